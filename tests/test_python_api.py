"""The Python calls on a machine without a GPU: argument checks and their messages (fake CUDA arrays), the clear
error of a GPU call without a GPU, a torch-free import, and what an installed package must carry."""
from __future__ import annotations

import fnmatch
import os
import subprocess
import sys
import tomllib

import numpy as np
import pytest

import mhakit
from conftest import REPO, have_gpu
from mhakit import _codegen, api, jit
from mhakit._arrays import DeviceArray, dtype_by_name


def arr(shape, dtype="float16", strides=None, device=0, ptr=0x7F0000000000):
    """A CUDA array as mhakit reads it (no memory behind it: these calls fail before any launch)."""
    return DeviceArray(ptr, shape, dtype_by_name(dtype), device, strides=strides)


def qkv(b=2, sq=64, sk=80, hq=8, hk=2, d=128, dv=128, dtype="float16", layout="bshd"):
    if layout == "bshd":
        return arr((b, sq, hq, d), dtype), arr((b, sk, hk, d), dtype), arr((b, sk, hk, dv), dtype)
    return arr((b, hq, sq, d), dtype), arr((b, hk, sk, d), dtype), arr((b, hk, sk, dv), dtype)


@pytest.mark.usefixtures("call_path")
class TestBatchArguments:
    @pytest.mark.parametrize("kwargs, error, message", [
        (dict(layout="sbhd"), ValueError, "layout: expected 'bshd' or 'bhsd'"),
        (dict(mask="b", causal=True), ValueError, "mask: give either mask= or causal=/window="),
        (dict(mask="q:1"), ValueError, "mask: invalid mask string 'q:1'"),
        (dict(mask=(7, -1, 0)), ValueError, "mask: mask type must be 0"),
        (dict(mask=("x", 1, 2)), ValueError, "mask: unknown mask type 'x'"),
        (dict(window=5), TypeError, r"window: expected \(left, right\)"),
        (dict(scale=-1.0), ValueError, "scale: must be finite and > 0"),
        (dict(scale="big"), TypeError, "scale: expected a float"),
        (dict(stream="s0"), TypeError, "stream: expected None, an int CUstream handle"),
        (dict(dtype="fp32"), TypeError, "dtype: expected 'fp16', 'bf16' or 'fp8'"),
        (dict(dtype="bf16"), TypeError, "q: has dtype float16 but dtype='bf16' was given"),
        (dict(return_lse="no"), TypeError, "return_lse: expected a bool, got 'no'"),
    ])
    def test_option_errors(self, kwargs, error, message):
        with pytest.raises(error, match=message):
            mhakit.mha_fwd(*qkv(), **kwargs)

    @pytest.mark.parametrize("shape, message", [
        ((1, 2**31, 1, 64), r"q: seqlen 2147483648 exceeds the C API's 32-bit limit \(2147483647\)"),
        ((2**31, 1, 1, 64), r"q: batch 2147483648 exceeds the C API's 32-bit limit"),
    ])
    def test_sizes_beyond_32_bits_are_refused_before_any_allocation(self, monkeypatch, shape, message):
        from mhakit import _cuda
        monkeypatch.setattr(_cuda, "allocate", lambda *a, **k: pytest.fail("allocated before the size check"))
        monkeypatch.setattr(jit, "library", lambda *a, **k: pytest.fail("resolved a library before the size check"))
        q = arr(shape)
        k = arr((shape[0], 16, 1, 64))
        with pytest.raises(ValueError, match=message):
            mhakit.mha_fwd(q, k, k)

    @pytest.mark.parametrize("q, k, v, error, message", [
        (arr((2, 64, 8)), arr((2, 80, 2, 128)), arr((2, 80, 2, 128)), ValueError,
         r"q: expected 4 dims \[batch, seqlen, nheads, headdim\] \(layout 'bshd'\), got shape \(2, 64, 8\)"),
        (arr((2, 64, 8, 128)), arr((3, 80, 2, 128)), arr((2, 80, 2, 128)), ValueError,
         "k: batch 3 does not match q's batch 2"),
        (arr((2, 64, 8, 128)), arr((2, 80, 2, 64)), arr((2, 80, 2, 128)), ValueError,
         "k: head dim 64 does not match q's head dim 128"),
        (arr((2, 64, 8, 128)), arr((2, 80, 2, 128)), arr((2, 81, 2, 128)), ValueError,
         r"v: shape \(2, 81, 2, 128\) does not match k's \(2, 80, 2, 128\)"),
        (arr((2, 64, 8, 128)), arr((2, 80, 3, 128)), arr((2, 80, 3, 128)), ValueError,
         "k: 3 kv heads; q's head count 8 must be a positive multiple of it"),
        (arr((2, 64, 8, 300)), arr((2, 80, 2, 300)), arr((2, 80, 2, 300)), ValueError,
         r"q: head dim 300 is not supported; head dims must be in \[1, 256\]"),
        (arr((2, 64, 8, 128)), arr((2, 80, 2, 128)), arr((2, 80, 2, 264)), ValueError, "v: head dim of v 264"),
        (arr((2, 64, 8, 128), strides=(64 * 8 * 256, 8 * 256, 256, 2)), arr((2, 80, 2, 128)), arr((2, 80, 2, 128)),
         ValueError, r"q: the head dimension must be contiguous \(stride 1\)"),
        (arr((2, 64, 8, 128), "float32"), arr((2, 80, 2, 128)), arr((2, 80, 2, 128)), TypeError,
         "q: dtype float32 is not supported; expected float16, bfloat16 or float8_e4m3fn"),
        (arr((2, 64, 8, 128)), arr((2, 80, 2, 128), "bfloat16"), arr((2, 80, 2, 128)), TypeError,
         "k: dtype bfloat16 does not match q's float16"),
        (arr((2, 64, 8, 128), "uint16"), arr((2, 80, 2, 128), "uint16"), arr((2, 80, 2, 128), "uint16"), TypeError,
         "q: dtype uint16 holds raw 16-bit values; pass dtype='bf16' or dtype='fp16'"),
        (arr((2, 64, 8, 128)), arr((2, 80, 2, 128), device=1), arr((2, 80, 2, 128)), ValueError,
         "k: is on cuda:1 but q is on cuda:0"),
        (np.zeros((2, 64, 8, 128), np.float16), arr((2, 80, 2, 128)), arr((2, 80, 2, 128)), ValueError,
         r"q: is a cpu array \(ndarray\); mhakit needs CUDA or ROCm device memory"),
        (arr((2, 64, 8, 128)), "k", arr((2, 80, 2, 128)), TypeError, "k: expected a CUDA array exposing __dlpack__"),
    ])
    def test_shape_dtype_device_errors_name_the_argument(self, q, k, v, error, message):
        with pytest.raises(error, match=message):
            mhakit.mha_fwd(q, k, v)

    @pytest.mark.parametrize("dtype, kwargs, message", [
        ("float8_e4m3fn", {}, "float8_e4m3fn inputs need descale_q, descale_k and descale_v"),
        ("float8_e4m3fn", dict(descale_q=arr((1,), "float32"), descale_k=arr((1,), "float32")),
         "float8_e4m3fn inputs need descale_q"),
        ("float8_e4m3fn", dict(descale_q=arr((2,), "float32"), descale_k=arr((1,), "float32"),
                               descale_v=arr((1,), "float32")),
         r"descale_q: expected a float32 array of one element, got float32 \(2,\)"),
        ("float8_e4m3fn", dict(descale_q=arr((1,), "float16"), descale_k=arr((1,), "float32"),
                               descale_v=arr((1,), "float32")), "descale_q: expected a float32 array"),
        ("float8_e4m3fn", dict(descale_q=arr((1,), "float32"), descale_k=arr((1,), "float32"),
                               descale_v=arr((1,), "float32"), out_dtype="fp8"), "out_dtype: expected 'bf16' or 'fp16'"),
        ("float16", dict(descale_q=arr((1,), "float32")), "descale_q: descale factors and out_dtype are for"),
        ("float16", dict(out_dtype="bf16"), "out_dtype: descale factors and out_dtype are for float8_e4m3fn"),
        ("uint8", {}, "q: dtype uint8 is not supported"),
        ("uint16", dict(dtype="fp8"), "q: dtype uint16 holds raw 16-bit values"),
    ])
    def test_fp8_arguments(self, dtype, kwargs, message):
        q, k, v = qkv(dtype=dtype)
        with pytest.raises(TypeError, match=message):
            mhakit.mha_fwd(q, k, v, **kwargs)

    def test_fp8_runs_on_the_batch_forward_only(self):
        q, k, v = qkv(dtype="float8_e4m3fn")
        with pytest.raises(TypeError, match="float8_e4m3fn inputs run on mha_fwd only .* the backward takes"):
            mhakit.mha_bwd(arr((2, 64, 8, 128)), q, k, v, arr((2, 64, 8, 128)), arr((2, 8, 64), "float32"))
        q8 = arr((100, 8, 128), "uint8")
        with pytest.raises(TypeError, match="run on mha_fwd only .* group mode"):
            mhakit.mha_varlen_fwd(q8, q8, q8, arr((3,), "int32"), arr((3,), "int32"), 64, 64, dtype="fp8")

    def test_negative_strides_are_refused(self):
        q = arr((2, 64, 8, 128), strides=(64 * 8 * 128, -8 * 128, 128, 1))
        k, v = arr((2, 80, 2, 128)), arr((2, 80, 2, 128))
        with pytest.raises(ValueError, match="q: negative strides are not supported"):
            mhakit.mha_fwd(q, k, v)
        with pytest.raises(ValueError, match="out: negative strides are not supported"):
            mhakit.mha_fwd(*qkv(), out=arr((2, 64, 8, 128), strides=(64 * 8 * 128, -8 * 128, 128, 1)))

    @pytest.mark.parametrize("kwargs, error, message", [
        (dict(out=arr((2, 64, 8, 64))), ValueError, r"out: expected shape \(2, 64, 8, 128\) \(bshd output\)"),
        (dict(out=arr((2, 64, 8, 128), "bfloat16")), TypeError, "out: expected dtype float16, got bfloat16"),
        (dict(lse_out=arr((2, 8, 64), "float16")), TypeError, "lse_out: expected dtype float32"),
        (dict(lse_out=arr((2, 64, 8), "float32")), ValueError,
         r"lse_out: expected shape \(2, 8, 64\) \(\[batch, nheads, seqlen_q\] float32\)"),
        (dict(lse_out=arr((2, 8, 64), "float32", strides=(1024, 128, 2))), ValueError,
         r"lse_out: the seqlen dimension must be contiguous"),
        (dict(out=arr((2, 64, 8, 128), device=3)), ValueError, "out: is on cuda:3 but q is on cuda:0"),
    ])
    def test_output_errors(self, kwargs, error, message):
        with pytest.raises(error, match=message):
            mhakit.mha_fwd(*qkv(), **kwargs)

    def test_bhsd_layout_shapes(self):
        q, k, v = qkv(layout="bhsd")
        with pytest.raises(ValueError, match=r"out: expected shape \(2, 8, 64, 128\) \(bhsd output\)"):
            mhakit.mha_fwd(q, k, v, layout="bhsd", out=arr((2, 64, 8, 128)))

    def test_masks_resolve_like_flash_attention_and_aiter(self):
        r = api._resolve_mask
        assert r(False, None, None) == (0, -1, -1)
        assert r(True, None, None) == (2, -1, 0)                    # causal: bottom-right, as FlashAttention
        assert r(False, None, (128, 0)) == (2, 128, 0)              # sliding window
        assert r(True, None, (128, 64)) == (2, 128, 0)              # causal window keeps right = 0
        assert r(False, None, (-1, -1)) == (0, -1, -1)
        assert r(False, "t", None) == (1, -1, 0) and r(False, "b:4,35", None) == (2, 4, 35)
        assert r(False, "g:10,5", None) == (3, 10, 5) and r(False, (1, 3, 5), None) == (1, 3, 5)
        assert r(False, ("generic", 2, 2), None) == (3, 2, 2)


