"""mhakit.torch's plumbing without a GPU: the calls mhakit.api would make are served by the NumPy reference on CPU
tensors (float64), so that what mhakit.torch adds around the kernels is checked on its own: which modifiers and
outputs reach the calls, the dbias buffer and its sum over broadcast dimensions, d sink, dropout's seed and offset
from ints, device tensors or a generator (the backward gets the forward's), GQA, group mode, and the custom
operators' schemas, fake implementations and autograd under torch.compile (the aot_eager backend, the operators given
CPU kernels). Against fp64 attention written out in PyTorch with autograd. The kernels themselves are the GPU tests'
(tests/test_python_gpu_torch_mods.py)."""
from __future__ import annotations

import numpy as np
import pytest

from mhakit import reference

torch = pytest.importorskip("torch")
mt = pytest.importorskip("mhakit.torch")

from torch_attention_ref import attention_ref  # noqa: E402

_UINT64 = 1 << 64


def _np(t):
    return None if t is None else t.detach().to(torch.float64).numpy()


def _int(x):
    return int(x.item()) % _UINT64 if isinstance(x, torch.Tensor) else int(x)


class FakeApi:
    """mhakit.api's four calls, computed by mhakit.reference; records each call's keyword arguments."""

    def __init__(self):
        self.calls = []

    def _mods(self, kw):
        mods = {"softcap": kw.get("softcap"), "alibi_slopes": _np(kw.get("alibi_slopes")),
                "bias": _np(kw.get("bias")), "sink": _np(kw.get("sink"))}
        return {n: v for n, v in mods.items() if v is not None}

    def _randval(self, kw, shape=None, varlen=None, hq=None):
        if not kw.get("dropout_p"):
            return {}
        seed, offset = _int(kw["seed"]), _int(kw["offset"])
        if varlen is not None:
            rv = reference.dropout_randval_varlen(seed, offset, varlen[0].numpy(), varlen[1].numpy(), hq)
        else:
            rv = reference.dropout_randval(seed, offset, *shape)
        return {"dropout_p": kw["dropout_p"], "randval": rv}

    def mha_fwd(self, q, k, v, *, mask, scale, layout, return_lse, **kw):
        self.calls.append(("fwd", kw))
        b, hq, sq = (q.shape[0], q.shape[2], q.shape[1]) if layout == "bshd" else q.shape[:3]
        sk = k.shape[1] if layout == "bshd" else k.shape[2]
        o, lse = reference.attention_fwd(_np(q), _np(k), _np(v), scale=scale, mask_type=mask[0], window_left=mask[1],
                                         window_right=mask[2], return_lse=True, layout=layout, out_dtype=np.float64,
                                         **self._mods(kw), **self._randval(kw, (b, hq, sq, sk)))
        return torch.from_numpy(o).to(q.dtype), torch.from_numpy(lse).float()

    def mha_bwd(self, do, q, k, v, o, lse, *, mask, scale, layout, deterministic, dbias=None, dsink=None, **kw):
        self.calls.append(("bwd", dict(kw, dbias=dbias, dsink=dsink)))
        b, hq, sq = (q.shape[0], q.shape[2], q.shape[1]) if layout == "bshd" else q.shape[:3]
        sk = k.shape[1] if layout == "bshd" else k.shape[2]
        dq, dk, dv, db, ds = reference.attention_bwd(
            _np(q), _np(k), _np(v), _np(do), scale=scale, mask_type=mask[0], window_left=mask[1],
            window_right=mask[2], layout=layout, out_dtype=np.float64, return_mod_grads=True, **self._mods(kw),
            **self._randval(kw, (b, hq, sq, sk)))
        self._fill(dbias, db, dsink, ds)
        return tuple(torch.from_numpy(g).to(q.dtype) for g in (dq, dk, dv))

    def mha_varlen_fwd(self, q, k, v, cu_q, cu_k, max_q, max_k, *, mask, scale, return_lse, **kw):
        self.calls.append(("varlen_fwd", kw))
        o, lse = reference.attention_varlen_fwd(_np(q), _np(k), _np(v), cu_q.numpy(), cu_k.numpy(), scale=scale,
                                                mask_type=mask[0], window_left=mask[1], window_right=mask[2],
                                                return_lse=True, out_dtype=np.float64, **self._mods(kw),
                                                **self._randval(kw, varlen=(cu_q, cu_k), hq=q.shape[1]))
        return torch.from_numpy(o).to(q.dtype), torch.from_numpy(lse).float()

    def mha_varlen_bwd(self, do, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, *, mask, scale, deterministic,
                       dbias=None, dsink=None, **kw):
        self.calls.append(("varlen_bwd", dict(kw, dbias=dbias, dsink=dsink)))
        dq, dk, dv, db, ds = reference.attention_varlen_bwd(
            _np(q), _np(k), _np(v), _np(do), cu_q.numpy(), cu_k.numpy(), scale=scale, mask_type=mask[0],
            window_left=mask[1], window_right=mask[2], out_dtype=np.float64, return_mod_grads=True,
            **self._mods(kw), **self._randval(kw, varlen=(cu_q, cu_k), hq=q.shape[1]))
        if dbias is not None:  # the reference's [b, h, max_s_q, max_s_k]: what the kernels write, zeros elsewhere
            db = np.pad(db, [(0, 0), (0, 0), (0, dbias.shape[2] - db.shape[2]), (0, dbias.shape[3] - db.shape[3])])
        self._fill(dbias, db, dsink, ds)
        return tuple(torch.from_numpy(g).to(q.dtype) for g in (dq, dk, dv))

    @staticmethod
    def _fill(dbias, db, dsink, ds):
        if dbias is not None:
            assert tuple(dbias.shape) == db.shape, (tuple(dbias.shape), db.shape)
            dbias.copy_(torch.from_numpy(db))
        if dsink is not None:
            dsink.copy_(torch.from_numpy(ds))


