"""Score modifiers on the Hopper forward ("_mods" instances, sm_90a) through the Python API against mhakit.reference
(float64 NumPy on the rounded inputs): logits soft-cap, ALiBi ([h] and [b, h] slopes), elementwise bias (fp32 and the
data type, broadcast over batch or heads), attention sinks, alone and combined, with every mask kind, GQA, group mode
(empty sequences on either side), rows that see no key (O = 0, LSE = sink), head dims 64 / 128 / 256 and (192, 128).
Every call asserts the instance it ran on ("[mhakit] mha_fwd -> <name>", MHAKIT_LOG_LEVEL=1), so a call that fell
back to the generic family fails here (dropout, which the Hopper "_mods" instances serve too, is tested in
test_python_gpu_dropout.py).
Kernels are built on first use into MHAKIT_TEST_CACHE_DIR (bench/gpu_check.sh prebuilds them with every core)."""
from __future__ import annotations

import zlib

import numpy as np
import pytest

import mhakit
from mhakit import api, reference

from test_python_gpu_mods import close, dev, host, make_mods, sequence_mods

pytestmark = [pytest.mark.gpu, pytest.mark.compile]

cp = pytest.importorskip("cupy")

from test_python_gpu import kernel_cache  # noqa: E402,F401  (autouse: MHAKIT_CACHE_DIR for the module)


@pytest.fixture(autouse=True)
def hopper_only():
    from mhakit import jit
    if jit.device_arch(0) != "sm_90a":
        pytest.skip("the hopper family exists on sm_90a only")


def launched_names(monkeypatch, capfd, which: str):
    """A function that returns the instance names of the `which` calls ("mha_fwd", "mha_bwd") since its last call."""
    monkeypatch.setattr(api, "LOG_LEVEL", 1)

    def names():
        cp.cuda.runtime.deviceSynchronize()
        return [line.split("-> ")[1].strip() for line in capfd.readouterr().out.splitlines() if f"{which} ->" in line]
    return names


@pytest.fixture
def launched(monkeypatch, capfd):
    """launched() -> the instance names of the forward calls since the last call of it."""
    return launched_names(monkeypatch, capfd, "mha_fwd")


def hopper_name(dtype, d, dv, mode):
    tile = {(64, 64): "b192x128", (128, 128): "b128x128", (256, 256): "b128x64", (192, 128): "b128x96"}[(d, dv)]
    hd = f"d{d}" if d == dv else f"d{d}x{dv}"
    return f"fwd_{hd}_{dtype}_{mode}_mask_mods_sm90a_hopper_{tile}"


def ran_on_hopper(names, expected_mods, api_name, dtype, d, dv, mode, kind):
    """The calls ran on the Hopper "_mods" instance `expected_mods`, or, for a sink alone (no per-score modifier: the
    catalogue's score_mods.plain), on a plain Hopper instance of the same API, bucket, dtype and mode (its tile is
    the plain call's: the catalogue's choice by mask and length). Shared with the backward's tests."""
    if not names:
        return False
    if kind != "sink":
        return names == [expected_mods] * len(names)
    hd = f"d{d}" if d == dv else f"d{d}x{dv}"
    return all(n.startswith(f"{api_name}_{hd}_{dtype}_{mode}_") and "_sm90a_hopper_" in n and "_mods_" not in n
               for n in names)


def hopper_ran(names, dtype, d, dv, mode, kind):
    return ran_on_hopper(names, hopper_name(dtype, d, dv, mode), "fwd", dtype, d, dv, mode, kind)


def run_batch(kind, mask, dtype, d, dv, b, h, hk, sq, sk, launched, seed_text):
    rng = np.random.default_rng(zlib.crc32(seed_text.encode()))
    qkv = [dev(rng.uniform(-1, 1, shape).astype(np.float32), dtype)
           for shape in ((b, h, sq, d), (b, hk, sk, d), (b, hk, sk, dv))]
    d_kw, r_kw = make_mods(rng, kind, b, h, sq, sk, dtype)
    return check_batch(qkv, d_kw, r_kw, kind, mask, dtype, launched)


