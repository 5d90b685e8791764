"""Rendering: one source per kernel instance and one dispatch table per API, from Jinja templates.

Files are rewritten only when their text changes, so ninja (which tracks mtimes) recompiles exactly what changed."""
from __future__ import annotations

import hashlib
from pathlib import Path

import jinja2

from .spec import KernelSpec

TEMPLATE_DIR = Path(__file__).resolve().parent.parent / "templates"


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


def render_dispatch(api: str, arch: str, specs: list[KernelSpec], env: jinja2.Environment | None = None) -> str:
    env = env or _environment()
    return env.get_template("dispatch.cu.j2").render(
        api=api, Api=api.capitalize(), arch=arch, instances=[spec.template_context() for spec in specs])


def render_all(api: str, arch: str, specs: list[KernelSpec], gen_dir: Path, suffix: str = ".cu") -> tuple[list[Path], Path]:
    """Render every instance and the dispatch table into gen_dir, as files ending in `suffix` (the toolchain's: .cu
    for nvcc, .cpp for HIP). Returns (instance sources, dispatch source)."""
    env = _environment()
    sources = []
    for spec in specs:
        path = gen_dir / "instances" / f"{spec.name}{suffix}"
        write_if_changed(path, render_instance(spec, env))
        sources.append(path)
    dispatch = gen_dir / f"{api}_dispatch_{arch}_{_selection_digest(specs)}{suffix}"
    write_if_changed(dispatch, render_dispatch(api, arch, specs, env))
    return sources, dispatch


def _selection_digest(specs: list[KernelSpec]) -> str:
    return hashlib.sha256("\n".join(s.name for s in specs).encode()).hexdigest()[:10]
