"""On-demand builds and the kernel cache.

A call needs a few kernel instances: the ones the runtime would choose for its dtype, head dims, mode (batch or
group) and mask class on the device's arch, plus the generic instance of the same signature that the runtime falls
back to when a fast family's run-time guard fails (alignment, empty sequences, ...). ``derive_entry`` names that set
(an *entry*: one small ``libmha_<api>.so``); ``KernelCache`` builds it once through the same code path as
``compile.py`` (``codegen.build.build``) and keeps it under the cache directory:

    $MHAKIT_CACHE_DIR, else $XDG_CACHE_HOME/mhakit, else ~/.cache/mhakit
        v1/<api>/<entry name>-<source key>-<toolchain key>/  libmha_<api>.so + manifest.json (written last)
        v1/locks/<entry dir>.lock, prebuild-<api>-<arch>.lock   fcntl locks: one builder per entry, one prebuild
                                                             per (api, arch), across processes
        v1/tmp/<name>.<pid>.<random>/                        builds in progress, each owned through a lock on its
                                                             .owner file (a killed build leaves only this, and the
                                                             next build removes it)
        v1/index/calls|entries/<key>.json                    call signature / instance list -> entry (shortcuts)
        v1/toolchains.json                                   nvcc version per nvcc file (path, size, mtime)

Keys. The *source key* hashes the rendered sources, the runtime sources and the content of every csrc header they
include (``codegen.build.build_inputs``); the *toolchain key* hashes the nvcc version, the flags (include
directories written as symbolic roots), the arch and the CUTLASS version. Neither sees a file time, PATH or where
anything lives. Running ``nvcc --version`` costs ~50 ms, so it is not on the hot path: its result is memoised in
toolchains.json per nvcc file (path, size, mtime: a cache of the probe, never part of a key) and the probe is re-run
before every real build, which corrects a stale memo. Without nvcc (a deployment filled by ``prebuild``), any entry
whose source key matches is used, whatever compiler built it.

Safety. Building happens in v1/tmp/ while holding the entry's lock; the library and then its manifest (sha256 and
size of the library, every key input) are written there and the directory is moved into place with ``os.replace``.
A reader accepts an entry only if its manifest parses, names the expected key, and the library's size and sha256
match, so a killed build, a truncated file or a corrupt manifest is rebuilt, never loaded. A cache that cannot be
written (read-only, a file, not permitted) still serves what it holds; a miss raises CacheDirError.

Speed. Each process memoises call signature -> loaded library (a dict lookup per call). The first call of a
signature in a new process reads v1/index/calls/<call key>.json, where the call key hashes the signature, the content
of the generator, templates and csrc (read, not rendered: no Jinja) and the memoised toolchain identity; then it
checks the entry's manifest and library checksum and loads it. A signature not seen before whose entry exists (e.g.
after ``prebuild``) is found through v1/index/entries/<entry key>.json after deriving its instance list (the
catalogue, no rendering). Only when both miss are the sources rendered and the full keys computed.

This module is API-neutral: ``api`` is "fwd" (libmha_fwd.so) or "bwd" (libmha_bwd.so) throughout; an entry holds
instances of one API only, and ``LOADERS`` says how each API's library is loaded. The backward's entries follow the
same rule as the forward's: on sm_90a, batch mode with hdim_q == hdim_v gives the hopper instance (when the catalogue
has a [bwd.hopper] family) and the generic one, which also serves what the fast family refuses at run time (e.g.
deterministic mode, unaligned strides).
"""

from __future__ import annotations

import errno
import hashlib
import json
import itertools
import os
import secrets
import shutil
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

from . import _codegen

__all__ = ["FORMAT", "ENV_CACHE_DIR", "JitError", "NoCompilerError", "CacheDirError", "Entry", "Plan", "KernelCache",
           "cache_dir", "derive_entry", "entries_within", "make_plan", "toolchain_for", "library", "prebuild",
           "device_arch", "default_cache", "codegen_builder", "LOADERS"]

FORMAT = 1                      # layout of the cache; bump to start a fresh v<N>/ tree
ENV_CACHE_DIR = "MHAKIT_CACHE_DIR"
DTYPES = ("fp16", "bf16", "fp8bf16", "fp8fp16")  # fp8: e4m3 q/k/v, bf16 / fp16 o (hopper forward only)
MODES = ("batch", "group")


class JitError(RuntimeError):
    """A JIT build could not produce the library a call needs."""


class NoCompilerError(JitError):
    """The cache lacks a library and there is no toolchain to build it."""


class CacheDirError(JitError):
    """The cache lacks a library and its directory cannot be written (read-only, a file, not permitted)."""


def cache_dir() -> Path:
    """The cache root: $MHAKIT_CACHE_DIR, else $XDG_CACHE_HOME/mhakit, else ~/.cache/mhakit."""
    override = os.environ.get(ENV_CACHE_DIR)
    if override:
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "mhakit"