@pytest.fixture
def api(monkeypatch):
    fake = FakeApi()
    for name in ("mha_fwd", "mha_bwd", "mha_varlen_fwd", "mha_varlen_bwd"):
        monkeypatch.setattr(mt.api, name, getattr(fake, name))
    return fake


@pytest.fixture
def cpu_ops():
    """The four custom operators with their own functions as CPU kernels, for torch.compile on CPU tensors."""
    handles = [op.register_kernel("cpu")(op._init_fn) for op in (mt._attention_fwd, mt._attention_bwd,
                                                                  mt._varlen_fwd, mt._varlen_bwd)]
    yield
    for h in handles:
        if h is not None and hasattr(h, "destroy"):
            h.destroy()


def rand(*shape, requires_grad=True, gen=None):
    return torch.randn(*shape, dtype=torch.float64, generator=gen).requires_grad_(requires_grad)


def keep_of(seed, offset, b, h, sq, sk, p):
    return torch.from_numpy(reference.dropout_randval(seed, offset, b, h, sq, sk) <= reference.dropout_keep_max(p))


def assert_grads(o, inputs, ref_kwargs, tol=1e-6):
    """O, then (o.backward(do) inside) every gradient against attention_ref's, fp64 on both sides (1e-6: the
    reference takes p and sinks in float32, as the kernels do; a plumbing fault shows as an O(1) difference)."""
    q, k, v, bias, sink = inputs
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in inputs]
    ref = attention_ref(*leaves[:3], bias=leaves[3], sink=leaves[4], **ref_kwargs)
    torch.testing.assert_close(o, ref, rtol=tol, atol=tol)
    do = torch.randn_like(o)
    o.backward(do)
    ref.backward(do)
    for got, want in zip((q, k, v, bias, sink), leaves):
        if got is None:
            continue
        if not got.requires_grad:
            assert got.grad is None
            continue
        assert got.grad is not None and got.grad.shape == got.shape
        torch.testing.assert_close(got.grad, want.grad, rtol=tol, atol=tol)


