"""Differentiable attention for PyTorch: ``mhakit.torch.attention`` and ``mhakit.torch.varlen_attention``.

The forward and backward are registered as PyTorch custom operators (``torch.ops.mhakit.*``, through
``torch.library.custom_op``) with fake implementations, so ``torch.compile(fullgraph=True)`` traces a model that
calls them without a graph break, and autograd runs mhakit's backward; in eager mode the same calls run through a
plain ``torch.autograd.Function`` (the operators' Python dispatch would cost more host time than the kernels' own
call path). Both launch through mhakit's C call path on
the tensors' current stream. torch is imported here only: ``import mhakit`` never imports it.

    import mhakit.torch as mt
    o = mt.attention(q, k, v, causal=True)                                  # q [b, s, h, d] (layout='bshd')
    o = mt.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True)

Arguments mean what they mean in :func:`mhakit.mha_fwd` (causal is bottom-right aligned, as in FlashAttention;
``window=(left, right)``; ``mask=`` aiter's mask strings; GQA/MQA by head counts). ``deterministic=True`` makes the
gradients bitwise reproducible.

Score modifiers, as on :func:`mhakit.mha_fwd`: ``softcap=``, ``alibi_slopes=`` (float32 [h_q] or [b, h_q]; no
gradient), ``bias=`` ([b|1, h_q|1, s_q, s_k], float32 or q's dtype; varlen [b|1, h_q|1, max_seqlen_q,
max_seqlen_k]) and ``sink=`` (float32 [h_q]). A bias or a sink that requires grad gets its gradient (dbias summed
over the dimensions it broadcasts; d sink). Dropout: ``dropout_p=`` with ``seed=`` and ``offset=`` (ints, or CUDA
int64 tensors of one element, read when the kernels run: what a CUDA graph needs), or without them from torch's CUDA
generator (``generator=``, else the device's default one): its seed, and its offset, which each call advances by 4,
so consecutive calls draw independent masks; the backward regenerates the forward's. Under torch.compile the
forward operator draws from the default generator each time it runs and hands the values to the backward (pass
seed= and offset= as device tensors for a CUDA-graph replay to draw anew: a replay runs no Python).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from . import api

__all__ = ["attention", "varlen_attention"]

Tensor = torch.Tensor


def _tensor(x: Any) -> Tensor:
    """The C call path returns torch tensors for torch inputs; the Python path returns mhakit.DeviceArray."""
    return x if isinstance(x, Tensor) else torch.from_dlpack(x)


def _head_contiguous(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


# The modifiers of a call other than the differentiable bias and sink: (softcap, alibi_slopes, dropout_p, seed,
# offset), seed / offset ints or one-element device tensors (both None without dropout). _NO_MODS: none.
_NO_MODS = (0.0, None, 0.0, None, None)


def _mod_kwargs(bias, sink, mods) -> dict:
    """The modifier keywords of mhakit's calls (only those a call sets, so that a plain call stays plain)."""
    softcap, alibi, dropout_p, seed, offset = mods
    kw = {}
    if softcap:
        kw["softcap"] = softcap
    if alibi is not None:
        kw["alibi_slopes"] = alibi
    if bias is not None:
        kw["bias"] = bias
    if sink is not None:
        kw["sink"] = sink
    if dropout_p:
        kw.update(dropout_p=dropout_p, seed=seed, offset=offset)
    return kw


def _forward(q, k, v, varlen, mask, scale, layout, bias=None, sink=None, mods=_NO_MODS):
    """(O, LSE) as torch tensors; varlen is None or (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)."""
    kw = _mod_kwargs(bias, sink, mods)
    if varlen is None:
        o, lse = api.mha_fwd(q, k, v, mask=mask, scale=scale, layout=layout, return_lse=True, **kw)
    else:
        o, lse = api.mha_varlen_fwd(q, k, v, *varlen, mask=mask, scale=scale, return_lse=True, **kw)
    return _tensor(o), _tensor(lse)


