"""The Python front end on ROCm, on a machine without an AMD GPU: arrays whose DLPack device type is kDLROCM are
served by the HIP device layer (mhakit._hip, through a stand-in for hip-python: tests/fake_hip.py) and by libraries
built for the device's gfx arch through Hipcc; nothing CUDA-specific is imported. Nothing here runs on AMD hardware:
the stand-in records the HIP calls the layer makes, and the library's launch is recorded, not run."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import mhakit
from conftest import REPO
from fake_hip import FakeLibrary, install
from mhakit import _arrays, _codegen, _cuda, _device, _hip, jit
from mhakit._arrays import KDL_ROCM, DeviceArray, dtype_by_name

TESTS = os.path.dirname(os.path.abspath(__file__))


def rocm(shape, dtype="bfloat16", device=0, ptr=0x7F0000000000):
    """A ROCm array as mhakit reads it (kDLROCM; no memory behind it)."""
    return DeviceArray(ptr, shape, dtype_by_name(dtype), device, device_type=KDL_ROCM)


def cuda(shape, dtype="bfloat16", device=0, ptr=0x7F0000000000):
    """The same array on a CUDA device (the control of the routing tests)."""
    return DeviceArray(ptr, shape, dtype_by_name(dtype), device)


class Cache:
    """jit.default_cache() stand-in: records which library each call asks for."""

    def __init__(self):
        self.asked = []

    def library_for(self, *args, mods=False):
        self.asked.append(args)
        return f"lib{args[0]}.so"


@pytest.fixture
def hip(monkeypatch):
    """A fake hip-python, a recording cache and library, and a CUDA layer that fails when anything touches it."""
    fake = install(monkeypatch)
    cache, lib = Cache(), FakeLibrary(workspace=4096)
    monkeypatch.setattr(jit, "default_cache", lambda: cache)
    for api in ("fwd", "bwd"):
        monkeypatch.setitem(jit.LOADERS, api, lambda path: lib)
    monkeypatch.setattr(_cuda, "driver", lambda: pytest.fail("a ROCm call reached the CUDA device layer"))
    fake.cache, fake.lib = cache, lib
    return fake


def test_both_device_layers_offer_the_same_interface():
    for backend, module in (("cuda", _cuda), ("rocm", _hip)):
        assert _device.layer(backend) is module and module.backend == backend
        missing = [name for name in _device.LAYER_API if not hasattr(module, name)]
        assert not missing, f"{module.__name__} lacks {missing}"
        assert issubclass(module.UnavailableError, mhakit.DeviceUnavailableError)
        assert issubclass(module.Allocation, _device.Allocation)
    assert (_cuda.device_type, _hip.device_type) == (_arrays.KDL_CUDA, KDL_ROCM)
    assert _arrays.backend_of(KDL_ROCM) == "rocm" and _arrays.backend_of(_arrays.KDL_CUDA_MANAGED) == "cuda"
    assert _arrays.backend_of(_arrays.KDL_CPU) is None
    with pytest.raises(ValueError, match="backend: expected one of"):
        _device.layer("metal")


def test_the_device_arch_comes_from_gcn_arch_name():
    toolchain = _codegen.submodule("toolchain")
    assert toolchain.arch_for_gcn_arch_name("gfx942:sramecc+:xnack-") == "gfx942"
    assert toolchain.arch_for_gcn_arch_name("gfx90a") == "gfx90a"
    with pytest.raises(toolchain.ToolchainError, match="AMD GPU gfx1100 is not supported: mhakit builds for "
                                                       "gfx90a, gfx942, gfx950"):
        toolchain.arch_for_gcn_arch_name("gfx1100")


@pytest.mark.usefixtures("call_path")
def test_a_rocm_forward_goes_through_the_hip_layer_to_a_gfx942_library(hip):
    q, k = rocm((2, 64, 8, 128)), rocm((2, 80, 2, 128))
    o, lse = mhakit.mha_fwd(q, k, k, causal=True, return_lse=True, stream=0x5000)
    assert hip.cache.asked == [("fwd", "gfx942", "bf16", 128, 128, "batch", True)]
    assert o.__dlpack_device__() == (KDL_ROCM, 0) and lse.__dlpack_device__() == (KDL_ROCM, 0)
    allocs = [c[1] for c in hip.calls if c[0] == "hipMallocAsync"]
    assert allocs == [(2 * 64 * 8 * 128 * 2, 0x5000), (2 * 8 * 64 * 4, 0x5000)]  # O (bf16), LSE (fp32)
    assert ("hipGetDeviceProperties", (0,)) in hip.calls
    [(function, args, config)] = hip.lib.launches
    assert function == "mha_fwd" and config.stream == 0x5000 and args.o_ptr == o.ptr and args.lse_ptr == lse.ptr
    assert (args.q_ptr, args.mask_type) == (q.ptr, 2)
    with pytest.raises(AttributeError, match="CUDA memory only"):
        o.__cuda_array_interface__


def test_the_c_call_path_hands_rocm_arrays_to_the_python_path(monkeypatch, call_path):
    """The C call path (csrc/python/mhakit_ext.c) reaches the CUDA driver only: it returns NotImplemented for kDLROCM
    arrays before anything else, and mhakit.api then takes the Python path (which uses the HIP layer)."""
    if call_path != "c":
        pytest.skip("the C path only")
    from mhakit import api

    class Resolved(Exception):
        pass

    def resolved(*args, **kwargs):
        raise Resolved(args)

    ext = api._ext()
    monkeypatch.setattr(jit, "library", resolved)
    for make, handled in ((rocm, False), (cuda, True)):
        q, lse = make((2, 64, 8, 128)), make((2, 8, 64), "float32")
        fwd = (q, q, q, None, None, None, None, None, 0, 2, -1, 0, None, True, 0, None, None, 0)
        bwd = (q, q, q, q, q, lse, None, None, None, None, None, None, None, 0, 0, -1, -1, None, False, 0, None, None,
               0)
        for function, args in ((ext.fwd, fwd), (ext.bwd, bwd)):
            if handled:  # the control: the same call on CUDA arrays goes on to resolve its library
                with pytest.raises(Resolved):
                    function(*args)
            else:
                assert function(*args) is NotImplemented


@pytest.mark.usefixtures("call_path")
def test_a_rocm_backward_allocates_its_workspace_on_the_call_stream(hip):
    q, k = rocm((2, 64, 8, 128)), rocm((2, 80, 2, 128))
    dq, dk, dv = mhakit.mha_bwd(q, q, k, k, q, rocm((2, 8, 64), "float32"), stream=0x6000)
    assert hip.cache.asked == [("bwd", "gfx942", "bf16", 128, 128, "batch", False)]
    assert [d.__dlpack_device__() for d in (dq, dk, dv)] == [(KDL_ROCM, 0)] * 3
    allocs = [c[1] for c in hip.calls if c[0] == "hipMallocAsync"]
    assert allocs[-1] == (4096, 0x6000)  # the workspace the library asked for, after dQ, dK, dV
    frees = [c[1] for c in hip.calls if c[0] == "hipFreeAsync"]
    assert frees and frees[-1][1] == 0x6000  # ... freed stream-ordered, after the launch
    assert [launch[0] for launch in hip.lib.launches] == ["mha_bwd"]


@pytest.mark.usefixtures("call_path")
def test_varlen_host_offsets_are_uploaded_through_hip(hip):
    q, k = rocm((30, 4, 64), "float16"), rocm((40, 2, 64), "float16")
    mhakit.mha_varlen_fwd(q, k, k, [0, 10, 30], [0, 15, 40], 20, 25, stream=0x7000)
    assert hip.cache.asked == [("fwd", "gfx942", "fp16", 64, 64, "group", False)]
    uploads = [c[1] for c in hip.calls if c[0] == "hipMemcpyHtoDAsync"]
    assert [(u[2], u[3]) for u in uploads] == [(12, 0x7000), (12, 0x7000)]


@pytest.mark.usefixtures("call_path")
def test_a_call_on_a_second_device_switches_the_hip_device_and_back(hip):
    hip.devices = 2
    mhakit.mha_fwd(rocm((1, 16, 2, 64), device=1), rocm((1, 16, 2, 64), device=1), rocm((1, 16, 2, 64), device=1))
    sets = [c[1][0] for c in hip.calls if c[0] == "hipSetDevice"]
    assert sets and set(sets) == {0, 1} and sets[-1] == 0 and hip.current == 0


@pytest.mark.usefixtures("call_path")
def test_rocm_and_cuda_arrays_cannot_be_mixed(hip):
    q = rocm((2, 64, 8, 128))
    k = cuda((2, 80, 2, 128))
    with pytest.raises(ValueError, match="k: is a cuda array but q is a rocm array"):
        mhakit.mha_fwd(q, k, k)
    with pytest.raises(ValueError, match="k: is on rocm:1 but q is on rocm:0"):
        mhakit.mha_fwd(q, rocm((2, 80, 2, 128), device=1), rocm((2, 80, 2, 128), device=1))
    assert hip.lib.launches == []


@pytest.mark.usefixtures("call_path")
def test_an_unsupported_amd_gpu_is_named(hip):
    hip.gcn_arch_name = "gfx1100"
    with pytest.raises(_codegen.submodule("toolchain").ToolchainError, match="AMD GPU gfx1100 is not supported"):
        mhakit.mha_fwd(rocm((1, 16, 2, 64)), rocm((1, 16, 2, 64)), rocm((1, 16, 2, 64)))


def test_without_hip_python_a_rocm_call_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "hip", None)  # `from hip import hip` raises ImportError
    monkeypatch.setattr(_hip, "_RUNTIME", None)
    monkeypatch.setattr(jit, "_ARCHS", {})
    monkeypatch.setenv("MHAKIT_NO_EXT", "1")
    with pytest.raises(mhakit.HipUnavailableError, match=r"need the hip-python package .*mhakit\[rocm\]"):
        mhakit.mha_fwd(rocm((1, 16, 2, 64)), rocm((1, 16, 2, 64)), rocm((1, 16, 2, 64)))


def test_rocm_arrays_export_and_order_through_the_hip_layer(hip):
    o = rocm((4, 8), "float16")
    o.stream = 0x5000
    capsule = o.__dlpack__(stream=0x9000)  # a consumer on another stream waits for the producer's stream
    assert type(capsule).__name__ == "PyCapsule"
    assert [c[0] for c in hip.calls] [-3:] == ["hipEventRecord", "hipStreamWaitEvent", "hipEventDestroy"]
    assert ("hipEventRecord", (0xE0, 0x5000)) in hip.calls and ("hipStreamWaitEvent", (0x9000, 0xE0, 0)) in hip.calls
    before = len(hip.calls)
    o.__dlpack__(stream=0x5000)  # the same stream: nothing to order
    assert len(hip.calls) == before


def test_rocm_producers_are_asked_for_their_own_stream_spelling():
    """DLPack's stream argument: CUDA spells the legacy default stream 1, ROCm's default stream is 0."""
    asked = []

    class Producer:
        def __init__(self, device_type):
            self.inner = DeviceArray(0x1000, (4, 8), dtype_by_name("float16"), 0, device_type=device_type)

        def __dlpack_device__(self):
            return self.inner.__dlpack_device__()

        def __dlpack__(self, stream=None, max_version=None):
            asked.append(stream)
            return self.inner.__dlpack__(stream=-1, max_version=max_version)

    assert _arrays.view_of(Producer(KDL_ROCM), "q", 0).device_type == KDL_ROCM
    assert _arrays.view_of(Producer(KDL_ROCM), "q", 0x77).ptr == 0x1000
    assert _arrays.view_of(Producer(_arrays.KDL_CUDA), "q", 0).device_type == _arrays.KDL_CUDA
    assert asked == [0, 0x77, 1]


def test_the_jit_plans_a_gfx942_build_through_hipcc(monkeypatch, tmp_path):
    """Which toolchain, target and instances a gfx942 library gets (the compiler itself is not run: its location
    and version probe are stood in for; tests/test_rocm_compile.py compiles for real where the SDK is present)."""
    toolchain = _codegen.submodule("toolchain")
    ck = tmp_path / "ck"
    (ck / "include").mkdir(parents=True)
    monkeypatch.setattr(toolchain, "locate_hip_compiler", lambda: ("/opt/rocm/bin/hipcc", "hipcc", tmp_path))
    monkeypatch.setattr(toolchain, "probe_clang_version", lambda path: "AMD clang 19.0.0")
    monkeypatch.setattr(toolchain, "find_ck", lambda: ck)
    tc, why = jit.toolchain_for("gfx942", tmp_path)
    assert why is None and isinstance(tc, toolchain.Hipcc) and tc.offload_arch == "gfx942"
    assert "--offload-arch=gfx942" in tc.compile_flags() and "-DMHAKIT_HIP=1" in tc.host_flags()
    entry = jit.derive_entry("fwd", "gfx942", "bf16", 128, 128, "batch", True)
    plan = jit.make_plan(entry, tc)
    assert plan.toolchain is tc and entry.instance_names
    assert all("_gfx942_" in name for name in entry.instance_names)
    assert plan.key != jit.make_plan(jit.derive_entry("fwd", "gfx90a", "bf16", 128, 128, "batch", True),
                                     jit.toolchain_for("gfx90a", tmp_path)[0]).key


def test_an_amd_only_machine_is_asked_through_hip_only(monkeypatch):
    import glob
    exists = os.path.exists
    monkeypatch.setattr(os.path, "exists", lambda path: path == "/dev/kfd" or exists(path))
    monkeypatch.setattr(glob, "glob", lambda pattern: [])
    assert jit._backends_present() == ("rocm",)
    monkeypatch.setattr(glob, "glob", lambda pattern: ["/dev/nvidia0"] if pattern.startswith("/dev/nvidia") else [])
    assert jit._backends_present() == ("cuda", "rocm")


def test_a_rocm_machine_needs_nothing_cuda_specific(tmp_path):
    """In a fresh interpreter where cuda-bindings, CUTLASS and torch cannot be imported (as on a ROCm machine that
    lacks them): import mhakit, find the AMD GPU (the stand-in hip-python), and run a ROCm forward call through the
    HIP layer to a gfx942 library. No CUDA-specific module is even looked for."""
    script = r"""
