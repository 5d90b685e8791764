"""The C call path (``csrc/python/mhakit_ext.c``): built on first use with the host C compiler, cached, loaded.

The extension is a host-only target: one C file against ``Python.h``, ``csrc/python/dlpack_abi.h`` and the public
``csrc/include/mha_*.h``. It is cached beside the kernel libraries, under ``<cache>/v1/ext/``, in a directory named
by a key over its sources, the Python ABI tag (``EXT_SUFFIX``), the compiler and the flags; the build runs in
``v1/tmp/`` under a file lock and is moved into place with its manifest (sha256 of the module) written last, as the
kernel entries are (:mod:`mhakit.jit`). A later process loads it without compiling; ``prebuild`` fills it in too.

Where it cannot be had (no C compiler and nothing cached, a failed build, ``MHAKIT_NO_EXT=1``), :func:`module`
returns None after saying once on stderr that calls take the slower pure-Python path.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path
from typing import Optional

from . import _codegen

__all__ = ["ENV_DISABLE", "module", "build", "cached", "abi_tag", "ExtError", "compiler"]

ENV_DISABLE = "MHAKIT_NO_EXT"
NAME = "_mhakit_ext"
FLAGS = ["-std=gnu11", "-O2", "-fPIC", "-shared", "-fvisibility=hidden", "-Wall"]
LIBS = ["-ldl"]
_STATE: dict = {}
_LOCK = threading.Lock()


class ExtError(RuntimeError):
    """The C call path could not be built or loaded."""


def _sources() -> list[Path]:
    csrc = _codegen.source_dirs()["csrc"]
    return [csrc / "python" / "mhakit_ext.c", csrc / "python" / "dlpack_abi.h",
            *(csrc / "include" / name for name in ("mha_common.h", "mha_fwd.h", "mha_bwd.h"))]


def compiler() -> Optional[list[str]]:
    """The host C compiler as an argv prefix: $CC, else the one Python was built with, else cc / gcc / clang."""
    for candidate in (os.environ.get("CC"), sysconfig.get_config_var("CC"), "cc", "gcc", "clang"):
        if not candidate:
            continue
        argv = shlex.split(candidate)
        path = shutil.which(argv[0])
        if path:
            return [path, *argv[1:]]
    return None


def _key(cc: Optional[list[str]]) -> str:
    h = hashlib.sha256()
    for path in _sources():
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    h.update(repr((abi_tag(), sys.implementation.cache_tag, FLAGS, LIBS,
                   [Path(cc[0]).name, *cc[1:]] if cc else None)).encode())
    return h.hexdigest()[:20]


def _entry_dir(root: Path, key: str) -> Path:
    return root / "ext" / f"{NAME}-{key}"


def _cached(directory: Path) -> Optional[Path]:
    from .jit import _file_sha256, _read_json
    manifest = _read_json(directory / "manifest.json")
    if not isinstance(manifest, dict) or not isinstance(manifest.get("module"), str):
        return None
    path = directory / manifest["module"]
    try:
        if path.name != Path(manifest["module"]).name or _file_sha256(path) != manifest.get("sha256"):
            return None
    except OSError:
        return None
    return path


def abi_tag() -> str:
    return sysconfig.get_config_var("EXT_SUFFIX") or sys.implementation.cache_tag


def cached(cache=None) -> Optional[Path]:
    """The extension module this Python would load from the cache, or None (nothing compiled, no lock taken)."""
    from . import jit
    cache = cache or jit.default_cache()
    return _cached(_entry_dir(cache.root, _key(compiler())))


def build(cache=None, *, quiet: bool = False) -> Path:
    """The extension module's path in the cache (a :class:`mhakit.jit.KernelCache`, default the process's),
    compiling it first when missing (once across processes)."""
    from . import jit
    cache = cache or jit.default_cache()
    cc = compiler()
    key = _key(cc)
    final = _entry_dir(cache.root, key)
    found = _cached(final)
    if found is not None:
        return found
    if cc is None:
        raise ExtError("no C compiler found (set CC, or install gcc or clang)")
    cache.require_writable("the C call path")
    with jit._locked(cache.root / "locks" / f"{final.name}.lock", "the C call path", cache.log):
        found = _cached(final)
        if found is not None:
            return found
        with cache._work_dir(final.name) as work:
            stage = work / "entry"
            stage.mkdir()
            target = stage / f"{NAME}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"
            include = _codegen.source_dirs()["csrc"] / "include"
            cmd = [*cc, *FLAGS, f"-I{sysconfig.get_paths()['include']}", f"-I{include}", str(_sources()[0]),
                   "-o", str(target), *LIBS]
            start = time.monotonic()
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise ExtError(f"compiling {_sources()[0].name} failed:\n{done.stderr.strip()[-3000:]}")
            jit._write_json_atomic(stage / "manifest.json", {
                "module": target.name, "sha256": jit._file_sha256(target), "key": key, "command": cmd,
                "build_seconds": round(time.monotonic() - start, 2)})
            cache.install(stage, final, work)
        if not quiet:
            cache.log(f"[mhakit] built the C call path ({NAME}) in {time.monotonic() - start:.1f} s into {final}")
    found = _cached(final)
    if found is None:
        raise ExtError(f"the C call path installed into {final} does not pass its check")
    return found


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"mhakit.{NAME}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def module():
    """The configured extension module, or None (the pure-Python path serves calls; said once on stderr)."""
    state = _STATE.get("module", False)
    if state is not False:
        return state
    with _LOCK:
        if "module" in _STATE:
            return _STATE["module"]
        mod = None
        if os.environ.get(ENV_DISABLE, "") not in ("", "0"):
            _STATE["module"] = None
            return None
        try:
            mod = _load(build())
            from . import api
            mod.configure(*api._ext_callbacks())
        except Exception as exc:  # any failure leaves the slow path working
            mod = None
            print(f"[mhakit] the C call path is unavailable ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); "
                  "calls take the slower pure-Python path (about 150 us of host time each)", file=sys.stderr)
        _STATE["module"] = mod
        return mod


def reset() -> None:
    """Forget the loaded module (tests: the next call decides again)."""
    with _LOCK:
        _STATE.clear()