def _full_bias_shape(q, varlen, layout, bias):
    """The shape of the backward's dbias: [b, h_q, s_q, s_k] (varlen: [b, h_q, max_seqlen_q, max_seqlen_k])."""
    if varlen is not None:
        return (len(varlen[0]) - 1, q.shape[1], varlen[2], varlen[3])
    b, hq = (q.shape[0], q.shape[2]) if layout == "bshd" else (q.shape[0], q.shape[1])
    return (b, hq, bias.shape[2], bias.shape[3])


def _backward(do, q, k, v, o, lse, varlen, mask, scale, layout, deterministic, bias=None, sink=None, mods=_NO_MODS,
              need_dbias=False, need_dsink=False):
    """(dQ, dK, dV, dbias or None, dsink or None) as torch tensors, for the forward _forward ran; dbias has the
    bias's shape (summed over the dimensions the bias broadcasts)."""
    do = _head_contiguous(do)
    kw = _mod_kwargs(bias, sink, mods)
    dbias = dsink = None
    if need_dbias:
        # varlen: the positions outside a sequence's lengths are never written, and their gradient is 0
        alloc = torch.zeros if varlen is not None else torch.empty
        kw["dbias"] = dbias = alloc(_full_bias_shape(q, varlen, layout, bias), dtype=bias.dtype, device=q.device)
    if need_dsink:
        kw["dsink"] = dsink = torch.empty(sink.shape, dtype=torch.float32, device=q.device)
    if varlen is None:
        grads = api.mha_bwd(do, q, k, v, o, lse, mask=mask, scale=scale, layout=layout, deterministic=deterministic,
                            **kw)
    else:
        grads = api.mha_varlen_bwd(do, q, k, v, o, lse, *varlen, mask=mask, scale=scale,
                                   deterministic=deterministic, **kw)
    if dbias is not None:
        broadcast = [axis for axis in (0, 1) if bias.shape[axis] == 1 and dbias.shape[axis] != 1]
        if broadcast:
            acc = torch.float32 if bias.dtype in (torch.float16, torch.bfloat16) else bias.dtype
            dbias = dbias.sum(dim=broadcast, keepdim=True, dtype=acc).to(bias.dtype)
    return tuple(_tensor(g) for g in grads) + (dbias, dsink)


_UINT64 = 1 << 64


def _draw(q: Tensor, generator: Any) -> Tuple[int, int]:
    """(seed, offset) from torch's CUDA generator (the device's default one unless given), its offset advanced by 4
    so that the next call draws another mask."""
    gen = generator if generator is not None else torch.cuda.default_generators[q.device.index]
    seed, offset = gen.initial_seed() % _UINT64, gen.get_offset()
    gen.set_offset(offset + 4)
    return seed, offset % _UINT64


def _dropout_state(q: Tensor, dropout_p: Any, seed: Any, offset: Any, generator: Any):
    """(dropout_p, seed, offset) of a call: seed / offset as given (ints or one-element device tensors), else drawn
    from the generator (eager), or both None under torch.compile, where the forward operator draws them when it
    runs. (0.0, None, None) without dropout."""
    p = api._dropout_probability(dropout_p)
    if p == 0.0:
        if seed is not None or offset is not None or generator is not None:
            raise ValueError("seed, offset and generator are dropout's: give them with dropout_p > 0")
        return 0.0, None, None
    if (seed is None) != (offset is None):
        raise ValueError("give seed and offset together (or neither, to draw them from the generator)")
    if seed is not None:
        if generator is not None:
            raise ValueError("give either seed and offset or generator, not both")
        if isinstance(seed, Tensor) != isinstance(offset, Tensor):
            raise ValueError("seed and offset must both be ints or both be one-element device tensors")
        return p, seed, offset
    if torch.compiler.is_compiling():
        if generator is not None:
            raise ValueError("under torch.compile, dropout draws from the default CUDA generator: pass seed= and "
                             "offset= instead of generator=")
        return p, None, None
    return (p,) + _draw(q, generator)


