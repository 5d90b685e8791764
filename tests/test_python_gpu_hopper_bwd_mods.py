"""Score modifiers on the Hopper backward ("_mods" instances, sm_90a) through the Python API against mhakit.reference
(float64 NumPy on the rounded inputs, D from the library's O): logits soft-cap, ALiBi ([h] and [b, h] slopes),
elementwise bias (fp32 and the data type, broadcast over batch or heads) with dbias, attention sinks with d sink,
alone and combined, with every mask kind, GQA, group mode (empty sequences on either side), head dims 64 / 128 / 256
and (192, 128), deterministic mode. Every backward call asserts the instance it ran on ("[mhakit] mha_bwd -> <name>",
MHAKIT_LOG_LEVEL=1), so a call that fell back to the generic family fails here (dropout, which the Hopper "_mods"
instances serve too: test_python_gpu_dropout.py). Kernels are built on first use into MHAKIT_TEST_CACHE_DIR (bench/gpu_check.sh
prebuilds them with every core)."""
from __future__ import annotations

import zlib

import numpy as np
import pytest

import mhakit
from mhakit import _codegen, api, reference

from gpu_arrays import fill_value
from test_python_gpu_mods import check_grads, close, dev, host, make_mods, sequence_mods

pytestmark = [pytest.mark.gpu, pytest.mark.compile]

cp = pytest.importorskip("cupy")

from test_python_gpu import kernel_cache  # noqa: E402,F401  (autouse: MHAKIT_CACHE_DIR for the module)
from test_python_gpu_hopper_mods import hopper_only, launched_names, ran_on_hopper  # noqa: E402,F401  (hopper_only: autouse)


@pytest.fixture
def launched(monkeypatch, capfd):
    """launched() -> the instance names of the backward calls since the last call of it."""
    return launched_names(monkeypatch, capfd, "mha_bwd")


# The head dims whose Hopper backward tile gives unmasked modifier calls an unmasked "_mods" instance (catalogue
# unmasked_mods; d64 and d128 when this was written).
_BWD_HOPPER = _codegen.submodule("catalogue").load("cuda").families[("bwd", "hopper")]
UNMASKED_MODS = {(t.hdim_q, t.hdim_v) for t in _BWD_HOPPER.tiles if t.unmasked_mods}


def hopper_name(dtype, d, dv, mode, masked):
    """The Hopper "_mods" instance of a modifier call: an unmasked call's own unmasked one where the tile has one
    (UNMASKED_MODS), elsewhere the masked one."""
    tile = {(64, 64): "b64x128", (128, 128): "b64x128", (256, 256): "b64x64", (192, 128): "b64x64"}[(d, dv)]
    hd = f"d{d}" if d == dv else f"d{d}x{dv}"
    cls = "mask" if masked or (d, dv) not in UNMASKED_MODS else "nmask"
    return f"bwd_{hd}_{dtype}_{mode}_{cls}_mods_sm90a_hopper_{tile}"


def hopper_ran(names, dtype, d, dv, mode, kind, mask):
    masked = api._resolve_mask(False, mask, None)[0] != 0
    return ran_on_hopper(names, hopper_name(dtype, d, dv, mode, masked), "bwd", dtype, d, dv, mode, kind)


def mod_grads(d_kw, shape, dbias_pitch=None):
    """The dbias / dsink outputs a call with these modifiers asks for (dbias: the bias's dtype, every element; with
    dbias_pitch, the [..., :s_k] view of a buffer of rows that long)."""
    grads = {}
    if "bias" in d_kw:
        full = shape if dbias_pitch is None else (*shape[:-1], dbias_pitch)
        # 7, not zeros: every element must be written (7 as a value: bf16 arrays hold bits)
        dt = d_kw["bias"].dtype
        grads["dbias"] = cp.full(full, fill_value(7.0, dt), dtype=dt)[..., :shape[-1]]
    if "sink" in d_kw:
        grads["dsink"] = cp.full((shape[1],), 7, dtype=cp.float32)
    return grads


def pitched_bias(d_kw, pitch, offset=0):
    """d_kw with its 16-bit bias moved into the [..., offset:offset + s_k] view of a buffer of rows `pitch` elements
    long whose other elements are NaN: the bias rows' alignment set by the pitch and the offset, and any read outside
    [0, s_k) of a row poisons the result."""
    bias = d_kw["bias"]
    sk = bias.shape[-1]
    assert offset + sk <= pitch
    nan = np.array(np.nan, dtype=np.float16) if bias.dtype == cp.float16 else np.uint16(0x7FC0)  # bf16 bits
    buf = cp.full((*bias.shape[:-1], pitch), nan, dtype=bias.dtype)
    buf[..., offset:offset + sk] = bias
    return {**d_kw, "bias": buf[..., offset:offset + sk]}


