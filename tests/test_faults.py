"""Faults and bad input met the way a new user meets them (issue 8): unwritable caches and build directories,
concurrent builds, damaged memos, killed builds, misleading advice. CPU only: fake toolchains and builders, except
where a test says otherwise."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import REPO, run_compile
from mhakit import _codegen, jit
from readonly import run_readonly
from test_python_jit import FakeBuilder, build_mod, entry, fake_toolchain, make_cache, sub_env

locks_mod = _codegen.submodule("locks")


def mhakit_cli(*args, cache: Path, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mhakit", *args], capture_output=True, text=True, timeout=300,
                          env=sub_env(MHAKIT_CACHE_DIR=str(cache)), **kwargs)


def one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    for fragment in fragments:
        assert fragment in proc.stderr, proc.stderr


# ----------------------------------------------------------------------------------------------------------------
# 1. An unwritable cache: one sentence naming the directory and what to do; hits keep working
# ----------------------------------------------------------------------------------------------------------------

def test_cache_dir_that_is_a_file_is_one_sentence(tmp_path):
    (tmp_path / "afile").write_text("not a directory")
    cache = jit.KernelCache(tmp_path / "afile", builder=FakeBuilder(), log=lambda msg: None)
    with pytest.raises(jit.CacheDirError) as info:
        cache.ensure(jit.make_plan(entry(), fake_toolchain()))
    message = str(info.value)
    assert str(tmp_path / "afile") in message and "set MHAKIT_CACHE_DIR to a writable directory" in message
    assert "python -m mhakit prebuild" in message and "\n" not in message


_READONLY_CHILD = """
import sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from mhakit import jit
from test_python_jit import FakeBuilder, entry, fake_toolchain
cache = jit.KernelCache(Path(sys.argv[1]), builder=FakeBuilder(), log=lambda msg: None)
print("hit", cache.ensure(jit.make_plan(entry(), fake_toolchain())))
try:
    cache.ensure(jit.make_plan(entry(masked=True), fake_toolchain()))
except jit.CacheDirError as exc:
    print("miss", exc)
