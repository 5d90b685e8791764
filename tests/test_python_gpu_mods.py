"""Score modifiers through the Python API on the GPU against mhakit.reference (on the family the runtime picks: the
Hopper "_mods" instances for aligned head dims that are multiples of 8 on sm_90a, generic otherwise): logits soft-cap,
ALiBi slopes ([h] and [b, h]), elementwise bias (fp32 or the data type, broadcast over batch or heads), attention
sinks, each alone and combined, with masks, GQA, group mode and odd head dims; forward (O, LSE) and backward (dQ,
dK, dV, dbias, dsink). Inputs uniform in [-1, 1) rounded to fp16/bf16; the backward's O and LSE come from the
library's forward, and the reference's D uses that O. Kernels are built on first use into MHAKIT_TEST_CACHE_DIR."""
from __future__ import annotations

import zlib

import numpy as np
import pytest

import mhakit
from gpu_arrays import fill_value, from_bits, to_bits
from mhakit import reference

pytestmark = [pytest.mark.gpu, pytest.mark.compile]

cp = pytest.importorskip("cupy")


from test_python_gpu import kernel_cache  # noqa: E402,F401  (autouse: MHAKIT_CACHE_DIR for the module)


def dev(values: np.ndarray, dtype: str):
    """(device array of fp16 / bf16 bits, the rounded values as float32)."""
    bits, rounded = to_bits(values, dtype)
    return cp.asarray(bits.view(np.float16) if dtype == "fp16" else bits), rounded


def host(x, dtype: str) -> np.ndarray:
    a = x.numpy() if isinstance(x, mhakit.DeviceArray) else cp.asnumpy(x)
    if a.dtype in (np.float16, np.uint16):
        return from_bits(np.ascontiguousarray(a).view(np.uint16), dtype)
    return a.astype(np.float32)


def close(out, ref, tol, what):
    res = reference.check_close(out, ref, *tol)
    assert res.ok, f"{what}: {res}"


def check_grads(dq, dk, dv, grads, ref, dtype: str, tol):
    """dQ, dK, dV and the modifier gradients a call asked for (grads: "dbias" / "dsink") against
    reference.attention_bwd(..., return_mod_grads=True)'s (dq, dk, dv, dbias, dsink)."""
    for name, out, r in (("dQ", dq, ref[0]), ("dK", dk, ref[1]), ("dV", dv, ref[2])):
        close(host(out, dtype), r, tol, name)
    if "dbias" in grads:
        close(host(grads["dbias"], dtype), ref[3], tol, "dbias")
    if "dsink" in grads:
        close(cp.asnumpy(grads["dsink"]), ref[4], tol, "dsink")


def make_mods(rng, kind: str, b: int, h: int, sq: int, sk: int, dtype: str):
    """(device kwargs, reference kwargs) for one modifier set; kind is '+'-joined: cap, alibi ([h]), alibi_bh
    ([b, h]), bias32 ([1, h, sq, sk] fp32), bias16 ([b, h, sq, sk] of the data type), bias16_b ([b, 1, sq, sk]),
    bias16_1 ([1, 1, sq, sk]), sink."""
    d_kw, r_kw = {}, {}
    for part in kind.split("+"):
        if part == "cap":
            d_kw["softcap"] = r_kw["softcap"] = 2.5
        elif part in ("alibi", "alibi_bh"):
            slopes = rng.uniform(0.05, 0.5, (h,) if part == "alibi" else (b, h)).astype(np.float32)
            d_kw["alibi_slopes"], r_kw["alibi_slopes"] = cp.asarray(slopes), slopes
        elif part == "bias32":
            bias = rng.uniform(-2, 2, (1, h, sq, sk)).astype(np.float32)
            d_kw["bias"], r_kw["bias"] = cp.asarray(bias), bias
        elif part in ("bias16", "bias16_b", "bias16_1"):
            shape = {"bias16": (b, h, sq, sk), "bias16_b": (b, 1, sq, sk), "bias16_1": (1, 1, sq, sk)}[part]
            d_kw["bias"], r_kw["bias"] = dev(rng.uniform(-2, 2, shape).astype(np.float32), dtype)
        elif part == "sink":
            sink = rng.uniform(-1, 2, (h,)).astype(np.float32)
            d_kw["sink"], r_kw["sink"] = cp.asarray(sink), sink
        else:
            raise ValueError(part)
    return d_kw, r_kw


