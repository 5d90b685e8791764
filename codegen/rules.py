"""Explicit validity rules for specs. Each rule returns None when the spec is fine, else the reason it is not.

Every rule reads its facts from the catalogue (codegen/catalogue/<backend>.toml): the API's head dims, the family's
static guards (modes, masks, dtypes, equal head dims, whether it needs an arch-specific target) and the arches that
list it. Enumeration (profiles.py) applies every rule, so an impossible combination is dropped with a reason
(visible with `compile.py --list --verbose`) instead of failing deep inside the compiler."""
from __future__ import annotations

from typing import Callable, Optional

from . import catalogue as catalogue_mod
from .spec import KernelSpec

Rule = Callable[[KernelSpec, "catalogue_mod.Catalogue"], Optional[str]]


def _family(spec: KernelSpec, cat: "catalogue_mod.Catalogue"):
    return cat.families.get((spec.signature.api, spec.algorithm.family))


def family_is_known(spec: KernelSpec, cat) -> Optional[str]:
    if _family(spec, cat) is None:
        return f"the catalogue has no {spec.signature.api} family '{spec.algorithm.family}'"
    return None


def head_dims_in_range(spec: KernelSpec, cat) -> Optional[str]:
    s, hd = spec.signature, cat.head_dims
    for label, d in (("hdim_q", s.hdim_q), ("hdim_v", s.hdim_v)):
        if not hd.accepts(d):
            return f"{label}={d} is not an accepted head dim: head dims must be {hd.describe()}"
    return None


def family_serves_signature(spec: KernelSpec, cat) -> Optional[str]:
    fam, s = _family(spec, cat), spec.signature
    if fam is None:
        return None
    for what, value, served in (("dtype", s.dtype, fam.dtypes), ("mode", s.mode, fam.modes),
                                ("mask class", s.mask, fam.masks)):
        if value not in served:
            return f"the {fam.name} family serves {', '.join(served)} {what} only, not {value} {what} (catalogue)"
    if fam.equal_head_dims and s.hdim_q != s.hdim_v:
        return (f"the {fam.name} family computes Q·Kᵀ and P·V with one head-dim tile "
                "(equal_head_dims: hdim_q == hdim_v)")
    return None


def modifier_instances_need_score_mods(spec: KernelSpec, cat) -> Optional[str]:
    fam = _family(spec, cat)
    if fam is not None and spec.signature.mods and not fam.has_mod_instances:
        return f"the {fam.name} family has no score modifiers (catalogue score_mods.mods), so no modifier instance"
    if fam is not None and spec.signature.mods and spec.signature.dtype not in fam.mod_dtypes:
        return (f"the {fam.name} family's score modifiers serve {', '.join(fam.mod_dtypes)} only (catalogue "
                f"score_mods.dtypes), not {spec.signature.dtype}")
    return None


def family_built_for_arch(spec: KernelSpec, cat) -> Optional[str]:
    fam, arch_name = _family(spec, cat), spec.algorithm.arch
    if fam is None or arch_name not in cat.arches:
        return None if fam is None else f"unknown arch '{arch_name}'"
    arch = cat.arches[arch_name]
    if fam.needs_arch_specific and not arch.arch_specific:
        targets = ", ".join(sorted(a.name for a in cat.arches.values() if a.arch_specific))
        return f"the {fam.name} family needs an arch-specific target ({targets}), not {arch_name}"
    if fam.name not in arch.families:
        return f"arch.{arch_name} does not list the {fam.name} family"
    return None


def tiles_have_block_sizes(spec: KernelSpec, cat) -> Optional[str]:
    tile = dict(spec.algorithm.tile)
    if "block_m" not in tile or "block_n" not in tile:
        return "a tile needs block_m and block_n"
    return None


def wgmma_decode_tiles_agree(spec: KernelSpec, cat) -> Optional[str]:
    """decode_tma's wgmma tiles (a `warpgroups` knob): 64 packed rows per warpgroup (block_m = 64 x warpgroups), 64
    keys per slot (one m64n64 wgmma per k step of S), one or two warpgroups; and `min_rows`, the packed rows from
    which the runtime prefers a split-KV tile, within what its score can hold (1 .. 99999)."""
    tile = dict(spec.algorithm.tile)
    if "min_rows" in tile and not 1 <= tile["min_rows"] <= 99999:
        return f"min_rows must be in [1, 99999] (got {tile['min_rows']})"
    if "warpgroups" not in tile:
        return None
    wg = tile["warpgroups"]
    if tile.get("overlap", 0) not in (0, 1):
        return f"overlap is 0 or 1 (got {tile['overlap']})"
    if wg == 2 and tile.get("overlap"):  # the kernel's static_assert says the same (fmha_fwd_splitkv_wgmma.cuh)
        return "overlap = 1 with two warpgroups failed on the H200 (2026-11-24) and is refused"
    if wg not in (1, 2) or tile.get("block_m") != 64 * wg or tile.get("block_n") != 64 or "warps" in tile:
        return (f"a wgmma decode tile has 1 or 2 warpgroups, block_m = 64 x warpgroups, block_n = 64 and no warps "
                f"(got warpgroups={wg}, block_m={tile.get('block_m')}, block_n={tile.get('block_n')})")
    return None