@pytest.mark.usefixtures("call_path")
class TestVarlenArguments:
    def call(self, **kw):
        args = dict(q=arr((30, 4, 64)), k=arr((40, 2, 64)), v=arr((40, 2, 64)), cu_seqlens_q=[0, 10, 10, 30],
                    cu_seqlens_k=[0, 0, 25, 40], max_seqlen_q=20, max_seqlen_k=25)
        args.update(kw)
        return mhakit.mha_varlen_fwd(**args)

    @pytest.mark.parametrize("kwargs, error, message", [
        (dict(q=arr((30, 4, 64, 1))), ValueError, r"q: expected 3 dims \[total_tokens, nheads, headdim\]"),
        (dict(cu_seqlens_q=[0, 10, 5, 30]), ValueError, "cu_seqlens_q: offsets must be non-decreasing within"),
        (dict(cu_seqlens_q=[0, 10, 31]), ValueError, r"cu_seqlens_q: offsets must be non-decreasing within \[0, 30\]"),
        (dict(cu_seqlens_k=[0, 25, 40]), ValueError, "cu_seqlens_k: has 3 entries but cu_seqlens_q has 4"),
        (dict(cu_seqlens_q=[[0, 30]]), ValueError, "cu_seqlens_q: expected a 1-D integer array"),
        (dict(max_seqlen_q=19), ValueError, r"max_seqlen_q: 19 is less than the longest sequence in cu_seqlens_q \(20\)"),
        (dict(max_seqlen_k=-1), ValueError, "max_seqlen_q / max_seqlen_k: must be >= 0"),
        (dict(max_seqlen_q=2.5), TypeError, "max_seqlen_q: expected an int"),
        (dict(cu_seqlens_q=arr((4,), "int64")), TypeError, "cu_seqlens_q: expected dtype int32, got int64"),
        (dict(cu_seqlens_q=arr((4,), "int32", strides=(2,))), ValueError, r"cu_seqlens_q: must be contiguous"),
        (dict(cu_seqlens_q=arr((4,), "int32", device=1)), ValueError, "cu_seqlens_q: is on cuda:1 but q is on cuda:0"),
        (dict(lse_out=arr((30, 4), "float32")), ValueError, r"lse_out: expected shape \(4, 30\)"),
        (dict(v=arr((40, 2, 64), "bfloat16")), TypeError, "v: dtype bfloat16 does not match q's float16"),
    ])
    def test_errors(self, kwargs, error, message):
        with pytest.raises(error, match=message):
            self.call(**kwargs)


