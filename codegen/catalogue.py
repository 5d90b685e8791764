"""Read a backend's catalogue (codegen/catalogue/<backend>.toml) into plain, typed records."""
from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

CATALOGUE_DIR = Path(__file__).resolve().parent / "catalogue"


class CatalogueError(ValueError):
    """The catalogue file is malformed; the message names the file and the entry."""


def backend_of_arch(arch: str) -> str:
    """Which backend's catalogue an arch name belongs to: gfx* is ROCm, sm_* is CUDA."""
    if re.fullmatch(r"gfx[0-9a-f]+", arch):
        return "rocm"
    if re.fullmatch(r"sm_\d+a?", arch):
        return "cuda"
    raise CatalogueError(f"unknown arch '{arch}': use an NVIDIA target such as sm_90a or sm_80, "
                         "or an AMD target such as gfx942, gfx90a or gfx950")


@dataclass(frozen=True)
class Tile:
    hdim_q: int
    hdim_v: int
    params: tuple[tuple[str, int], ...]  # the family's tile parameters (block_m, block_n, warps, ...) in file order
    # Optional narrowing of the family's dtypes / modes for this tile (None: all of the family's), so that a dtype
    # with tiles of its own (the Hopper forward's fp8) lists them beside the others.
    # `masks` likewise narrows the family's mask classes, so that a bucket may use one tile unmasked and another
    # masked.
    dtypes: tuple[str, ...] | None = None
    modes: tuple[str, ...] | None = None
    masks: tuple[str, ...] | None = None
    # A tuning candidate (catalogue `candidate = true`): an alternative to the tile that serves the same instances,
    # left out of every instance set (the profiles, the JIT) except a profile that asks for candidates (profiles.toml
    # `candidates = true`), which builds it one library at a time (codegen/profiles.py, select).
    candidate: bool = False
    # The range of a call's max_seqlen_q (batch mode: seqlen_q) in which the runtime prefers this tile over the
    # default one of its instances (catalogue `min_seqlen_q` / `max_seqlen_q`, inclusive; None: the default tile,
    # taken wherever no ranged tile's range holds the call). A ranged tile is an addition, not an alternative: its
    # instances are built beside the default tile's, and the generated dispatch table hands the range to the
    # runtime's choice (choose_instance).
    seqlen_q: tuple[int, int] | None = None
    # Whether the tile has modifier ("_mods") instances beside its plain ones (catalogue `plain_only = true`: no;
    # a call with score modifiers then runs on the default tile's "_mods" instance).
    has_mods: bool = True
    # Whether it has plain instances (catalogue `mods_only = true`: no; the tile then serves only the modifier calls
    # of its instances, and a `plain_only` tile beside it the plain ones).
    has_plain: bool = True
    # Whether its instances are the batch-mode plain ones of its signatures, in place of the default tile's
    # (catalogue `plain_batch = true`): the tile a family gives its batch-mode plain calls where group mode and the
    # "_mods" instances keep another (the Hopper forward's d128 unmasked 128 x 176 beside 128 x 128). It has neither
    # "_mods" nor group-mode instances, and no seqlen range.
    plain_batch: bool = False
    # Whether unmasked modifier calls take its unmasked "_mods" instance (catalogue `unmasked_mods = true`; default:
    # the masked "_mods" instance serves them, one modifier instance for both mask classes). The JIT derives it for
    # them (mhakit/jit.py, derive_entry); the runtime takes the exact mask class wherever a library holds it.
    unmasked_mods: bool = False

    def get(self, key: str) -> int:
        return dict(self.params)[key]

    def serves(self, dtype: str, mode: str, mask: str | None = None) -> bool:
        return ((self.dtypes is None or dtype in self.dtypes) and (self.modes is None or mode in self.modes)
                and (mask is None or self.masks is None or mask in self.masks))


