"""The little of the CUDA driver that the Python front end needs, through cuda-bindings (no torch, no CuPy).

Devices and their compute capability, the primary context of a device made current around a launch, stream-ordered
allocation (``cuMemAllocAsync`` on the caller's stream, freed on the same stream), event-based ordering between two
streams, and copies to and from the host. cuda-bindings is imported on first use, so ``import mhakit`` works
without it and without a GPU; the first GPU call then raises :class:`CudaUnavailableError` saying what is missing.

Stream handles are raw ``CUstream`` values (parsed by :func:`mhakit._device.stream_handle`): 0 is the legacy
default stream (the driver also spells it 1, ``CU_STREAM_LEGACY``), 2 is the per-thread default stream. This is the
CUDA device layer of :mod:`mhakit._device`; :mod:`mhakit._hip` is the HIP one, with the same names.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Optional, Tuple

from ._arrays import KDL_CUDA
from ._device import Allocation as _Allocation, DeviceError, DeviceUnavailableError

__all__ = ["CudaUnavailableError", "CudaError", "driver", "compute_capability", "device_arch", "device_count",
           "pointer_device", "device_scope", "Allocation", "allocate", "order_streams", "copy_to_host",
           "copy_from_host"]

backend = "cuda"          # the catalogue's backend this layer serves
device_type = KDL_CUDA    # the DLPack device type of the arrays it allocates

_LOCK = threading.Lock()
_DRIVER = None
_CC: dict = {}
_PRIMARY: dict = {}
_POOLS: dict = {}


class CudaUnavailableError(DeviceUnavailableError):
    """No GPU call is possible in this process (no cuda-bindings, no driver, or no device)."""


class CudaError(DeviceError):
    """A CUDA driver call failed."""


UnavailableError, Error = CudaUnavailableError, CudaError


def driver():
    """``cuda.bindings.driver``, initialised (``cuInit``) once per process."""
    global _DRIVER
    if _DRIVER is not None:
        return _DRIVER
    with _LOCK:
        if _DRIVER is not None:
            return _DRIVER
        try:
            from cuda.bindings import driver as cu
        except ImportError as exc:
            raise CudaUnavailableError(
                "mhakit's GPU calls need the cuda-bindings package (python3 -m pip install cuda-bindings); "
                "mhakit.reference, mhakit.prebuild and the code generator work without it") from exc
        try:
            result = cu.cuInit(0)
        except Exception as exc:  # the bindings raise when libcuda.so cannot be loaded at all
            raise CudaUnavailableError(
                f"no usable NVIDIA GPU in this process: the CUDA driver could not be loaded ({exc}). "
                "mhakit.reference, mhakit.prebuild and the code generator work without a GPU") from None
        if result[0] != cu.CUresult.CUDA_SUCCESS:
            raise CudaUnavailableError(
                f"no usable NVIDIA GPU in this process: cuInit failed with {_error_name(cu, result[0])}. "
                "mhakit.reference, mhakit.prebuild and the code generator work without a GPU")
        _DRIVER = cu
        return cu


def _error_name(cu, err) -> str:
    try:
        name = cu.cuGetErrorName(err)[1]
        text = cu.cuGetErrorString(err)[1]
        return f"{name.decode()} ({text.decode()})" if name and text else str(err)
    except Exception:  # pragma: no cover - error formatting must never hide the error
        return str(err)


def check(result, what: str):
    """The values of a cuda-bindings call after its CUresult; raises CudaError naming the call on failure."""
    cu = driver()
    err = result[0]
    if err != cu.CUresult.CUDA_SUCCESS:
        raise CudaError(f"{what} failed: {_error_name(cu, err)}")
    if len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]


def _same_stream(a: int, b: int) -> bool:
    legacy = (0, 1)
    return a == b or (a in legacy and b in legacy)


# ------------------------------------------------------------------------------------------------------------------
# Devices and contexts
# ------------------------------------------------------------------------------------------------------------------

def device_count() -> int:
    cu = driver()
    return int(check(cu.cuDeviceGetCount(), "cuDeviceGetCount"))


def _device(ordinal: int):
    cu = driver()
    return check(cu.cuDeviceGet(int(ordinal)), f"cuDeviceGet({ordinal})")


def compute_capability(ordinal: int) -> Tuple[int, int]:
    cc = _CC.get(ordinal)
    if cc is None:
        cu = driver()
        dev = _device(ordinal)
        attr = cu.CUdevice_attribute
        major = check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev), "cuDeviceGetAttribute")
        minor = check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev), "cuDeviceGetAttribute")
        cc = _CC[ordinal] = (int(major), int(minor))
    return cc


def device_arch(ordinal: int) -> str:
    """The arch mhakit builds for device `ordinal`: the CUDA catalogue's arch of its compute capability."""
    from . import _codegen
    return _codegen.submodule("toolchain").arch_for_compute_capability(*compute_capability(ordinal))


def pointer_device(ptr: int, name: str) -> int:
    """The device ordinal that owns device pointer `ptr` (for ``__cuda_array_interface__`` inputs, which do not say)."""
    cu = driver()
    attr = cu.CUpointer_attribute
    result = cu.cuPointerGetAttribute(attr.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, int(ptr))
    if result[0] != cu.CUresult.CUDA_SUCCESS:
        raise ValueError(f"{name}: pointer {ptr:#x} is not CUDA device memory ({_error_name(cu, result[0])})")
    return int(result[1])