@pytest.mark.skipif(have_gpu(), reason="checks the message on machines without a GPU")
@pytest.mark.usefixtures("call_path")
def test_gpu_call_without_gpu_says_so():
    with pytest.raises(mhakit.CudaUnavailableError, match="no usable NVIDIA GPU in this process"):
        mhakit.mha_fwd(*qkv())
    with pytest.raises(mhakit.CudaUnavailableError, match="mhakit.reference, mhakit.prebuild and the code generator "
                                                          "work without"):
        mhakit.mha_varlen_fwd(arr((30, 4, 64)), arr((40, 2, 64)), arr((40, 2, 64)), [0, 30], [0, 40], 30, 40)


@pytest.mark.usefixtures("call_path")
def test_empty_problem_needs_no_library(monkeypatch):
    """Nothing to compute: outputs are allocated (empty) and no library is built or loaded."""
    monkeypatch.setattr(jit, "library", lambda *a, **k: pytest.fail("no library for an empty problem"))
    from mhakit import _cuda
    monkeypatch.setattr(_cuda, "allocate", lambda nbytes, dev, stream, ref=None: _cuda.Allocation(0, 0, dev, stream,
                                                                                                 ref, False))
    o, lse = mhakit.mha_fwd(*qkv(sq=0), return_lse=True)
    assert o.shape == (2, 0, 8, 128) and lse.shape == (2, 8, 0) and o.dtype.name == "float16"


