"""Exclusive locks between processes, on lock files (fcntl.flock): one writer per build directory (build.py) and per
cache entry (the Python JIT). The kernel releases a lock when its holder dies, so a killed build never leaves one
behind; lock files themselves are never deleted (deleting one while another process waits on it would let two
holders in)."""
from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional


@contextmanager
def exclusive(path: Path, on_wait: Optional[Callable[[], None]] = None) -> Iterator[None]:
    """Hold an exclusive lock on `path` (created, with its directory, if needed) for the body of the `with`. When
    another process holds it, `on_wait()` is called once (to say so) and the lock is waited for."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def try_take(path: Path, create: bool = False) -> Optional[int]:
    """The lock on `path` if it is free right now: an open descriptor holding it (close it to release), else None
    (another process holds it, or the file is missing and `create` is false)."""
    try:
        fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o644)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd
