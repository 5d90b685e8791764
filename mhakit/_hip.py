"""The little of the HIP runtime that the Python front end needs on AMD GPUs, through hip-python (the ``rocm`` extra:
``python3 -m pip install ".[rocm]"``); the HIP device layer of :mod:`mhakit._device`, with the names and meanings of
:mod:`mhakit._cuda`.

Devices and their gfx arch (``hipDeviceProp_t.gcnArchName``, e.g. ``gfx942:sramecc+:xnack-``, read as the ROCm
catalogue's arch ``gfx942``), the device made current around a launch (``hipSetDevice``, restored afterwards),
stream-ordered allocation (``hipMallocAsync`` on the caller's stream, freed on the same stream), event-based ordering
between two streams, and copies to and from the host. hip-python is imported on first use, so ``import mhakit``
works without it; the first GPU call on a ROCm array then raises :class:`HipUnavailableError` saying what is missing.

Stream handles are raw ``hipStream_t`` values: 0 is the default (null) stream. Written against hip-python 10's
interface (each call returns ``(hipError_t, values...)``); it has not run on an AMD GPU: only a CPU test with a
stand-in for hip-python exercises it (tests/test_python_rocm.py).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Optional

from ._arrays import KDL_ROCM
from ._device import Allocation as _Allocation, DeviceError, DeviceUnavailableError

__all__ = ["HipUnavailableError", "HipError", "runtime", "device_count", "device_arch", "current_device",
           "device_scope", "Allocation", "allocate", "order_streams", "copy_to_host", "copy_from_host",
           "synchronize"]

backend = "rocm"          # the catalogue's backend this layer serves
device_type = KDL_ROCM    # the DLPack device type of the arrays it allocates

_LOCK = threading.Lock()
_RUNTIME = None
_ARCH_NAMES: dict = {}
_POOLS: dict = {}


class HipUnavailableError(DeviceUnavailableError):
    """No GPU call on an AMD device is possible in this process (no hip-python, no HIP runtime, or no device)."""


class HipError(DeviceError):
    """A HIP runtime call failed."""


UnavailableError, Error = HipUnavailableError, HipError

_WORKS_WITHOUT = "mhakit.reference, mhakit.prebuild and the code generator work without it"


def runtime():
    """hip-python's ``hip`` module, initialised (``hipInit``) once per process."""
    global _RUNTIME
    if _RUNTIME is not None:
        return _RUNTIME
    with _LOCK:
        if _RUNTIME is not None:
            return _RUNTIME
        try:
            from hip import hip
        except ImportError as exc:
            raise HipUnavailableError(
                "mhakit's GPU calls on AMD GPUs need the hip-python package (python3 -m pip install "
                f"'mhakit[rocm]', or hip-python matching your ROCm); {_WORKS_WITHOUT}") from exc
        try:
            result = hip.hipInit(0)
        except Exception as exc:  # the bindings raise when libamdhip64.so cannot be loaded at all
            raise HipUnavailableError(f"no usable AMD GPU in this process: the HIP runtime could not be loaded "
                                      f"({exc}); {_WORKS_WITHOUT}") from None
        if result[0] != hip.hipError_t.hipSuccess:
            raise HipUnavailableError(f"no usable AMD GPU in this process: hipInit failed with "
                                      f"{_error_name(hip, result[0])}; {_WORKS_WITHOUT}")
        _RUNTIME = hip
        return hip


def _text(value) -> str:
    return value.decode(errors="replace") if isinstance(value, (bytes, bytearray)) else str(value)


def _error_name(hip, err) -> str:
    try:
        return f"{_text(hip.hipGetErrorName(err)[1])} ({_text(hip.hipGetErrorString(err)[1])})"
    except Exception:  # pragma: no cover - error formatting must never hide the error
        return str(err)


def check(result, what: str):
    """The values of a hip-python call after its hipError_t; raises HipError naming the call on failure."""
    hip = runtime()
    err = result[0]
    if err != hip.hipError_t.hipSuccess:
        raise HipError(f"{what} failed: {_error_name(hip, err)}")
    if len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]


# ------------------------------------------------------------------------------------------------------------------
# Devices
# ------------------------------------------------------------------------------------------------------------------

def device_count() -> int:
    hip = runtime()
    return int(check(hip.hipGetDeviceCount(), "hipGetDeviceCount"))


def gcn_arch_name(ordinal: int) -> str:
    """The device's ``gcnArchName`` (target id with its features, e.g. ``gfx942:sramecc+:xnack-``)."""
    name = _ARCH_NAMES.get(ordinal)
    if name is None:
        hip = runtime()
        props = check(hip.hipGetDeviceProperties(int(ordinal)), f"hipGetDeviceProperties({ordinal})")
        name = _ARCH_NAMES[ordinal] = _text(props.gcnArchName).split("\0", 1)[0]
    return name