@dataclass(frozen=True)
class Family:
    name: str
    api: str  # the [api.family] table it came from
    v3: bool
    template: str
    priority: int
    needs_arch_specific: bool  # built only for arch-specific targets (sm_90a)
    dtypes: tuple[str, ...]
    modes: tuple[str, ...]
    masks: tuple[str, ...]
    equal_head_dims: bool      # serves only hdim_q == hdim_v
    deterministic: bool        # bwd: serves deterministic calls (fwd: always true, nothing to choose)
    align_bytes: int           # every tensor's base pointer and strides a multiple of this many bytes
    tiles: tuple[Tile, ...]
    # Serves only head dims (hdim_q and hdim_v) that are multiples of this (optional key, default 1: any head dim the
    # API accepts; the Hopper kernels need whole 16-byte rows).
    head_dim_multiple: int = 1
    # The score modifiers it serves (optional key `score_mods`, a table {plain = [...], mods = [...]} of SCORE_MODS
    # names, default none: a call that sets one the family lacks runs on a family that has it): `plain` those its
    # plain instances serve, `mods` those only a second set of instances serves, one per signature, that hold the
    # modifier kernel ("_mods" in the name; Signature.mods; such an instance serves the plain ones' modifiers too).
    plain_mods: tuple[str, ...] = ()
    instance_mods: tuple[str, ...] = ()
    # The dtypes whose instances serve them (score_mods.dtypes, default: every dtype of the family; the Hopper
    # forward's fp8 kernels have none).
    mod_dtypes: tuple[str, ...] = ()

    @property
    def has_mod_instances(self) -> bool:
        return bool(self.instance_mods)
    # Further instance axes of the family (e.g. CK-tile's padding flags and LSE store), each with its values in order
    # of preference: every combination is one instance, and an earlier value ranks above a later one at run time.
    variants: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # The family's fixed settings that its template reads (e.g. the CK-tile pipeline class), as (key, value) pairs.
    knobs: tuple[tuple[str, object], ...] = ()

    def knob(self, key: str, default=None):
        return dict(self.knobs).get(key, default)


@dataclass(frozen=True)
class Arch:
    name: str
    compute_capabilities: tuple[str, ...]  # "major.minor" of the devices this arch is built for (HIP: its major.minor)
    target: str                   # what the compiler is told: nvcc's -gencode value, or clang's --offload-arch
    arch_specific: bool           # code for it runs on exactly this target (sm_90a; every gfx target)
    families: tuple[str, ...]
    traits: tuple[tuple[str, object], ...] = ()  # further per-arch data (e.g. CK-tile's arch tag and device guard)

    @property
    def gencode(self) -> str:
        return self.target

    def trait(self, key: str, default=None):
        return dict(self.traits).get(key, default)


@dataclass(frozen=True)
class HeadDims:
    """Head dims the API accepts: multiples of `multiple` in [multiple, max] (multiple = 1: every head dim up to max)."""
    multiple: int
    max: int

    def accepts(self, d: int) -> bool:
        return self.multiple <= d <= self.max and d % self.multiple == 0

    def describe(self) -> str:
        span = f"in [{self.multiple}, {self.max}]"
        return span if self.multiple == 1 else f"multiples of {self.multiple} {span}"


APIS = ("fwd", "bwd", "splitkv")
# APIs whose instances live in another API's library: the split-KV (decode) instances are part of libmha_fwd.so,
# selected, rendered and linked with the forward's.
LIBRARY_OF_API = {"fwd": "fwd", "bwd": "bwd", "splitkv": "fwd"}

# The key of an [arch.*] table that names the compiler target, per backend.
TARGET_KEY = {"cuda": "gencode", "rocm": "offload_arch"}


@dataclass(frozen=True)
class Catalogue:
    backend: str
    compiler: str
    default_arch: str
    head_dims: HeadDims
    arches: dict[str, Arch]
    families: dict[tuple[str, str], Family]  # (api, family name) -> Family
    tables: tuple[tuple[str, object], ...] = ()  # the catalogue's other top-level tables (shared data its templates read)

    def table(self, key: str) -> dict:
        return thaw(dict(self.tables).get(key, ())) or {}

    def family(self, api: str, name: str) -> Family:
        return self.families[(api, name)]

    def families_for(self, api: str, arch: str) -> list[Family]:
        """The families of `api` built for `arch`, in the arch's order."""
        return [self.families[(api, name)] for name in self.arch(arch).families if (api, name) in self.families]

    def arch(self, name: str) -> Arch:
        if name not in self.arches:
            known = ", ".join(sorted(self.arches))
            raise CatalogueError(f"unknown arch '{name}' for the {self.backend} backend (known: {known})")
        return self.arches[name]

    def arch_for_compute_capability(self, major: int, minor: int) -> Arch | None:
        """The arch built for a device of compute capability major.minor: the arch listing it, else the one listing
        major.0 (SASS for sm_X0 runs on every sm_Xy); None when neither exists."""
        for key in (f"{major}.{minor}", f"{major}.0"):
            for arch in self.arches.values():
                if key in arch.compute_capabilities:
                    return arch
        return None


