"""The ROCm backend, compiled: a small gfx942 forward and backward build into libmha_fwd.so / libmha_bwd.so, one
forward instance each for gfx90a and gfx950, and each library's code object checked for its arch (ELF machine,
kernel descriptors, MFMA instructions). Nothing here runs on an AMD GPU: there is none. Marked `rocm`; skipped
without a HIP compiler and a CK tree (tools/rocm_sdk.sh prepares both; .ci/run calls it)."""
from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from conftest import run_compile
from rocm_objects import code_object

pytestmark = pytest.mark.rocm

# (api, arch, instance-name filter): bf16, head dim 128, batch mode, CK's preferred tiles; every kernel family of
# the minimal profile's direction is represented once per arch.
BUILDS = [
    ("fwd", "gfx942", "fwd_d128_bf16_batch_nmask_gfx942_qr_async_b128x128x32x128x32x128_psskddv_nlse,"
                      "fwd_d128_bf16_batch_mask_gfx942_qr_async_b128x128x32x128x32x128_psskddv_lse"),
    ("bwd", "gfx942", "bwd_d128_bf16_batch_mask_gfx942_dqdkdv_b16x128x128x16x128x16x32x128x128_pd8dv8_ndeterministic"),
    ("fwd", "gfx90a", "fwd_d128_bf16_batch_nmask_gfx90a_qr_async_b128x128x32x128x32x128_psskddv_nlse"),
    ("fwd", "gfx950", "fwd_d128_bf16_batch_nmask_gfx950_qr_async_trload_b128x64x32x128x16x128_pddv_nlse"),
]
KERNELS_PER_INSTANCE = {"fwd": 1, "bwd": 3}  # the backward launches dot(dO,O), dQ/dK/dV and convert-dQ


@pytest.fixture(scope="module")
def rocm_builds(build_root) -> dict:
    """Builds each entry of BUILDS into its own directory; returns {(api, arch): (dir, seconds)}."""
    results = {}
    for api, arch, name_filter in BUILDS:
        out = build_root / f"rocm-{arch}"
        out.mkdir(exist_ok=True)
        start = time.monotonic()
        proc = run_compile(["--api", api, "--arch", arch, "--profile", "minimal", "--filter", name_filter,
                            "--benchmark", "--build-dir", str(build_root / "objects")], cwd=out, timeout=1800)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
        results[(api, arch)] = (out, time.monotonic() - start)
        print(f"[rocm] {api} {arch}: {len(name_filter.split(','))} instance(s) in {results[(api, arch)][1]:.0f} s")
    return results


@pytest.mark.parametrize("api, arch, name_filter", BUILDS, ids=[f"{b[0]}-{b[1]}" for b in BUILDS])
def test_library_holds_a_code_object_for_its_arch(rocm_builds, tmp_path, api, arch, name_filter):
    out, _ = rocm_builds[(api, arch)]
    library = out / f"libmha_{api}.so"
    assert library.is_file()
    obj = code_object(library, arch, tmp_path)
    assert obj.arch == arch
    assert len(obj.kernels) == KERNELS_PER_INSTANCE[api] * len(name_filter.split(","))
    assert obj.mfma > 0, "no matrix-core instruction: the kernel body is empty"


def test_libraries_export_only_the_c_api(rocm_builds):
    for (api, _arch), (out, _) in rocm_builds.items():
        nm = subprocess.run(["nm", "-D", "--defined-only", str(out / f"libmha_{api}.so")], capture_output=True, text=True)
        if nm.returncode != 0:
            pytest.skip("nm not available")
        exported = {line.split()[-1] for line in nm.stdout.splitlines() if " T " in line}
        assert f"mhakit_mha_{api}" in exported and "mhakit_last_error" in exported
        assert all(name.startswith("mhakit_") for name in exported), sorted(exported)


# What clang's HIP code generation itself emits to register a module's kernels (the HIP runtime defines them; no
# header declares them), and what every shared object leaves to the C runtime's start-up files.
COMPILER_EMITTED = {"__hipRegisterFatBinary", "__hipRegisterFunction", "__hipUnregisterFatBinary"}
STARTUP = {"__gmon_start__", "_ITM_registerTMCloneTable", "_ITM_deregisterTMCloneTable"}


