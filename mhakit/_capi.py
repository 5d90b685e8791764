"""ctypes mirror of the C API in csrc/include/mha_common.h, csrc/include/mha_fwd.h and csrc/include/mha_bwd.h.

This is the thin layer that the Python front end and bench/ stand on: the argument structs, the constants, loaders
for libmha_fwd.so and libmha_bwd.so and helpers that fill ``mhakit_fwd_args`` / ``mhakit_bwd_args`` from sizes,
element strides and raw device pointers (integers, e.g. ``tensor.data_ptr()`` or ``cupy_array.data.ptr``). Nothing
here imports a GPU library.

The structs hold raw addresses only: the caller keeps the arrays they point to alive while the call runs.
tests/test_capi_layout.py checks field offsets and sizes against the C header with the system C compiler.
"""

from __future__ import annotations

import ctypes
import math
import os
import threading
from typing import Dict, Optional, Sequence, Union

__all__ = [
    "DTYPE_FP16", "DTYPE_BF16", "DTYPE_FP8_BF16", "DTYPE_FP8_FP16",
    "MASK_NONE", "MASK_TOP_LEFT", "MASK_BOTTOM_RIGHT", "MASK_GENERIC",
    "ERROR_UNSUPPORTED", "ERROR_INVALID_ARGS", "ERROR_CUDA",
    "MhakitStreamConfig", "MhakitFwdArgs", "MhakitBwdArgs", "MhakitError", "MhakitValueError", "error_for",
    "FwdLibrary", "BwdLibrary", "load_library", "load_bwd_library", "dtype_code", "make_fwd_args",
    "make_bwd_args", "make_stream_config",
]

# mhakit_dtype
DTYPE_FP16 = 0
DTYPE_BF16 = 1
DTYPE_FP8_BF16 = 2  # e4m3 q/k/v, bf16 o (forward only)
DTYPE_FP8_FP16 = 3  # e4m3 q/k/v, fp16 o (forward only)
# mhakit_mask_type
MASK_NONE = 0
MASK_TOP_LEFT = 1
MASK_BOTTOM_RIGHT = 2
MASK_GENERIC = 3
# mhakit_bias_type
BIAS_NONE = 0
BIAS_ELEMENTWISE = 1
BIAS_ALIBI = 2
# mhakit_score_mod: the bits of the score modifiers a call sets, by the catalogue's names (codegen SCORE_MODS)
SCORE_MOD_BITS: Dict[str, int] = {"softcap": 1, "bias": 2, "alibi": 4, "sink": 8, "dropout": 16}
# Negative return codes of mhakit_mha_fwd / mhakit_mha_bwd
ERROR_UNSUPPORTED = -1
ERROR_INVALID_ARGS = -2
ERROR_CUDA = -3
_ERROR_NAMES = {ERROR_UNSUPPORTED: "unsupported", ERROR_INVALID_ARGS: "invalid arguments", ERROR_CUDA: "CUDA error"}

_DTYPE_NAMES: Dict[str, int] = {
    "fp16": DTYPE_FP16, "float16": DTYPE_FP16, "half": DTYPE_FP16,
    "bf16": DTYPE_BF16, "bfloat16": DTYPE_BF16,
    "fp8bf16": DTYPE_FP8_BF16, "fp8": DTYPE_FP8_BF16, "fp8fp16": DTYPE_FP8_FP16,
}


class MhakitStreamConfig(ctypes.Structure):
    """``mhakit_stream_config`` (mha_common.h)."""

    _fields_ = [
        ("stream", ctypes.c_void_p),   # cudaStream_t; None = legacy default stream
        ("time_kernel", ctypes.c_int),
        ("log_level", ctypes.c_int),
        ("warmup", ctypes.c_int),
        ("repeat", ctypes.c_int),
        ("gpu_timer", ctypes.c_int),
    ]


# The score modifiers' block, the same at the end of both argument structs (the backward adds its gradients).
_MOD_FIELDS = [
    ("logits_soft_cap", ctypes.c_float),
    ("bias_type", ctypes.c_int),
    ("bias_fp32", ctypes.c_int),
    ("bias_ptr", ctypes.c_void_p),
    ("stride_bias", ctypes.c_int64),
    ("nhead_stride_bias", ctypes.c_int64),
    ("batch_stride_bias", ctypes.c_int64),
    ("sink_ptr", ctypes.c_void_p),
]

# Dropout's fields, the same in both argument structs (after the modifiers; the forward adds its randval store).
_DROP_FIELDS = [
    ("p_drop", ctypes.c_float),
    ("drop_seed", ctypes.c_uint64),
    ("drop_offset", ctypes.c_uint64),
    ("drop_seed_ptr", ctypes.c_void_p),
    ("drop_offset_ptr", ctypes.c_void_p),
]


