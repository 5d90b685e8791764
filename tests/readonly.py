"""Running a command with one directory read-only, as a user meets it (a cache mounted read-only, a read-only
checkout). As root, permission bits do not stop writes, so the directory is bind-mounted read-only in a private
mount namespace (`unshare -m`); as another user, its write bits are removed for the duration."""
from __future__ import annotations

import functools
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

# $1: the directory, $2: where to run (entered after the mount, so that a working directory inside it is the
# read-only view), then the command.
_MOUNT_RO = 'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" && cd "$2" && shift 2 && exec "$@"'


@functools.lru_cache(maxsize=None)
def _can_mount_readonly() -> bool:
    if not shutil.which("unshare"):
        return False
    with tempfile.TemporaryDirectory() as d:
        probe = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", _MOUNT_RO, "sh", d, d,
                                "true"], capture_output=True, timeout=60)
    return probe.returncode == 0


def _set_writable(root: Path, writable: bool) -> None:
    bits = stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [dirpath] + [os.path.join(dirpath, n) for n in dirnames + filenames]:
            mode = os.lstat(name).st_mode
            if not stat.S_ISLNK(mode):
                os.chmod(name, (mode | stat.S_IWUSR) if writable else (mode & ~bits))


def run_readonly(argv: list[str], readonly: Path, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(argv, capture_output=True, text=True, **kwargs) while `readonly` cannot be written."""
    kwargs.setdefault("timeout", 300)
    if os.geteuid() != 0:
        _set_writable(readonly, False)
        try:
            return subprocess.run(argv, capture_output=True, text=True, **kwargs)
        finally:
            _set_writable(readonly, True)
    if not _can_mount_readonly():
        pytest.skip("running as root without a way to mount a directory read-only (unshare -m)")
    cwd = str(kwargs.pop("cwd", None) or os.getcwd())
    return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", _MOUNT_RO, "sh", str(readonly),
                           cwd, *argv], capture_output=True, text=True, **kwargs)
