"""Which vendor's device layer serves a call: :mod:`mhakit._cuda` (cuda-bindings) or :mod:`mhakit._hip` (hip-python).

A layer is chosen by backend, the catalogue's name for the vendor a library is built for (``backend_of_arch``:
``sm_*`` is ``cuda``, ``gfx*`` is ``rocm``). An array names its backend through its DLPack device type
(:data:`mhakit._arrays.BACKEND_OF_DEVICE_TYPE`: kDLCUDA / kDLCUDAManaged are CUDA, kDLROCM is ROCm). Each layer
module is imported on first use only, and imports its vendor's bindings on its first device call only, so a ROCm
machine never imports cuda-bindings and a CUDA machine never imports hip-python.

Every layer module defines the names in :data:`LAYER_API` with the same meaning (see mhakit._cuda for each);
stream objects are parsed here, once for both vendors.
"""

from __future__ import annotations

import importlib
from typing import Any, Tuple

__all__ = ["DeviceUnavailableError", "DeviceError", "Allocation", "LAYER_API", "MODULES", "layer", "stream_handle"]


class DeviceUnavailableError(RuntimeError):
    """No GPU call is possible in this process (the vendor's bindings, driver or device is missing)."""


class DeviceError(RuntimeError):
    """A driver or runtime call of the device layer failed."""


class Allocation:
    """Device memory owned by Python: allocated stream-ordered on `stream` and freed on the same stream when the
    last reference goes (so work queued on that stream before the free still sees valid memory). A stream object
    passed by the caller is kept alive with the allocation; a raw handle must outlive it. Each layer has its own
    subclass, whose `_release(ptr)` frees through that layer's runtime."""

    __slots__ = ("ptr", "nbytes", "device", "stream", "_stream_ref", "_async")

    def __init__(self, ptr: int, nbytes: int, device: int, stream: int, stream_ref: Any, is_async: bool):
        self.ptr, self.nbytes, self.device, self.stream = ptr, nbytes, device, stream
        self._stream_ref, self._async = stream_ref, is_async

    def free(self) -> None:
        ptr, self.ptr = self.ptr, 0
        if ptr:
            self._release(ptr)

    def __del__(self):
        try:
            self.free()
        except Exception:  # pragma: no cover - interpreter shutdown, or the context is gone
            pass


# What the front end uses of a layer; both modules define all of it (tests/test_python_rocm.py checks).
LAYER_API = ("backend", "device_type", "UnavailableError", "Error", "device_count", "device_arch", "current_device",
             "device_scope", "Allocation", "allocate", "order_streams", "copy_to_host", "copy_from_host",
             "synchronize")

# backend -> the module of its device layer
MODULES = {"cuda": "_cuda", "rocm": "_hip"}


def layer(backend: str):
    """The device-layer module of `backend` ("cuda" or "rocm")."""
    if backend not in MODULES:
        raise ValueError(f"backend: expected one of {sorted(MODULES)}, got {backend!r}")
    return importlib.import_module(f".{MODULES[backend]}", __package__)


def stream_handle(stream: Any) -> Tuple[int, Any]:
    """(raw stream handle, object to keep alive) from None (the default stream, 0), an int handle (a CUstream or a
    hipStream_t), or a stream object: ``__cuda_stream__()`` (CUDA stream protocol), ``.cuda_stream`` (PyTorch, on
    ROCm too), ``.ptr`` (CuPy). Parsing only: no device call."""
    if stream is None:
        return 0, None
    if isinstance(stream, bool):
        raise TypeError("stream: expected an int handle or a stream object, got a bool")
    if isinstance(stream, int):
        if stream < 0:
            raise ValueError(f"stream: a CUstream handle is >= 0, got {stream}")
        return stream, None
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        value = proto() if callable(proto) else proto
        if isinstance(value, tuple) and len(value) == 2:
            return int(value[1]), stream
        raise TypeError(f"stream: __cuda_stream__() returned {value!r}; expected (version, handle)")
    for attr in ("cuda_stream", "ptr", "handle"):
        value = getattr(stream, attr, None)
        if value is not None and not callable(value):
            try:
                return int(value), stream
            except (TypeError, ValueError):
                continue
    raise TypeError(f"stream: expected None, an int CUstream handle or an object with __cuda_stream__, .cuda_stream "
                    f"(PyTorch) or .ptr (CuPy); got {type(stream).__name__}")