CASES = [
    ("plain_causal", dict(causal=True), {}),
    ("softcap", dict(softcap=3.0), {}),
    ("alibi_causal", dict(causal=True), {"alibi": True}),
    ("bias_broadcast", {}, {"bias": (1, 1)}),
    ("bias_per_head", {}, {"bias": (1, 4)}),
    ("bias_per_batch", dict(causal=True), {"bias": (2, 1)}),
    ("bias_full", {}, {"bias": (2, 4)}),
    ("sink", dict(causal=True), {"sink": True}),
    ("all", dict(causal=True, softcap=5.0), {"bias": (1, 1), "sink": True}),
]


@pytest.mark.parametrize("name, kwargs, spec", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("hk", [4, 2])
def test_modifiers_reach_the_calls_and_every_gradient_comes_back(api, name, kwargs, spec, hk):
    b, sq, sk, hq, d = 2, 7, 9, 4, 8
    q, k, v = rand(b, sq, hq, d), rand(b, sk, hk, d), rand(b, sk, hk, d)
    bias = rand(*spec["bias"], sq, sk) if "bias" in spec else None
    sink = torch.randn(hq, dtype=torch.float64).requires_grad_() if spec.get("sink") else None
    alibi = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64) if spec.get("alibi") else None
    o = mt.attention(q, k, v, alibi_slopes=alibi, bias=bias, sink=sink, **kwargs)
    ref_kwargs = {n: kwargs[n] for n in ("causal", "softcap") if n in kwargs}
    assert_grads(o, (q, k, v, bias, sink), dict(ref_kwargs, alibi=alibi))
    (_, fwd_kw), (_, bwd_kw) = api.calls
    assert set(fwd_kw) == {n for n, given in (("softcap", "softcap" in kwargs), ("alibi_slopes", alibi is not None),
                                              ("bias", bias is not None), ("sink", sink is not None)) if given}
    if bias is not None:  # the call's dbias is the full [b, h_q, s_q, s_k] in the bias's dtype
        assert tuple(bwd_kw["dbias"].shape) == (b, hq, sq, sk) and bwd_kw["dbias"].dtype == bias.dtype


def test_plain_calls_pass_no_modifier_keyword(api):
    q, k, v = rand(1, 5, 2, 8), rand(1, 5, 2, 8), rand(1, 5, 2, 8)
    mt.attention(q, k, v, causal=True).sum().backward()
    assert api.calls == [("fwd", {}), ("bwd", {"dbias": None, "dsink": None})]


def test_bias_and_sink_without_grad_get_no_output_buffers(api):
    q, k, v = rand(1, 6, 2, 8), rand(1, 6, 2, 8), rand(1, 6, 2, 8)
    bias, sink = rand(1, 2, 6, 6, requires_grad=False), torch.randn(2, dtype=torch.float64)
    o = mt.attention(q, k, v, bias=bias, sink=sink)
    assert_grads(o, (q, k, v, bias, sink), {})
    assert api.calls[1][1]["dbias"] is None and api.calls[1][1]["dsink"] is None


@pytest.mark.parametrize("as_tensors", [False, True])
def test_dropout_seed_and_offset_reach_both_passes(api, as_tensors):
    b, s, hq, hk, d, p = 2, 8, 4, 2, 8, 0.3
    seed, offset = (1 << 63) + 99, 12
    q, k, v = rand(b, s, hq, d), rand(b, s, hk, d), rand(b, s, hk, d)
    bias = rand(1, 1, s, s)
    if as_tensors:
        kw = dict(seed=torch.tensor([seed - _UINT64]), offset=torch.tensor([offset]))
    else:
        kw = dict(seed=seed, offset=offset)
    o = mt.attention(q, k, v, causal=True, bias=bias, dropout_p=p, **kw)
    assert_grads(o, (q, k, v, bias, None), dict(causal=True, keep=keep_of(seed, offset, b, hq, s, s, p), p=p))
    for _, call in api.calls:
        assert call["dropout_p"] == p and _int(call["seed"]) == seed and _int(call["offset"]) == offset


