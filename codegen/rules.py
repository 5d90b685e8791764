"""Explicit validity rules for specs. Each rule returns None when the spec is fine, else the reason it is not.

Enumeration (profiles.py) applies every rule, so an impossible combination in the catalogue is dropped with a
reason (visible with `compile.py --list --verbose`) instead of failing deep inside the compiler."""
from __future__ import annotations

from typing import Callable, Optional

from .spec import KernelSpec

MAX_HDIM = 256


def head_dims_in_range(spec: KernelSpec) -> Optional[str]:
    s = spec.signature
    for label, d in (("hdim_q", s.hdim_q), ("hdim_v", s.hdim_v)):
        if d <= 0 or d % 8 or d > MAX_HDIM:
            return f"{label}={d} must be a positive multiple of 8 up to {MAX_HDIM}"
    return None


def hopper_needs_equal_head_dims(spec: KernelSpec) -> Optional[str]:
    s = spec.signature
    if spec.algorithm.family == "hopper" and s.hdim_q != s.hdim_v:
        return "the hopper family computes Q·Kᵀ and P·V with one head-dim tile (hdim_q == hdim_v)"
    return None


def hopper_is_batch_mode(spec: KernelSpec) -> Optional[str]:
    if spec.algorithm.family == "hopper" and spec.signature.mode != "batch":
        return "the hopper family's TMA epilogue stores whole tiles, so group mode goes to the generic family"
    return None


def hopper_needs_sm90a(spec: KernelSpec) -> Optional[str]:
    if spec.algorithm.family == "hopper" and spec.algorithm.arch != "sm_90a":
        return "wgmma and setmaxnreg exist only on the sm_90a target"
    return None


def tiles_have_block_sizes(spec: KernelSpec) -> Optional[str]:
    tile = dict(spec.algorithm.tile)
    if "block_m" not in tile or "block_n" not in tile:
        return "a tile needs block_m and block_n"
    return None


def ck_group_mode_pads_sequences(spec: KernelSpec) -> Optional[str]:
    """CK-tile forward: a group-mode kernel cannot know whether a sequence fills its last tile, so it must pad both
    sequence dimensions (the padding flags of each variant are catalogue data: ck.fwd_pads)."""
    pad = dict(spec.algorithm.variant).get("pad")
    if spec.signature.mode != "group" or pad is None or spec.signature.api != "fwd":
        return None
    flags = dict(dict(spec.knobs).get("ck", ())).get("fwd_pads", ())
    flags = dict(dict(flags).get(pad, ()))
    if not (flags.get("spad") and flags.get("skpad")):
        return f"CK-tile group mode pads seqlen_q and seqlen_k, and variant '{pad}' does not"
    return None


RULES: tuple[Callable[[KernelSpec], Optional[str]], ...] = (
    head_dims_in_range,
    hopper_needs_equal_head_dims,
    hopper_is_batch_mode,
    hopper_needs_sm90a,
    tiles_have_block_sizes,
    ck_group_mode_pads_sequences,
)


def violations(spec: KernelSpec) -> list[str]:
    return [reason for rule in RULES if (reason := rule(spec)) is not None]