def sequence_mods(r_kw: dict, i: int, len_q: int, len_k: int) -> dict:
    """The reference kwargs of sequence i of a varlen call (group mode) from the whole call's: its ALiBi slopes
    ([b, h]: row i), its bias block ([b|1, h|1, :len_q, :len_k]), the rest as they are."""
    one = dict(r_kw)
    if "alibi_slopes" in r_kw and r_kw["alibi_slopes"].ndim == 2:
        one["alibi_slopes"] = r_kw["alibi_slopes"][i:i + 1]
    if "bias" in r_kw:
        bias = r_kw["bias"]
        one["bias"] = (bias[i:i + 1] if bias.shape[0] > 1 else bias)[:, :, :len_q, :len_k]
    return one


MASKS = {"none": (dict(), (0, -1, -1)), "causal": (dict(causal=True), (2, -1, 0)),
         "window": (dict(mask="t:8,4"), (1, 8, 4))}
KINDS = ["cap", "alibi", "alibi_bh", "bias32", "bias16_b", "sink", "cap+bias32+sink", "cap+alibi+sink"]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("d", [59, 128])
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("kind", KINDS)
def test_forward_and_backward_batch(kind, mask, d, dtype):
    rng = np.random.default_rng(zlib.crc32(f"{kind}/{mask}/{d}/{dtype}".encode()))
    b, h, hk, sq, sk = 2, 4, 2, 70, 93
    q, qf = dev(rng.uniform(-1, 1, (b, h, sq, d)).astype(np.float32), dtype)
    k, kf = dev(rng.uniform(-1, 1, (b, hk, sk, d)).astype(np.float32), dtype)
    v, vf = dev(rng.uniform(-1, 1, (b, hk, sk, d)).astype(np.float32), dtype)
    do, dof = dev(rng.uniform(-1, 1, (b, h, sq, d)).astype(np.float32), dtype)
    d_kw, r_kw = make_mods(rng, kind, b, h, sq, sk, dtype)
    m_kw, (mt, wl, wr) = MASKS[mask]
    o, lse = mhakit.mha_fwd(q, k, v, layout="bhsd", return_lse=True, dtype=dtype, **m_kw, **d_kw)
    o_ref, lse_ref = reference.attention_fwd(qf, kf, vf, mask_type=mt, window_left=wl, window_right=wr,
                                             return_lse=True, **r_kw)
    close(host(o, dtype), o_ref, reference.tolerances(dtype), "O")
    close(host(lse, dtype), lse_ref, reference.tolerances(dtype), "LSE")

    grads = {}
    if "bias" in d_kw:  # 7, not zeros: the call must write every element (the tiles no key block visits as zeros)
        dt = d_kw["bias"].dtype
        grads["dbias"] = cp.full((b, h, sq, sk), fill_value(7.0, dt), dtype=dt)
    if "sink" in d_kw:
        grads["dsink"] = cp.zeros((h,), dtype=cp.float32)
    dq, dk, dv = mhakit.mha_bwd(do, q, k, v, o, lse, layout="bhsd", dtype=dtype, **m_kw, **d_kw, **grads)
    ref = reference.attention_bwd(qf, kf, vf, dof, mask_type=mt, window_left=wl, window_right=wr,
                                  o=host(o, dtype), return_mod_grads=True, **r_kw)
    check_grads(dq, dk, dv, grads, ref, dtype, reference.tolerances_bwd(dtype, d, d))


