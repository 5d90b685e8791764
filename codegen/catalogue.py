"""Read a backend's catalogue (codegen/catalogue/<backend>.toml) into plain, typed records."""
from __future__ import annotations

import tomllib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

CATALOGUE_DIR = Path(__file__).resolve().parent / "catalogue"


class CatalogueError(ValueError):
    """The catalogue file is malformed; the message names the file and the entry."""


@dataclass(frozen=True)
class Tile:
    hdim_q: int
    hdim_v: int
    params: tuple[tuple[str, int], ...]  # the family's tile parameters (block_m, block_n, warps, ...) in file order

    def get(self, key: str) -> int:
        return dict(self.params)[key]


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


@dataclass(frozen=True)
class Arch:
    name: str
    compute_capabilities: tuple[str, ...]  # "major.minor" of the devices this arch is built for
    gencode: str
    arch_specific: bool
    families: tuple[str, ...]


@dataclass(frozen=True)
class HeadDims:
    """Head dims the API accepts: multiples of `multiple` in [multiple, max]."""
    multiple: int
    max: int

    def accepts(self, d: int) -> bool:
        return self.multiple <= d <= self.max and d % self.multiple == 0

    def describe(self) -> str:
        return f"multiples of {self.multiple} in [{self.multiple}, {self.max}]"


APIS = ("fwd", "bwd")


@dataclass(frozen=True)
class Catalogue:
    backend: str
    compiler: str
    default_arch: str
    head_dims: HeadDims
    arches: dict[str, Arch]
    families: dict[tuple[str, str], Family]  # (api, family name) -> Family

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


def _parse_tile(raw: dict, where: str) -> Tile:
    hdim_q = int(_require(raw, "hdim_q", where))
    hdim_v = int(_require(raw, "hdim_v", where))
    params = tuple((k, int(v)) for k, v in raw.items() if k not in ("hdim_q", "hdim_v"))
    return Tile(hdim_q, hdim_v, params)


@lru_cache(maxsize=None)
def load(backend: str = "cuda") -> Catalogue:
    path = CATALOGUE_DIR / f"{backend}.toml"
    if not path.is_file():
        raise CatalogueError(f"no catalogue for backend '{backend}' ({path} does not exist)")
    with open(path, "rb") as f:
        data = tomllib.load(f)
    arches = {}
    for name, raw in _require(data, "arch", str(path)).items():
        where = f"{path.name}: arch.{name}"
        arches[name] = Arch(name, tuple(_require(raw, "compute_capability", where)), _require(raw, "gencode", where),
                            bool(_require(raw, "arch_specific", where)), tuple(_require(raw, "families", where)))
    raw_hd = _require(data, "head_dims", str(path))
    head_dims = HeadDims(int(_require(raw_hd, "multiple", f"{path.name}: head_dims")),
                         int(_require(raw_hd, "max", f"{path.name}: head_dims")))
    families = {}
    for api in APIS:
        for name, raw in data.get(api, {}).items():
            where = f"{path.name}: {api}.{name}"
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
                tiles=tuple(_parse_tile(t, f"{where}.tiles[{i}]") for i, t in enumerate(_require(raw, "tiles", where))),
            )
    known_names = {name for _, name in families}
    for arch in arches.values():
        for fam in arch.families:
            if fam not in known_names:
                raise CatalogueError(f"{path.name}: arch.{arch.name} lists unknown family '{fam}'")
    default_arch = _require(data, "default_arch", str(path))
    if default_arch not in arches:
        raise CatalogueError(f"{path.name}: default_arch '{default_arch}' is not an [arch.*] table")
    return Catalogue(data.get("backend", backend), data.get("compiler", ""), default_arch, head_dims, arches, families)