def device_arch(ordinal: int) -> str:
    """The arch mhakit builds for device `ordinal`: the ROCm catalogue's arch of its gcnArchName."""
    from . import _codegen
    return _codegen.submodule("toolchain").arch_for_gcn_arch_name(gcn_arch_name(ordinal))


def current_device() -> Optional[int]:
    """The current device of this thread (HIP always has one: device 0 until hipSetDevice)."""
    hip = runtime()
    return int(check(hip.hipGetDevice(), "hipGetDevice"))


@contextmanager
def device_scope(ordinal: int):
    """Make `ordinal` the current device of this thread unless it is already; restore the previous one afterwards."""
    hip = runtime()
    previous = int(check(hip.hipGetDevice(), "hipGetDevice"))
    if previous == ordinal:
        yield
        return
    check(hip.hipSetDevice(int(ordinal)), f"hipSetDevice({ordinal})")
    try:
        yield
    finally:
        hip.hipSetDevice(previous)


# ------------------------------------------------------------------------------------------------------------------
# Memory
# ------------------------------------------------------------------------------------------------------------------

def _pools_supported(ordinal: int) -> bool:
    ok = _POOLS.get(ordinal)
    if ok is None:
        hip = runtime()
        attr = hip.hipDeviceAttribute_t.hipDeviceAttributeMemoryPoolsSupported
        ok = _POOLS[ordinal] = bool(check(hip.hipDeviceGetAttribute(attr, int(ordinal)), "hipDeviceGetAttribute"))
    return ok


class Allocation(_Allocation):
    """Device memory owned by Python, freed on its stream (hipFreeAsync; hipFree where allocated without a pool):
    see mhakit._device.Allocation."""

    __slots__ = ()

    def _release(self, ptr: int) -> None:
        if _RUNTIME is None:
            return
        hip = _RUNTIME
        with device_scope(self.device):
            if self._async:
                hip.hipFreeAsync(ptr, self.stream)
            else:
                hip.hipFree(ptr)


def allocate(nbytes: int, device: int, stream: int, stream_ref: Any = None) -> Allocation:
    """`nbytes` of device memory on `device`, ordered on `stream` (hipMallocAsync; hipMalloc where the device has no
    memory pools). 0 bytes gives a null pointer."""
    if nbytes <= 0:
        return Allocation(0, 0, device, stream, stream_ref, False)
    hip = runtime()
    with device_scope(device):
        if _pools_supported(device):
            ptr = check(hip.hipMallocAsync(int(nbytes), stream), f"hipMallocAsync({nbytes} bytes)")
            return Allocation(int(ptr), nbytes, device, stream, stream_ref, True)
        ptr = check(hip.hipMalloc(int(nbytes)), f"hipMalloc({nbytes} bytes)")
        return Allocation(int(ptr), nbytes, device, stream, stream_ref, False)


def order_streams(producer: int, consumer: int, device: int) -> None:
    """Make work queued later on `consumer` wait for the work queued so far on `producer` (nothing when equal)."""
    if producer == consumer:
        return
    hip = runtime()
    with device_scope(device):
        event = check(hip.hipEventCreateWithFlags(hip.hipEventDisableTiming), "hipEventCreateWithFlags")
        try:
            check(hip.hipEventRecord(event, producer), "hipEventRecord")
            check(hip.hipStreamWaitEvent(consumer, event, 0), "hipStreamWaitEvent")
        finally:
            hip.hipEventDestroy(event)


def copy_to_host(dst_ptr: int, src_ptr: int, nbytes: int, device: int, stream: int) -> None:
    """Synchronise `stream`, then copy `nbytes` from device memory to the host buffer at dst_ptr."""
    if nbytes <= 0:
        return
    hip = runtime()
    with device_scope(device):
        check(hip.hipStreamSynchronize(stream), "hipStreamSynchronize")
        check(hip.hipMemcpyDtoH(dst_ptr, src_ptr, nbytes), "hipMemcpyDtoH")


def copy_from_host(dst_ptr: int, src_ptr: int, nbytes: int, device: int, stream: int) -> None:
    """Copy `nbytes` from pageable host memory to the device on `stream`, and wait for it: the host buffer may be
    reused as soon as this returns (mhakit does not rely on the HIP runtime staging pageable memory)."""
    if nbytes <= 0:
        return
    hip = runtime()
    with device_scope(device):
        check(hip.hipMemcpyHtoDAsync(dst_ptr, src_ptr, nbytes, stream), "hipMemcpyHtoDAsync")
        check(hip.hipStreamSynchronize(stream), "hipStreamSynchronize")


def synchronize(stream: int, device: int) -> None:
    hip = runtime()
    with device_scope(device):
        check(hip.hipStreamSynchronize(stream), "hipStreamSynchronize")
