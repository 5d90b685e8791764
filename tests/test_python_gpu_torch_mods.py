"""mhakit.torch's differentiable operators with the score modifiers and dropout: O and every gradient (dQ, dK, dV,
dbias summed over the dimensions a bias broadcasts, d sink) against fp32 attention written out in PyTorch with
autograd, in eager mode, under torch.compile(fullgraph=True) and in group mode; dropout from explicit seeds (the
kept scores from mhakit.reference's Philox) and from torch's generator; and the arguments refused with one
sentence."""
from __future__ import annotations

import pytest

from mhakit import reference as npref

pytestmark = [pytest.mark.gpu, pytest.mark.compile]

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("PyTorch sees no CUDA device", allow_module_level=True)

from test_python_gpu_callpath import close, kernel_cache, rand  # noqa: E402,F401  (autouse fixture)

import mhakit.torch as mt  # noqa: E402
from torch_attention_ref import attention_ref  # noqa: E402

SLOPES = [2.0 ** (-8.0 * (i + 1) / 4) for i in range(4)]


def keep_mask(seed: int, offset: int, b: int, h: int, sq: int, sk: int, p: float):
    """The kept scores of a batch-mode call, [b, h, sq, sk] bool, from the reference's Philox."""
    bytes_ = npref.dropout_randval(seed, offset, b, h, sq, sk)
    return torch.from_numpy(bytes_ <= npref.dropout_keep_max(p)).cuda()


def close_rel(got, want, tol):
    """Max abs error within tol times the reference's largest magnitude (dbias and d sink are small numbers: an
    absolute bound of bf16's size would pass a gradient of zeros)."""
    scale = want.float().abs().max().item()
    assert scale > 0, "a reference gradient of zeros checks nothing"
    err = (got.float() - want.float()).abs().max().item()
    assert err <= tol * scale, f"max abs error {err} > {tol} * {scale}"


def leaves(*tensors):
    """fp32 copies that require grad (None stays None)."""
    return [None if t is None else t.detach().float().requires_grad_() for t in tensors]


def check_against_reference(o, inputs, ref_kwargs, do, tol=2e-2, grad_tol=5e-2):
    """O against attention_ref, then every input's gradient (o.backward(do) already ran) against the reference's."""
    q, k, v, bias, sink = inputs
    rq, rk, rv, rbias, rsink = leaves(q, k, v, bias, sink)
    ref = attention_ref(rq, rk, rv, bias=rbias, sink=rsink, **ref_kwargs)
    close(o, ref, tol)
    ref.backward(do.float())
    for name, got, want in (("dq", q.grad, rq.grad), ("dk", k.grad, rk.grad), ("dv", v.grad, rv.grad),
                            ("dbias", None if bias is None else bias.grad, None if rbias is None else rbias.grad),
                            ("dsink", None if sink is None else sink.grad, None if rsink is None else rsink.grad)):
        if want is None:  # no bias / sink given
            continue
        assert got is not None, f"{name}: no gradient"
        assert got.shape == want.shape and got.dtype in (torch.bfloat16, torch.float32), (name, got.shape, got.dtype)
        if name in ("dbias", "dsink"):
            close_rel(got, want, grad_tol)
        else:
            close(got, want, grad_tol)


CASES = [
    # id, causal, modifier kwargs (bias / sink given as shapes, made below)
    ("softcap", False, {"softcap": 5.0}),
    ("softcap_causal", True, {"softcap": 5.0}),
    ("alibi_causal", True, {"alibi": True}),
    ("bias_broadcast", False, {"bias": (1, 1)}),
    ("bias_full_fp32_causal", True, {"bias": (2, 4), "bias_fp32": True}),
    ("bias_per_head", False, {"bias": (1, 4)}),
    ("sink", False, {"sink": True}),
    ("all_causal", True, {"softcap": 8.0, "bias": (2, 1), "sink": True}),
]


def make_inputs(b, sq, sk, hq, hk, d, spec):
    q = rand(b, sq, hq, d, requires_grad=True)
    k, v = rand(b, sk, hk, d, requires_grad=True), rand(b, sk, hk, d, requires_grad=True)
    bias = sink = alibi = None
    if "bias" in spec:
        bb, bh = spec["bias"]
        dt = torch.float32 if spec.get("bias_fp32") else torch.bfloat16
        bias = torch.randn(bb, bh, sq, sk, device="cuda", dtype=dt).requires_grad_()
    if spec.get("sink"):
        sink = torch.randn(hq, device="cuda", dtype=torch.float32).requires_grad_()
    if spec.get("alibi"):
        alibi = torch.tensor(SLOPES[:hq], device="cuda", dtype=torch.float32)
    return q, k, v, bias, sink, alibi