"""


def test_read_only_cache_serves_hits_and_names_itself_on_a_miss(tmp_path):
    cache = make_cache(tmp_path)
    lib = cache.ensure(jit.make_plan(entry(), fake_toolchain()))  # filled ahead of time, then mounted read-only
    script = tmp_path / "child.py"
    script.write_text(_READONLY_CHILD.format(tests=str(REPO / "tests")))
    proc = run_readonly([sys.executable, str(script), str(cache.base)], cache.base, env=sub_env())
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    hit, miss = proc.stdout.strip().splitlines()
    assert hit == f"hit {lib}"
    assert miss.startswith(f"miss the kernel cache {cache.base} cannot be written")
    assert "set MHAKIT_CACHE_DIR to a writable directory" in miss


def test_prebuild_into_a_read_only_cache_is_one_line(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    proc = run_readonly([sys.executable, "-m", "mhakit", "prebuild", "--profile", "minimal", "--arch", "sm_90a"],
                        cache, env=sub_env(MHAKIT_CACHE_DIR=str(cache)))
    if "needs a toolchain" in proc.stderr:
        pytest.skip("no nvcc: prebuild stops before it writes")
    assert proc.returncode == 1
    one_line_error(proc, f"the kernel cache {cache} cannot be written", "set MHAKIT_CACHE_DIR to a writable directory")
    assert "mhakit prebuild`" not in proc.stderr, "no advice to run what just failed"


# ----------------------------------------------------------------------------------------------------------------
# 2. One build at a time per build directory (compile.py runs sharing ./build)
# ----------------------------------------------------------------------------------------------------------------

def test_build_directory_lock_makes_the_second_build_wait(tmp_path, monkeypatch):
    """build() holds <work dir>/build.lock from rendering to install; a second build() waits and says so."""
    events = []
    real_run = build_mod._run_ninja

    def slow_ninja(ninja_file, work_dir, jobs, verbose, capture=False):
        events.append("ninja start")
        time.sleep(0.5)
        events.append("ninja end")

    monkeypatch.setattr(build_mod, "_run_ninja", slow_ninja)
    monkeypatch.setattr(build_mod, "_install", lambda src, dest: False)
    request = build_mod.BuildRequest(api="fwd", arch="sm_90a", specs=list(entry().specs), build_dir=tmp_path / "b",
                                     install_dir=tmp_path, toolchain=fake_toolchain())
    logs: list[str] = []
    threads = [threading.Thread(target=build_mod.build, args=(request,), kwargs=dict(log=logs.append))
               for _ in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.1)
    for t in threads:
        t.join(timeout=60)
    assert real_run is not slow_ninja
    assert events == ["ninja start", "ninja end", "ninja start", "ninja end"], "the two ninja runs overlapped"
    assert sum("waiting for another build in" in line for line in logs) == 1


def test_prebuild_compiles_further_instance_tables_without_linking_them(tmp_path, monkeypatch):
    """BuildRequest.also_dispatch (the JIT's prebuild): each further selection's dispatch table is a compile of the
    same ninja run and a default target, but not an input of the library's link."""
    texts = []
    monkeypatch.setattr(build_mod, "_run_ninja", lambda ninja_file, *a, **k: texts.append(ninja_file.read_text()))
    monkeypatch.setattr(build_mod, "_install", lambda src, dest: False)
    specs = list(entry().specs)
    request = build_mod.BuildRequest(api="fwd", arch="sm_90a", specs=specs, build_dir=tmp_path / "b",
                                     install_dir=tmp_path, toolchain=fake_toolchain(),
                                     also_dispatch=[specs[:1], specs[::-1], specs[1:]])
    build_mod.build(request, log=lambda *_: None)
    (text,) = texts
    tables = [line.split(":")[0].removeprefix("build ") for line in text.splitlines()
              if line.startswith("build ") and "_dispatch_" in line and "compile_device" in line]
    assert len(tables) == 3, "the own table plus two further ones (specs[::-1] is the own selection again)"
    link = next(line for line in text.splitlines() if "link_shared" in line and line.startswith("build "))
    default = next(line for line in text.splitlines() if line.startswith("default "))
    assert sum(t in link for t in tables) == 1 and all(t in default or t in link for t in tables)


@pytest.mark.compile
def test_compile_py_waits_for_a_build_in_the_same_directory(minimal_fwd_build, build_root):
    (work_dir,) = (build_root / "objects").glob("cuda-sm_90a-*")
    args = [sys.executable, str(REPO / "compile.py"), "--api", "fwd", "--profile", "minimal", "--arch", "sm_90a",
            "--benchmark", "--build-dir", str(build_root / "objects")]
    with locks_mod.exclusive(work_dir / "build.lock"):  # another build is running
        proc = subprocess.Popen(args, cwd=minimal_fwd_build, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        first = proc.stdout.readline()
        assert "waiting for another build in" in first, first
        assert proc.poll() is None, "it must wait while the lock is held"
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "no work to do" in out and "up to date" in out


# ----------------------------------------------------------------------------------------------------------------
# 3. Concurrent prebuilds compile once
# ----------------------------------------------------------------------------------------------------------------

def test_concurrent_prebuilds_compile_once(tmp_path, monkeypatch):
    builder = FakeBuilder()
    cache = make_cache(tmp_path, builder)
    monkeypatch.setattr(jit, "toolchain_for", lambda arch, root, refresh=False: (fake_toolchain(arch), None))
    monkeypatch.setattr(jit, "_toolchain_identity", lambda root: ("13.0.88", "4.2.0"))
    compiled = []

    def slow_build(request, log=None):
        compiled.append(len(request.specs))
        time.sleep(1.0)

    monkeypatch.setattr(build_mod, "build", slow_build)
    cache_logs: list[str] = []
    cache.log = cache_logs.append
    results: list = [None, None]

    def run(i):  # two processes in effect: each flock() call opens the lock file afresh
        results[i] = jit.prebuild("minimal", "sm_90a", cache=cache, jobs=1)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.2)
    for t in threads:
        t.join(timeout=60)
    # minimal: four mha_fwd libraries, two with modifier instances ("_mods") and two split-KV ones (decode alone,
    # decode_tma + decode), from 10 instances
    assert compiled == [10], "the second prebuild must wait and find the libraries the first one built"
    assert results[0] == results[1] and len(results[0]) == 8 and builder.calls == 8
    assert sum("compiling 10 kernel instances" in line for line in cache_logs) == 1
    assert any("waiting for another process that is building fwd libraries for sm_90a" in line for line in cache_logs)


# ----------------------------------------------------------------------------------------------------------------
# 6. compile.py: unusable directories are one line, before anything is compiled
# ----------------------------------------------------------------------------------------------------------------

def test_build_dir_that_is_a_file(tmp_path):
    (tmp_path / "afile").write_text("x")
    proc = run_compile(["--api", "fwd", "--profile", "minimal", "--arch", "sm_90a", "--build-dir", "afile"],
                       cwd=tmp_path)
    assert proc.returncode == 2
    one_line_error(proc, "--build-dir afile is not a directory")


def test_read_only_working_directory(tmp_path):
    work = tmp_path / "ro"
    work.mkdir()
    args = [sys.executable, str(REPO / "compile.py"), "--api", "fwd", "--profile", "minimal", "--arch", "sm_90a"]
    proc = run_readonly(args, work, cwd=work)
    assert proc.returncode == 2
    one_line_error(proc, "--build-dir build cannot be created")
    start = time.monotonic()
    proc = run_readonly(args + ["--build-dir", str(tmp_path / "objects")], work, cwd=work)
    assert proc.returncode == 2 and time.monotonic() - start < 30, "refused before compiling"
    one_line_error(proc, f"the current directory {work} (the libraries are installed there) is not writable")
    assert not (tmp_path / "objects").exists() or not list((tmp_path / "objects").rglob("*.o"))


# ----------------------------------------------------------------------------------------------------------------
# 7. A memo of the wrong shape is ignored and rewritten
# ----------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("memo", ["[1, 2]", '"text"', "3", '{"x": [1]}', "{"])
def test_wrong_typed_toolchain_memo_is_rewritten(tmp_path, monkeypatch, memo):
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.parent.mkdir()
    nvcc.write_text('#!/bin/sh\necho "Cuda compilation tools, release 13.0, V13.0.88"\n')
    nvcc.chmod(0o755)
    root = tmp_path / "cache" / "v1"
    root.mkdir(parents=True)
    (root / "toolchains.json").write_text(memo)
    assert jit._nvcc_version(str(nvcc), root) == "13.0.88"
    rewritten = json.loads((root / "toolchains.json").read_text())
    assert isinstance(rewritten, dict) and rewritten[os.path.realpath(nvcc)]["version"] == "13.0.88"


def test_cache_listing_survives_a_manifest_of_the_wrong_shape(tmp_path):
    cache = make_cache(tmp_path)
    lib = cache.ensure(jit.make_plan(entry(), fake_toolchain()))
    (lib.parent / "manifest.json").write_text("[1, 2]")
    (listed,) = cache.entries()
    assert not listed["ok"] and listed["instances"] == []
    proc = mhakit_cli("cache", cache=cache.base)
    assert proc.returncode == 0 and "BROKEN" in proc.stdout, proc.stderr


# ----------------------------------------------------------------------------------------------------------------
# 8. Work directories of dead processes are counted and swept
# ----------------------------------------------------------------------------------------------------------------

def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_dead_work_directories_are_counted_then_swept(tmp_path):
    cache = make_cache(tmp_path)
    tmp = cache.tmp_dir
    tmp.mkdir(parents=True)
    legacy = tmp / f"prebuild.{_dead_pid()}.0a0b0c0d"        # an older version's leftover: no .owner, pid gone
    (legacy / "build").mkdir(parents=True)
    (legacy / "build" / "x.o").write_bytes(b"\0" * 1_000_000)
    orphan = tmp / "fwd_x-1-2.123.deadbeef"                   # its owner's lock died with it
    orphan.mkdir()
    (orphan / ".owner").write_text("")
    alive = tmp / f"prebuild.{os.getpid()}.00000000"          # a live process, mid-way (no .owner yet)
    alive.mkdir()
    owned = tmp / "prebuild.1.11111111"                       # a live owner holding its lock
    owned.mkdir()
    fd = locks_mod.try_take(owned / ".owner", create=True)
    try:
        assert sorted(p.name for p, _ in cache.stale_tmp()) == sorted([legacy.name, orphan.name])
        proc = mhakit_cli("cache", cache=cache.base)
        assert "2 temporary build directories of processes that died (1.0 MB)" in proc.stdout, proc.stdout
        assert cache.sweep_tmp() == 2
        assert sorted(p.name for p in tmp.iterdir()) == sorted([alive.name, owned.name])
    finally:
        os.close(fd)
    assert [p.name for p, _ in cache.stale_tmp()] == [owned.name], "a released lock means its owner is gone"


def test_a_build_owns_its_work_directory_and_removes_it(tmp_path):
    cache = make_cache(tmp_path)
    with cache._work_dir("prebuild") as work:
        assert (work / ".owner").is_file() and cache.stale_tmp() == []
    assert not work.exists()


_NINJA_CHILD = """
import sys
from pathlib import Path
sys.path.insert(0, {repo!r})
from codegen import build
build._run_ninja(Path(sys.argv[1]) / "t.ninja", Path(sys.argv[1]), 1, False, capture=True)
"""


def test_killing_a_build_stops_the_compilers_ninja_started(tmp_path):
    """`kill -9` of a build's process group used to leave nvcc running (ninja gives each command a process group
    of its own). A stand-in compiler that writes its pid and sleeps must be gone soon after the kill."""
    (tmp_path / "t.ninja").write_text("rule slow\n  command = sh -c 'echo $$$$ > $out.pid; exec sleep 120'\n"
                                      "build out: slow\n")
    script = tmp_path / "child.py"
    script.write_text(_NINJA_CHILD.format(repo=str(REPO)))
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)], start_new_session=True)
    pid_file = tmp_path / "out.pid"
    deadline = time.monotonic() + 60
    while not (pid_file.exists() and pid_file.read_text().strip()):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    compiler = int(pid_file.read_text())
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 20
    try:
        while time.monotonic() < deadline:
            os.kill(compiler, 0)
            time.sleep(0.1)
    except ProcessLookupError:
        return
    os.kill(compiler, signal.SIGKILL)
    pytest.fail("the compiler ninja started outlived the killed build")