def _require(table: dict, key: str, where: str):
    if key not in table:
        raise CatalogueError(f"{where}: missing key '{key}'")
    return table[key]


_TILE_NARROWING = ("dtypes", "modes", "masks")
# Tile keys that say when the tile is chosen or what it is built with, not how it computes (no template parameters).
_TILE_CHOICE = ("candidate", "min_seqlen_q", "max_seqlen_q", "plain_only", "mods_only", "unmasked_mods", "plain_batch")


def _parse_seqlen_range(raw: dict, where: str) -> tuple[int, int] | None:
    """A tile's `min_seqlen_q` (default 1) .. `max_seqlen_q` (inclusive), or None for a tile without one."""
    if "max_seqlen_q" not in raw:
        if "min_seqlen_q" in raw:
            raise CatalogueError(f"{where}.min_seqlen_q: needs max_seqlen_q (a range's upper end)")
        return None
    lo, hi = raw.get("min_seqlen_q", 1), raw["max_seqlen_q"]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (lo, hi)) or not 1 <= lo <= hi:
        raise CatalogueError(f"{where}: min_seqlen_q / max_seqlen_q must be integers with 1 <= min <= max "
                             f"(got {lo} and {hi})")
    return (lo, hi)


def _parse_tile(raw: dict, where: str, family: dict) -> Tile:
    hdim_q = int(_require(raw, "hdim_q", where))
    hdim_v = int(_require(raw, "hdim_v", where))
    candidate = raw.get("candidate", False)
    if not isinstance(candidate, bool):
        raise CatalogueError(f"{where}.candidate: must be true or false")
    plain_only = raw.get("plain_only", False)
    if not isinstance(plain_only, bool):
        raise CatalogueError(f"{where}.plain_only: must be true or false")
    mods_only = raw.get("mods_only", False)
    if not isinstance(mods_only, bool):
        raise CatalogueError(f"{where}.mods_only: must be true or false")
    if mods_only and (plain_only or not family.get("score_mods", {}).get("mods")):
        raise CatalogueError(f"{where}: a mods_only tile has modifier instances only, so it cannot be plain_only and "
                             "its family needs score_mods.mods")
    unmasked_mods = raw.get("unmasked_mods", False)
    if not isinstance(unmasked_mods, bool):
        raise CatalogueError(f"{where}.unmasked_mods: must be true or false")
    if unmasked_mods and (plain_only or not family.get("score_mods", {}).get("mods")
                          or "nmask" not in raw.get("masks", family.get("masks", []))):
        raise CatalogueError(f"{where}: unmasked_mods needs the tile's unmasked modifier instances (not plain_only, "
                             "an unmasked mask class, and its family's score_mods.mods)")
    seqlen_q = _parse_seqlen_range(raw, where)
    if seqlen_q is not None and candidate:
        raise CatalogueError(f"{where}: a candidate tile replaces the default one, so it takes no seqlen range")
    plain_batch = raw.get("plain_batch", False)
    if not isinstance(plain_batch, bool):
        raise CatalogueError(f"{where}.plain_batch: must be true or false")
    if plain_batch:
        clash = [k for k in ("modes", "plain_only", "mods_only", "unmasked_mods", "candidate", "max_seqlen_q") if k in raw]
        if clash or "batch" not in family.get("modes", []):
            raise CatalogueError(f"{where}: a plain_batch tile is the batch-mode plain instances of its signatures, so "
                                 f"it takes none of {', '.join(clash) or 'these keys'} and its family needs batch mode")
    params = tuple((k, int(v)) for k, v in raw.items()
                   if k not in ("hdim_q", "hdim_v", *_TILE_CHOICE, *_TILE_NARROWING))
    narrowed = {}
    for key in _TILE_NARROWING:
        if key in raw:
            values = raw[key]
            served = family.get(key, [])
            if not isinstance(values, list) or not values or not set(values) <= set(served):
                raise CatalogueError(f"{where}.{key}: must be a non-empty list of the family's {key} {served}")
            narrowed[key] = tuple(values)
    if plain_batch:
        narrowed["modes"] = ("batch",)
    return Tile(hdim_q, hdim_v, params, candidate=candidate, seqlen_q=seqlen_q, has_mods=not (plain_only or plain_batch),
                has_plain=not mods_only, unmasked_mods=unmasked_mods, plain_batch=plain_batch, **narrowed)


