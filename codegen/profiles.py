"""Enumerate kernel specs from the catalogue and narrow them by a named profile and a name filter."""
from __future__ import annotations

import fnmatch
import itertools
import tomllib
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from . import catalogue as catalogue_mod
from .catalogue import backend_of_arch
from .rules import violations
from .spec import Algorithm, Guards, KernelSpec, Signature

PROFILES_FILE = Path(__file__).resolve().parent / "profiles.toml"
PROFILE_KEYS = ("api", "dtype", "hdim", "mode", "mask", "family")
# A profile's `mods` key narrows its modifier instances (Signature.mods) further: a table of the keys above (what the
# profile keeps of them), a list of such tables (it keeps what any of them keeps), or false (none). Without it the
# profile keeps the modifier instances of every plain one.
MODS_KEY = "mods"
# A profile with `candidates = true` also enumerates the catalogue's tuning candidates (tiles marked `candidate`), each
# an alternative to the tile that serves the same instances: for sweeps, one candidate per library (select refuses
# a selection holding a candidate and another instance of the same family and signature).
CANDIDATES_KEY = "candidates"

# The public API names that compile.py accepts. *_v3 builds the same library from the arch-specialised
# families only (catalogue `v3 = true`), as aiter's fwd_v3/bwd_v3 builds keep only its hand-tuned kernels.
APIS = {"fwd": ("fwd", False), "fwd_v3": ("fwd", True), "bwd": ("bwd", False), "bwd_v3": ("bwd", True)}


class SelectionError(ValueError):
    """The request selects nothing or names something unknown; the message says what and what exists."""


@lru_cache(maxsize=None)
def load_profiles() -> dict[str, dict]:
    with open(PROFILES_FILE, "rb") as f:
        profiles = tomllib.load(f)
    for name, body in profiles.items():
        unknown = set(body) - set(PROFILE_KEYS) - {"description", MODS_KEY, CANDIDATES_KEY}
        if unknown:
            raise SelectionError(f"profiles.toml: profile '{name}' has unknown keys {sorted(unknown)}")
        mods = body.get(MODS_KEY, {})
        tables = mods if isinstance(mods, list) else [mods]
        if mods is not False and not (tables and all(isinstance(t, dict) and set(t) <= set(PROFILE_KEYS)
                                                     for t in tables)):
            raise SelectionError(f"profiles.toml: profile '{name}': `{MODS_KEY}` must be false, a table of "
                                 f"{', '.join(PROFILE_KEYS)} or a list of such tables")
        if not isinstance(body.get(CANDIDATES_KEY, False), bool):
            raise SelectionError(f"profiles.toml: profile '{name}': `{CANDIDATES_KEY}` must be true or false")
    return profiles


@dataclass
class Selection:
    specs: list[KernelSpec]
    rejected: list[tuple[str, list[str]]] = field(default_factory=list)  # (name, reasons) dropped by rules
    candidates: frozenset[str] = frozenset()  # the names of specs made from candidate tiles (catalogue `candidate`)


def _variant_choices(fam: catalogue_mod.Family) -> list[tuple[tuple[tuple[str, str], ...], int]]:
    """Every combination of the family's variant values with its rank (higher = preferred: earlier values first)."""
    choices = [((), 0)]
    for axis, values in fam.variants:
        choices = [(chosen + ((axis, value),), rank * len(values) + (len(values) - 1 - i))
                   for chosen, rank in choices for i, value in enumerate(values)]
    return choices


# A family with variants ranks its instances inside its own priority: priority * VARIANT_SCALE + variant rank.
VARIANT_SCALE = 100