class MhakitFwdArgs(ctypes.Structure):
    """``mhakit_fwd_args`` (mha_fwd.h). ``data_type`` is the C enum ``mhakit_dtype`` (an int)."""

    _fields_ = [
        ("data_type", ctypes.c_int),
        ("is_group_mode", ctypes.c_int),
        ("has_lse", ctypes.c_int),
        ("q_ptr", ctypes.c_void_p),
        ("k_ptr", ctypes.c_void_p),
        ("v_ptr", ctypes.c_void_p),
        ("o_ptr", ctypes.c_void_p),
        ("lse_ptr", ctypes.c_void_p),
        ("seqstart_q_ptr", ctypes.c_void_p),
        ("seqstart_k_ptr", ctypes.c_void_p),
        ("seqlen_q", ctypes.c_int),
        ("seqlen_k", ctypes.c_int),
        ("batch", ctypes.c_int),
        ("max_seqlen_q", ctypes.c_int),
        ("hdim_q", ctypes.c_int),
        ("hdim_v", ctypes.c_int),
        ("nhead_q", ctypes.c_int),
        ("nhead_k", ctypes.c_int),
        ("scale_s", ctypes.c_float),
        ("stride_q", ctypes.c_int64),
        ("stride_k", ctypes.c_int64),
        ("stride_v", ctypes.c_int64),
        ("stride_o", ctypes.c_int64),
        ("nhead_stride_q", ctypes.c_int64),
        ("nhead_stride_k", ctypes.c_int64),
        ("nhead_stride_v", ctypes.c_int64),
        ("nhead_stride_o", ctypes.c_int64),
        ("nhead_stride_lse", ctypes.c_int64),
        ("batch_stride_q", ctypes.c_int64),
        ("batch_stride_k", ctypes.c_int64),
        ("batch_stride_v", ctypes.c_int64),
        ("batch_stride_o", ctypes.c_int64),
        ("batch_stride_lse", ctypes.c_int64),
        ("mask_type", ctypes.c_int),
        ("window_size_left", ctypes.c_int),
        ("window_size_right", ctypes.c_int),
    ] + _MOD_FIELDS + _DROP_FIELDS + [
        ("randval_ptr", ctypes.c_void_p),
        ("stride_randval", ctypes.c_int64),
        ("nhead_stride_randval", ctypes.c_int64),
        ("batch_stride_randval", ctypes.c_int64),
        ("q_descale_ptr", ctypes.c_void_p),   # fp8: device fp32 descale factors
        ("k_descale_ptr", ctypes.c_void_p),
        ("v_descale_ptr", ctypes.c_void_p),
        ("workspace_ptr", ctypes.c_void_p),   # fp8: V transposed (mhakit_mha_fwd_workspace_size bytes)
        ("workspace_bytes", ctypes.c_size_t),
    ]

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name, _ in self._fields_)
        return f"MhakitFwdArgs({fields})"


class MhakitFwdSplitkvArgs(ctypes.Structure):
    """``mhakit_fwd_splitkv_args`` (mha_fwd.h): decode against a (paged) KV cache."""

    _fields_ = [
        ("data_type", ctypes.c_int),
        ("has_lse", ctypes.c_int),
        ("q_ptr", ctypes.c_void_p),
        ("k_cache_ptr", ctypes.c_void_p),
        ("v_cache_ptr", ctypes.c_void_p),
        ("k_new_ptr", ctypes.c_void_p),
        ("v_new_ptr", ctypes.c_void_p),
        ("o_ptr", ctypes.c_void_p),
        ("lse_ptr", ctypes.c_void_p),
        ("lse_acc_ptr", ctypes.c_void_p),
        ("o_acc_ptr", ctypes.c_void_p),
        ("seqlen_k_ptr", ctypes.c_void_p),
        ("block_table_ptr", ctypes.c_void_p),
        ("cache_batch_idx_ptr", ctypes.c_void_p),
        ("seqlen_q", ctypes.c_int),
        ("seqlen_knew", ctypes.c_int),
        ("max_seqlen_k", ctypes.c_int),
        ("batch", ctypes.c_int),
        ("hdim_q", ctypes.c_int),
        ("hdim_v", ctypes.c_int),
        ("nhead_q", ctypes.c_int),
        ("nhead_k", ctypes.c_int),
        ("page_block_size", ctypes.c_int),
        ("num_splits", ctypes.c_int),
        ("scale_s", ctypes.c_float),
        ("stride_q", ctypes.c_int64),
        ("stride_k", ctypes.c_int64),
        ("stride_v", ctypes.c_int64),
        ("stride_knew", ctypes.c_int64),
        ("stride_vnew", ctypes.c_int64),
        ("stride_o", ctypes.c_int64),
        ("nhead_stride_q", ctypes.c_int64),
        ("nhead_stride_k", ctypes.c_int64),
        ("nhead_stride_v", ctypes.c_int64),
        ("nhead_stride_knew", ctypes.c_int64),
        ("nhead_stride_vnew", ctypes.c_int64),
        ("nhead_stride_o", ctypes.c_int64),
        ("nhead_stride_lse", ctypes.c_int64),
        ("batch_stride_q", ctypes.c_int64),
        ("batch_stride_k", ctypes.c_int64),
        ("batch_stride_v", ctypes.c_int64),
        ("batch_stride_knew", ctypes.c_int64),
        ("batch_stride_vnew", ctypes.c_int64),
        ("batch_stride_o", ctypes.c_int64),
        ("batch_stride_lse", ctypes.c_int64),
        ("batch_stride_block_table", ctypes.c_int64),
        ("mask_type", ctypes.c_int),
        ("window_size_left", ctypes.c_int),
        ("window_size_right", ctypes.c_int),
    ]

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name, _ in self._fields_)
        return f"MhakitFwdSplitkvArgs({fields})"