def check_seqlen_ranges(tiles, family: dict, where: str) -> None:
    """Within one group of instances (dtype, head dims, mode, mask class) that a ranged tile belongs to: exactly one
    tile without a range (the default, taken outside every range) and ranges that do not overlap, so that each
    max_seqlen_q names one tile. Candidates replace a tile rather than join it and take no part."""
    groups: dict[tuple, list[Tile]] = {}
    for tile in tiles:
        if tile.candidate:
            continue
        for dtype in tile.dtypes or family.get("dtypes", []):
            for mode in tile.modes or family.get("modes", []):
                for mask in tile.masks or family.get("masks", []):
                    groups.setdefault((dtype, tile.hdim_q, tile.hdim_v, mode, mask), []).append(tile)
    for (dtype, hq, hv, mode, mask), members in groups.items():
        group = f"{where}: the {dtype} d{hq}x{hv} {mode} {mask} tiles"
        if sum(t.plain_batch for t in members) > 1:
            raise CatalogueError(f"{group} have more than one plain_batch tile")
        ranged = sorted((t.seqlen_q for t in members if t.seqlen_q is not None))
        if not ranged:
            continue
        if any(t.plain_batch for t in members):
            raise CatalogueError(f"{group} have a plain_batch tile and a ranged one: the ranged one's default would be "
                                 "two tiles")
        defaults = sum(t.seqlen_q is None for t in members)
        if defaults != 1:
            raise CatalogueError(f"{group} have {defaults} tiles without a seqlen range; a group with ranged tiles "
                                 "needs exactly one (the default)")
        for (lo_a, hi_a), (lo_b, hi_b) in zip(ranged, ranged[1:]):
            if lo_b <= hi_a:
                raise CatalogueError(f"{group}: the seqlen ranges [{lo_a}, {hi_a}] and [{lo_b}, {hi_b}] overlap")


def _parse_tiles(raw: dict, where: str) -> tuple[Tile, ...]:
    tiles = tuple(_parse_tile(t, f"{where}.tiles[{i}]", raw) for i, t in enumerate(_require(raw, "tiles", where)))
    check_seqlen_ranges(tiles, raw, where)
    return tiles


def _freeze(value):
    """TOML values as hashable records: lists become tuples, tables (key, value) tuples."""
    if isinstance(value, dict):
        return tuple((k, _freeze(v)) for k, v in value.items())
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


def thaw(value):
    """Catalogue records ((key, value) tuples) back into dicts and lists for the templates."""
    if isinstance(value, tuple):
        if all(isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) for item in value) and value:
            return {k: thaw(v) for k, v in value}
        return [thaw(v) for v in value]
    return value


