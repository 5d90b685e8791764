"""The Python calls: ``mha_fwd`` / ``mha_bwd`` (batch mode), ``mha_varlen_fwd`` / ``mha_varlen_bwd`` (group
mode, packed tokens) and ``mha_fwd_kvcache`` (decode against a contiguous or paged KV cache).

Arrays come in through DLPack or ``__cuda_array_interface__`` (CuPy, PyTorch, JAX, ...): pointers, shapes and
element strides are read, nothing is copied. Outputs are allocated on the inputs' device, stream-ordered on the call's
stream, and returned as :class:`mhakit.DeviceArray` (DLPack and CAI capable), or written into ``out=`` / ``lse_out=``
(forward) and ``dq=`` / ``dk=`` / ``dv=`` (backward). The backward's scratch memory is allocated per call on the
call's stream and freed after the launch, stream-ordered. The library a call needs (libmha_fwd.so or libmha_bwd.so)
is built on first use and cached (:mod:`mhakit.jit`).

Every argument is checked before anything touches the GPU; a mismatch raises ValueError (shapes, devices, values)
or TypeError (types and dtypes) that names the argument and says what was expected.
"""

from __future__ import annotations

import ctypes
import math
import numbers
import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple

from . import _arrays, _codegen
from . import _ext as _ext_module
from ._arrays import ArrayView, DeviceArray

__all__ = ["mha_fwd", "mha_varlen_fwd", "mha_fwd_kvcache", "mha_bwd", "mha_varlen_bwd"]

# MHAKIT_LOG_LEVEL=1: each call prints the kernel instance it launches ("[mhakit] mha_fwd -> <name>", likewise
# mha_bwd) to stdout.
LOG_LEVEL = int(os.environ.get("MHAKIT_LOG_LEVEL", "0") or 0)
_DTYPE_NAMES = {"fp16": "fp16", "float16": "fp16", "half": "fp16", "bf16": "bf16", "bfloat16": "bf16",
                "fp8": "fp8", "float8_e4m3fn": "fp8"}
_STORAGE_OF = {"fp16": "float16", "bf16": "bfloat16"}
# fp8 inputs (float8_e4m3fn; forward, batch mode): the kernel dtype of each output type, bf16 the default (aiter's
# fp8bf16).
_FP8_KINDS = {"bf16": "fp8bf16", "fp16": "fp8fp16"}
_INT32_MAX = (1 << 31) - 1
_NO_MASK, _CAUSAL = (0, -1, -1), (2, -1, 0)  # (mask_type, left, right)
_MASK_NAMES = {"none": 0, "top_left": 1, "bottom_right": 2, "generic": 3, "t": 1, "b": 2, "g": 3}


# ------------------------------------------------------------------------------------------------------------------
# Argument checks (no GPU)
# ------------------------------------------------------------------------------------------------------------------

def _kernel_dtype(view: ArrayView, override: Optional[str]) -> str:
    name = view.dtype.name
    if name in ("float16", "bfloat16"):
        kind = "fp16" if name == "float16" else "bf16"
        if override is not None and override != kind:
            raise TypeError(f"{view.name}: has dtype {name} but dtype={override!r} was given")
        return kind
    if name in ("uint16", "int16"):
        if override is None or override == "fp8":
            raise TypeError(f"{view.name}: dtype {name} holds raw 16-bit values; pass dtype='bf16' or dtype='fp16' "
                            "to say how to read them (e.g. bf16 data in a framework without a bfloat16 dtype)")
        return override
    if name in ("uint8", "int8") and override == "fp8":
        return "fp8"  # e4m3 bytes in a framework without a float8 dtype (CuPy)
    if name == "float8_e4m3fn":
        if override not in (None, "fp8"):
            raise TypeError(f"{view.name}: has dtype {name} but dtype={override!r} was given")
        return "fp8"  # the call's out_dtype completes it (_fp8_call)
    raise TypeError(f"{view.name}: dtype {name} is not supported; expected float16, bfloat16 or float8_e4m3fn "
                    "(forward)")


def _no_fp8(kind: str, what: str) -> None:
    if kind == "fp8":
        raise TypeError(f"float8_e4m3fn inputs run on mha_fwd only (batch mode); {what} takes float16 or bfloat16")


def _fp8_call(call: "_Call", kind: str, storage: str, out_dtype: Any, descales: Tuple[Any, Any, Any]):
    """(kernel dtype, output storage, descale views) of a forward call: fp8 inputs need all three descale factors
    (float32 device arrays of one element each) and take out_dtype 'bf16' (default) or 'fp16'; other inputs take
    neither."""
    given = [name for name, d in zip(("descale_q", "descale_k", "descale_v"), descales) if d is not None]
    if kind != "fp8":
        if given or out_dtype is not None:
            raise TypeError(f"{', '.join(given) or 'out_dtype'}: descale factors and out_dtype are for float8_e4m3fn "
                            f"inputs; q is {storage}")
        return kind, storage, []
    if len(given) != 3:
        raise TypeError("float8_e4m3fn inputs need descale_q, descale_k and descale_v (float32 device arrays of one "
                        "element: the factors that turn the stored values into real ones; 1.0 for unscaled data)")
    out_kind = _normalise_dtype("bf16" if out_dtype is None else out_dtype)
    if out_kind not in _FP8_KINDS:
        raise TypeError(f"out_dtype: expected 'bf16' or 'fp16' for the output of fp8 inputs, got {out_dtype!r}")
    views = []
    for name, d in zip(("descale_q", "descale_k", "descale_v"), descales):
        view = call.view(d, name)
        if view.dtype.name != "float32" or math.prod(view.shape) != 1:
            raise TypeError(f"{name}: expected a float32 array of one element, got {view.dtype.name} {view.shape}")
        views.append(view)
    return _FP8_KINDS[out_kind], _STORAGE_OF[out_kind], views


def _normalise_dtype(dtype: Any) -> Optional[str]:
    if dtype is None:
        return None
    key = str(dtype).rsplit(".", 1)[-1].lower()  # accepts "bf16", "torch.bfloat16", numpy/cupy dtype names
    if key not in _DTYPE_NAMES:
        raise TypeError(f"dtype: expected 'fp16', 'bf16' or 'fp8' (or None to read it from q), got {dtype!r}")
    return _DTYPE_NAMES[key]


def _same_dtype(views: Sequence[ArrayView], ref: ArrayView, override: Optional[str]) -> str:
    kind = _kernel_dtype(ref, override)
    for v in views:
        if v is ref:
            continue
        if _kernel_dtype(v, override) != kind or (v.dtype.name != ref.dtype.name):
            raise TypeError(f"{v.name}: dtype {v.dtype.name} does not match {ref.name}'s {ref.dtype.name}")
    return kind


def _check_ndim(view: ArrayView, ndim: int, dims: str) -> None:
    if view.ndim != ndim:
        raise ValueError(f"{view.name}: expected {ndim} dims {dims}, got shape {view.shape}")


def _check_head_dim(view: ArrayView, d: int, what: str) -> None:
    head_dims = _codegen.submodule("catalogue").load("cuda").head_dims  # the API's head dims: catalogue data
    if not head_dims.accepts(d):
        raise ValueError(f"{view.name}: {what} {d} is not supported; head dims must be {head_dims.describe()}")
    if view.strides[-1] != 1 and view.size > 0:  # an empty array's strides are arbitrary (CuPy reports zeros)
        raise ValueError(f"{view.name}: the head dimension must be contiguous (stride 1); got element strides "
                         f"{view.strides} for shape {view.shape}")


def _stride(view: ArrayView, axis: int, extent: int, *, row_align: Optional[int] = None) -> int:
    """An element stride as the C API takes it (>= 0). The stride of a size-1 axis is never used for addressing:
    it is normalised (a row stride to the padded head dim, so that the fast family's alignment guard holds)."""
    s = int(view.strides[axis])
    if extent <= 1:
        if row_align is not None and (s <= 0 or s % 8):
            return -(-row_align // 8) * 8
        return max(s, 0)
    if s < 0:
        raise ValueError(f"{view.name}: negative strides are not supported (got {view.strides})")
    return s


def _resolve_mask(causal: bool, mask: Any, window: Any) -> Tuple[int, int, int]:
    """(mask_type, left, right). causal / window follow FlashAttention: causal is bottom-right aligned,
    window=(left, right) is a bottom-right sliding window (-1 = unbounded), causal with a window keeps right = 0.
    mask= takes aiter's CLI strings ("t", "b:3,0", "g:y,x", ...) or a (type, left, right) tuple."""
    if mask is None and window is None and (causal is True or causal is False):  # the common calls, first
        return _CAUSAL if causal else _NO_MASK
    if mask is not None:
        if causal or window is not None:
            raise ValueError("mask: give either mask= or causal=/window=, not both")
        if isinstance(mask, str):
            from .reference import parse_mask
            try:
                m = parse_mask(mask)
            except ValueError as exc:
                raise ValueError(f"mask: {exc}") from None
            return int(m.mask_type), int(m.left), int(m.right)
        try:
            kind, left, right = mask
        except (TypeError, ValueError):
            raise TypeError(f"mask: expected a mask string such as 'b' or 't:64,0', or (type, left, right); got "
                            f"{mask!r}") from None
        if isinstance(kind, str):
            if kind not in _MASK_NAMES:
                raise ValueError(f"mask: unknown mask type {kind!r}; use one of {sorted(_MASK_NAMES)} or 0..3")
            kind = _MASK_NAMES[kind]
        if not isinstance(kind, numbers.Integral) or not 0 <= int(kind) <= 3:
            raise ValueError(f"mask: mask type must be 0 (none), 1 (top-left), 2 (bottom-right) or 3 (generic); "
                             f"got {kind!r}")
        return int(kind), _as_int(left, "mask left"), _as_int(right, "mask right")
    if window is not None:
        try:
            left, right = window
        except (TypeError, ValueError):
            raise TypeError(f"window: expected (left, right), got {window!r}") from None
        left, right = _as_int(left, "window left"), _as_int(right, "window right")
        if causal:
            right = 0
        if left < 0 and right < 0:
            return 0, -1, -1
        return 2, left, right
    if not isinstance(causal, (bool, numbers.Integral)):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    return (2, -1, 0) if causal else (0, -1, -1)


def _as_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what}: expected an int, got {value!r}")
    value = int(value)
    if not -(1 << 31) <= value < (1 << 31):
        raise ValueError(f"{what}: {value} does not fit in 32 bits")
    return value


