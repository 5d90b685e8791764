"""mhakit's code generator: catalogue -> specs -> rendered sources -> ninja build.

Each module is one stage of the data flow (docs/ARCHITECTURE.md) and consumes only the stage above it:

    catalogue.py   read the per-backend catalogue (data: families, tiles, arches)
    spec.py        KernelSpec (signature + algorithm) and its deterministic name
    rules.py       explicit validity rules for specs
    profiles.py    enumerate specs from the catalogue, narrowed by a named profile and a name filter
    render.py      Jinja: one source per instance and one dispatch table per API
    toolchain.py   the compiler (Nvcc; Hipcc: hipcc or clang for CK-tile): flags, arch, version
    ninja.py       write build.ninja
    build.py       the one build path shared by compile.py, build_mha.sh and the Python JIT
    locks.py       locks between processes: one build per build directory, one builder per cache entry
"""

__all__ = ["build", "catalogue", "locks", "profiles", "render", "rules", "spec", "toolchain", "ninja"]
