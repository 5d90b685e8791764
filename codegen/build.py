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
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import catalogue as catalogue_mod
from . import locks
from .ninja import Compile, Executable, NinjaFile
from .profiles import APIS, Selection, SelectionError, select
from .render import BUILD_NAME_ROOT
from .render import _environment as render_environment
from .render import render_all, render_dispatch, render_dispatch_file, render_instance, write_if_changed
from .spec import KernelSpec
from .toolchain import CSRC, Toolchain, ToolchainError, backend_of_arch, make_toolchain

# Hand-written runtime sources linked into each API's library.
_SHARED_RUNTIME = ["runtime/api_common.cpp", "runtime/error.cpp", "runtime/device.cpp"]
RUNTIME_SOURCES = {
    "fwd": ["runtime/mha_fwd.cpp", "runtime/mha_fwd_splitkv.cpp", *_SHARED_RUNTIME],
    "bwd": ["runtime/mha_bwd.cpp", *_SHARED_RUNTIME],
}
# The libraries export the C ABI and nothing else: without this, inline functions of the C++ standard library that
# its headers mark visible would be exported too.
EXPORT_MAP_NAME = "exports.map"
EXPORT_MAP = "{\n  global: mhakit_*;\n  local: *;\n};\n"
BENCHMARKS = {"fwd": "benchmark/benchmark_mha_fwd.cpp", "bwd": "benchmark/benchmark_mha_bwd.cpp"}
# Libraries a benchmark links besides its own API's: the backward benchmark runs our forward for O and LSE.
BENCHMARK_NEEDS = {"fwd": [], "bwd": ["fwd"]}


class BuildError(RuntimeError):
    """ninja or the compiler failed; the compiler's own output was already shown."""


@dataclass
class BuildRequest:
    api: str = "fwd"
    arch: str = field(default_factory=lambda: catalogue_mod.load("cuda").default_arch)
    profile: str = "default"
    name_filter: str | None = None
    build_dir: Path = Path("build")
    install_dir: Path = Path(".")
    jobs: int | None = None
    benchmark: bool = False
    verbose: bool = False
    # The Python JIT's additions (compile.py leaves them at their defaults):
    specs: list[KernelSpec] | None = None  # build exactly these instances (profile and name_filter are then unused)
    toolchain: Toolchain | None = None     # a toolchain made by the caller (e.g. with a memoised version probe)
    capture_output: bool = False           # keep ninja's output off the terminal; a failure's BuildError carries it
    # The JIT's prebuild: the instance tables of these further selections are compiled in the same ninja run (not
    # linked), so that building each of those libraries afterwards only links.
    also_dispatch: list[list[KernelSpec]] = field(default_factory=list)


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
    if request.specs is not None:
        if not request.specs:
            raise SelectionError("an explicit instance list must name at least one instance")
        return Selection(sorted(request.specs, key=lambda s: s.name))
    return select(request.api, request.arch, request.profile, request.name_filter)


def _digest(texts: list[str]) -> str:
    return hashlib.sha256("\n".join(texts).encode()).hexdigest()[:10]


def default_jobs() -> int:
    return max(1, os.cpu_count() or 1)


def _stop_with_parent():
    """A preexec_fn for ninja: the kernel sends it SIGTERM when the thread that started it dies, even by SIGKILL
    (Linux: PR_SET_PDEATHSIG); None where prctl is unavailable."""
    import ctypes
    import signal
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def arm():
        prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the line above
            os.kill(os.getpid(), signal.SIGTERM)
    return arm


