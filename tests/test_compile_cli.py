"""compile.py as a user meets it: listing, one-line errors, and (with nvcc) a real incremental build."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from conftest import run_compile


def test_list_prints_names_and_count(tmp_path):
    proc = run_compile(["--api", "fwd", "--profile", "minimal", "--arch", "sm_90a", "--list"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[-1] == "10 fwd instances for sm_90a (profile minimal)"
    assert "splitkv_d128_bf16_batch_mask_sm90a_decode_b32x64w4" in lines
    assert "fwd_d128_bf16_batch_mask_mods_sm90a_generic_b128x64w4" in lines  # the profile's one modifier instance
    assert "fwd_d128_bf16_batch_nmask_sm90a_hopper_b128x176" in lines
    assert not list(tmp_path.iterdir()), "--list must not write anything"


@pytest.mark.parametrize("args, message", [
    (["--arch", "gfx1100", "--list"], "unknown arch 'gfx1100' for the rocm backend"),
    (["--arch", "sm_75", "--list"], "unknown arch 'sm_75'"),
    (["--arch", "banana"], "unknown arch 'banana'"),
    (["--arch", "sm_90a", "--filter", "no_such_instance"], "selects no fwd instance"),
    (["--arch", "sm_80", "--api", "fwd_v3"], "no kernel family for api 'fwd_v3' on sm_80"),
    (["--arch", "sm_90a", "-j", "0"], "-j must be >= 1"),
])
def test_bad_requests_give_one_line_and_no_traceback(tmp_path, args, message):
    proc = run_compile(args, cwd=tmp_path)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_missing_nvcc_is_one_line(tmp_path):
    env_backup = dict(os.environ)
    try:
        os.environ["PATH"] = "/nonexistent"
        for var in ("NVCC", "CUDA_HOME", "CUDA_PATH"):
            os.environ.pop(var, None)
        proc = run_compile(["--arch", "sm_90a", "--profile", "minimal"], cwd=tmp_path)
    finally:
        os.environ.clear()
        os.environ.update(env_backup)
    assert proc.returncode == 2
    assert "nvcc not found" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.compile
def test_minimal_build_lands_in_cwd_and_rebuilds_nothing(minimal_fwd_build, build_root):
    lib = minimal_fwd_build / "libmha_fwd.so"
    bench = minimal_fwd_build / "benchmark_mha_fwd"
    assert lib.is_file() and bench.is_file() and os.access(bench, os.X_OK)
    lib_mtime = lib.stat().st_mtime_ns
    start = time.monotonic()
    proc = run_compile(["--api", "fwd", "--profile", "minimal", "--arch", "sm_90a", "--benchmark",
                        "--build-dir", str(build_root / "objects")], cwd=minimal_fwd_build)
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr
    assert "no work to do" in proc.stdout and "up to date" in proc.stdout
    assert lib.stat().st_mtime_ns == lib_mtime
    assert elapsed < 5.0, f"a no-op rebuild took {elapsed:.1f} s"


@pytest.mark.compile
def test_library_exports_only_the_c_api(minimal_fwd_build):
    import subprocess
    out = subprocess.run(["nm", "-D", "--defined-only", str(minimal_fwd_build / "libmha_fwd.so")],
                         capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("nm not available")
    exported = {line.split()[-1] for line in out.stdout.splitlines() if " T " in line}
    assert {"mhakit_mha_fwd", "mhakit_mha_fwd_kernel_name", "mhakit_last_error"} <= exported
    assert not [s for s in exported if "cutlass" in s or "cute" in s]