class MhakitBwdArgs(ctypes.Structure):
    """``mhakit_bwd_args`` (mha_bwd.h). ``data_type`` is the C enum ``mhakit_dtype`` (an int)."""

    _fields_ = [
        ("data_type", ctypes.c_int),
        ("is_group_mode", ctypes.c_int),
        ("deterministic", ctypes.c_int),
        ("q_ptr", ctypes.c_void_p),
        ("k_ptr", ctypes.c_void_p),
        ("v_ptr", ctypes.c_void_p),
        ("o_ptr", ctypes.c_void_p),
        ("lse_ptr", ctypes.c_void_p),
        ("do_ptr", ctypes.c_void_p),
        ("dq_ptr", ctypes.c_void_p),
        ("dk_ptr", ctypes.c_void_p),
        ("dv_ptr", ctypes.c_void_p),
        ("workspace_ptr", ctypes.c_void_p),
        ("workspace_bytes", ctypes.c_size_t),
        ("seqstart_q_ptr", ctypes.c_void_p),
        ("seqstart_k_ptr", ctypes.c_void_p),
        ("seqlen_q", ctypes.c_int),
        ("seqlen_k", ctypes.c_int),
        ("batch", ctypes.c_int),
        ("max_seqlen_q", ctypes.c_int),
        ("max_seqlen_k", ctypes.c_int),
        ("hdim_q", ctypes.c_int),
        ("hdim_v", ctypes.c_int),
        ("nhead_q", ctypes.c_int),
        ("nhead_k", ctypes.c_int),
        ("scale", ctypes.c_float),
        ("stride_q", ctypes.c_int64),
        ("stride_k", ctypes.c_int64),
        ("stride_v", ctypes.c_int64),
        ("stride_o", ctypes.c_int64),
        ("stride_do", ctypes.c_int64),
        ("stride_dq", ctypes.c_int64),
        ("stride_dk", ctypes.c_int64),
        ("stride_dv", ctypes.c_int64),
        ("nhead_stride_q", ctypes.c_int64),
        ("nhead_stride_k", ctypes.c_int64),
        ("nhead_stride_v", ctypes.c_int64),
        ("nhead_stride_o", ctypes.c_int64),
        ("nhead_stride_do", ctypes.c_int64),
        ("nhead_stride_dq", ctypes.c_int64),
        ("nhead_stride_dk", ctypes.c_int64),
        ("nhead_stride_dv", ctypes.c_int64),
        ("nhead_stride_lse", ctypes.c_int64),
        ("batch_stride_q", ctypes.c_int64),
        ("batch_stride_k", ctypes.c_int64),
        ("batch_stride_v", ctypes.c_int64),
        ("batch_stride_o", ctypes.c_int64),
        ("batch_stride_do", ctypes.c_int64),
        ("batch_stride_dq", ctypes.c_int64),
        ("batch_stride_dk", ctypes.c_int64),
        ("batch_stride_dv", ctypes.c_int64),
        ("batch_stride_lse", ctypes.c_int64),
        ("mask_type", ctypes.c_int),
        ("window_size_left", ctypes.c_int),
        ("window_size_right", ctypes.c_int),
    ] + _MOD_FIELDS + [
        ("dbias_ptr", ctypes.c_void_p),
        ("stride_dbias", ctypes.c_int64),
        ("nhead_stride_dbias", ctypes.c_int64),
        ("batch_stride_dbias", ctypes.c_int64),
        ("dsink_ptr", ctypes.c_void_p),
    ] + _DROP_FIELDS

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name, _ in self._fields_)
        return f"MhakitBwdArgs({fields})"