@pytest.mark.parametrize("name, causal, spec", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("hq, hk", [(4, 4), (4, 2)])
def test_modifiers_forward_and_gradients(name, causal, spec, hq, hk):
    b, sq, sk, d = 2, 150, 200, 64
    q, k, v, bias, sink, alibi = make_inputs(b, sq, sk, hq, hk, d, spec)
    softcap = spec.get("softcap")
    o = mt.attention(q, k, v, causal=causal, softcap=softcap, alibi_slopes=alibi, bias=bias, sink=sink)
    do = torch.randn_like(o)
    o.backward(do)
    check_against_reference(o, (q, k, v, bias, sink), {"causal": causal, "softcap": softcap, "alibi": alibi}, do)


def test_bias_without_grad_gets_none_and_bias_grad_alone():
    """A bias that does not require grad gets none (and the call writes no dbias); a bias alone requiring grad."""
    b, s, h, d = 1, 128, 2, 64
    q, k, v = (rand(b, s, h, d, requires_grad=True) for _ in range(3))
    bias = torch.randn(1, h, s, s, device="cuda", dtype=torch.bfloat16)
    mt.attention(q, k, v, bias=bias).sum().backward()
    assert bias.grad is None and q.grad is not None
    q2, k2, v2 = (t.detach() for t in (q, k, v))
    bias.requires_grad_()
    o = mt.attention(q2, k2, v2, bias=bias)
    do = torch.randn_like(o)
    o.backward(do)
    rbias = bias.detach().float().requires_grad_()
    attention_ref(q2, k2, v2, bias=rbias).backward(do.float())
    close_rel(bias.grad, rbias.grad, 5e-2)


@pytest.mark.parametrize("causal", [False, True])
def test_dropout_with_explicit_seed_matches_the_philox_reference(causal):
    b, s, hq, hk, d, p = 2, 160, 4, 2, 64, 0.25
    seed, offset = 1234567, 40
    q, k, v, bias, sink, _ = make_inputs(b, s, s, hq, hk, d, {"sink": True, "bias": (1, 1)})
    o = mt.attention(q, k, v, causal=causal, bias=bias, sink=sink, dropout_p=p, seed=seed, offset=offset)
    do = torch.randn_like(o)
    o.backward(do)
    keep = keep_mask(seed, offset, b, hq, s, s, p)
    check_against_reference(o, (q, k, v, bias, sink), {"causal": causal, "keep": keep, "p": p}, do)


def test_dropout_seed_and_offset_as_device_tensors():
    b, s, h, d, p = 1, 128, 2, 64, 0.3
    seed, offset = (1 << 63) + 12345, 8  # a seed above int64's range travels as a device tensor too
    q, k, v = (rand(b, s, h, d, requires_grad=True) for _ in range(3))
    seed_t = torch.tensor([seed - (1 << 64)], dtype=torch.int64, device="cuda")
    offset_t = torch.tensor([offset], dtype=torch.int64, device="cuda")
    o = mt.attention(q, k, v, dropout_p=p, seed=seed_t, offset=offset_t)
    do = torch.randn_like(o)
    o.backward(do)
    check_against_reference(o, (q, k, v, None, None), {"keep": keep_mask(seed, offset, b, h, s, s, p), "p": p}, do)
    o_int = mt.attention(q.detach(), k.detach(), v.detach(), dropout_p=p, seed=seed, offset=offset)
    assert torch.equal(o.detach(), o_int)


def test_dropout_from_the_generator_advances_it_and_the_backward_regenerates_the_mask():
    b, s, h, d, p = 1, 128, 2, 64, 0.4
    gen = torch.Generator(device="cuda")
    gen.manual_seed(77)
    q, k, v = (rand(b, s, h, d, requires_grad=True) for _ in range(3))
    seed, offset = gen.initial_seed(), gen.get_offset()
    o1 = mt.attention(q, k, v, dropout_p=p, generator=gen)
    assert gen.get_offset() == offset + 4
    do = torch.randn_like(o1)
    o1.backward(do)
    check_against_reference(o1, (q, k, v, None, None), {"keep": keep_mask(seed, offset, b, h, s, s, p), "p": p}, do)
    with torch.no_grad():
        o2 = mt.attention(q, k, v, dropout_p=p, generator=gen)  # the next offset: another mask
        assert not torch.equal(o1.detach(), o2)
        gen.set_offset(offset)
        assert torch.equal(o1.detach(), mt.attention(q, k, v, dropout_p=p, generator=gen))


def test_modifiers_under_compile_match_eager():
    torch._dynamo.reset()
    b, s, hq, hk, d = 2, 192, 4, 2, 64
    q, k, v, bias, sink, alibi = make_inputs(b, s, s, hq, hk, d, {"bias": (1, 1), "sink": True})

    def model(q, k, v, bias, sink):
        o = mt.attention(q, k, v, causal=True, softcap=10.0, bias=bias, sink=sink, dropout_p=0.1, seed=5, offset=4)
        return (o.float() * 1.5).square().sum()

    loss = torch.compile(model, fullgraph=True)(q, k, v, bias, sink)
    loss.backward()
    compiled = [t.grad.clone() for t in (q, k, v, bias, sink)]
    for t in (q, k, v, bias, sink):
        t.grad = None
    eager = model(q, k, v, bias, sink)
    eager.backward()
    assert abs(eager.item() - loss.item()) <= 1e-3 * max(1.0, abs(loss.item()))
    for got, t in zip(compiled, (q, k, v, bias, sink)):
        assert got.shape == t.shape
        close(got, t.grad, 1e-2)


@pytest.mark.parametrize("compiled", [False, True])
def test_varlen_modifiers_and_gradients(compiled):
    torch._dynamo.reset()
    lens_q, lens_k = [100, 0, 57], [120, 30, 57]
    cu_q = torch.tensor([0, 100, 100, 157], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 120, 150, 207], dtype=torch.int32, device="cuda")
    hq, hk, d, cap = 4, 2, 64, 6.0
    q = rand(157, hq, d, requires_grad=True)
    k, v = rand(207, hk, d, requires_grad=True), rand(207, hk, d, requires_grad=True)
    bias = torch.randn(1, hq, 100, 120, device="cuda", dtype=torch.bfloat16).requires_grad_()
    sink = torch.randn(hq, device="cuda", dtype=torch.float32).requires_grad_()

    def model(q, k, v, bias, sink):
        return mt.varlen_attention(q, k, v, cu_q, cu_k, 100, 120, causal=True, softcap=cap, bias=bias, sink=sink)

    fn = torch.compile(model, fullgraph=True) if compiled else model
    o = fn(q, k, v, bias, sink)
    do = torch.randn_like(o)
    o.backward(do)
    dbias_ref = torch.zeros(1, hq, 100, 120, device="cuda")
    dsink_ref = torch.zeros(hq, device="cuda")
    for (q0, nq), (k0, nk) in zip(zip(cu_q[:-1].tolist(), lens_q), zip(cu_k[:-1].tolist(), lens_k)):
        parts = leaves(q[None, q0:q0 + nq], k[None, k0:k0 + nk], v[None, k0:k0 + nk])
        rbias, rsink = leaves(bias[:, :, :nq, :nk], sink)
        ref = attention_ref(*parts, causal=True, softcap=cap, bias=rbias, sink=rsink)
        close(o[q0:q0 + nq], ref[0], 2e-2)
        ref.backward(do[None, q0:q0 + nq].float())
        for got, part in zip((q.grad[q0:q0 + nq], k.grad[k0:k0 + nk], v.grad[k0:k0 + nk]), parts):
            close(got, part.grad[0], 8e-2)
        dbias_ref[:, :, :nq, :nk] += rbias.grad
        dsink_ref += rsink.grad
    close_rel(bias.grad, dbias_ref, 5e-2)
    close_rel(sink.grad, dsink_ref, 5e-2)


