"""Catalogue, spec rules, names, profiles, rendering and the ninja file: the code generator without a compiler."""
from __future__ import annotations

import dataclasses
import re
import time

import pytest

from codegen import catalogue, profiles, render, rules
from codegen.ninja import Compile, Executable, NinjaFile
from codegen.spec import Algorithm, Guards, KernelSpec, Signature


def make_spec(family="generic", arch="sm_90a", dtype="bf16", hq=128, hv=128, mode="batch", mask="nmask", api="fwd",
              mods=False):
    tile = (("block_m", 64), ("block_n", 64), ("warps", 4))
    fam = catalogue.load("cuda").family(api, family)
    return KernelSpec(Signature(api, dtype, hq, hv, mode, mask, mods), Algorithm(family, arch, tile), 1,
                      f"instance_{family}.cu.j2", Guards.of(fam))


class TestCatalogue:
    def test_cuda_catalogue_loads_with_both_families(self):
        cat = catalogue.load("cuda")
        assert set(cat.families) >= {("fwd", "hopper"), ("fwd", "generic"), ("splitkv", "decode"),
                                     ("splitkv", "decode_tma")}
        assert cat.arch("sm_90a").families == ("hopper", "generic", "decode_tma", "decode")
        assert "decode_tma" not in cat.arch("sm_80").families
        assert cat.arch("sm_90a").gencode == "arch=compute_90a,code=sm_90a"

    def test_every_arch_lists_known_families_only(self):
        cat = catalogue.load("cuda")
        for arch in cat.arches.values():
            assert set(arch.families) <= {name for _, name in cat.families}

    def test_generic_covers_the_required_head_dims(self):
        tiles = catalogue.load("cuda").families[("fwd", "generic")].tiles
        assert {(t.hdim_q, t.hdim_v) for t in tiles} == {(32, 32), (64, 64), (128, 128), (192, 128), (256, 256)}

    def test_unknown_arch_names_the_known_ones(self):
        with pytest.raises(catalogue.CatalogueError, match="unknown arch 'sm_75'.*sm_90a"):
            catalogue.load("cuda").arch("sm_75")

    def test_family_guards_and_arch_records_are_catalogue_data(self):
        cat = catalogue.load("cuda")
        hopper, generic = cat.family("bwd", "hopper"), cat.family("bwd", "generic")
        assert not hopper.equal_head_dims and hopper.deterministic and hopper.align_bytes == 16
        assert hopper.head_dim_multiple == 8 and generic.head_dim_multiple == 1  # generic serves every head dim
        assert not generic.equal_head_dims and generic.deterministic and "group" in generic.modes
        assert cat.arch_for_compute_capability(9, 0).name == "sm_90a" and cat.arch("sm_90a").arch_specific
        assert cat.arch_for_compute_capability(8, 7).name == "sm_86"      # listed
        assert cat.arch_for_compute_capability(12, 1).name == "sm_120"    # major.0 stands in for major.y
        assert cat.arch_for_compute_capability(7, 5) is None
        assert cat.default_arch in cat.arches
        # Every head dim from 1 to 256 (issue 13): odd ones run on the smallest bucket that holds them.
        assert all(cat.head_dims.accepts(d) for d in (1, 3, 59, 100, 111, 255, 256))
        assert not cat.head_dims.accepts(0) and not cat.head_dims.accepts(257)
        assert cat.head_dims.describe() == "in [1, 256]"

    def test_generic_backward_tuning_knobs_are_in_the_tiles(self):
        for tile in catalogue.load("cuda").family("bwd", "generic").tiles:
            assert {"keys_per_warp", "dq_row_tiles", "dq_block_n", "dq_pass"} <= dict(tile.params).keys()

    def test_unknown_backend(self):
        with pytest.raises(catalogue.CatalogueError, match="no catalogue for backend 'nope'"):
            catalogue.load("nope")


class TestRules:
    def test_valid_generic_spec_passes(self):
        assert rules.violations(make_spec()) == []

    @pytest.mark.parametrize("kwargs, reason", [
        (dict(family="hopper", arch="sm_80"), "sm_90a"),
        (dict(mask="windowed"), "not windowed mask class"),
        (dict(hq=0), "hdim_q=0 is not an accepted head dim: head dims must be in [1, 256]"),
        (dict(hv=264), "hdim_v=264 is not an accepted head dim: head dims must be in [1, 256]"),
        (dict(api="splitkv", family="decode", mods=True), "the decode family has no score modifiers"),
    ])
    def test_invalid_specs_are_rejected_with_a_reason(self, kwargs, reason):
        reasons = rules.violations(make_spec(**kwargs))
        assert any(reason in r for r in reasons), reasons