class MhakitError(RuntimeError):
    """A negative return code of the library (or 0 when the call has no code), with ``mhakit_last_error()``'s
    sentence. Invalid arguments (-2) raise :class:`MhakitValueError`, which is a ValueError too."""

    def __init__(self, code: int, message: str):
        self.code = int(code)
        self.message = message
        if self.code == 0:
            super().__init__(f"mhakit error: {message}")
        else:
            super().__init__(f"mhakit error {self.code} ({_ERROR_NAMES.get(self.code, 'unknown')}): {message}")


class MhakitValueError(MhakitError, ValueError):
    """The library refused the arguments (MHAKIT_ERROR_INVALID_ARGS): nothing was launched."""


def error_for(code: int, message: str) -> MhakitError:
    """The exception for a library return code: MhakitValueError for invalid arguments, else MhakitError."""
    return (MhakitValueError if int(code) == ERROR_INVALID_ARGS else MhakitError)(code, message)


def _check_int32(name: str, value: int) -> int:
    value = int(value)
    if not -(1 << 31) <= value < (1 << 31):
        raise OverflowError(f"{name}={value} does not fit in a C int")
    return value


def dtype_code(dtype: Union[int, str]) -> int:
    """mhakit_dtype code from an int or a name: fp16/float16/half, bf16/bfloat16 (``torch.bfloat16`` etc. too)."""
    if isinstance(dtype, int):
        if dtype not in (DTYPE_FP16, DTYPE_BF16, DTYPE_FP8_BF16, DTYPE_FP8_FP16):
            raise ValueError(f"unknown mhakit_dtype code {dtype}")
        return dtype
    name = str(dtype).rsplit(".", 1)[-1].lower()  # "torch.bfloat16" -> "bfloat16"
    if name not in _DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {dtype!r}; mhakit takes fp16, bf16, or fp8bf16 / fp8fp16 (forward)")
    return _DTYPE_NAMES[name]


def _strides3(name: str, strides: Sequence[int]):
    if len(strides) != 3:
        raise ValueError(f"{name}: expected (batch_stride, nhead_stride, row_stride) in elements, got {strides}")
    return tuple(int(s) for s in strides)