def _ninja(cmd: list[str], env: dict, capture: bool) -> tuple[int, str]:
    """Runs ninja; returns (exit status, its output when captured). ninja runs each compiler in a process group of its
    own, and stops them when it gets SIGTERM or SIGINT, but not when it is killed. So ninja gets a session of its
    own (a kill of our process group, e.g. `kill -9 -<pgid>`, does not reach it), is sent SIGTERM when we die, and is
    asked to stop, not killed, when we are interrupted: no compiler outlives the build that started it."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE if capture else None,
                            stderr=subprocess.STDOUT if capture else None, text=True, errors="replace",
                            start_new_session=True, preexec_fn=_stop_with_parent())
    try:
        out, _ = proc.communicate()
    except BaseException:  # KeyboardInterrupt, ...
        proc.terminate()
        proc.wait()
        raise
    return proc.returncode, out or ""


def _run_ninja(ninja_file: Path, work_dir: Path, jobs: int, verbose: bool, capture: bool = False) -> None:
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
    status, out = _ninja(cmd, env, capture)
    if status != 0 and capture:
        tail = "\n".join(out.splitlines()[-80:])
        raise BuildError(f"the build failed; build files are in {work_dir} (the compiler calls it "
                         f"{BUILD_NAME_ROOT}); compiler output:\n{tail}")
    if status != 0:
        raise BuildError(f"the build failed (see the compiler output above); build files are in {work_dir} (the "
                         f"compiler calls it {BUILD_NAME_ROOT})")


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


def _installed_library(api: str, install_dir: Path) -> Path:
    """A library another output links against, already installed in install_dir (built by an earlier call)."""
    path = (install_dir / library_name(api)).resolve()
    if not path.is_file():
        raise ToolchainError(f"the benchmark also links {path.name}: build it first in the same directory "
                             f"(compile.py --api {api}; build_mha.sh bwd does both)")
    return path


def build(request: BuildRequest, log=print) -> BuildResult:
    start = time.monotonic()
    selection = plan_selection(request)
    base_api = APIS[request.api][0]
    if base_api not in RUNTIME_SOURCES:
        raise ToolchainError(f"--api {request.api}: the {base_api} runtime is not part of this version yet")
    backend = backend_of_arch(request.arch)
    cat = catalogue_mod.load(backend)
    toolchain = request.toolchain or make_toolchain(request.arch, cat.arch(request.arch).target)

    work_dir = (request.build_dir / f"{backend}-{request.arch}-{toolchain.fingerprint()}").resolve()
    # One build at a time per build directory: two ninja runs sharing one .ninja_log / .ninja_deps (compile.py fwd
    # and bwd started together, or two jobs in one checkout) corrupt them and every later run recompiles everything.
    with locks.exclusive(work_dir / "build.lock",
                         lambda: log(f"[mhakit] waiting for another build in {work_dir} to finish")):
        return _build_in(request, selection, toolchain, work_dir, log, start)


def _build_in(request: BuildRequest, selection: Selection, toolchain: Toolchain, work_dir: Path, log,
              start: float) -> BuildResult:
    """build() for one work directory, holding its lock: render, write the ninja file, run ninja, install."""
    base_api = APIS[request.api][0]
    gen_dir, obj_dir = work_dir / "gen", work_dir / "obj"
    instance_sources, dispatch_source = render_all(base_api, request.arch, selection.specs, gen_dir,
                                                   toolchain.source_suffix)
    digest = _digest([s.name for s in selection.specs])
    out_dir = work_dir / "out" / f"{request.api}-{digest}"

    # Generated sources are named relative to the work directory (ninja runs there): nvcc records the name it is
    # given in the library, and a relative one keeps two builds of the same selection byte-identical.
    compiles = [Compile(src.relative_to(work_dir), obj_dir / "instances" / (src.stem + ".o"), device=True)
                for src in instance_sources]
    # The table holds host function pointers only: nvcc compiles it like the instances; clang's device pass must not
    # see it (it would try to place the table on the GPU), so HIP compiles it host-only.
    compiles.append(Compile(dispatch_source.relative_to(work_dir), obj_dir / (dispatch_source.stem + ".o"),
                            device=toolchain.backend == "cuda"))
    for rel in RUNTIME_SOURCES[base_api]:
        compiles.append(Compile(CSRC / rel, obj_dir / "runtime" / (Path(rel).stem + ".o"), device=False))
    executables, unlinked = [], []
    for specs in request.also_dispatch:
        source = render_dispatch_file(base_api, request.arch, sorted(specs, key=lambda s: s.name), gen_dir,
                                      toolchain.source_suffix)
        obj = obj_dir / (source.stem + ".o")
        if all(c.obj != obj for c in compiles):
            compiles.append(Compile(source.relative_to(work_dir), obj, device=toolchain.backend == "cuda"))
            unlinked.append(obj)
    if request.benchmark:
        bench_src = CSRC / BENCHMARKS[base_api]
        bench_obj = obj_dir / "benchmark" / (bench_src.stem + ".o")
        compiles.append(Compile(bench_src, bench_obj, device=False))
        if toolchain.can_link_executables:
            executables.append(Executable(out_dir / bench_src.stem, [bench_obj],
                                          [_installed_library(api, request.install_dir)
                                           for api in BENCHMARK_NEEDS[base_api]]))
        else:  # no device runtime library to link an executable against: compile it, and say so
            unlinked.append(bench_obj)
            log(f"[mhakit] {bench_src.stem}: compiled, not linked (no HIP runtime library under the ROCm root; "
                "a ROCm install provides libamdhip64.so)")
    library = out_dir / library_name(request.api)
    write_if_changed(work_dir / EXPORT_MAP_NAME, EXPORT_MAP)
    ninja = NinjaFile(toolchain.path, toolchain.compile_flags(), toolchain.host_flags(), compiles, library, executables,
                      export_map=Path(EXPORT_MAP_NAME), label=toolchain.label, unlinked=unlinked,
                      **toolchain.ninja_rules())
    ninja_file = work_dir / f"{request.api}-{digest}.ninja"
    write_if_changed(ninja_file, ninja.text())

    jobs = request.jobs or default_jobs()
    log(f"[mhakit] {request.api}: {len(selection.specs)} instances for {request.arch} "
        f"(profile {request.profile}{', filter ' + request.name_filter if request.name_filter else ''}), "
        f"{toolchain.label} {toolchain.version}, -j{jobs}")
    _run_ninja(ninja_file, work_dir, jobs, request.verbose, request.capture_output)

    installed = []
    outputs = [library] + [exe.output for exe in executables]
    for out in outputs:
        if _install(out, request.install_dir.resolve()):
            installed.append(request.install_dir / out.name)
    seconds = time.monotonic() - start
    names = ", ".join(o.name for o in outputs)
    log(f"[mhakit] {names} -> {request.install_dir.resolve()} "
        f"({'updated' if installed else 'up to date'}, {seconds:.1f} s)")
    return BuildResult(library, [exe.output for exe in executables], selection.specs, seconds, work_dir, installed)


# ----------------------------------------------------------------------------------------------------------------
# What a build is made of, for content-addressed caches (the Python JIT keys its cache with this)
# ----------------------------------------------------------------------------------------------------------------

_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)


def _sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def csrc_closure(texts: list[tuple[Path | None, str]], csrc: Path = CSRC) -> dict[str, str]:
    """sha256 of every file under `csrc` that the given sources include, transitively ("..." includes, resolved as
    the compiler does: beside the including file, then csrc/ and csrc/include/). Keys are paths relative to csrc.
    Includes found outside csrc (CUTLASS, CUDA) are not listed: their identity is the toolchain's (versions)."""
    csrc = Path(csrc).resolve()
    search = [csrc, csrc / "include"]
    seen: dict[str, str] = {}
    pending = list(texts)
    while pending:
        where, text = pending.pop()
        for name in _INCLUDE.findall(text):
            dirs = ([where.parent] if where is not None else []) + search
            for d in dirs:
                cand = (d / name).resolve()
                if cand.is_file() and cand.is_relative_to(csrc):
                    rel = cand.relative_to(csrc).as_posix()
                    if rel not in seen:
                        body = cand.read_text(errors="replace")
                        seen[rel] = _sha256_text(body)
                        pending.append((cand, body))
                    break
    return dict(sorted(seen.items()))


