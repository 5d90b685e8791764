"""Arrays in and out without a GPU: the DLPack capsule reader and writer (against NumPy's own DLPack implementation
and fake CUDA producers), the CUDA array interface reader, and stream arguments."""
from __future__ import annotations

import gc

import numpy as np
import pytest

from mhakit import _arrays, _device
from mhakit._arrays import DeviceArray, dtype_by_name, view_of


class FakeCudaArray:
    """A producer that says its memory is on cuda:<dev> and exports through DLPack (using mhakit's own writer over a
    made-up address) and records what the consumer asked for."""

    def __init__(self, shape, dtype="float16", strides=None, ptr=0x7F0000000000, device=0, legacy_only=False):
        self.inner = DeviceArray(ptr, shape, dtype_by_name(dtype), device, strides=strides)
        self.calls = []
        self.legacy_only = legacy_only

    def __dlpack_device__(self):
        return self.inner.__dlpack_device__()

    def __dlpack__(self, stream=None, **kwargs):
        if self.legacy_only and kwargs:
            raise TypeError("__dlpack__() got an unexpected keyword argument 'max_version'")
        self.calls.append(dict(kwargs, stream=stream))
        return self.inner.__dlpack__(max_version=kwargs.get("max_version"))


class FakeCai:
    def __init__(self, **cai):
        self.__cuda_array_interface__ = dict({"version": 3, "strides": None, "stream": None}, **cai)


