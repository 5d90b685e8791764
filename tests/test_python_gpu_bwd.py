"""mhakit.mha_bwd / mha_varlen_bwd on the GPU against mhakit.reference (and PyTorch SDPA autograd where PyTorch is
installed), with CuPy arrays and torch tensors through DLPack.

Inputs are uniform in [-1, 1) (aiter's backward default) rounded to fp16/bf16. O and LSE come from the reference
(O rounded to the element type) so that a failure is the backward's own, except in the PyTorch tests, which run
mhakit.mha_fwd first as a user would. Tolerances: reference.tolerances_bwd. Kernels are built on first use into
MHAKIT_TEST_CACHE_DIR (default: a temporary directory), so the first run compiles."""
from __future__ import annotations

import os
import zlib

import numpy as np
import pytest

import mhakit
from gpu_arrays import from_bits, to_bits
from mhakit import api, jit, reference

pytestmark = [pytest.mark.gpu, pytest.mark.compile]

cp = pytest.importorskip("cupy")
try:
    import torch
    if not torch.cuda.is_available():
        torch = None
except ImportError:
    torch = None

NAN_BITS = {"fp16": 0x7E00, "bf16": 0x7FC0}


@pytest.fixture(scope="module", autouse=True)
def kernel_cache(tmp_path_factory):
    path = os.environ.get("MHAKIT_TEST_CACHE_DIR") or str(tmp_path_factory.mktemp("mhakit_cache"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MHAKIT_CACHE_DIR", path)
        yield path


def uniform(rng, shape):
    return rng.uniform(-1.0, 1.0, shape).astype(np.float32)


def storage(values: np.ndarray, dtype: str):
    """(host array as the device will hold it, the values as float32): fp16 as float16, bf16 as uint16 bits (CuPy
    has no bfloat16; mhakit reads them with dtype='bf16')."""
    bits, rounded = to_bits(values, dtype)
    return (bits.view(np.float16) if dtype == "fp16" else bits), rounded


def to_float(host: np.ndarray, dtype: str) -> np.ndarray:
    host = np.ascontiguousarray(host)
    if host.dtype == np.float16 or host.dtype == np.uint16:
        return from_bits(host.view(np.uint16), dtype)
    return host.astype(np.float32)


def host_of(x, dtype: str) -> np.ndarray:
    """float32 host copy of a gradient: a mhakit.DeviceArray, a CuPy array (any strides) or a torch tensor."""
    if isinstance(x, mhakit.DeviceArray):
        return to_float(x.numpy(), dtype)
    if torch is not None and isinstance(x, torch.Tensor):
        return x.float().cpu().numpy()
    return to_float(cp.asnumpy(x), dtype)


def bits_of(x) -> np.ndarray:
    """The raw 16-bit patterns of a gradient (bitwise comparisons)."""
    host = x.numpy() if isinstance(x, mhakit.DeviceArray) else cp.asnumpy(x)
    if host.dtype == np.float32:  # DeviceArray.numpy() widens bfloat16; our bf16 arrays are uint16, but be safe
        return host.view(np.uint32)
    return np.ascontiguousarray(host).view(np.uint16)


def assert_close(out, ref, tol, what):
    rtol, atol = tol
    res = reference.check_close(out, ref, rtol, atol)
    assert res.ok, f"{what}: {res}"


def device_layout(host_bshd: np.ndarray, layout: str):
    """A CuPy array holding `host_bshd` (logical [b, s, h, d]) in one of aiter's generate_qkv memory orders."""
    if layout == "bshd":
        return cp.asarray(host_bshd)
    if layout == "bhsd":
        return cp.ascontiguousarray(cp.asarray(host_bshd).transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    if layout == "sbhd":
        return cp.ascontiguousarray(cp.asarray(host_bshd).transpose(1, 0, 2, 3)).transpose(1, 0, 2, 3)
    if layout in ("padded", "padded_odd"):  # rows with extra elements: non-contiguous; odd = unaligned strides
        b, s, h, d = host_bshd.shape
        pad = 8 if layout == "padded" else 1
        store = cp.zeros((b, s, h, d + pad), dtype=host_bshd.dtype)
        store[..., :d] = cp.asarray(host_bshd)
        return store[..., :d]
    raise ValueError(layout)


def mask_args(mask_kwargs):
    mask_type, left, right = api._resolve_mask(mask_kwargs.get("causal", False), mask_kwargs.get("mask"),
                                               mask_kwargs.get("window"))
    return dict(mask_type=mask_type, window_left=left, window_right=right)


def batch_problem(rng, dtype, b, sq, sk, hq, hk, d, dv, layout, mask_kwargs):
    """Device (do, q, k, v, o, lse) for mha_bwd in `layout` ('api_bhsd': the call's layout='bhsd', else logical
    bshd in that memory order), and the reference gradients (logical bshd, float32)."""
    (q_h, qr), (k_h, kr), (v_h, vr), (do_h, dor) = (storage(uniform(rng, shape), dtype) for shape in
                                                    ((b, sq, hq, d), (b, sk, hk, d), (b, sk, hk, dv), (b, sq, hq, dv)))
    m = mask_args(mask_kwargs)
    ref_o, ref_lse = reference.attention_fwd(qr, kr, vr, layout="bshd", return_lse=True, **m)
    o_h, o_r = storage(ref_o, dtype)
    if layout == "api_bhsd":
        dev = [cp.asarray(np.ascontiguousarray(x.transpose(0, 2, 1, 3))) for x in (do_h, q_h, k_h, v_h, o_h)]
    else:
        dev = [device_layout(x, layout) for x in (do_h, q_h, k_h, v_h, o_h)]
    lse = cp.asarray(np.ascontiguousarray(ref_lse, dtype=np.float32))
    refs = reference.attention_bwd(qr, kr, vr, dor, o=o_r, layout="bshd", **m)
    return (*dev, lse), refs


BATCH_CASES = [
    # dtype, b, sq, sk, hq, hk, d, dv, layout, mask kwargs
    ("fp16", 2, 128, 128, 4, 4, 128, 128, "bshd", {}),
    ("bf16", 2, 100, 200, 8, 2, 128, 128, "api_bhsd", {"causal": True}),          # layout='bhsd', GQA
    ("fp16", 1, 257, 300, 4, 1, 64, 64, "sbhd", {"window": (32, 16)}),            # MQA, sliding window
    ("bf16", 1, 130, 129, 4, 2, 96, 96, "padded_odd", {"mask": "t"}),             # unaligned strides, padded d
    ("bf16", 2, 77, 150, 6, 2, 128, 128, "bhsd", {"mask": "b:16,8"}),
    ("fp16", 2, 96, 96, 4, 4, 128, 128, "padded", {"causal": True}),
    ("fp16", 2, 40, 0, 4, 4, 128, 128, "bshd", {}),                               # no keys: dQ = 0
    ("fp16", 2, 0, 37, 4, 2, 128, 128, "bshd", {}),                               # no queries: dK = dV = 0
    ("fp16", 1, 130, 129, 4, 2, 59, 59, "bshd", {}),                              # head dim 59: rows of 118 bytes
    ("bf16", 2, 77, 150, 6, 2, 111, 111, "padded_odd", {"causal": True}),         # head dim 111 in rows of 112
]


@pytest.mark.parametrize("case", BATCH_CASES,
                         ids=lambda c: "-".join(map(str, c[:9])) + "-" + "_".join(map(str, c[9].values())))
def test_mha_bwd_cupy(case):
    dtype, b, sq, sk, hq, hk, d, dv, layout, mask_kwargs = case
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    (do, q, k, v, o, lse), (ref_dq, ref_dk, ref_dv) = batch_problem(rng, dtype, b, sq, sk, hq, hk, d, dv, layout,
                                                                    mask_kwargs)
    api_layout = "bhsd" if layout == "api_bhsd" else "bshd"
    stream = cp.cuda.Stream(non_blocking=True)
    grads = mhakit.mha_bwd(do, q, k, v, o, lse, layout=api_layout, dtype="bf16" if dtype == "bf16" else None,
                           stream=stream, **mask_kwargs)
    stream.synchronize()
    shapes = [(b, sq, hq, d), (b, sk, hk, d), (b, sk, hk, dv)]
    tol = reference.tolerances_bwd(dtype, d, dv)
    for label, grad, shape, ref in zip(("dQ", "dK", "dV"), grads, shapes, (ref_dq, ref_dk, ref_dv)):
        assert isinstance(grad, mhakit.DeviceArray) and grad.device_id == q.device.id
        expect = shape if api_layout == "bshd" else (shape[0], shape[2], shape[1], shape[3])
        assert grad.shape == expect and grad.dtype.name == q.dtype.name, (label, grad.shape, grad.dtype)
        out = host_of(grad, dtype)
        if api_layout == "bhsd":
            out = out.transpose(0, 2, 1, 3)
        assert_close(out, ref, tol, label)


def test_deterministic_runs_are_bitwise_equal():
    rng = np.random.default_rng(21)
    dtype = "bf16"
    (do, q, k, v, o, lse), refs = batch_problem(rng, dtype, 1, 200, 333, 4, 2, 128, 128, "bshd", {"causal": True})
    first = mhakit.mha_bwd(do, q, k, v, o, lse, causal=True, deterministic=True, dtype="bf16")
    second = mhakit.mha_bwd(do, q, k, v, o, lse, causal=True, deterministic=True, dtype="bf16")
    cp.cuda.runtime.deviceSynchronize()
    tol = reference.tolerances_bwd(dtype, 128, 128)
    for label, a, b_, ref in zip(("dQ", "dK", "dV"), first, second, refs):
        assert np.array_equal(bits_of(a), bits_of(b_)), f"{label} differs bitwise between two deterministic runs"
        assert_close(host_of(a, dtype), ref, tol, label)


def test_gradients_into_caller_arrays():
    """dq=/dk=/dv= may have layouts of their own (head-major memory viewed as bshd, padded rows); they are filled in
    place and returned."""
    rng = np.random.default_rng(22)
    dtype, b, sq, sk, hq, hk, d = "fp16", 2, 120, 136, 4, 2, 128
    (do, q, k, v, o, lse), refs = batch_problem(rng, dtype, b, sq, sk, hq, hk, d, d, "bshd", {"window": (40, 0)})
    dq = cp.full((b, hq, sq, d), np.nan, dtype=cp.float16).transpose(0, 2, 1, 3)      # bhsd memory, bshd view
    dk_store = cp.full((b, sk, hk, d + 8), np.nan, dtype=cp.float16)
    dk = dk_store[..., :d]                                                             # padded rows
    dv = cp.full((b, sk, hk, d), np.nan, dtype=cp.float16)
    got = mhakit.mha_bwd(do, q, k, v, o, lse, window=(40, 0), dq=dq, dk=dk, dv=dv)
    cp.cuda.runtime.deviceSynchronize()
    assert got[0] is dq and got[1] is dk and got[2] is dv
    tol = reference.tolerances_bwd(dtype, d, d)
    for label, grad, ref in zip(("dQ", "dK", "dV"), (dq, dk, dv), refs):
        assert_close(host_of(grad, dtype), ref, tol, f"{label} (caller's array)")
    assert bool(cp.isnan(dk_store[..., d:]).all()), "the padding of dk's rows must stay untouched"


def test_both_families_run(monkeypatch, capfd):
    """On sm_90a an aligned call reaches the Hopper backward, deterministic or not; unaligned strides (which it
    refuses) fall back to the generic instance of the same cached library."""
    if jit.device_arch(0) != "sm_90a":
        pytest.skip("the hopper family exists on sm_90a only")
    if not any(sp.algorithm.family == "hopper" for sp in jit._catalogue_specs("bwd", "sm_90a")):
        pytest.skip("the catalogue has no [bwd.hopper] family yet")
    monkeypatch.setattr(api, "LOG_LEVEL", 1)
    rng = np.random.default_rng(23)
    (do, q, k, v, o, lse), _ = batch_problem(rng, "bf16", 1, 128, 128, 2, 2, 128, 128, "bshd", {"causal": True})
    mhakit.mha_bwd(do, q, k, v, o, lse, causal=True, dtype="bf16")
    mhakit.mha_bwd(do, q, k, v, o, lse, causal=True, dtype="bf16", deterministic=True)
    (do, q, k, v, o, lse), _ = batch_problem(rng, "bf16", 1, 128, 128, 2, 2, 128, 128, "padded_odd", {"causal": True})
    mhakit.mha_bwd(do, q, k, v, o, lse, causal=True, dtype="bf16")
    cp.cuda.runtime.deviceSynchronize()
    lines = [line for line in capfd.readouterr().out.splitlines() if "mha_bwd ->" in line]
    assert len(lines) == 3 and "_hopper_" in lines[0] and "_hopper_" in lines[1] and "_generic_" in lines[2], lines


VARLEN_CASES = [
    # dtype, hq, hk, lens_q, lens_k, d, dv, mask kwargs, cu on device, deterministic
    ("fp16", 4, 2, [0, 7, 100, 33], [5, 0, 130, 64], 128, 128, {}, True, False),
    ("bf16", 2, 1, [65, 1, 129], [65, 200, 40], 128, 128, {"causal": True}, False, True),
    ("bf16", 4, 4, [17, 90, 0], [0, 33, 12], 128, 128, {"window": (8, 8)}, True, False),
    ("bf16", 2, 1, [65, 1, 129], [65, 200, 40], 111, 111, {"causal": True}, False, True),  # head dim 111
]


@pytest.mark.parametrize("case", VARLEN_CASES, ids=lambda c: f"{c[0]}-h{c[1]}x{c[2]}-{c[3]}-{c[4]}-d{c[5]}-"
                                                             + "_".join(map(str, c[7].values())) + f"-det{c[9]}")
def test_mha_varlen_bwd_cupy(case):
    dtype, hq, hk, lens_q, lens_k, d, dv, mask_kwargs, on_device, deterministic = case
    rng = np.random.default_rng(sum(lens_q) * 31 + sum(lens_k))
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    (q_h, qr), (k_h, kr), (v_h, vr), (do_h, dor) = (storage(uniform(rng, shape), dtype) for shape in
                                                    ((tq, hq, d), (tk, hk, d), (tk, hk, dv), (tq, hq, dv)))
    m = mask_args(mask_kwargs)
    ref_o, ref_lse = reference.attention_varlen_fwd(qr, kr, vr, cu_q, cu_k, return_lse=True, **m)
    o_h, o_r = storage(ref_o, dtype)
    q, k, v, do, o = (cp.asarray(x) for x in (q_h, k_h, v_h, do_h, o_h))
    lse = cp.asarray(np.ascontiguousarray(ref_lse, dtype=np.float32))  # [h, total_q]
    cq, ck = (cp.asarray(cu_q), cp.asarray(cu_k)) if on_device else (cu_q.tolist(), cu_k.tolist())
    kwargs = dict(dtype="bf16" if dtype == "bf16" else None, deterministic=deterministic, **mask_kwargs)
    grads = mhakit.mha_varlen_bwd(do, q, k, v, o, lse, cq, ck, max(lens_q), max(lens_k), **kwargs)
    cp.cuda.runtime.deviceSynchronize()
    refs = reference.attention_varlen_bwd(qr, kr, vr, dor, cu_q, cu_k, o=o_r, **m)
    tol = reference.tolerances_bwd(dtype, d, dv)
    shapes = [(tq, hq, d), (tk, hk, d), (tk, hk, dv)]
    for label, grad, shape, ref in zip(("dQ", "dK", "dV"), grads, shapes, refs):
        assert grad.shape == shape, (label, grad.shape)
        assert_close(host_of(grad, dtype), ref, tol, label)
    if deterministic:
        again = mhakit.mha_varlen_bwd(do, q, k, v, o, lse, cq, ck, max(lens_q), max(lens_k), **kwargs)
        cp.cuda.runtime.deviceSynchronize()
        for label, a, b_ in zip(("dQ", "dK", "dV"), grads, again):
            assert np.array_equal(bits_of(a), bits_of(b_)), f"{label} differs bitwise between two deterministic runs"


# ----------------------------------------------------------------------------------------------------------------
# PyTorch, where present: tensors in and out through DLPack, the forward's own O and LSE, and SDPA's autograd
# ----------------------------------------------------------------------------------------------------------------

needs_torch = pytest.mark.skipif(torch is None, reason="PyTorch with CUDA is not installed")


def torch_uniform(shape, dtype, generator):
    return (torch.rand(shape, device="cuda", generator=generator) * 2 - 1).to(dtype)


@needs_torch
def test_torch_tensors_forward_then_backward():
    """mha_fwd's O and LSE feed mha_bwd on torch tensors and a torch stream; gradients match the reference."""
    tdt = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(5)
    b, s, hq, hk, d = 2, 160, 8, 2, 128
    q, do = torch_uniform((b, s, hq, d), tdt, g), torch_uniform((b, s, hq, d), tdt, g)
    kv = torch_uniform((b, s, 2, hk, d), tdt, g)  # kvpacked [b, s, 2, hk, d]
    k, v = kv[:, :, 0], kv[:, :, 1]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        o, lse = mhakit.mha_fwd(q, k, v, causal=True, return_lse=True, stream=stream)
        dq_out = torch.empty_like(q)
        dq, dk, dv = mhakit.mha_bwd(do, q, k, v, o, lse, causal=True, dq=dq_out, stream=stream)
        dk_t, dv_t = torch.from_dlpack(dk), torch.from_dlpack(dv)
    stream.synchronize()
    assert dq is dq_out and dk_t.dtype == tdt and dk_t.shape == (b, s, hk, d)
    assert dk_t.data_ptr() == (dk.data_ptr() if isinstance(dk, torch.Tensor) else dk.ptr)  # C path: torch tensors
    host = lambda t: t.float().cpu().numpy()  # noqa: E731
    o_host = host(torch.from_dlpack(o))
    refs = reference.attention_bwd(host(q), host(k), host(v), host(do), o=o_host, layout="bshd", mask_type=2,
                                   window_left=-1, window_right=0)
    tol = reference.tolerances_bwd("bf16", d, d)
    for label, grad, ref in zip(("dQ", "dK", "dV"), (dq, dk_t, dv_t), refs):
        assert_close(host(grad), ref, tol, f"{label} (torch)")


@needs_torch
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_against_torch_sdpa_autograd(dtype):
    """One causal GQA case against PyTorch's own gradients: SDPA (math backend, fp32, no TF32) differentiated by
    autograd, with k/v repeated per query head so that autograd sums dK/dV over each group. s_q == s_k, where
    SDPA's top-left causal mask and mhakit's bottom-right one coincide."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    tdt = torch.bfloat16 if dtype == "bf16" else torch.float16
    g = torch.Generator(device="cuda").manual_seed(6)
    b, s, hq, hk, d = 2, 256, 4, 2, 128
    q, k, v, do = (torch_uniform(shape, tdt, g) for shape in
                   ((b, s, hq, d), (b, s, hk, d), (b, s, hk, d), (b, s, hq, d)))
    o, lse = mhakit.mha_fwd(q, k, v, causal=True, return_lse=True)
    dq, dk, dv = mhakit.mha_bwd(do, q, k, v, o, lse, causal=True)
    torch.cuda.synchronize()

    leaves = [x.float().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v)]  # [b, h, s, d] fp32
    qf, kf, vf = leaves
    group = hq // hk
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with sdpa_kernel(SDPBackend.MATH):
            of = torch.nn.functional.scaled_dot_product_attention(
                qf, kf.repeat_interleave(group, dim=1), vf.repeat_interleave(group, dim=1), is_causal=True)
        of.backward(do.float().transpose(1, 2))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    tol = reference.tolerances_bwd(dtype, d, d)
    for label, ours, leaf in zip(("dQ", "dK", "dV"), (dq, dk, dv), leaves):
        ref = leaf.grad.transpose(1, 2).cpu().numpy()
        assert_close(torch.from_dlpack(ours).float().cpu().numpy(), ref, tol, f"{label} vs SDPA autograd")


@needs_torch
def test_torch_varlen_with_device_offsets():
    lens_q, lens_k = [3, 0, 120], [64, 9, 0]
    cu_q = torch.tensor([0, 3, 3, 123], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 64, 73, 73], dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(7)
    q, do = torch_uniform((123, 4, 128), torch.bfloat16, g), torch_uniform((123, 4, 128), torch.bfloat16, g)
    k, v = torch_uniform((73, 2, 128), torch.bfloat16, g), torch_uniform((73, 2, 128), torch.bfloat16, g)
    o, lse = mhakit.mha_varlen_fwd(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True, return_lse=True)
    dq, dk, dv = mhakit.mha_varlen_bwd(do, q, k, v, o, lse, cu_q, cu_k, max(lens_q), max(lens_k), causal=True)
    torch.cuda.synchronize()
    host = lambda t: t.float().cpu().numpy()  # noqa: E731
    refs = reference.attention_varlen_bwd(host(q), host(k), host(v), host(do), cu_q.cpu().numpy(),
                                          cu_k.cpu().numpy(), o=host(torch.from_dlpack(o)), mask_type=2,
                                          window_left=-1, window_right=0)
    tol = reference.tolerances_bwd("bf16", 128, 128)
    for label, grad, ref in zip(("dQ", "dK", "dV"), (dq, dk, dv), refs):
        assert_close(host(torch.from_dlpack(grad)), ref, tol, f"{label} (torch varlen)")
