"""Arrays in and out without copies: a DLPack / ``__cuda_array_interface__`` reader and a small owning device array.

Reading (``view_of``): any object exposing DLPack (``__dlpack__`` / ``__dlpack_device__``: CuPy, PyTorch, JAX, NumPy
on the host) or the CUDA Array Interface (``__cuda_array_interface__``: CuPy, PyTorch, Numba) becomes an
:class:`ArrayView` — pointer, shape, element strides, dtype, device — read straight from the producer's DLPack
capsule (parsed with ctypes) or interface dict. Nothing is copied and nothing is imported from the producer's
framework. The producer is told which stream the data will be used on (DLPack's ``stream=`` handshake; a CAI
``stream`` entry is honoured by the caller through :func:`mhakit._cuda.order_streams`).

Writing (:class:`DeviceArray`): the outputs mhakit allocates are returned as ``DeviceArray`` objects that export
themselves through DLPack (``__dlpack__`` / ``__dlpack_device__``, versioned 1.x and legacy capsules) and through
``__cuda_array_interface__`` (v3), so ``cupy.from_dlpack(o)``, ``torch.from_dlpack(o)``, ``jax.dlpack.from_dlpack(o)``
and ``cupy.asarray(o)`` all take them without a copy. The array owns its memory (a stream-ordered allocation freed
when the last reference, including every DLPack consumer's, is gone).
"""

from __future__ import annotations

import ctypes
import math
import threading
from dataclasses import dataclass
from typing import Any, Optional, Tuple

__all__ = ["DType", "ArrayView", "DeviceArray", "view_of", "dtype_by_name", "contiguous_strides", "backend_of",
           "KDL_CPU", "KDL_CUDA", "KDL_CUDA_HOST", "KDL_CUDA_MANAGED", "KDL_ROCM", "BACKEND_OF_DEVICE_TYPE"]

# DLDeviceType
KDL_CPU, KDL_CUDA, KDL_CUDA_HOST, KDL_ROCM, KDL_CUDA_MANAGED = 1, 2, 3, 10, 13
_DEVICE_NAMES = {1: "cpu", 2: "cuda", 3: "cuda_host", 4: "opencl", 7: "vulkan", 8: "metal", 9: "vpi", 10: "rocm",
                 11: "rocm_host", 13: "cuda_managed", 14: "oneapi"}
# The device types mhakit computes on -> the catalogue's backend (mhakit._device picks the device layer by it)
BACKEND_OF_DEVICE_TYPE = {KDL_CUDA: "cuda", KDL_CUDA_MANAGED: "cuda", KDL_ROCM: "rocm"}
# DLDataTypeCode
_KDL_INT, _KDL_UINT, _KDL_FLOAT, _KDL_BFLOAT, _KDL_BOOL = 0, 1, 2, 4, 6
_KDL_FLOAT8_E4M3FN = 10  # dlpack.h's kDLFloat8_e4m3fn (torch.float8_e4m3fn exports this code)
_READ_ONLY = 1  # DLPACK_FLAG_BITMASK_READ_ONLY


@dataclass(frozen=True)
class DType:
    """An element type: its name, DLPack (code, bits) and CAI typestr (None where the interface has none: bf16)."""

    name: str
    code: int
    bits: int
    typestr: Optional[str]

    @property
    def itemsize(self) -> int:
        return self.bits // 8

    def __str__(self) -> str:
        return self.name


_DTYPES = [
    DType("float16", _KDL_FLOAT, 16, "<f2"), DType("bfloat16", _KDL_BFLOAT, 16, None),
    DType("float32", _KDL_FLOAT, 32, "<f4"), DType("float64", _KDL_FLOAT, 64, "<f8"),
    DType("int8", _KDL_INT, 8, "|i1"), DType("int16", _KDL_INT, 16, "<i2"), DType("int32", _KDL_INT, 32, "<i4"),
    DType("int64", _KDL_INT, 64, "<i8"), DType("uint8", _KDL_UINT, 8, "|u1"), DType("uint16", _KDL_UINT, 16, "<u2"),
    DType("uint32", _KDL_UINT, 32, "<u4"), DType("uint64", _KDL_UINT, 64, "<u8"), DType("bool", _KDL_BOOL, 8, "|b1"),
    DType("float8_e4m3fn", _KDL_FLOAT8_E4M3FN, 8, None),
]
_BY_DL = {(d.code, d.bits): d for d in _DTYPES}
_BY_NAME = {d.name: d for d in _DTYPES}
_BY_TYPESTR = {d.typestr: d for d in _DTYPES if d.typestr}
_BY_TYPESTR.update({"=f2": _BY_NAME["float16"], "=f4": _BY_NAME["float32"], "=u2": _BY_NAME["uint16"],
                    "=i4": _BY_NAME["int32"], "<b1": _BY_NAME["bool"], "<u1": _BY_NAME["uint8"], "<i1": _BY_NAME["int8"]})