# ----------------------------------------------------------------------------------------------------------------
# 9. clear says when it could not remove the cache
# ----------------------------------------------------------------------------------------------------------------

def test_clear_of_a_read_only_cache_fails_in_one_line(tmp_path):
    cache = make_cache(tmp_path)
    cache.ensure(jit.make_plan(entry(), fake_toolchain()))
    proc = run_readonly([sys.executable, "-m", "mhakit", "clear"], cache.base,
                        env=sub_env(MHAKIT_CACHE_DIR=str(cache.base)))
    assert proc.returncode == 1 and "removed" not in proc.stdout
    one_line_error(proc, "could not remove", str(cache.root))
    assert cache.entries(), "nothing was removed"


def test_clear_reports_what_it_did(tmp_path):
    cache = make_cache(tmp_path)
    proc = mhakit_cli("clear", cache=cache.base)
    assert proc.returncode == 0 and proc.stdout.startswith("nothing to remove")
    cache.ensure(jit.make_plan(entry(), fake_toolchain()))
    proc = mhakit_cli("clear", cache=cache.base)
    assert proc.returncode == 0 and proc.stdout.strip() == f"removed {cache.root}" and not cache.root.exists()


# ----------------------------------------------------------------------------------------------------------------
# 14. prebuild's advice names an option it has
# ----------------------------------------------------------------------------------------------------------------