def _signed(x: int) -> int:
    """A uint64 as the int64 of the same bits (the operators' schema has signed ints only)."""
    return x - _UINT64 if x >= 1 << 63 else x


def _op_dropout(mods) -> tuple:
    """The forward operators' dropout arguments of a mods tuple: seed_t, offset_t (device tensors or None), seed,
    offset (ints as int64 bits), draw (the operator draws them from the default generator when it runs)."""
    dropout_p, seed, offset = mods[2:]
    if isinstance(seed, Tensor):
        return seed, offset, 0, 0, False
    if seed is None:
        return None, None, 0, 0, bool(dropout_p)
    return None, None, _signed(int(seed)), _signed(int(offset)), False


def _run_mods(q, softcap, alibi, dropout_p, seed_t, offset_t, seed, offset, draw):
    """In a forward operator: the mods tuple of the call, and its rng state, an int64 CPU tensor [seed, offset] (the
    ints the call used, as int64 bits; zeros with device-tensor seeds or without dropout) that the backward reads."""
    if not dropout_p:
        return (softcap, alibi, 0.0, None, None), torch.zeros(2, dtype=torch.int64)
    if seed_t is not None:
        return (softcap, alibi, dropout_p, seed_t, offset_t), torch.zeros(2, dtype=torch.int64)
    if draw:
        seed, offset = _draw(q, None)
    seed, offset = seed % _UINT64, offset % _UINT64
    return (softcap, alibi, dropout_p, seed, offset), torch.tensor([_signed(seed), _signed(offset)], dtype=torch.int64)


def _saved_mods(softcap, alibi, dropout_p, seed_t, offset_t, rng):
    """In a backward operator: the forward's mods tuple again, from its rng state."""
    if not dropout_p:
        return softcap, alibi, 0.0, None, None
    if seed_t is not None:
        return softcap, alibi, dropout_p, seed_t, offset_t
    seed, offset = (x % _UINT64 for x in rng.tolist())
    return softcap, alibi, dropout_p, seed, offset


def _op_grads(q, grads):
    """The backward operators' outputs: dbias / dsink as empty tensors where they were not asked for."""
    dq, dk, dv, dbias, dsink = grads
    return (dq, dk, dv, q.new_empty(0) if dbias is None else dbias,
            q.new_empty(0, dtype=torch.float32) if dsink is None else dsink)


def _fake_grads(q, k, v, bias, sink, need_dbias, need_dsink):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            torch.empty_like(bias) if need_dbias else q.new_empty(0),
            torch.empty_like(sink) if need_dsink else q.new_empty(0, dtype=torch.float32))


def _differentiable(t) -> bool:
    return t is not None and t.requires_grad


# ---- batch mode -----------------------------------------------------------------------------------------------
# The operators take the modifiers flat (the schema has no tuples): bias, alibi_slopes, sink, seed_t, offset_t
# (optional tensors), softcap, dropout_p, seed, offset, draw (scalars; _op_dropout). The forward returns (O, LSE,
# rng state); the backward takes the rng state and returns dbias / dsink as empty tensors where no gradient was
# asked for.

@torch.library.custom_op("mhakit::attention_fwd", mutates_args=(), device_types="cuda")
def _attention_fwd(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], alibi_slopes: Optional[Tensor],
                   sink: Optional[Tensor], seed_t: Optional[Tensor], offset_t: Optional[Tensor], mask_type: int,
                   left: int, right: int, scale: float, layout: str, deterministic: bool, softcap: float,
                   dropout_p: float, seed: int, offset: int, draw: bool) -> Tuple[Tensor, Tensor, Tensor]:
    mods, rng = _run_mods(q, softcap, alibi_slopes, dropout_p, seed_t, offset_t, seed, offset, draw)
    return _forward(q, k, v, None, (mask_type, left, right), scale, layout, bias, sink, mods) + (rng,)