def check_batch(qkv, d_kw, r_kw, kind, mask, dtype, launched):
    """One batch-mode forward call on qkv ((device array, rounded values) of q, k, v, b·h·s·d) with the modifiers
    d_kw: it ran on the Hopper instance for `kind`, and O and LSE match the reference's with r_kw."""
    (q, qf), (k, kf), (v, vf) = qkv
    d, dv = q.shape[3], v.shape[3]
    mask_kw = {} if mask is None else {"mask": mask}
    mt, wl, wr = api._resolve_mask(False, mask, None)
    o, lse = mhakit.mha_fwd(q, k, v, layout="bhsd", return_lse=True, dtype=dtype, **mask_kw, **d_kw)
    ran = launched()
    assert hopper_ran(ran, dtype, d, dv, "batch", kind), ran
    o_ref, lse_ref = reference.attention_fwd(qf, kf, vf, mask_type=mt, window_left=wl, window_right=wr,
                                             return_lse=True, **r_kw)
    close(host(o, dtype), o_ref, reference.tolerances(dtype), "O")
    close(cp.asnumpy(lse), lse_ref, reference.tolerances(dtype), "LSE")
    return o_ref, lse_ref, r_kw


KINDS = ["cap", "alibi", "alibi_bh", "bias32", "bias16", "bias16_b", "sink", "cap+alibi_bh+sink", "cap+bias16+sink"]
MASKS = [None, "t", "b", "t:40,17", "b:64,0", "g:90,33"]


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("kind", KINDS)
def test_each_modifier_with_every_mask_d128(kind, mask, launched):
    """GQA 4/2, lengths that leave partial query and key tiles (200 x 333)."""
    run_batch(kind, mask, "bf16", 128, 128, 2, 4, 2, 200, 333, launched, f"{kind}/{mask}")


@pytest.mark.parametrize("d, dv", [(64, 64), (256, 256), (192, 128)])
@pytest.mark.parametrize("kind, mask", [("cap+alibi_bh+sink", "b"), ("bias32+sink", None), ("bias16_b", "t:33,70"),
                                        ("cap", "g:100,20")])
def test_head_dims(d, dv, kind, mask, launched):
    run_batch(kind, mask, "bf16", d, dv, 2, 4, 1, 150, 260, launched, f"{kind}/{mask}/{d}/{dv}")


@pytest.mark.parametrize("cap", [2.5, 40.0, 41.0])
@pytest.mark.parametrize("mask", [None, "b", "t:40,17", "g:90,33"])
@pytest.mark.parametrize("extremes", [False, True])
def test_softcap_fixed_reference_d256(cap, mask, extremes, launched):
    """d256's tile runs a soft-cap alone (cap <= 40) against a fixed reference maximum (kFixedRef): every score is at
    most the cap. Caps of 2.5 and 40 take it, 41 the running maximum. extremes: queries and keys of opposite signs
    and large norms, so every visible logit sits at -cap (exp2(-2·cap·log2 e) against the reference, 2^-115 at cap
    40), so that each row's largest logit lies far below the cap; a sink joins the calls of two of the mask kinds.
    (Rows that see no key on this path: benchmark_mha_fwd's host-validated d256 windowed case in docs/PERFORMANCE.md.)"""
    rng = np.random.default_rng(zlib.crc32(f"fixed/{cap}/{mask}/{extremes}".encode()))
    b, h, hk, sq, sk, d = 2, 4, 2, 150, 260, 256
    if extremes:
        qv = -rng.uniform(0.5, 1.0, (b, h, sq, d)) * 4
        kv = rng.uniform(0.5, 1.0, (b, hk, sk, d)) * 4
    else:
        qv = rng.uniform(-1, 1, (b, h, sq, d)) * 3
        kv = rng.uniform(-1, 1, (b, hk, sk, d))
    vv = rng.uniform(-1, 1, (b, hk, sk, d))
    qkv = [dev(x.astype(np.float32), "bf16") for x in (qv, kv, vv)]
    d_kw, r_kw = {"softcap": cap}, {"softcap": cap}
    if mask in ("b", "g:90,33"):
        sink = rng.uniform(-1, 2, (h,)).astype(np.float32)
        d_kw["sink"], r_kw["sink"] = cp.asarray(sink), sink
    check_batch(qkv, d_kw, r_kw, "cap", mask, "bf16", launched)