class TestNames:
    def test_name_is_readable_and_deterministic(self):
        assert make_spec().name == "fwd_d128_bf16_batch_nmask_sm90a_generic_b64x64w4"
        assert make_spec(hq=192, hv=128, mode="group", mask="mask", dtype="fp16").name == \
            "fwd_d192x128_fp16_group_mask_sm90a_generic_b64x64w4"
        assert make_spec(mask="mask", mods=True).name == "fwd_d128_bf16_batch_mask_mods_sm90a_generic_b64x64w4"

    def test_default_names_are_unique_and_tokenised(self):
        specs = profiles.select("fwd", "sm_90a", "default").specs
        names = [s.name for s in specs]
        assert len(names) == len(set(names))
        pattern = re.compile(r"^fwd_d\d+(x\d+)?_(fp16|bf16|fp8bf16)_(batch|group)_(n?mask)(_mods)?_sm\d+a?_(hopper|generic)_b\d+x\d+(w\d+|s\d+)?$")
        # (s<stages>: a persistent Hopper tile that caps its ring, e.g. d256's b128x64s4 beside the one-tile b128x64)
        # the forward library's split-KV (decode) instances: batch "mode", one mask class serving every mask
        # (decode_tma's wgmma tile: g<warpgroups> instead of w<warps>, o1 where its consumer loop is pipelined)
        decode = re.compile(r"^splitkv_d\d+_(fp16|bf16)_batch_mask_sm\d+a?_decode(_tma)?_b\d+x\d+(w\d+|g\d+(o1)?)$")
        assert all(pattern.match(n) or decode.match(n) for n in names), [n for n in names if not pattern.match(n)]
        # decode 2 x 3 buckets, decode_tma 2 x (64, 128) mma.sync + 2 x (64, 128 x 2) wgmma
        assert sum(bool(decode.match(n)) for n in names) == 6 + 4 + 6