def dtype_by_name(name: str) -> DType:
    return _BY_NAME[name]


def contiguous_strides(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(strides))


# ------------------------------------------------------------------------------------------------------------------
# DLPack structs (dlpack.h, v1.x) and the CPython capsule API through ctypes
# ------------------------------------------------------------------------------------------------------------------

class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


_Deleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter)]


class _DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", _DLPackVersion), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter),
                ("flags", ctypes.c_uint64), ("dl_tensor", _DLTensor)]


_NAME_LEGACY = b"dltensor"
_NAME_VERSIONED = b"dltensor_versioned"
_NAME_BUFFERS = {name: ctypes.create_string_buffer(name) for name in (_NAME_LEGACY, _NAME_VERSIONED)}

_api = ctypes.pythonapi
_capsule_is_valid = _api.PyCapsule_IsValid
_capsule_is_valid.restype, _capsule_is_valid.argtypes = ctypes.c_int, [ctypes.py_object, ctypes.c_char_p]
_capsule_get_pointer = _api.PyCapsule_GetPointer
_capsule_get_pointer.restype, _capsule_get_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
_capsule_new = _api.PyCapsule_New
_capsule_new.restype, _capsule_new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
# The same two functions on a raw PyObject* (inside a capsule destructor the object is being deallocated).
_raw_is_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(("PyCapsule_IsValid", _api))
_raw_get_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(("PyCapsule_GetPointer", _api))


# ------------------------------------------------------------------------------------------------------------------
# Reading arrays
# ------------------------------------------------------------------------------------------------------------------

@dataclass
class ArrayView:
    """What mhakit needs of an array: where its elements are and how they are laid out. Strides are in elements."""

    name: str                        # the argument name, for messages
    ptr: int
    shape: Tuple[int, ...]
    strides: Tuple[int, ...]
    dtype: DType
    device_type: int
    device_id: Optional[int]         # None: not stated (CAI); the caller asks the driver
    readonly: bool = False
    source: str = ""                 # the producer's type, for messages
    stream: Optional[int] = None     # CAI: the stream the producer last wrote on (None: no sync needed)
    keepalive: Any = None            # the capsule or object that keeps the memory reachable during the call

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def device_label(self) -> str:
        kind = _DEVICE_NAMES.get(self.device_type, f"device type {self.device_type}")
        return kind if self.device_id is None else f"{kind}:{self.device_id}"


def _dtype_from_dl(name: str, code: int, bits: int, lanes: int) -> DType:
    if lanes != 1:
        raise TypeError(f"{name}: vector element types (DLPack lanes={lanes}) are not supported")
    dt = _BY_DL.get((code, bits))
    if dt is None:
        raise TypeError(f"{name}: unsupported DLPack element type (code {code}, {bits} bits)")
    return dt


def parse_capsule(capsule: Any, name: str, source: str = "") -> ArrayView:
    """Read a DLPack capsule (versioned or legacy) without consuming it: the producer's deleter runs when the
    capsule is released, which must not happen before the memory's last use by the caller (keep `.keepalive`)."""
    if _capsule_is_valid(capsule, _NAME_VERSIONED):
        managed = _DLManagedTensorVersioned.from_address(_capsule_get_pointer(capsule, _NAME_VERSIONED))
        if managed.version.major > 1:
            raise TypeError(f"{name}: DLPack {managed.version.major}.{managed.version.minor} is newer than the 1.x "
                            "this reader understands")
        tensor, readonly = managed.dl_tensor, bool(managed.flags & _READ_ONLY)
    elif _capsule_is_valid(capsule, _NAME_LEGACY):
        tensor, readonly = _DLManagedTensor.from_address(_capsule_get_pointer(capsule, _NAME_LEGACY)).dl_tensor, False
    else:
        raise TypeError(f"{name}: __dlpack__() returned {type(capsule).__name__}, not an unused DLPack capsule")
    ndim = int(tensor.ndim)
    if ndim < 0:
        raise TypeError(f"{name}: DLPack tensor with ndim={ndim}")
    shape = tuple(int(tensor.shape[i]) for i in range(ndim))
    strides = tuple(int(tensor.strides[i]) for i in range(ndim)) if tensor.strides else contiguous_strides(shape)
    dtype = _dtype_from_dl(name, tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes)
    ptr = int(tensor.data or 0) + int(tensor.byte_offset)
    return ArrayView(name, ptr, shape, strides, dtype, int(tensor.device.device_type), int(tensor.device.device_id),
                     readonly, source, None, capsule)


