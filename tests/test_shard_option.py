"""conftest.py's --shard=I/N (bench/gpu_check.sh runs the shards of a GPU test file side by side): the N shards of a
file partition its collected tests, and a malformed spec is refused in one line."""
from __future__ import annotations

import subprocess
import sys

from conftest import REPO

TARGET = "tests/test_score_mods.py"  # many quick CPU tests, parametrized ids included


def run_collect(*extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", TARGET,
                           *extra], cwd=REPO, capture_output=True, text=True, timeout=300)


def collected(*extra: str) -> list[str]:
    res = run_collect(*extra)
    assert res.returncode == 0, res.stdout + res.stderr
    return [line for line in res.stdout.splitlines() if "::" in line]


def test_shards_partition_the_collection():
    everything = collected()
    shards = [collected(f"--shard={i}/3") for i in range(3)]
    assert len(everything) > 3 and all(shards)
    assert sorted(sum(shards, [])) == sorted(everything)
    assert len(set(sum(shards, []))) == len(everything)  # disjoint


def test_malformed_shard_is_one_line():
    for spec in ("3/3", "-1/2", "a/b", "1"):
        res = run_collect(f"--shard={spec}")
        assert res.returncode != 0
        assert "expected I/N with integers 0 <= I < N" in res.stderr
        assert "Traceback" not in res.stderr + res.stdout
