"""Compilers as objects: where the compiler is, its version, its flags, and the arch it targets.

The catalogue and spec layers never see a compiler flag; everything compiler-specific lives here, so the ROCm
backend arrives as another Toolchain (hipcc, --offload-arch=gfx...), not as a rewrite."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from . import catalogue as catalogue_mod

REPO_ROOT = Path(__file__).resolve().parent.parent
CSRC = REPO_ROOT / "csrc"
CUTLASS_PIN = "nvidia-cutlass==4.2.0.0"


class ToolchainError(RuntimeError):
    """The build cannot start: a missing compiler, an unknown arch, missing headers. One line, says what to do."""


# Which arch a compute capability gets, and the default target, are the catalogue's arch records (codegen/catalogue/
# cuda.toml: compute_capability, gencode, arch_specific, default_arch); this module only asks the GPU.


def detect_arch() -> str:
    """The arch of GPU 0 when one is visible, else the catalogue's default_arch."""
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
    return cat.default_arch


def backend_of_arch(arch: str) -> str:
    if arch.startswith("gfx"):
        return "rocm"
    if re.fullmatch(r"sm_\d+a?", arch):
        return "cuda"
    raise ToolchainError(f"unknown arch '{arch}': use an NVIDIA target such as sm_90a or sm_80 "
                         "(or an AMD gfx target once the ROCm backend exists)")


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


@dataclass
class Nvcc:
    """nvcc for one target arch. Flags are the same for every translation unit of a build."""

    arch: str
    gencode: str
    path: str = field(default="")
    version: str = field(default="")
    cutlass: Path | None = None

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

    def _path_roots(self) -> list[tuple[str, str]]:
        roots = [(str(CSRC), "<csrc>"), (str(self.cuda_home), "<cuda>")]
        if self.cutlass is not None:
            roots.append((str(self.cutlass), "<cutlass>"))
        return sorted(roots, key=lambda r: -len(r[0]))  # longest prefix first

    def portable(self, flags: list[str]) -> list[str]:
        """flags with machine-specific directories written as symbolic roots (<csrc>, <cutlass>, <cuda>), so that a
        description of the build does not depend on where the repository, the wheel or the toolkit live."""
        roots = self._path_roots()
        out = []
        for flag in flags:
            for path, token in roots:
                flag = flag.replace(path, token)
            out.append(flag)
        return out

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


def probe_nvcc_version(path: str) -> str:
    """The full version of the nvcc at `path` (e.g. "13.0.88"), by running `nvcc --version`."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60).stdout
    except OSError as exc:
        raise ToolchainError(f"nvcc at {path} does not run: {exc}") from exc
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


def require_available_backend(arch: str) -> str:
    """The backend of `arch`, or one clear line saying why it cannot be built by this version."""
    backend = backend_of_arch(arch)
    if backend == "rocm":
        raise ToolchainError(f"--arch {arch}: the ROCm backend (hipcc, CK-tile) is not built yet; "
                             "this version builds NVIDIA targets only (e.g. --arch sm_90a)")
    return backend


def make_toolchain(arch: str, gencode: str, need_cutlass: bool = True) -> Nvcc:
    require_available_backend(arch)
    return Nvcc.create(arch, gencode, need_cutlass)