@_attention_fwd.register_fake
def _(q, k, v, bias, alibi_slopes, sink, seed_t, offset_t, mask_type, left, right, scale, layout, deterministic,
      softcap, dropout_p, seed, offset, draw):
    if layout == "bshd":
        b, sq, hq, _ = q.shape
        o_shape = (b, sq, hq, v.shape[-1])
    else:
        b, hq, sq, _ = q.shape
        o_shape = (b, hq, sq, v.shape[-1])
    return (q.new_empty(o_shape), q.new_empty((b, hq, sq), dtype=torch.float32),
            torch.empty(2, dtype=torch.int64, device="cpu"))


@torch.library.custom_op("mhakit::attention_bwd", mutates_args=(), device_types="cuda")
def _attention_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, bias: Optional[Tensor],
                   alibi_slopes: Optional[Tensor], sink: Optional[Tensor], seed_t: Optional[Tensor],
                   offset_t: Optional[Tensor], rng: Tensor, mask_type: int, left: int, right: int, scale: float,
                   layout: str, deterministic: bool, softcap: float, dropout_p: float, need_dbias: bool,
                   need_dsink: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    mods = _saved_mods(softcap, alibi_slopes, dropout_p, seed_t, offset_t, rng)
    grads = _backward(do, q, k, v, o, lse, None, (mask_type, left, right), scale, layout, deterministic, bias, sink,
                      mods, need_dbias, need_dsink)
    return _op_grads(q, grads)


@_attention_bwd.register_fake
def _(do, q, k, v, o, lse, bias, alibi_slopes, sink, seed_t, offset_t, rng, mask_type, left, right, scale, layout,
      deterministic, softcap, dropout_p, need_dbias, need_dsink):
    return _fake_grads(q, k, v, bias, sink, need_dbias, need_dsink)


def _setup_fwd(ctx, inputs, output):
    q, k, v, bias, alibi, sink, seed_t, offset_t = inputs[:8]
    o, lse, rng = output
    ctx.save_for_backward(q, k, v, o, lse, bias, alibi, sink, seed_t, offset_t, rng)
    # mask_type, left, right, scale, layout, deterministic, softcap, dropout_p; then which gradients to compute
    ctx.options = tuple(inputs[8:16]) + (_differentiable(bias), _differentiable(sink))


def _backward_fwd(ctx, do, dlse, drng):
    need_dbias, need_dsink = ctx.options[-2:]
    dq, dk, dv, dbias, dsink = torch.ops.mhakit.attention_bwd(do, *ctx.saved_tensors, *ctx.options)
    return (dq, dk, dv, dbias if need_dbias else None, None, dsink if need_dsink else None) + (None,) * 13


_attention_fwd.register_autograd(_backward_fwd, setup_context=_setup_fwd)


# ---- group mode (packed variable-length sequences) ------------------------------------------------------------

@torch.library.custom_op("mhakit::varlen_attention_fwd", mutates_args=(), device_types="cuda")
def _varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, bias: Optional[Tensor],
                alibi_slopes: Optional[Tensor], sink: Optional[Tensor], seed_t: Optional[Tensor],
                offset_t: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int, mask_type: int, left: int,
                right: int, scale: float, deterministic: bool, softcap: float, dropout_p: float, seed: int,
                offset: int, draw: bool) -> Tuple[Tensor, Tensor, Tensor]:
    mods, rng = _run_mods(q, softcap, alibi_slopes, dropout_p, seed_t, offset_t, seed, offset, draw)
    return _forward(q, k, v, (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), (mask_type, left, right),
                    scale, "bshd", bias, sink, mods) + (rng,)