def make_fwd_args(*, dtype: Union[int, str], q_ptr: int, k_ptr: int, v_ptr: int, o_ptr: int,
                  batch: int, nhead_q: int, nhead_k: int, hdim_q: int, hdim_v: int,
                  q_strides: Sequence[int], k_strides: Sequence[int], v_strides: Sequence[int],
                  o_strides: Sequence[int],
                  seqlen_q: int = 0, seqlen_k: int = 0,
                  lse_ptr: Optional[int] = None, lse_strides: Sequence[int] = (0, 0),
                  seqstart_q_ptr: Optional[int] = None, seqstart_k_ptr: Optional[int] = None,
                  max_seqlen_q: Optional[int] = None, scale: Optional[float] = None,
                  mask_type: int = MASK_NONE, window_left: int = -1, window_right: int = -1,
                  descale_ptrs: Optional[Sequence[int]] = None) -> MhakitFwdArgs:
    """Fill an ``MhakitFwdArgs``.

    Strides are element strides ``(batch_stride, nhead_stride, row_stride)`` per tensor (head dim contiguous);
    for a torch tensor in b·h·s·d that is ``(t.stride(0), t.stride(1), t.stride(2))``, in b·s·h·d
    ``(t.stride(0), t.stride(2), t.stride(1))``. lse_strides is ``(batch_stride_lse, nhead_stride_lse)``.
    Group mode is selected by passing both seqstart pointers (device int32 arrays of batch + 1 offsets); then the
    batch strides are ignored by the library, ``max_seqlen_q`` is required and ``seqlen_q`` / ``seqlen_k`` give the
    packed row counts of q / k (the bound TMA kernels need; 0: unknown, such calls run on the generic family).
    ``lse_ptr`` given => has_lse = 1.
    ``scale`` defaults to 1/sqrt(hdim_q).
    ``descale_ptrs``: fp8 only, the device addresses of the fp32 descale factors of q, k and v. The workspace (fp8:
    V transposed) is set afterwards: ``workspace_ptr`` / ``workspace_bytes`` of ``FwdLibrary.workspace_size(args)``.
    """
    group = seqstart_q_ptr is not None or seqstart_k_ptr is not None
    if group and (seqstart_q_ptr is None or seqstart_k_ptr is None):
        raise ValueError("group mode needs both seqstart_q_ptr and seqstart_k_ptr")
    if group and max_seqlen_q is None:
        raise ValueError("group mode needs max_seqlen_q")
    if scale is None:
        scale = 1.0 / math.sqrt(hdim_q) if hdim_q > 0 else 0.0

    qb, qh, qs = _strides3("q_strides", q_strides)
    kb, kh, ks = _strides3("k_strides", k_strides)
    vb, vh, vs = _strides3("v_strides", v_strides)
    ob, oh, os_ = _strides3("o_strides", o_strides)
    if len(lse_strides) != 2:
        raise ValueError(f"lse_strides: expected (batch_stride_lse, nhead_stride_lse), got {lse_strides}")
    lb, lh = (int(s) for s in lse_strides)

    a = MhakitFwdArgs()
    a.data_type = dtype_code(dtype)
    a.is_group_mode = 1 if group else 0
    a.has_lse = 0 if lse_ptr is None else 1
    a.q_ptr, a.k_ptr, a.v_ptr, a.o_ptr = q_ptr, k_ptr, v_ptr, o_ptr
    a.lse_ptr = lse_ptr
    a.seqstart_q_ptr = seqstart_q_ptr
    a.seqstart_k_ptr = seqstart_k_ptr
    a.seqlen_q = _check_int32("seqlen_q", seqlen_q)
    a.seqlen_k = _check_int32("seqlen_k", seqlen_k)
    a.batch = _check_int32("batch", batch)
    a.max_seqlen_q = _check_int32("max_seqlen_q", max_seqlen_q if max_seqlen_q is not None else seqlen_q)
    a.hdim_q = _check_int32("hdim_q", hdim_q)
    a.hdim_v = _check_int32("hdim_v", hdim_v)
    a.nhead_q = _check_int32("nhead_q", nhead_q)
    a.nhead_k = _check_int32("nhead_k", nhead_k)
    a.scale_s = float(scale)
    a.stride_q, a.stride_k, a.stride_v, a.stride_o = qs, ks, vs, os_
    a.nhead_stride_q, a.nhead_stride_k, a.nhead_stride_v, a.nhead_stride_o = qh, kh, vh, oh
    a.nhead_stride_lse = lh
    a.batch_stride_q, a.batch_stride_k, a.batch_stride_v, a.batch_stride_o = qb, kb, vb, ob
    a.batch_stride_lse = lb
    a.mask_type = _check_int32("mask_type", mask_type)
    a.window_size_left = _check_int32("window_left", window_left)
    a.window_size_right = _check_int32("window_right", window_right)
    if descale_ptrs is not None:
        if len(descale_ptrs) != 3:
            raise ValueError(f"descale_ptrs: expected (q, k, v) device addresses, got {descale_ptrs}")
        a.q_descale_ptr, a.k_descale_ptr, a.v_descale_ptr = (int(p) for p in descale_ptrs)
    return a


