"""Tile choice by sequence length (catalogue `min_seqlen_q` / `max_seqlen_q`): the catalogue's checks, the specs and
the dispatch table that carry a range, the JIT's entries, and the runtime's choice through the real C ABI of a
library whose instances are host stubs (built with nvcc, no GPU: kernel_name launches nothing)."""
from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pytest

from codegen import catalogue, profiles, render
from codegen.catalogue import CatalogueError, Tile, _parse_tile, check_seqlen_ranges

FAM = {"dtypes": ["fp16", "bf16"], "modes": ["batch", "group"], "masks": ["nmask", "mask"]}
# d64 masked group-mode calls up to max_seqlen_q 1024: 128 x 128 (batch mode takes the persistent 192 x 128 tile)
D64_MASKED = [f"fwd_d64_{dt}_group_mask_sm90a_hopper_b128x128" for dt in ("bf16", "fp16")]
# d256 masked up to 1024 query rows: the persistent tile with a 4-slot ring (batch-mode plain calls)
D256_MASKED = [f"fwd_d256_{dt}_batch_mask_sm90a_hopper_b128x64s4" for dt in ("bf16", "fp16")]


def tile(block_m=192, seqlen_q=None, **narrowing) -> Tile:
    return Tile(64, 64, (("block_m", block_m), ("block_n", 128)), seqlen_q=seqlen_q,
                **{k: tuple(v) for k, v in narrowing.items()})


class TestCatalogue:
    def test_range_keys_parse_into_the_tile_not_its_template_parameters(self):
        t = _parse_tile({"hdim_q": 64, "hdim_v": 64, "block_m": 128, "block_n": 128, "max_seqlen_q": 2048,
                         "plain_only": True}, "t", FAM)
        assert t.params == (("block_m", 128), ("block_n", 128)) and t.seqlen_q == (1, 2048) and not t.has_mods
        t = _parse_tile({"hdim_q": 64, "hdim_v": 64, "block_m": 128, "min_seqlen_q": 512, "max_seqlen_q": 512},
                        "t", FAM)
        assert t.seqlen_q == (512, 512) and t.has_mods
        assert _parse_tile({"hdim_q": 64, "hdim_v": 64, "block_m": 128}, "t", FAM).seqlen_q is None

    @pytest.mark.parametrize("raw, message", [
        ({"min_seqlen_q": 16}, "min_seqlen_q: needs max_seqlen_q"),
        ({"min_seqlen_q": 4096, "max_seqlen_q": 2048}, "1 <= min <= max"),
        ({"max_seqlen_q": 0}, "1 <= min <= max"),
        ({"max_seqlen_q": 2048.0}, "must be integers"),
        ({"max_seqlen_q": 2048, "candidate": True}, "a candidate tile replaces the default one"),
        ({"plain_only": 1}, "plain_only: must be true or false"),
    ])
    def test_malformed_ranges_are_one_sentence(self, raw, message):
        with pytest.raises(CatalogueError, match=message):
            _parse_tile({"hdim_q": 64, "hdim_v": 64, "block_m": 128, **raw}, "t", FAM)

    def test_a_group_with_ranged_tiles_needs_exactly_one_default(self):
        check_seqlen_ranges([tile(), tile(128, (1, 2048))], FAM, "f")
        with pytest.raises(CatalogueError, match="have 0 tiles without a seqlen range"):
            check_seqlen_ranges([tile(128, (1, 2048)), tile(192, (2049, 1 << 30))], FAM, "f")
        with pytest.raises(CatalogueError, match="fp16 d64x64 batch mask tiles have 2 tiles without"):
            check_seqlen_ranges([tile(), tile(64), tile(128, (1, 2048), masks=["mask"])], FAM, "f")
        # groups without a ranged tile are left as they are (the ROCm families list several tiles per bucket)
        check_seqlen_ranges([tile(), tile(64)], FAM, "f")
        # a candidate replaces a tile: it neither counts as a second default nor needs one
        check_seqlen_ranges([tile(), tile(128, (1, 2048)), Tile(64, 64, (("block_m", 64),), candidate=True)],
                            FAM, "f")

    def test_ranges_must_not_overlap_within_a_group(self):
        check_seqlen_ranges([tile(), tile(128, (1, 1024)), tile(64, (1025, 2048))], FAM, "f")  # adjacent: fine
        with pytest.raises(CatalogueError, match=r"\[1, 2048\] and \[2048, 4096\] overlap"):
            check_seqlen_ranges([tile(), tile(128, (1, 2048)), tile(64, (2048, 4096))], FAM, "f")
        # the same ranges in different groups (one tile narrowed to fp16, the other to bf16) do not meet
        check_seqlen_ranges([tile(), tile(128, (1, 2048), dtypes=["fp16"]), tile(64, (1, 2048), dtypes=["bf16"])],
                            FAM, "f")

    def test_the_check_runs_when_a_catalogue_loads(self, tmp_path, monkeypatch):
        text = (catalogue.CATALOGUE_DIR / "cuda.toml").read_text()
        ranged = "masks = [\"mask\"], max_seqlen_q = 1024, plain_only = true }"
        assert ranged in text
        monkeypatch.setattr(catalogue, "CATALOGUE_DIR", tmp_path)
        (tmp_path / "overlap.toml").write_text(text.replace(ranged, "masks = [\"mask\"], max_seqlen_q = 2048 },\n"
                                               "  { hdim_q = 64, hdim_v = 64, block_m = 128, block_n = 96, masks = "
                                               "[\"mask\"], min_seqlen_q = 1024, max_seqlen_q = 4096 }"))
        with pytest.raises(CatalogueError, match=r"overlap.toml: fwd.hopper: the fp16 d64x64 group mask tiles: "
                                                 r"the seqlen ranges \[1, 2048\] and \[1024, 4096\] overlap"):
            catalogue.load("overlap")

    def test_the_shipped_catalogue_ranges_the_d64_and_d256_masked_hopper_forward(self):
        hopper = catalogue.load("cuda").family("fwd", "hopper")
        ranged = [t for t in hopper.tiles if t.seqlen_q is not None]
        assert [(t.hdim_q, t.get("block_m"), t.get("block_n"), t.seqlen_q, t.masks, t.dtypes, t.has_mods)
                for t in ranged] == [(64, 128, 128, (1, 1024), ("mask",), ("fp16", "bf16"), False),
                                     (256, 128, 64, (1, 1024), ("mask",), ("fp16", "bf16"), False)]
        # the d64 one serves group mode; the d256 one is the persistent grid with a capped ring, batch mode only
        assert ranged[0].modes == ("group",)
        assert (ranged[1].get("persistent"), ranged[1].get("stages"), ranged[1].modes) == (1, 4, ("batch",))