class TestProfiles:
    def test_counts(self):
        # minimal: hopper + generic, masked and unmasked, one masked modifier instance of each, one decode and one
        # decode_tma instance
        # (+ 2: decode_tma's wgmma tiles, one and two warpgroups, beside its mma.sync one)
        assert len(profiles.select("fwd", "sm_90a", "minimal").specs) == 4 + 2 + 1 + 1 + 2
        # (+ 1: the Hopper backward's unmasked modifier instance beside its masked one, catalogue unmasked_mods)
        assert len(profiles.select("bwd", "sm_90a", "minimal").specs) == 4 + 2 + 1
        # generic: 2 dtypes x 5 buckets x 2 modes x 2 masks, plus its modifier instances (default: 2 dtypes x the
        # 64 / 128 / 256 buckets x 2 modes, masked only; all: one per plain instance); hopper: 2 dtypes x 3 hdims x
        # 2 modes x 2 masks in the default profile, and (192, 128); `all` adds the Hopper 96 and 192 buckets; the
        # forward library also holds the split-KV instances: decode (2 dtypes x 3 buckets) and, on sm_90a only,
        # decode_tma (2 dtypes x the 64 / 128 buckets); the Hopper modifier instances (forward and backward): bf16 x 64 / 128 / 256
        # x 2 modes, masked, in the default profile, one per plain instance in `all`; fp8 (hopper forward, batch mode,
        # 128 and 256): fp8bf16 x 2 masks in the default profile, fp8fp16 too in `all`; the ranged d64 masked tile
        # (128 x 128 up to max_seqlen_q 1024, plain only, group mode): 2 dtypes in both; decode_tma's wgmma tiles (2
        # dtypes x (d64 one warpgroup, d128 one and two warpgroups)); the ranged d256 masked persistent tile (up to
        # max_seqlen_q 1024, plain, batch mode): 2 dtypes in both
        assert len(profiles.select("fwd", "sm_90a", "default").specs) == 40 + 12 + 32 + 6 + 4 + 6 + 4 + 2 + 6 + 2
        # (the backward's Hopper modifier instances: the unmasked ones of d64 / d128 too, catalogue unmasked_mods:
        # bf16 x 2 buckets x 2 modes)
        assert len(profiles.select("bwd", "sm_90a", "default").specs) == 40 + 12 + 32 + 6 + 4
        assert len(profiles.select("fwd", "sm_90a", "all").specs) == 80 + 48 + 6 + 4 + 48 + 8 + 2 + 6 + 2
        # (the unmasked (192, 128) backward tile is plain only: no nmask "_mods" instance, 2 dtypes x 2 modes)
        assert len(profiles.select("bwd", "sm_90a", "all").specs) == 80 + 48 + 48 - 4
        assert len(profiles.select("fwd", "sm_80", "default").specs) == 40 + 12 + 6

    def test_modifier_instances_are_a_trait_the_profile_narrows(self):
        mods = [s for s in profiles.select("bwd", "sm_90a", "default").specs if s.signature.mods]
        # the Hopper backward's unmasked d64 / d128 modifier calls have instances of their own (catalogue
        # unmasked_mods), which the default profile keeps (its `api` key); the other tiles' take the masked one
        assert {(s.signature.hdim_q, s.signature.mask, s.algorithm.family) for s in mods} == \
            {(d, "mask", f) for d in (64, 128, 256) for f in ("generic", "hopper")} | \
            {(d, "nmask", "hopper") for d in (64, 128)}
        assert {(s.signature.dtype, s.signature.mode) for s in mods if s.algorithm.family == "hopper"} == \
            {("bf16", "batch"), ("bf16", "group")}
        assert all(s.name.split("_")[4:6] == [s.signature.mask, "mods"] for s in mods)
        fwd = [s for s in profiles.select("fwd", "sm_90a", "default").specs if s.signature.mods]
        assert {(s.signature.dtype, s.signature.hdim_q, s.signature.mode, s.signature.mask) for s in fwd
                if s.algorithm.family == "hopper"} == {("bf16", d, m, "mask") for d in (64, 128, 256)
                                                         for m in ("batch", "group")}
        assert sum(s.algorithm.family == "generic" for s in fwd) == 12
        # every modifier instance has its plain twin (the same signature without the modifiers; the same tile except
        # where the plain calls take a tile of their own: the Hopper d128 / d256 batch-mode unmasked ones), and only
        # families whose score_mods list `mods` have them
        every = profiles.enumerate_specs("fwd", "sm_90a").specs
        plain = {s.name for s in every if not s.signature.mods}
        plain_signatures = {s.signature for s in every if not s.signature.mods}
        twins = [s for s in every if s.signature.mods]
        assert len(twins) == 40 + 48
        assert all(dataclasses.replace(s.signature, mods=False) in plain_signatures for s in twins)
        own_tile = [s.name for s in twins if s.name.replace("_mods", "") not in plain]
        assert sorted(own_tile) == sorted(f"fwd_d{d}_{t}_batch_nmask_mods_sm90a_hopper_b128x{n}" for d, n in
                                          ((128, 128), (256, 64)) for t in ("fp16", "bf16"))
        assert all(s.guards.instance_mods for s in twins)
        bwd_twins = [s for s in profiles.enumerate_specs("bwd", "sm_90a").specs if s.signature.mods]
        # (less the unmasked (192, 128) backward tile's 4, which is plain only)
        assert len(bwd_twins) == 40 + 48 - 4 and {s.algorithm.family for s in bwd_twins} == {"generic", "hopper"}
        assert not any(s.signature.mods for s in profiles.enumerate_specs("fwd", "gfx942").specs)
        # the profile's `mods` table narrows modifier instances only; `mods = false` drops them
        generic_mods = make_spec(hq=32, hv=32, mask="nmask", mods=True)
        assert profiles._profile_admits({"hdim": ["32x32"]}, generic_mods)
        assert not profiles._profile_admits({"hdim": ["32x32"], "mods": False}, generic_mods)
        assert profiles._profile_admits({"hdim": ["32x32"], "mods": False}, make_spec(hq=32, hv=32))
        assert not profiles._profile_admits({"mods": {"mask": ["mask"]}}, generic_mods)
        assert profiles._profile_admits({"mods": {"mask": ["mask"]}}, make_spec(hq=32, hv=32))
        sel = profiles.select("fwd", "sm_90a", "default", "_mods_")
        assert len(sel.specs) == 12 + 6
        # a list of tables keeps what any of them keeps
        either = {"mods": [{"family": ["generic"]}, {"family": ["hopper"], "dtype": ["fp16"]}]}
        assert profiles._profile_admits(either, generic_mods)
        assert not profiles._profile_admits(either, make_spec(family="hopper", mask="mask", mods=True))
        assert profiles._profile_admits(either, make_spec(family="hopper", dtype="fp16", mask="mask", mods=True))

    def test_fp8_has_its_own_hopper_tiles_in_batch_mode(self):
        """A tile's `dtypes` / `modes` narrow the family's: fp8 gets the 128 and 256 buckets in batch mode with
        block_n a multiple of 32, the 16-bit dtypes keep their tiles, and no other family (or the backward) has fp8."""
        every = profiles.enumerate_specs("fwd", "sm_90a").specs
        fp8 = [s for s in every if s.signature.dtype.startswith("fp8")]
        assert {(s.signature.dtype, s.signature.hdim_q, s.signature.mode, s.signature.mask) for s in fp8} == {
            (dt, d, "batch", m) for dt in ("fp8bf16", "fp8fp16") for d in (128, 256) for m in ("mask", "nmask")}
        assert all(s.algorithm.family == "hopper" and dict(s.algorithm.tile)["block_n"] % 32 == 0 for s in fp8)
        assert {(s.signature.hdim_q, dict(s.algorithm.tile)["block_n"]) for s in every
                if s.signature.dtype == "bf16" and s.algorithm.family == "hopper" and s.signature.hdim_q == 256} == \
            {(256, 64)}
        assert not any(s.signature.dtype.startswith("fp8") for s in profiles.enumerate_specs("bwd", "sm_90a").specs)
        assert not any(s.signature.dtype.startswith("fp8") for s in profiles.enumerate_specs("fwd", "sm_80").specs)
        # the default profile: one fp8bf16 instance per bucket and mask class, none of them a candidate tile
        default = [s for s in profiles.select("fwd", "sm_90a", "default").specs if "fp8" in s.name]
        assert sorted((s.signature.dtype, s.signature.hdim_q, s.signature.mask) for s in default) == [
            ("fp8bf16", d, m) for d in (128, 256) for m in ("mask", "nmask")]
        chosen = {(t.hdim_q, t.get("block_m"), t.get("block_n")) for t in
                  catalogue.load("cuda").family("fwd", "hopper").tiles if t.dtypes == ("fp8bf16", "fp8fp16")
                  and not t.candidate}
        assert {(s.signature.hdim_q, *(dict(s.algorithm.tile)[k] for k in ("block_m", "block_n")))
                for s in default} == chosen

    def test_candidate_tiles_are_alternatives_built_one_per_library(self):
        """Tiles marked `candidate` (the fp8 d128 sweep, decode_tma's L2 prefetch) stay out of the profiles and the
        JIT; the `candidates` profile lists them, and a selection that holds a candidate beside another tile of its
        instance is refused."""
        fp8_d128 = "fwd_d128_fp8bf16_batch"
        every = profiles.enumerate_specs("fwd", "sm_90a", candidates=True)
        tiles = {(dict(s.algorithm.tile)["block_m"], dict(s.algorithm.tile)["block_n"])
                 for s in every.specs if s.name.startswith(fp8_d128)}
        assert len(tiles) >= 2 and all(n % 32 == 0 and n <= 256 for _, n in tiles)
        # (and the 16-bit masked short-sequence candidates of tools/verify_tilechoice.sh)
        short = tuple(f"fwd_d{d}_{dt}_{m}_mask_sm90a_hopper_{t}" for d, t in ((64, "b128x96"), (128, "b128x160"),
                                                                             (256, "b128x96"))
                      for dt in ("fp16", "bf16") for m in ("batch", "group"))
        assert set(short) <= every.candidates
        # (decode_tma's one-warpgroup wgmma tile with the other consumer loop: b64x64g1o1s3)
        assert every.candidates and all(n.startswith((fp8_d128, "fwd_d128_fp8fp16_batch",
                                                      "splitkv_d128_bf16_batch_mask_sm90a_decode_tma_b32x"))
                                        or re.fullmatch(r"splitkv_d128_bf16_batch_mask_sm90a_decode_tma_b\d+x64g\d(o1)?s\d", n)
                                        for n in every.candidates - set(short))
        assert not profiles.enumerate_specs("fwd", "sm_90a").candidates
        for profile in ("minimal", "default", "all"):
            sel = profiles.select("fwd", "sm_90a", profile)
            assert not sel.candidates and not {s.name for s in sel.specs} & every.candidates
        with pytest.raises(profiles.SelectionError, match="is a candidate tile of the same instance as"):
            profiles.select("fwd", "sm_90a", "candidates", fp8_d128)
        for m, n in tiles:  # one library per tile, with whatever else it needs
            sel = profiles.select("fwd", "sm_90a", "candidates",
                                  f"{fp8_d128}_*_b{m}x{n},fwd_d128_bf16_batch_nmask_sm90a_hopper")
            assert sorted(s.signature.mask for s in sel.specs if s.signature.dtype == "fp8bf16") == ["mask", "nmask"]
            assert len(sel.specs) == 3
        # decode_tma's candidates (L2 prefetch; rings): a candidate's name spells its stages, the chosen tile's
        # neither its stages nor a prefetch of 0, so that candidates differing only in their ring are named apart
        tma = "splitkv_d128_bf16_batch_mask_sm90a_decode_tma_b32x64w4"
        rings = {tma + "s3p2": (3, 2), tma + "s2": (2, 0), tma + "s4": (4, 0), tma + "c1s2": (2, 0), tma + "s3l256": (3, 0)}
        # the one-warpgroup wgmma tile's candidate with the other consumer loop (overlap = 1: o1; and its stages)
        loops = {tma[:-len("b32x64w4")] + "b64x64g1o1s3": True}
        assert {n for n in every.candidates if n.startswith("splitkv")} == set(rings) | set(loops)
        for name, overlap in loops.items():
            (spec,) = profiles.select("fwd", "sm_90a", "candidates", name).specs
            assert bool(dict(spec.algorithm.tile).get("overlap")) == overlap
            assert f"/*overlap=*/{'true' if overlap else 'false'}" in render.render_instance(spec)
        assert [s.name for s in profiles.select("fwd", "sm_90a", "all", tma).specs] == [tma]
        for name, (stages, prefetch) in rings.items():
            sel = profiles.select("fwd", "sm_90a", "candidates", name)
            tile = dict(sel.specs[0].algorithm.tile)
            assert [s.name for s in sel.specs] == [name] and (tile["stages"], tile["prefetch"]) == (stages, prefetch)
            assert tile.get("ctas_per_sm", 0) == (1 if "c1s" in name else 0)  # a cap of CTAs per SM: c<N>
            assert tile.get("l2_promotion") == (256 if name.endswith("l256") else None)  # L2 promotion: l<bytes>
        # the JIT derives one fp8 instance per call, never a candidate
        from mhakit import jit
        for masked in (False, True):
            entry = jit.derive_entry("fwd", "sm_90a", "fp8bf16", 128, 128, "batch", masked)
            assert len(entry.instance_names) == 1 and not set(entry.instance_names) & every.candidates

    def test_tile_masks_and_candidate_keys(self):
        from codegen.catalogue import CatalogueError, _parse_tile
        fam = {"dtypes": ["fp16", "bf16"], "modes": ["batch"], "masks": ["nmask", "mask"]}
        tile = _parse_tile({"hdim_q": 64, "hdim_v": 64, "block_m": 64, "masks": ["mask"], "candidate": True}, "t", fam)
        assert tile.params == (("block_m", 64),) and tile.candidate
        assert tile.serves("fp16", "batch", "mask") and not tile.serves("fp16", "batch", "nmask")
        with pytest.raises(CatalogueError, match="masks: must be a non-empty list of the family's masks"):
            _parse_tile({"hdim_q": 64, "hdim_v": 64, "block_m": 64, "masks": ["causal"]}, "t", fam)
        with pytest.raises(CatalogueError, match="candidate: must be true or false"):
            _parse_tile({"hdim_q": 64, "hdim_v": 64, "block_m": 64, "candidate": 1}, "t", fam)

    def test_tile_narrowing_must_name_the_familys_values(self, tmp_path):
        from codegen.catalogue import CatalogueError, _parse_tile
        fam = {"dtypes": ["fp16", "bf16"], "modes": ["batch"]}
        with pytest.raises(CatalogueError, match="dtypes: must be a non-empty list of the family's dtypes"):
            _parse_tile({"hdim_q": 64, "hdim_v": 64, "block_m": 64, "dtypes": ["fp8bf16"]}, "t", fam)
        tile = _parse_tile({"hdim_q": 64, "hdim_v": 64, "block_m": 64, "modes": ["batch"]}, "t", fam)
        assert tile.params == (("block_m", 64),) and tile.serves("fp16", "batch") and not tile.serves("fp16", "group")

    def test_v3_keeps_only_the_hopper_family(self):
        specs = profiles.select("fwd_v3", "sm_90a", "default").specs
        assert specs and all(s.algorithm.family == "hopper" for s in specs)

    def test_filter_glob_substring_and_list(self):
        sel = profiles.select("fwd", "sm_90a", "default", "d64_fp16")
        assert sel.specs and all("d64_fp16" in s.name for s in sel.specs)
        glob = profiles.select("fwd", "sm_90a", "default", "*hopper*")
        assert {s.algorithm.family for s in glob.specs} == {"hopper"}
        both = profiles.select("fwd", "sm_90a", "default", "d64_fp16_batch_nmask*generic*,d256_bf16_group_mask_sm*generic*")
        assert len(both.specs) == 2
        twins = profiles.select("fwd", "sm_90a", "default", "d256_bf16_group_mask*generic*")  # plain and "_mods"
        assert sorted(s.signature.mods for s in twins.specs) == [False, True]

    def test_errors_are_one_clear_sentence(self):
        with pytest.raises(profiles.SelectionError, match="unknown profile 'huge'"):
            profiles.select("fwd", "sm_90a", "huge")
        with pytest.raises(profiles.SelectionError, match="selects no fwd instance"):
            profiles.select("fwd", "sm_90a", "default", "no_such_kernel")
        with pytest.raises(profiles.SelectionError, match="no kernel family for api 'fwd_v3' on sm_80"):
            profiles.select("fwd_v3", "sm_80")
        with pytest.raises(profiles.SelectionError, match="unknown api"):
            profiles.select("fwdx", "sm_90a")


