"""The Hopper backward's swapped key split (tile b64x96, catalogue `candidate = true` beside the masked (192, 128)
b64x64 tile; fmha_bwd_hopper_kernel.hpp, consumer_swapped): the catalogue and codegen carry it as a candidate of
the masked (192, 128) instances only (plain, both dtypes and modes, deterministic calls included), the template
instantiates it with block_n = 96, and the rule that mirrors the kernel's static_asserts refuses the tiles the kernel
refuses. No GPU: tests/test_gpu_bwd.py runs it (test_bwd96_*), tools/verify_bwd96.sh measures it."""
from __future__ import annotations

import dataclasses
import re

import pytest

from codegen import catalogue, profiles, render, rules
from codegen.spec import Algorithm, KernelSpec

FILTER = "bwd_d192x128_*_sm90a_hopper_b64x96"
NAMES = {f"bwd_d192x128_{dt}_{mode}_mask_sm90a_hopper_b64x96" for dt in ("bf16", "fp16") for mode in ("batch", "group")}


def candidate_specs() -> list[KernelSpec]:
    return list(profiles.select("bwd", "sm_90a", "candidates", FILTER).specs)


def test_the_candidate_serves_the_masked_192x128_instances_only():
    specs = candidate_specs()
    assert {s.name for s in specs} == NAMES
    assert all(not s.signature.mods and s.signature.mask == "mask" for s in specs)  # plain_only, masks = ["mask"]
    assert all(dict(s.algorithm.tile) == {"block_m": 64, "block_n": 96} for s in specs)
    assert all(s.guards.deterministic for s in specs)  # the dQ writer takes deterministic turns: no refusal
    (tile,) = [t for t in catalogue.load("cuda").family("bwd", "hopper").tiles if t.get("block_n") == 96]
    assert tile.candidate and not tile.has_mods and tile.masks == ("mask",)


def test_it_stays_out_of_every_profile_and_replaces_the_64x64_tile():
    every = profiles.enumerate_specs("bwd", "sm_90a", candidates=True)
    assert NAMES <= every.candidates
    for profile in ("minimal", "default", "all"):
        assert not NAMES & {s.name for s in profiles.select("bwd", "sm_90a", profile).specs}
    # the shipped masked tile is the alternative: one of the two per library
    with pytest.raises(profiles.SelectionError, match="is a candidate tile of the same instance as"):
        profiles.select("bwd", "sm_90a", "candidates", "bwd_d192x128_bf16_batch_mask_sm90a_hopper_b64")
    # beside the unmasked 128-key tile (what verify_bwd96.sh's candidate library holds for unmasked rows)
    sel = profiles.select("bwd", "sm_90a", "candidates",
                          "bwd_d192x128_bf16_batch_mask_sm90a_hopper_b64x96,bwd_d192x128_bf16_batch_nmask_sm90a_hopper")
    assert sorted(s.name for s in sel.specs) == ["bwd_d192x128_bf16_batch_mask_sm90a_hopper_b64x96",
                                                 "bwd_d192x128_bf16_batch_nmask_sm90a_hopper_b64x128"]


def test_the_template_instantiates_block_n_96():
    spec = next(s for s in candidate_specs() if s.name.endswith("_bf16_group_mask_sm90a_hopper_b64x96"))
    src = render.render_instance(spec)
    assert "hopper::BwdKernel<MHAKIT_DTYPE_BF16, 192, 128, /*group_mode=*/true, /*masked=*/true," in src
    assert "64, 96, /*mods=*/false>;" in src
    table = render.render_dispatch("bwd", "sm_90a", candidate_specs())
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
    good = next(iter(candidate_specs()))
    reasons = rules.violations(_with(good, **change))
    assert any(re.search(message, r) for r in reasons), reasons
    assert rules.violations(good) == []
    # (192, 128) at 96 keys fits; so do head dims of 128 (128 + 128 <= 320)
    assert rules.violations(_with(good, hdims=(128, 128))) == []


def test_every_shipped_hopper_backward_tile_passes_the_rule():
    for s in profiles.enumerate_specs("bwd", "sm_90a", candidates=True).specs:
        if s.algorithm.family == "hopper":
            assert rules.violations(s) == [], s.name


def test_shipping_it_is_the_two_edits_the_catalogue_comment_names(tmp_path, monkeypatch):
    """Drop `candidate = true` from the b64x96 tile and give the 64 x 64 mask tile `mods_only = true`: plain masked
    calls get b64x96, modifier calls keep the 64 x 64 kernel, the unmasked tile is untouched."""
    text = (catalogue.CATALOGUE_DIR / "cuda.toml").read_text()
    old64 = '{ hdim_q = 192, hdim_v = 128, block_m = 64, block_n = 64, masks = ["mask"] }'
    old96 = 'block_n = 96, masks = ["mask"], plain_only = true, candidate = true }'
    assert text.count(old64) == 1 and text.count(old96) == 1
    switched = text.replace(old64, old64[:-2] + ", mods_only = true }").replace(old96, old96.replace(", candidate = true", ""))
    (tmp_path / "cuda.toml").write_text(switched)
    monkeypatch.setattr(catalogue, "CATALOGUE_DIR", tmp_path)
    catalogue.load.cache_clear()
    try:
        names = {s.name for s in profiles.select("bwd", "sm_90a", "all", "bwd_d192x128_bf16_batch_*hopper").specs}
        assert not profiles.enumerate_specs("bwd", "sm_90a", candidates=True).candidates & NAMES
    finally:
        monkeypatch.undo()
        catalogue.load.cache_clear()
    assert names == {"bwd_d192x128_bf16_batch_mask_sm90a_hopper_b64x96",
                     "bwd_d192x128_bf16_batch_mask_mods_sm90a_hopper_b64x64",
                     "bwd_d192x128_bf16_batch_nmask_sm90a_hopper_b64x128"}


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