class TestStagesRule:
    """A Hopper forward tile's `stages` caps a persistent grid's ring (codegen/rules.py,
    hopper_fwd_stages_are_persistent): its instances must run that grid, and the name spells the cap."""

    @staticmethod
    def spec(stages=4, persistent=True, mode="batch", mods=False, dtype="bf16"):
        from codegen import rules
        from codegen.spec import Algorithm, Guards, KernelSpec, Signature
        tile = (("block_m", 128), ("block_n", 64)) + ((("persistent", 1),) if persistent else ()) + \
            ((("stages", stages),) if stages is not None else ())
        fam = catalogue.load("cuda").family("fwd", "hopper")
        spec = KernelSpec(Signature("fwd", dtype, 256, 256, mode, "mask", mods), Algorithm("hopper", "sm_90a", tile), 10,
                          "instance_hopper.cu.j2", Guards.of(fam))
        return spec, rules.violations(spec)

    def test_the_shipped_tile_passes_and_is_named_apart(self):
        spec, reasons = self.spec()
        assert reasons == [] and spec.name == "fwd_d256_bf16_batch_mask_sm90a_hopper_b128x64s4"
        spec, reasons = self.spec(stages=None, persistent=False)
        assert reasons == [] and spec.name == "fwd_d256_bf16_batch_mask_sm90a_hopper_b128x64"

    @pytest.mark.parametrize("change", [dict(persistent=False), dict(mode="group"), dict(mods=True)])
    def test_stages_on_a_one_tile_instance_is_refused(self, change):
        _, reasons = self.spec(**change)
        assert any("caps a persistent grid's ring" in r for r in reasons), reasons

    def test_fp8_batch_instances_run_the_persistent_grid_and_take_stages(self):
        """fp8 instances of a persistent tile run its grid (O in rows of their own), so a cap on the ring is theirs
        too; without `persistent` they are one-tile instances and the cap is refused."""
        spec, reasons = self.spec(dtype="fp8bf16")
        assert spec.persistent and reasons == [] and spec.name.endswith("_b128x64s4")
        _, reasons = self.spec(dtype="fp8bf16", persistent=False)
        assert any("caps a persistent grid's ring" in r for r in reasons), reasons

    @pytest.mark.parametrize("stages", [1, 6])
    def test_stages_out_of_range_is_refused(self, stages):
        _, reasons = self.spec(stages=stages)
        assert any("stages is 2 .. 5" in r for r in reasons), reasons