def make_bwd_args(*, dtype: Union[int, str], q_ptr: int, k_ptr: int, v_ptr: int, o_ptr: int, lse_ptr: int,
                  do_ptr: int, dq_ptr: int, dk_ptr: int, dv_ptr: int,
                  batch: int, nhead_q: int, nhead_k: int, hdim_q: int, hdim_v: int,
                  q_strides: Sequence[int], k_strides: Sequence[int], v_strides: Sequence[int],
                  o_strides: Sequence[int], lse_strides: Sequence[int],
                  do_strides: Optional[Sequence[int]] = None, dq_strides: Optional[Sequence[int]] = None,
                  dk_strides: Optional[Sequence[int]] = None, dv_strides: Optional[Sequence[int]] = None,
                  seqlen_q: int = 0, seqlen_k: int = 0,
                  seqstart_q_ptr: Optional[int] = None, seqstart_k_ptr: Optional[int] = None,
                  max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
                  workspace_ptr: Optional[int] = None, workspace_bytes: int = 0, deterministic: bool = False,
                  scale: Optional[float] = None,
                  mask_type: int = MASK_NONE, window_left: int = -1, window_right: int = -1) -> MhakitBwdArgs:
    """Fill an ``MhakitBwdArgs``.

    Strides are element strides ``(batch_stride, nhead_stride, row_stride)`` per tensor, as in ``make_fwd_args``;
    ``do_strides`` defaults to ``o_strides`` and ``dq_strides`` / ``dk_strides`` / ``dv_strides`` to those of q / k / v
    (dK and dV have nhead_k heads). ``lse_strides`` is ``(batch_stride_lse, nhead_stride_lse)`` of the forward's LSE.
    Group mode is selected by passing both seqstart pointers; then ``max_seqlen_q`` and ``max_seqlen_k`` are required
    and the batch strides are ignored by the library. ``workspace_ptr`` / ``workspace_bytes``: device scratch of at
    least ``BwdLibrary.workspace_size(args)`` bytes (query it with these arguments first; None / 0 when it is 0).
    ``scale`` defaults to 1/sqrt(hdim_q).
    """
    group = seqstart_q_ptr is not None or seqstart_k_ptr is not None
    if group and (seqstart_q_ptr is None or seqstart_k_ptr is None):
        raise ValueError("group mode needs both seqstart_q_ptr and seqstart_k_ptr")
    if group and (max_seqlen_q is None or max_seqlen_k is None):
        raise ValueError("group mode needs max_seqlen_q and max_seqlen_k")
    if scale is None:
        scale = 1.0 / math.sqrt(hdim_q) if hdim_q > 0 else 0.0

    qb, qh, qs = _strides3("q_strides", q_strides)
    kb, kh, ks = _strides3("k_strides", k_strides)
    vb, vh, vs = _strides3("v_strides", v_strides)
    ob, oh, os_ = _strides3("o_strides", o_strides)
    db, dh, ds = _strides3("do_strides", o_strides if do_strides is None else do_strides)
    dqb, dqh, dqs = _strides3("dq_strides", q_strides if dq_strides is None else dq_strides)
    dkb, dkh, dks = _strides3("dk_strides", k_strides if dk_strides is None else dk_strides)
    dvb, dvh, dvs = _strides3("dv_strides", v_strides if dv_strides is None else dv_strides)
    if len(lse_strides) != 2:
        raise ValueError(f"lse_strides: expected (batch_stride_lse, nhead_stride_lse), got {lse_strides}")
    lb, lh = (int(s) for s in lse_strides)
    if workspace_bytes < 0:
        raise ValueError(f"workspace_bytes must be >= 0, got {workspace_bytes}")

    a = MhakitBwdArgs()
    a.data_type = dtype_code(dtype)
    if a.data_type in (DTYPE_FP8_BF16, DTYPE_FP8_FP16):
        raise ValueError(f"dtype {dtype!r}: fp8 is forward-only; the backward takes fp16 or bf16")
    a.is_group_mode = 1 if group else 0
    a.deterministic = 1 if deterministic else 0
    a.q_ptr, a.k_ptr, a.v_ptr, a.o_ptr, a.lse_ptr, a.do_ptr = q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, do_ptr
    a.dq_ptr, a.dk_ptr, a.dv_ptr = dq_ptr, dk_ptr, dv_ptr
    a.workspace_ptr = workspace_ptr
    a.workspace_bytes = int(workspace_bytes)
    a.seqstart_q_ptr = seqstart_q_ptr
    a.seqstart_k_ptr = seqstart_k_ptr
    a.seqlen_q = _check_int32("seqlen_q", seqlen_q)
    a.seqlen_k = _check_int32("seqlen_k", seqlen_k)
    a.batch = _check_int32("batch", batch)
    a.max_seqlen_q = _check_int32("max_seqlen_q", max_seqlen_q if max_seqlen_q is not None else seqlen_q)
    a.max_seqlen_k = _check_int32("max_seqlen_k", max_seqlen_k if max_seqlen_k is not None else seqlen_k)
    a.hdim_q = _check_int32("hdim_q", hdim_q)
    a.hdim_v = _check_int32("hdim_v", hdim_v)
    a.nhead_q = _check_int32("nhead_q", nhead_q)
    a.nhead_k = _check_int32("nhead_k", nhead_k)
    a.scale = float(scale)
    a.stride_q, a.stride_k, a.stride_v, a.stride_o, a.stride_do = qs, ks, vs, os_, ds
    a.stride_dq, a.stride_dk, a.stride_dv = dqs, dks, dvs
    a.nhead_stride_q, a.nhead_stride_k, a.nhead_stride_v, a.nhead_stride_o, a.nhead_stride_do = qh, kh, vh, oh, dh
    a.nhead_stride_dq, a.nhead_stride_dk, a.nhead_stride_dv, a.nhead_stride_lse = dqh, dkh, dvh, lh
    a.batch_stride_q, a.batch_stride_k, a.batch_stride_v, a.batch_stride_o, a.batch_stride_do = qb, kb, vb, ob, db
    a.batch_stride_dq, a.batch_stride_dk, a.batch_stride_dv, a.batch_stride_lse = dqb, dkb, dvb, lb
    a.mask_type = _check_int32("mask_type", mask_type)
    a.window_size_left = _check_int32("window_left", window_left)
    a.window_size_right = _check_int32("window_right", window_right)
    return a