@_varlen_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, bias, alibi_slopes, sink, seed_t, offset_t, max_seqlen_q, max_seqlen_k,
      mask_type, left, right, scale, deterministic, softcap, dropout_p, seed, offset, draw):
    tq, hq, _ = q.shape
    return (q.new_empty((tq, hq, v.shape[-1])), q.new_empty((hq, tq), dtype=torch.float32),
            torch.empty(2, dtype=torch.int64, device="cpu"))


@torch.library.custom_op("mhakit::varlen_attention_bwd", mutates_args=(), device_types="cuda")
def _varlen_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, cu_seqlens_q: Tensor,
                cu_seqlens_k: Tensor, bias: Optional[Tensor], alibi_slopes: Optional[Tensor], sink: Optional[Tensor],
                seed_t: Optional[Tensor], offset_t: Optional[Tensor], rng: Tensor, max_seqlen_q: int,
                max_seqlen_k: int, mask_type: int, left: int, right: int, scale: float, deterministic: bool,
                softcap: float, dropout_p: float, need_dbias: bool,
                need_dsink: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    mods = _saved_mods(softcap, alibi_slopes, dropout_p, seed_t, offset_t, rng)
    grads = _backward(do, q, k, v, o, lse, (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
                      (mask_type, left, right), scale, "bshd", deterministic, bias, sink, mods, need_dbias,
                      need_dsink)
    return _op_grads(q, grads)


@_varlen_bwd.register_fake
def _(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, bias, alibi_slopes, sink, seed_t, offset_t, rng, max_seqlen_q,
      max_seqlen_k, mask_type, left, right, scale, deterministic, softcap, dropout_p, need_dbias, need_dsink):
    return _fake_grads(q, k, v, bias, sink, need_dbias, need_dsink)


def _setup_varlen(ctx, inputs, output):
    q, k, v, cu_q, cu_k, bias, alibi, sink, seed_t, offset_t = inputs[:10]
    o, lse, rng = output
    ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k, bias, alibi, sink, seed_t, offset_t, rng)
    # max_seqlen_q, max_seqlen_k, mask_type, left, right, scale, deterministic, softcap, dropout_p; then flags
    ctx.options = tuple(inputs[10:19]) + (_differentiable(bias), _differentiable(sink))


def _backward_varlen(ctx, do, dlse, drng):
    need_dbias, need_dsink = ctx.options[-2:]
    dq, dk, dv, dbias, dsink = torch.ops.mhakit.varlen_attention_bwd(do, *ctx.saved_tensors, *ctx.options)
    return (dq, dk, dv, None, None, dbias if need_dbias else None, None, dsink if need_dsink else None) + (None,) * 14


_varlen_fwd.register_autograd(_backward_varlen, setup_context=_setup_varlen)


# ---- eager mode: the same calls through an autograd.Function (the custom operators' dispatch costs ~150 us of
# host time a step; a traced graph pays it once) ------------------------------------------------------------------

class _Eager(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bias, sink, varlen, options, mods):
        mask, scale, layout = options[:3], options[3], options[4]
        o, lse = _forward(q, k, v, varlen, mask, scale, layout, bias, sink, mods)
        ctx.save_for_backward(q, k, v, o, lse, bias, sink)
        ctx.varlen, ctx.options, ctx.mods = varlen, options, mods
        return o

    @staticmethod
    def backward(ctx, do):
        mask, scale, layout, deterministic = ctx.options[:3], ctx.options[3], ctx.options[4], ctx.options[5]
        q, k, v, o, lse, bias, sink = ctx.saved_tensors
        need_dbias, need_dsink = ctx.needs_input_grad[3], ctx.needs_input_grad[4]
        dq, dk, dv, dbias, dsink = _backward(do, q, k, v, o, lse, ctx.varlen, mask, scale, layout, deterministic,
                                             bias, sink, ctx.mods, need_dbias, need_dsink)
        return dq, dk, dv, dbias, dsink, None, None, None