class TestDLPackReader:
    def test_numpy_producer_strided_view(self):
        a = np.arange(2 * 5 * 3 * 16, dtype=np.float16).reshape(2, 5, 3, 16)[:, 1:4, :, :8]
        v = view_of(a, "q", allow_host=True)
        assert v.ptr == a.ctypes.data and v.shape == (2, 3, 3, 8)
        assert v.strides == tuple(s // 2 for s in a.strides) and v.dtype.name == "float16"
        assert (v.device_type, v.device_id) == (_arrays.KDL_CPU, 0)

    @pytest.mark.parametrize("dtype, name", [(np.float32, "float32"), (np.int32, "int32"), (np.uint16, "uint16")])
    def test_numpy_dtypes(self, dtype, name):
        assert view_of(np.zeros(3, dtype), "x", allow_host=True).dtype.name == name

    def test_fake_cuda_producer_gets_the_stream_and_is_read_without_copy(self):
        arr = FakeCudaArray((2, 64, 4, 128), strides=(64 * 3 * 4 * 128, 3 * 4 * 128, 128, 1))  # a packed qkv slice
        v = view_of(arr, "q", stream=0)
        assert v.ptr == 0x7F0000000000 and v.shape == (2, 64, 4, 128)
        assert v.strides == (64 * 3 * 4 * 128, 3 * 4 * 128, 128, 1)
        assert (v.device_type, v.device_id) == (_arrays.KDL_CUDA, 0)
        assert arr.calls == [{"stream": 1, "max_version": (1, 0)}], "stream 0 is passed as DLPack's legacy 1"
        view_of(arr, "q", stream=0x1234)
        assert arr.calls[-1]["stream"] == 0x1234

    def test_legacy_producer_without_max_version(self):
        arr = FakeCudaArray((4, 8), legacy_only=True)
        v = view_of(arr, "k", stream=0)
        assert v.shape == (4, 8) and arr.calls == [{"stream": 1}]

    def test_capsule_is_released_when_dropped(self):
        arr = DeviceArray(0x1000, (4, 8), dtype_by_name("float16"), 0)
        before = len(_arrays._EXPORTS)
        v = view_of(FakeCudaArray((4, 8)), "q")
        assert len(_arrays._EXPORTS) == before + 1
        del v
        gc.collect()
        assert len(_arrays._EXPORTS) == before
        capsule = arr.__dlpack__()
        assert len(_arrays._EXPORTS) == before + 1
        del capsule
        assert len(_arrays._EXPORTS) == before

    def test_not_an_array(self):
        with pytest.raises(TypeError, match=r"q: expected a CUDA array exposing __dlpack__ or "
                                            r"__cuda_array_interface__ \(CuPy, PyTorch, JAX\), got list"):
            view_of([[1.0]], "q")

    def test_host_array_is_refused_by_name(self):
        with pytest.raises(ValueError, match=r"k: is a cpu array \(ndarray\); mhakit needs CUDA or ROCm device memory"):
            view_of(np.zeros((2, 2), np.float16), "k")


class TestDeviceArrayWriter:
    def host_backed(self, a: np.ndarray) -> DeviceArray:
        # DeviceArray over host memory (device type CPU) so that NumPy can consume it: a real third-party consumer.
        return DeviceArray(a.ctypes.data, a.shape, dtype_by_name(a.dtype.name), 0,
                           strides=tuple(s // a.itemsize for s in a.strides), owner=a, device_type=_arrays.KDL_CPU)

    @pytest.mark.parametrize("view", [lambda a: a, lambda a: a[:, ::2], lambda a: a.transpose(1, 0, 2)])
    def test_numpy_consumes_it_without_copy(self, view):
        a = view(np.arange(4 * 6 * 8, dtype=np.float32).reshape(4, 6, 8))
        d = self.host_backed(a)
        b = np.from_dlpack(d)
        assert b.ctypes.data == a.ctypes.data and b.strides == a.strides and np.array_equal(a, b)

    def test_versioned_and_legacy_capsules_round_trip(self):
        a = np.arange(12, dtype=np.float16).reshape(3, 4)
        d = self.host_backed(a)
        for max_version in (None, (1, 0), (1, 1)):
            v = _arrays.parse_capsule(d.__dlpack__(max_version=max_version), "x")
            assert (v.ptr, v.shape, v.strides, v.dtype.name) == (a.ctypes.data, (3, 4), (4, 1), "float16")

    def test_export_keeps_the_array_alive(self):
        a = np.arange(8, dtype=np.float32)
        d = self.host_backed(a)
        b = np.from_dlpack(d)
        del d
        gc.collect()
        assert np.array_equal(b, np.arange(8, dtype=np.float32))

    def test_cuda_array_interface(self):
        d = DeviceArray(0x2000, (2, 3, 8), dtype_by_name("float16"), 1, stream=0x55)
        cai = d.__cuda_array_interface__
        assert cai == {"shape": (2, 3, 8), "typestr": "<f2", "data": (0x2000, False), "strides": None,
                       "version": 3, "stream": 0x55}
        t = DeviceArray(0x2000, (3, 2), dtype_by_name("float32"), 0, strides=(1, 3))
        assert t.__cuda_array_interface__["strides"] == (4, 12) and t.__cuda_array_interface__["stream"] == 1
        assert d.__dlpack_device__() == (_arrays.KDL_CUDA, 1)

    def test_bf16_has_no_cai_but_has_dlpack(self):
        d = DeviceArray(0x2000, (4,), dtype_by_name("bfloat16"), 0)
        assert not hasattr(d, "__cuda_array_interface__")
        v = _arrays.parse_capsule(d.__dlpack__(max_version=(1, 0)), "o")
        assert v.dtype.name == "bfloat16"

    def test_export_refuses_copies_and_other_devices(self):
        d = DeviceArray(0x2000, (4,), dtype_by_name("float16"), 0)
        with pytest.raises(BufferError, match="without copying"):
            d.__dlpack__(copy=True)
        with pytest.raises(BufferError, match="lives on"):
            d.__dlpack__(dl_device=(2, 3))


class TestCaiReader:
    def test_contiguous_and_strided(self):
        v = view_of(FakeCai(shape=(2, 3, 4), typestr="<f2", data=(0xABC0, False)), "q")
        assert (v.ptr, v.shape, v.strides, v.device_id) == (0xABC0, (2, 3, 4), (12, 4, 1), None)
        v = view_of(FakeCai(shape=(2, 3), typestr="<f2", data=(0x10, False), strides=(2, 8), stream=7), "k")
        assert v.strides == (1, 4) and v.stream == 7

    def test_read_only_flag(self):
        assert view_of(FakeCai(shape=(1,), typestr="<f4", data=(0x10, True)), "out").readonly

    @pytest.mark.parametrize("cai, error, message", [
        (dict(shape=(2,), typestr="<f2", data=(0x10, False), strides=(3,)), ValueError, "not multiples of the element"),
        (dict(shape=(2,), typestr="<f2", data=(0x10, False), mask=5), TypeError, "masked arrays"),
        (dict(shape=(2,), typestr="<c8", data=(0x10, False)), TypeError, "unsupported element type '<c8'"),
        (dict(shape=(2,), typestr="<V2", data=(0x10, False)), TypeError, "for bfloat16 data pass the array"),
        (dict(shape=(2,), typestr="<f2"), TypeError, "malformed __cuda_array_interface__"),
    ])
    def test_errors_name_the_argument(self, cai, error, message):
        with pytest.raises(error, match=f"v: .*{message}"):
            view_of(FakeCai(**cai), "v")


class TestStreams:
    def test_stream_objects(self):
        class Torchish:
            cuda_stream = 0x111

        class Cupyish:
            ptr = 0x222

        class Protocol:
            def __cuda_stream__(self):
                return (0, 0x333)

        assert _device.stream_handle(None) == (0, None)
        assert _device.stream_handle(0x99) == (0x99, None)
        for obj, handle in ((Torchish(), 0x111), (Cupyish(), 0x222), (Protocol(), 0x333)):
            h, keep = _device.stream_handle(obj)
            assert h == handle and keep is obj

    @pytest.mark.parametrize("bad, error", [(True, TypeError), (-1, ValueError), ("s", TypeError), (1.5, TypeError)])
    def test_bad_streams(self, bad, error):
        with pytest.raises(error, match="stream"):
            _device.stream_handle(bad)