def _resolve_scale(scale: Any, d: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(d)
    try:
        value = float(scale)
    except (TypeError, ValueError):
        raise TypeError(f"scale: expected a float, got {scale!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"scale: must be finite and > 0, got {scale!r}")
    return value


def _check_device(views: Sequence[ArrayView], device: int, backend: str) -> None:
    for v in views:
        if v.device_id is not None and v.device_id != device:
            raise ValueError(f"{v.name}: is on {backend}:{v.device_id} but q is on {backend}:{device}")


def _resolve_backend(views: Sequence[ArrayView]) -> str:
    """The backend of the call ("cuda" or "rocm"): every array's DLPack device type must name the same one."""
    backend = _arrays.backend_of(views[0].device_type)
    for v in views[1:]:
        if _arrays.backend_of(v.device_type) != backend:
            raise ValueError(f"{v.name}: is a {_arrays.backend_of(v.device_type)} array but {views[0].name} is a "
                             f"{backend} array")
    return backend


def _resolve_device(views: Sequence[ArrayView], layer) -> int:
    """The device ordinal of the call, asked of `layer` (the call's device layer) where no array says."""
    for v in views:
        if v.device_id is None:  # CAI (a CUDA protocol) does not say: ask the CUDA driver about the pointer
            from . import _cuda
            v.device_id = _cuda.pointer_device(v.ptr, v.name) if v.ptr else None
    device = views[0].device_id
    if device is None:
        device = next((v.device_id for v in views if v.device_id is not None), None)
    if device is None:
        cur = layer.current_device()
        device = 0 if cur is None else cur
    _check_device(views, device, layer.backend)
    return device


def _check_output(view: ArrayView, shape: Tuple[int, ...], storage: str, what: str) -> None:
    if view.readonly:
        raise ValueError(f"{view.name}: is read-only")
    if tuple(view.shape) != tuple(shape):
        raise ValueError(f"{view.name}: expected shape {tuple(shape)} ({what}), got {view.shape}")
    if view.dtype.name != storage:
        raise TypeError(f"{view.name}: expected dtype {storage}, got {view.dtype.name}")


def _check_fits_int32(view: ArrayView, **sizes: int) -> None:
    """Sizes the C API takes as int, refused before anything is allocated or launched."""
    for what, n in sizes.items():
        if n > _INT32_MAX:
            raise ValueError(f"{view.name}: {what} {n} exceeds the C API's 32-bit limit ({_INT32_MAX})")


def _check_layout(layout: Any) -> None:
    if layout not in ("bshd", "bhsd"):
        raise ValueError(f"layout: expected 'bshd' or 'bhsd', got {layout!r}")


def _check_input_shape(view: ArrayView, shape: Tuple[int, ...], what: str) -> None:
    if tuple(view.shape) != tuple(shape):
        raise ValueError(f"{view.name}: expected shape {tuple(shape)} ({what}), got {view.shape}")


def _as_flag(value: Any, what: str) -> bool:
    if isinstance(value, (bool, numbers.Integral)) or type(value).__name__ == "bool_":  # numpy.bool_ too
        return bool(value)
    raise TypeError(f"{what}: expected a bool, got {value!r}")


# ------------------------------------------------------------------------------------------------------------------
# Inputs both directions share: q, k, v in batch or packed (group) layout, and the cumulative sequence offsets
# ------------------------------------------------------------------------------------------------------------------

@dataclass
class _Batch:
    """q, k, v of a batch-mode call, checked against each other, and how the call's layout maps to the C API."""

    layout: str
    q: ArrayView
    k: ArrayView
    v: ArrayView
    kind: str                      # 'fp16' or 'bf16'
    b: int
    sq: int
    sk: int
    hq: int
    hk: int
    d: int
    dv: int
    axes: Tuple[int, int, int]     # the array axes of (batch, head, row)

    def shape(self, heads: int, rows: int, hdim: int) -> Tuple[int, ...]:
        """The shape of a [batch, heads, rows, hdim] tensor in the call's layout."""
        return (self.b, rows, heads, hdim) if self.layout == "bshd" else (self.b, heads, rows, hdim)

    def dims(self, rows: str, heads: str, hdim: str) -> str:
        names = ("batch", rows, heads, hdim) if self.layout == "bshd" else ("batch", heads, rows, hdim)
        return "[" + ", ".join(names) + "]"

    def strides(self, view: ArrayView, heads: int, rows: int, hdim: int) -> Tuple[int, int, int]:
        """(batch, head, row) element strides as the C API takes them."""
        extents = (self.b, heads, rows)
        return tuple(_stride(view, a, n, row_align=hdim if a == self.axes[2] else None)
                     for a, n in zip(self.axes, extents))


def _batch_inputs(call: "_Call", q: Any, k: Any, v: Any, layout: str) -> _Batch:
    qv, kv, vv = call.view(q, "q"), call.view(k, "k"), call.view(v, "v")
    dims = "[batch, seqlen, nheads, headdim]" if layout == "bshd" else "[batch, nheads, seqlen, headdim]"
    for view in (qv, kv, vv):
        _check_ndim(view, 4, f"{dims} (layout {layout!r})")
    kind = _same_dtype((qv, kv, vv), qv, call.override)
    if layout == "bshd":
        (b, sq, hq, d), (bk, sk, hk, dk), (bv, skv, hkv, dv) = qv.shape, kv.shape, vv.shape
        axes = (0, 2, 1)  # batch, head, row
    else:
        (b, hq, sq, d), (bk, hk, sk, dk), (bv, hkv, skv, dv) = qv.shape, kv.shape, vv.shape
        axes = (0, 1, 2)
    if bk != b or bv != b:
        raise ValueError(f"{'k' if bk != b else 'v'}: batch {bk if bk != b else bv} does not match q's batch {b}")
    if dk != d:
        raise ValueError(f"k: head dim {dk} does not match q's head dim {d}")
    if (skv, hkv) != (sk, hk):
        raise ValueError(f"v: shape {vv.shape} does not match k's {kv.shape} in seqlen and heads (layout {layout!r})")
    if hk < 1 or hq % hk:
        raise ValueError(f"k: {hk} kv heads; q's head count {hq} must be a positive multiple of it (GQA/MQA)")
    _check_head_dim(qv, d, "head dim")
    _check_head_dim(kv, d, "head dim")
    _check_head_dim(vv, dv, "head dim of v")
    _check_fits_int32(qv, batch=b, seqlen=sq, nheads=hq)
    _check_fits_int32(kv, seqlen=sk)
    return _Batch(layout, qv, kv, vv, kind, b, sq, sk, hq, hk, d, dv, axes)


@dataclass
class _Packed:
    """q, k, v of a group-mode call: [total_tokens, nheads, headdim], checked against each other."""

    q: ArrayView
    k: ArrayView
    v: ArrayView
    kind: str
    tq: int
    tk: int
    hq: int
    hk: int
    d: int
    dv: int

    @staticmethod
    def strides(view: ArrayView, tokens: int, heads: int, hdim: int) -> Tuple[int, int, int]:
        """(batch = unused, head, row) element strides as the C API takes them."""
        return (0, _stride(view, 1, heads), _stride(view, 0, tokens, row_align=hdim))


def _packed_inputs(call: "_Call", q: Any, k: Any, v: Any) -> _Packed:
    qv, kv, vv = call.view(q, "q"), call.view(k, "k"), call.view(v, "v")
    for view in (qv, kv, vv):
        _check_ndim(view, 3, "[total_tokens, nheads, headdim]")
    kind = _same_dtype((qv, kv, vv), qv, call.override)
    _no_fp8(kind, "group mode (mha_varlen_fwd / mha_varlen_bwd)")
    (tq, hq, d), (tk, hk, dk), (tkv, hkv, dv) = qv.shape, kv.shape, vv.shape
    if dk != d:
        raise ValueError(f"k: head dim {dk} does not match q's head dim {d}")
    if (tkv, hkv) != (tk, hk):
        raise ValueError(f"v: shape {vv.shape} does not match k's {kv.shape} in tokens and heads")
    if hk < 1 or hq % hk:
        raise ValueError(f"k: {hk} kv heads; q's head count {hq} must be a positive multiple of it (GQA/MQA)")
    _check_head_dim(qv, d, "head dim")
    _check_head_dim(kv, d, "head dim")
    _check_head_dim(vv, dv, "head dim of v")
    _check_fits_int32(qv, total_tokens=tq, nheads=hq)
    _check_fits_int32(kv, total_tokens=tk)
    return _Packed(qv, kv, vv, kind, tq, tk, hq, hk, d, dv)


def _host_seqstarts(obj: Any, name: str):
    """A host cu_seqlens as int32 numpy (validated later against the totals), or None for a device array."""
    if _arrays.is_device_array(obj):
        return None
    import numpy as np
    try:
        arr = np.asarray(obj)
    except Exception:
        raise TypeError(f"{name}: expected a 1-D int32 array (device or host) of batch+1 offsets, got "
                        f"{type(obj).__name__}") from None
    if arr.ndim != 1 or arr.shape[0] < 1 or arr.dtype.kind not in "iu":
        raise ValueError(f"{name}: expected a 1-D integer array of batch+1 cumulative offsets, got shape "
                         f"{arr.shape} dtype {arr.dtype}")
    return arr.astype(np.int64)


@dataclass
class _Seqstarts:
    """cu_seqlens_q / cu_seqlens_k of a group-mode call: host offsets (validated; uploaded at launch) or device
    views (taken as they are), and the max_seqlen bounds."""

    batch: int
    max_q: int
    max_k: int
    host: dict    # name -> int32 numpy array
    device: dict  # name -> ArrayView

    def pointers(self, call: "_Call", device: int):
        """({name: device pointer}, allocations to free once the launch is queued). Host offsets are copied on the
        call's stream, so the launch that follows sees them."""
        uploads, ptrs = [], {}
        for name in ("cu_seqlens_q", "cu_seqlens_k"):
            if name in self.host:
                arr = self.host[name]
                alloc = call.layer.allocate(arr.nbytes, device, call.stream, call.stream_ref)
                call.layer.copy_from_host(alloc.ptr, arr.ctypes.data, arr.nbytes, device, call.stream)
                uploads.append(alloc)
                ptrs[name] = alloc.ptr
            else:
                ptrs[name] = self.device[name].ptr
        return ptrs, uploads


def _seqstarts(call: "_Call", cu_seqlens_q: Any, cu_seqlens_k: Any, tq: int, tk: int, max_seqlen_q: Any,
               max_seqlen_k: Any) -> _Seqstarts:
    max_q = _as_int(max_seqlen_q, "max_seqlen_q")
    max_k = _as_int(max_seqlen_k, "max_seqlen_k")
    if max_q < 0 or max_k < 0:
        raise ValueError(f"max_seqlen_q / max_seqlen_k: must be >= 0, got {max_q} / {max_k}")
    host, seq_views, counts = {}, {}, {}
    for name, obj, total, bound in (("cu_seqlens_q", cu_seqlens_q, tq, max_q),
                                    ("cu_seqlens_k", cu_seqlens_k, tk, max_k)):
        arr = _host_seqstarts(obj, name)
        if arr is None:
            sv = call.view(obj, name)
            if sv.ndim != 1 or sv.shape[0] < 1:
                raise ValueError(f"{name}: expected a 1-D array of batch+1 cumulative offsets, got shape {sv.shape}")
            if sv.dtype.name != "int32":
                raise TypeError(f"{name}: expected dtype int32, got {sv.dtype.name}")
            if sv.shape[0] > 1 and sv.strides[0] != 1:
                raise ValueError(f"{name}: must be contiguous (stride 1), got stride {sv.strides[0]}")
            seq_views[name] = sv
            counts[name] = sv.shape[0]
        else:
            import numpy as np
            if arr[0] < 0 or np.any(np.diff(arr) < 0) or arr[-1] > total:
                raise ValueError(f"{name}: offsets must be non-decreasing within [0, {total}], got {arr.tolist()}")
            longest = int(np.max(np.diff(arr))) if arr.shape[0] > 1 else 0
            if longest > bound:
                which = "max_seqlen_q" if name.endswith("q") else "max_seqlen_k"
                raise ValueError(f"{which}: {bound} is less than the longest sequence in {name} ({longest})")
            host[name] = arr.astype(np.int32)
            counts[name] = arr.shape[0]
    if counts["cu_seqlens_k"] != counts["cu_seqlens_q"]:
        raise ValueError(f"cu_seqlens_k: has {counts['cu_seqlens_k']} entries but cu_seqlens_q has "
                         f"{counts['cu_seqlens_q']}")
    return _Seqstarts(counts["cu_seqlens_q"] - 1, max_q, max_k, host, seq_views)


def _lse_input(call: "_Call", lse: Any, shape: Tuple[int, ...], what: str, row_axis: int, rows: str) -> ArrayView:
    """The forward's LSE as the backward reads it: float32, `shape`, rows contiguous (the C API has no row stride)."""
    lv = call.view(lse, "lse")
    _check_input_shape(lv, shape, what)
    if lv.dtype.name != "float32":
        raise TypeError(f"lse: expected dtype float32 (the forward's LSE), got {lv.dtype.name}")
    if shape[row_axis] > 1 and lv.strides[row_axis] != 1:
        raise ValueError(f"lse: the {rows} dimension must be contiguous (stride 1), as the forward writes it; got "
                         f"strides {lv.strides}")
    return lv


# ------------------------------------------------------------------------------------------------------------------
# Launch
# ------------------------------------------------------------------------------------------------------------------

_WORKSPACE_ALIGN = 256  # mha_fwd.h / mha_bwd.h: a workspace must be aligned as cudaMalloc aligns


class _Call:
    """The part every call shares once the arguments are understood: device, outputs, stream order, launch."""

    def __init__(self, stream: Any, dtype: Any):
        from . import _device
        self.stream, self.stream_ref = _device.stream_handle(stream)
        self.override = _normalise_dtype(dtype)
        self.backend, self.layer = "cuda", None  # set by resolve_device from the arrays

    def resolve_device(self, views: Sequence[ArrayView]) -> int:
        """The call's backend and device from its arrays; from here on the call uses that backend's device layer
        (mhakit._cuda or mhakit._hip) and that backend's libraries."""
        from . import _device
        self.backend = _resolve_backend(views)
        self.layer = _device.layer(self.backend)
        return _resolve_device(views, self.layer)

    def library(self, api: str, device: int, kind: str, hdim_q: int, hdim_v: int, mode: str, masked: bool,
                mods: int = 0):
        from . import jit
        return jit.library(api, device, kind, hdim_q, hdim_v, mode, masked, backend=self.backend, mods=mods)

    def view(self, obj: Any, name: str) -> ArrayView:
        return _arrays.view_of(obj, name, self.stream)

    def output(self, given: Any, name: str, shape: Tuple[int, ...], storage: str, what: str):
        """(array to return, its view): the caller's `given` checked, or None to allocate later."""
        if given is None:
            return None
        view = self.view(given, name)
        _check_output(view, shape, storage, what)
        return view

    def allocate(self, device: int, shape: Tuple[int, ...], storage: str) -> DeviceArray:
        dtype = _arrays.dtype_by_name(storage)
        nbytes = math.prod(shape) * dtype.itemsize
        alloc = self.layer.allocate(nbytes, device, self.stream, self.stream_ref)
        return DeviceArray(alloc.ptr, shape, dtype, device, owner=alloc, stream=self.stream,
                           device_type=self.layer.device_type)

    def order_inputs(self, views: Sequence[ArrayView], device: int) -> None:
        """CAI producers (and our own arrays) name the stream they wrote on: order this call's stream after it."""
        for v in views:
            if v.stream is not None and v.stream != -1:
                self.layer.order_streams(0 if v.stream == 1 else v.stream, self.stream, device)

    def launch(self, lib, args, device: int, workspace: bool = False) -> None:
        """mha_fwd; with `workspace` (fp8: V transposed) the scratch the chosen instance asks for, as launch_bwd
        gives it (the 16-bit forward needs none, so it asks nothing)."""
        if workspace:
            self._launch_with_workspace(lib, args, device, lib.mha_fwd)
            return
        from . import _capi
        config = _capi.make_stream_config(self.stream, log_level=LOG_LEVEL)
        with self.layer.device_scope(device):
            lib.mha_fwd(args, config)
        if LOG_LEVEL > 0:  # the library printf()s the chosen instance; show it now, not at exit
            ctypes.CDLL(None).fflush(None)

    def launch_splitkv(self, lib, args, device: int) -> None:
        """mha_fwd_splitkv with its split accumulators allocated on the call's stream for the split count the
        library resolves on this device, freed after the launch (stream-ordered)."""
        from . import _capi
        config = _capi.make_stream_config(self.stream, log_level=LOG_LEVEL)
        with self.layer.device_scope(device):
            lse_bytes, o_bytes, _ = lib.splitkv_acc_size(args)  # MhakitError when refused; nothing allocated
            acc = []
            try:
                if lse_bytes > 0:
                    acc = [self.layer.allocate(n, device, self.stream, self.stream_ref) for n in (lse_bytes, o_bytes)]
                    args.lse_acc_ptr, args.o_acc_ptr = acc[0].ptr, acc[1].ptr
                lib.mha_fwd_splitkv(args, config)
            finally:
                for a in acc:
                    a.free()
        if LOG_LEVEL > 0:
            ctypes.CDLL(None).fflush(None)

    def launch_bwd(self, lib, args, device: int) -> None:
        self._launch_with_workspace(lib, args, device, lib.mha_bwd)

    def _launch_with_workspace(self, lib, args, device: int, run) -> None:
        """Ask the library how much scratch the instance it chooses for `args` needs, allocate it on the call's
        stream, launch, and free it on the same stream (the free is ordered after the kernels that use it)."""
        from . import _capi
        config = _capi.make_stream_config(self.stream, log_level=LOG_LEVEL)
        with self.layer.device_scope(device):
            need = lib.workspace_size(args)  # MhakitError when the library refuses the arguments; nothing allocated
            work = None
            try:
                if need > 0:
                    work = self.layer.allocate(need, device, self.stream, self.stream_ref)
                    if work.ptr % _WORKSPACE_ALIGN:  # pools align far more in practice; never rely on it
                        work.free()
                        work = self.layer.allocate(need + _WORKSPACE_ALIGN, device, self.stream, self.stream_ref)
                    args.workspace_ptr = -(-work.ptr // _WORKSPACE_ALIGN) * _WORKSPACE_ALIGN
                    args.workspace_bytes = need
                run(args, config)
            finally:
                if work is not None:
                    work.free()
        if LOG_LEVEL > 0:
            ctypes.CDLL(None).fflush(None)


# ------------------------------------------------------------------------------------------------------------------
# Score modifiers (soft-cap, bias / ALiBi, sink): the fields of mha_fwd.h's / mha_bwd.h's modifier block
# ------------------------------------------------------------------------------------------------------------------

_MOD_KWARGS = ("softcap", "alibi_slopes", "bias", "sink")


def _score_mods(call: "_Call", storage: str, batch: int, hq: int, rows_q: int, rows_k: int, *, softcap: Any = None,
                alibi_slopes: Any = None, bias: Any = None, sink: Any = None, dropout_p: Any = 0.0, seed: Any = None,
                offset: Any = 0, randval: Any = None, randval_shape: Optional[tuple] = None) -> Tuple[dict, list]:
    """(the argument-struct fields, the arrays' views). softcap: cap > 0 (None or 0: off). alibi_slopes: float32
    [h_q] or [batch, h_q]. bias: [batch|1, h_q|1, rows_q, rows_k] float32 or q's dtype (a dimension of extent 1
    broadcasts; varlen: rows_q / rows_k bound every sequence's lengths, its block starts at [b, h, 0, 0]).
    sink: float32 [h_q] logits. Dropout: see _dropout (randval_shape: the forward's randval shape, None in the
    backward)."""
    fields: dict = {}
    views: list = []
    _dropout(call, fields, views, dropout_p, seed, offset, randval, randval_shape)
    if softcap is not None:
        cap = float(softcap)
        if not math.isfinite(cap) or cap < 0:
            raise ValueError(f"softcap must be a finite number >= 0 (got {softcap!r}; 0 or None turns it off)")
        fields["logits_soft_cap"] = cap
    if alibi_slopes is not None and bias is not None:
        raise ValueError("alibi_slopes and bias are exclusive: give one of them")
    if alibi_slopes is not None:
        sv = call.view(alibi_slopes, "alibi_slopes")
        if sv.dtype.name != "float32" or sv.shape not in ((hq,), (batch, hq)):
            raise ValueError(f"alibi_slopes must be float32 of shape ({hq},) or ({batch}, {hq}), got "
                             f"{sv.dtype.name} {tuple(sv.shape)}")
        two = len(sv.shape) == 2
        fields.update(bias_type=2, bias_fp32=1, bias_ptr=sv.ptr, stride_bias=0,
                      nhead_stride_bias=sv.strides[-1] if hq > 1 else 0,
                      batch_stride_bias=sv.strides[0] if two and batch > 1 else 0)
        views.append(sv)
    if bias is not None:
        bv = call.view(bias, "bias")
        ok_dtype = bv.dtype.name in ("float32", storage)
        shape = tuple(bv.shape)
        ok_shape = (len(shape) == 4 and shape[0] in (1, batch) and shape[1] in (1, hq) and shape[2] == rows_q
                    and shape[3] == rows_k)
        if not ok_dtype or not ok_shape:
            raise ValueError(f"bias must be float32 or {storage} of shape ([1|{batch}], [1|{hq}], {rows_q}, {rows_k}),"
                             f" got {bv.dtype.name} {shape}")
        if rows_k > 1 and bv.strides[3] != 1:
            raise ValueError(f"bias: the key dimension must be contiguous (stride 1), got strides {bv.strides}")
        st = [0 if shape[i] == 1 else bv.strides[i] for i in range(3)]
        fields.update(bias_type=1, bias_fp32=1 if bv.dtype.name == "float32" else 0, bias_ptr=bv.ptr,
                      stride_bias=st[2], nhead_stride_bias=st[1], batch_stride_bias=st[0])
        views.append(bv)
    if sink is not None:
        kv = _per_head_f32(call, sink, "sink", hq)
        fields["sink_ptr"] = kv.ptr
        views.append(kv)
    return fields, views


def _modifier_kinds(fields: dict) -> int:
    """The score modifiers a call with these fields sets, as mhakit_score_mod bits (ScoreMods::kinds in
    csrc/kernels/common/score_mod.h): which instances serve it is the catalogue's score_mods (jit.derive_entry)."""
    from . import _capi
    bits = _capi.SCORE_MOD_BITS
    bias_type = fields.get("bias_type", 0)
    return ((bits["softcap"] if fields.get("logits_soft_cap", 0.0) > 0 else 0) |
            (bits["bias"] if bias_type == _capi.BIAS_ELEMENTWISE else 0) |
            (bits["alibi"] if bias_type == _capi.BIAS_ALIBI else 0) |
            (bits["sink"] if fields.get("sink_ptr") else 0) |
            (bits["dropout"] if fields.get("p_drop", 0.0) > 0 else 0))


def _dropout_probability(dropout_p: Any) -> float:
    """dropout_p as a float in [0, 1) (None: 0, no dropout), or ValueError."""
    p = 0.0 if dropout_p is None else dropout_p
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 <= float(p) < 1.0):
        raise ValueError(f"dropout_p must be a number in [0, 1) (got {dropout_p!r}; 0 turns dropout off)")
    return float(p)


def _dropout(call: "_Call", fields: dict, views: list, dropout_p: Any, seed: Any, offset: Any, randval: Any,
             randval_shape: Optional[tuple]) -> None:
    """Dropout's fields into `fields`: dropout_p in [0, 1) (0: off); seed / offset: ints (the Philox key and stream
    offset, 0 <= value < 2**64) or both device arrays of one uint64 / int64 element (read when the kernels run:
    CUDA-graph friendly); randval (forward only): a uint8 array of randval_shape ([b, h_q, s_q, s_k], varlen
    [h_q, total_q, max_seqlen_k]; key dimension contiguous) that receives the random bytes of the visited scores."""
    p = _dropout_probability(dropout_p)
    if p == 0.0:
        if randval is not None:
            raise ValueError("randval is given but dropout_p is 0: there is no dropout to record")
        return
    if seed is None:
        raise ValueError("dropout_p > 0 needs seed= (an int, or a device array holding it)")

    def as_int(value, name):
        if isinstance(value, bool) or not 0 <= int(value) < 1 << 64:
            raise ValueError(f"{name} must be an int in [0, 2**64) or a device array of one uint64 (got {value!r})")
        return int(value)

    def as_pointer(value, name):
        view = call.view(value, name)
        if view.dtype.name not in ("uint64", "int64") or math.prod(view.shape) != 1:
            raise ValueError(f"{name} must be a device array of one uint64 (or int64) element, got {view.dtype.name} "
                             f"{tuple(view.shape)}")
        views.append(view)
        return view.ptr

    on_device = [not isinstance(x, numbers.Integral) for x in (seed, offset)]
    if on_device[0] != on_device[1]:
        raise ValueError("seed and offset must both be ints or both be device arrays")
    fields["p_drop"] = p
    if on_device[0]:
        fields.update(drop_seed_ptr=as_pointer(seed, "seed"), drop_offset_ptr=as_pointer(offset, "offset"))
    else:
        fields.update(drop_seed=as_int(seed, "seed"), drop_offset=as_int(offset, "offset"))
    if randval is not None:
        if randval_shape is None:
            raise ValueError("randval is a forward output: the backward regenerates the random bytes")
        rv = call.view(randval, "randval")
        if rv.dtype.name != "uint8" or tuple(rv.shape) != tuple(randval_shape) or rv.readonly or \
                (randval_shape[-1] > 1 and rv.strides[-1] != 1):
            raise ValueError(f"randval must be a writable uint8 array of shape {tuple(randval_shape)} with a "
                             f"contiguous last dimension, got {rv.dtype.name} {tuple(rv.shape)}")
        st = list(rv.strides)
        if len(randval_shape) == 4:
            batch_stride, head_stride, row_stride = st[0], st[1], st[2]
        else:
            batch_stride, head_stride, row_stride = 0, st[0], st[1]
        fields.update(randval_ptr=rv.ptr, stride_randval=row_stride, nhead_stride_randval=head_stride,
                      batch_stride_randval=batch_stride)
        views.append(rv)


def _per_head_f32(call: "_Call", obj: Any, name: str, hq: int) -> ArrayView:
    """The view of a contiguous float32 [h_q] array (sink logits, their gradient), or ValueError."""
    view = call.view(obj, name)
    if view.dtype.name != "float32" or tuple(view.shape) != (hq,) or (hq > 1 and view.strides[0] != 1):
        raise ValueError(f"{name} must be a contiguous float32 array of shape ({hq},), got {view.dtype.name} "
                         f"{tuple(view.shape)}")
    return view


def _mod_grads(call: "_Call", fields: dict, storage: str, batch: int, hq: int, rows_q: int, rows_k: int,
               dbias: Any, dsink: Any) -> Tuple[dict, list]:
    """The backward's dbias= ([batch, h_q, rows_q, rows_k], the bias's dtype) and dsink= (float32 [h_q]) outputs."""
    out: dict = {}
    views: list = []
    if dbias is not None:
        if fields.get("bias_type") != 1:
            raise ValueError("dbias is given but there is no elementwise bias (bias=) to differentiate")
        want = "float32" if fields["bias_fp32"] else storage
        dv = call.view(dbias, "dbias")
        if dv.dtype.name != want or tuple(dv.shape) != (batch, hq, rows_q, rows_k) or (rows_k > 1 and dv.strides[3] != 1):
            raise ValueError(f"dbias must be a {want} array of shape ({batch}, {hq}, {rows_q}, {rows_k}) with a "
                             f"contiguous key dimension, got {dv.dtype.name} {tuple(dv.shape)}")
        out.update(dbias_ptr=dv.ptr, stride_dbias=dv.strides[2], nhead_stride_dbias=dv.strides[1],
                   batch_stride_dbias=dv.strides[0])
        views.append(dv)
    if dsink is not None:
        if "sink_ptr" not in fields:
            raise ValueError("dsink is given but there is no sink (sink=) to differentiate")
        sv = _per_head_f32(call, dsink, "dsink", hq)
        out["dsink_ptr"] = sv.ptr
        views.append(sv)
    return out, views


def _set_fields(args, fields: dict) -> None:
    for name, value in fields.items():
        setattr(args, name, value)


_FWD_MODS = ("softcap", "alibi_slopes", "bias", "sink")
_BWD_MODS = _FWD_MODS + ("dbias", "dsink")
_PYTHON_PATH = object()
_DROPOUT_KWARGS = ("dropout_p", "seed", "offset", "randval")


def _ext_mods(mods: dict, names: Tuple[str, ...]):
    """The C path's mods argument: None without modifiers, else their tuple in ``names`` order; _PYTHON_PATH for a
    keyword the API does not know (the Python path raises the TypeError). The entry points skip the call when no
    modifier keyword was given (the common call: its per-call cost), and an empty ``mods`` gives None here too."""
    if not mods.get("dropout_p") and mods.get("randval") is None:  # dropout off: nothing the C path must know
        mods = {name: value for name, value in mods.items() if name not in _DROPOUT_KWARGS}
    if any(name not in names for name in mods):
        return _PYTHON_PATH  # dropout (the Python path handles it) or a keyword the API does not know (TypeError)
    if all(value is None for value in mods.values()):
        return None
    return tuple(mods.get(name) for name in names)


# ------------------------------------------------------------------------------------------------------------------
# Forward
# ------------------------------------------------------------------------------------------------------------------

def _mha_fwd_py(q: Any, k: Any, v: Any, *, causal: bool = False, mask: Any = None, window: Any = None,
            scale: Optional[float] = None, return_lse: bool = False, out: Any = None, lse_out: Any = None,
            layout: str = "bshd", stream: Any = None, dtype: Any = None, softcap: Any = None,
            alibi_slopes: Any = None, bias: Any = None, sink: Any = None, dropout_p: Any = 0.0, seed: Any = None,
            offset: Any = 0, randval: Any = None, descale_q: Any = None, descale_k: Any = None,
            descale_v: Any = None, out_dtype: Any = None):
    """Fused attention forward, batch mode: O = softmax(scale · Q Kᵀ + mask) V with fp32 accumulation.

    q: [b, s_q, h_q, d], k: [b, s_k, h_k, d], v: [b, s_k, h_k, d_v] for ``layout='bshd'`` (default), or
    [b, h, s, d] for ``layout='bhsd'``. Any element strides (bshd/bhsd views of one buffer, packed ``b·s·3·h·d`` qkv
    slices, non-contiguous views) as long as the head dim is contiguous. fp16 or bf16; d, d_v any head dims the
    catalogue accepts (today 1 to 256: each runs on the smallest instance that holds it); h_q a multiple of h_k
    (GQA/MQA).

    causal: bottom-right aligned causal mask (FlashAttention's convention). window=(left, right): bottom-right
    sliding window (-1 = unbounded). mask: an aiter/CK mask string ("0", "t", "b", "t:l,r", "b:l,r", "g:y,x",
    "xt:w", "xb:w") or (type, left, right) with type 0 none / 1 top-left / 2 bottom-right / 3 generic; exclusive with
    causal/window. scale defaults to 1/sqrt(d).

    Returns O (same layout and storage dtype as q, on q's device; a :class:`mhakit.DeviceArray` unless ``out`` is
    given, which is then filled and returned) and, with ``return_lse``, (O, LSE) where LSE is float32 [b, h_q, s_q]
    (natural log; -inf for rows that see no key; ``lse_out`` may supply it and is filled whenever given).
    stream: int CUstream or a stream object (``torch.cuda.current_stream()``, a CuPy stream, ...); default: the
    legacy default stream. dtype: how to read 16-bit integer storage (e.g. 'bf16' for CuPy arrays of bf16 bits).

    Score modifiers (the Hopper forward and the generic family; mha_fwd.h says what they mean): ``softcap=cap``
    (logits cap·tanh(l/cap)), ``alibi_slopes=`` float32 [h_q] or [b, h_q] (bias -slope·|i + s_k - s_q - j|) or
    ``bias=`` [b|1, h_q|1, s_q, s_k] float32 or q's dtype (exclusive with alibi_slopes), ``sink=`` float32 [h_q]
    logits added to the softmax denominator (gpt-oss).

    Dropout (the modifier instances, Hopper's or generic's; FlashAttention's semantics: kept probabilities scaled
    by 1/(1-p), the LSE of the undropped softmax): ``dropout_p=p`` with ``seed=`` and ``offset=`` (ints, or both
    device arrays of one uint64: read when the kernel runs, so a captured CUDA graph can be replayed with new
    values); the same values on :func:`mha_bwd` regenerate the mask. ``randval=`` (uint8 [b, h_q, s_q, s_k])
    receives the random bytes (kept where byte <= floor((1 - p)·255); for tests: :func:`mhakit.reference.mha_fwd`
    takes them). Dropout calls take the Python call path.

    fp8 (Hopper, sm_90a; mha_fwd.h says what it computes): q, k, v float8_e4m3fn (DLPack kDLFloat8_e4m3fn, e.g.
    ``torch.float8_e4m3fn``) with ``descale_q=``, ``descale_k=``, ``descale_v=`` (float32 device arrays of one element:
    the logits are scale·dq·dk·q·k, O is multiplied by dv) and ``out_dtype='bf16'`` (default) or ``'fp16'`` for O;
    no score modifiers or dropout; P is rounded to e4m3 for P·V (:func:`mhakit.reference.tolerances_fp8`).
    """
    _check_layout(layout)
    call = _Call(stream, dtype)
    g = _batch_inputs(call, q, k, v, layout)
    qv, kv, vv = g.q, g.k, g.v
    kind, storage, descale_views = _fp8_call(call, g.kind, qv.dtype.name, out_dtype, (descale_q, descale_k, descale_v))
    b, sq, sk, hq, hk, d, dv = g.b, g.sq, g.sk, g.hq, g.hk, g.d, g.dv
    mask_type, left, right = _resolve_mask(causal, mask, window)
    scale = _resolve_scale(scale, d)
    q_strides, k_strides, v_strides = g.strides(qv, hq, sq, d), g.strides(kv, hk, sk, d), g.strides(vv, hk, sk, dv)
    o_shape = g.shape(hq, sq, dv)
    ov = call.output(out, "out", o_shape, storage, f"{layout} output")
    if ov is not None:
        _check_head_dim(ov, dv, "head dim")
        g.strides(ov, hq, sq, dv)
    lse_shape = (b, hq, sq)
    lv = call.output(lse_out, "lse_out", lse_shape, "float32", "[batch, nheads, seqlen_q] float32")
    if lv is not None and sq > 1 and lv.strides[2] != 1:
        raise ValueError(f"lse_out: the seqlen dimension must be contiguous (stride 1), got strides {lv.strides}")
    return_lse = _as_flag(return_lse, "return_lse")
    want_lse = return_lse or lv is not None
    mods, mod_views = _score_mods(call, storage, b, hq, sq, sk, softcap=softcap, alibi_slopes=alibi_slopes,
                                  bias=bias, sink=sink, dropout_p=dropout_p, seed=seed, offset=offset,
                                  randval=randval, randval_shape=(b, hq, sq, sk))

    views = [qv, kv, vv] + [x for x in (ov, lv) if x is not None] + mod_views + descale_views
    device = call.resolve_device(views)
    o = out if ov is not None else call.allocate(device, o_shape, storage)
    if ov is None:
        ov = call.view(o, "out")
    lse = None
    if want_lse:
        lse = lse_out if lv is not None else call.allocate(device, lse_shape, "float32")
        if lv is None:
            lv = call.view(lse, "lse_out")
    if b == 0 or sq == 0 or hq == 0:
        return (o, lse) if return_lse else o

    from . import _capi
    lib = call.library("fwd", device, kind, d, dv, "batch", mask_type != 0, _modifier_kinds(mods))
    call.order_inputs(views, device)
    lse_strides = (0, 0)
    if lv is not None:
        lse_strides = (_stride(lv, 0, b), _stride(lv, 1, hq))
    args = _capi.make_fwd_args(
        dtype=kind, q_ptr=qv.ptr, k_ptr=kv.ptr or None, v_ptr=vv.ptr or None, o_ptr=ov.ptr, batch=b, nhead_q=hq,
        nhead_k=hk, hdim_q=d, hdim_v=dv, seqlen_q=sq, seqlen_k=sk, q_strides=q_strides, k_strides=k_strides,
        v_strides=v_strides, o_strides=g.strides(ov, hq, sq, dv),
        lse_ptr=lv.ptr if lv is not None else None, lse_strides=lse_strides, scale=scale, mask_type=mask_type,
        window_left=left, window_right=right, descale_ptrs=[x.ptr for x in descale_views] or None)
    _set_fields(args, mods)
    call.launch(lib, args, device, workspace=bool(descale_views))
    return (o, lse) if return_lse else o


def _mha_varlen_fwd_py(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: int,
                   max_seqlen_k: int, *, causal: bool = False, mask: Any = None, window: Any = None,
                   scale: Optional[float] = None, return_lse: bool = False, out: Any = None, lse_out: Any = None,
                   stream: Any = None, dtype: Any = None, softcap: Any = None, alibi_slopes: Any = None,
                   bias: Any = None, sink: Any = None, dropout_p: Any = 0.0, seed: Any = None, offset: Any = 0,
                   randval: Any = None):
    """Fused attention forward, group mode (variable sequence lengths, packed tokens).

    q: [total_q, h_q, d], k: [total_k, h_k, d], v: [total_k, h_k, d_v]; sequence i owns rows
    cu_seqlens[i]:cu_seqlens[i+1] (int32, batch+1 cumulative offsets, on the device as FlashAttention takes them, or
    a host sequence/numpy array, which is validated and uploaded). Sequences may be empty. max_seqlen_q must bound
    every query length (it sizes the launch); max_seqlen_k is checked against host offsets only. Masks apply per
    sequence with its own lengths. Returns O [total_q, h_q, d_v] and, with ``return_lse``, LSE float32
    [h_q, total_q]. The other arguments are those of :func:`mha_fwd`; a ``bias=`` is [b|1, h_q|1, max_seqlen_q,
    max_seqlen_k], sequence i's block at [i, :, :s_q_i, :s_k_i]; a ``randval=`` is uint8 [h_q, total_q, max_seqlen_k]
    (sequence i's row r at [:, cu_seqlens_q[i] + r, :s_k_i]).
    """
    call = _Call(stream, dtype)
    g = _packed_inputs(call, q, k, v)
    qv, kv, vv, kind = g.q, g.k, g.v, g.kind
    tq, tk, hq, hk, d, dv = g.tq, g.tk, g.hq, g.hk, g.d, g.dv
    q_strides, k_strides, v_strides = g.strides(qv, tq, hq, d), g.strides(kv, tk, hk, d), g.strides(vv, tk, hk, dv)
    seqs = _seqstarts(call, cu_seqlens_q, cu_seqlens_k, tq, tk, max_seqlen_q, max_seqlen_k)
    batch, max_q = seqs.batch, seqs.max_q
    mask_type, left, right = _resolve_mask(causal, mask, window)
    scale = _resolve_scale(scale, d)
    storage = qv.dtype.name
    o_shape = (tq, hq, dv)
    ov = call.output(out, "out", o_shape, storage, "[total_q, nheads, headdim_v]")
    if ov is not None:
        _check_head_dim(ov, dv, "head dim")
        g.strides(ov, tq, hq, dv)
    lse_shape = (hq, tq)
    lv = call.output(lse_out, "lse_out", lse_shape, "float32", "[nheads, total_q] float32")
    if lv is not None and tq > 1 and lv.strides[1] != 1:
        raise ValueError(f"lse_out: the token dimension must be contiguous (stride 1), got strides {lv.strides}")
    return_lse = _as_flag(return_lse, "return_lse")
    want_lse = return_lse or lv is not None
    max_k_rows = _as_int(max_seqlen_k, "max_seqlen_k")
    mods, mod_views = _score_mods(call, storage, batch, hq, max_q, max_k_rows, softcap=softcap,
                                  alibi_slopes=alibi_slopes, bias=bias, sink=sink, dropout_p=dropout_p, seed=seed,
                                  offset=offset, randval=randval, randval_shape=(hq, tq, max_k_rows))

    views = [qv, kv, vv] + list(seqs.device.values()) + [x for x in (ov, lv) if x is not None] + mod_views
    device = call.resolve_device(views)
    o = out if ov is not None else call.allocate(device, o_shape, storage)
    if ov is None:
        ov = call.view(o, "out")
    lse = None
    if want_lse:
        lse = lse_out if lv is not None else call.allocate(device, lse_shape, "float32")
        if lv is None:
            lv = call.view(lse, "lse_out")
    if batch == 0 or tq == 0 or hq == 0 or max_q == 0:
        return (o, lse) if return_lse else o

    from . import _capi
    lib = call.library("fwd", device, kind, d, dv, "group", mask_type != 0, _modifier_kinds(mods))
    call.order_inputs(views, device)
    seq_ptrs, uploads = seqs.pointers(call, device)
    # No sequence has keys when total_k == 0; the C API still wants non-null k/v pointers in group mode.
    k_ptr = kv.ptr or qv.ptr
    v_ptr = vv.ptr or qv.ptr
    args = _capi.make_fwd_args(
        dtype=kind, q_ptr=qv.ptr, k_ptr=k_ptr, v_ptr=v_ptr, o_ptr=ov.ptr, batch=batch, nhead_q=hq, nhead_k=hk,
        hdim_q=d, hdim_v=dv, seqlen_q=tq, seqlen_k=tk, q_strides=q_strides, k_strides=k_strides, v_strides=v_strides,
        o_strides=g.strides(ov, tq, hq, dv),
        lse_ptr=lv.ptr if lv is not None else None, lse_strides=(0, _stride(lv, 0, hq)) if lv is not None else (0, 0),
        seqstart_q_ptr=seq_ptrs["cu_seqlens_q"], seqstart_k_ptr=seq_ptrs["cu_seqlens_k"], max_seqlen_q=max_q,
        scale=scale, mask_type=mask_type, window_left=left, window_right=right)
    _set_fields(args, mods)
    try:
        call.launch(lib, args, device)
    finally:
        for alloc in uploads:  # freed stream-ordered, after the launch
            alloc.free()
    return (o, lse) if return_lse else o


# ------------------------------------------------------------------------------------------------------------------
# Backward
# ------------------------------------------------------------------------------------------------------------------

# ------------------------------------------------------------------------------------------------------------------
# Decode against a KV cache
# ------------------------------------------------------------------------------------------------------------------

def _int32_vector(call: "_Call", obj: Any, name: str, length: int, what: str):
    """A per-batch int32 vector: (device view, None) as given, or (None, int32 numpy array) for a host sequence or,
    for cache_seqlens, one int that holds for every batch."""
    if _arrays.is_device_array(obj):
        view = call.view(obj, name)
        if view.ndim != 1 or view.shape[0] != length:
            raise ValueError(f"{name}: expected shape ({length},) ({what}), got {view.shape}")
        if view.dtype.name != "int32":
            raise TypeError(f"{name}: expected dtype int32, got {view.dtype.name}")
        if length > 1 and view.strides[0] != 1:
            raise ValueError(f"{name}: must be contiguous (stride 1), got stride {view.strides[0]}")
        return view, None
    import numpy as np
    if isinstance(obj, numbers.Integral) and not isinstance(obj, bool) and name == "cache_seqlens":
        host = np.full(length, int(obj), dtype=np.int64)
    else:
        try:
            host = np.asarray(obj)
        except Exception:
            raise TypeError(f"{name}: expected an int32 array of {length} entries ({what}), got "
                            f"{type(obj).__name__}") from None
        if host.shape != (length,) or host.dtype.kind not in "iu":
            raise ValueError(f"{name}: expected {length} integers ({what}), got shape {host.shape} dtype {host.dtype}")
    return None, host.astype(np.int64)


def _mha_fwd_kvcache_py(q: Any, k_cache: Any, v_cache: Any, cache_seqlens: Any, *, block_table: Any = None,
                        k: Any = None, v: Any = None, cache_batch_idx: Any = None, causal: bool = False,
                        window: Any = None, scale: Optional[float] = None, num_splits: int = 0,
                        return_lse: bool = False, out: Any = None, lse_out: Any = None, stream: Any = None,
                        dtype: Any = None):
    """Decode attention against a KV cache, with FlashAttention's ``flash_attn_with_kvcache`` semantics.

    q: [b, s_q, h_q, d]. k_cache / v_cache: [b_c, s_cache, h_k, d] / [..., d_v], or, with ``block_table`` (int32
    [b, max_blocks] page indices), paged [num_blocks, page_block_size, h_k, d] (any page size >= 1). cache_seqlens:
    the cache rows each batch holds (int32 [b] device array, a host sequence, or one int). k / v (optional,
    [b, s_new, h_k, d] / [..., d_v]): new rows written into the cache at rows cache_seqlens[i] .. + s_new before
    attending (cache_seqlens itself is not changed; the cache must have room). cache_batch_idx (int32 [b], contiguous
    caches only): the cache batch of each batch. Every layout with a contiguous head dim works.

    causal: bottom-right aligned (query row i sees keys up to cache_seqlens + s_new - s_q + i); window=(left, right)
    a bottom-right sliding window (-1 = unbounded). scale defaults to 1/sqrt(d). GQA/MQA: the query heads of one kv
    head are computed together, so each K/V byte is read once. num_splits: parts each (batch, kv head)'s keys are
    cut into (0: chosen from the GPU's SM count; at most 128); the split accumulators are allocated on the call's
    stream.

    Returns O [b, s_q, h_q, d_v] (q's storage dtype; ``out`` is filled when given) and, with ``return_lse``,
    (O, LSE) with LSE float32 [b, h_q, s_q] (``lse_out`` may supply it).
    """
    call = _Call(stream, dtype)
    qv, kcv, vcv = call.view(q, "q"), call.view(k_cache, "k_cache"), call.view(v_cache, "v_cache")
    paged = block_table is not None
    cache_dims = ("[num_blocks, page_block_size, nheads_k, headdim]" if paged
                  else "[batch_cache, seqlen_cache, nheads_k, headdim]")
    _check_ndim(qv, 4, "[batch, seqlen_q, nheads, headdim]")
    _check_ndim(kcv, 4, cache_dims)
    _check_ndim(vcv, 4, cache_dims)
    kind = _same_dtype((qv, kcv, vcv), qv, call.override)
    _no_fp8(kind, "mha_fwd_kvcache")
    b, sq, hq, d = qv.shape
    nbc, cap, hk, dk = kcv.shape
    if dk != d:
        raise ValueError(f"k_cache: head dim {dk} does not match q's head dim {d}")
    if tuple(vcv.shape[:3]) != (nbc, cap, hk):
        raise ValueError(f"v_cache: shape {vcv.shape} does not match k_cache's {kcv.shape} in its first three dims")
    dv = vcv.shape[3]
    if hk < 1 or hq % hk:
        raise ValueError(f"k_cache: {hk} kv heads; q's head count {hq} must be a positive multiple of it (GQA/MQA)")
    _check_head_dim(qv, d, "head dim")
    _check_head_dim(kcv, d, "head dim")
    _check_head_dim(vcv, dv, "head dim of v")
    _check_fits_int32(qv, batch=b, seqlen=sq, nheads=hq)
    _check_fits_int32(kcv, seqlen=cap)
    mask_type, left, right = _resolve_mask(causal, None, window)
    scale = _resolve_scale(scale, d)
    num_splits = _as_int(num_splits, "num_splits")
    if not 0 <= num_splits <= 128:
        raise ValueError(f"num_splits: must be 0 (chosen from the GPU) or in [1, 128], got {num_splits}")
    return_lse = _as_flag(return_lse, "return_lse")

    # the block table, the batch map, the new rows
    btv = None
    max_blocks = 0
    if paged:
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx: works with contiguous caches only; a paged cache maps batches to pages "
                             "through block_table")
        btv = call.view(block_table, "block_table")
        if btv.ndim != 2 or btv.shape[0] != b:
            raise ValueError(f"block_table: expected shape ({b}, max_blocks) (int32 page indices), got {btv.shape}")
        if btv.dtype.name != "int32":
            raise TypeError(f"block_table: expected dtype int32, got {btv.dtype.name}")
        max_blocks = btv.shape[1]
        if max_blocks > 1 and btv.strides[1] != 1:
            raise ValueError(f"block_table: rows must be contiguous (stride 1), got strides {btv.strides}")
    elif cache_batch_idx is None and nbc != b:
        raise ValueError(f"k_cache: batch {nbc} does not match q's batch {b} (cache_batch_idx maps batches to other "
                         "cache batches)")
    idx_view, idx_host = (None, None)
    if cache_batch_idx is not None:
        idx_view, idx_host = _int32_vector(call, cache_batch_idx, "cache_batch_idx", b, "one cache batch per batch")
        if idx_host is not None and b and (idx_host.min() < 0 or idx_host.max() >= nbc):
            raise ValueError(f"cache_batch_idx: entries must be in [0, {nbc}), got {idx_host.tolist()}")
    capacity = max_blocks * cap if paged else cap
    seq_view, seq_host = _int32_vector(call, cache_seqlens, "cache_seqlens", b, "cache rows per batch")
    if (k is None) != (v is None):
        raise ValueError("k / v: give both new keys and new values, or neither")
    knv = vnv = None
    s_new = 0
    if k is not None:
        knv, vnv = call.view(k, "k"), call.view(v, "v")
        _check_ndim(knv, 4, "[batch, seqlen_new, nheads_k, headdim]")
        _check_ndim(vnv, 4, "[batch, seqlen_new, nheads_k, headdim_v]")
        s_new = knv.shape[1]
        _check_input_shape(knv, (b, s_new, hk, d), "the new keys: [batch, seqlen_new, nheads_k, headdim]")
        _check_input_shape(vnv, (b, s_new, hk, dv), "the new values: [batch, seqlen_new, nheads_k, headdim_v]")
        _same_dtype((knv, vnv), qv, call.override)
        _check_head_dim(knv, d, "head dim")
        _check_head_dim(vnv, dv, "head dim of v")
    if seq_host is not None and b and (seq_host.min() < 0 or seq_host.max() + s_new > capacity):
        raise ValueError(f"cache_seqlens: each batch's cache rows plus the {s_new} new ones must fit the cache's "
                         f"{capacity} rows, got {seq_host.tolist()}")
    if capacity + s_new > _INT32_MAX:
        raise ValueError(f"k_cache: {capacity} rows plus {s_new} new ones exceed the C API's 32-bit limit")

    storage = qv.dtype.name
    o_shape, lse_shape = (b, sq, hq, dv), (b, hq, sq)
    ov = call.output(out, "out", o_shape, storage, "[batch, seqlen_q, nheads, headdim_v]")
    if ov is not None:
        _check_head_dim(ov, dv, "head dim")
    lv = call.output(lse_out, "lse_out", lse_shape, "float32", "[batch, nheads, seqlen_q] float32")
    if lv is not None and sq > 1 and lv.strides[2] != 1:
        raise ValueError(f"lse_out: the seqlen dimension must be contiguous (stride 1), got strides {lv.strides}")
    views = [x for x in (qv, kcv, vcv, btv, idx_view, seq_view, knv, vnv, ov, lv) if x is not None]
    device = call.resolve_device(views)
    o = out if ov is not None else call.allocate(device, o_shape, storage)
    if ov is None:
        ov = call.view(o, "out")
    lse = None
    if return_lse or lv is not None:
        lse = lse_out if lv is not None else call.allocate(device, lse_shape, "float32")
        if lv is None:
            lv = call.view(lse, "lse_out")
    if b == 0 or (sq == 0 and s_new == 0) or hq == 0:
        return (o, lse) if return_lse else o

    from . import _capi
    lib = call.library("splitkv", device, kind, d, dv, "batch", True)
    call.order_inputs(views, device)
    uploads = []
    try:
        def device_vector(view, host):
            if view is not None:
                return view.ptr
            import numpy as np
            arr = host.astype(np.int32)
            alloc = call.layer.allocate(arr.nbytes, device, call.stream, call.stream_ref)
            call.layer.copy_from_host(alloc.ptr, arr.ctypes.data, arr.nbytes, device, call.stream)
            uploads.append(alloc)
            return alloc.ptr

        a = _capi.MhakitFwdSplitkvArgs()
        a.data_type = _capi.dtype_code(kind)
        a.has_lse = 1 if lv is not None else 0
        a.q_ptr, a.k_cache_ptr, a.v_cache_ptr, a.o_ptr = qv.ptr, kcv.ptr, vcv.ptr, ov.ptr
        a.lse_ptr = lv.ptr if lv is not None else None
        a.seqlen_k_ptr = device_vector(seq_view, seq_host)
        if paged:
            a.block_table_ptr = btv.ptr
            a.page_block_size = cap
            a.batch_stride_block_table = _stride(btv, 0, b)
        if cache_batch_idx is not None:
            a.cache_batch_idx_ptr = device_vector(idx_view, idx_host)
        if s_new:
            a.k_new_ptr, a.v_new_ptr = knv.ptr, vnv.ptr
            a.batch_stride_knew, a.stride_knew, a.nhead_stride_knew = (
                _stride(knv, 0, b), _stride(knv, 1, s_new, row_align=d), _stride(knv, 2, hk))
            a.batch_stride_vnew, a.stride_vnew, a.nhead_stride_vnew = (
                _stride(vnv, 0, b), _stride(vnv, 1, s_new, row_align=dv), _stride(vnv, 2, hk))
        a.seqlen_q, a.seqlen_knew, a.max_seqlen_k = sq, s_new, capacity
        a.batch, a.hdim_q, a.hdim_v, a.nhead_q, a.nhead_k = b, d, dv, hq, hk
        a.num_splits = num_splits
        a.scale_s = scale
        a.batch_stride_q, a.stride_q, a.nhead_stride_q = (
            _stride(qv, 0, b), _stride(qv, 1, sq, row_align=d), _stride(qv, 2, hq))
        a.batch_stride_o, a.stride_o, a.nhead_stride_o = (
            _stride(ov, 0, b), _stride(ov, 1, sq, row_align=dv), _stride(ov, 2, hq))
        a.batch_stride_k, a.stride_k, a.nhead_stride_k = (
            _stride(kcv, 0, nbc), _stride(kcv, 1, cap, row_align=d), _stride(kcv, 2, hk))
        a.batch_stride_v, a.stride_v, a.nhead_stride_v = (
            _stride(vcv, 0, nbc), _stride(vcv, 1, cap, row_align=dv), _stride(vcv, 2, hk))
        if lv is not None:
            a.batch_stride_lse, a.nhead_stride_lse = _stride(lv, 0, b), _stride(lv, 1, hq)
        a.mask_type, a.window_size_left, a.window_size_right = mask_type, left, right
        call.launch_splitkv(lib, a, device)
    finally:
        for u in uploads:
            u.free()
    return (o, lse) if return_lse else o


def _check_query_heads(hq: int, keys: int) -> None:
    if hq == 0 and keys > 0:
        raise ValueError("q: has 0 heads; the backward needs at least one query head (with none, dK and dV are zero)")


def _mha_bwd_py(do: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, *, causal: bool = False, mask: Any = None,
            window: Any = None, scale: Optional[float] = None, layout: str = "bshd", deterministic: bool = False,
            dq: Any = None, dk: Any = None, dv: Any = None, stream: Any = None, dtype: Any = None,
            softcap: Any = None, alibi_slopes: Any = None, bias: Any = None, sink: Any = None, dbias: Any = None,
            dsink: Any = None, dropout_p: Any = 0.0, seed: Any = None, offset: Any = 0):
    """Fused attention backward, batch mode: the gradients of :func:`mha_fwd` with respect to q, k and v.

    do: the gradient of O; q, k, v: the forward's inputs; o: the forward's output; lse: the forward's float32 LSE
    [b, h_q, s_q] (``mha_fwd(..., return_lse=True)``; natural log, the seqlen dimension contiguous). q, k, v, o and
    do are [b, s, h, d] for ``layout='bshd'`` (default) or [b, h, s, d] for ``layout='bhsd'``, any strides with a
    contiguous head dim, all fp16 or all bf16; do has o's shape [.., h_q, .., d_v]. causal / mask / window / scale /
    layout / dtype / stream mean what they mean in :func:`mha_fwd` and must be the forward's (causal is
    bottom-right aligned, as in FlashAttention; scale defaults to 1/sqrt(d)).

    deterministic: bitwise-identical gradients run to run (dQ reduced in a fixed order; slower).
    Returns (dq, dk, dv) shaped like q, k, v (dk, dv have h_k heads: with GQA/MQA they are the sums over the query
    heads of each kv head), with q's storage dtype, as :class:`mhakit.DeviceArray` — or the caller's ``dq=`` /
    ``dk=`` / ``dv=`` arrays (any strides with a contiguous head dim), filled and returned. The scratch memory the
    kernels need is allocated on ``stream`` for the call and freed after it, stream-ordered.

    softcap / alibi_slopes / bias / sink: the forward's score modifiers (:func:`mha_fwd`). ``dbias=`` ([b, h_q, s_q,
    s_k], the bias's dtype, contiguous keys) receives the gradient of an elementwise bias, ``dsink=`` (float32 [h_q])
    that of the sink logits; both are written, not accumulated.
    """
    _check_layout(layout)
    call = _Call(stream, dtype)
    g = _batch_inputs(call, q, k, v, layout)
    qv, kv, vv, kind = g.q, g.k, g.v, g.kind
    _no_fp8(kind, "the backward")
    b, sq, sk, hq, hk, d, d_v = g.b, g.sq, g.sk, g.hq, g.hk, g.d, g.dv
    o_shape = g.shape(hq, sq, d_v)
    o_dims = g.dims("seqlen_q", "nheads_q", "headdim_v")
    ov, dov = call.view(o, "o"), call.view(do, "do")
    _check_input_shape(ov, o_shape, f"the forward's output, {o_dims}")
    _check_input_shape(dov, o_shape, f"the gradient of o, {o_dims}")
    _same_dtype((qv, ov, dov), qv, call.override)
    _check_head_dim(ov, d_v, "head dim")
    _check_head_dim(dov, d_v, "head dim")
    lv = _lse_input(call, lse, (b, hq, sq), "the forward's LSE, [batch, nheads_q, seqlen_q] float32", 2, "seqlen")
    _check_query_heads(hq, b * sk * hk)
    mask_type, left, right = _resolve_mask(causal, mask, window)
    scale = _resolve_scale(scale, d)
    deterministic = _as_flag(deterministic, "deterministic")
    strides = {"q": g.strides(qv, hq, sq, d), "k": g.strides(kv, hk, sk, d), "v": g.strides(vv, hk, sk, d_v),
               "o": g.strides(ov, hq, sq, d_v), "do": g.strides(dov, hq, sq, d_v)}
    lse_strides = (_stride(lv, 0, b), _stride(lv, 1, hq))

    storage = qv.dtype.name
    grads = {}  # name -> [given array or None, its view or None, shape, heads, rows, hdim]
    for name, given, heads, rows, hdim, like in (("dq", dq, hq, sq, d, "q"), ("dk", dk, hk, sk, d, "k"),
                                                 ("dv", dv, hk, sk, d_v, "v")):
        shape = g.shape(heads, rows, hdim)
        view = call.output(given, name, shape, storage, f"like {like}, {layout}")
        if view is not None:
            _check_head_dim(view, hdim, "head dim")
            g.strides(view, heads, rows, hdim)
        grads[name] = [given, view, shape, heads, rows, hdim]

    mods, mod_views = _score_mods(call, storage, b, hq, sq, sk, softcap=softcap, alibi_slopes=alibi_slopes,
                                  bias=bias, sink=sink, dropout_p=dropout_p, seed=seed, offset=offset)
    mod_out, mod_out_views = _mod_grads(call, mods, storage, b, hq, sq, sk, dbias, dsink)
    views = [qv, kv, vv, ov, dov, lv] + [gr[1] for gr in grads.values() if gr[1] is not None]
    views += mod_views + mod_out_views
    device = call.resolve_device(views)
    for name, gr in grads.items():
        if gr[1] is None:
            gr[0] = call.allocate(device, gr[2], storage)
            gr[1] = call.view(gr[0], name)
    result = tuple(grads[name][0] for name in ("dq", "dk", "dv"))
    if b == 0 or hq == 0 or (sq == 0 and sk == 0):
        return result

    from . import _capi
    lib = call.library("bwd", device, kind, d, d_v, "batch", mask_type != 0, _modifier_kinds(mods))
    call.order_inputs(views, device)
    dqv, dkv, dvv = (grads[name][1] for name in ("dq", "dk", "dv"))
    args = _capi.make_bwd_args(
        dtype=kind, q_ptr=qv.ptr, k_ptr=kv.ptr, v_ptr=vv.ptr, o_ptr=ov.ptr, lse_ptr=lv.ptr, do_ptr=dov.ptr,
        dq_ptr=dqv.ptr, dk_ptr=dkv.ptr, dv_ptr=dvv.ptr, batch=b, nhead_q=hq, nhead_k=hk, hdim_q=d, hdim_v=d_v,
        seqlen_q=sq, seqlen_k=sk, q_strides=strides["q"], k_strides=strides["k"], v_strides=strides["v"],
        o_strides=strides["o"], do_strides=strides["do"], lse_strides=lse_strides,
        dq_strides=g.strides(dqv, hq, sq, d), dk_strides=g.strides(dkv, hk, sk, d),
        dv_strides=g.strides(dvv, hk, sk, d_v), deterministic=deterministic, scale=scale, mask_type=mask_type,
        window_left=left, window_right=right)
    _set_fields(args, {**mods, **mod_out})
    call.launch_bwd(lib, args, device)
    return result


def _mha_varlen_bwd_py(do: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, cu_seqlens_q: Any, cu_seqlens_k: Any,
                   max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = False, mask: Any = None,
                   window: Any = None, scale: Optional[float] = None, deterministic: bool = False, dq: Any = None,
                   dk: Any = None, dv: Any = None, stream: Any = None, dtype: Any = None, softcap: Any = None,
                   alibi_slopes: Any = None, bias: Any = None, sink: Any = None, dbias: Any = None,
                   dsink: Any = None, dropout_p: Any = 0.0, seed: Any = None, offset: Any = 0):
    """Fused attention backward, group mode (variable sequence lengths, packed tokens): the gradients of
    :func:`mha_varlen_fwd`.

    q: [total_q, h_q, d], k: [total_k, h_k, d], v: [total_k, h_k, d_v], o and do: [total_q, h_q, d_v]; lse: the
    forward's float32 LSE [h_q, total_q] (token dimension contiguous). cu_seqlens_q / cu_seqlens_k: batch+1 int32
    offsets as in :func:`mha_varlen_fwd` (device arrays, or host sequences that are validated and uploaded);
    sequences may be empty. max_seqlen_q and max_seqlen_k must bound every query and key length (they size the launch
    and the scratch memory; host offsets are checked against them). Returns (dq [total_q, h_q, d],
    dk [total_k, h_k, d], dv [total_k, h_k, d_v]); rows outside every sequence are not written. The other
    arguments are those of :func:`mha_bwd`.
    """
    call = _Call(stream, dtype)
    g = _packed_inputs(call, q, k, v)
    qv, kv, vv, kind = g.q, g.k, g.v, g.kind
    tq, tk, hq, hk, d, d_v = g.tq, g.tk, g.hq, g.hk, g.d, g.dv
    o_shape = (tq, hq, d_v)
    ov, dov = call.view(o, "o"), call.view(do, "do")
    _check_ndim(ov, 3, "[total_q, nheads_q, headdim_v]")
    _check_ndim(dov, 3, "[total_q, nheads_q, headdim_v]")
    _check_input_shape(ov, o_shape, "the forward's output, [total_q, nheads_q, headdim_v]")
    _check_input_shape(dov, o_shape, "the gradient of o, [total_q, nheads_q, headdim_v]")
    _same_dtype((qv, ov, dov), qv, call.override)
    _check_head_dim(ov, d_v, "head dim")
    _check_head_dim(dov, d_v, "head dim")
    lv = _lse_input(call, lse, (hq, tq), "the forward's LSE, [nheads_q, total_q] float32", 1, "token")
    _check_query_heads(hq, tk * hk)
    seqs = _seqstarts(call, cu_seqlens_q, cu_seqlens_k, tq, tk, max_seqlen_q, max_seqlen_k)
    mask_type, left, right = _resolve_mask(causal, mask, window)
    scale = _resolve_scale(scale, d)
    deterministic = _as_flag(deterministic, "deterministic")
    strides = {"q": g.strides(qv, tq, hq, d), "k": g.strides(kv, tk, hk, d), "v": g.strides(vv, tk, hk, d_v),
               "o": g.strides(ov, tq, hq, d_v), "do": g.strides(dov, tq, hq, d_v)}
    lse_strides = (0, _stride(lv, 0, hq))

    storage = qv.dtype.name
    grads = {}  # name -> [given array or None, its view or None, shape, tokens, heads, hdim]
    for name, given, tokens, heads, hdim, like in (("dq", dq, tq, hq, d, "q"), ("dk", dk, tk, hk, d, "k"),
                                                   ("dv", dv, tk, hk, d_v, "v")):
        shape = (tokens, heads, hdim)
        view = call.output(given, name, shape, storage, f"like {like}, [total, nheads, headdim]")
        if view is not None:
            _check_head_dim(view, hdim, "head dim")
            g.strides(view, tokens, heads, hdim)
        grads[name] = [given, view, shape, tokens, heads, hdim]

    max_k = _as_int(max_seqlen_k, "max_seqlen_k")
    mods, mod_views = _score_mods(call, storage, seqs.batch, hq, seqs.max_q, max_k, softcap=softcap,
                                  alibi_slopes=alibi_slopes, bias=bias, sink=sink, dropout_p=dropout_p, seed=seed,
                                  offset=offset)
    mod_out, mod_out_views = _mod_grads(call, mods, storage, seqs.batch, hq, seqs.max_q, max_k, dbias, dsink)
    views = ([qv, kv, vv, ov, dov, lv] + list(seqs.device.values())
             + [gr[1] for gr in grads.values() if gr[1] is not None] + mod_views + mod_out_views)
    device = call.resolve_device(views)
    for name, gr in grads.items():
        if gr[1] is None:
            gr[0] = call.allocate(device, gr[2], storage)
            gr[1] = call.view(gr[0], name)
    result = tuple(grads[name][0] for name in ("dq", "dk", "dv"))
    if seqs.batch == 0 or hq == 0 or (tq == 0 and tk == 0) or (seqs.max_q == 0 and seqs.max_k == 0):
        return result

    from . import _capi
    lib = call.library("bwd", device, kind, d, d_v, "group", mask_type != 0, _modifier_kinds(mods))
    call.order_inputs(views, device)
    dqv, dkv, dvv = (grads[name][1] for name in ("dq", "dk", "dv"))
    # Group mode: the C API wants every pointer non-null. A side without tokens (total 0) is never addressed, so any
    # valid address stands in for its pointers.
    stand_in = next(x.ptr for x in (qv, kv, ov, dov, lv, dqv, dkv) if x.ptr)
    ptr = lambda view: view.ptr or stand_in  # noqa: E731
    seq_ptrs, uploads = seqs.pointers(call, device)
    try:
        args = _capi.make_bwd_args(
            dtype=kind, q_ptr=ptr(qv), k_ptr=ptr(kv), v_ptr=ptr(vv), o_ptr=ptr(ov), lse_ptr=ptr(lv), do_ptr=ptr(dov),
            dq_ptr=ptr(dqv), dk_ptr=ptr(dkv), dv_ptr=ptr(dvv), batch=seqs.batch, nhead_q=hq, nhead_k=hk, hdim_q=d,
            hdim_v=d_v, seqlen_q=tq, seqlen_k=tk, q_strides=strides["q"], k_strides=strides["k"],
            v_strides=strides["v"], o_strides=strides["o"], do_strides=strides["do"], lse_strides=lse_strides,
            dq_strides=g.strides(dqv, tq, hq, d), dk_strides=g.strides(dkv, tk, hk, d),
            dv_strides=g.strides(dvv, tk, hk, d_v), seqstart_q_ptr=seq_ptrs["cu_seqlens_q"],
            seqstart_k_ptr=seq_ptrs["cu_seqlens_k"], max_seqlen_q=seqs.max_q, max_seqlen_k=seqs.max_k,
            deterministic=deterministic, scale=scale, mask_type=mask_type, window_left=left, window_right=right)
        _set_fields(args, {**mods, **mod_out})
        call.launch_bwd(lib, args, device)
    finally:
        for alloc in uploads:  # freed stream-ordered, after the launch
            alloc.free()
    return result


# ------------------------------------------------------------------------------------------------------------------
# The public calls: the C call path (mhakit._ext) first, the Python path above for everything it hands back
# ------------------------------------------------------------------------------------------------------------------
#
# The C path reads the arrays, allocates outputs, fills the argument struct and launches; whatever it does not take
# (host offsets, __cuda_array_interface__-only producers, a shape or dtype mismatch, an empty problem, an unusual
# stream object, ...) it returns as NotImplemented before touching the GPU, and the Python path then does the work
# or raises its one-sentence error. Here only what C cannot see is resolved: the mask string or flags, the layout
# name and the dtype override. The score modifiers (softcap=, alibi_slopes=, bias=, sink=, dbias=, dsink=) go to
# the C path as one tuple (None without them); it hands back what it does not take (a varlen bias, ...).

_LAYOUT_CODES = {"bshd": 0, "bhsd": 1}
_PACKED = 2


def _dtype_code(dtype: Any) -> Optional[int]:
    """The C enum of a dtype override (None: read it from q)."""
    if dtype is None:
        return None
    from . import _capi
    return _capi.dtype_code(_normalise_dtype(dtype))


def _ext_callbacks():
    """(resolve, allocate, make_error, cuda_error) for _mhakit_ext.configure."""
    from . import _capi, _cuda, jit

    def resolve(api_name, device, kind, hdim_q, hdim_v, mode, masked, mods):
        head_dims = _codegen.submodule("catalogue").load("cuda").head_dims
        if not (head_dims.accepts(hdim_q) and head_dims.accepts(hdim_v)):
            return None  # the Python path says why
        lib = jit.library(api_name, device, kind, hdim_q, hdim_v, mode, masked, mods=mods)
        return lib.splitkv_entry_points() if api_name == "splitkv" else lib.entry_points()

    def allocate(device, shape, storage, stream, stream_ref):
        # The allocation keeps the caller's stream object alive: it is freed on that stream.
        dtype = _arrays.dtype_by_name(storage)
        alloc = _cuda.allocate(math.prod(shape) * dtype.itemsize, device, stream, stream_ref)
        return DeviceArray(alloc.ptr, shape, dtype, device, owner=alloc, stream=stream)

    def cuda_error(message):
        kind = _cuda.CudaUnavailableError if message.startswith("no usable") else _cuda.CudaError
        return kind(message)

    return resolve, allocate, _capi.error_for, cuda_error


def _ext():
    """The C call path's module, or None. The per-call cost matters here (a few hundred ns of Python on every call):
    the loaded module is read straight from _ext's state, and only the first call (or one after a reset) goes
    through _ext.module()."""
    mod = _ext_module._STATE.get("module", False)
    return mod if mod is not False else _ext_module.module()


def mha_fwd(q: Any, k: Any, v: Any, *, causal: bool = False, mask: Any = None, window: Any = None,
            scale: Optional[float] = None, return_lse: bool = False, out: Any = None, lse_out: Any = None,
            layout: str = "bshd", stream: Any = None, dtype: Any = None, **mods: Any):
    ext_mods = _ext_mods(mods, _FWD_MODS) if mods else None
    ext = None if ext_mods is _PYTHON_PATH else _ext()
    if ext is not None:
        mask_type, left, right = _resolve_mask(causal, mask, window)
        result = ext.fwd(q, k, v, out, lse_out, None, None, None, _LAYOUT_CODES.get(layout, -1), mask_type, left,
                         right, scale, return_lse, stream, _dtype_code(dtype), ext_mods, LOG_LEVEL)
        if result is not NotImplemented:
            return result
    return _mha_fwd_py(q, k, v, causal=causal, mask=mask, window=window, scale=scale, return_lse=return_lse,
                       out=out, lse_out=lse_out, layout=layout, stream=stream, dtype=dtype, **mods)


def mha_varlen_fwd(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: int,
                   max_seqlen_k: int, *, causal: bool = False, mask: Any = None, window: Any = None,
                   scale: Optional[float] = None, return_lse: bool = False, out: Any = None, lse_out: Any = None,
                   stream: Any = None, dtype: Any = None, **mods: Any):
    ext_mods = _ext_mods(mods, _FWD_MODS) if mods else None
    ext = None if ext_mods is _PYTHON_PATH else _ext()
    if ext is not None:
        mask_type, left, right = _resolve_mask(causal, mask, window)
        result = ext.fwd(q, k, v, out, lse_out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, _PACKED, mask_type, left,
                         right, scale, return_lse, stream, _dtype_code(dtype), ext_mods, LOG_LEVEL)
        if result is not NotImplemented:
            return result
    return _mha_varlen_fwd_py(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                              mask=mask, window=window, scale=scale, return_lse=return_lse, out=out, lse_out=lse_out,
                              stream=stream, dtype=dtype, **mods)


def mha_fwd_kvcache(q: Any, k_cache: Any, v_cache: Any, cache_seqlens: Any, *, block_table: Any = None, k: Any = None,
                    v: Any = None, cache_batch_idx: Any = None, causal: bool = False, window: Any = None,
                    scale: Optional[float] = None, num_splits: int = 0, return_lse: bool = False, out: Any = None,
                    lse_out: Any = None, stream: Any = None, dtype: Any = None):
    ext = _ext()
    if ext is not None:
        mask_type, left, right = _resolve_mask(causal, None, window)
        result = ext.kvcache(q, k_cache, v_cache, cache_seqlens, block_table, k, v, cache_batch_idx, out, lse_out,
                             mask_type, left, right, scale, num_splits, return_lse, stream, _dtype_code(dtype),
                             LOG_LEVEL)
        if result is not NotImplemented:
            return result
    return _mha_fwd_kvcache_py(q, k_cache, v_cache, cache_seqlens, block_table=block_table, k=k, v=v,
                               cache_batch_idx=cache_batch_idx, causal=causal, window=window, scale=scale,
                               num_splits=num_splits, return_lse=return_lse, out=out, lse_out=lse_out, stream=stream,
                               dtype=dtype)


def mha_bwd(do: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, *, causal: bool = False, mask: Any = None,
            window: Any = None, scale: Optional[float] = None, layout: str = "bshd", deterministic: bool = False,
            dq: Any = None, dk: Any = None, dv: Any = None, stream: Any = None, dtype: Any = None, **mods: Any):
    ext_mods = _ext_mods(mods, _BWD_MODS) if mods else None
    ext = None if ext_mods is _PYTHON_PATH else _ext()
    if ext is not None:
        mask_type, left, right = _resolve_mask(causal, mask, window)
        result = ext.bwd(do, q, k, v, o, lse, dq, dk, dv, None, None, None, None, _LAYOUT_CODES.get(layout, -1),
                         mask_type, left, right, scale, deterministic, stream, _dtype_code(dtype), ext_mods,
                         LOG_LEVEL)
        if result is not NotImplemented:
            return result
    return _mha_bwd_py(do, q, k, v, o, lse, causal=causal, mask=mask, window=window, scale=scale, layout=layout,
                       deterministic=deterministic, dq=dq, dk=dk, dv=dv, stream=stream, dtype=dtype, **mods)


def mha_varlen_bwd(do: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, cu_seqlens_q: Any, cu_seqlens_k: Any,
                   max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = False, mask: Any = None,
                   window: Any = None, scale: Optional[float] = None, deterministic: bool = False, dq: Any = None,
                   dk: Any = None, dv: Any = None, stream: Any = None, dtype: Any = None, **mods: Any):
    ext_mods = _ext_mods(mods, _BWD_MODS) if mods else None
    ext = None if ext_mods is _PYTHON_PATH else _ext()
    if ext is not None:
        mask_type, left, right = _resolve_mask(causal, mask, window)
        result = ext.bwd(do, q, k, v, o, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                         _PACKED, mask_type, left, right, scale, deterministic, stream, _dtype_code(dtype),
                         ext_mods, LOG_LEVEL)
        if result is not NotImplemented:
            return result
    return _mha_varlen_bwd_py(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              causal=causal, mask=mask, window=window, scale=scale, deterministic=deterministic,
                              dq=dq, dk=dk, dv=dv, stream=stream, dtype=dtype, **mods)


for _public, _python_path in ((mha_fwd, _mha_fwd_py), (mha_varlen_fwd, _mha_varlen_fwd_py), (mha_bwd, _mha_bwd_py),
                              (mha_varlen_bwd, _mha_varlen_bwd_py), (mha_fwd_kvcache, _mha_fwd_kvcache_py)):
    _public.__doc__ = _python_path.__doc__
del _public, _python_path