def test_bad_modifier_arguments_raise_one_sentence():
    q, k, v = (rand(1, 64, 2, 64) for _ in range(3))
    bad = [
        (dict(seed=1, offset=0), "dropout_p > 0"),
        (dict(dropout_p=0.1, seed=1), "together"),
        (dict(dropout_p=0.1, seed=1, offset=torch.zeros(1, dtype=torch.int64, device="cuda")), "both be ints"),
        (dict(dropout_p=0.1, seed=1, offset=0, generator=torch.Generator(device="cuda")), "not both"),
        (dict(dropout_p=1.0), "[0, 1)"),
        (dict(softcap="x"), "softcap"),
        (dict(alibi_slopes=torch.ones(2, device="cuda"), bias=torch.zeros(1, 1, 64, 64, device="cuda")), "exclusive"),
        (dict(sink=torch.ones(3, device="cuda")), "sink"),
    ]
    for kwargs, words in bad:
        with pytest.raises((ValueError, TypeError)) as err:
            mt.attention(q, k, v, **kwargs)
        assert words in str(err.value) and "\n" not in str(err.value), (kwargs, str(err.value))


def test_dropout_under_compile_draws_from_the_default_generator_at_run_time():
    """The compiled forward operator draws (seed, offset) each time it runs and its backward regenerates that mask."""
    torch._dynamo.reset()
    b, s, h, d, p = 1, 128, 2, 64, 0.2
    q, k, v = (rand(b, s, h, d, requires_grad=True) for _ in range(3))
    compiled = torch.compile(lambda q, k, v: mt.attention(q, k, v, causal=True, dropout_p=p), fullgraph=True)
    gen = torch.cuda.default_generators[q.device.index]
    seed, offset = gen.initial_seed(), gen.get_offset()
    o = compiled(q, k, v)
    assert gen.get_offset() == offset + 4
    do = torch.randn_like(o)
    o.backward(do)
    check_against_reference(o, (q, k, v, None, None),
                            {"causal": True, "keep": keep_mask(seed, offset, b, h, s, s, p), "p": p}, do)
    with torch.no_grad():
        assert not torch.equal(o.detach(), compiled(q, k, v))  # the next run: the next offset
