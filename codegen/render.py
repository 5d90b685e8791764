"""Rendering: one source per kernel instance and one dispatch table per API, from Jinja templates.

Files are rewritten only when their text changes, so ninja (which tracks mtimes) recompiles exactly what changed.
Each written source starts with a #line directive naming it by a fixed path, BUILD_NAME_ROOT/<path under the build's
work directory>: nvcc records a source's directory in the line info (-lineinfo), and a fixed name keeps the bytes of
a library the same whichever (temporary) directory built it. HIP sources (clang) carry the same directive."""
from __future__ import annotations

import hashlib
from pathlib import Path

import jinja2

from . import catalogue
from .spec import KernelSpec

TEMPLATE_DIR = Path(__file__).resolve().parent.parent / "templates"
BUILD_NAME_ROOT = "/mhakit-build"  # what compiler messages and line info call a build's work directory


def _environment() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)), undefined=jinja2.StrictUndefined,
                              keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True)


def write_if_changed(path: Path, text: str) -> bool:
    """Write text to path unless it already holds exactly that. Returns True when the file changed."""
    if path.is_file() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return True


def render_instance(spec: KernelSpec, env: jinja2.Environment | None = None) -> str:
    env = env or _environment()
    return env.get_template(spec.template).render(**spec.template_context())


def render_dispatch(api: str, arch: str, specs: list[KernelSpec], env: jinja2.Environment | None = None,
                    backend: str | None = None) -> str:
    """The dispatch table of `specs` for `arch`, with the arch's record and the API's head dims from the catalogue of
    `backend` (default: the arch's own)."""
    env = env or _environment()
    cat = catalogue.load(backend or catalogue.backend_of_arch(arch))
    record = cat.arch(arch)
    major, minor = (int(x) for x in record.compute_capabilities[0].split("."))
    arch_ctx = {"name": record.name, "major": major, "minor": minor,
                "arch_specific": "true" if record.arch_specific else "false"}
    # Instances of an API that lives in this library (the forward's split-KV ones) get a table of their own.
    return env.get_template("dispatch.cu.j2").render(
        api=api, Api=api.capitalize(), arch=arch_ctx, head_dims=cat.head_dims,
        instances=[spec.template_context() for spec in specs if spec.signature.api == api],
        splitkv_instances=[spec.template_context() for spec in specs if spec.signature.api == "splitkv"])


def _named(rel: str, text: str) -> str:
    """text as written to <work dir>/<rel>: under its fixed build name (see the module docstring); line numbers
    stay those of the text."""
    return f'#line 1 "{BUILD_NAME_ROOT}/{rel}"\n{text}'


def render_all(api: str, arch: str, specs: list[KernelSpec], gen_dir: Path,
               suffix: str = ".cu") -> tuple[list[Path], Path]:
    """Render every instance and the dispatch table into gen_dir (the build work directory's gen/), as files ending
    in `suffix` (the toolchain's: .cu for nvcc, .cpp for HIP). Returns (instance sources, dispatch source)."""
    env = _environment()
    sources = []
    for spec in specs:
        rel = f"instances/{spec.name}{suffix}"
        write_if_changed(gen_dir / rel, _named(f"{gen_dir.name}/{rel}", render_instance(spec, env)))
        sources.append(gen_dir / rel)
    return sources, render_dispatch_file(api, arch, specs, gen_dir, suffix, env)


def render_dispatch_file(api: str, arch: str, specs: list[KernelSpec], gen_dir: Path, suffix: str = ".cu",
                         env=None) -> Path:
    """Render the dispatch table of `specs` into gen_dir, named by the selection's digest; returns its path."""
    rel = f"{api}_dispatch_{arch}_{_selection_digest(specs)}{suffix}"
    text = render_dispatch(api, arch, specs, env or _environment())
    write_if_changed(gen_dir / rel, _named(f"{gen_dir.name}/{rel}", text))
    return gen_dir / rel


def _selection_digest(specs: list[KernelSpec]) -> str:
    return hashlib.sha256("\n".join(s.name for s in specs).encode()).hexdigest()[:10]