def run_batch(kind, mask, dtype, d, dv, b, h, hk, sq, sk, launched, seed_text, deterministic=False, dbias_pitch=None,
              bias_pitch=None, bias_offset=0, dbias=True):
    rng = np.random.default_rng(zlib.crc32(seed_text.encode()))
    q, qf = dev(rng.uniform(-1, 1, (b, h, sq, d)).astype(np.float32), dtype)
    k, kf = dev(rng.uniform(-1, 1, (b, hk, sk, d)).astype(np.float32), dtype)
    v, vf = dev(rng.uniform(-1, 1, (b, hk, sk, dv)).astype(np.float32), dtype)
    do, dof = dev(rng.uniform(-1, 1, (b, h, sq, dv)).astype(np.float32), dtype)
    d_kw, r_kw = make_mods(rng, kind, b, h, sq, sk, dtype)
    if bias_pitch is not None:
        d_kw = pitched_bias(d_kw, bias_pitch, bias_offset)
    mask_kw = {} if mask is None else {"mask": mask}
    mt, wl, wr = api._resolve_mask(False, mask, None)
    o, lse = mhakit.mha_fwd(q, k, v, layout="bhsd", return_lse=True, dtype=dtype, **mask_kw, **d_kw)
    grads = mod_grads(d_kw, (b, h, sq, sk), dbias_pitch)
    if not dbias:
        grads.pop("dbias", None)
    launched()
    dq, dk, dv_ = mhakit.mha_bwd(do, q, k, v, o, lse, layout="bhsd", dtype=dtype, deterministic=deterministic,
                                 **mask_kw, **d_kw, **grads)
    ran = launched()
    assert hopper_ran(ran, dtype, d, dv, "batch", kind, mask), ran
    ref = reference.attention_bwd(qf, kf, vf, dof, mask_type=mt, window_left=wl, window_right=wr,
                                  o=host(o, dtype), return_mod_grads=True, **r_kw)
    check_grads(dq, dk, dv_, grads, ref, dtype, reference.tolerances_bwd(dtype, d, dv))
    return (dq, dk, dv_, grads)


KINDS = ["cap", "alibi", "alibi_bh", "bias32", "bias16", "bias16_b", "sink", "cap+alibi_bh+sink", "cap+bias16+sink",
         "cap+bias32"]
MASKS = [None, "t", "b", "t:40,17", "b:64,0", "g:90,33"]


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("kind", KINDS)
def test_each_modifier_with_every_mask_d128(kind, mask, launched):
    """GQA 4/2, lengths that leave partial query and key tiles (200 x 333)."""
    run_batch(kind, mask, "bf16", 128, 128, 2, 4, 2, 200, 333, launched, f"bwd/{kind}/{mask}")


@pytest.mark.parametrize("d, dv", [(64, 64), (256, 256), (192, 128)])
@pytest.mark.parametrize("kind, mask", [("cap+alibi_bh+sink", "b"), ("bias32+sink", None), ("bias16_b", "t:33,70"),
                                        ("cap", "g:100,20")])
def test_head_dims(d, dv, kind, mask, launched):
    run_batch(kind, mask, "bf16", d, dv, 2, 4, 1, 150, 260, launched, f"bwd/{kind}/{mask}/{d}/{dv}")


@pytest.mark.parametrize("d, dv", [(128, 128), (64, 64), (256, 256), (192, 128)])
@pytest.mark.parametrize("kind, mask", [("bias16", None), ("bias16_b", "b"), ("cap+bias16+sink", "t:40,17"),
                                        ("bias16", "g:90,33")])
def test_staged_bias(d, dv, kind, mask, launched):
    """A 16-bit bias whose rows are 16-byte aligned (s_k = 264) comes through the bias warp's shared-memory ring
    (hopper_bias_stage.hpp) where the instance has one (d64 / d128 / (192, 128); d256: global loads), with dbias:
    partial query tiles and a last key block of 8 keys, GQA 4/2."""
    run_batch(kind, mask, "bf16", d, dv, 2, 4, 2, 150, 264, launched, f"bwd/staged/{kind}/{mask}/{d}/{dv}")