@pytest.mark.parametrize("kind", ["cap", "alibi_bh", "bias32", "sink", "cap+bias32+sink"])
def test_group_mode(kind):
    """Varlen: per-sequence positions (ALiBi bottom-right per sequence, bias block [i, :, :s_q_i, :s_k_i])."""
    dtype, d = "bf16", 64
    rng = np.random.default_rng(7)
    lq, lk = [37, 0, 90], [50, 20, 61]
    b, h, hk = len(lq), 4, 1
    cq, ck = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32), np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    mq, mk = max(lq), max(lk)
    q, qf = dev(rng.uniform(-1, 1, (cq[-1], h, d)).astype(np.float32), dtype)
    k, kf = dev(rng.uniform(-1, 1, (ck[-1], hk, d)).astype(np.float32), dtype)
    v, vf = dev(rng.uniform(-1, 1, (ck[-1], hk, d)).astype(np.float32), dtype)
    do, dof = dev(rng.uniform(-1, 1, (cq[-1], h, d)).astype(np.float32), dtype)
    d_kw, r_kw = make_mods(rng, kind, b, h, mq, mk, dtype)
    o, lse = mhakit.mha_varlen_fwd(q, k, v, cp.asarray(cq), cp.asarray(ck), mq, mk, causal=True, return_lse=True,
                                   dtype=dtype, **d_kw)
    grads = {}
    if "bias" in d_kw:
        grads["dbias"] = cp.full((b, h, mq, mk), 7.0, dtype=cp.float32)  # every element inside a sequence written
    if "sink" in d_kw:
        grads["dsink"] = cp.zeros((h,), dtype=cp.float32)
    dq, dk, dv = mhakit.mha_varlen_bwd(do, q, k, v, o, lse, cp.asarray(cq), cp.asarray(ck), mq, mk, causal=True,
                                       dtype=dtype, **d_kw, **grads)
    oh, lh = host(o, dtype), cp.asnumpy(lse)
    dqh, dkh, dvh = host(dq, dtype), host(dk, dtype), host(dv, dtype)
    dsink_ref = np.zeros(h)
    tol_f, tol_b = reference.tolerances(dtype), reference.tolerances_bwd(dtype, d, d)
    for i in range(b):
        q0, q1, k0, k1 = cq[i], cq[i + 1], ck[i], ck[i + 1]
        one = sequence_mods(r_kw, i, q1 - q0, k1 - k0)
        bhsd = lambda x: x[None].transpose(0, 2, 1, 3)  # noqa: E731
        o_ref, lse_ref = reference.attention_fwd(bhsd(qf[q0:q1]), bhsd(kf[k0:k1]), bhsd(vf[k0:k1]), mask_type=2,
                                                 window_left=-1, window_right=0, return_lse=True, **one)
        close(oh[q0:q1], o_ref[0].transpose(1, 0, 2), tol_f, f"O of sequence {i}")
        close(lh[:, q0:q1], lse_ref[0], tol_f, f"LSE of sequence {i}")
        r = reference.attention_bwd(bhsd(qf[q0:q1]), bhsd(kf[k0:k1]), bhsd(vf[k0:k1]), bhsd(dof[q0:q1]),
                                    mask_type=2, window_left=-1, window_right=0, o=bhsd(oh[q0:q1]),
                                    return_mod_grads=True, **one)
        close(dqh[q0:q1], r[0][0].transpose(1, 0, 2), tol_b, f"dQ of sequence {i}")
        close(dkh[k0:k1], r[1][0].transpose(1, 0, 2), tol_b, f"dK of sequence {i}")
        close(dvh[k0:k1], r[2][0].transpose(1, 0, 2), tol_b, f"dV of sequence {i}")
        if "dbias" in grads:
            close(cp.asnumpy(grads["dbias"][i, :, :q1 - q0, :k1 - k0]), r[3][0], tol_b, f"dbias of sequence {i}")
        dsink_ref += r[4]
    if "dsink" in grads:
        close(cp.asnumpy(grads["dsink"]), dsink_ref, tol_b, "dsink")


def test_modifier_arguments_are_checked():
    q = cp.zeros((1, 8, 2, 64), dtype=cp.float16)
    with pytest.raises(ValueError, match="alibi_slopes must be float32 of shape"):
        mhakit.mha_fwd(q, q, q, alibi_slopes=cp.zeros((3,), dtype=cp.float32))
    with pytest.raises(ValueError, match="bias must be float32 or float16 of shape"):
        mhakit.mha_fwd(q, q, q, bias=cp.zeros((1, 2, 8, 7), dtype=cp.float32))
    with pytest.raises(ValueError, match="alibi_slopes and bias are exclusive"):
        mhakit.mha_fwd(q, q, q, bias=cp.zeros((1, 2, 8, 8), dtype=cp.float32),
                       alibi_slopes=cp.zeros((2,), dtype=cp.float32))
    with pytest.raises(ValueError, match="softcap must be a finite number >= 0"):
        mhakit.mha_fwd(q, q, q, softcap=-1.0)
    with pytest.raises(ValueError, match="sink must be a contiguous float32 array of shape"):
        mhakit.mha_fwd(q, q, q, sink=cp.zeros((3,), dtype=cp.float32))