def _parse_variants(raw: dict, where: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    variants = []
    for axis, values in raw.items():
        if not isinstance(values, list) or not values or not all(isinstance(v, str) for v in values):
            raise CatalogueError(f"{where}.variants.{axis}: must be a non-empty list of strings")
        variants.append((axis, tuple(values)))
    return tuple(variants)


# The score modifiers a family can list (catalogue `score_mods`), each the C enum mhakit_score_mod's
# MHAKIT_MOD_<NAME> (csrc/include/mha_common.h): soft-cap, elementwise bias, ALiBi, attention sink, dropout.
SCORE_MODS = ("softcap", "bias", "alibi", "sink", "dropout")


def _parse_score_mods(raw, where: str, family_dtypes: list) -> dict:
    """A family's `score_mods` table: {plain = [names], mods = [names], dtypes = [...]} -> Family's plain_mods /
    instance_mods / mod_dtypes."""
    if not isinstance(raw, dict) or set(raw) - {"plain", "mods", "dtypes"}:
        raise CatalogueError(f"{where}.score_mods: must be a table with the keys plain and mods (lists of names) and "
                             "optionally dtypes")
    dtypes = raw.get("dtypes", list(family_dtypes))
    if not isinstance(dtypes, list) or not dtypes or any(d not in family_dtypes for d in dtypes):
        raise CatalogueError(f"{where}.score_mods.dtypes: must be a non-empty list of the family's dtypes")
    out = {"mod_dtypes": tuple(dtypes)}
    for key, field_name in (("plain", "plain_mods"), ("mods", "instance_mods")):
        names = raw.get(key, [])
        if not isinstance(names, list) or any(n not in SCORE_MODS for n in names) or len(set(names)) != len(names):
            raise CatalogueError(f"{where}.score_mods.{key}: must list distinct names of {', '.join(SCORE_MODS)}")
        out[field_name] = tuple(n for n in SCORE_MODS if n in names)
    if set(out["plain_mods"]) & set(out["instance_mods"]):
        raise CatalogueError(f"{where}.score_mods: a modifier is listed under both plain and mods")
    return out


_FAMILY_KEYS = {"v3", "template", "priority", "needs_arch_specific", "dtypes", "modes", "masks", "equal_head_dims",
                "deterministic", "align_bytes", "head_dim_multiple", "score_mods", "tiles", "variants", "knobs"}
# The keys of an [arch.*] table that Arch's own fields hold (besides the backend's target key); the rest are traits.
_ARCH_KEYS = ("compute_capability", "arch_specific", "families")
# The top-level keys read into Catalogue's own fields; the other top-level tables are kept as shared `tables`.
_TOP_KEYS = ("backend", "compiler", "default_arch", "head_dims", "arch", *APIS)


@lru_cache(maxsize=None)
def load(backend: str = "cuda") -> Catalogue:
    path = CATALOGUE_DIR / f"{backend}.toml"
    if not path.is_file():
        raise CatalogueError(f"no catalogue for backend '{backend}' ({path} does not exist)")
    with open(path, "rb") as f:
        data = tomllib.load(f)
    backend_name = data.get("backend", backend)
    target_key = TARGET_KEY.get(backend_name, "gencode")
    arches = {}
    for name, raw in _require(data, "arch", str(path)).items():
        where = f"{path.name}: arch.{name}"
        traits = _freeze({k: v for k, v in raw.items() if k not in _ARCH_KEYS + (target_key,)})
        arches[name] = Arch(name, tuple(_require(raw, "compute_capability", where)), _require(raw, target_key, where),
                            bool(_require(raw, "arch_specific", where)), tuple(_require(raw, "families", where)),
                            traits)
    raw_hd = _require(data, "head_dims", str(path))
    head_dims = HeadDims(int(_require(raw_hd, "multiple", f"{path.name}: head_dims")),
                         int(_require(raw_hd, "max", f"{path.name}: head_dims")))
    families = {}
    for api in APIS:
        for name, raw in data.get(api, {}).items():
            where = f"{path.name}: {api}.{name}"
            unknown = set(raw) - _FAMILY_KEYS
            if unknown:
                raise CatalogueError(f"{where}: unknown keys {sorted(unknown)} (put family settings under knobs)")
            families[(api, name)] = Family(
                name=name,
                api=api,
                v3=bool(raw.get("v3", False)),
                template=_require(raw, "template", where),
                priority=int(_require(raw, "priority", where)),
                needs_arch_specific=bool(_require(raw, "needs_arch_specific", where)),
                dtypes=tuple(_require(raw, "dtypes", where)),
                modes=tuple(_require(raw, "modes", where)),
                masks=tuple(_require(raw, "masks", where)),
                equal_head_dims=bool(_require(raw, "equal_head_dims", where)),
                deterministic=bool(_require(raw, "deterministic", where)) if api == "bwd" else True,
                align_bytes=int(_require(raw, "align_bytes", where)),
                tiles=_parse_tiles(raw, where),
                variants=_parse_variants(raw.get("variants", {}), where),
                knobs=_freeze(raw.get("knobs", {})),
                head_dim_multiple=int(raw.get("head_dim_multiple", 1)),
                **_parse_score_mods(raw.get("score_mods", {}), where, list(_require(raw, "dtypes", where))),
            )
    known_names = {name for _, name in families}
    for arch in arches.values():
        for fam in arch.families:
            if fam not in known_names:
                raise CatalogueError(f"{path.name}: arch.{arch.name} lists unknown family '{fam}'")
    default_arch = _require(data, "default_arch", str(path))
    if default_arch not in arches:
        raise CatalogueError(f"{path.name}: default_arch '{default_arch}' is not an [arch.*] table")
    tables = _freeze({k: v for k, v in data.items() if k not in _TOP_KEYS})
    return Catalogue(backend_name, data.get("compiler", ""), default_arch, head_dims, arches, families, tables)