@pytest.mark.parametrize("sq, sk, pitch", [(150, 165, 168), (200, 166, 166), (64, 512, 520), (129, 200, 203)])
@pytest.mark.parametrize("mask", [None, "t", "b:64,0", "t:40,17"])
def test_dbias_rows(sq, sk, pitch, mask, launched):
    """dbias into a view of wider rows: an even pitch gives 4-byte aligned rows, written two keys at a time
    (store_dbias_pairs_t, hopper_score_mod.hpp; with an odd s_k the last key alone), an odd one a store per element;
    the preprocess zeroes only the tiles no key block visits (causal, window). Every element inside the view is
    written (the buffer starts at 7: check_grads), none past s_k."""
    _, _, _, grads = run_batch("bias16", mask, "bf16", 128, 128, 2, 4, 2, sq, sk, launched,
                               f"bwd/dbias/{sq}/{sk}/{mask}", dbias_pitch=pitch)
    seven = fill_value(7.0, grads["dbias"].dtype)
    pad = cp.asnumpy(grads["dbias"].base[..., sk:]) if pitch > sk else np.full(1, seven)
    assert (pad == seven).all(), "dbias written past s_k"


# Unstaged 16-bit biases (rows not 16-byte aligned: the generic kernel reads them from global memory, load_bias16_t
# in hopper_score_mod.hpp): (kind, s_k, row pitch, first element's offset), pitch and offset in elements. A contiguous
# odd s_k (2-byte aligned rows every other row), an even one (4-byte aligned rows), an odd pitch under an even s_k,
# and every row 2-byte aligned (an odd offset under an even pitch); [b, h, ...] and the [1, 1, ...] broadcast
# (benchmark_mha_bwd's -bias=e:2 and -bias=e).
UNSTAGED = [("bias16_1", 333, 333, 0), ("bias16", 330, 330, 0), ("bias16_1", 330, 337, 0), ("bias16", 330, 332, 1)]


@pytest.mark.parametrize("mask", [None, "t", "b:64,0", "t:40,17", "g:90,33"])
@pytest.mark.parametrize("kind, sk, pitch, offset", UNSTAGED)
def test_unstaged_bias(kind, sk, pitch, offset, mask, launched):
    """GQA 4/2, 200 queries (a partial query tile), with dbias; the padding around each row is NaN (pitched_bias), so a
    read past s_k or before the row fails the call."""
    run_batch(kind, mask, "bf16", 128, 128, 2, 4, 2, 200, sk, launched, f"bwd/unstaged/{kind}/{sk}/{pitch}/{mask}",
              bias_pitch=pitch, bias_offset=offset)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("kind, mask, dbias", [("bias16_1", "b", False), ("cap+bias16_1", None, True),
                                               ("cap+bias16+sink", "t:40,17", False), ("bias16", "t", True)])
@pytest.mark.parametrize("d, dv", [(128, 128), (64, 64), (256, 256)])
def test_unstaged_bias_combined(d, dv, kind, mask, dbias, dtype, launched):
    """With and without dbias, with a soft-cap, fp16 and bf16, head dims 64 / 128 / 256 (d256: no bias ring, every
    bias unstaged); s_k = 261 (odd rows), s_q = 131."""
    run_batch(kind, mask, dtype, d, dv, 2, 4, 2, 131, 261, launched, f"bwd/unstaged_c/{kind}/{mask}/{d}/{dtype}",
              dbias=dbias)


@pytest.mark.parametrize("d, dv", [(128, 128), (64, 64)])
@pytest.mark.parametrize("mask", [None, "b", "t:30,5"])
@pytest.mark.parametrize("kind", ["bias16", "cap+bias16+sink", "bias16_b"])
def test_group_mode_unstaged_odd_rows(kind, mask, d, dv, launched):
    """Group mode with an odd longest key length (301: 602-byte rows, every other row 2-byte aligned): every tile's bias
    from global memory, per sequence ([i, :, :s_q_i, :s_k_i]), with dbias."""
    run_group(kind, mask, d, dv, [37, 0, 190, 20, 5], [51, 20, 161, 0, 301], launched,
              f"bwd/group_odd/{kind}/{mask}/{d}")


@pytest.mark.parametrize("kind", ["cap+alibi+sink", "bias16"])
def test_fp16(kind, launched):
    run_batch(kind, "b", "fp16", 128, 128, 1, 2, 2, 129, 257, launched, f"bwd/fp16/{kind}")


@pytest.mark.parametrize("kind", ["cap+bias16+sink", "alibi_bh+sink"])
def test_deterministic_mode_repeats_bit_for_bit(kind, launched):
    """Deterministic mode keeps working with the modifiers: the same call twice gives identical dQ, dK, dV, dbias and
    d sink."""
    assert_repeats_bit_for_bit(kind, 4, 2, 300, 400, launched, f"det/{kind}")