def hopper_bwd_tiles_fit(spec: KernelSpec, cat) -> Optional[str]:
    """The Hopper backward's tiles, as the kernel's static_asserts refuse them (fmha_bwd_hopper_kernel.hpp), so that a
    catalogue edit meets a sentence, not an nvcc error: block_m 64 or 128; block_n 64 or 128 (query / key split) or
    96, the swapped key split, whose two warpgroups hold dKᵀ and dVᵀ of 48 keys each in registers: block_m = 64, head
    dims multiples of 64 with hdim_q + hdim_v <= 320, plain instances only (the tile's `plain_only`)."""
    if spec.signature.api != "bwd" or spec.algorithm.family != "hopper":
        return None
    tile, s = dict(spec.algorithm.tile), spec.signature
    bm, bn = tile.get("block_m"), tile.get("block_n")
    if bm not in (64, 128) or bn not in (64, 96, 128):
        return f"a Hopper backward tile has block_m 64 or 128 and block_n 64, 96 or 128 (got {bm} x {bn})"
    if bn == 96:
        if bm != 64 or s.hdim_q % 64 or s.hdim_v % 64 or s.hdim_q + s.hdim_v > 320:
            return (f"the swapped key split (block_n = 96) needs block_m = 64 and head dims that are multiples of 64 "
                    f"with hdim_q + hdim_v <= 320 (got block_m {bm}, d{s.hdim_q}x{s.hdim_v})")
        if s.mods:
            return "the swapped key split (block_n = 96) has no modifier instances: its tile needs plain_only = true"
    return None


def hopper_fwd_stages_are_persistent(spec: KernelSpec, cat) -> Optional[str]:
    """The Hopper forward's `stages` caps the K/V ring of a persistent tile (to leave O a staging buffer of its own;
    fmha_hopper_kernel.hpp, kMaxStages): only instances that run the persistent grid (spec.persistent: batch-mode
    plain ones) take it, so a tile with stages needs persistent = true and only batch-mode plain instances
    (plain_batch = true, or plain_only = true and modes = ["batch"]), and at most the 5 slots the kernel ever uses."""
    if spec.signature.api != "fwd" or spec.algorithm.family != "hopper":
        return None
    stages = dict(spec.algorithm.tile).get("stages")
    if stages is None:
        return None
    if not spec.persistent:
        return ("a Hopper forward tile's stages caps a persistent grid's ring: give it persistent = true and "
                "plain_batch = true (or plain_only = true and modes = [\"batch\"]): this instance would run the "
                "one-tile kernel")
    if not 2 <= stages <= 5:
        return f"a Hopper forward tile's stages is 2 .. 5 (got {stages})"
    return None


def ck_group_mode_pads_sequences(spec: KernelSpec, cat) -> Optional[str]:
    """CK-tile forward: a group-mode kernel cannot know whether a sequence fills its last tile, so it must pad both
    sequence dimensions (the padding flags of each variant are catalogue data: ck.fwd_pads)."""
    pad = dict(spec.algorithm.variant).get("pad")
    if spec.signature.mode != "group" or pad is None or spec.signature.api != "fwd":
        return None
    flags = cat.table("ck").get("fwd_pads", {}).get(pad, {})
    if not (flags.get("spad") and flags.get("skpad")):
        return f"CK-tile group mode pads seqlen_q and seqlen_k, and variant '{pad}' does not"
    return None


RULES: tuple[Rule, ...] = (
    family_is_known,
    head_dims_in_range,
    family_serves_signature,
    modifier_instances_need_score_mods,
    family_built_for_arch,
    tiles_have_block_sizes,
    wgmma_decode_tiles_agree,
    hopper_bwd_tiles_fit,
    hopper_fwd_stages_are_persistent,
    ck_group_mode_pads_sequences,
)


def violations(spec: KernelSpec, backend: str = "cuda") -> list[str]:
    cat = catalogue_mod.load(backend)
    return [reason for rule in RULES if (reason := rule(spec, cat)) is not None]