class TestProfiles:
    def test_default_builds_the_four_ranged_instances_and_minimal_none(self):
        default = {s.name: s for s in profiles.select("fwd", "sm_90a", "default").specs}
        ranged = sorted(n for n, s in default.items() if s.seqlen_q is not None)
        assert ranged == sorted(D64_MASKED + D256_MASKED)
        defaults = [n.replace("b128x128", "b192x128").replace("b128x64s4", "b128x64") for n in ranged]
        assert all(default[n].seqlen_q is None for n in defaults)
        # plain_only: no "_mods" instance of the ranged tile in any profile
        every = profiles.select("fwd", "sm_90a", "all").specs
        assert not [s for s in every if s.seqlen_q is not None and s.signature.mods]
        assert not [s for s in profiles.select("fwd", "sm_90a", "minimal").specs if s.seqlen_q is not None]
        assert not [s for s in profiles.select("bwd", "sm_90a", "default").specs if s.seqlen_q is not None]


class TestDispatchTable:
    def test_rows_carry_the_range_and_defaults_none(self):
        specs = profiles.select("fwd", "sm_90a", "default", "fwd_d64_bf16_group_mask_sm90a_hopper").specs
        text = render.render_dispatch("fwd", "sm_90a", specs)
        for name, lo, hi in (("fwd_d64_bf16_group_mask_sm90a_hopper_b128x128", 1, 1024),
                             ("fwd_d64_bf16_group_mask_sm90a_hopper_b192x128", 0, 0)):
            row = text[text.index(f'{{"{name}"'):]
            row = row[:row.index("&instances::")]
            assert f"/*seqlen_q_min=*/{lo}, /*seqlen_q_max=*/{hi}," in row


class TestJit:
    @pytest.mark.parametrize("dtype", ["bf16", "fp16"])
    @pytest.mark.parametrize("mode", ["batch", "group"])
    def test_a_masked_d64_entry_holds_the_tiles_of_its_mode(self, dtype, mode):
        from mhakit import jit
        names = jit.derive_entry("fwd", "sm_90a", dtype, 64, 64, mode, True).instance_names
        hopper = sorted(n for n in names if "_hopper_" in n)
        assert hopper == [f"fwd_d64_{dtype}_{mode}_mask_sm90a_hopper_b128x128"] * (mode == "group") + \
            [f"fwd_d64_{dtype}_{mode}_mask_sm90a_hopper_b192x128"]
        # head dims served by the d64 bucket take both too; unmasked and modifier calls only the default tile
        assert set(hopper) <= set(jit.derive_entry("fwd", "sm_90a", dtype, 40, 40, mode, True).instance_names)
        unmasked = jit.derive_entry("fwd", "sm_90a", dtype, 64, 64, mode, False).instance_names
        assert [n for n in unmasked if "_hopper_" in n] == [f"fwd_d64_{dtype}_{mode}_nmask_sm90a_hopper_b192x128"]
        if dtype == "bf16":
            mods = jit.derive_entry("fwd", "sm_90a", dtype, 64, 64, mode, True, mods=1).instance_names
            assert [n for n in mods if "_hopper_" in n] == [f"fwd_d64_{dtype}_{mode}_mask_mods_sm90a_hopper_b192x128"]

    def test_prebuild_of_default_covers_the_masked_d64_entries(self):
        from mhakit import jit
        entries = jit.entries_within("fwd", "sm_90a", profiles.select("fwd", "sm_90a", "default").specs)
        with_ranged = {n for e in entries for n in e.instance_names if n in D64_MASKED + D256_MASKED}
        assert with_ranged == set(D64_MASKED + D256_MASKED)


# ------------------------------------------------------------------------------------------------------------------
# The runtime's choice, through mhakit_mha_fwd_kernel_name of a library whose instances are host stubs
# ------------------------------------------------------------------------------------------------------------------

REPO = Path(__file__).resolve().parent.parent
CSRC = REPO / "csrc"
FAKE = 0x7F0000000000  # 16-byte aligned, never dereferenced