def assert_repeats_bit_for_bit(kind, h, hk, sq, sk, launched, seed_text):
    """The same deterministic call (bf16, d128, b = 1, bottom-right causal) twice: identical dQ, dK, dV and modifier
    gradients."""
    first = run_batch(kind, "b", "bf16", 128, 128, 1, h, hk, sq, sk, launched, seed_text, deterministic=True)
    second = run_batch(kind, "b", "bf16", 128, 128, 1, h, hk, sq, sk, launched, seed_text, deterministic=True)
    for a, b in zip(first[:3], second[:3]):
        assert np.array_equal(host(a, "bf16"), host(b, "bf16"))
    for name in first[3]:
        assert np.array_equal(cp.asnumpy(first[3][name]), cp.asnumpy(second[3][name])), name


@pytest.mark.parametrize("d, dv", [(128, 128), (64, 64), (256, 256)])
@pytest.mark.parametrize("kind, mask", [("bias16", "t"), ("bias32+sink", "b:64,0"), ("cap+alibi_bh+sink", None),
                                        ("cap+bias16+sink", "g:90,33"), ("alibi", "b")])
def test_gqa_split(kind, mask, d, dv, launched):
    """MQA 8/1 at b = 1: the unsplit grid (three key blocks) leaves SMs idle, so the call runs split (bwd_gqa_split.h:
    several CTAs share the kv group, dK / dV from fp32 partial sums), on the generic "_mods" kernel's split twin
    whatever its variant: dbias per query head (each written by its split's CTA), d sink, the soft-cap's derivative,
    ALiBi per query head (each CTA's first head is not the group's)."""
    run_batch(kind, mask, "bf16", d, dv, 1, 8, 1, 300, 333, launched, f"bwd/split/{kind}/{mask}/{d}")


@pytest.mark.parametrize("kind", ["cap+bias16+sink", "bias32"])
def test_gqa_split_deterministic(kind, launched):
    """The split with dbias in deterministic mode: dQ's turns per query head, dK / dV's slots added in a fixed order,
    so the same call twice gives identical dQ, dK, dV, dbias and d sink."""
    assert_repeats_bit_for_bit(kind, 8, 1, 700, 900, launched, f"split/det/{kind}")


@pytest.mark.parametrize("kind", ["sink", "cap+sink", "bias32+sink"])
def test_rows_that_see_no_key(kind, launched):
    """Bottom-right causal with s_q > s_k: the first s_q - s_k rows see no key; their dQ is 0 and their d sink share
    exp(sink - LSE)·D = D still counts."""
    run_batch(kind, "b", "bf16", 128, 128, 1, 4, 4, 200, 70, launched, f"bwd/empty/{kind}")


@pytest.mark.parametrize("d, dv", [(128, 128), (64, 64)])
@pytest.mark.parametrize("mask", [None, "b", "t:30,5"])
@pytest.mark.parametrize("kind", ["cap", "alibi_bh", "bias32", "bias16", "sink", "cap+bias16+sink"])
def test_group_mode(kind, mask, d, dv, launched):
    """Varlen with empty sequences on either side and sequences longer than one key block: per-sequence positions
    (ALiBi bottom-right per sequence, bias and dbias blocks [i, :, :s_q_i, :s_k_i]), d sink summed over sequences."""
    run_group(kind, mask, d, dv, [37, 0, 190, 20, 5], [50, 20, 161, 0, 300], launched, f"bwd/group/{kind}/{mask}/{d}")


@pytest.mark.parametrize("d, dv", [(128, 128), (64, 64)])
@pytest.mark.parametrize("mask", [None, "b", "t:30,5"])
@pytest.mark.parametrize("kind", ["bias16", "cap+bias16+sink"])
def test_group_mode_staged_bias(kind, mask, d, dv, launched):
    """Group mode with a stageable 16-bit bias (the longest key length 304: 608-byte rows, 16-byte aligned): the
    bias warp's TMA map serves every sequence, the slots inside a sequence (190 x 264: rows 0 .. 127, keys 0 .. 255)
    from the ring, those reaching past it (its last row block or key tile, BiasStage::staged_slot) from global
    memory; several query tiles per key block, so the two-stage ring wraps."""
    run_group(kind, mask, d, dv, [37, 0, 190, 130, 5], [50, 20, 264, 0, 304], launched,
              f"bwd/group_staged/{kind}/{mask}/{d}")


