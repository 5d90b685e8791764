"""Check programs over the kernel headers (which include CuTe and CUTLASS): compiled by nvcc with the library's flags
for an arch, run on the CPU, their last line "checked N failures M". Each program gets PRELUDE in front: the counters
`checked` / `failures` and EXPECT(cond, printf-format, ...), which counts a check and prints the first 10 failures."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from codegen import catalogue, toolchain


PRELUDE = r"""#include <cstdio>

static int failures = 0, checked = 0;
#define EXPECT(cond, ...)                                                                                      \
    do {                                                                                                       \
        ++checked;                                                                                             \
        if (!(cond) && ++failures <= 10) {                                                                     \
            std::printf(__VA_ARGS__);                                                                          \
            std::printf("\n");                                                                                 \
        }                                                                                                      \
    } while (0)
"""


def build_cpp(work: Path, name: str, program: str, *flags: str) -> Path:
    """Compile `program` (no CUDA) with the host C++ compiler, -std=c++17 -O1 and the repository's csrc and
    csrc/include on the include path, plus `flags`, as <work>/<name>; the executable. Skips the test without a
    compiler (g++ or c++)."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    src, exe = work / f"{name}.cpp", work / name
    src.write_text(program)
    subprocess.run([cxx, "-std=c++17", "-O1", *flags, "-I", str(toolchain.CSRC), "-I", str(toolchain.CSRC / "include"),
                    str(src), "-o", str(exe)], check=True)
    return exe


def run_host_check(tmp_path: Path, name: str, program: str, arch: str = "sm_90a") -> str:
    """Compile PRELUDE + `program` as <tmp_path>/<name>.cu, run it, assert it compiled, exited 0 and counted no
    failure; its output."""
    nvcc = toolchain.make_toolchain(arch, catalogue.load().arch(arch).gencode)
    src, exe = tmp_path / f"{name}.cu", tmp_path / name
    src.write_text(PRELUDE + program)
    done = subprocess.run([nvcc.path, *nvcc.compile_flags(), str(src), "-o", str(exe)], capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout
    assert "failures 0" in out.stdout and "checked " in out.stdout, out.stdout
    return out.stdout