class StubGenerator:
    def __init__(self, seed, offset):
        self.seed, self.offset = seed, offset

    def initial_seed(self):
        return self.seed

    def get_offset(self):
        return self.offset

    def set_offset(self, offset):
        self.offset = offset


def test_dropout_from_a_generator_advances_it_and_the_backward_reuses_the_draw(api):
    b, s, h, d, p = 1, 8, 2, 8, 0.5
    gen = StubGenerator(2024, 40)
    q, k, v = rand(b, s, h, d), rand(b, s, h, d), rand(b, s, h, d)
    o = mt.attention(q, k, v, dropout_p=p, generator=gen)
    assert gen.offset == 44
    assert_grads(o, (q, k, v, None, None), dict(keep=keep_of(2024, 40, b, h, s, s, p), p=p))
    assert [(_int(c["seed"]), _int(c["offset"])) for _, c in api.calls] == [(2024, 40), (2024, 40)]


def test_varlen_modifiers_and_gradients(api):
    cu_q, cu_k = torch.tensor([0, 5, 5, 12], dtype=torch.int32), torch.tensor([0, 6, 9, 16], dtype=torch.int32)
    hq, hk, d, cap = 4, 2, 8, 4.0
    q, k, v = rand(12, hq, d), rand(16, hk, d), rand(16, hk, d)
    bias, sink = rand(1, hq, 7, 7), torch.randn(hq, dtype=torch.float64).requires_grad_()
    o = mt.varlen_attention(q, k, v, cu_q, cu_k, 7, 7, causal=True, softcap=cap, bias=bias, sink=sink)
    do = torch.randn_like(o)
    o.backward(do)
    dbias_ref, dsink_ref = torch.zeros_like(bias), torch.zeros_like(sink)
    for q0, q1, k0, k1 in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()):
        leaves = [t.detach()[None, a:z].clone().requires_grad_() for t, a, z in ((q, q0, q1), (k, k0, k1), (v, k0, k1))]
        rb = bias.detach()[:, :, :q1 - q0, :k1 - k0].clone().requires_grad_()
        rs = sink.detach().clone().requires_grad_()
        ref = attention_ref(*leaves, causal=True, softcap=cap, bias=rb, sink=rs)
        torch.testing.assert_close(o[q0:q1], ref[0])
        ref.backward(do[None, q0:q1])
        for got, leaf in zip((q.grad[q0:q1], k.grad[k0:k1], v.grad[k0:k1]), leaves):
            torch.testing.assert_close(got, leaf.grad[0])
        dbias_ref[:, :, :q1 - q0, :k1 - k0] += rb.grad
        dsink_ref += rs.grad
    torch.testing.assert_close(bias.grad, dbias_ref)
    torch.testing.assert_close(sink.grad, dsink_ref)
    assert tuple(api.calls[1][1]["dbias"].shape) == (3, hq, 7, 7)