def test_import_is_torch_free_and_lazy():
    """`import mhakit` and the front end's modules load without torch (blocked here), without touching CUDA or HIP, and do
    not install a top-level `codegen` module."""
    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'cupy', 'jax'):\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import mhakit\n"
        "assert 'numpy' not in sys.modules and 'mhakit.api' not in sys.modules\n"
        "from mhakit import api, jit, _arrays, _cuda, _hip\n"
        "mhakit.mha_fwd, mhakit.mha_varlen_fwd, mhakit.mha_bwd, mhakit.mha_varlen_bwd, mhakit.prebuild\n"
        "mhakit.reference.attention_fwd, mhakit.reference.attention_bwd\n"
        "e = jit.derive_entry('fwd', 'sm_90a', 'bf16', 128, 128, 'batch', False)\n"
        "assert mhakit.codegen.__name__ == 'mhakit.codegen' and 'codegen' not in sys.modules\n"
        "assert not [m for m in sys.modules if m.split('.')[0] in ('torch', 'cupy', 'jax', 'cuda', 'hip')]\n"
        "print('ok')\n")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd="/")
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_reference_is_exposed():
    assert mhakit.reference.attention_fwd is not None and "reference" in dir(mhakit)


def test_installed_package_carries_what_a_build_reads():
    """pyproject.toml ships codegen/, templates/ and csrc/ inside the package as the generator expects them; every
    file a JIT build reads (rendered instances' includes, runtime sources, templates, catalogue) matches its globs."""
    with open(REPO / "pyproject.toml", "rb") as f:
        setup = tomllib.load(f)["tool"]["setuptools"]
    dirs = setup["package-dir"]
    assert dirs["mhakit.codegen"] == "codegen" and dirs["mhakit.templates"] == "templates" and dirs["mhakit.csrc"] == "csrc"
    assert "codegen" not in setup["packages"]
    data = setup["package-data"]

    def shipped(package, rel):
        return any(fnmatch.fnmatch(rel, pat) or fnmatch.fnmatch(rel, pat.replace("**/", "")) for pat in data[package])

    build = _codegen.submodule("build")
    plans = [jit.make_plan(jit.derive_entry("fwd", "sm_90a", dt, 128, 128, mode, m), None)
             for dt in ("fp16", "bf16") for mode in ("batch", "group") for m in (False, True)]
    needed = set().union(*(p.inputs["csrc"] for p in plans)) | set(build.RUNTIME_SOURCES["fwd"])
    assert needed and all(shipped("mhakit.csrc", rel) for rel in needed), needed
    assert all(shipped("mhakit.templates", p.name) for p in (REPO / "templates").iterdir() if p.is_file())
    assert all(shipped("mhakit.codegen", p.relative_to(REPO / "codegen").as_posix())
               for p in (REPO / "codegen").rglob("*.toml"))


