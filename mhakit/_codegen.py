"""Where mhakit's code generator lives: ``mhakit.codegen`` in an installed package, ``<checkout>/codegen`` in place.

An install (``pip install .``) ships the generator as the subpackage ``mhakit.codegen`` with its data
(catalogue, profiles) and, beside it, ``mhakit/templates`` and ``mhakit/csrc``; the generator finds them relative
to itself. A checkout keeps ``codegen/``, ``templates/`` and ``csrc/`` at the top level (``compile.py`` imports
``codegen`` from there): ``load()`` then imports that directory under the name ``mhakit.codegen``, so the Python
front end uses one name everywhere and never installs a top-level ``codegen`` module.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
from pathlib import Path
from types import ModuleType

_LOCK = threading.Lock()
PACKAGE = "mhakit.codegen"


def checkout_root() -> Path | None:
    """The repository root when this package runs from a checkout (codegen/ beside mhakit/), else None."""
    root = Path(__file__).resolve().parent.parent
    return root if (root / "codegen" / "__init__.py").is_file() and (root / "compile.py").is_file() else None


def load() -> ModuleType:
    """The code generator package, imported as ``mhakit.codegen``."""
    module = sys.modules.get(PACKAGE)
    if module is not None:
        return module
    with _LOCK:
        module = sys.modules.get(PACKAGE)
        if module is not None:
            return module
        try:
            module = importlib.import_module(PACKAGE)
        except ModuleNotFoundError as exc:
            if exc.name != PACKAGE:
                raise
            root = checkout_root()
            if root is None:
                raise ImportError("mhakit's code generator (mhakit.codegen) is missing: reinstall mhakit "
                                  "(python3 -m pip install <mhakit checkout>) or run from a complete checkout") from None
            init = root / "codegen" / "__init__.py"
            spec = importlib.util.spec_from_file_location(PACKAGE, init, submodule_search_locations=[str(init.parent)])
            module = importlib.util.module_from_spec(spec)
            sys.modules[PACKAGE] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                sys.modules.pop(PACKAGE, None)
                raise
        parent = sys.modules.get("mhakit")
        if parent is not None:
            setattr(parent, "codegen", module)
        return module


def submodule(name: str) -> ModuleType:
    """``mhakit.codegen.<name>`` (build, profiles, toolchain, ...)."""
    load()
    return importlib.import_module(f"{PACKAGE}.{name}")


def codegen_dir() -> Path:
    """The generator's directory, found without importing it: mhakit/codegen (install), <checkout>/codegen, or
    wherever an editable install maps mhakit.codegen."""
    installed = Path(__file__).resolve().parent / "codegen"
    if (installed / "__init__.py").is_file():
        return installed
    root = checkout_root()
    if root is not None:
        return root / "codegen"
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("mhakit's code generator (mhakit.codegen) is missing: reinstall mhakit")
    return Path(list(spec.submodule_search_locations)[0]).resolve()


def source_dirs() -> dict[str, Path]:
    """The directories a build reads, laid out as codegen/render.py and codegen/toolchain.py expect them: the
    generator, and beside it templates/ and csrc/."""
    gen = codegen_dir()
    return {"codegen": gen, "templates": gen.parent / "templates", "csrc": gen.parent / "csrc"}