def test_compiled_operators_match_eager(api, cpu_ops):
    """torch.compile(fullgraph=True) through the custom operators (aot_eager: their fake implementations and
    autograd registration, the CPU kernels being the operators' own functions) gives eager mode's values."""
    torch._dynamo.reset()
    b, s, hq, hk, d = 2, 6, 4, 2, 8
    q, k, v = rand(b, s, hq, d), rand(b, s, hk, d), rand(b, s, hk, d)
    bias, sink = rand(1, hq, s, s), torch.randn(hq, dtype=torch.float64).requires_grad_()
    alibi = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64)

    def model(q, k, v, bias, sink):
        o = mt.attention(q, k, v, causal=True, softcap=4.0, bias=bias, sink=sink, dropout_p=0.25, seed=7, offset=3)
        o2 = mt.attention(q, k, v, alibi_slopes=alibi)
        return (o * o).sum() + o2.sum()

    loss = torch.compile(model, backend="aot_eager", fullgraph=True)(q, k, v, bias, sink)
    loss.backward()
    compiled = [t.grad.clone() for t in (q, k, v, bias, sink)]
    assert any(name == "fwd" and c.get("dropout_p") for name, c in api.calls)
    for t in (q, k, v, bias, sink):
        t.grad = None
    eager = model(q, k, v, bias, sink)
    eager.backward()
    torch.testing.assert_close(loss, eager)
    for got, t in zip(compiled, (q, k, v, bias, sink)):
        torch.testing.assert_close(got, t.grad)


def test_compiled_dropout_draws_when_it_runs(api, cpu_ops, monkeypatch):
    """Under torch.compile without seed / offset the forward operator draws them each time it runs (the default
    generator; a stub here) and its backward regenerates that draw's mask."""
    torch._dynamo.reset()
    gen = StubGenerator(5, 0)
    monkeypatch.setattr(mt, "_draw", lambda q, generator: (gen.seed, (gen.offset, gen.set_offset(gen.offset + 4))[0]))
    b, s, h, d, p = 1, 8, 2, 8, 0.4
    q, k, v = rand(b, s, h, d), rand(b, s, h, d), rand(b, s, h, d)
    fn = torch.compile(lambda q, k, v: mt.attention(q, k, v, dropout_p=p), backend="aot_eager", fullgraph=True)
    o = fn(q, k, v)
    assert gen.offset == 4
    assert_grads(o, (q, k, v, None, None), dict(keep=keep_of(5, 0, b, h, s, s, p), p=p))
    with torch.no_grad():
        o2 = fn(q, k, v)
    assert gen.offset == 8 and not torch.equal(o.detach(), o2)
    assert [(_int(c["seed"]), _int(c["offset"])) for _, c in api.calls] == [(5, 0), (5, 0), (5, 4)]


def test_compiled_varlen_matches_eager(api, cpu_ops):
    torch._dynamo.reset()
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    q, k, v = rand(10, 4, 8), rand(10, 2, 8), rand(10, 2, 8)
    bias = rand(2, 4, 6, 6)

    def model(q, k, v, bias):
        return mt.varlen_attention(q, k, v, cu, cu, 6, 6, causal=True, bias=bias).square().sum()

    loss = torch.compile(model, backend="aot_eager", fullgraph=True)(q, k, v, bias)
    loss.backward()
    compiled = [t.grad.clone() for t in (q, k, v, bias)]
    for t in (q, k, v, bias):
        t.grad = None
    model(q, k, v, bias).backward()
    for got, t in zip(compiled, (q, k, v, bias)):
        torch.testing.assert_close(got, t.grad)


@pytest.mark.parametrize("kwargs, words", [
    (dict(seed=1, offset=0), "dropout_p > 0"),
    (dict(dropout_p=0.1, seed=1), "together"),
    (dict(dropout_p=0.1, seed=1, offset=torch.zeros(1, dtype=torch.int64)), "both be ints"),
    (dict(dropout_p=0.1, seed=1, offset=0, generator=StubGenerator(1, 0)), "not both"),
    (dict(dropout_p=1.0), "[0, 1)"),
    (dict(dropout_p=True), "[0, 1)"),
    (dict(softcap="x"), "softcap"),
])
def test_bad_arguments_raise_one_sentence(api, kwargs, words):
    q, k, v = rand(1, 4, 2, 8), rand(1, 4, 2, 8), rand(1, 4, 2, 8)
    with pytest.raises((ValueError, TypeError)) as err:
        mt.attention(q, k, v, **kwargs)
    assert words in str(err.value) and "\n" not in str(err.value)
    assert api.calls == []