def _primary_context(ordinal: int):
    ctx = _PRIMARY.get(ordinal)
    if ctx is None:
        with _LOCK:
            ctx = _PRIMARY.get(ordinal)
            if ctx is None:
                cu = driver()
                # Retained for the life of the process (as the CUDA runtime does for every device it touches).
                ctx = check(cu.cuDevicePrimaryCtxRetain(_device(ordinal)), "cuDevicePrimaryCtxRetain")
                _PRIMARY[ordinal] = ctx
    return ctx


@contextmanager
def device_scope(ordinal: int):
    """Make `ordinal` the current device of this thread (its primary context, as the CUDA runtime, PyTorch and
    CuPy use) unless a context of that device is already current; restore the previous context afterwards."""
    cu = driver()
    current = check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if int(current) != 0:
        dev = cu.cuCtxGetDevice()
        if dev[0] == cu.CUresult.CUDA_SUCCESS and int(dev[1]) == ordinal:
            yield
            return
    check(cu.cuCtxSetCurrent(_primary_context(ordinal)), "cuCtxSetCurrent")
    try:
        yield
    finally:
        cu.cuCtxSetCurrent(current)


# ------------------------------------------------------------------------------------------------------------------
# Memory
# ------------------------------------------------------------------------------------------------------------------

def _pools_supported(ordinal: int) -> bool:
    ok = _POOLS.get(ordinal)
    if ok is None:
        cu = driver()
        attr = cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED
        ok = _POOLS[ordinal] = bool(check(cu.cuDeviceGetAttribute(attr, _device(ordinal)), "cuDeviceGetAttribute"))
    return ok


class Allocation(_Allocation):
    """Device memory owned by Python, freed on its stream (cuMemFreeAsync; cuMemFree where allocated without a
    pool): see mhakit._device.Allocation."""

    __slots__ = ()

    def _release(self, ptr: int) -> None:
        if _DRIVER is None:
            return
        cu = _DRIVER
        with device_scope(self.device):
            if self._async:
                cu.cuMemFreeAsync(ptr, self.stream)
            else:
                cu.cuMemFree(ptr)


def allocate(nbytes: int, device: int, stream: int, stream_ref: Any = None) -> Allocation:
    """`nbytes` of device memory on `device`, ordered on `stream` (cuMemAllocAsync; cuMemAlloc where the device has
    no memory pools). 0 bytes gives a null pointer."""
    if nbytes <= 0:
        return Allocation(0, 0, device, stream, stream_ref, False)
    cu = driver()
    with device_scope(device):
        if _pools_supported(device):
            ptr = check(cu.cuMemAllocAsync(int(nbytes), stream), f"cuMemAllocAsync({nbytes} bytes)")
            return Allocation(int(ptr), nbytes, device, stream, stream_ref, True)
        ptr = check(cu.cuMemAlloc(int(nbytes)), f"cuMemAlloc({nbytes} bytes)")
        return Allocation(int(ptr), nbytes, device, stream, stream_ref, False)


def order_streams(producer: int, consumer: int, device: int) -> None:
    """Make work queued later on `consumer` wait for the work queued so far on `producer` (nothing when equal)."""
    if _same_stream(producer, consumer):
        return
    cu = driver()
    with device_scope(device):
        flags = cu.CUevent_flags.CU_EVENT_DISABLE_TIMING
        event = check(cu.cuEventCreate(flags), "cuEventCreate")
        try:
            check(cu.cuEventRecord(event, producer), "cuEventRecord")
            check(cu.cuStreamWaitEvent(consumer, event, 0), "cuStreamWaitEvent")
        finally:
            cu.cuEventDestroy(event)


def copy_to_host(dst_ptr: int, src_ptr: int, nbytes: int, device: int, stream: int) -> None:
    """Synchronise `stream`, then copy `nbytes` from device memory to the host buffer at dst_ptr."""
    if nbytes <= 0:
        return
    cu = driver()
    with device_scope(device):
        check(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")
        check(cu.cuMemcpyDtoH(dst_ptr, src_ptr, nbytes), "cuMemcpyDtoH")


def copy_from_host(dst_ptr: int, src_ptr: int, nbytes: int, device: int, stream: int) -> None:
    """Queue a copy of `nbytes` from pageable host memory to the device on `stream`. The driver stages pageable
    memory before returning, so the host buffer may be reused at once."""
    if nbytes <= 0:
        return
    cu = driver()
    with device_scope(device):
        check(cu.cuMemcpyHtoDAsync(dst_ptr, src_ptr, nbytes, stream), "cuMemcpyHtoDAsync")


def synchronize(stream: int, device: int) -> None:
    cu = driver()
    with device_scope(device):
        check(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")


def current_device() -> Optional[int]:
    """The device of the context current on this thread, or None."""
    cu = driver()
    ctx = check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if int(ctx) == 0:
        return None
    return int(check(cu.cuCtxGetDevice(), "cuCtxGetDevice"))
