"""The Hopper backward's swapped key split (tile b64x96; fmha_bwd_hopper_kernel.hpp, consumer_swapped): the
catalogue and codegen give it every plain (192, 128) instance (both masks, dtypes and modes, deterministic calls
included) while modifier calls keep the 64 x 64 tile (`mods_only`) and the 128-key query split is a candidate, the template instantiates it with block_n = 96,
and the rule that mirrors the kernel's static_asserts refuses the tiles the kernel refuses. No GPU:
tests/test_gpu_bwd.py runs it (test_bwd96_*)."""
from __future__ import annotations

import dataclasses
import re

import pytest

from codegen import catalogue, profiles, render, rules
from codegen.spec import Algorithm, KernelSpec

FILTER = "bwd_d192x128_*_sm90a_hopper_b64x96"
NAMES = {f"bwd_d192x128_{dt}_{mode}_{mask}_sm90a_hopper_b64x96" for dt in ("bf16", "fp16") for mode in ("batch", "group")
         for mask in ("mask", "nmask")}


def shipped_specs() -> list[KernelSpec]:
    return list(profiles.select("bwd", "sm_90a", "default", FILTER).specs)


def test_it_serves_the_plain_192x128_instances_only():
    specs = shipped_specs()
    assert {s.name for s in specs} == NAMES
    assert all(not s.signature.mods for s in specs)  # plain_only, both masks
    assert all(dict(s.algorithm.tile) == {"block_m": 64, "block_n": 96} for s in specs)
    assert all(s.guards.deterministic for s in specs)  # the dQ writer takes deterministic turns: no refusal
    (tile,) = [t for t in catalogue.load("cuda").family("bwd", "hopper").tiles if t.get("block_n") == 96]
    assert not tile.candidate and not tile.has_mods and tile.masks is None  # every mask
    # the 128-key query split it replaced for unmasked calls stays buildable as a candidate
    (old,) = [t for t in catalogue.load("cuda").family("bwd", "hopper").tiles
              if (t.hdim_q, t.hdim_v) == (192, 128) and t.get("block_n") == 128]
    assert old.candidate and old.masks == ("nmask",)


def test_the_profiles_give_plain_calls_b64x96_and_modifier_calls_the_64x64_tile():
    plain = {"bwd_d192x128_bf16_batch_mask_sm90a_hopper_b64x96", "bwd_d192x128_bf16_batch_nmask_sm90a_hopper_b64x96"}
    for profile, expected in (("default", plain), ("all", plain | {"bwd_d192x128_bf16_batch_mask_mods_sm90a_hopper_b64x64"})):
        names = {s.name for s in profiles.select("bwd", "sm_90a", profile, "bwd_d192x128_bf16_batch_*hopper").specs}
        assert names == expected, profile  # the default profile builds no modifier instances
    assert not profiles.enumerate_specs("bwd", "sm_90a", candidates=True).candidates & NAMES


def test_the_template_instantiates_block_n_96():
    spec = next(s for s in shipped_specs() if s.name.endswith("_bf16_group_mask_sm90a_hopper_b64x96"))
    src = render.render_instance(spec)
    assert "hopper::BwdKernel<MHAKIT_DTYPE_BF16, 192, 128, /*group_mode=*/true, /*masked=*/true," in src
    assert "64, 96, /*mods=*/false>;" in src
    table = render.render_dispatch("bwd", "sm_90a", shipped_specs())
    assert table.count("_hopper_b64x96") >= 4


def _with(spec: KernelSpec, *, tile=None, hdims=None, mods=None) -> KernelSpec:
    sig = spec.signature
    if hdims is not None:
        sig = dataclasses.replace(sig, hdim_q=hdims[0], hdim_v=hdims[1])
    if mods is not None:
        sig = dataclasses.replace(sig, mods=mods)
    alg = spec.algorithm if tile is None else Algorithm("hopper", "sm_90a", tuple(tile.items()))
    return KernelSpec(sig, alg, spec.priority, spec.template, spec.guards)


@pytest.mark.parametrize("change, message", [
    (dict(tile=dict(block_m=128, block_n=96)), r"needs block_m = 64"),
    (dict(hdims=(192, 192)), r"hdim_q \+ hdim_v <= 320"),
    (dict(hdims=(96, 96)), r"multiples of 64"),
    (dict(mods=True), r"plain_only = true"),
    (dict(tile=dict(block_m=64, block_n=80)), r"block_n 64, 96 or 128"),
    (dict(tile=dict(block_m=32, block_n=64)), r"block_m 64 or 128"),
])
def test_the_rule_refuses_what_the_kernel_refuses(change, message):
    good = next(iter(shipped_specs()))
    reasons = rules.violations(_with(good, **change))
    assert any(re.search(message, r) for r in reasons), reasons
    assert rules.violations(good) == []
    # (192, 128) at 96 keys fits; so do head dims of 128 (128 + 128 <= 320)
    assert rules.violations(_with(good, hdims=(128, 128))) == []


def test_every_shipped_hopper_backward_tile_passes_the_rule():
    for s in profiles.enumerate_specs("bwd", "sm_90a", candidates=True).specs:
        if s.algorithm.family == "hopper":
            assert rules.violations(s) == [], s.name


def test_mods_only_is_checked_when_the_catalogue_loads():
    from codegen.catalogue import CatalogueError, _parse_tile
    fam = {"dtypes": ["bf16"], "modes": ["batch"], "masks": ["mask"], "score_mods": {"mods": ["softcap"]}}
    tile = _parse_tile({"hdim_q": 64, "hdim_v": 64, "block_m": 64, "mods_only": True}, "t", fam)
    assert tile.has_mods and not tile.has_plain
    with pytest.raises(CatalogueError, match="cannot be plain_only"):
        _parse_tile({"hdim_q": 64, "hdim_v": 64, "block_m": 64, "mods_only": True, "plain_only": True}, "t", fam)
    with pytest.raises(CatalogueError, match="needs score_mods.mods"):
        _parse_tile({"hdim_q": 64, "hdim_v": 64, "block_m": 64, "mods_only": True}, "t", {**fam, "score_mods": {}})
    with pytest.raises(CatalogueError, match="mods_only: must be true or false"):
        _parse_tile({"hdim_q": 64, "hdim_v": 64, "block_m": 64, "mods_only": 1}, "t", fam)