class TestRendering:
    def test_instance_source_instantiates_the_family_template(self):
        generic = render.render_instance(make_spec(hq=192, hv=128, mode="group", mask="mask", dtype="fp16"))
        assert "generic::FwdKernel<MHAKIT_DTYPE_FP16, 192, 128, /*group_mode=*/true,\n" in generic
        assert "/*masked=*/true, 64, 64, 4,\n                                  /*mods=*/false>;" in generic
        mods = render.render_instance(make_spec(mask="mask", mods=True))
        assert "/*mods=*/true>;" in mods and "the score modifiers' kernel in place of the plain one" in mods
        assert "score modifiers" not in generic
        spec = profiles.select("fwd", "sm_90a", "default", "fwd_d128_bf16_batch_mask_sm90a_hopper*").specs[0]
        hopper = render.render_instance(spec)
        # The d128 tile is `persistent` (catalogue): its batch-mode plain instance asks for the persistent grid and
        # has a workspace query; its group-mode twin does not.
        assert "hopper::FwdKernel<MHAKIT_DTYPE_BF16, 128, 128, /*group_mode=*/false, /*masked=*/true,\n                                 128, 128, /*mods=*/false, /*persistent=*/true>" in hopper
        assert f"size_t {spec.name}_workspace_bytes(" in hopper
        assert "score modifiers" not in hopper
        group_spec = profiles.select("fwd", "sm_90a", "default", "fwd_d128_bf16_group_mask_sm90a_hopper*").specs[0]
        group_text = render.render_instance(group_spec)
        assert "128, 128, /*mods=*/false>;" in group_text and "workspace_bytes" not in group_text
        d256 = profiles.select("fwd", "sm_90a", "default", "fwd_d256_bf16_batch_mask_sm90a_hopper*").specs[0]
        assert not d256.persistent  # measured slower persistent: one CTA per tile
        assert spec.persistent and not group_spec.persistent
        table = render.render_dispatch("fwd", "sm_90a", [spec, group_spec])
        assert table.count("/*workspace_optional=*/true") == 1 and table.count("/*workspace_optional=*/false") == 1
        assert table.count("/*persistent=*/true}") == 1 and table.count("/*persistent=*/false}") == 1
        # fp8 tiles are persistent too, but their workspace (V transposed, after the counter) is needed, not wanted
        fp8 = profiles.select("fwd", "sm_90a", "default", "fwd_d128_fp8bf16_batch_nmask_sm90a_hopper*").specs[0]
        assert fp8.persistent and "/*persistent=*/true>" in render.render_instance(fp8)
        fp8_table = render.render_dispatch("fwd", "sm_90a", [fp8])
        assert "/*workspace_optional=*/false, /*persistent=*/true}" in fp8_table
        mods_spec = profiles.select("fwd", "sm_90a", "all", "fwd_d128_fp16_group_mask_mods_sm90a_hopper*").specs[0]
        hopper_mods = render.render_instance(mods_spec)
        assert "hopper::FwdKernel<MHAKIT_DTYPE_FP16, 128, 128, /*group_mode=*/true, /*masked=*/true,\n                                 128, 128, /*mods=*/true>" in hopper_mods
        assert "the score modifiers' kernel in place of the plain one (\"_mods\": soft-cap, bias / ALiBi, sink)" in hopper_mods
        bwd = profiles.select("bwd", "sm_90a", "default", "bwd_d128_bf16_batch_mask_sm90a_hopper*").specs[0]
        assert "64, 128, /*mods=*/false>;" in render.render_instance(bwd)
        bwd_mods = profiles.select("bwd", "sm_90a", "default", "bwd_d128_bf16_group_mask_mods_sm90a_hopper*").specs[0]
        bwd_text = render.render_instance(bwd_mods)
        assert "hopper::BwdKernel<MHAKIT_DTYPE_BF16, 128, 128, /*group_mode=*/true, /*masked=*/true,\n                                 64, 128, /*mods=*/true>" in bwd_text
        assert "(the backward: with dbias and d sink)" in bwd_text
        assert f"bool {spec.name}_supports(" in hopper and f"dev::Error {spec.name}_run(" in hopper

    def test_dispatch_lists_every_instance_with_its_traits(self):
        everything = profiles.select("fwd", "sm_90a", "minimal").specs
        text = render.render_dispatch("fwd", "sm_90a", everything)
        specs = [s for s in everything if s.signature.api == "fwd"]
        splitkv = [s for s in everything if s.signature.api == "splitkv"]
        assert f"const int kNumFwdInstances = {len(specs)};" in text
        assert len(splitkv) == 4 and "const int kNumSplitkvInstances = 4;" in text
        tma, = [s for s in splitkv if s.algorithm.family == "decode_tma" and "warps" in dict(s.algorithm.tile)]
        wg, = [s for s in splitkv if dict(s.algorithm.tile).get("warpgroups") == 1]
        plain, = [s for s in splitkv if s.algorithm.family == "decode"]
        # each with its family's priority and static guards (decode_tma: TMA's 16-byte units, whole 16-byte chunks)
        assert (f'{{"{plain.name}", MHAKIT_DTYPE_BF16, 128, 128, /*priority=*/1,\n'
                "     /*equal_head_dims=*/false, /*align_bytes=*/2,\n     /*head_dim_multiple=*/1,") in text
        assert (f'{{"{tma.name}", MHAKIT_DTYPE_BF16, 128, 128, /*priority=*/10,\n'
                "     /*equal_head_dims=*/false, /*align_bytes=*/16,\n     /*head_dim_multiple=*/8, /*min_rows=*/0,") in text
        # the wgmma tile: the same family's row, with the packed rows from which the runtime prefers it
        assert (f'{{"{wg.name}", MHAKIT_DTYPE_BF16, 128, 128, /*priority=*/10,\n'
                "     /*equal_head_dims=*/false, /*align_bytes=*/16,\n     /*head_dim_multiple=*/8, /*min_rows=*/64,") in text
        alone = render.render_dispatch("fwd", "sm_90a", splitkv)  # a decode-only library: an empty mha_fwd table
        assert "kFwdInstances[1] = {\n};" in alone and "const int kNumFwdInstances = 0;" in alone
        assert 'const BuiltArch kFwdBuiltArch = {"sm_90a", 9, 0, /*arch_specific=*/true};' in text
        assert "const HeadDimRule kFwdHeadDims = {/*multiple=*/1, /*max=*/256};" in text
        for s in specs:
            assert f'{{"{s.name}", MHAKIT_DTYPE_BF16, 128, 128, /*group_mode=*/false' in text
        hopper = [s for s in specs if s.algorithm.family == "hopper"]
        assert hopper and all(not s.guards.equal_head_dims and s.guards.align_bytes == 16 for s in hopper)
        assert text.count("/*equal_head_dims=*/false,\n     /*deterministic=*/true, /*align_bytes=*/16") == len(hopper)
        assert text.count("/*head_dim_multiple=*/8,") == len(hopper) + 3  # + decode_tma (mma.sync, 2 x wgmma)
        assert text.count("/*head_dim_multiple=*/1,") == len(specs) - len(hopper) + 1  # + decode
        assert text.count("/*mods=*/true,") == sum(s.signature.mods for s in specs) == 2
        assert text.count("/*mods=*/false,") == len(specs) - 2
        # what each instance serves of the score modifiers (catalogue score_mods), as mhakit_score_mod bits
        for s in specs:
            row = text[text.index(f'{{"{s.name}"'):]
            row = row[:row.index("&instances::")]
            # (both families: a sink alone on the plain instances, the per-score modifiers on the "_mods" ones)
            every = "MHAKIT_MOD_SINK | MHAKIT_MOD_SOFTCAP | MHAKIT_MOD_BIAS | MHAKIT_MOD_ALIBI | MHAKIT_MOD_DROPOUT"
            served = every if s.signature.mods else "MHAKIT_MOD_SINK"
            assert f"/*mod_kinds=*/{served}, /*plain_mod_kinds=*/MHAKIT_MOD_SINK," in row
        sm80 = render.render_dispatch("bwd", "sm_86", profiles.select("bwd", "sm_86", "minimal").specs)
        assert 'const BuiltArch kBwdBuiltArch = {"sm_86", 8, 6, /*arch_specific=*/false};' in sm80

    def test_generic_backward_instance_passes_the_catalogue_knobs(self):
        spec = profiles.select("bwd", "sm_90a", "default", "bwd_d128_bf16_group_mask_sm90a_generic").specs[0]
        text = render.render_instance(spec)
        assert "/*keys_per_warp=*/16, /*dq_row_tiles=*/2,\n" in text and "/*dq_block_n=*/32, /*dq_pass=*/1,\n" in text
        assert "/*dq_pass=*/1,\n                                  /*mods=*/false>;" in text

    def test_write_if_changed_keeps_mtime_of_identical_content(self, tmp_path):
        path = tmp_path / "a.cu"
        assert render.write_if_changed(path, "x")
        before = path.stat().st_mtime_ns
        time.sleep(0.01)
        assert not render.write_if_changed(path, "x")
        assert path.stat().st_mtime_ns == before
        assert render.write_if_changed(path, "y") and path.read_text() == "y"

    def test_render_all_is_stable(self, tmp_path):
        specs = profiles.select("fwd", "sm_90a", "minimal").specs
        first = render.render_all("fwd", "sm_90a", specs, tmp_path)
        mtimes = {p: p.stat().st_mtime_ns for p in first[0] + [first[1]]}
        second = render.render_all("fwd", "sm_90a", specs, tmp_path)
        assert first == second
        assert all(p.stat().st_mtime_ns == m for p, m in mtimes.items())


