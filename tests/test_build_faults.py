"""Faults of the built artefacts (issue 8): what the libraries export, reproducible bytes, and benchmarks that refuse
sizes they cannot hold or a machine without a GPU in one line instead of aborting. Needs nvcc (the minimal build),
not a GPU."""
from __future__ import annotations

import resource
import subprocess
import sys

import pytest

from conftest import have_gpu, run_compile

pytestmark = pytest.mark.compile


def exported(lib) -> set[str]:
    out = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("nm not available")
    return {line.split()[-1] for line in out.stdout.splitlines() if line.strip()}


def test_libraries_export_only_the_c_abi(minimal_bwd_build):
    assert exported(minimal_bwd_build / "libmha_fwd.so") == {
        "mhakit_mha_fwd", "mhakit_mha_fwd_kernel_name", "mhakit_mha_fwd_splitkv", "mhakit_mha_fwd_splitkv_kernel_name",
        "mhakit_mha_fwd_splitkv_acc_size", "mhakit_mha_fwd_workspace_size", "mhakit_last_error"}
    assert exported(minimal_bwd_build / "libmha_bwd.so") == {"mhakit_mha_bwd", "mhakit_mha_bwd_kernel_name",
                                                              "mhakit_mha_bwd_workspace_size", "mhakit_last_error"}


_SHARED_ERROR = """
import ctypes, sys
fwd = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
bwd = ctypes.CDLL(sys.argv[2], mode=ctypes.RTLD_GLOBAL)
fwd.mhakit_last_error.restype = bwd.mhakit_last_error.restype = ctypes.c_char_p
bwd.mhakit_mha_bwd.restype = fwd.mhakit_mha_fwd.restype = ctypes.c_float
print(bwd.mhakit_mha_bwd(None, None), fwd.mhakit_last_error().decode(), "|", bwd.mhakit_last_error().decode())
print(fwd.mhakit_mha_fwd(None, None), bwd.mhakit_last_error().decode())
"""


def test_both_libraries_loaded_globally_share_one_error_text(minimal_bwd_build):
    """A C++ program linking both libraries reads mhakit::last_error() from either one, whichever failed."""
    proc = subprocess.run([sys.executable, "-c", _SHARED_ERROR, str(minimal_bwd_build / "libmha_fwd.so"),
                           str(minimal_bwd_build / "libmha_bwd.so")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["-2.0 args must not be NULL | args must not be NULL",
                                        "-2.0 args must not be NULL"]


def test_the_same_selection_builds_to_the_same_bytes_anywhere(minimal_fwd_build, build_root, tmp_path):
    """Two builds of one selection in different build directories (as two JIT builds of an entry use two
    temporary ones) give byte-identical libraries."""
    args = ["--api", "fwd", "--profile", "minimal", "--arch", "sm_90a", "--filter", "batch_nmask_sm90a_generic"]
    libs = []
    for name, build_dir in (("first", build_root / "objects"), ("second", tmp_path / "elsewhere" / "objects")):
        out = tmp_path / name
        out.mkdir()
        proc = run_compile(args + ["--build-dir", str(build_dir)], cwd=out)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        libs.append((out / "libmha_fwd.so").read_bytes())
    assert libs[0] == libs[1]
    assert str(tmp_path).encode() not in libs[1] and b"tmpxft" not in libs[1]


def _limit_memory(nbytes: int):
    def apply():
        resource.setrlimit(resource.RLIMIT_AS, (nbytes, nbytes))
    return apply


def run_bench(build, api: str, *args: str, memory: int | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(build / f"benchmark_mha_{api}"), *args], capture_output=True, text=True, timeout=300,
                          preexec_fn=_limit_memory(memory) if memory else None)


@pytest.mark.parametrize("api", ["fwd", "bwd"])
@pytest.mark.parametrize("args, memory, message", [
    (["-b=1024", "-h=64", "-s=65536", "-d=256"], 6 << 30, "GiB of host memory (inputs and reference), more than"),
    (["-mode=1", "-b=2", "-s=2000000000,2000000000", "-h=1"], None,
     "more than 2147483647 tokens in total, beyond the int32 offsets (seqstart) of group mode"),
    (["-b=65535", "-h=65535", "-s=2000000000", "-d=256"], None, "the tensors have too many elements to address"),
])
def test_benchmarks_refuse_sizes_they_cannot_hold_in_one_line(minimal_bwd_build, api, args, memory, message):
    proc = run_bench(minimal_bwd_build, api, *args, memory=memory)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
    assert proc.stderr.startswith(f"benchmark_mha_{api}: error: ")


@pytest.mark.parametrize("api", ["fwd", "bwd"])
def test_benchmarks_without_a_gpu_say_so(minimal_bwd_build, api):
    if have_gpu():
        pytest.skip("a GPU is present")
    proc = run_bench(minimal_bwd_build, api, "-prec=bf16", "-b=1", "-h=2", "-s=64", "-d=128")
    assert proc.returncode == 3
    assert proc.stderr.startswith(f"benchmark_mha_{api}: no CUDA device/driver is available (")
    assert proc.stderr.count("\n") == 1, proc.stderr