def _call_dlpack(obj: Any, stream: Optional[int]):
    kwargs = {} if stream is None else {"stream": stream}
    try:
        return obj.__dlpack__(max_version=(1, 0), **kwargs)
    except TypeError:  # a producer that predates DLPack 1.0's keyword arguments
        return obj.__dlpack__(**kwargs)


def parse_cai(cai: dict, name: str, source: str = "", keepalive: Any = None) -> ArrayView:
    """Read a ``__cuda_array_interface__`` dict (v2/v3). Strides are converted from bytes to elements."""
    try:
        shape = tuple(int(n) for n in cai["shape"])
        typestr = cai["typestr"]
        ptr, readonly = cai["data"]
    except (KeyError, TypeError, ValueError) as exc:
        raise TypeError(f"{name}: malformed __cuda_array_interface__ ({exc})") from None
    if cai.get("mask") is not None:
        raise TypeError(f"{name}: masked arrays (__cuda_array_interface__ 'mask') are not supported")
    dtype = _BY_TYPESTR.get(typestr)
    if dtype is None:
        raise TypeError(f"{name}: unsupported element type {typestr!r} in __cuda_array_interface__"
                        + ("; for bfloat16 data pass the array through DLPack, or 16-bit storage with dtype='bf16'"
                           if typestr.endswith("V2") else ""))
    byte_strides = cai.get("strides")
    if byte_strides is None:
        strides = contiguous_strides(shape)
    else:
        byte_strides = tuple(int(s) for s in byte_strides)
        if len(byte_strides) != len(shape):
            raise TypeError(f"{name}: __cuda_array_interface__ has {len(byte_strides)} strides for {len(shape)} dims")
        if any(s % dtype.itemsize for s in byte_strides):
            raise ValueError(f"{name}: byte strides {byte_strides} are not multiples of the element size "
                             f"{dtype.itemsize}")
        strides = tuple(s // dtype.itemsize for s in byte_strides)
    stream = cai.get("stream")
    return ArrayView(name, int(ptr or 0), shape, strides, dtype, KDL_CUDA, None, bool(readonly), source,
                     int(stream) if stream is not None else None, keepalive)


def backend_of(device_type: int) -> Optional[str]:
    """The backend ("cuda" or "rocm") of arrays of DLPack device type `device_type`; None for any other device."""
    return BACKEND_OF_DEVICE_TYPE.get(int(device_type))


def dlpack_stream(device_type: int, stream: Optional[int]) -> Optional[int]:
    """How ``__dlpack__(stream=...)`` spells the call's raw stream handle for a producer on `device_type`: CUDA
    names the legacy default stream 1 (0 is reserved); ROCm names its default stream 0 (1 and 2 are not used)."""
    if stream is None or backend_of(device_type) is None:
        return None
    return 1 if stream == 0 and backend_of(device_type) == "cuda" else stream


def is_device_array(obj: Any) -> bool:
    """True for an object that says it lives in CUDA or ROCm memory (DLPack device or the CUDA array interface)."""
    if isinstance(obj, DeviceArray):
        return backend_of(obj.device_type) is not None
    dev = getattr(obj, "__dlpack_device__", None)
    if dev is not None:
        try:
            return backend_of(int(dev()[0])) is not None
        except Exception:
            return False
    try:
        return getattr(obj, "__cuda_array_interface__", None) is not None
    except Exception:
        return False


_NEEDS_GPU_MEMORY = ("mhakit needs CUDA or ROCm device memory (e.g. a CuPy array, a torch tensor on 'cuda', a JAX "
                     "array on a GPU)")


def view_of(obj: Any, name: str, stream: Optional[int] = None, *, allow_host: bool = False) -> ArrayView:
    """Read `obj` as an array. `stream` is the raw CUstream the data will be used on (0 = legacy default); it is
    passed to ``__dlpack__`` so the producer orders its pending writes before that stream's later work.
    Raises TypeError/ValueError naming `name` for anything that is not a CUDA or ROCm array (unless allow_host)."""
    source = type(obj).__name__
    if isinstance(obj, DeviceArray):
        return ArrayView(name, obj.ptr, obj.shape, obj.strides, obj.dtype, obj.device_type, obj.device_id,
                         False, source, None if obj.stream == stream else obj.stream, obj)
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        dev_type, dev_id = (int(x) for x in obj.__dlpack_device__())
        if backend_of(dev_type) is None and not allow_host:
            where = _DEVICE_NAMES.get(dev_type, f"device type {dev_type}")
            raise ValueError(f"{name}: is a {where} array ({source}); {_NEEDS_GPU_MEMORY}")
        dl_stream = dlpack_stream(dev_type, stream)
        try:
            capsule = _call_dlpack(obj, dl_stream)
        except BufferError as exc:
            # A tensor that requires grad refuses export (torch); its memory is only read here, as FlashAttention
            # reads it, so export a detached view of the same memory instead.
            if not getattr(obj, "requires_grad", False) or not callable(getattr(obj, "detach", None)):
                raise TypeError(f"{name}: {source} refused DLPack export: {exc}") from None
            obj = obj.detach()
            capsule = _call_dlpack(obj, dl_stream)
        view = parse_capsule(capsule, name, source)
        view.keepalive = (capsule, obj)
        return view
    try:
        cai = getattr(obj, "__cuda_array_interface__", None)
    except AttributeError:
        cai = None
    if cai is not None:
        return parse_cai(cai, name, source, obj)
    if allow_host and (hasattr(obj, "__array_interface__") or hasattr(obj, "__array__")):
        raise ValueError(f"{name}: host arrays are read with numpy, not as device arrays")
    if hasattr(obj, "__array_interface__") or hasattr(obj, "__array__"):
        raise ValueError(f"{name}: is a host (CPU) array ({source}); {_NEEDS_GPU_MEMORY}")
    raise TypeError(f"{name}: expected a CUDA array exposing __dlpack__ or __cuda_array_interface__ "
                    f"(CuPy, PyTorch, JAX), got {source}")


# ------------------------------------------------------------------------------------------------------------------
# Exporting arrays
# ------------------------------------------------------------------------------------------------------------------

_EXPORTS: dict = {}            # address of a DLManagedTensor[Versioned] -> what it references (kept alive until deleted)
_EXPORTS_LOCK = threading.Lock()


def _release(address: int) -> None:
    with _EXPORTS_LOCK:
        _EXPORTS.pop(address, None)


@_Deleter
def _managed_deleter(address):  # DLManagedTensor[Versioned]::deleter, called by the consumer (any thread)
    try:
        _release(int(address or 0))
    except Exception:  # pragma: no cover - interpreter shutdown
        pass


_CapsuleDestructor = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


@_CapsuleDestructor
def _capsule_destructor(capsule):
    """A capsule nobody consumed (still named dltensor[_versioned]) releases its tensor itself."""
    try:
        for name in (_NAME_VERSIONED, _NAME_LEGACY):
            if _raw_is_valid(capsule, name):
                _release(int(_raw_get_pointer(capsule, name) or 0))
                return
    except Exception:  # pragma: no cover - interpreter shutdown
        pass


class DeviceArray:
    """A strided device array that mhakit owns (its outputs). Exports itself through DLPack and the CUDA array
    interface without copying; ``numpy()`` copies it to the host.

    ``stream`` is the stream its contents were last written on: DLPack consumers on another stream are ordered after
    that work (``__dlpack__(stream=...)``), and ``__cuda_array_interface__`` reports it."""

    __slots__ = ("ptr", "shape", "strides", "dtype", "device_id", "device_type", "stream", "_owner", "__weakref__")

    def __init__(self, ptr: int, shape, dtype: DType, device_id: int, *, strides=None, owner: Any = None,
                 stream: int = 0, device_type: int = KDL_CUDA):
        self.ptr = int(ptr)
        self.shape = tuple(int(n) for n in shape)
        self.strides = tuple(int(s) for s in strides) if strides is not None else contiguous_strides(self.shape)
        self.dtype = dtype
        self.device_id = int(device_id)
        self.device_type = int(device_type)
        self.stream = int(stream)
        self._owner = owner

    # --- array basics -------------------------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize

    @property
    def is_contiguous(self) -> bool:
        return all(st == c for n, st, c in zip(self.shape, self.strides, contiguous_strides(self.shape)) if n > 1)

    @property
    def device(self) -> str:
        return f"{_DEVICE_NAMES.get(self.device_type, self.device_type)}:{self.device_id}"

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d array")
        return self.shape[0]

    def __repr__(self) -> str:
        return f"mhakit.DeviceArray(shape={self.shape}, dtype={self.dtype.name}, device='{self.device}')"

    # --- DLPack -------------------------------------------------------------------------------------------------
    def __dlpack_device__(self) -> Tuple[int, int]:
        return (self.device_type, self.device_id)

    def __dlpack__(self, *, stream: Any = None, max_version: Optional[Tuple[int, int]] = None,
                   dl_device: Optional[Tuple[int, int]] = None, copy: Optional[bool] = None):
        if copy:
            raise BufferError("mhakit.DeviceArray exports without copying (copy=True is not supported)")
        if dl_device is not None and tuple(int(x) for x in dl_device) != self.__dlpack_device__():
            raise BufferError(f"mhakit.DeviceArray lives on {self.__dlpack_device__()}, not {tuple(dl_device)}")
        backend = backend_of(self.device_type)
        if stream != -1 and backend is not None:
            # DLPack: None names the legacy default stream (CUDA also spells it 1; ROCm's default stream is 0), 2 the
            # per-thread one, -1 "do not synchronise".
            consumer = 0 if stream is None or (int(stream) == 1 and backend == "cuda") else int(stream)
            if consumer != self.stream:
                from . import _device
                _device.layer(backend).order_streams(self.stream, consumer, self.device_id)
        versioned = max_version is not None and int(max_version[0]) >= 1
        return self._capsule(versioned)

    def _capsule(self, versioned: bool):
        ndim = self.ndim
        shape = (ctypes.c_int64 * max(ndim, 1))(*self.shape)
        strides = (ctypes.c_int64 * max(ndim, 1))(*self.strides)
        managed = _DLManagedTensorVersioned() if versioned else _DLManagedTensor()
        t = managed.dl_tensor
        t.data = self.ptr or None
        t.device = _DLDevice(self.device_type, self.device_id)
        t.ndim = ndim
        t.dtype = _DLDataType(self.dtype.code, self.dtype.bits, 1)
        t.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
        t.strides = ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64))
        t.byte_offset = 0
        managed.manager_ctx = None
        managed.deleter = _managed_deleter
        if versioned:
            managed.version = _DLPackVersion(1, 0)
            managed.flags = 0
        address = ctypes.addressof(managed)
        with _EXPORTS_LOCK:
            _EXPORTS[address] = (managed, shape, strides, self)  # the array (and its memory) lives while exported
        name = _NAME_VERSIONED if versioned else _NAME_LEGACY
        try:
            return _capsule_new(address, _NAME_BUFFERS[name], ctypes.cast(_capsule_destructor, ctypes.c_void_p))
        except BaseException:
            _release(address)
            raise

    # --- CUDA array interface -----------------------------------------------------------------------------------
    @property
    def __cuda_array_interface__(self) -> dict:
        if self.device_type not in (KDL_CUDA, KDL_CUDA_MANAGED):
            raise AttributeError("__cuda_array_interface__ describes CUDA memory only")
        if self.dtype.typestr is None:
            raise AttributeError(f"{self.dtype.name} has no __cuda_array_interface__ typestr; "
                                 "import this array through DLPack (cupy.from_dlpack, torch.from_dlpack)")
        item = self.itemsize
        return {
            "shape": self.shape,
            "typestr": self.dtype.typestr,
            "data": (self.ptr, False),
            "strides": None if self.is_contiguous else tuple(s * item for s in self.strides),
            "version": 3,
            "stream": 1 if self.stream == 0 else self.stream,  # CAI spells the legacy default stream 1
        }

    # --- host copy ----------------------------------------------------------------------------------------------
    def numpy(self):
        """A host copy as a numpy array (after the array's stream finished). bfloat16 is widened to float32."""
        import numpy as np

        backend = backend_of(self.device_type)
        if backend is None:
            raise TypeError("numpy() copies CUDA and ROCm arrays; this one is on neither")
        if not self.is_contiguous:
            raise ValueError("numpy() copies contiguous arrays only")
        storage = {"bfloat16": np.uint16}.get(self.dtype.name) or np.dtype(self.dtype.typestr)
        host = np.empty(self.shape, dtype=storage)
        from . import _device
        _device.layer(backend).copy_to_host(host.ctypes.data, self.ptr, self.nbytes, self.device_id, self.stream)
        if self.dtype.name == "bfloat16":
            return (host.astype(np.uint32) << 16).view(np.float32)
        return host