# ---- the public functions -------------------------------------------------------------------------------------

def _options(q: Tensor, causal: bool, window: Any, mask: Any, scale: Optional[float]):
    mask_type, left, right = api._resolve_mask(causal, mask, window)
    return mask_type, left, right, api._resolve_scale(scale, q.shape[-1])


def _mods(q: Tensor, softcap: Any, alibi_slopes: Any, dropout_p: Any, seed: Any, offset: Any, generator: Any):
    """The call's mods tuple (see _NO_MODS); the values mhakit's calls validate are passed through as given."""
    cap = 0.0 if softcap is None else softcap
    if isinstance(cap, bool) or not isinstance(cap, (int, float)):
        raise TypeError(f"softcap must be a number (got {softcap!r}; 0 or None turns it off)")
    return (float(cap), alibi_slopes) + _dropout_state(q, dropout_p, seed, offset, generator)


def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, window: Any = None, mask: Any = None,
              scale: Optional[float] = None, deterministic: bool = False, layout: str = "bshd",
              softcap: Optional[float] = None, alibi_slopes: Optional[Tensor] = None, bias: Optional[Tensor] = None,
              sink: Optional[Tensor] = None, dropout_p: float = 0.0, seed: Any = None, offset: Any = None,
              generator: Optional[torch.Generator] = None) -> Tensor:
    """Fused attention with autograd: O = softmax(scale · Q Kᵀ + mask) V (see :func:`mhakit.mha_fwd`), with the
    score modifiers and dropout of this module's docstring."""
    api._check_layout(layout)
    mask_type, left, right, scale = _options(q, causal, window, mask, scale)
    deterministic = api._as_flag(deterministic, "deterministic")
    mods = _mods(q, softcap, alibi_slopes, dropout_p, seed, offset, generator)
    if not torch.compiler.is_compiling():
        return _Eager.apply(q, k, v, bias, sink, None, (mask_type, left, right, scale, layout, deterministic), mods)
    seed_t, offset_t, seed, offset, draw = _op_dropout(mods)
    o, _, _ = torch.ops.mhakit.attention_fwd(q, k, v, bias, mods[1], sink, seed_t, offset_t, mask_type, left, right,
                                             scale, layout, deterministic, mods[0], mods[2], seed, offset, draw)
    return o


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                     max_seqlen_k: int, *, causal: bool = False, window: Any = None, mask: Any = None,
                     scale: Optional[float] = None, deterministic: bool = False, softcap: Optional[float] = None,
                     alibi_slopes: Optional[Tensor] = None, bias: Optional[Tensor] = None,
                     sink: Optional[Tensor] = None, dropout_p: float = 0.0, seed: Any = None, offset: Any = None,
                     generator: Optional[torch.Generator] = None) -> Tensor:
    """Fused attention with autograd over packed sequences (see :func:`mhakit.mha_varlen_fwd`); cu_seqlens are
    int32 tensors on the GPU. Modifiers and dropout as :func:`attention`'s (bias [b|1, h_q|1, max_seqlen_q,
    max_seqlen_k])."""
    mask_type, left, right, scale = _options(q, causal, window, mask, scale)
    deterministic = api._as_flag(deterministic, "deterministic")
    mods = _mods(q, softcap, alibi_slopes, dropout_p, seed, offset, generator)
    if not torch.compiler.is_compiling():
        return _Eager.apply(q, k, v, bias, sink, (cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k)),
                            (mask_type, left, right, scale, "bshd", deterministic), mods)
    seed_t, offset_t, seed, offset, draw = _op_dropout(mods)
    o, _, _ = torch.ops.mhakit.varlen_attention_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, bias, mods[1], sink, seed_t,
                                                    offset_t, int(max_seqlen_q), int(max_seqlen_k), mask_type, left,
                                                    right, scale, deterministic, mods[0], mods[2], seed, offset, draw)
    return o
