"""The C call path's build and cache (mhakit._ext), on any machine with a C compiler: built once and reused, checked
before loading, and the slow path said once when it cannot be had (prebuild filling it in: test_python_jit)."""
from __future__ import annotations

import os

import pytest

from mhakit import _ext, jit

pytestmark = pytest.mark.skipif(_ext.compiler() is None, reason="no C compiler")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MHAKIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(_ext.ENV_DISABLE, raising=False)
    _ext.reset()
    yield jit.KernelCache(tmp_path / "cache", log=lambda *_: None)
    _ext.reset()


def test_built_once_then_loaded_from_the_cache(cache):
    path = _ext.build(cache)
    assert path.is_file() and path.parent.parent == cache.root / "ext"
    stamp = path.stat().st_mtime_ns
    assert _ext.build(cache) == path and path.stat().st_mtime_ns == stamp, "a second build compiles nothing"
    assert _ext.cached(cache) == path
    mod = _ext.module()
    assert mod is not None and os.path.samefile(mod.__file__, path)
    assert mod.fwd.__doc__ and mod.bwd.__doc__


def test_a_damaged_module_is_rebuilt_not_loaded(cache):
    path = _ext.build(cache)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    assert _ext.cached(cache) is None
    rebuilt = _ext.build(cache)
    assert _ext.cached(cache) == rebuilt


def test_no_compiler_and_nothing_cached_says_once_and_takes_the_python_path(cache, monkeypatch, capsys):
    monkeypatch.setattr(_ext, "compiler", lambda: None)
    assert _ext.module() is None and _ext.module() is None
    err = capsys.readouterr().err
    assert err.count("the C call path is unavailable (no C compiler found") == 1
    assert "slower pure-Python path" in err


def test_disabled_by_the_environment(cache, monkeypatch, capsys):
    monkeypatch.setenv(_ext.ENV_DISABLE, "1")
    assert _ext.module() is None
    assert capsys.readouterr().err == ""


def test_the_module_refuses_a_wrong_argument_count(cache):
    mod = _ext.module()
    with pytest.raises(TypeError, match="takes 18 arguments"):
        mod.fwd(1, 2, 3)
    with pytest.raises(TypeError, match="takes 23 arguments"):
        mod.bwd()


def test_arrays_it_cannot_read_come_back_to_the_python_path(cache):
    """Host arrays, lists and mismatched shapes are handed back (NotImplemented) before the GPU is touched."""
    import numpy as np
    mod = _ext.module()
    q = np.zeros((1, 4, 2, 64), np.float16)
    args = [q, q, q, None, None, None, None, None, 0, 0, -1, -1, None, False, None, None, None, 0]
    assert mod.fwd(*args) is NotImplemented
    args[0] = [[1.0]]
    assert mod.fwd(*args) is NotImplemented
    args[0] = q  # score modifiers on the host (or of an unknown shape) go back too
    args[16] = (2.0, None, np.zeros((1, 2, 4, 4), np.float32), None)
    assert mod.fwd(*args) is NotImplemented
    args[16] = (2.0, None, None, None, None)  # not a tuple the path knows
    assert mod.fwd(*args) is NotImplemented
