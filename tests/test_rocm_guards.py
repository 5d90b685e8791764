"""The CK-tile glue's host logic (instance guards as CK's dispatch decides them, the backward workspace, the mask
conversion), compiled host-only with the HIP toolchain and run on the CPU: tests/ck_guards_check.cpp. Marked `rocm`
(needs the HIP headers and CK); no GPU involved."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from codegen import toolchain

pytestmark = pytest.mark.rocm

SOURCE = Path(__file__).resolve().parent / "ck_guards_check.cpp"


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_guards_workspace_and_masks(tmp_path, direction):
    tc = toolchain.Hipcc.create("gfx942", "gfx942")
    obj, exe = tmp_path / "check.o", tmp_path / "check"
    flags = tc.host_flags() + [f"-I{d}" for d in tc.include_dirs()] + (["-DCHECK_BWD"] if direction == "bwd" else [])
    compiled = subprocess.run([tc.path, *flags, "-c", str(SOURCE), "-o", str(obj)], capture_output=True, text=True)
    assert compiled.returncode == 0, compiled.stderr[-4000:]
    linked = subprocess.run([tc.path, str(obj), "-o", str(exe)], capture_output=True, text=True)
    assert linked.returncode == 0, linked.stderr[-4000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip().endswith(" passed, 0 failed"), run.stdout