class FakeDriver:
    """Enough of cuda.bindings.driver to run the Python call path on a machine without a GPU: allocations hand out
    made-up addresses, every call is recorded. The library itself then runs for real up to its device check."""

    class CUresult:
        CUDA_SUCCESS = 0

    class CUdevice_attribute:
        CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
        CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76
        CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED = 115

    class CUpointer_attribute:
        CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9

    class CUevent_flags:
        CU_EVENT_DISABLE_TIMING = 2

    def __init__(self, cc=(8, 0)):
        self.calls = []
        self.cc = cc
        self.next_ptr = 0x7E0000000000
        self.current = 0

    def __getattr__(self, name):
        def call(*args):
            self.calls.append((name, args))
            if name == "cuDeviceGetAttribute":
                attr = args[0]
                value = {75: self.cc[0], 76: self.cc[1], 115: 1}[attr]
                return (0, value)
            if name in ("cuMemAllocAsync", "cuMemAlloc"):
                ptr, self.next_ptr = self.next_ptr, self.next_ptr + ((int(args[0]) + 255) // 256) * 256
                return (0, ptr)
            if name == "cuCtxGetCurrent":
                return (0, self.current)
            if name == "cuCtxSetCurrent":
                self.current = args[0]
                return (0,)
            if name == "cuDevicePrimaryCtxRetain":
                return (0, 0xC0)
            if name == "cuCtxGetDevice":
                return (0, 0)
            if name in ("cuDeviceGet", "cuEventCreate"):
                return (0, args[0] if args else 1)
            return (0,)
        return call


def install_fake_driver(monkeypatch, tmp_path) -> FakeDriver:
    """mhakit._cuda on a FakeDriver (fresh per-process memos, so the fake device's arch is asked again) and a kernel
    cache under tmp_path; returns the fake, whose .calls record every driver call."""
    from mhakit import _cuda
    fake = FakeDriver()
    monkeypatch.setattr(_cuda, "_DRIVER", fake)
    for module, memo in ((_cuda, "_CC"), (_cuda, "_PRIMARY"), (_cuda, "_POOLS"), (jit, "_LIBS"), (jit, "_ARCHS")):
        monkeypatch.setattr(module, memo, {})  # per-process memos start empty for the fake device
    monkeypatch.setenv("MHAKIT_CACHE_DIR", str(tmp_path / "cache"))
    return fake


@pytest.mark.compile
@pytest.mark.usefixtures("python_path")
def test_call_path_reaches_the_library_with_valid_arguments(tmp_path, monkeypatch):
    """With a fake driver, a varlen call builds its library for the fake device's arch (sm_80), allocates O and LSE
    on the call's stream, uploads host offsets, and the C library accepts every argument and chooses an instance
    (it then stops at its own device check: there is no GPU here)."""
    from conftest import have_nvcc
    from mhakit import _capi
    if not have_nvcc():
        pytest.skip("nvcc not found")
    if have_gpu():
        pytest.skip("the GPU tests cover this path for real")
    fake = install_fake_driver(monkeypatch, tmp_path)
    q, k, v = arr((30, 4, 64)), arr((40, 2, 64)), arr((40, 2, 64))
    with pytest.raises(_capi.MhakitError, match="no CUDA device/driver is available") as info:
        mhakit.mha_varlen_fwd(q, k, v, [0, 10, 10, 30], [0, 0, 25, 40], 20, 25, causal=True, return_lse=True,
                              stream=0x5000)
    assert info.value.code == _capi.ERROR_CUDA
    names = [c[0] for c in fake.calls]
    allocs = [c[1] for c in fake.calls if c[0] == "cuMemAllocAsync"]
    assert allocs[:2] == [(30 * 4 * 64 * 2, 0x5000), (4 * 30 * 4, 0x5000)]  # O (fp16) and LSE (fp32)
    uploads = [c[1] for c in fake.calls if c[0] == "cuMemcpyHtoDAsync"]
    assert [u[2] for u in uploads] == [16, 16] and all(u[3] == 0x5000 for u in uploads)
    assert "cuCtxSetCurrent" in names
    assert (tmp_path / "cache" / "v1" / "fwd").is_dir()
    lib_dirs = list((tmp_path / "cache" / "v1" / "fwd").iterdir())
    assert [d.name.split("-")[0:2] for d in lib_dirs] == [["fwd_fp16_group_mask_sm80", "generic_d64"]]
    # batch mode, head-major memory viewed as bshd, GQA, a sliding window: accepted by the library as well
    q = arr((2, 33, 4, 64), strides=(4 * 33 * 64, 64, 33 * 64, 1))
    k = arr((2, 47, 2, 64), strides=(2 * 47 * 64, 64, 47 * 64, 1))
    with pytest.raises(_capi.MhakitError, match="no CUDA device/driver is available"):
        mhakit.mha_fwd(q, k, k, window=(8, 0), lse_out=arr((2, 4, 33), "float32"))
    names = sorted(d.name.split("-")[0] for d in (tmp_path / "cache" / "v1" / "fwd").iterdir())
    assert names == ["fwd_fp16_batch_mask_sm80", "fwd_fp16_group_mask_sm80"]


@pytest.mark.usefixtures("call_path")
def test_empty_arrays_may_report_any_strides(monkeypatch):
    """CuPy exports zero-size arrays with all-zero strides: no key at all (s_k = 0) is still a valid call."""
    from mhakit import _cuda

    class Reached(Exception):  # the Python path allocates outputs first, the C path resolves the library first
        pass

    def reached(*args, **kwargs):
        raise Reached

    monkeypatch.setattr(_cuda, "allocate", reached)
    monkeypatch.setattr(jit, "library", reached)
    q = arr((2, 40, 4, 128))
    k = arr((2, 0, 4, 128), strides=(0, 0, 0, 0), ptr=0)
    with pytest.raises(Reached):  # every argument check passed
        mhakit.mha_fwd(q, k, k)


@pytest.mark.compile
@pytest.mark.usefixtures("call_path")
def test_c_path_resolves_allocates_then_needs_the_driver(tmp_path, monkeypatch, call_path):
    """Through the C path with mhakit._cuda's driver faked: a valid call builds its library (sm_80), gets its entry
    points, allocates O and LSE through mhakit's allocator on the call's stream, and stops only where it needs the
    real driver for the launch (there is none here)."""
    from conftest import have_nvcc
    if call_path != "c":
        pytest.skip("the Python path's version of this is test_call_path_reaches_the_library_with_valid_arguments")
    if not have_nvcc() or have_gpu():
        pytest.skip("needs nvcc and a machine without a GPU")
    fake = install_fake_driver(monkeypatch, tmp_path)
    q = arr((2, 33, 4, 64), strides=(4 * 33 * 64, 64, 33 * 64, 1))
    k = arr((2, 47, 2, 64), strides=(2 * 47 * 64, 64, 47 * 64, 1))
    with pytest.raises(mhakit.CudaUnavailableError, match="libcuda.so.1 could not be loaded"):
        mhakit.mha_fwd(q, k, k, window=(8, 0), return_lse=True, stream=0x5000)
    allocs = [c[1] for c in fake.calls if c[0] == "cuMemAllocAsync"]
    assert allocs == [(2 * 33 * 4 * 64 * 2, 0x5000), (2 * 4 * 33 * 4, 0x5000)]  # O (fp16), LSE (fp32)
    names = [d.name.split("-")[0] for d in (tmp_path / "cache" / "v1" / "fwd").iterdir()]
    assert names == ["fwd_fp16_batch_mask_sm80"]


# ----------------------------------------------------------------------------------------------------------------
# The backward calls
# ----------------------------------------------------------------------------------------------------------------

def bwd_batch(b=2, sq=64, sk=80, hq=8, hk=2, d=128, d_v=128, storage="float16", layout="bshd", **overrides):
    """Keyword arguments of a valid mha_bwd call (fake CUDA arrays), with `overrides` (mha_bwd's own keyword names:
    dq, dk, dv, o, lse, ...) replacing some."""
    q, k, v = qkv(b, sq, sk, hq, hk, d, d_v, storage, layout)
    o_shape = (b, sq, hq, d_v) if layout == "bshd" else (b, hq, sq, d_v)
    args = dict(do=arr(o_shape, storage), q=q, k=k, v=v, o=arr(o_shape, storage), lse=arr((b, hq, sq), "float32"),
                layout=layout)
    args.update(overrides)
    return args


@pytest.mark.usefixtures("call_path")
class TestBwdArguments:
    @pytest.mark.parametrize("kwargs, error, message", [
        (dict(layout="sbhd"), ValueError, "layout: expected 'bshd' or 'bhsd'"),
        (dict(mask="b", causal=True), ValueError, "mask: give either mask= or causal=/window="),
        (dict(window=(1, 2, 3)), TypeError, r"window: expected \(left, right\)"),
        (dict(scale=0.0), ValueError, "scale: must be finite and > 0"),
        (dict(deterministic="yes"), TypeError, "deterministic: expected a bool, got 'yes'"),
        (dict(stream=1.5), TypeError, "stream: expected None, an int CUstream handle"),
        (dict(dtype="bf16"), TypeError, "q: has dtype float16 but dtype='bf16' was given"),
    ])
    def test_option_errors(self, kwargs, error, message):
        with pytest.raises(error, match=message):
            mhakit.mha_bwd(**bwd_batch(**kwargs))

    @pytest.mark.parametrize("kwargs, error, message", [
        (dict(o=arr((2, 64, 8, 64))), ValueError,
         r"o: expected shape \(2, 64, 8, 128\) \(the forward's output, \[batch, seqlen_q, nheads_q, headdim_v\]\), "
         r"got \(2, 64, 8, 64\)"),
        (dict(do=arr((2, 8, 64, 128))), ValueError, r"do: expected shape \(2, 64, 8, 128\) \(the gradient of o"),
        (dict(do=arr((2, 64, 8, 128), "bfloat16")), TypeError, "do: dtype bfloat16 does not match q's float16"),
        (dict(o=arr((2, 64, 8, 128), "float32")), TypeError, "o: dtype float32 is not supported"),
        (dict(o=arr((2, 64, 8, 128), strides=(64 * 8 * 256, 8 * 256, 256, 2))), ValueError,
         r"o: the head dimension must be contiguous \(stride 1\)"),
        (dict(lse=arr((2, 64, 8), "float32")), ValueError,
         r"lse: expected shape \(2, 8, 64\) \(the forward's LSE, \[batch, nheads_q, seqlen_q\] float32\)"),
        (dict(lse=arr((2, 8, 64))), TypeError, r"lse: expected dtype float32 \(the forward's LSE\), got float16"),
        (dict(lse=arr((2, 8, 64), "float32", strides=(8 * 128, 128, 2))), ValueError,
         r"lse: the seqlen dimension must be contiguous \(stride 1\)"),
        (dict(lse=np.zeros((2, 8, 64), np.float32)), ValueError, r"lse: is a cpu array"),
        (dict(lse=arr((2, 8, 64), "float32", device=1)), ValueError, "lse: is on cuda:1 but q is on cuda:0"),
        (dict(k=arr((2, 80, 3, 128)), v=arr((2, 80, 3, 128))), ValueError, "k: 3 kv heads; q's head count 8"),
    ])
    def test_input_errors_name_the_argument(self, kwargs, error, message):
        with pytest.raises(error, match=message):
            mhakit.mha_bwd(**bwd_batch(**kwargs))

    @pytest.mark.parametrize("kwargs, error, message", [
        (dict(dq=arr((2, 64, 8, 64))), ValueError, r"dq: expected shape \(2, 64, 8, 128\) \(like q, bshd\)"),
        (dict(dk=arr((2, 80, 8, 128))), ValueError, r"dk: expected shape \(2, 80, 2, 128\) \(like k, bshd\)"),
        (dict(dv=arr((2, 80, 2, 128), "bfloat16")), TypeError, "dv: expected dtype float16, got bfloat16"),
        (dict(dq=arr((2, 64, 8, 128), strides=(64 * 8 * 256, 8 * 256, 256, 2))), ValueError,
         r"dq: the head dimension must be contiguous"),
        (dict(dk=arr((2, 80, 2, 128), strides=(80 * 2 * 128, -2 * 128, 128, 1))), ValueError,
         "dk: negative strides are not supported"),
        (dict(dv=arr((2, 80, 2, 128), device=2)), ValueError, "dv: is on cuda:2 but q is on cuda:0"),
    ])
    def test_output_errors(self, kwargs, error, message):
        with pytest.raises(error, match=message):
            mhakit.mha_bwd(**bwd_batch(**kwargs))

    def test_bhsd_layout_shapes(self):
        with pytest.raises(ValueError, match=r"o: expected shape \(2, 8, 64, 128\) \(the forward's output, "
                                             r"\[batch, nheads_q, seqlen_q, headdim_v\]\)"):
            mhakit.mha_bwd(**bwd_batch(layout="bhsd", o=arr((2, 64, 8, 128))))
        with pytest.raises(ValueError, match=r"dk: expected shape \(2, 2, 80, 128\) \(like k, bhsd\)"):
            mhakit.mha_bwd(**bwd_batch(layout="bhsd", dk=arr((2, 80, 2, 128))))

    def test_no_query_heads_is_refused_when_keys_exist(self):
        with pytest.raises(ValueError, match="q: has 0 heads; the backward needs at least one query head"):
            mhakit.mha_bwd(**bwd_batch(hq=0))


@pytest.mark.usefixtures("call_path")
class TestVarlenBwdArguments:
    def call(self, **kw):
        args = dict(do=arr((30, 4, 64)), q=arr((30, 4, 64)), k=arr((40, 2, 64)), v=arr((40, 2, 64)),
                    o=arr((30, 4, 64)), lse=arr((4, 30), "float32"), cu_seqlens_q=[0, 10, 10, 30],
                    cu_seqlens_k=[0, 0, 25, 40], max_seqlen_q=20, max_seqlen_k=25)
        args.update(kw)
        return mhakit.mha_varlen_bwd(**args)

    @pytest.mark.parametrize("kwargs, error, message", [
        (dict(o=arr((30, 4, 64, 1))), ValueError, r"o: expected 3 dims \[total_q, nheads_q, headdim_v\]"),
        (dict(do=arr((30, 2, 64))), ValueError, r"do: expected shape \(30, 4, 64\) \(the gradient of o"),
        (dict(lse=arr((30, 4), "float32")), ValueError,
         r"lse: expected shape \(4, 30\) \(the forward's LSE, \[nheads_q, total_q\] float32\)"),
        (dict(lse=arr((4, 30), "float32", strides=(1, 4))), ValueError,
         r"lse: the token dimension must be contiguous \(stride 1\)"),
        (dict(cu_seqlens_k=[0, 25, 40]), ValueError, "cu_seqlens_k: has 3 entries but cu_seqlens_q has 4"),
        (dict(max_seqlen_k=24), ValueError, r"max_seqlen_k: 24 is less than the longest sequence in cu_seqlens_k"),
        (dict(cu_seqlens_q=arr((4,), "int64")), TypeError, "cu_seqlens_q: expected dtype int32, got int64"),
        (dict(dk=arr((40, 4, 64))), ValueError, r"dk: expected shape \(40, 2, 64\) \(like k"),
        (dict(dq=arr((30, 4, 64), "bfloat16")), TypeError, "dq: expected dtype float16, got bfloat16"),
        (dict(deterministic=None), TypeError, "deterministic: expected a bool"),
    ])
    def test_errors(self, kwargs, error, message):
        with pytest.raises(error, match=message):
            self.call(**kwargs)


@pytest.mark.skipif(have_gpu(), reason="checks the message on machines without a GPU")
@pytest.mark.usefixtures("call_path")
def test_bwd_call_without_gpu_says_so():
    with pytest.raises(mhakit.CudaUnavailableError, match="no usable NVIDIA GPU in this process"):
        mhakit.mha_bwd(**bwd_batch())


def _no_gpu_memory(monkeypatch):
    monkeypatch.setattr(jit, "library", lambda *a, **k: pytest.fail("no library for an empty problem"))
    from mhakit import _cuda
    monkeypatch.setattr(_cuda, "allocate", lambda nbytes, dev, stream, ref=None: _cuda.Allocation(0, 0, dev, stream,
                                                                                                 ref, False))


@pytest.mark.parametrize("sizes", [dict(b=0), dict(sq=0, sk=0)])
@pytest.mark.usefixtures("call_path")
def test_empty_backward_needs_no_library(monkeypatch, sizes):
    """Nothing to compute: the gradients are allocated (empty) and no library is built or loaded."""
    _no_gpu_memory(monkeypatch)
    args = bwd_batch(**sizes)
    dq, dk, dv = mhakit.mha_bwd(**args)
    assert dq.shape == args["q"].shape and dk.shape == args["k"].shape and dv.shape == args["v"].shape
    assert dq.dtype.name == "float16"


@pytest.mark.usefixtures("call_path")
def test_empty_varlen_backward_needs_no_library(monkeypatch):
    _no_gpu_memory(monkeypatch)
    empty = arr((0, 4, 64), ptr=0)
    kv = arr((0, 2, 64), ptr=0)
    dq, dk, dv = mhakit.mha_varlen_bwd(empty, empty, kv, kv, empty, arr((4, 0), "float32", ptr=0), [0, 0, 0],
                                       [0, 0, 0], 0, 0)
    assert dq.shape == (0, 4, 64) and dk.shape == (0, 2, 64) and dv.shape == (0, 2, 64)


@pytest.mark.compile
@pytest.mark.usefixtures("python_path")
def test_bwd_call_path_reaches_the_library_with_valid_arguments(tmp_path, monkeypatch):
    """With a fake driver, mha_varlen_bwd and mha_bwd build libmha_bwd.so for the fake device's arch (sm_80),
    allocate dQ/dK/dV on the call's stream, upload host offsets, ask the library for the workspace, allocate it on
    the stream (256-byte aligned) and pass it in; the C library accepts every argument, chooses an instance and
    finds the workspace large enough (it then stops at its own device check: there is no GPU here); the workspace is
    freed on the call's stream."""
    from conftest import have_nvcc
    from mhakit import _capi
    if not have_nvcc():
        pytest.skip("nvcc not found")
    if have_gpu():
        pytest.skip("the GPU tests cover this path for real")
    fake = install_fake_driver(monkeypatch, tmp_path)
    launches = []
    original = _capi.BwdLibrary.mha_bwd

    def spy(self, args, config=None):
        launches.append(dict(name=self.kernel_name(args), need=self.workspace_size(args), ptr=args.workspace_ptr,
                             bytes=args.workspace_bytes, stream=config.stream, group=args.is_group_mode,
                             deterministic=args.deterministic, dk=(args.batch_stride_dk, args.nhead_stride_dk,
                                                                   args.stride_dk), lse=(args.batch_stride_lse,
                                                                                         args.nhead_stride_lse)))
        return original(self, args, config)

    monkeypatch.setattr(_capi.BwdLibrary, "mha_bwd", spy)
    q, k, v = arr((30, 4, 64)), arr((40, 2, 64)), arr((40, 2, 64))
    with pytest.raises(_capi.MhakitError, match="no CUDA device/driver is available") as info:
        mhakit.mha_varlen_bwd(q, q, k, v, q, arr((4, 30), "float32"), [0, 10, 10, 30], [0, 0, 25, 40], 20, 25,
                              causal=True, deterministic=True, stream=0x5000)
    assert info.value.code == _capi.ERROR_CUDA
    allocs = [c[1] for c in fake.calls if c[0] == "cuMemAllocAsync"]
    assert allocs[:3] == [(30 * 4 * 64 * 2, 0x5000), (40 * 2 * 64 * 2, 0x5000), (40 * 2 * 64 * 2, 0x5000)]
    uploads = [c[1] for c in fake.calls if c[0] == "cuMemcpyHtoDAsync"]
    assert [u[2] for u in uploads] == [16, 16] and all(u[3] == 0x5000 for u in uploads)
    (launch,) = launches
    assert launch["name"].startswith("bwd_d64_fp16_group_mask_sm80_generic_")
    assert launch["group"] == 1 and launch["deterministic"] == 1 and launch["stream"] == 0x5000
    assert launch["dk"] == (0, 64, 128) and launch["lse"] == (0, 30)
    assert launch["need"] > 0 and launch["bytes"] == launch["need"] and launch["ptr"] % 256 == 0
    assert allocs[5] == (launch["need"], 0x5000)  # after dQ, dK, dV and the two offset uploads
    frees = [c[1] for c in fake.calls if c[0] == "cuMemFreeAsync"]
    assert (launch["ptr"], 0x5000) in frees, "the workspace is freed on the call's stream"
    # batch mode, head-major memory viewed as bshd, GQA, a window, dK into a caller's array of another layout
    q = arr((2, 33, 4, 64), strides=(4 * 33 * 64, 64, 33 * 64, 1))
    kk = arr((2, 47, 2, 64), strides=(2 * 47 * 64, 64, 47 * 64, 1))
    dk = arr((2, 47, 2, 64), strides=(47 * 2 * 72, 2 * 72, 72, 1))  # rows padded to 72 elements
    with pytest.raises(_capi.MhakitError, match="no CUDA device/driver is available"):
        mhakit.mha_bwd(q, q, kk, kk, q, arr((2, 4, 33), "float32"), window=(8, 0), dk=dk, stream=0x5000)
    assert launches[1]["name"].startswith("bwd_d64_fp16_batch_mask_sm80_generic_")
    assert launches[1]["group"] == 0 and launches[1]["deterministic"] == 0
    assert launches[1]["dk"] == (47 * 2 * 72, 72, 144) and launches[1]["lse"] == (4 * 33, 33)
    names = sorted(d.name.split("-")[0] for d in (tmp_path / "cache" / "v1" / "bwd").iterdir())
    assert names == ["bwd_fp16_batch_mask_sm80", "bwd_fp16_group_mask_sm80"]


def test_c_path_allocations_keep_the_callers_stream_alive(monkeypatch):
    """An output the C path allocates through mhakit's allocator is freed on the caller's stream when its last
    reference goes; the allocation keeps the caller's stream object alive until then (a CuPy stream destroyed
    first would make that free fault)."""
    import gc
    import weakref

    from mhakit import _cuda
    fake = FakeDriver()
    monkeypatch.setattr(_cuda, "_DRIVER", fake)
    for memo in ("_CC", "_PRIMARY", "_POOLS"):
        monkeypatch.setattr(_cuda, memo, {})

    class Stream:
        ptr = 0x5000

    stream = Stream()
    alive = weakref.ref(stream)
    _, allocate, _, _ = api._ext_callbacks()
    out = allocate(0, (2, 3), "float16", 0x5000, stream)
    assert out.shape == (2, 3) and out.stream == 0x5000
    ptr = out.ptr
    del stream
    gc.collect()
    assert alive() is not None, "the allocation holds the caller's stream"
    del out
    gc.collect()
    assert alive() is None
    assert ("cuMemFreeAsync", (ptr, 0x5000)) in fake.calls
