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


def _forward(q, k, v, varlen, mask, scale, layout):
    """(O, LSE) as torch tensors; varlen is None or (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)."""
    if varlen is None:
        o, lse = api.mha_fwd(q, k, v, mask=mask, scale=scale, layout=layout, return_lse=True)
    else:
        o, lse = api.mha_varlen_fwd(q, k, v, *varlen, mask=mask, scale=scale, return_lse=True)
    return _tensor(o), _tensor(lse)


def _backward(do, q, k, v, o, lse, varlen, mask, scale, layout, deterministic):
    """(dQ, dK, dV) as torch tensors, for the forward _forward ran."""
    do = _head_contiguous(do)
    if varlen is None:
        grads = api.mha_bwd(do, q, k, v, o, lse, mask=mask, scale=scale, layout=layout, deterministic=deterministic)
    else:
        grads = api.mha_varlen_bwd(do, q, k, v, o, lse, *varlen, mask=mask, scale=scale, deterministic=deterministic)
    return tuple(_tensor(g) for g in grads)


# ---- batch mode -----------------------------------------------------------------------------------------------

@torch.library.custom_op("mhakit::attention_fwd", mutates_args=(), device_types="cuda")
def _attention_fwd(q: Tensor, k: Tensor, v: Tensor, mask_type: int, left: int, right: int, scale: float,
                   layout: str, deterministic: bool) -> Tuple[Tensor, Tensor]:
    return _forward(q, k, v, None, (mask_type, left, right), scale, layout)


@_attention_fwd.register_fake
def _(q, k, v, mask_type, left, right, scale, layout, deterministic):
    if layout == "bshd":
        b, sq, hq, _ = q.shape
        o_shape = (b, sq, hq, v.shape[-1])
    else:
        b, hq, sq, _ = q.shape
        o_shape = (b, hq, sq, v.shape[-1])
    return q.new_empty(o_shape), q.new_empty((b, hq, sq), dtype=torch.float32)


@torch.library.custom_op("mhakit::attention_bwd", mutates_args=(), device_types="cuda")
def _attention_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, mask_type: int, left: int,
                   right: int, scale: float, layout: str, deterministic: bool) -> Tuple[Tensor, Tensor, Tensor]:
    return _backward(do, q, k, v, o, lse, None, (mask_type, left, right), scale, layout, deterministic)


@_attention_bwd.register_fake
def _(do, q, k, v, o, lse, mask_type, left, right, scale, layout, deterministic):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_fwd(ctx, inputs, output):
    q, k, v, mask_type, left, right, scale, layout, deterministic = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.options = (mask_type, left, right, scale, layout, deterministic)


def _backward_fwd(ctx, do, dlse):
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.mhakit.attention_bwd(do, q, k, v, o, lse, *ctx.options)
    return dq, dk, dv, None, None, None, None, None, None


_attention_fwd.register_autograd(_backward_fwd, setup_context=_setup_fwd)


# ---- group mode (packed variable-length sequences) ------------------------------------------------------------

@torch.library.custom_op("mhakit::varlen_attention_fwd", mutates_args=(), device_types="cuda")
def _varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                max_seqlen_k: int, mask_type: int, left: int, right: int, scale: float,
                deterministic: bool) -> Tuple[Tensor, Tensor]:
    return _forward(q, k, v, (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), (mask_type, left, right),
                    scale, "bshd")


@_varlen_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, mask_type, left, right, scale, deterministic):
    tq, hq, _ = q.shape
    return q.new_empty((tq, hq, v.shape[-1])), q.new_empty((hq, tq), dtype=torch.float32)


@torch.library.custom_op("mhakit::varlen_attention_bwd", mutates_args=(), device_types="cuda")
def _varlen_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, cu_seqlens_q: Tensor,
                cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, mask_type: int, left: int, right: int,
                scale: float, deterministic: bool) -> Tuple[Tensor, Tensor, Tensor]:
    return _backward(do, q, k, v, o, lse, (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
                     (mask_type, left, right), scale, "bshd", deterministic)


@_varlen_bwd.register_fake
def _(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, mask_type, left, right, scale,
      deterministic):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_varlen(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, mask_type, left, right, scale, deterministic = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k)
    ctx.options = (max_q, max_k, mask_type, left, right, scale, deterministic)


def _backward_varlen(ctx, do, dlse):
    q, k, v, o, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = torch.ops.mhakit.varlen_attention_bwd(do, q, k, v, o, lse, cu_q, cu_k, *ctx.options)
    return (dq, dk, dv) + (None,) * 9


_varlen_fwd.register_autograd(_backward_varlen, setup_context=_setup_varlen)


# ---- eager mode: the same calls through an autograd.Function (the custom operators' dispatch costs ~150 us of
# host time a step; a traced graph pays it once) ------------------------------------------------------------------

class _Eager(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, varlen, options):
        mask, scale, layout = options[:3], options[3], options[4]
        o, lse = _forward(q, k, v, varlen, mask, scale, layout)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.varlen, ctx.options = varlen, options
        return o

    @staticmethod
    def backward(ctx, do):
        mask, scale, layout, deterministic = ctx.options[:3], ctx.options[3], ctx.options[4], ctx.options[5]
        grads = _backward(do, *ctx.saved_tensors, ctx.varlen, mask, scale, layout, deterministic)
        return grads + (None, None)


# ---- the public functions -------------------------------------------------------------------------------------

def _options(q: Tensor, causal: bool, window: Any, mask: Any, scale: Optional[float]):
    mask_type, left, right = api._resolve_mask(causal, mask, window)
    return mask_type, left, right, api._resolve_scale(scale, q.shape[-1])


def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, window: Any = None, mask: Any = None,
              scale: Optional[float] = None, deterministic: bool = False, layout: str = "bshd") -> Tensor:
    """Fused attention with autograd: O = softmax(scale · Q Kᵀ + mask) V (see :func:`mhakit.mha_fwd`)."""
    api._check_layout(layout)
    mask_type, left, right, scale = _options(q, causal, window, mask, scale)
    deterministic = api._as_flag(deterministic, "deterministic")
    if not torch.compiler.is_compiling():
        return _Eager.apply(q, k, v, None, (mask_type, left, right, scale, layout, deterministic))
    o, _ = torch.ops.mhakit.attention_fwd(q, k, v, mask_type, left, right, scale, layout, deterministic)
    return o


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                     max_seqlen_k: int, *, causal: bool = False, window: Any = None, mask: Any = None,
                     scale: Optional[float] = None, deterministic: bool = False) -> Tensor:
    """Fused attention with autograd over packed sequences (see :func:`mhakit.mha_varlen_fwd`); cu_seqlens are
    int32 tensors on the GPU."""
    mask_type, left, right, scale = _options(q, causal, window, mask, scale)
    deterministic = api._as_flag(deterministic, "deterministic")
    if not torch.compiler.is_compiling():
        return _Eager.apply(q, k, v, (cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k)),
                            (mask_type, left, right, scale, "bshd", deterministic))
    o, _ = torch.ops.mhakit.varlen_attention_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                                                 int(max_seqlen_k), mask_type, left, right, scale, deterministic)
    return o