def make_stream_config(stream: Optional[int] = None, *, time_kernel: bool = False, log_level: int = 0,
                       warmup: int = 5, repeat: int = 20, gpu_timer: bool = True) -> MhakitStreamConfig:
    """``mhakit_stream_config``; ``stream`` is a raw cudaStream_t (e.g. ``torch.cuda.current_stream().cuda_stream``)."""
    c = MhakitStreamConfig()
    c.stream = stream or None
    c.time_kernel = 1 if time_kernel else 0
    c.log_level = int(log_level)
    c.warmup = int(warmup)
    c.repeat = int(repeat)
    c.gpu_timer = 1 if gpu_timer else 0
    return c


class _Library:
    """Typed entry points of one loaded mhakit library; subclasses name their API and argument struct.
    ``cdll`` is the raw ctypes handle."""

    API = ""
    ARGS: type = ctypes.Structure

    def __init__(self, cdll: ctypes.CDLL, path: str):
        self.cdll = cdll
        self.path = path
        run = getattr(cdll, f"mhakit_mha_{self.API}")
        run.argtypes = [ctypes.POINTER(self.ARGS), ctypes.POINTER(MhakitStreamConfig)]
        run.restype = ctypes.c_float
        name = getattr(cdll, f"mhakit_mha_{self.API}_kernel_name")
        name.argtypes = [ctypes.POINTER(self.ARGS)]
        name.restype = ctypes.c_char_p
        cdll.mhakit_last_error.argtypes = []
        cdll.mhakit_last_error.restype = ctypes.c_char_p
        self._run, self._kernel_name = run, name
        # The workspace query (forward: fp8's transposed V; backward: its scratch); a library older than the forward's
        # query has none (then the forward needs no workspace).
        self._workspace = getattr(cdll, f"mhakit_mha_{self.API}_workspace_size", None)
        if self._workspace is not None:
            self._workspace.argtypes = [ctypes.POINTER(self.ARGS)]
            self._workspace.restype = ctypes.c_size_t

    def workspace_size(self, args) -> int:
        """Bytes of workspace the pass needs for ``args`` (may be 0); raises MhakitError when the library refuses
        the arguments (it returns 0 and sets last_error then; the error's code is 0: the C call does not tell
        "unsupported" from "invalid")."""
        if self._workspace is None:
            return 0
        n = int(self._workspace(ctypes.byref(args)))
        if n == 0:
            msg = self.last_error()
            if msg:
                raise MhakitError(0, msg)
        return n

    def last_error(self) -> str:
        msg = self.cdll.mhakit_last_error()
        return msg.decode("utf-8", "replace") if msg else ""

    def run_raw(self, args, config: Optional[MhakitStreamConfig] = None) -> float:
        """The C return value as is: time in ms (>= 0) or a negative MHAKIT_ERROR_* code."""
        if config is None:
            config = make_stream_config()
        return float(self._run(ctypes.byref(args), ctypes.byref(config)))

    def run(self, args, config: Optional[MhakitStreamConfig] = None) -> float:
        """Run the pass; returns the kernel time in ms (0 when not timing); raises MhakitError on failure."""
        ret = self.run_raw(args, config)
        if ret < 0:
            raise error_for(int(round(ret)), self.last_error())
        return ret

    def entry_points(self) -> tuple:
        """Addresses of the run, last-error and (backward) workspace-size functions, for the C call path."""
        workspace = getattr(self.cdll, "mhakit_mha_bwd_workspace_size", None) if self.API == "bwd" else None
        return tuple(ctypes.cast(fn, ctypes.c_void_p).value or 0 if fn is not None else 0
                     for fn in (self._run, self.cdll.mhakit_last_error, workspace))

    def kernel_name(self, args) -> Optional[str]:
        """Name of the instance the library would launch for ``args``, or None (see last_error())."""
        name = self._kernel_name(ctypes.byref(args))
        return name.decode("utf-8", "replace") if name else None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path!r})"


