"""Shared fixtures: where the repo is, whether nvcc / a GPU exist, and one minimal-profile build per session."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
COMPILE_PY = REPO / "compile.py"


def have_nvcc() -> bool:
    return bool(os.environ.get("NVCC") or shutil.which("nvcc") or
                (os.environ.get("CUDA_HOME") and (Path(os.environ["CUDA_HOME"]) / "bin" / "nvcc").is_file()))


def have_gpu() -> bool:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return False
    try:
        return subprocess.run([smi, "-L"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def rocm_unavailable() -> str:
    """Why the ROCm compile tests cannot run here ("" when they can): no HIP compiler, or no CK tree."""
    from codegen import toolchain
    if not toolchain.locate_hip_compiler()[0]:
        return ("no HIP compiler (hipcc under ROCM_PATH, or clang++ with a ROCm root): "
                "eval \"$(bash tools/rocm_sdk.sh --env)\" prepares one")
    try:
        toolchain.find_ck()
    except toolchain.ToolchainError as exc:
        return str(exc)
    return ""


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="I/N",
                     help="run only every N-th collected test, starting at the I-th (0 <= I < N): the shards of one "
                          "file run side by side (bench/gpu_check.sh)")


def shard_of(spec: str | None) -> tuple[int, int] | None:
    """--shard's (I, N), None without it; a UsageError (pytest's one-line refusal) for anything but 0 <= I < N."""
    if spec is None:
        return None
    try:
        i, n = (int(x) for x in spec.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--shard={spec}: expected I/N with integers 0 <= I < N") from None
    if not 0 <= i < n:
        raise pytest.UsageError(f"--shard={spec}: expected I/N with integers 0 <= I < N")
    return i, n


def pytest_collection_modifyitems(config, items):
    shard = shard_of(config.getoption("--shard"))
    if shard is not None:  # collection order is deterministic, so the shards of a file partition its tests
        i, n = shard
        dropped = [item for k, item in enumerate(items) if k % n != i]
        items[:] = [item for k, item in enumerate(items) if k % n == i]
        config.hook.pytest_deselected(items=dropped)
    skip_gpu = pytest.mark.skip(reason="no NVIDIA GPU on this machine")
    skip_nvcc = pytest.mark.skip(reason="nvcc not found")
    gpu, nvcc = have_gpu(), have_nvcc()
    # markers, not keywords: a keyword match would also hit directory names (a checkout under .../rocm/)
    rocm_reason = rocm_unavailable() if any(item.get_closest_marker("rocm") for item in items) else ""
    for item in items:
        if item.get_closest_marker("gpu") and not gpu:
            item.add_marker(skip_gpu)
        if item.get_closest_marker("compile") and not nvcc:
            item.add_marker(skip_nvcc)
        if item.get_closest_marker("rocm") and rocm_reason:
            item.add_marker(pytest.mark.skip(reason=rocm_reason))


def run_compile(args: list[str], cwd: Path, timeout: int = 1500) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(COMPILE_PY), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="session")
def build_root(tmp_path_factory) -> Path:
    """One build directory for the whole session, so builds share objects. MHAKIT_TEST_BUILD_DIR reuses one across
    sessions (the GPU machine sets it to keep a default-profile build)."""
    override = os.environ.get("MHAKIT_TEST_BUILD_DIR")
    if override:
        path = Path(override)
        path.mkdir(parents=True, exist_ok=True)
        return path
    return tmp_path_factory.mktemp("mhakit_build")


@pytest.fixture(scope="session")
def minimal_fwd_build(build_root) -> Path:
    """libmha_fwd.so of the minimal profile (+ benchmark), built once; returns the directory holding both."""
    if not have_nvcc():
        pytest.skip("nvcc not found")
    out = build_root / "minimal"
    out.mkdir(exist_ok=True)
    proc = run_compile(["--api", "fwd", "--profile", "minimal", "--arch", "sm_90a", "--benchmark",
                        "--build-dir", str(build_root / "objects")], cwd=out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


@pytest.fixture(scope="session")
def gpu_libraries(build_root) -> Path:
    """libmha_fwd.so and libmha_bwd.so (with their benchmarks) of MHAKIT_TEST_PROFILE (default: default), built
    once into one directory; the GPU tests load them from there. MHAKIT_TEST_LIB_DIR names a directory that already
    holds them (built beforehand, with the profile MHAKIT_TEST_PROFILE names): nothing is compiled then."""
    try:
        import cupy  # noqa: F401
    except ImportError:
        pytest.skip("CuPy is not installed")
    prebuilt = os.environ.get("MHAKIT_TEST_LIB_DIR")
    if prebuilt:  # a directory build_mha.sh / compile.py --benchmark filled (e.g. built on another machine)
        missing = [n for n in ("libmha_fwd.so", "libmha_bwd.so", "benchmark_mha_fwd", "benchmark_mha_bwd")
                   if not (Path(prebuilt) / n).is_file()]
        assert not missing, f"MHAKIT_TEST_LIB_DIR={prebuilt} lacks {', '.join(missing)}"
        return Path(prebuilt)
    profile = os.environ.get("MHAKIT_TEST_PROFILE", "default")
    out = build_root / f"gpu-{profile}"
    out.mkdir(exist_ok=True)
    for api in ("fwd", "bwd"):
        proc = run_compile(["--api", api, "--profile", profile, "--benchmark", "--build-dir", str(build_root / "objects")],
                           cwd=out, timeout=3000)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out


@pytest.fixture(scope="session")
def minimal_bwd_build(minimal_fwd_build, build_root) -> Path:
    """libmha_bwd.so of the minimal profile (+ benchmark_mha_bwd, which links the forward library beside it)."""
    proc = run_compile(["--api", "bwd", "--profile", "minimal", "--arch", "sm_90a", "--benchmark",
                        "--build-dir", str(build_root / "objects")], cwd=minimal_fwd_build)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return minimal_fwd_build


def _use_call_path(monkeypatch, path: str) -> None:
    """Route mhakit.mha_* through the C call path ("c": it must build wherever a C compiler exists) or the
    pure-Python path ("python")."""
    from mhakit import _ext
    if path == "python":
        monkeypatch.setenv(_ext.ENV_DISABLE, "1")
    else:
        monkeypatch.delenv(_ext.ENV_DISABLE, raising=False)
    _ext.reset()
    if path == "c" and _ext.module() is None:
        if _ext.compiler() is not None:
            pytest.fail("a C compiler is present but the C call path did not build (see stderr)")
        pytest.skip("no C compiler: the C call path cannot be built here")


@pytest.fixture(params=["c", "python"])
def call_path(request, monkeypatch):
    """Runs a test once through each call path (argument handling must agree on both)."""
    _use_call_path(monkeypatch, request.param)
    yield request.param
    from mhakit import _ext
    _ext.reset()


@pytest.fixture
def c_path(monkeypatch):
    """The C call path only, whatever MHAKIT_NO_EXT says outside (tests of what only that path does)."""
    _use_call_path(monkeypatch, "c")
    yield
    from mhakit import _ext
    _ext.reset()


@pytest.fixture
def python_path(monkeypatch):
    """The pure-Python call path only (tests that fake the CUDA driver of mhakit._cuda)."""
    _use_call_path(monkeypatch, "python")
    yield
    from mhakit import _ext
    _ext.reset()


@pytest.fixture(scope="session")
def fwd_lib(minimal_fwd_build):
    """The minimal profile's libmha_fwd.so, loaded (the modifiers' C validator and dispatch tests)."""
    from mhakit import _capi
    return _capi.load_library(minimal_fwd_build / "libmha_fwd.so")


@pytest.fixture(scope="session")
def bwd_lib(minimal_bwd_build):
    """The minimal profile's libmha_bwd.so, loaded."""
    from mhakit import _capi
    return _capi.load_bwd_library(minimal_bwd_build / "libmha_bwd.so")
