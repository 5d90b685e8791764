"""Compilers as objects: where the compiler is, its version, its flags, and the arch it targets.

The catalogue and spec layers never see a compiler flag; everything compiler-specific lives here, so the ROCm
backend arrives as another Toolchain (hipcc, --offload-arch=gfx...), not as a rewrite."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from . import catalogue as catalogue_mod
from .catalogue import backend_of_arch  # noqa: F401  (re-exported: compile.py and the JIT ask the toolchain)

REPO_ROOT = Path(__file__).resolve().parent.parent
CSRC = REPO_ROOT / "csrc"
CUTLASS_PIN = "nvidia-cutlass==4.2.0.0"


class ToolchainError(RuntimeError):
    """The build cannot start: a missing compiler, an unknown arch, missing headers. One line, says what to do."""


# Which arch a compute capability gets, and the default target, are the catalogue's arch records (codegen/catalogue/
# cuda.toml: compute_capability, gencode, arch_specific, default_arch); this module only asks the GPU.


def detect_arch() -> str:
    """The arch of GPU 0 when one is visible (NVIDIA through nvidia-smi and the CUDA catalogue's compute
    capabilities, AMD through ROCm's rocm_agent_enumerator), else the CUDA catalogue's default_arch."""
    cat = catalogue_mod.load("cuda")
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20).stdout.split()
        except (OSError, subprocess.TimeoutExpired):
            out = []
        match = re.fullmatch(r"(\d+)\.(\d+)", out[0]) if out else None
        arch = cat.arch_for_compute_capability(int(match.group(1)), int(match.group(2))) if match else None
        if arch is not None:
            return arch.name
    root = rocm_root()
    enumerator = shutil.which("rocm_agent_enumerator") or (
        str(root / "bin" / "rocm_agent_enumerator") if root and (root / "bin" / "rocm_agent_enumerator").is_file() else None)
    if enumerator:
        try:
            agents = subprocess.run([enumerator], capture_output=True, text=True, timeout=20).stdout.split()
        except (OSError, subprocess.TimeoutExpired):
            agents = []
        gpus = [a for a in agents if a.startswith("gfx") and a != "gfx000"]  # gfx000 is the host CPU agent
        if gpus:
            return gpus[0]
    return cat.default_arch


def find_cutlass() -> Path:
    """The CUTLASS source tree shipped inside the nvidia-cutlass wheel (headers, tools/util, examples).
    MHAKIT_CUTLASS_DIR overrides it. The module is located without importing it: its Python package pulls in
    dependencies that header-only use does not need."""
    override = os.environ.get("MHAKIT_CUTLASS_DIR")
    candidates = [Path(override)] if override else []
    spec = importlib.util.find_spec("cutlass_library")
    if spec and spec.submodule_search_locations:
        candidates += [Path(p) / "source" for p in spec.submodule_search_locations]
    for root in candidates:
        if (root / "include" / "cute" / "tensor.hpp").is_file():
            return root
    raise ToolchainError(f"CUTLASS/CuTe headers not found: `python3 -m pip install {CUTLASS_PIN}` "
                         "(or set MHAKIT_CUTLASS_DIR to a CUTLASS source tree)")


def portable_flags(flags: list[str], roots: dict[str, Path | None]) -> list[str]:
    """flags with each root directory (longest first) replaced by its symbolic name; None roots are skipped."""
    ordered = sorted(((str(path), token) for token, path in roots.items() if path is not None), key=lambda r: -len(r[0]))
    out = []
    for flag in flags:
        for path, token in ordered:
            flag = flag.replace(path, token)
        out.append(flag)
    return out


@dataclass
class Nvcc:
    """nvcc for one target arch. Flags are the same for every translation unit of a build."""

    arch: str
    gencode: str
    path: str = field(default="")
    version: str = field(default="")
    cutlass: Path | None = None

    backend = "cuda"
    label = "nvcc"
    source_suffix = ".cu"
    can_link_executables = True

    def ninja_rules(self) -> dict:
        """The rule commands for codegen.ninja.NinjaFile (its defaults are nvcc's)."""
        return {}

    @classmethod
    def create(cls, arch: str, gencode: str, need_cutlass: bool = True) -> "Nvcc":
        path = locate_nvcc()
        if not path:
            raise ToolchainError("nvcc not found: install the CUDA toolkit, put nvcc on PATH or set CUDA_HOME / NVCC")
        return cls(arch=arch, gencode=gencode, path=path, version=probe_nvcc_version(path),
                   cutlass=find_cutlass() if need_cutlass else None)

    @property
    def cuda_home(self) -> Path:
        return Path(os.path.realpath(self.path)).parent.parent

    def include_dirs(self) -> list[Path]:
        dirs = [CSRC, CSRC / "include"]
        if self.cutlass is not None:
            dirs += [self.cutlass / "include", self.cutlass / "tools" / "util" / "include", self.cutlass / "examples"]
        cccl = self.cuda_home / "include" / "cccl"
        if cccl.is_dir():  # CUDA >= 13 moved the CCCL headers here
            dirs.append(cccl)
        return dirs

    def compile_flags(self) -> list[str]:
        flags = ["-std=c++17", "-O3", "-DNDEBUG", "-Xcompiler=-fPIC", "-Xcompiler=-fvisibility=hidden",
                 "--expt-relaxed-constexpr", "--expt-extended-lambda", "-lineinfo",
                 f"-gencode={self.gencode}"]
        return flags + [f"-I{d}" for d in self.include_dirs()]

    def host_flags(self) -> list[str]:
        """Host-only C++ (runtime, benchmark): no device code generation needed."""
        # -O3: the host reference in the benchmark runs about twice as fast as at -O2.
        return ["-std=c++17", "-O3", "-DNDEBUG", "-Xcompiler=-fPIC", "-Xcompiler=-pthread",
                "-Xcompiler=-fvisibility=hidden"] + [f"-I{d}" for d in (CSRC, CSRC / "include")]

    def fingerprint(self) -> str:
        """What makes objects incompatible: compiler identity and version, flags, arch."""
        text = "\n".join([self.path, self.version, self.arch, *self.compile_flags()])
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def portable(self, flags: list[str]) -> list[str]:
        """flags with machine-specific directories written as symbolic roots (<csrc>, <cutlass>, <cuda>), so that a
        description of the build does not depend on where the repository, the wheel or the toolkit live."""
        return portable_flags(flags, {"<csrc>": CSRC, "<cuda>": self.cuda_home, "<cutlass>": self.cutlass})

    def describe(self) -> dict:
        """What this toolchain contributes to a build's identity, free of paths and times: compiler and version,
        target, the flags (include directories as symbolic roots) and the version of the CUTLASS headers.
        The Python JIT keys its cache with it (together with the sources: codegen.build.build_inputs)."""
        return {
            "compiler": "nvcc",
            "version": self.version,
            "arch": self.arch,
            "gencode": self.gencode,
            "device_flags": self.portable(self.compile_flags()),
            "host_flags": self.portable(self.host_flags()),
            "cutlass": cutlass_version(self.cutlass) if self.cutlass is not None else None,
        }


def locate_nvcc() -> str:
    """Where nvcc is: $NVCC, else $CUDA_HOME/bin/nvcc (or $CUDA_PATH), else the first nvcc on PATH; "" if none.
    Runs nothing."""
    path = os.environ.get("NVCC") or ""
    if not path:
        cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
        if cuda_home and (Path(cuda_home) / "bin" / "nvcc").is_file():
            path = str(Path(cuda_home) / "bin" / "nvcc")
        else:
            path = shutil.which("nvcc") or ""
    return path


def version_text(path: str, what: str) -> str:
    """What `<path> --version` prints; ToolchainError naming `what` when it does not run."""
    try:
        return subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60).stdout
    except OSError as exc:
        raise ToolchainError(f"{what} at {path} does not run: {exc}") from exc


def probe_nvcc_version(path: str) -> str:
    """The full version of the nvcc at `path` (e.g. "13.0.88"), by running `nvcc --version`."""
    out = version_text(path, "nvcc")
    match = re.search(r"release (\d+\.\d+), V([\d.]+)", out)
    if not match:
        raise ToolchainError(f"cannot read the version of nvcc at {path}")
    return match.group(2)


def cutlass_version(root: Path) -> str:
    """The version of a CUTLASS source tree, from include/cutlass/version.h (e.g. "4.2.0"); "unknown" if unreadable."""
    try:
        text = (Path(root) / "include" / "cutlass" / "version.h").read_text(errors="replace")
    except OSError:
        return "unknown"
    parts = [re.search(rf"#define\s+CUTLASS_{key}\s+(\d+)", text) for key in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(m.group(1) for m in parts) if all(parts) else "unknown"


def arch_for_compute_capability(major: int, minor: int) -> str:
    """The arch mhakit builds for a device of compute capability major.minor (the catalogue's arch records: the arch
    listing it, else the one listing major.0, since SASS for sm_X0 runs on every sm_Xy)."""
    cat = catalogue_mod.load("cuda")
    arch = cat.arch_for_compute_capability(major, minor)
    if arch is None:
        raise ToolchainError(f"compute capability {major}.{minor} is not supported: mhakit builds for "
                             f"{', '.join(sorted(cat.arches))}")
    return arch.name


def arch_for_gcn_arch_name(gcn_arch_name: str) -> str:
    """The arch mhakit builds for an AMD device whose HIP gcnArchName is `gcn_arch_name` (a target id such as
    gfx942:sramecc+:xnack-: its processor, before the features, names the ROCm catalogue's arch; code objects are
    built for that processor, which runs them with either feature setting)."""
    cat = catalogue_mod.load("rocm")
    processor = gcn_arch_name.split(":", 1)[0].strip()
    if processor not in cat.arches:
        raise ToolchainError(f"AMD GPU {gcn_arch_name or '(no name)'} is not supported: mhakit builds for "
                             f"{', '.join(sorted(cat.arches))}")
    return processor


def require_available_backend(arch: str) -> str:
    """The backend of `arch` (cuda or rocm), or one clear line saying the arch is unknown."""
    try:
        return backend_of_arch(arch)
    except ValueError as exc:
        raise ToolchainError(str(exc)) from None


# ---------------------------------------------------------------------------------------------------------------
# ROCm: hipcc from a ROCm install, or an upstream clang with HIP support and a ROCm root (headers, device libraries)
# ---------------------------------------------------------------------------------------------------------------

CK_DIR_ENV = "MHAKIT_CK_DIR"
CK_SUBMODULE = REPO_ROOT / "3rdparty" / "composable_kernel"
# Upstream clang releases that compile HIP for gfx90a/gfx942 (19+) and gfx950 (20+), newest first.
_CLANG_VERSIONS = (22, 21, 20, 19)

# CK-tile's own compile flags (example/ck_tile/01_fmha/CMakeLists.txt and CK's toolchain settings). Upstream clang gets
# them less -amdgpu-coerce-illegal-types (an AMD-fork option) and -amdgpu-function-calls=false (with
# -amdgpu-early-inline-all it makes upstream clang run for tens of minutes per instance).
CK_FLAGS = ["-fno-offload-uniform-block", "-fgpu-flush-denormals-to-zero",
            "-mllvm", "--lsr-drop-solution=1", "-mllvm", "-enable-post-misched=0",
            "-mllvm", "-amdgpu-early-inline-all=true", "-Wno-undefined-func-template", "-Wno-float-equal"]
CK_FLAGS_AMD_CLANG = ["-mllvm", "-amdgpu-function-calls=false", "-mllvm", "-amdgpu-coerce-illegal-types=1"]


# clang names each object's compilation unit (a __hip_cuid_<id> symbol) by a hash of its whole command line, output
# path included, so the same sources built in another directory would give other bytes. Each object is given its own
# file name as the id instead (unique within a library: instance names, runtime source stems and the dispatch
# table's digest name are distinct identifiers). A ninja command line: $$ is the shell's $.
CUID_FROM_OBJECT = "-cuid=$$(basename $out .o)"


def find_ck() -> Path:
    """The composable_kernel source tree: $MHAKIT_CK_DIR, else 3rdparty/composable_kernel beside this repository."""
    override = os.environ.get(CK_DIR_ENV)
    root = Path(override) if override else CK_SUBMODULE
    if (root / "include" / "ck_tile" / "core.hpp").is_file() and \
            (root / "example" / "ck_tile" / "01_fmha" / "fmha_fwd.hpp").is_file():
        return root.resolve()
    where = f"{CK_DIR_ENV}={override}" if override else str(CK_SUBMODULE)
    raise ToolchainError(f"composable_kernel (CK-tile) not found at {where}: set {CK_DIR_ENV} to a composable_kernel "
                         "checkout (with include/ck_tile and example/ck_tile/01_fmha), or put one in "
                         "3rdparty/composable_kernel")


def rocm_root() -> Path | None:
    """$ROCM_PATH (or $HIP_PATH), else /opt/rocm when it exists."""
    for candidate in (os.environ.get("ROCM_PATH"), os.environ.get("HIP_PATH"), "/opt/rocm"):
        if candidate and Path(candidate).is_dir():
            return Path(candidate).resolve()
    return None


def locate_hip_compiler() -> tuple[str, str, Path | None]:
    """(compiler path, "hipcc" | "clang", ROCm root) or ("", "", root) when there is none. Runs nothing.
    $HIPCC, else <ROCm root>/bin/hipcc, else a clang++ with HIP support ($MHAKIT_HIP_CLANG, or clang++-22 ... -19, or
    clang++ on PATH) together with a ROCm root that holds the HIP headers."""
    root = rocm_root()
    if os.environ.get("HIPCC"):
        return os.environ["HIPCC"], "hipcc", root
    if root is not None and (root / "bin" / "hipcc").is_file():
        return str(root / "bin" / "hipcc"), "hipcc", root
    clang = os.environ.get("MHAKIT_HIP_CLANG") or next(
        (found for v in _CLANG_VERSIONS if (found := shutil.which(f"clang++-{v}"))), None) or shutil.which("clang++")
    if clang and root is not None and (root / "include" / "hip" / "hip_runtime.h").is_file():
        return clang, "clang", root
    return "", "", root


def probe_clang_version(path: str) -> str:
    """The clang version behind a HIP compiler (e.g. "22.1.8"; hipcc prints its clang's), by running --version."""
    out = version_text(path, "the HIP compiler")
    match = re.search(r"clang version ([\w.+-]+)", out)
    if not match:
        raise ToolchainError(f"cannot read the clang version of the HIP compiler at {path}")
    hip = re.search(r"HIP version: ([\w.-]+)", out)
    return match.group(1) + (f" (HIP {hip.group(1)})" if hip else "")


@dataclass
class Hipcc:
    """A HIP compiler for one gfx target: hipcc from ROCm, or upstream clang with --rocm-path. CK-tile's headers come
    from `ck`; kernels are built for `offload_arch` (one code object per target: --offload-arch)."""

    arch: str
    offload_arch: str
    path: str = field(default="")
    version: str = field(default="")
    kind: str = "clang"            # "hipcc" (ROCm's driver, AMD's clang) or "clang" (upstream)
    rocm: Path | None = None       # --rocm-path for upstream clang (headers and device libraries)
    ck: Path | None = None

    backend = "rocm"
    source_suffix = ".cpp"

    @classmethod
    def create(cls, arch: str, offload_arch: str) -> "Hipcc":
        path, kind, root = locate_hip_compiler()
        if not path:
            raise ToolchainError("no HIP compiler found: install ROCm (hipcc under ROCM_PATH, default /opt/rocm), or "
                                 "set ROCM_PATH to a ROCm root (include/hip, amdgcn/bitcode) and put a clang++ with "
                                 "HIP support on PATH (bash tools/rocm_sdk.sh prepares both from Debian and PyPI)")
        return cls(arch=arch, offload_arch=offload_arch, path=path, version=probe_clang_version(path), kind=kind,
                   rocm=root, ck=find_ck())

    @property
    def label(self) -> str:
        return self.kind

    @property
    def hip_runtime_library(self) -> Path | None:
        """libamdhip64.so of the ROCm root, when there is one to link against (ROCm installs have it; a root made
        of headers only does not, and libraries then resolve the HIP runtime where they are loaded)."""
        if self.rocm is not None:
            for lib in ("lib", "lib64"):
                if (self.rocm / lib / "libamdhip64.so").exists():
                    return self.rocm / lib / "libamdhip64.so"
        return None

    @property
    def can_link_executables(self) -> bool:
        return self.kind == "hipcc" or self.hip_runtime_library is not None

    def _base_flags(self) -> list[str]:
        flags = ["-x", "hip", "-std=c++20", "-O3", "-DNDEBUG", "-fPIC", "-fvisibility=hidden", "-DMHAKIT_HIP=1"]
        if self.kind == "clang" and self.rocm is not None:
            # --rocm-path puts its include directory after /usr/include: name it first, or a distribution's
            # /usr/include/hip would shadow the intended headers.
            flags += [f"--rocm-path={self.rocm}", "-isystem", str(self.rocm / "include")]
        return flags

    def include_dirs(self) -> list[Path]:
        dirs = [CSRC, CSRC / "include"]
        if self.ck is not None:
            dirs += [self.ck / "include", self.ck / "example" / "ck_tile" / "01_fmha"]
        return dirs

    def compile_flags(self) -> list[str]:
        flags = self._base_flags() + [f"--offload-arch={self.offload_arch}"] + CK_FLAGS
        if self.kind == "hipcc":
            flags += CK_FLAGS_AMD_CLANG
        return flags + [f"-I{d}" for d in self.include_dirs()]

    def host_flags(self) -> list[str]:
        """Host-only C++ (runtime, benchmark): HIP headers, no device code."""
        return self._base_flags() + ["--offload-host-only", "-pthread"] + [f"-I{d}" for d in (CSRC, CSRC / "include")]

    def _runtime_link(self) -> str:
        lib = self.hip_runtime_library
        return f"-L{shlex.quote(str(lib.parent))} -lamdhip64" if lib is not None else ""

    def ninja_rules(self) -> dict:
        """clang's rule commands for codegen.ninja.NinjaFile: the device compile needs no renaming (clang's depfile
        names the real files; the #line of each generated source names it in messages), and the shared library, as
        nvcc's, keeps no local symbols and exports the C ABI only ($exports: the version script)."""
        runtime = self._runtime_link()
        return {
            "compile_device": f"$device_flags {CUID_FROM_OBJECT} -MD -MF $out.d -c $in -o $out",
            "compile_host": f"$host_flags {CUID_FROM_OBJECT} -MD -MF $out.d -c $in -o $out",
            "link_shared": f"-shared $in -o $out -Wl,-soname,$soname -Wl,--discard-all $exports {runtime}".rstrip(),
            "link_exe": f"$in -o $out -pthread $libs {runtime} -Wl,-rpath,'$$ORIGIN'".replace("  ", " "),
        }

    def fingerprint(self) -> str:
        text = "\n".join([self.path, self.version, self.arch, *self.compile_flags()])
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def portable(self, flags: list[str]) -> list[str]:
        """flags with machine-specific directories written as symbolic roots (<csrc>, <rocm>, <ck>)."""
        return portable_flags(flags, {"<csrc>": CSRC, "<rocm>": self.rocm, "<ck>": self.ck})

    def describe(self) -> dict:
        return {
            "compiler": self.kind,
            "version": self.version,
            "arch": self.arch,
            "offload_arch": self.offload_arch,
            "device_flags": self.portable(self.compile_flags()),
            "host_flags": self.portable(self.host_flags()),
            "ck": ck_version(self.ck) if self.ck is not None else None,
        }


def ck_version(root: Path) -> str:
    """A CK tree's identity: its version header when it has one, else a hash of its FMHA headers' names and sizes."""
    header = Path(root) / "include" / "ck" / "version.h"
    if header.is_file():
        text = header.read_text(errors="replace")
        parts = [re.search(rf"#define\s+CK_VERSION_{key}\s+(\d+)", text) for key in ("MAJOR", "MINOR", "PATCH")]
        if all(parts):
            return ".".join(m.group(1) for m in parts)
    h = hashlib.sha256()
    for f in sorted((Path(root) / "include" / "ck_tile" / "ops" / "fmha").rglob("*.hpp")):
        h.update(f"{f.relative_to(root)}:{f.stat().st_size}\n".encode())
    return "tree-" + h.hexdigest()[:12]


Toolchain = Nvcc | Hipcc


def make_toolchain(arch: str, target: str, need_cutlass: bool = True) -> Toolchain:
    """The toolchain for `arch`: nvcc with -gencode `target`, or a HIP compiler with --offload-arch `target`."""
    if require_available_backend(arch) == "rocm":
        return Hipcc.create(arch, target)
    return Nvcc.create(arch, target, need_cutlass)