def _undefined(path: Path) -> set[str]:
    """Undefined symbols of an object or shared library, without symbol versions (nm -D for a shared library)."""
    nm = subprocess.run(["nm", "--undefined-only", *(["-D"] if path.suffix == ".so" else []), str(path)],
                        capture_output=True, text=True)
    if nm.returncode != 0:
        pytest.skip("nm not available")
    return {line.split()[-1] for line in nm.stdout.splitlines() if line.strip()}


def test_what_is_left_to_the_hip_runtime_is_its_api(rocm_builds, build_root):
    """No HIP runtime library can be linked here (the README's ROCm section says why), so the libraries leave the
    HIP runtime's symbols to the process that loads them and the benchmarks are compiled, not linked. What they leave
    open must be the HIP runtime's own API, as the HIP headers they were compiled against declare it (so that a
    ROCm install's libamdhip64 resolves it): the libraries' unversioned undefined symbols, and the benchmarks'
    hip* symbols, are each declared in hip_runtime_api.h or emitted by clang's HIP code generation."""
    from codegen import toolchain
    tc = toolchain.Hipcc.create("gfx942", "gfx942")
    if tc.can_link_executables:
        pytest.skip("a HIP runtime library is present: the libraries and benchmarks are linked against it")
    api_header = tc.rocm / "include" / "hip" / "hip_runtime_api.h" if tc.rocm is not None else None
    if api_header is None or not api_header.is_file():
        pytest.skip("no HIP headers under the ROCm root")
    text = api_header.read_text(errors="replace")
    declared = set(re.findall(r"\b(_{0,2}hip[A-Za-z0-9_]+)\s*\(", text))
    # HIP 6 renamed calls whose structs changed (#define hipGetDeviceProperties hipGetDevicePropertiesR0600)
    declared |= {new for old, new in re.findall(r"#define\s+(hip\w+)\s+(hip\w+)\s*$", text, re.M) if old in declared}
    for (api, _arch), (out, _) in rocm_builds.items():
        left = {name for name in _undefined(out / f"libmha_{api}.so") if "@" not in name} - STARTUP
        assert left and all(name in declared or name in COMPILER_EMITTED for name in left), sorted(left)
    benchmarks = sorted((build_root / "objects").glob("rocm-*/**/benchmark_mha_*.o"))  # beside them: CUDA builds
    assert {b.stem for b in benchmarks} == {"benchmark_mha_fwd", "benchmark_mha_bwd"}
    for obj in benchmarks:
        hip = {name for name in _undefined(obj) if name.lstrip("_").startswith("hip")}
        assert hip and hip <= declared, sorted(hip - declared)


def test_a_second_build_compiles_nothing(rocm_builds, build_root):
    api, arch, name_filter = BUILDS[0]
    out, _ = rocm_builds[(api, arch)]
    proc = run_compile(["--api", api, "--arch", arch, "--profile", "minimal", "--filter", name_filter, "--benchmark",
                        "--build-dir", str(build_root / "objects")], cwd=out)
    assert proc.returncode == 0 and "no work to do" in proc.stdout, proc.stdout + proc.stderr


def test_objects_do_not_depend_on_the_build_directory(tmp_path):
    """The same source compiled by the build's own rule in two directories gives the same object bytes (the build
    directory must not leak into the objects, as for nvcc builds: tests/test_build_faults.py). Host-only, seconds."""
    import shlex

    from codegen import toolchain
    tc = toolchain.Hipcc.create("gfx942", "gfx942")
    rule = tc.ninja_rules()["compile_host"].replace("$$", "$")
    objects = []
    for where in ("a", "b"):
        obj = tmp_path / where / "obj" / "api_common.o"
        obj.parent.mkdir(parents=True)
        command = rule.replace("$host_flags", shlex.join(tc.host_flags())).replace("$out", shlex.quote(str(obj)))
        command = command.replace("$in", shlex.quote(str(toolchain.CSRC / "runtime" / "api_common.cpp")))
        proc = subprocess.run(f"{shlex.quote(tc.path)} {command}", shell=True, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-4000:]
        objects.append(obj.read_bytes())
    assert objects[0] == objects[1]