def build_inputs(request: BuildRequest, toolchain: Toolchain | None, csrc: Path | None = None) -> dict:
    """Everything that determines the library `build(request)` produces, as plain data without paths or times:
    the instances, the sha256 of every rendered source, of the runtime sources and of every csrc file they include,
    and under "toolchain" the toolchain's description (compiler version, flags, arch, CUTLASS version, ninja rules;
    None when no toolchain is given). Renders in memory; writes and runs nothing. `csrc` overrides where the C++
    sources are read from (tests)."""
    csrc = Path(csrc) if csrc is not None else CSRC
    selection = plan_selection(request)
    base_api = APIS[request.api][0]
    if base_api not in RUNTIME_SOURCES:
        raise ToolchainError(f"--api {request.api}: the {base_api} runtime is not part of this version yet")
    env = render_environment()
    suffix = toolchain.source_suffix if toolchain is not None else ".cu"
    rendered = {f"instances/{spec.name}{suffix}": render_instance(spec, env) for spec in selection.specs}
    rendered[f"dispatch{suffix}"] = render_dispatch(base_api, request.arch, selection.specs, env)
    runtime = {rel: (csrc / rel).read_text(errors="replace") for rel in RUNTIME_SOURCES[base_api]}
    texts = [(None, t) for t in rendered.values()] + [(csrc / rel, t) for rel, t in runtime.items()]
    headers = csrc_closure(texts, csrc)
    headers.update({rel: _sha256_text(t) for rel, t in runtime.items()})
    described = None
    if toolchain is not None:
        rules = NinjaFile(f"<{toolchain.label}>", toolchain.portable(toolchain.compile_flags()),
                          toolchain.portable(toolchain.host_flags()), [], Path(library_name(request.api)), [],
                          export_map=Path(EXPORT_MAP_NAME), label=toolchain.label, **toolchain.ninja_rules()).text()
        described = dict(toolchain.describe(), rules=_sha256_text(rules), exports=_sha256_text(EXPORT_MAP))
    return {
        "api": request.api,
        "arch": request.arch,
        "instances": [spec.name for spec in selection.specs],
        "rendered": {name: _sha256_text(text) for name, text in sorted(rendered.items())},
        "csrc": dict(sorted(headers.items())),
        "toolchain": described,
    }