class FwdLibrary(_Library):
    """A loaded libmha_fwd.so, with the split-KV (decode) entry points beside mha_fwd's."""

    API, ARGS = "fwd", MhakitFwdArgs
    mha_fwd_raw = _Library.run_raw
    mha_fwd = _Library.run

    def __init__(self, cdll: ctypes.CDLL, path: str):
        super().__init__(cdll, path)
        splitkv = cdll.mhakit_mha_fwd_splitkv
        splitkv.argtypes = [ctypes.POINTER(MhakitFwdSplitkvArgs), ctypes.POINTER(MhakitStreamConfig)]
        splitkv.restype = ctypes.c_float
        cdll.mhakit_mha_fwd_splitkv_kernel_name.argtypes = [ctypes.POINTER(MhakitFwdSplitkvArgs)]
        cdll.mhakit_mha_fwd_splitkv_kernel_name.restype = ctypes.c_char_p
        cdll.mhakit_mha_fwd_splitkv_acc_size.argtypes = [
            ctypes.POINTER(MhakitFwdSplitkvArgs), ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t),
            ctypes.POINTER(ctypes.c_int)]
        cdll.mhakit_mha_fwd_splitkv_acc_size.restype = ctypes.c_float

    def mha_fwd_splitkv_raw(self, args: MhakitFwdSplitkvArgs, config: Optional[MhakitStreamConfig] = None) -> float:
        """mhakit_mha_fwd_splitkv's return value as is: ms (>= 0) or a negative MHAKIT_ERROR_* code."""
        if config is None:
            config = make_stream_config()
        return float(self.cdll.mhakit_mha_fwd_splitkv(ctypes.byref(args), ctypes.byref(config)))

    def mha_fwd_splitkv(self, args: MhakitFwdSplitkvArgs, config: Optional[MhakitStreamConfig] = None) -> float:
        """Append and attend; returns ms (0 when not timing); raises MhakitError on failure."""
        ret = self.mha_fwd_splitkv_raw(args, config)
        if ret < 0:
            raise error_for(int(round(ret)), self.last_error())
        return ret

    def splitkv_entry_points(self) -> tuple:
        """Addresses of mhakit_mha_fwd_splitkv, mhakit_last_error and mhakit_mha_fwd_splitkv_acc_size, for the C
        call path."""
        return tuple(ctypes.cast(fn, ctypes.c_void_p).value or 0
                     for fn in (self.cdll.mhakit_mha_fwd_splitkv, self.cdll.mhakit_last_error,
                                self.cdll.mhakit_mha_fwd_splitkv_acc_size))

    def splitkv_kernel_name(self, args: MhakitFwdSplitkvArgs) -> Optional[str]:
        """Name of the split-KV instance the library would launch, or None (see last_error())."""
        name = self.cdll.mhakit_mha_fwd_splitkv_kernel_name(ctypes.byref(args))
        return name.decode("utf-8", "replace") if name else None

    def splitkv_acc_size(self, args: MhakitFwdSplitkvArgs) -> tuple:
        """(lse_acc bytes, o_acc bytes, num_splits) the call needs on the current device; raises MhakitError."""
        lse, o, n = ctypes.c_size_t(0), ctypes.c_size_t(0), ctypes.c_int(0)
        ret = float(self.cdll.mhakit_mha_fwd_splitkv_acc_size(ctypes.byref(args), ctypes.byref(lse),
                                                               ctypes.byref(o), ctypes.byref(n)))
        if ret < 0:
            raise error_for(int(round(ret)), self.last_error())
        return lse.value, o.value, n.value


class BwdLibrary(_Library):
    """A loaded libmha_bwd.so (its workspace query: _Library.workspace_size)."""

    API, ARGS = "bwd", MhakitBwdArgs
    mha_bwd_raw = _Library.run_raw
    mha_bwd = _Library.run


_LOADED: Dict[tuple, object] = {}
_LOCK = threading.Lock()


def _load(path: Union[str, os.PathLike], cls):
    resolved = os.path.realpath(os.fspath(path))
    if not os.path.isfile(resolved):
        raise FileNotFoundError(f"mhakit library not found: {path}")
    with _LOCK:
        lib = _LOADED.get((cls, resolved))
        if lib is None:
            lib = cls(ctypes.CDLL(resolved), resolved)
            _LOADED[(cls, resolved)] = lib
        return lib


def load_library(path: Union[str, os.PathLike] = "./libmha_fwd.so") -> FwdLibrary:
    """Load libmha_fwd.so (cached per resolved path) and set argtypes / restypes of its extern "C" entry points."""
    return _load(path, FwdLibrary)


def load_bwd_library(path: Union[str, os.PathLike] = "./libmha_bwd.so") -> BwdLibrary:
    """Load libmha_bwd.so (cached per resolved path) and set argtypes / restypes of its extern "C" entry points."""
    return _load(path, BwdLibrary)