def enumerate_specs(api: str, arch: str, backend: str | None = None, candidates: bool = False) -> Selection:
    """Every spec the catalogue describes for this API and arch (the backend's catalogue: by default the one the
    arch belongs to), split into valid and rejected-by-rules; with candidates, the tiles marked `candidate` too."""
    backend = backend or backend_of_arch(arch)
    if api not in APIS:
        raise SelectionError(f"unknown api '{api}' (choose from {', '.join(APIS)})")
    base_api, v3_only = APIS[api]
    cat = catalogue_mod.load(backend)
    arch_record = cat.arch(arch)
    selection = Selection(specs=[])
    seen: dict[str, str] = {}
    candidate_names: set[str] = set()
    families = [fam for lib_api in catalogue_mod.APIS if catalogue_mod.LIBRARY_OF_API[lib_api] == base_api
                for fam in cat.families_for(lib_api, arch)]
    for fam in families:
        if v3_only and not fam.v3:
            continue
        knobs = (*cat.tables, *arch_record.traits, *fam.knobs)
        # A family with the score modifiers has a modifier instance beside each plain one.
        mods_choices = (False, True) if fam.has_mod_instances else (False,)
        # The signatures whose batch-mode plain instances a plain_batch tile gives (catalogue), in place of the
        # default tile's.
        plain_batch = {(t.hdim_q, t.hdim_v, dtype, mask) for t in fam.tiles if t.plain_batch and not t.candidate
                       for dtype in fam.dtypes for mask in fam.masks if t.serves(dtype, "batch", mask)}
        for tile, dtype, mode, mask, (variant, rank), mods in itertools.product(
                fam.tiles, fam.dtypes, fam.modes, fam.masks, _variant_choices(fam), mods_choices):
            if not tile.serves(dtype, mode, mask):  # a tile narrowed to some dtypes / modes / masks (catalogue)
                continue
            if tile.candidate and not candidates:
                continue
            if mods and not tile.has_mods:  # catalogue `plain_only`: modifier calls run on the default tile
                continue
            if not mods and not tile.has_plain:  # catalogue `mods_only`: plain calls run on a plain_only tile
                continue
            if (not mods and mode == "batch" and not tile.plain_batch and tile.seqlen_q is None and not tile.candidate
                    and (tile.hdim_q, tile.hdim_v, dtype, mask) in plain_batch):
                continue  # a plain_batch tile gives these
            spec = KernelSpec(
                signature=Signature(fam.api, dtype, tile.hdim_q, tile.hdim_v, mode, mask, mods),
                algorithm=Algorithm(fam.name, arch, tile.params, variant, candidate=tile.candidate),
                priority=fam.priority * VARIANT_SCALE + rank if fam.variants else fam.priority,
                template=fam.template,
                guards=Guards.of(fam),
                knobs=knobs,
                seqlen_q=tile.seqlen_q,
                unmasked_mods=mods and tile.unmasked_mods,
            )
            reasons = violations(spec, backend)
            if reasons:
                selection.rejected.append((spec.name, reasons))
                continue
            if spec.name in seen:
                raise catalogue_mod.CatalogueError(
                    f"{backend}.toml: two {api} entries for {arch} are both named {spec.name}; "
                    "tiles of one family and head dim must differ in their block sizes")
            seen[spec.name] = fam.name
            selection.specs.append(spec)
            if tile.candidate:
                candidate_names.add(spec.name)
    selection.candidates = frozenset(candidate_names)
    return selection


def _profile_admits(profile: dict, spec: KernelSpec) -> bool:
    s = spec.signature
    values = {
        "api": s.api,
        "dtype": s.dtype,
        "hdim": f"{s.hdim_q}x{s.hdim_v}",
        "mode": s.mode,
        "mask": s.mask,
        "family": spec.algorithm.family,
    }
    if not all(values[key] in profile[key] for key in PROFILE_KEYS if key in profile):
        return False
    if not s.mods:
        return True
    mods = profile.get(MODS_KEY, {})
    if mods is False:
        return False
    tables = mods if isinstance(mods, list) else [mods]

    def kept(vals: dict) -> bool:
        return any(all(vals[key] in t[key] for key in PROFILE_KEYS if key in t) for t in tables)

    # A tile with the catalogue's unmasked_mods gives its unmasked modifier calls an unmasked "_mods" instance in
    # place of the masked one they would otherwise run on: it goes wherever the profile keeps that masked instance,
    # so that no profile restates which tiles have one (the top-level keys above still apply: mask = ["mask"] drops
    # it).
    return kept(values) or (spec.unmasked_mods and s.mask == "nmask" and kept({**values, "mask": "mask"}))


def select(api: str, arch: str, profile: str = "default", name_filter: str | None = None,
           backend: str | None = None) -> Selection:
    """The specs to build. name_filter holds comma-separated globs matched anywhere in an instance's name (a bare
    word is a substring match); a spec is kept when any pattern matches."""
    profiles = load_profiles()
    if profile not in profiles:
        raise SelectionError(f"unknown profile '{profile}' (choose from {', '.join(profiles)})")
    backend = backend or backend_of_arch(arch)
    selection = enumerate_specs(api, arch, backend, candidates=profiles[profile].get(CANDIDATES_KEY, False))
    if not selection.specs and not selection.rejected:
        raise SelectionError(f"the {backend} catalogue has no kernel family for api '{api}' on {arch} yet")
    specs = [s for s in selection.specs if _profile_admits(profiles[profile], s)]
    if name_filter:
        patterns = [f"*{p}*" for p in name_filter.split(",") if p]
        specs = [s for s in specs if any(fnmatch.fnmatchcase(s.name, p) for p in patterns)]
    if not specs:
        what = f"profile '{profile}'" + (f" with filter '{name_filter}'" if name_filter else "")
        raise SelectionError(f"{what} selects no {api} instance for {arch}; try `--list` to see the names")
    # A candidate tile is an alternative, not an addition: the runtime could not tell it from the instance of the
    # same family and signature beside it, so a library holds one of them.
    for spec in specs:
        if spec.name in selection.candidates:
            rivals = sorted(s.name for s in specs if s is not spec and s.algorithm.family == spec.algorithm.family
                            and s.signature == spec.signature)
            if rivals:
                raise SelectionError(f"{spec.name} is a candidate tile of the same instance as {', '.join(rivals)}: "
                                     "build one of them per library (narrow with --filter)")
    specs.sort(key=lambda s: s.name)
    return Selection(specs, selection.rejected, selection.candidates & {s.name for s in specs})