class TestNinjaFile:
    def make(self, tmp_path):
        compiles = [Compile(tmp_path / "a.cu", tmp_path / "obj/a.o", True),
                    Compile(tmp_path / "rt.cpp", tmp_path / "obj/rt.o", False),
                    Compile(tmp_path / "bench.cpp", tmp_path / "obj/bench.o", False)]
        return NinjaFile("/usr/bin/nvcc", ["-O3", "-gencode=arch=compute_90a,code=sm_90a"], ["-O2"], compiles,
                         tmp_path / "out/libmha_bwd.so",
                         [Executable(tmp_path / "out/benchmark_mha_bwd", [tmp_path / "obj/bench.o"],
                                     [tmp_path / "inst/libmha_fwd.so"])])

    def test_rules_and_targets(self, tmp_path):
        text = self.make(tmp_path).text()
        assert "device_flags = -O3 -gencode=arch=compute_90a,code=sm_90a" in text
        assert f"build {tmp_path}/obj/a.o: compile_device {tmp_path}/a.cu" in text
        assert f"build {tmp_path}/obj/rt.o: compile_host {tmp_path}/rt.cpp" in text
        # the library links the kernel and runtime objects, not the benchmark's
        assert f"build {tmp_path}/out/libmha_bwd.so: link_shared {tmp_path}/obj/a.o {tmp_path}/obj/rt.o\n" in text
        assert "-Xlinker -rpath='$$ORIGIN'" in text
        # the executable links its own library and the extra one, and relinks when either changes
        assert f"  libs = -L{tmp_path}/out -lmha_bwd -L{tmp_path}/inst -lmha_fwd" in text
        assert f"| {tmp_path}/out/libmha_bwd.so {tmp_path}/inst/libmha_fwd.so" in text
        assert text.rstrip().splitlines()[-1].startswith("default ")

    def test_depfiles_make_header_edits_rebuild(self, tmp_path):
        text = self.make(tmp_path).text()
        assert text.count("depfile = $out.d") == 2 and "-MD -MF $out.d" in text
