"""The C call path on the GPU with PyTorch, CuPy and JAX arrays: results against an fp32 reference, tensors that
require grad, CUDA-graph capture (torch.cuda.graph and CuPy stream capture), the producer's stream, outputs
allocated by the producer, the backward's grow-only workspace, errors without a launch, and mhakit.torch's
differentiable operators under torch.compile(fullgraph=True) against SDPA."""
from __future__ import annotations

import os

import pytest

import mhakit

pytestmark = [pytest.mark.gpu, pytest.mark.compile]

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("PyTorch sees no CUDA device", allow_module_level=True)
F = torch.nn.functional


@pytest.fixture(scope="module", autouse=True)
def kernel_cache(tmp_path_factory):
    path = os.environ.get("MHAKIT_TEST_CACHE_DIR") or str(tmp_path_factory.mktemp("mhakit_cache"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MHAKIT_CACHE_DIR", path)
        mp.delenv("MHAKIT_NO_EXT", raising=False)
        from mhakit import _ext
        _ext.reset()
        assert _ext.module() is not None, "the C call path must build on the GPU machine"
        yield path
        _ext.reset()


def reference(q, k, v, causal=False, layout="bshd"):
    """fp32 attention through SDPA's math on upcast inputs; GQA by repeating kv heads; causal bottom-right."""
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    q, k, v = q.float(), k.float(), v.float()
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    mask = None
    if causal:
        sq, sk = q.shape[2], k.shape[2]
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        mask = j <= i + (sk - sq)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return o.transpose(1, 2) if layout == "bshd" else o


def rand(*shape, dtype=torch.bfloat16, requires_grad=False):
    return torch.randn(*shape, device="cuda", dtype=dtype).requires_grad_(requires_grad)


def close(a, b, tol=2e-2):
    """Max abs error within tol, scaled by the reference's magnitude where it exceeds 1 (bf16 gradients reach ~5,
    where one bf16 ulp is 0.03)."""
    scale = max(1.0, b.float().abs().max().item()) if b.numel() else 1.0
    err = (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
    assert err <= tol * scale, f"max abs error {err} > {tol} * {scale}"


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("causal", [False, True])
def test_torch_tensors_take_the_c_path(layout, causal):
    b, sq, sk, hq, hk, d = 2, 77, 130, 8, 2, 128
    shape = (lambda s, h: (b, s, h, d)) if layout == "bshd" else (lambda s, h: (b, h, s, d))
    q, k, v = rand(*shape(sq, hq)), rand(*shape(sk, hk)), rand(*shape(sk, hk))
    o, lse = mhakit.mha_fwd(q, k, v, causal=causal, layout=layout, return_lse=True)
    assert isinstance(o, torch.Tensor) and isinstance(lse, torch.Tensor), "outputs come from torch's allocator"
    assert o.shape == q.shape and lse.shape == (b, hq, sq) and lse.dtype == torch.float32
    close(o, reference(q, k, v, causal, layout))


def test_requires_grad_tensors_are_read():
    q, k, v = (rand(1, 64, 4, 64, requires_grad=True) for _ in range(3))
    o, lse = mhakit.mha_fwd(q, k, v, causal=True, return_lse=True)
    close(o, reference(q.detach(), k.detach(), v.detach(), True))
    do = rand(1, 64, 4, 64)
    dq, dk, dv = mhakit.mha_bwd(do, q, k, v, o, lse, causal=True)
    q2, k2, v2 = (t.detach().float().requires_grad_() for t in (q, k, v))
    reference(q2, k2, v2, True).backward(do.float())
    for got, want in ((dq, q2.grad), (dk, k2.grad), (dv, v2.grad)):
        close(got, want, 5e-2)


def test_varlen_with_device_offsets():
    lens = [5, 0, 130, 64]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")
    total, h, d = sum(lens), 4, 64
    q, k, v = rand(total, h, d), rand(total, h, d), rand(total, h, d)
    o = mhakit.mha_varlen_fwd(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    assert isinstance(o, torch.Tensor)
    for s, n in zip(cu[:-1].tolist(), lens):
        if n:
            close(o[s:s + n], reference(q[None, s:s + n], k[None, s:s + n], v[None, s:s + n], True)[0])


def test_the_producers_current_stream_is_used():
    """With no stream= a torch caller's work lands on torch's current stream (ordered after its producer work)."""
    q, k, v = (rand(4, 512, 8, 128) for _ in range(3))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        o = torch.empty_like(q)
        q2 = q * 2  # queued on `side`; mhakit must run after it without a sync
        mhakit.mha_fwd(q2, k, v, out=o)
    side.synchronize()
    close(o, reference(q * 2, k, v))


def test_torch_cuda_graph_capture_and_replay():
    q, k, v = (rand(2, 256, 8, 128) for _ in range(3))
    o, lse = torch.empty_like(q), torch.empty(2, 8, 256, device="cuda", dtype=torch.float32)
    do = rand(2, 256, 8, 128)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture: builds kernels, grows the workspace
        mhakit.mha_fwd(q, k, v, causal=True, out=o, lse_out=lse)
        mhakit.mha_bwd(do, q, k, v, o, lse, causal=True, dq=dq, dk=dk, dv=dv)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mhakit.mha_fwd(q, k, v, causal=True, out=o, lse_out=lse)
        mhakit.mha_bwd(do, q, k, v, o, lse, causal=True, dq=dq, dk=dk, dv=dv)
    for _ in range(2):
        for t in (q, k, v, do):
            t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        want_o, want_lse = mhakit.mha_fwd(q, k, v, causal=True, return_lse=True)
        want = mhakit.mha_bwd(do, q, k, v, want_o, want_lse, causal=True)
        assert torch.equal(o, want_o) and torch.equal(lse, want_lse)
        for got, ref in zip((dq, dk, dv), want):
            close(got, ref, 1e-2)  # dq may be accumulated atomically in another order


def test_cupy_stream_capture_and_replay():
    cp = pytest.importorskip("cupy")
    q, k, v = (cp.random.standard_normal((2, 200, 4, 64)).astype(cp.float16) for _ in range(3))
    o = cp.empty_like(q)
    # A non-blocking stream does not wait for the legacy default stream, where CuPy wrote q, k and v: every write the
    # graph must see is ordered before it explicitly (the new q and the cleared o go on the graph's own stream).
    cp.cuda.Device().synchronize()
    stream = cp.cuda.Stream(non_blocking=True)
    mhakit.mha_fwd(q, k, v, out=o, stream=stream)  # warm-up
    stream.synchronize()
    stream.begin_capture()
    mhakit.mha_fwd(q, k, v, out=o, stream=stream)
    graph = stream.end_capture()
    with stream:
        q[...] = cp.random.standard_normal(q.shape).astype(q.dtype)
        o[...] = 0
    graph.launch(stream)
    stream.synchronize()
    want = reference(*(torch.from_dlpack(x) for x in (q, k, v)))
    close(torch.from_dlpack(o), want)


def test_jax_arrays_take_the_same_path():
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch in this process
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    if not any(dev.platform == "gpu" for dev in jax.devices()):
        pytest.skip("JAX sees no GPU")
    key = jax.random.PRNGKey(0)
    q, k, v = (jax.random.normal(jax.random.fold_in(key, i), (1, 96, 4, 64), dtype=jnp.float16) for i in range(3))
    o = mhakit.mha_fwd(q, k, v, causal=True)
    want = reference(*(torch.from_dlpack(x) for x in (q, k, v)), causal=True)
    close(torch.from_dlpack(o), want)


def test_bad_input_raises_the_python_paths_sentence_and_launches_nothing():
    q, k = rand(2, 64, 8, 128), rand(3, 80, 2, 128)
    o = torch.full_like(q, 7.0)
    with pytest.raises(ValueError, match="k: batch 3 does not match q's batch 2"):
        mhakit.mha_fwd(q, k, k, out=o)
    with pytest.raises(ValueError, match=r"out: expected shape \(2, 64, 8, 128\)"):
        mhakit.mha_fwd(q, rand(2, 80, 2, 128), rand(2, 80, 2, 128), out=rand(2, 64, 8, 64))
    with pytest.raises(TypeError, match="q: dtype float32 is not supported"):
        mhakit.mha_fwd(q.float(), k.float(), k.float())
    torch.cuda.synchronize()
    assert bool((o == 7.0).all()), "nothing was launched"


def test_backward_workspace_grows_and_is_reused():
    from mhakit import _ext
    q, k, v, do = (rand(1, 1024, 8, 128) for _ in range(4))
    o, lse = mhakit.mha_fwd(q, k, v, return_lse=True)
    mhakit.mha_bwd(do, q, k, v, o, lse)
    held = _ext.module().workspace_bytes(q.device.index)
    assert held > 0
    mhakit.mha_bwd(do, q, k, v, o, lse)
    assert _ext.module().workspace_bytes(q.device.index) == held


@pytest.mark.parametrize("hq, hk", [(8, 8), (8, 2)])
def test_torch_op_under_compile_matches_sdpa(hq, hk):
    import mhakit.torch as mt
    torch._dynamo.reset()
    b, s, d = 2, 256, 64
    q = rand(b, s, hq, d, requires_grad=True)
    k, v = rand(b, s, hk, d, requires_grad=True), rand(b, s, hk, d, requires_grad=True)

    def model(q, k, v):
        return (mt.attention(q, k, v, causal=True) * 1.5).sum()

    compiled = torch.compile(model, fullgraph=True)
    loss = compiled(q, k, v)
    loss.backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    eager = model(q, k, v)  # eager mode: the autograd.Function path
    eager.backward()
    assert abs(eager.item() - loss.item()) <= 1e-2 * max(1.0, abs(loss.item()))  # a bf16 sum, fused or not
    for got, t in zip(grads, (q, k, v)):
        close(got, t.grad, 1e-2)
        t.grad = None
    ref = (F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                          enable_gqa=True).transpose(1, 2) * 1.5).sum()
    ref.backward()
    assert abs(loss.item() - ref.item()) <= 1e-2 * max(1.0, abs(ref.item()))
    for got, t in zip(grads, (q, k, v)):
        close(got, t.grad, 5e-2)


def test_varlen_torch_op_gradients():
    import mhakit.torch as mt
    lens = [100, 37, 256]
    cu = torch.tensor([0, 100, 137, 393], dtype=torch.int32, device="cuda")
    q, k, v = (rand(393, 4, 64, requires_grad=True) for _ in range(3))
    o = mt.varlen_attention(q, k, v, cu, cu, 256, 256, causal=True)
    o.float().square().sum().backward()
    for s, n in zip(cu[:-1].tolist(), lens):
        parts = [t.detach()[None, s:s + n].float().requires_grad_() for t in (q, k, v)]
        reference(*parts, causal=True).square().sum().backward()
        for got, part in zip((q.grad, k.grad, v.grad), parts):
            close(got[s:s + n], part.grad[0], 8e-2)


def test_outputs_outlive_the_callers_stream():
    """Outputs the C path allocates for a CuPy caller (mhakit.DeviceArray) are freed on the call's stream; the
    allocation keeps that stream object alive, so dropping the stream first and the output later is safe."""
    import gc

    cp = pytest.importorskip("cupy")
    q = cp.random.standard_normal((1, 64, 2, 64)).astype(cp.float16)
    stream = cp.cuda.Stream(non_blocking=True)
    o = mhakit.mha_fwd(q, q, q, stream=stream)
    assert isinstance(o, mhakit.DeviceArray) and o.stream == stream.ptr
    stream.synchronize()
    want = reference(*(torch.from_dlpack(x) for x in (q, q, q)))
    close(torch.from_dlpack(o), want)
    del stream
    gc.collect()
    del o
    gc.collect()
    cp.cuda.runtime.deviceSynchronize()
