"""What a ROCm build put into a library: the amdgcn code objects of its fat binary, read with LLVM's tools.

A compile for the wrong target can succeed with an empty kernel, so a passing build is not enough: each library's
.hip_fatbin section is unbundled for the arch, and the code object must be an AMDGPU ELF for that arch with kernel
descriptors and MFMA (matrix-core) instructions."""
from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from codegen import toolchain


def llvm_tool(name: str) -> str | None:
    """An LLVM tool that matches the HIP compiler: <name>-<clang major> (Debian), ROCm's llvm/bin, or <name>."""
    path, _, root = toolchain.locate_hip_compiler()
    match = re.search(r"-(\d+)$", path or "")
    candidates = [f"{name}-{match.group(1)}"] if match else []
    if root is not None:
        candidates.append(str(root / "llvm" / "bin" / name))
    candidates.append(name)
    for candidate in candidates:
        found = shutil.which(candidate) or (candidate if Path(candidate).is_file() else None)
        if found:
            return found
    return None


@dataclass
class CodeObject:
    arch: str           # from the ELF header flags ("" unless every code object is an AMDGPU ELF for one arch)
    kernels: list[str]  # kernel descriptor symbols (*.kd), over all code objects
    mfma: int           # v_mfma instructions in the disassembly, over all code objects


BUNDLE_MAGIC = b"__CLANG_OFFLOAD_BUNDLE__"


def code_object(library: Path, arch: str, work: Path) -> CodeObject:
    """The amdgcn code for `arch` in a library. A linked library's .hip_fatbin section is the concatenation of its
    translation units' offload bundles (one per instance); each is unbundled and read."""
    tools = {n: llvm_tool(n) for n in ("llvm-objcopy", "clang-offload-bundler", "llvm-readelf", "llvm-objdump")}
    missing = [n for n, p in tools.items() if p is None]
    if missing:
        raise RuntimeError(f"LLVM tools not found: {', '.join(missing)}")
    work.mkdir(parents=True, exist_ok=True)
    run = lambda *cmd: subprocess.run(cmd, check=True, capture_output=True, text=True).stdout  # noqa: E731
    section = work / f"{library.stem}.hip_fatbin"
    # (an output file of its own: without one, objcopy rewrites the library in place)
    run(tools["llvm-objcopy"], f"--dump-section=.hip_fatbin={section}", str(library), str(work / "copy.so"))
    data = section.read_bytes()
    starts = [i for i in range(len(data)) if data.startswith(BUNDLE_MAGIC, i)]
    arches, kernels, mfma = set(), [], 0
    for n, (begin, end) in enumerate(zip(starts, starts[1:] + [len(data)])):
        bundle, hsaco = work / f"bundle{n}", work / f"bundle{n}-{arch}.hsaco"
        bundle.write_bytes(data[begin:end])
        run(tools["clang-offload-bundler"], "--unbundle", "--type=o", f"--input={bundle}",
            f"--targets=hipv4-amdgcn-amd-amdhsa--{arch}", f"--output={hsaco}")
        header = run(tools["llvm-readelf"], "-h", str(hsaco))
        flags = re.search(r"Flags:\s+\S+,\s*(gfx\w+)", header)
        machine = re.search(r"Machine:\s+(\S+)", header)
        arches.add(flags.group(1) if flags and machine and machine.group(1) == "EM_AMDGPU" else "")
        kernels += re.findall(r"\.symbol:\s+(\S+\.kd)", run(tools["llvm-readelf"], "--notes", str(hsaco)))
        mfma += len(re.findall(r"\bv_mfma", run(tools["llvm-objdump"], "-d", str(hsaco))))
    return CodeObject(arches.pop() if len(arches) == 1 else "", kernels, mfma)
