"""Dropout through the Python API on the GPU (the modifier instances: Hopper's on sm_90a for head dims that are
multiples of 8, else generic's; each call asserts its family): the stored random bytes equal the NumPy reference's
Philox (dropout_randval), O / LSE and dQ / dK / dV match mhakit.reference given those bytes (with masks, GQA,
soft-cap + sink, group mode, odd head dims), the dropout rate is checked statistically, and seed / offset given in
device memory give the same results as host values. Kernels are built on first use into MHAKIT_TEST_CACHE_DIR."""
from __future__ import annotations

import zlib

import numpy as np
import pytest

import mhakit
from mhakit import api, jit, reference

pytestmark = [pytest.mark.gpu, pytest.mark.compile]

cp = pytest.importorskip("cupy")

from test_python_gpu import kernel_cache  # noqa: E402,F401  (autouse: MHAKIT_CACHE_DIR for the module)
from test_python_gpu_mods import check_grads, close, dev, host  # noqa: E402

MASKS = {"none": (dict(), (0, -1, -1)), "causal": (dict(causal=True), (2, -1, 0)),
         "window": (dict(mask="t:8,4"), (1, 8, 4))}


@pytest.fixture
def launched(monkeypatch, capfd):
    """launched() -> the instance names of the calls since its last call ("[mhakit] mha_fwd -> <name>")."""
    monkeypatch.setattr(api, "LOG_LEVEL", 1)

    def names():
        cp.cuda.runtime.deviceSynchronize()
        return [line.split("-> ")[1].strip() for line in capfd.readouterr().out.splitlines() if "-> " in line]
    return names


def family(d: int) -> str:
    """The family a dropout call of head dim d runs on: Hopper's "_mods" instances on sm_90a (head dims multiples of
    8), else generic's."""
    return "hopper" if jit.device_arch(0) == "sm_90a" and d % 8 == 0 else "generic"


def visible_equal(out: np.ndarray, ref: np.ndarray, mt: int, wl: int, wr: int) -> None:
    """Random bytes of the visible scores (those the kernels visit) must be identical."""
    sq, sk = out.shape[-2:]
    vis = reference.visible_mask(mt, wl, wr, sq, sk)
    bad = np.argwhere((out != ref) & vis)
    assert bad.size == 0, f"{len(bad)} random bytes differ, first at {tuple(bad[0])}"


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("d", [59, 128])
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("extra", ["", "cap+sink"])
def test_forward_and_backward_batch(extra, mask, d, dtype, launched):
    rng = np.random.default_rng(zlib.crc32(f"{extra}/{mask}/{d}/{dtype}".encode()))
    b, h, hk, sq, sk, p = 2, 4, 2, 70, 93, 0.3
    seed, offset = int(rng.integers(1, 2**63)), int(rng.integers(0, 2**40))
    q, qf = dev(rng.uniform(-1, 1, (b, h, sq, d)).astype(np.float32), dtype)
    k, kf = dev(rng.uniform(-1, 1, (b, hk, sk, d)).astype(np.float32), dtype)
    v, vf = dev(rng.uniform(-1, 1, (b, hk, sk, d)).astype(np.float32), dtype)
    do, dof = dev(rng.uniform(-1, 1, (b, h, sq, d)).astype(np.float32), dtype)
    m_kw, (mt, wl, wr) = MASKS[mask]
    d_kw, r_kw = dict(dropout_p=p, seed=seed, offset=offset), {}
    if extra:
        sink = rng.uniform(-1, 2, (h,)).astype(np.float32)
        d_kw.update(softcap=2.5, sink=cp.asarray(sink))
        r_kw.update(softcap=2.5, sink=sink)
    randval = cp.zeros((b, h, sq, sk), dtype=cp.uint8)
    o, lse = mhakit.mha_fwd(q, k, v, layout="bhsd", return_lse=True, dtype=dtype, randval=randval, **m_kw, **d_kw)
    rv = cp.asnumpy(randval)
    rv_ref = reference.dropout_randval(seed, offset, b, h, sq, sk)
    visible_equal(rv, rv_ref, mt, wl, wr)
    o_ref, lse_ref = reference.attention_fwd(qf, kf, vf, mask_type=mt, window_left=wl, window_right=wr,
                                             return_lse=True, dropout_p=p, randval=rv_ref, **r_kw)
    close(host(o, dtype), o_ref, reference.tolerances(dtype), "O")
    close(host(lse, dtype), lse_ref, reference.tolerances(dtype), "LSE")

    dq, dk, dv = mhakit.mha_bwd(do, q, k, v, o, lse, layout="bhsd", dtype=dtype, **m_kw, **d_kw)
    ref = reference.attention_bwd(qf, kf, vf, dof, mask_type=mt, window_left=wl, window_right=wr,
                                  o=host(o, dtype), dropout_p=p, randval=rv_ref, **r_kw)
    tol = reference.tolerances_bwd(dtype, d, d)
    check_grads(dq, dk, dv, {}, ref, dtype, tol)
    # the deterministic backward regenerates the same bytes too
    dq2, dk2, dv2 = mhakit.mha_bwd(do, q, k, v, o, lse, layout="bhsd", dtype=dtype, deterministic=True, **m_kw,
                                   **d_kw)
    for name, out, r in (("dQ", dq2, ref[0]), ("dK", dk2, ref[1]), ("dV", dv2, ref[2])):
        close(host(out, dtype), r, tol, f"deterministic {name}")
    names = launched()
    assert len(names) == 3 and all(f"_mods_sm90a_{family(d)}_" in n or "_sm90a_" not in n for n in names), names