def test_prebuild_filter_advice_and_list(tmp_path):
    proc = mhakit_cli("prebuild", "--profile", "minimal", "--arch", "sm_90a", "--filter", "zzz", cache=tmp_path)
    assert proc.returncode == 2
    one_line_error(proc, "selects no fwd instance", "--list")
    proc = mhakit_cli("prebuild", "--profile", "minimal", "--arch", "sm_90a", "--api", "all", "--list",
                      cache=tmp_path / "c")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "fwd_d128_bf16_batch_nmask_sm90a_hopper_b128x176" in lines
    assert {"10 fwd instances for sm_90a (profile minimal)", "7 bwd instances for sm_90a (profile minimal)"} <= set(lines)
    assert not (tmp_path / "c").exists(), "--list builds nothing"


# ----------------------------------------------------------------------------------------------------------------
# 16. What is skipped or slow is said
# ----------------------------------------------------------------------------------------------------------------

def test_build_mha_says_it_skipped_the_validation_run(tmp_path):
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "nvidia-smi").write_text("#!/bin/sh\nexit 9\n")  # no GPU: nvidia-smi -L fails
    (fake_bin / "nvidia-smi").chmod(0o755)
    env = dict(os.environ, PATH=f"{fake_bin}{os.pathsep}{os.environ['PATH']}", PYTHON="true")
    proc = subprocess.run(["bash", str(REPO / "build_mha.sh"), "fwd"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ("[build_mha] skipped the validation run of ./benchmark_mha_fwd: no GPU visible "
                                   "(neither nvidia-smi -L nor rocminfo found one)")
    proc = subprocess.run(["bash", str(REPO / "build_mha.sh")], cwd=tmp_path, env=dict(env, MHA_SKIP_RUN="1"),
                          capture_output=True, text=True, timeout=60)
    assert proc.stdout.splitlines() == [f"[build_mha] skipped the validation run of ./benchmark_mha_{api} "
                                        "(MHA_SKIP_RUN=1)" for api in ("fwd", "bwd")]


def test_pytest_summary_names_the_slowest_tests():
    import tomllib
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert "--durations=" in config.get("addopts", "")


# ----------------------------------------------------------------------------------------------------------------
# 15. The README's architecture note is part of the repository
# ----------------------------------------------------------------------------------------------------------------

def test_readme_points_at_the_projects_own_architecture_note():
    readme = (REPO / "README.md").read_text()
    assert "../shared" not in readme and "`docs/ARCHITECTURE.md`" in readme
    note = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    for path in ("codegen/catalogue/cuda.toml", "codegen/build.py", "templates/", "csrc/runtime/", "csrc/include/",
                 "mhakit/jit.py", "mhakit/api.py", "csrc/kernels/"):
        assert path in note, path
        assert (REPO / path.rstrip("/")).exists(), f"docs/ARCHITECTURE.md names {path}, which does not exist"