import importlib.abc, json, sys
looked_for = []
class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("cuda", "cutlass_library", "cutlass", "torch"):
            looked_for.append(name)
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None
sys.meta_path.insert(0, NotInstalled())
import fake_hip
fake = fake_hip.install()
import mhakit
from mhakit import jit
from mhakit._arrays import KDL_ROCM, DeviceArray, dtype_by_name
jit._backends_present = lambda: ("rocm",)  # what an AMD-only machine answers (see the test above)
arch = jit.default_arch()
asked, lib = [], fake_hip.FakeLibrary()
class Cache:
    def library_for(self, *args, mods=False):
        asked.append(args)
        return "libmha_fwd.so"
jit.default_cache = lambda: Cache()
jit.LOADERS["fwd"] = lambda path: lib
q = DeviceArray(0x7F0000000000, (2, 64, 8, 128), dtype_by_name("bfloat16"), 0, device_type=KDL_ROCM)
o = mhakit.mha_fwd(q, q, q, causal=True, stream=0x5000)
print(json.dumps({"arch": arch, "asked": asked, "launches": len(lib.launches), "device": o.__dlpack_device__(),
                  "looked_for": looked_for, "hip": fake.names()}))
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), TESTS]), MHAKIT_CACHE_DIR=str(tmp_path),
               MHAKIT_NO_EXT="1")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["arch"] == "gfx942" and result["looked_for"] == []
    assert result["asked"] == [["fwd", "gfx942", "bf16", 128, 128, "batch", True]]
    assert result["launches"] == 1 and result["device"] == [KDL_ROCM, 0]
    assert "hipInit" in result["hip"] and "hipMallocAsync" in result["hip"]