def test_group_mode(launched):
    dtype, d, p, seed, offset = "bf16", 64, 0.2, 1234, 77
    rng = np.random.default_rng(9)
    lq, lk = [37, 0, 90], [50, 20, 61]
    b, h, hk = len(lq), 4, 1
    cq, ck = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32), np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    mq, mk = max(lq), max(lk)
    q, qf = dev(rng.uniform(-1, 1, (cq[-1], h, d)).astype(np.float32), dtype)
    k, kf = dev(rng.uniform(-1, 1, (ck[-1], hk, d)).astype(np.float32), dtype)
    v, vf = dev(rng.uniform(-1, 1, (ck[-1], hk, d)).astype(np.float32), dtype)
    do, dof = dev(rng.uniform(-1, 1, (cq[-1], h, d)).astype(np.float32), dtype)
    randval = cp.zeros((h, int(cq[-1]), mk), dtype=cp.uint8)
    kw = dict(causal=True, dtype=dtype, dropout_p=p, seed=seed, offset=offset)
    o, lse = mhakit.mha_varlen_fwd(q, k, v, cp.asarray(cq), cp.asarray(ck), mq, mk, return_lse=True, randval=randval,
                                   **kw)
    dq, dk, dv = mhakit.mha_varlen_bwd(do, q, k, v, o, lse, cp.asarray(cq), cp.asarray(ck), mq, mk, **kw)
    rv_ref = reference.dropout_randval_varlen(seed, offset, cq, ck, h)
    rv = cp.asnumpy(randval)
    for i in range(b):
        visible_equal(rv[:, cq[i]:cq[i + 1], :lk[i]], rv_ref[:, cq[i]:cq[i + 1], :lk[i]], 2, -1, 0)
    r_kw = dict(mask_type=2, window_left=-1, window_right=0, dropout_p=p, randval=rv_ref)
    o_ref, lse_ref = reference.attention_varlen_fwd(qf, kf, vf, cq, ck, return_lse=True, **r_kw)
    close(host(o, dtype), o_ref, reference.tolerances(dtype), "O")
    close(cp.asnumpy(lse), lse_ref, reference.tolerances(dtype), "LSE")
    ref = reference.attention_varlen_bwd(qf, kf, vf, dof, cq, ck, o=host(o, dtype), **r_kw)
    check_grads(dq, dk, dv, {}, ref, dtype, reference.tolerances_bwd(dtype, d, d))
    names = launched()
    assert len(names) == 2 and all(f"_group_mask_mods_sm90a_{family(d)}_" in n or "_sm90a_" not in n
                                   for n in names), names


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_rate_and_scale(p):
    """With V = 1 (one column) each output is Σ_j P_ij·keep_ij / (1 − p): over many rows its mean is 1 and the kept
    fraction of the stored bytes is (keep_max + 1)/256 within five standard deviations."""
    b, h, s, d = 2, 8, 512, 64
    q = cp.zeros((b, h, s, d), dtype=cp.float16)  # uniform P = 1/s
    v = cp.ones((b, h, s, d), dtype=cp.float16)
    randval = cp.zeros((b, h, s, s), dtype=cp.uint8)
    o = mhakit.mha_fwd(q, q, v, layout="bhsd", dropout_p=p, seed=2024, offset=0, randval=randval)
    keep = cp.asnumpy(randval) <= reference.dropout_keep_max(p)
    rate = (reference.dropout_keep_max(p) + 1) / 256
    n = keep.size
    assert abs(keep.mean() - rate) < 5 * np.sqrt(rate * (1 - rate) / n)
    o0 = cp.asnumpy(o.numpy() if isinstance(o, mhakit.DeviceArray) else o).astype(np.float64)[..., 0]
    expected = keep.mean(axis=-1) / (1 - np.float32(p))
    np.testing.assert_allclose(o0, expected, rtol=2e-3, atol=2e-3)
    assert abs(o0.mean() - rate / (1 - p)) < 0.01


def test_seed_and_offset_in_device_memory():
    """drop_seed_ptr / drop_offset_ptr: the same bytes as host values; new values in the same arrays change them."""
    b, h, s, d = 1, 2, 100, 64
    rng = np.random.default_rng(5)
    q = cp.asarray(rng.uniform(-1, 1, (b, h, s, d)).astype(np.float16))
    seed_dev, offset_dev = cp.asarray([2**40 + 3], dtype=cp.uint64), cp.asarray([9], dtype=cp.uint64)
    out = {}
    for name, kw in (("host", dict(seed=2**40 + 3, offset=9)), ("device", dict(seed=seed_dev, offset=offset_dev))):
        rv = cp.zeros((b, h, s, s), dtype=cp.uint8)
        o = mhakit.mha_fwd(q, q, q, layout="bhsd", dropout_p=0.4, randval=rv, **kw)
        out[name] = (cp.asnumpy(o.numpy() if isinstance(o, mhakit.DeviceArray) else o), cp.asnumpy(rv))
    assert (out["host"][1] == out["device"][1]).all() and (out["host"][0] == out["device"][0]).all()
    offset_dev[0] = 10
    rv = cp.zeros((b, h, s, s), dtype=cp.uint8)
    mhakit.mha_fwd(q, q, q, layout="bhsd", dropout_p=0.4, randval=rv, seed=seed_dev, offset=offset_dev)
    assert (cp.asnumpy(rv) == reference.dropout_randval(2**40 + 3, 10, b, h, s, s)).all()
