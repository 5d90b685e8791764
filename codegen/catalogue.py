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
    dtypes: tuple[str, ...]
    modes: tuple[str, ...]
    masks: tuple[str, ...]
    tiles: tuple[Tile, ...]


@dataclass(frozen=True)
class Arch:
    name: str
    gencode: str
    families: tuple[str, ...]


APIS = ("fwd", "bwd")


@dataclass(frozen=True)
class Catalogue:
    backend: str
    compiler: str
    arches: dict[str, Arch]
    families: dict[tuple[str, str], Family]  # (api, family name) -> Family

    def families_for(self, api: str, arch: str) -> list[Family]:
        """The families of `api` built for `arch`, in the arch's order."""
        return [self.families[(api, name)] for name in self.arch(arch).families if (api, name) in self.families]

    def arch(self, name: str) -> Arch:
        if name not in self.arches:
            known = ", ".join(sorted(self.arches))
            raise CatalogueError(f"unknown arch '{name}' for the {self.backend} backend (known: {known})")
        return self.arches[name]


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
        arches[name] = Arch(name, _require(raw, "gencode", where), tuple(_require(raw, "families", where)))
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
                dtypes=tuple(_require(raw, "dtypes", where)),
                modes=tuple(_require(raw, "modes", where)),
                masks=tuple(_require(raw, "masks", where)),
                tiles=tuple(_parse_tile(t, f"{where}.tiles[{i}]") for i, t in enumerate(_require(raw, "tiles", where))),
            )
    known_names = {name for _, name in families}
    for arch in arches.values():
        for fam in arch.families:
            if fam not in known_names:
                raise CatalogueError(f"{path.name}: arch.{arch.name} lists unknown family '{fam}'")
    return Catalogue(data.get("backend", backend), data.get("compiler", ""), arches, families)