def _stub_library(specs, out: Path) -> Path:
    """libmha_fwd.so from the generated dispatch table of `specs` (forward or split-KV ones), the real runtime sources,
    and host stubs for the instances (every run-time guard holds, nothing launches; split-KV: one split)."""
    out.mkdir(parents=True, exist_ok=True)
    table = out / "dispatch.cu"
    table.write_text(render.render_dispatch("fwd", "sm_90a", specs))
    stubs = ['#include "runtime/registry.h"', "namespace mhakit::instances {"]
    for s in specs:
        if s.signature.api == "splitkv":
            stubs += [f"bool {s.name}_supports(const SplitkvParams&) {{ return true; }}",
                      f"int {s.name}_num_splits(const SplitkvParams&, int) {{ return 1; }}",
                      f"dev::Error {s.name}_run(const SplitkvParams&, dev::Stream) {{ return dev::kSuccess; }}"]
            continue
        stubs += [f"bool {s.name}_supports(const FwdParams&) {{ return true; }}",
                  f"dev::Error {s.name}_run(const FwdParams&, dev::Stream) {{ return dev::kSuccess; }}"]
        if s.persistent:  # the tile counter the persistent instances ask for (the table points at the query)
            stubs.append(f"size_t {s.name}_workspace_bytes(const FwdParams&) {{ return 8; }}")
    stubs.append("}  // namespace mhakit::instances")
    (out / "stubs.cu").write_text("\n".join(stubs) + "\n")
    sources = [table, out / "stubs.cu"] + [CSRC / "runtime" / f for f in
                                           ("mha_fwd.cpp", "mha_fwd_splitkv.cpp", "api_common.cpp", "error.cpp",
                                            "device.cpp")]
    lib = out / "libmha_fwd.so"
    cmd = ["nvcc", "-std=c++17", "-shared", "-Xcompiler=-fPIC", "-Xcompiler=-fvisibility=hidden", "-arch=sm_90a",
           f"-I{CSRC}", f"-I{CSRC / 'include'}", *map(str, sources), "-o", str(lib)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return lib


def _args(seqlen_q, *, group_max=None, masked=True, softcap=0.0, d=64):
    from mhakit import _capi
    h, b = 8, 2
    a = _capi.MhakitFwdArgs()
    a.data_type = _capi.DTYPE_BF16
    a.q_ptr = a.k_ptr = a.v_ptr = a.o_ptr = FAKE
    a.batch, a.nhead_q, a.nhead_k, a.hdim_q, a.hdim_v = b, h, h, d, d
    a.seqlen_q = a.seqlen_k = seqlen_q
    a.max_seqlen_q = seqlen_q
    if group_max is not None:  # group mode: seqlen_q / seqlen_k are the packed row counts, max_seqlen_q the longest
        a.is_group_mode = 1
        a.seqstart_q_ptr = a.seqstart_k_ptr = FAKE
        a.max_seqlen_q = group_max
    a.scale_s = 1.0 / math.sqrt(d)
    for t in "qkvo":
        setattr(a, f"stride_{t}", h * d)
        setattr(a, f"nhead_stride_{t}", d)
        setattr(a, f"batch_stride_{t}", seqlen_q * h * d)
    a.window_size_left = -1
    a.window_size_right = 0 if masked else -1
    a.mask_type = 1 if masked else 0
    a.logits_soft_cap = softcap
    return a


@pytest.fixture(scope="module")
def stub_lib(tmp_path_factory):
    from mhakit import _capi
    specs = profiles.select("fwd", "sm_90a", "default", "fwd_d64_bf16_,fwd_d128_bf16_,fwd_d256_bf16_").specs
    return _capi.load_library(_stub_library(specs, tmp_path_factory.mktemp("tilechoice") / "full"))


@pytest.mark.compile
class TestRuntimeChoice:
    @pytest.mark.parametrize("seqlen", [1, 1024, 1025, 4096, 16384])
    def test_batch_mode_takes_the_persistent_192_row_tile_at_every_length(self, stub_lib, seqlen):
        assert stub_lib.kernel_name(_args(seqlen)) == "fwd_d64_bf16_batch_mask_sm90a_hopper_b192x128", \
            stub_lib.last_error()

    @pytest.mark.parametrize("max_seqlen, block", [(1024, "128x128"), (1025, "192x128"), (100, "128x128")])
    def test_group_mode_picks_by_max_seqlen_q(self, stub_lib, max_seqlen, block):
        # 9000 packed rows in both cases: the choice follows max_seqlen_q, not the packed count
        name = stub_lib.kernel_name(_args(9000, group_max=max_seqlen))
        assert name == f"fwd_d64_bf16_group_mask_sm90a_hopper_b{block}", stub_lib.last_error()

    def test_other_calls_keep_their_instances(self, stub_lib):
        # unmasked: the nmask default tile (an unmasked instance beats a masked one before tiles are compared)
        assert stub_lib.kernel_name(_args(1024, masked=False)) == "fwd_d64_bf16_batch_nmask_sm90a_hopper_b192x128"
        # a score modifier: the default tile's "_mods" instance (the ranged tile has none)
        assert stub_lib.kernel_name(_args(1024, softcap=30.0)) == "fwd_d64_bf16_batch_mask_mods_sm90a_hopper_b192x128"
        # head dims of the d64 bucket below 64 choose alike; 72 goes past the bucket (generic d128 is not built)
        assert stub_lib.kernel_name(_args(9000, group_max=1024, d=48)) == "fwd_d64_bf16_group_mask_sm90a_hopper_b128x128"
        assert stub_lib.kernel_name(_args(9000, group_max=4096, d=48)) == "fwd_d64_bf16_group_mask_sm90a_hopper_b192x128"

    @pytest.mark.parametrize("seqlen, tile", [(1, "b128x64s4"), (1024, "b128x64s4"), (1025, "b128x64"),
                                              (4096, "b128x64"), (16384, "b128x64")])
    def test_d256_masked_takes_the_persistent_tile_up_to_1024_rows(self, stub_lib, seqlen, tile):
        assert stub_lib.kernel_name(_args(seqlen, d=256)) == f"fwd_d256_bf16_batch_mask_sm90a_hopper_{tile}", \
            stub_lib.last_error()
        # group mode and modifier calls keep the one-tile instances; unmasked batch calls the persistent one always
        assert stub_lib.kernel_name(_args(9000, group_max=seqlen, d=256)) == \
            "fwd_d256_bf16_group_mask_sm90a_hopper_b128x64"
        assert stub_lib.kernel_name(_args(seqlen, d=256, softcap=30.0)) == \
            "fwd_d256_bf16_batch_mask_mods_sm90a_hopper_b128x64"
        assert stub_lib.kernel_name(_args(seqlen, d=256, masked=False)) == \
            "fwd_d256_bf16_batch_nmask_sm90a_hopper_b128x64s4"

    def test_d128_unmasked_batch_calls_take_128_x_176(self, stub_lib):
        assert stub_lib.kernel_name(_args(4096, d=128, masked=False)) == "fwd_d128_bf16_batch_nmask_sm90a_hopper_b128x176"
        assert stub_lib.kernel_name(_args(4096, d=128)) == "fwd_d128_bf16_batch_mask_sm90a_hopper_b128x128"
        assert stub_lib.kernel_name(_args(9000, group_max=4096, d=128, masked=False)) == \
            "fwd_d128_bf16_group_nmask_sm90a_hopper_b128x128"
        # an unmasked modifier call: the masked "_mods" instance (the default profile builds masked ones only)
        assert stub_lib.kernel_name(_args(4096, d=128, masked=False, softcap=30.0)) == \
            "fwd_d128_bf16_batch_mask_mods_sm90a_hopper_b128x128"

    def test_persistent_instances_want_a_tile_counter_but_run_without_one(self, stub_lib):
        # The batch-mode plain instances of the d64 tiles are persistent (catalogue `persistent`): they ask for the
        # 8-byte counter; group mode and "_mods" instances ask for nothing.
        from mhakit import _capi
        assert stub_lib.workspace_size(_args(1024)) == 8 and stub_lib.workspace_size(_args(4096, masked=False)) == 8
        assert stub_lib.workspace_size(_args(9000, group_max=1024)) == 0
        assert stub_lib.workspace_size(_args(1024, softcap=30.0)) == 0
        # Without a workspace the call goes on (no GPU here: it stops at the device check, past the workspace's);
        # with one smaller than asked it is refused, naming the query.
        assert stub_lib.mha_fwd_raw(_args(1024)) != _capi.ERROR_INVALID_ARGS, stub_lib.last_error()
        small = _args(1024)
        small.workspace_ptr, small.workspace_bytes = 4096, 4
        assert stub_lib.mha_fwd_raw(small) == _capi.ERROR_INVALID_ARGS
        assert "the workspace is too small" in stub_lib.last_error()
        assert "mhakit_mha_fwd_workspace_size" in stub_lib.last_error()

    def test_a_ranged_tile_alone_still_serves_outside_its_range(self, tmp_path):
        from mhakit import _capi
        specs = profiles.select("fwd", "sm_90a", "default",
                                "fwd_d64_bf16_group_mask_sm90a_hopper_b128x128,fwd_d64_bf16_group_mask_sm90a_generic").specs
        lib = _capi.load_library(_stub_library(specs, tmp_path / "ranged_only"))
        for seqlen in (1024, 4096):
            assert lib.kernel_name(_args(9000, group_max=seqlen)) == "fwd_d64_bf16_group_mask_sm90a_hopper_b128x128"


class TestPlainBatch:
    """A plain_batch tile (catalogue) gives the batch-mode plain instances of its signatures in place of the default
    tile's, which keeps the group-mode and "_mods" ones: one entry says what took four."""

    def test_it_parses_to_batch_plain_only_and_refuses_what_would_contradict_it(self):
        t = _parse_tile({"hdim_q": 128, "hdim_v": 128, "block_m": 128, "block_n": 176, "plain_batch": True}, "t", FAM)
        assert t.plain_batch and t.modes == ("batch",) and not t.has_mods and t.has_plain and t.seqlen_q is None
        assert t.params == (("block_m", 128), ("block_n", 176))
        fam = {**FAM, "score_mods": {"mods": ["softcap"]}}
        for extra in ({"modes": ["batch"]}, {"plain_only": True}, {"mods_only": True}, {"candidate": True},
                      {"max_seqlen_q": 1024}, {"unmasked_mods": True}):
            with pytest.raises(CatalogueError, match="a plain_batch tile is the batch-mode plain instances"):
                _parse_tile({"hdim_q": 64, "hdim_v": 64, "block_m": 128, "plain_batch": True, **extra}, "t", fam)
        with pytest.raises(CatalogueError, match="plain_batch: must be true or false"):
            _parse_tile({"hdim_q": 64, "hdim_v": 64, "block_m": 128, "plain_batch": "yes"}, "t", FAM)
        with pytest.raises(CatalogueError, match="its family needs batch mode"):
            _parse_tile({"hdim_q": 64, "hdim_v": 64, "block_m": 128, "plain_batch": True}, "t",
                        {**FAM, "modes": ["group"]})

    def test_one_per_group_and_no_ranged_tile_beside_it(self):
        pb = Tile(64, 64, (("block_m", 128),), modes=("batch",), has_mods=False, plain_batch=True)
        check_seqlen_ranges([tile(), pb], FAM, "f")
        with pytest.raises(CatalogueError, match="more than one plain_batch tile"):
            check_seqlen_ranges([tile(), pb, Tile(64, 64, (("block_m", 64),), modes=("batch",), has_mods=False,
                                                  plain_batch=True)], FAM, "f")
        with pytest.raises(CatalogueError, match="a plain_batch tile and a ranged one"):
            check_seqlen_ranges([tile(), pb, tile(128, (1, 1024))], FAM, "f")

    def test_the_d128_and_d256_unmasked_instances(self):
        """The Hopper forward's d128 / d256 unmasked batch-mode plain calls run the plain_batch tiles; group mode and
        the "_mods" instances (and every masked call) the default tile's; no signature has two instances."""
        specs = profiles.select("fwd", "sm_90a", "all").specs
        for d, default, batch_tile in ((128, "b128x128", "b128x176"), (256, "b128x64", "b128x64s4")):
            for dt in ("fp16", "bf16"):
                names = {s.name for s in specs if s.signature.hdim_q == d and s.signature.dtype == dt
                         and s.algorithm.family == "hopper"}
                assert f"fwd_d{d}_{dt}_batch_nmask_sm90a_hopper_{batch_tile}" in names
                assert f"fwd_d{d}_{dt}_batch_nmask_sm90a_hopper_{default}" not in names
                assert {f"fwd_d{d}_{dt}_group_nmask_sm90a_hopper_{default}",
                        f"fwd_d{d}_{dt}_batch_nmask_mods_sm90a_hopper_{default}",
                        f"fwd_d{d}_{dt}_group_nmask_mods_sm90a_hopper_{default}",
                        f"fwd_d{d}_{dt}_batch_mask_sm90a_hopper_{default}"} <= names
        keyed = {}
        for s in (s for s in specs if s.algorithm.family == "hopper"):
            key = (s.signature, s.seqlen_q)
            assert key not in keyed, (s.name, keyed.get(key))
            keyed[key] = s.name