@pytest.mark.parametrize("d, dv", [(128, 128), (64, 64), (256, 256), (192, 128)])
@pytest.mark.parametrize("kind, mask", [("bias16", None), ("bias16_b", "b"), ("cap+bias16+sink", "t:40,17"),
                                        ("bias16", "g:90,33")])
def test_staged_bias(d, dv, kind, mask, launched):
    """A 16-bit bias whose rows are 16-byte aligned (s_k = 264: 528-byte rows) comes through the bias warp's
    shared-memory ring where the instance has one (d128, d256; the others, and the other tests' s_k = 333 / 260 / 257, read
    it from global memory): partial query and key tiles (the last key tile of every width holds 8 or 72 keys), GQA
    4/2."""
    run_batch(kind, mask, "bf16", d, dv, 2, 4, 2, 150, 264, launched, f"staged/{kind}/{mask}/{d}/{dv}")


@pytest.mark.parametrize("kind", ["cap+alibi+sink", "bias16"])
def test_fp16(kind, launched):
    run_batch(kind, "b", "fp16", 128, 128, 1, 2, 2, 129, 257, launched, f"fp16/{kind}")


@pytest.mark.parametrize("kind", ["sink", "cap+sink", "bias32+sink"])
def test_rows_that_see_no_key_get_the_sink(kind, launched):
    """Bottom-right causal with s_q > s_k: the first s_q - s_k rows see no key: O = 0 and LSE = the sink."""
    sq, sk = 200, 70
    o_ref, lse_ref, r_kw = run_batch(kind, "b", "bf16", 128, 128, 1, 4, 4, sq, sk, launched, f"empty/{kind}")
    assert np.all(o_ref[:, :, : sq - sk] == 0)
    assert np.allclose(lse_ref[0, :, : sq - sk], r_kw["sink"][:, None])


@pytest.mark.parametrize("d, dv", [(128, 128), (64, 64)])
@pytest.mark.parametrize("mask", [None, "b", "t:30,5"])
@pytest.mark.parametrize("kind, staged", [(k, False) for k in ["cap", "alibi_bh", "bias32", "bias16", "sink",
                                                                "cap+bias16+sink"]] +
                         [("bias16", True), ("cap+bias16+sink", True)])
def test_group_mode(kind, mask, d, dv, staged, launched):
    """Varlen with empty sequences on either side and a sequence longer than one query block: per-sequence positions
    (ALiBi bottom-right per sequence, bias block [i, :, :s_q_i, :s_k_i]), LSE = sink where a sequence has no key."""
    # staged: max s_k 296 makes the bias rows 16-byte aligned (the shared-memory ring), 300 does not (global loads)
    lq, lk = [37, 0, 190, 20, 5], [50, 20, 161, 0, 296 if staged else 300]
    run_group(kind, mask, d, dv, lq, lk, f"group/{kind}/{mask}/{d}" + ("/staged" if staged else ""), launched)


@pytest.mark.parametrize("mask", [None, "b", "t:100,30"])
@pytest.mark.parametrize("kind", ["bias16", "bias16_b", "bias16_1", "cap+bias16+sink"])
def test_group_mode_staged_slots(kind, mask, launched):
    """d128's TMA-loaded bias ring in group mode (hopper_bias_stage.hpp, staged_slot): sequences of several query
    blocks and key tiles (max s_k 1000: 2000-byte rows), so that a CTA's slots inside its sequence come by TMA and
    those reaching past it (a sequence's last row block, its last key tile) from global memory, next to empty
    sequences and one of a single row."""
    lq, lk = [300, 0, 129, 64, 700, 1], [520, 64, 0, 1000, 264, 77]
    run_group(kind, mask, 128, 128, lq, lk, f"group_slots/{kind}/{mask}", launched)