def _log_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _sha256_json(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_json_atomic(path: Path, value) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _read_json(path: Path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


# ------------------------------------------------------------------------------------------------------------------
# Which instances a call needs
# ------------------------------------------------------------------------------------------------------------------

# Which families serve which head dims, modes and masks is catalogue data (codegen/catalogue/cuda.toml): the specs
# carry their family's static guards (KernelSpec.admits_head_dims). Alignment, empty sequences, deterministic mode
# and the like are checked at run time; the lowest-priority instance built alongside serves those calls.
_SPECS_BY_API_ARCH: dict = {}


def _library_api(api: str) -> str:
    """The library an API's instances live in: "splitkv" (mha_fwd_kvcache) is part of libmha_fwd.so."""
    return _codegen.submodule("catalogue").LIBRARY_OF_API[api]


def _catalogue_specs(api: str, arch: str) -> list:
    """The catalogue's specs of `api` on `arch` (only that API's, not those of others sharing its library)."""
    specs = _SPECS_BY_API_ARCH.get((api, arch))
    if specs is None:
        specs = [sp for sp in _codegen.submodule("profiles").enumerate_specs(_library_api(api), arch).specs
                 if sp.signature.api == api]
        _SPECS_BY_API_ARCH[(api, arch)] = specs
    return specs


@dataclass(frozen=True)
class Entry:
    """The instances one cached library holds: for each family that can serve the call, its tightest bucket."""

    api: str
    arch: str
    specs: tuple  # KernelSpec, highest priority first

    @property
    def name(self) -> str:
        s = self.specs[0].signature
        # (an instance of another mask class or kind than the first, e.g. a sink call's plain generic instance
        # beside the hopper "_mods" one, says so)
        parts = dict.fromkeys(f"{sp.algorithm.family}_{sp.signature.hdim_token}" +
                              ("" if sp.signature.mask_token == s.mask_token else f"_{sp.signature.mask_token}")
                              for sp in self.specs)
        return f"{self.api}_{s.dtype}_{s.mode}_{s.mask_token}_{self.arch.replace('_', '')}-" + "-".join(parts)

    @property
    def instance_names(self) -> list[str]:
        return [sp.name for sp in self.specs]


def mod_names(mods: int) -> tuple[str, ...]:
    """The score modifiers of a call's mhakit_score_mod bits (_capi.SCORE_MOD_BITS), by their catalogue names."""
    from . import _capi
    unknown = int(mods) & ~sum(_capi.SCORE_MOD_BITS.values())
    if unknown:
        raise ValueError(f"mods: unknown score-modifier bits {unknown:#x} (known: {_capi.SCORE_MOD_BITS})")
    return tuple(name for name, bit in _capi.SCORE_MOD_BITS.items() if int(mods) & bit)


def derive_entry(api: str, arch: str, dtype: str, hdim_q: int, hdim_v: int, mode: str, masked: bool,
                 candidates: Optional[Iterable] = None, mods: int = 0) -> Entry:
    """The entry a call needs: per kernel family of `arch` that serves (dtype, mode, mask class, score modifiers)
    and whose static guard admits the head dims, the instance with the tightest head-dim bucket that holds them (the
    runtime's own score). On sm_90a, batch mode with hdim_q == hdim_v gives the hopper instance and the generic one
    as fallback. mods: the score modifiers the call sets (mhakit_score_mod bits): a family serves them on its plain
    instance when that has them all (catalogue score_mods.plain), else on its modifier instance ("_mods": the masked
    one, which serves unmasked calls too, unless the tile's catalogue unmasked_mods gives its unmasked calls an
    unmasked one), else not at all (KernelSpec.serves_call_mods, the runtime's static_guards_hold)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    names = mod_names(mods)
    pool = _catalogue_specs(api, arch) if candidates is None else list(candidates)  # read twice below
    best: dict[str, tuple[int, object]] = {}
    for spec in pool:
        s = spec.signature
        if s.dtype != dtype or s.mode != mode or not spec.serves_call_mods(names):
            continue
        # An unmasked modifier call may take either class of a tile with unmasked "_mods" instances (catalogue
        # unmasked_mods); the masked one only where no unmasked one of as tight a bucket exists (the runtime's
        # score: padding first, then the exact mask class).
        either = s.mods and spec.unmasked_mods and not masked
        if not either and s.mask != ("mask" if masked or s.mods else "nmask"):
            continue
        if not spec.admits_head_dims(hdim_q, hdim_v):
            continue
        rank = ((s.hdim_q - hdim_q) + (s.hdim_v - hdim_v), s.mask == "mask" and either)
        family = spec.algorithm.family
        if family not in best or rank < best[family][0] or (rank == best[family][0] and spec.name < best[family][1].name):
            best[family] = (rank, spec)
    if not best:
        raise ValueError(f"no {api} kernel in the catalogue serves dtype={dtype} hdim_q={hdim_q} hdim_v={hdim_v} "
                         f"mode={mode} {'masked' if masked else 'unmasked'}"
                         f"{' with score modifiers (' + ', '.join(names) + ')' if names else ''} on {arch}")
    # A family whose bucket holds several instances (CK-tile's tiles and padding/LSE variants, which the runtime
    # picks among by its guards; a CUDA tile with a seqlen range beside the default tile, which the runtime picks by
    # the call's max_seqlen_q) contributes all of them.
    # A family marked complete in the catalogue (its instances together serve every call in their bucket) ends
    # the list: the runtime ranks families by priority, so no lower family would ever be chosen after it.
    chosen = set()
    for _, sp in sorted(best.values(), key=lambda item: -item[1].priority):
        chosen.add((sp.algorithm.family, sp.signature))
        if dict(sp.knobs).get("complete"):
            break
    specs = sorted((sp for sp in pool if (sp.algorithm.family, sp.signature) in chosen),
                   key=lambda sp: (-sp.priority, sp.name))
    return Entry(_library_api(api), arch, tuple(specs))


def _representative_head_dims(api: str, arch: str) -> list[int]:
    """Head dims that between them derive every entry a call can derive on `arch`. derive_entry depends on a head
    dim only through which buckets hold it, which families' head_dim_multiple divide it, and, between
    hdim_q and hdim_v, whether they are equal; so the two smallest accepted dims of each such class stand for all of
    it (two, so that unequal pairs within one class occur). A few dozen dims instead of every one of 1..256."""
    catalogue = _codegen.submodule("catalogue")
    head_dims = catalogue.load(catalogue.backend_of_arch(arch)).head_dims  # the arch's own backend
    specs = _catalogue_specs(api, arch)
    buckets = sorted({d for sp in specs for d in (sp.signature.hdim_q, sp.signature.hdim_v)})
    multiples = sorted({sp.guards.head_dim_multiple for sp in specs})
    members: dict[tuple, list[int]] = {}
    for d in range(head_dims.multiple, head_dims.max + 1, head_dims.multiple):
        key = (tuple(d <= b for b in buckets), tuple(d % m == 0 for m in multiples))
        members.setdefault(key, [])
        if len(members[key]) < 2:
            members[key].append(d)
    return sorted(d for ds in members.values() for d in ds)


def _representative_mods(api: str, arch: str) -> list[int]:
    """Score-modifier sets (mhakit_score_mod bits) that between them derive every entry a call can derive on `arch`:
    derive_entry depends on a call's modifiers only through which instance of each family (plain, "_mods" or none)
    serves them, so one set per such outcome stands for all of them (the smallest, none first)."""
    from . import _capi
    bits = list(_capi.SCORE_MOD_BITS.values())
    specs = _catalogue_specs(api, arch)
    families = {sp.algorithm.family: sp.guards for sp in specs}
    seen: dict[tuple, int] = {}
    for mods in sorted(range(1 << len(bits)), key=lambda m: (bin(m).count("1"), m)):
        value = sum(b for i, b in enumerate(bits) if mods >> i & 1)
        names = set(mod_names(value))
        outcome = tuple(("plain" if names <= set(g.plain_mods) else
                         "mods" if names <= set(g.plain_mods) | set(g.instance_mods) else None)
                        for _, g in sorted(families.items()))
        seen.setdefault(outcome, value)
    return sorted(seen.values())


def entries_within(api: str, arch: str, specs: Iterable) -> list[Entry]:
    """Every entry a call could derive on `arch` whose instances all lie in `specs` (e.g. a profile's selection):
    what ``prebuild`` builds so that those calls need no compiler."""
    pool = list(specs)
    allowed = {sp.name for sp in pool}
    found: dict[tuple, Entry] = {}
    dims = _representative_head_dims(api, arch)
    for dtype in DTYPES:
        for mode in MODES:
            for masked, mods in itertools.product((False, True), _representative_mods(api, arch)):
                for hq in dims:
                    for hv in dims:
                        try:
                            entry = derive_entry(api, arch, dtype, hq, hv, mode, masked, mods=mods)
                        except ValueError:
                            continue
                        names = tuple(entry.instance_names)
                        if names not in found and allowed.issuperset(names):
                            found[names] = entry
    return sorted(found.values(), key=lambda e: e.name)


# ------------------------------------------------------------------------------------------------------------------
# Toolchain (with a memoised version probe) and keys
# ------------------------------------------------------------------------------------------------------------------

def _memo_path(root: Path) -> Path:
    return root / "toolchains.json"


def _read_memo(root: Path) -> dict:
    """toolchains.json, or {} when it is missing or is not a JSON object (it is then rewritten by the next probe)."""
    memo = _read_json(_memo_path(root))
    return memo if isinstance(memo, dict) else {}


def _nvcc_version(path: str, root: Path, refresh: bool = False) -> str:
    """nvcc's version, memoised per nvcc file (realpath, size, mtime) in toolchains.json; refresh re-runs the probe."""
    real = os.path.realpath(path)
    st = os.stat(real)
    stamp = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    known = _read_memo(root).get(real)
    if not refresh and isinstance(known, dict) and all(known.get(k) == v for k, v in stamp.items()) and known.get("version"):
        return known["version"]
    version = _codegen.submodule("toolchain").probe_nvcc_version(path)
    memo = _read_memo(root)
    memo[real] = dict(stamp, version=version)
    try:
        _write_json_atomic(_memo_path(root), memo)
    except OSError:
        pass
    return version


def toolchain_for(arch: str, root: Path, refresh: bool = False):
    """(Nvcc or Hipcc, None) when this machine can build for `arch`, else (None, the reason in one sentence)."""
    tc = _codegen.submodule("toolchain")
    if tc.backend_of_arch(arch) == "rocm":
        target = _codegen.submodule("catalogue").load("rocm").arch(arch).target
        try:
            return tc.Hipcc.create(arch, target), None  # probes the compiler's version (one short run)
        except tc.ToolchainError as exc:
            return None, str(exc)
    gencode = _codegen.submodule("catalogue").load("cuda").arch(arch).gencode
    path = tc.locate_nvcc()
    if not path:
        return None, "nvcc was not found (install the CUDA toolkit, put nvcc on PATH or set CUDA_HOME / NVCC)"
    try:
        cutlass = tc.find_cutlass()
    except tc.ToolchainError as exc:
        return None, str(exc)
    return tc.Nvcc(arch=arch, gencode=gencode, path=path, version=_nvcc_version(path, root, refresh),
                   cutlass=cutlass), None


@dataclass
class Plan:
    """An entry with its keys: everything needed to find it in the cache or build it."""

    entry: Entry
    toolchain: object            # codegen.toolchain.Nvcc, or None (look up only)
    inputs: dict                 # codegen.build.build_inputs(): the key material, stored in the manifest
    source_key: str
    toolchain_key: Optional[str]
    key: Optional[str]           # None without a toolchain
    why_no_toolchain: Optional[str] = None

    @property
    def prefix(self) -> str:
        return f"{self.entry.name}-{self.source_key[:12]}"

    @property
    def dirname(self) -> Optional[str]:
        return f"{self.prefix}-{self.toolchain_key[:8]}" if self.toolchain_key else None


def make_plan(entry: Entry, toolchain, csrc: Optional[Path] = None, why_no_toolchain: Optional[str] = None) -> Plan:
    build = _codegen.submodule("build")
    request = build.BuildRequest(api=entry.api, arch=entry.arch, specs=list(entry.specs))
    inputs = build.build_inputs(request, toolchain, csrc=csrc)
    source = {k: v for k, v in inputs.items() if k != "toolchain"}
    source["format"] = FORMAT
    source_key = _sha256_json(source)
    tc = inputs.get("toolchain")
    toolchain_key = _sha256_json(tc) if tc else None
    key = hashlib.sha256(f"{source_key}:{toolchain_key}".encode()).hexdigest() if toolchain_key else None
    return Plan(entry, toolchain, inputs, source_key, toolchain_key, key, why_no_toolchain)


# ------------------------------------------------------------------------------------------------------------------
# Builders: produce the library of a plan inside a staging directory
# ------------------------------------------------------------------------------------------------------------------

Builder = Callable[[Plan, Path, Path, Optional[int]], Path]


def codegen_builder(plan: Plan, stage: Path, build_dir: Path, jobs: Optional[int]) -> Path:
    """The real builder: codegen.build.build() for exactly the plan's instances (compile.py's path), installing the
    library into `stage`. Compiler output is captured and reported only on failure."""
    build = _codegen.submodule("build")
    request = build.BuildRequest(api=plan.entry.api, arch=plan.entry.arch, specs=list(plan.entry.specs),
                                 build_dir=build_dir, install_dir=stage, jobs=jobs, capture_output=True,
                                 toolchain=plan.toolchain)
    try:
        result = build.build(request, log=lambda *_: None)
    except build.BuildError as exc:
        raise JitError(f"building {plan.entry.name} failed: {exc}") from None
    return stage / result.library.name


# ------------------------------------------------------------------------------------------------------------------
# The cache
# ------------------------------------------------------------------------------------------------------------------

@contextmanager
def _locked(path: Path, what: str, log: Callable[[str], None]):
    """An exclusive lock on `path` between processes (codegen/locks.py); says once that it waits for another."""
    with _codegen.submodule("locks").exclusive(
            path, lambda: log(f"[mhakit] waiting for another process that is building {what}")):
        yield


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. EPERM: it exists
        return True
    return True


def _tree_bytes(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


class KernelCache:
    """Built libraries under ``<root>/v<FORMAT>/``. `builder` makes a plan's library (the real one by default; tests
    inject fakes); `log` receives the progress lines (stderr by default)."""

    def __init__(self, root: Optional[Path] = None, builder: Optional[Builder] = None,
                 log: Optional[Callable[[str], None]] = None):
        self.base = Path(os.path.abspath(Path(root).expanduser() if root is not None else cache_dir()))
        self.root = self.base / f"v{FORMAT}"
        self.builder = builder or codegen_builder
        self.log = log or _log_stderr

    # --- layout -------------------------------------------------------------------------------------------------
    def entry_dir(self, plan: Plan) -> Path:
        return self.root / plan.entry.api / plan.dirname

    def lock_path(self, plan: Plan) -> Path:
        return self.root / "locks" / f"{plan.dirname}.lock"

    @property
    def tmp_dir(self) -> Path:
        return self.root / "tmp"

    # --- writing ------------------------------------------------------------------------------------------------
    def _unwritable(self, exc: OSError, needed_for: str, prebuilding: bool = False) -> CacheDirError:
        where = exc.filename or self.root
        remedy = f"set {ENV_CACHE_DIR} to a writable directory" + (
            "" if prebuilding else ", or fill this cache ahead of time with `python -m mhakit prebuild` for this "
                                   "configuration")
        return CacheDirError(f"the kernel cache {self.base} cannot be written ({exc.strerror or exc}: {where}), so "
                             f"{needed_for} cannot be built into it: {remedy}")

    def require_writable(self, needed_for: str, prebuilding: bool = False) -> None:
        """Raise CacheDirError (one sentence: which directory, what to do) unless builds can be written here."""
        try:
            for directory in (self.tmp_dir, self.root / "locks"):
                directory.mkdir(parents=True, exist_ok=True)
                if not os.access(directory, os.W_OK | os.X_OK):
                    raise OSError(errno.EACCES, "not writable", str(directory))
        except OSError as exc:
            raise self._unwritable(exc, needed_for, prebuilding) from None

    @contextmanager
    def _work_dir(self, prefix: str):
        """A fresh directory tmp/<prefix>.<pid>.<random>, removed when the block ends. This process owns it by
        holding the lock on its .owner file, so that a later process can tell a dead build's leftovers
        (sweep_tmp) from a live build's directory."""
        locks = _codegen.submodule("locks")
        work = self.tmp_dir / f"{prefix}.{os.getpid()}.{secrets.token_hex(4)}"
        work.mkdir(parents=True)
        fd = locks.try_take(work / ".owner.new", create=True)
        try:
            if fd is not None:
                os.replace(work / ".owner.new", work / ".owner")  # .owner exists only while locked
            yield work
        finally:
            shutil.rmtree(work, ignore_errors=True)
            if fd is not None:
                os.close(fd)

    @staticmethod
    def install(stage: Path, final: Path, work: Path) -> None:
        """Move a completed entry (its manifest written last) from `stage` to `final` atomically; an entry there
        that failed its check is first moved aside into `work` (removed with it)."""
        final.parent.mkdir(parents=True, exist_ok=True)
        if final.exists():
            os.replace(final, work / "replaced")
        os.replace(stage, final)

    def _claim_if_dead(self, directory: Path):
        """For a directory under tmp/ whose owner is gone: a lock descriptor to close after removing it (-1 when
        it has no .owner file, as builds of older versions left them, and the pid in its name is gone); else None."""
        owner = directory / ".owner"
        if owner.exists():
            return _codegen.submodule("locks").try_take(owner)
        try:
            pid = int(directory.name.rsplit(".", 2)[1])
        except (IndexError, ValueError):
            return None
        return None if _pid_alive(pid) else -1

    def _dead_tmp(self, remove: bool) -> list[tuple[Path, int]]:
        found = []
        try:
            children = sorted(p for p in self.tmp_dir.iterdir() if p.is_dir())
        except OSError:
            return found
        for directory in children:
            fd = self._claim_if_dead(directory)
            if fd is None:
                continue
            try:
                found.append((directory, _tree_bytes(directory)))
                if remove:
                    shutil.rmtree(directory, ignore_errors=True)
            finally:
                if fd >= 0:
                    os.close(fd)
        return found

    def stale_tmp(self) -> list[tuple[Path, int]]:
        """Build directories under tmp/ left by processes that died (killed builds and prebuilds), with their
        sizes in bytes."""
        return self._dead_tmp(remove=False)

    def sweep_tmp(self) -> int:
        """Remove what stale_tmp() lists; returns how many directories went. Builds call it before they start."""
        return len(self._dead_tmp(remove=True))

    # --- lookup -------------------------------------------------------------------------------------------------
    @staticmethod
    def check_entry(directory: Path, *, key: Optional[str] = None, source_key: Optional[str] = None) -> Optional[Path]:
        """The library of a complete, intact entry, else None: the manifest parses, names the expected key (or
        source key), and the library's size and sha256 match it."""
        manifest = _read_json(directory / "manifest.json")
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            return None
        if key is not None and manifest.get("key") != key:
            return None
        if source_key is not None and manifest.get("source_key") != source_key:
            return None
        name = manifest.get("library")
        if not isinstance(name, str) or "/" in name:
            return None
        lib = directory / name
        try:
            if lib.stat().st_size != manifest.get("size"):
                return None
            if _file_sha256(lib) != manifest.get("sha256"):
                return None
        except OSError:
            return None
        return lib

    def find(self, plan: Plan) -> Optional[Path]:
        """The plan's library if the cache holds it intact. Without a toolchain: any intact entry of the same
        sources, whichever compiler built it."""
        if plan.dirname is not None:
            return self.check_entry(self.entry_dir(plan), key=plan.key)
        api_dir = self.root / plan.entry.api
        if not api_dir.is_dir():
            return None
        for directory in sorted(api_dir.glob(f"{plan.prefix}-*")):
            lib = self.check_entry(directory, source_key=plan.source_key)
            if lib is not None:
                return lib
        return None

    # --- building -----------------------------------------------------------------------------------------------
    def ensure(self, plan: Plan, *, jobs: Optional[int] = None, build_dir: Optional[Path] = None,
               quiet: bool = False, probe: bool = True) -> Path:
        """The plan's library, building it first if the cache lacks it (once across processes). `probe`: re-run
        `nvcc --version` before a real build (prebuild probes once for all its entries)."""
        lib = self.find(plan)
        if lib is not None:
            return lib
        if plan.toolchain is None or plan.dirname is None:
            raise NoCompilerError(
                f"the kernels for this call ({plan.entry.name}) are not in the cache {self.root} and they cannot be "
                f"built here: {plan.why_no_toolchain or 'no toolchain'}. Fill a cache ahead of time with "
                "`python -m mhakit prebuild` on a machine with the CUDA toolkit and point MHAKIT_CACHE_DIR at it.")
        if probe and self.builder is codegen_builder:
            plan = self._with_probed_toolchain(plan)
            lib = self.find(plan)
            if lib is not None:
                return lib
        needed_for = f"the kernels for this call ({plan.entry.name})"
        self.require_writable(needed_for)
        try:
            with _locked(self.lock_path(plan), plan.entry.name, self.log):
                lib = self.find(plan)  # another process may have built it while we waited
                if lib is not None:
                    return lib
                return self._build_locked(plan, jobs, build_dir, quiet)
        except OSError as exc:  # e.g. the disk filled up, or the cache was made read-only meanwhile
            raise self._unwritable(exc, needed_for) from None

    def _with_probed_toolchain(self, plan: Plan) -> Plan:
        """A real build runs nvcc anyway: re-probe its version (cheap next to a build) so that a stale memo can never
        file a library under the wrong key."""
        tc = plan.toolchain
        if tc.backend == "rocm":  # Hipcc probed its version when it was made, just now
            return plan
        version = _nvcc_version(tc.path, self.root, refresh=True)
        if version == tc.version:
            return plan
        fresh = type(tc)(arch=tc.arch, gencode=tc.gencode, path=tc.path, version=version, cutlass=tc.cutlass)
        return make_plan(plan.entry, fresh)

    def _build_locked(self, plan: Plan, jobs: Optional[int], build_dir: Optional[Path], quiet: bool) -> Path:
        self.sweep_tmp()
        with self._work_dir(plan.dirname) as work:
            return self._build_in(plan, work, jobs, build_dir, quiet)

    def _build_in(self, plan: Plan, work: Path, jobs: Optional[int], build_dir: Optional[Path], quiet: bool) -> Path:
        stage = work / "entry"
        stage.mkdir()
        final = self.entry_dir(plan)
        n = len(plan.entry.specs)
        if not quiet:
            version = getattr(plan.toolchain, "version", "?")
            self.log(f"[mhakit] first use of {plan.entry.name}: building {n} kernel instance{'s' if n != 1 else ''} "
                     f"for {plan.entry.arch} with nvcc {version} (-j{jobs or os.cpu_count() or 1}) into "
                     f"{final.parent}; this happens once, later calls and processes load it")
        start = time.monotonic()
        library = Path(self.builder(plan, stage, Path(build_dir) if build_dir else work / "build", jobs))
        if library.parent != stage or not library.is_file():
            raise JitError(f"the builder did not leave a library in {stage} (got {library})")
        with open(library, "rb") as f:
            os.fsync(f.fileno())
        seconds = time.monotonic() - start
        manifest = {
            "format": FORMAT,
            "name": plan.entry.name,
            "api": plan.entry.api,
            "arch": plan.entry.arch,
            "instances": plan.entry.instance_names,
            "key": plan.key,
            "source_key": plan.source_key,
            "toolchain_key": plan.toolchain_key,
            "library": library.name,
            "size": library.stat().st_size,
            "sha256": _file_sha256(library),
            "build_seconds": round(seconds, 2),
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),  # information only; never part of a key
            "inputs": plan.inputs,
        }
        _write_json_atomic(stage / "manifest.json", manifest)  # last: its presence completes the entry
        self.install(stage, final, work)
        if not quiet:
            self.log(f"[mhakit] built {plan.entry.name} in {time.monotonic() - start:.1f} s")
        return final / library.name

    # --- the per-call path ------------------------------------------------------------------------------------
    def _index_path(self, kind: str, index_key: str) -> Path:
        return self.root / "index" / kind / f"{index_key}.json"

    def _from_index(self, kind: str, index_key: str) -> Optional[Path]:
        """The library an index record points at, if that entry passes its check."""
        record = _read_json(self._index_path(kind, index_key))
        if not isinstance(record, dict) or not isinstance(record.get("entry"), str) or ".." in record["entry"]:
            return None
        directory = self.root / record["entry"]
        if record.get("key"):
            return self.check_entry(directory, key=record["key"])
        if record.get("source_key"):
            return self.check_entry(directory, source_key=record["source_key"])
        return None

    def _remember(self, kind: str, index_key: str, plan: Plan, lib: Path) -> None:
        record = {"entry": f"{plan.entry.api}/{lib.parent.name}"}
        record.update({"key": plan.key} if plan.key else {"source_key": plan.source_key})
        try:
            _write_json_atomic(self._index_path(kind, index_key), record)
        except OSError:  # a read-only cache still serves; it just cannot remember shortcuts
            pass

    def remember_entry(self, plan: Plan, lib: Path) -> None:
        """Index an entry by its instances (prebuild does this for every library it fills in)."""
        self._remember("entries", _entry_key(plan.entry, self.root), plan, lib)

    def library_for(self, api: str, arch: str, dtype: str, hdim_q: int, hdim_v: int, mode: str, masked: bool,
                    jobs: Optional[int] = None, mods: int = 0) -> Path:
        """The library a call needs: from the call index (no derivation, no rendering), the entry index (derivation
        only: a prebuilt cache), or by computing the entry's keys and finding or building it. mods: the score
        modifiers the call sets (mhakit_score_mod bits; derive_entry)."""
        call_key = _call_key(api, arch, dtype, hdim_q, hdim_v, mode, masked, self.root, mods)
        lib = self._from_index("calls", call_key)
        if lib is not None:
            return lib
        entry = derive_entry(api, arch, dtype, hdim_q, hdim_v, mode, masked, mods=mods)
        entry_key = _entry_key(entry, self.root)
        lib = self._from_index("entries", entry_key)
        if lib is not None:
            record = _read_json(self._index_path("entries", entry_key))
            try:
                _write_json_atomic(self._index_path("calls", call_key), record)
            except OSError:
                pass
            return lib
        toolchain, why = toolchain_for(arch, self.root)
        plan = make_plan(entry, toolchain, why_no_toolchain=why)
        lib = self.ensure(plan, jobs=jobs)
        self._remember("entries", entry_key, plan, lib)
        self._remember("calls", call_key, plan, lib)
        return lib

    # --- inspection ---------------------------------------------------------------------------------------------
    def entries(self) -> list[dict]:
        """Every entry directory with its manifest summary and whether it passes its check."""
        out = []
        for api_dir in sorted(p for p in self.root.glob("*")
                              if p.is_dir() and p.name not in ("locks", "tmp", "index", "ext")):
            for directory in sorted(p for p in api_dir.iterdir() if p.is_dir()):
                manifest = _read_json(directory / "manifest.json")
                manifest = manifest if isinstance(manifest, dict) else {}
                ok = self.check_entry(directory, key=manifest.get("key"), source_key=manifest.get("source_key"))
                instances = manifest.get("instances")
                out.append({"dir": str(directory), "name": str(manifest.get("name", directory.name)),
                            "instances": instances if isinstance(instances, list) else [], "ok": ok is not None,
                            "build_seconds": manifest.get("build_seconds")})
        return out

    def clear(self) -> list[str]:
        """Remove this cache format's tree (entries, index, memo). Callers must not be building meanwhile. Returns
        what could not be removed ("path: reason"; empty when everything went)."""
        failures: list[str] = []

        def failed(_function, path, exc_info):
            exc = exc_info[1]
            failures.append(f"{path}: {exc.strerror if isinstance(exc, OSError) and exc.strerror else exc}")

        if os.path.lexists(self.root):
            shutil.rmtree(self.root, onerror=failed)
        return failures


# ------------------------------------------------------------------------------------------------------------------
# Call keys for the index: the call signature and what determines its entry, without rendering anything
# ------------------------------------------------------------------------------------------------------------------

_TREE_DIGEST: Optional[str] = None


def _tree_digest() -> str:
    """sha256 over the generator (its Python and data), the templates and every csrc file, and this module (the
    derivation rules): everything an entry's sources are rendered from. Computed once per process."""
    global _TREE_DIGEST
    if _TREE_DIGEST is None:
        dirs = _codegen.source_dirs()
        h = hashlib.sha256()
        files = []
        for label, directory in sorted(dirs.items()):
            for path in sorted(directory.rglob("*")):
                if path.is_file() and "__pycache__" not in path.parts and path.suffix not in (".pyc",):
                    files.append((f"{label}/{path.relative_to(directory).as_posix()}", path))
        files.append(("mhakit/jit.py", Path(__file__)))
        for rel, path in files:
            h.update(rel.encode() + b"\0" + path.read_bytes() + b"\0")
        _TREE_DIGEST = h.hexdigest()
    return _TREE_DIGEST


_TOOLCHAIN_IDENTITY: dict = {}


def _toolchain_identity(root: Path):
    """(nvcc version or None, CUTLASS version or None) from the memo, without running anything."""
    ident = _TOOLCHAIN_IDENTITY.get(root)
    if ident is None:
        tc = _codegen.submodule("toolchain")
        path = tc.locate_nvcc()
        version = None
        if path:
            try:
                version = _nvcc_version(path, root)
            except (OSError, tc.ToolchainError):
                version = None
        try:
            cutlass = tc.cutlass_version(tc.find_cutlass())
        except tc.ToolchainError:
            cutlass = None
        ident = _TOOLCHAIN_IDENTITY[root] = (version, cutlass)
    return ident


def _call_key(api, arch, dtype, hdim_q, hdim_v, mode, masked, root: Path, mods: int = 0) -> str:
    return _sha256_json([FORMAT, "call", api, arch, dtype, hdim_q, hdim_v, mode, bool(masked), int(mods),
                         _tree_digest(), list(_toolchain_identity(root))])


def _entry_key(entry: Entry, root: Path) -> str:
    return _sha256_json([FORMAT, "entry", entry.api, entry.arch, entry.instance_names, _tree_digest(),
                         list(_toolchain_identity(root))])


# ------------------------------------------------------------------------------------------------------------------
# Per process: call signature -> loaded library
# ------------------------------------------------------------------------------------------------------------------

def _load_fwd(path: Path):
    from . import _capi
    return _capi.load_library(path)


def _load_bwd(path: Path):
    from . import _capi
    return _capi.load_bwd_library(path)


# How each API's library is loaded: libmha_fwd.so as _capi.FwdLibrary, libmha_bwd.so as _capi.BwdLibrary.
LOADERS: dict[str, Callable[[Path], object]] = {"fwd": _load_fwd, "bwd": _load_bwd, "splitkv": _load_fwd}

_LIBS: dict = {}
_LIBS_LOCK = threading.RLock()
_ARCHS: dict = {}
_DEFAULT_CACHE: list = []


def default_cache() -> KernelCache:
    """The process's cache object for cache_dir() (re-created if MHAKIT_CACHE_DIR changes)."""
    base = Path(os.path.abspath(cache_dir()))
    if not _DEFAULT_CACHE or _DEFAULT_CACHE[0].base != base:
        _DEFAULT_CACHE[:] = [KernelCache(base)]
    return _DEFAULT_CACHE[0]


def device_arch(device: int, backend: str = "cuda") -> str:
    """The arch mhakit builds for device `device` of `backend` (its device layer, mhakit._device, asks the device:
    sm_90a on H100/H200, gfx942 on MI300X)."""
    arch = _ARCHS.get((backend, device))
    if arch is None:
        from . import _device
        arch = _ARCHS[(backend, device)] = _device.layer(backend).device_arch(device)
    return arch


def library(api: str, device: int, dtype: str, hdim_q: int, hdim_v: int, mode: str, masked: bool,
            backend: str = "cuda", mods: int = 0):
    """The loaded library serving a call on `device` of `backend` ("cuda", or "rocm" for a ROCm array) (memoised: a
    dict lookup after the first call): a _capi.FwdLibrary for api "fwd", a _capi.BwdLibrary for "bwd". mods: the
    score modifiers the call sets (mhakit_score_mod bits), which decide the instances (derive_entry)."""
    key = (api, device, dtype, hdim_q, hdim_v, mode, masked, backend, int(mods))
    lib = _LIBS.get(key)
    if lib is not None:
        return lib
    if api not in LOADERS:
        raise ValueError(f"api must be one of {sorted(LOADERS)}, got {api!r}")
    with _LIBS_LOCK:
        lib = _LIBS.get(key)
        if lib is None:
            arch = device_arch(device, backend)
            path = default_cache().library_for(api, arch, dtype, hdim_q, hdim_v, mode, masked, mods=mods)
            lib = _LIBS[key] = LOADERS[api](path)
    return lib


# ------------------------------------------------------------------------------------------------------------------
# Ahead of time
# ------------------------------------------------------------------------------------------------------------------

def _backends_present() -> tuple:
    """The backends whose GPUs this machine may have, in the order default_arch asks them: an AMD-only machine
    (ROCm's /dev/kfd, no /dev/nvidia*) is asked through HIP only, so that nothing CUDA-specific is imported there;
    any other machine is asked through CUDA first, as before the ROCm layer existed."""
    import glob
    if os.path.exists("/dev/kfd") and not glob.glob("/dev/nvidia*"):
        return ("rocm",)
    return ("cuda", "rocm")


def default_arch() -> str:
    """The arch of GPU 0 when one is usable (an NVIDIA GPU through cuda-bindings, an AMD GPU through hip-python),
    else what codegen.toolchain.detect_arch() says (sm_90a without one)."""
    from . import _device
    for backend in _backends_present():
        try:
            if _device.layer(backend).device_count() > 0:
                return device_arch(0, backend)
        except Exception:
            continue
    return _codegen.submodule("toolchain").detect_arch()


def _prebuild_compile(cache: KernelCache, api: str, arch: str, todo: list, toolchain, objects: Path, shared: Path,
                      jobs: Optional[int], log) -> None:
    """prebuild's work: every instance object and every library's dispatch table of `todo` in one parallel ninja run
    in the build directory `objects`, then each library's link, installed into the cache (`shared`: scratch)."""
    build = _codegen.submodule("build")
    start = time.monotonic()
    union = sorted({sp.name: sp for p in todo for sp in p.entry.specs}.values(), key=lambda sp: sp.name)
    log(f"[mhakit] compiling {len(union)} kernel instances with {toolchain.label} {toolchain.version} "
        f"(-j{jobs or os.cpu_count() or 1})")
    request = build.BuildRequest(api=api, arch=arch, specs=union, build_dir=objects,
                                 install_dir=shared / "all", jobs=jobs, capture_output=True, toolchain=toolchain,
                                 also_dispatch=[list(p.entry.specs) for p in todo])
    try:
        build.build(request, log=lambda *_: None)
    except build.BuildError as exc:
        raise JitError(f"prebuild failed: {exc}") from None
    log(f"[mhakit] compiled in {time.monotonic() - start:.1f} s; linking {len(todo)} libraries")
    for i, plan in enumerate(todo, 1):
        cache.ensure(plan, jobs=jobs, build_dir=objects, quiet=True, probe=False)
        log(f"[mhakit] [{i}/{len(todo)}] {plan.entry.name}")
    log(f"[mhakit] prebuild finished in {time.monotonic() - start:.1f} s")


def _require_build_dir(path: Path) -> None:
    """prebuild's --build-dir: a directory this process can create and write, else one sentence (JitError)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise JitError(f"the build directory {path} cannot be created ({exc.strerror or exc}); give --build-dir a "
                       "writable directory") from None
    if not path.is_dir() or not os.access(path, os.W_OK | os.X_OK):
        raise JitError(f"the build directory {path} is not a writable directory; give --build-dir a writable one")


def prebuild(profile: str = "default", arch: Optional[str] = None, *, api: str = "fwd",
             name_filter: Optional[str] = None, jobs: Optional[int] = None, cache: Optional[KernelCache] = None,
             quiet: bool = False, build_dir: Optional[Path] = None) -> list[Path]:
    """Fill the cache with every library a call of `api` ("fwd": mha_fwd / mha_varlen_fwd / mha_fwd_kvcache, "bwd":
    mha_bwd / mha_varlen_bwd) could need within a build profile (see codegen/profiles.toml), so that deployment needs no
    compiler. Reuses the JIT path: the same entries, keys and atomic installs. All instance objects are compiled
    first in one parallel ninja run, with every library's dispatch table; each library then only links. Returns the
    library paths. Already cached entries are kept. `build_dir`: keep the objects there (compile.py's --build-dir
    layout, so a prebuild after compile.py, or a second prebuild, recompiles nothing) instead of in a temporary
    directory."""
    if api not in LOADERS or _library_api(api) != api:
        raise ValueError(f"api must be one of {sorted(a for a in LOADERS if _library_api(a) == a)}, got {api!r}")
    cache = cache or default_cache()
    log = (lambda *_: None) if quiet else cache.log
    arch = arch or default_arch()
    tc_mod = _codegen.submodule("toolchain")
    tc_mod.require_available_backend(arch)
    profiles = _codegen.submodule("profiles")
    selection = profiles.select(api, arch, profile, name_filter)
    # The forward library also holds the split-KV (decode) instances: their entries come along.
    entries = [e for lib_api in LOADERS if _library_api(lib_api) == api
               for e in entries_within(lib_api, arch, selection.specs)]
    if not entries:
        raise profiles.SelectionError(
            f"profile '{profile}'{' with filter ' + name_filter if name_filter else ''} holds no complete {api} "
            f"library for {arch}: each needs every instance the runtime may choose for a call (on CUDA its fast "
            "instance and the generic fallback; on ROCm every tile and padding/LSE variant of its bucket)")
    toolchain, why = toolchain_for(arch, cache.root, refresh=True)
    plans = [make_plan(e, toolchain, why_no_toolchain=why) for e in entries]
    todo = [p for p in plans if cache.find(p) is None]
    if not todo:
        log(f"[mhakit] prebuild {api} (profile {profile}) for {arch}: all {len(plans)} libraries already in "
            f"{cache.root}")
    else:
        if toolchain is None:
            raise NoCompilerError(f"prebuild needs a toolchain: {why}")
        needed_for = f"the {api} libraries of profile {profile}"
        cache.require_writable(needed_for, prebuilding=True)
        if build_dir is not None:
            _require_build_dir(Path(build_dir))
        try:
            # One prebuild per (api, arch) at a time: a second one waits, then finds the libraries the first built.
            with _locked(cache.root / "locks" / f"prebuild-{api}-{arch}.lock", f"{api} libraries for {arch}", log):
                todo = [p for p in plans if cache.find(p) is None]
                log(f"[mhakit] prebuild {api} (profile {profile}) for {arch}: {len(plans)} libraries, "
                    f"{len(plans) - len(todo)} already in {cache.root}")
                if todo:
                    cache.sweep_tmp()
                    with cache._work_dir("prebuild") as shared:
                        objects = Path(build_dir).resolve() if build_dir is not None else shared / "build"
                        _prebuild_compile(cache, api, arch, todo, toolchain, objects, shared, jobs, log)
        except OSError as exc:
            raise cache._unwritable(exc, needed_for, prebuilding=True) from None
    paths = []
    for plan in plans:
        lib = cache.find(plan)
        if lib is None:  # pragma: no cover - ensure() raised already
            raise JitError(f"{plan.entry.name} is missing after prebuild")
        cache.remember_entry(plan, lib)  # a first call then finds it without rendering (see library_for)
        paths.append(lib)
    # The C call path belongs in a deployment's cache too (keyed by this Python's ABI tag); without a C compiler
    # here, calls there take the pure-Python path.
    from . import _ext
    try:
        _ext.build(cache, quiet=quiet)
    except (_ext.ExtError, JitError, OSError) as exc:
        log(f"[mhakit] the C call path was not built into the cache ({str(exc).splitlines()[0]}); calls will take "
            "the slower pure-Python path")
    return paths
