"""The one build path: specs -> rendered sources -> build.ninja -> ninja -> atomically installed library.

compile.py, build_mha.sh and (later) the Python JIT all call `build()`. Layout of a build directory:

    <build_dir>/<backend>-<arch>-<toolchain fingerprint>/     objects shared by every selection built with it
        gen/instances/<instance>.cu                           one rendered source per instance
        gen/<api>_dispatch_<arch>_<selection digest>.cu       the instance table of one selection
        obj/...                                               objects (ninja's depfiles beside them)
        <api>-<selection digest>.ninja                        one ninja file per selection
        out/<api>-<selection digest>/libmha_<api>.so          linked outputs, then copied to the install dir
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import catalogue as catalogue_mod
from .ninja import Compile, NinjaFile
from .profiles import APIS, Selection, select
from .render import render_all, write_if_changed
from .spec import KernelSpec
from .toolchain import CSRC, ToolchainError, make_toolchain

# Hand-written runtime sources linked into each API's library.
RUNTIME_SOURCES = {
    "fwd": ["runtime/mha_fwd.cpp", "runtime/error.cpp", "runtime/device.cpp"],
}
BENCHMARKS = {"fwd": "benchmark/benchmark_mha_fwd.cpp"}


class BuildError(RuntimeError):
    """ninja or the compiler failed; the compiler's own output was already shown."""


@dataclass
class BuildRequest:
    api: str = "fwd"
    arch: str = "sm_90a"
    profile: str = "default"
    name_filter: str | None = None
    build_dir: Path = Path("build")
    install_dir: Path = Path(".")
    jobs: int | None = None
    benchmark: bool = False
    verbose: bool = False


@dataclass
class BuildResult:
    library: Path
    executables: list[Path]
    specs: list[KernelSpec]
    seconds: float
    work_dir: Path
    installed: list[Path] = field(default_factory=list)  # outputs whose installed copy changed


def library_name(api: str) -> str:
    return f"libmha_{APIS[api][0]}.so"


def plan_selection(request: BuildRequest) -> Selection:
    return select(request.api, request.arch, request.profile, request.name_filter)


def _digest(texts: list[str]) -> str:
    return hashlib.sha256("\n".join(texts).encode()).hexdigest()[:10]


def default_jobs() -> int:
    return max(1, os.cpu_count() or 1)


def _run_ninja(ninja_file: Path, work_dir: Path, jobs: int, verbose: bool) -> None:
    ninja = shutil.which("ninja")
    if ninja is None:
        try:  # the `ninja` PyPI package ships the binary; use it when the script dir is not on PATH
            import ninja as ninja_pkg
            ninja = str(Path(ninja_pkg.BIN_DIR) / "ninja")
        except ImportError as exc:
            raise ToolchainError("ninja not found: `python3 -m pip install ninja`") from exc
    cmd = [ninja, "-C", str(work_dir), "-f", ninja_file.name, "-j", str(jobs)]
    if verbose:
        cmd.append("-v")
    env = dict(os.environ, NINJA_STATUS="[%f/%t %es] ")
    if subprocess.run(cmd, env=env).returncode != 0:
        raise BuildError(f"the build failed (see the compiler output above); build files are in {work_dir}")


def _install(src: Path, dest_dir: Path) -> bool:
    """Copy src into dest_dir atomically (a reader never sees a half-written file). Skips identical content so
    that a no-op build leaves the installed file, and its mtime, untouched. Returns True when it copied."""
    dest = dest_dir / src.name
    if dest.is_file() and dest.stat().st_size == src.stat().st_size and _file_hash(dest) == _file_hash(src):
        return False
    dest_dir.mkdir(parents=True, exist_ok=True)
    tmp = dest_dir / f".{src.name}.tmp{os.getpid()}"
    shutil.copy2(src, tmp)
    os.replace(tmp, dest)
    return True


def _file_hash(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def build(request: BuildRequest, log=print) -> BuildResult:
    start = time.monotonic()
    selection = plan_selection(request)
    base_api = APIS[request.api][0]
    if base_api not in RUNTIME_SOURCES:
        raise ToolchainError(f"--api {request.api}: the {base_api} runtime is not part of this version yet")
    cat = catalogue_mod.load("cuda")
    toolchain = make_toolchain(request.arch, cat.arch(request.arch).gencode)

    work_dir = (request.build_dir / f"cuda-{request.arch}-{toolchain.fingerprint()}").resolve()
    gen_dir, obj_dir = work_dir / "gen", work_dir / "obj"
    instance_sources, dispatch_source = render_all(base_api, request.arch, selection.specs, gen_dir)
    digest = _digest([s.name for s in selection.specs])
    out_dir = work_dir / "out" / f"{request.api}-{digest}"

    compiles = [Compile(src, obj_dir / "instances" / (src.stem + ".o"), device=True) for src in instance_sources]
    compiles.append(Compile(dispatch_source, obj_dir / (dispatch_source.stem + ".o"), device=True))
    for rel in RUNTIME_SOURCES[base_api]:
        compiles.append(Compile(CSRC / rel, obj_dir / "runtime" / (Path(rel).stem + ".o"), device=False))
    executables = []
    if request.benchmark:
        bench_src = CSRC / BENCHMARKS[base_api]
        bench_obj = obj_dir / "benchmark" / (bench_src.stem + ".o")
        compiles.append(Compile(bench_src, bench_obj, device=False))
        executables.append((out_dir / bench_src.stem, [bench_obj]))
    library = out_dir / library_name(request.api)
    ninja = NinjaFile(toolchain.path, toolchain.compile_flags(), toolchain.host_flags(), compiles, library, executables)
    ninja_file = work_dir / f"{request.api}-{digest}.ninja"
    write_if_changed(ninja_file, ninja.text())

    jobs = request.jobs or default_jobs()
    log(f"[mhakit] {request.api}: {len(selection.specs)} instances for {request.arch} "
        f"(profile {request.profile}{', filter ' + request.name_filter if request.name_filter else ''}), "
        f"nvcc {toolchain.version}, -j{jobs}")
    _run_ninja(ninja_file, work_dir, jobs, request.verbose)

    installed = []
    outputs = [library] + [exe for exe, _ in executables]
    for out in outputs:
        if _install(out, request.install_dir.resolve()):
            installed.append(request.install_dir / out.name)
    seconds = time.monotonic() - start
    names = ", ".join(o.name for o in outputs)
    log(f"[mhakit] {names} -> {request.install_dir.resolve()} "
        f"({'updated' if installed else 'up to date'}, {seconds:.1f} s)")
    return BuildResult(library, [exe for exe, _ in executables], selection.specs, seconds, work_dir, installed)