def run_group(kind, mask, d, dv, lq, lk, launched, seed):
    dtype = "bf16"
    rng = np.random.default_rng(zlib.crc32(seed.encode()))
    b, h, hk = len(lq), 4, 2
    cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    mq, mk = max(lq), max(lk)
    q, qf = dev(rng.uniform(-1, 1, (cq[-1], h, d)).astype(np.float32), dtype)
    k, kf = dev(rng.uniform(-1, 1, (ck[-1], hk, d)).astype(np.float32), dtype)
    v, vf = dev(rng.uniform(-1, 1, (ck[-1], hk, dv)).astype(np.float32), dtype)
    do, dof = dev(rng.uniform(-1, 1, (cq[-1], h, dv)).astype(np.float32), dtype)
    d_kw, r_kw = make_mods(rng, kind, b, h, mq, mk, dtype)
    mask_kw = {} if mask is None else {"mask": mask}
    mt, wl, wr = api._resolve_mask(False, mask, None)
    o, lse = mhakit.mha_varlen_fwd(q, k, v, cp.asarray(cq), cp.asarray(ck), mq, mk, return_lse=True, dtype=dtype,
                                   **mask_kw, **d_kw)
    grads = mod_grads(d_kw, (b, h, mq, mk))
    launched()
    dq, dk, dv_ = mhakit.mha_varlen_bwd(do, q, k, v, o, lse, cp.asarray(cq), cp.asarray(ck), mq, mk, dtype=dtype,
                                        **mask_kw, **d_kw, **grads)
    ran = launched()
    assert hopper_ran(ran, dtype, d, dv, "group", kind, mask), ran
    oh = host(o, dtype)
    dqh, dkh, dvh = host(dq, dtype), host(dk, dtype), host(dv_, dtype)
    dsink_ref = np.zeros(h)
    tol = reference.tolerances_bwd(dtype, d, dv)
    bhsd = lambda x: x[None].transpose(0, 2, 1, 3)  # noqa: E731
    for i in range(b):
        q0, q1, k0, k1 = cq[i], cq[i + 1], ck[i], ck[i + 1]
        if q1 == q0 and k1 == k0:
            continue
        one = sequence_mods(r_kw, i, q1 - q0, k1 - k0)
        if q1 == q0:  # queries none: dK = dV = 0
            assert not np.any(dkh[k0:k1]) and not np.any(dvh[k0:k1]), f"dK/dV of sequence {i}"
            continue
        r = reference.attention_bwd(bhsd(qf[q0:q1]), bhsd(kf[k0:k1]), bhsd(vf[k0:k1]), bhsd(dof[q0:q1]),
                                    mask_type=mt, window_left=wl, window_right=wr, o=bhsd(oh[q0:q1]),
                                    return_mod_grads=True, **one)
        close(dqh[q0:q1], r[0][0].transpose(1, 0, 2), tol, f"dQ of sequence {i}")
        close(dkh[k0:k1], r[1][0].transpose(1, 0, 2), tol, f"dK of sequence {i}")
        close(dvh[k0:k1], r[2][0].transpose(1, 0, 2), tol, f"dV of sequence {i}")
        if "dbias" in grads:
            close(host(grads["dbias"][i, :, :q1 - q0, :k1 - k0], dtype), r[3][0], tol, f"dbias of sequence {i}")
        if r[4] is not None:
            dsink_ref += r[4]
    if "dsink" in grads:
        close(cp.asnumpy(grads["dsink"]), dsink_ref, tol, "dsink")


def test_dropout_runs_on_hopper(launched):
    """Dropout is a Hopper modifier (catalogue score_mods): a soft-capped backward with dropout runs on the Hopper
    "_mods" instance, as the same call without dropout."""
    rng = np.random.default_rng(5)
    q, _ = dev(rng.uniform(-1, 1, (1, 2, 64, 128)).astype(np.float32), "bf16")
    o, lse = mhakit.mha_fwd(q, q, q, layout="bhsd", return_lse=True, dtype="bf16", softcap=20.0, dropout_p=0.1,
                            seed=1, offset=2)
    mhakit.mha_bwd(q, q, q, q, o, lse, layout="bhsd", dtype="bf16", softcap=20.0, dropout_p=0.1, seed=1, offset=2)
    o, lse = mhakit.mha_fwd(q, q, q, layout="bhsd", return_lse=True, dtype="bf16", softcap=20.0)
    mhakit.mha_bwd(q, q, q, q, o, lse, layout="bhsd", dtype="bf16", softcap=20.0)
    assert launched() == [hopper_name("bf16", 128, 128, "batch", masked=False)] * 2