@pytest.mark.parametrize("kind, mask", [("bias16", None), ("bias16_1", "b"), ("bias16_b", "t:200,50"),
                                        ("cap+bias16+sink", "g:300,100")])
def test_staged_bias_many_tiles(kind, mask, launched):
    """d128's TMA-loaded bias ring in batch mode over many key tiles with partial last tiles in both directions
    (s_q 520, s_k 1000: the map's extents, zero-filled past them), bias broadcast over nothing, batch, or both."""
    run_batch(kind, mask, "bf16", 128, 128, 2, 4, 2, 520, 1000, launched, f"many/{kind}/{mask}")


def run_group(kind, mask, d, dv, lq, lk, seed_text, launched):
    dtype = "bf16"
    rng = np.random.default_rng(zlib.crc32(seed_text.encode()))
    b, h, hk = len(lq), 4, 2
    cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    mq, mk = max(lq), max(lk)
    q, qf = dev(rng.uniform(-1, 1, (cq[-1], h, d)).astype(np.float32), dtype)
    k, kf = dev(rng.uniform(-1, 1, (ck[-1], hk, d)).astype(np.float32), dtype)
    v, vf = dev(rng.uniform(-1, 1, (ck[-1], hk, dv)).astype(np.float32), dtype)
    d_kw, r_kw = make_mods(rng, kind, b, h, mq, mk, dtype)
    mask_kw = {} if mask is None else {"mask": mask}
    mt, wl, wr = api._resolve_mask(False, mask, None)
    o, lse = mhakit.mha_varlen_fwd(q, k, v, cp.asarray(cq), cp.asarray(ck), mq, mk, return_lse=True, dtype=dtype,
                                   **mask_kw, **d_kw)
    ran = launched()
    assert hopper_ran(ran, dtype, d, dv, "group", kind), ran
    oh, lh = host(o, dtype), cp.asnumpy(lse)
    tol = reference.tolerances(dtype)
    bhsd = lambda x: x[None].transpose(0, 2, 1, 3)  # noqa: E731
    for i in range(b):
        q0, q1, k0, k1 = cq[i], cq[i + 1], ck[i], ck[i + 1]
        if q1 == q0:
            continue
        one = sequence_mods(r_kw, i, q1 - q0, k1 - k0)
        o_ref, lse_ref = reference.attention_fwd(bhsd(qf[q0:q1]), bhsd(kf[k0:k1]), bhsd(vf[k0:k1]), mask_type=mt,
                                                 window_left=wl, window_right=wr, return_lse=True, **one)
        close(oh[q0:q1], o_ref[0].transpose(1, 0, 2), tol, f"O of sequence {i}")
        close(lh[:, q0:q1], lse_ref[0], tol, f"LSE of sequence {i}")


def test_dropout_runs_on_hopper(launched):
    """Dropout is a Hopper modifier (catalogue score_mods): a soft-capped call with dropout runs on the Hopper
    "_mods" instance, as the same call without dropout; a head dim Hopper does not take on generic's."""
    rng = np.random.default_rng(3)
    q, _ = dev(rng.uniform(-1, 1, (1, 2, 64, 128)).astype(np.float32), "bf16")
    mhakit.mha_fwd(q, q, q, layout="bhsd", dtype="bf16", softcap=20.0, dropout_p=0.1, seed=1, offset=2)
    mhakit.mha_fwd(q, q, q, layout="bhsd", dtype="bf16", softcap=20.0)
    q100, _ = dev(rng.uniform(-1, 1, (1, 2, 64, 100)).astype(np.float32), "bf16")  # 100: not a multiple of 8
    mhakit.mha_fwd(q100, q100, q100, layout="bhsd", dtype="bf16", dropout_p=0.1, seed=1)
    assert launched() == [hopper_name("bf16", 128, 128, "batch"), hopper_name("bf16", 128, 128, "batch"),
                          "fwd_d128_bf16_batch_mask_mods_sm90a_generic_b128x64w4"]
