"""The JIT's instance derivation, cache keys, cross-process locking, atomic installs and corrupt-entry recovery.

CPU only (fake toolchains and fake builders), except the tests marked `compile`, which run nvcc for one small
library (two processes asking for it at once: one builds, the other waits and loads it)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import REPO, have_nvcc
from mhakit import _codegen, jit

toolchain_mod = _codegen.submodule("toolchain")
catalogue_mod = _codegen.submodule("catalogue")
profiles_mod = _codegen.submodule("profiles")
render_mod = _codegen.submodule("render")
build_mod = _codegen.submodule("build")


def sub_env(**extra) -> dict:
    """Environment for child Pythons: this checkout first on sys.path (an older mhakit may be installed)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(extra)
    return env


def fake_toolchain(arch="sm_90a", version="13.0.88", path="/opt/fake-cuda/bin/nvcc"):
    return toolchain_mod.Nvcc(arch=arch, gencode=catalogue_mod.load("cuda").arch(arch).gencode, path=path,
                              version=version, cutlass=Path("/opt/fake-cutlass"))


SOFTCAP, BIAS, ALIBI, SINK, DROPOUT = (1, 2, 4, 8, 16)  # mhakit_score_mod bits (_capi.SCORE_MOD_BITS)


def entry(dtype="bf16", hq=128, hv=128, mode="batch", masked=False, arch="sm_90a", api="fwd", mods=0):
    return jit.derive_entry(api, arch, dtype, hq, hv, mode, masked, mods=mods)


class FakeBuilder:
    """Writes a small 'library' whose bytes depend on the key; counts calls."""

    def __init__(self, delay: float = 0.0):
        self.calls = 0
        self.delay = delay

    def __call__(self, plan, stage, build_dir, jobs):
        self.calls += 1
        time.sleep(self.delay)
        lib = stage / "libmha_fwd.so"
        lib.write_bytes(b"\x7fELF fake " + plan.key.encode() * 20)
        return lib


def make_cache(tmp_path, builder=None):
    return jit.KernelCache(tmp_path / "cache", builder=builder or FakeBuilder(), log=lambda msg: None)


# ----------------------------------------------------------------------------------------------------------------
# Which instances a call needs
# ----------------------------------------------------------------------------------------------------------------

class TestDerive:
    def test_hopper_batch_equal_dims_gets_hopper_and_generic_fallback(self):
        e = entry()
        assert e.instance_names == ["fwd_d128_bf16_batch_nmask_sm90a_hopper_b128x176",
                                    "fwd_d128_bf16_batch_nmask_sm90a_generic_b128x64w4"]
        assert e.name == "fwd_bf16_batch_nmask_sm90a-hopper_d128-generic_d128"

    def test_mask_class_and_dtype_select_the_signature(self):
        e = entry(dtype="fp16", masked=True)
        assert all("_fp16_batch_mask_" in n for n in e.instance_names) and len(e.instance_names) == 2

    @pytest.mark.parametrize("hq, hv, expected", [
        (24, 24, ["fwd_d64_fp16_batch_nmask_sm90a_hopper_b192x128", "fwd_d32_fp16_batch_nmask_sm90a_generic_b128x128w4"]),
        (96, 96, ["fwd_d96_fp16_batch_nmask_sm90a_hopper_b128x128", "fwd_d128_fp16_batch_nmask_sm90a_generic_b128x64w4"]),
        (160, 128, ["fwd_d192x128_fp16_batch_nmask_sm90a_hopper_b128x96",  # d != dv: the (192, 128) instances
                    "fwd_d192x128_fp16_batch_nmask_sm90a_generic_b64x64w4"]),
        (160, 160, ["fwd_d192_fp16_batch_nmask_sm90a_hopper_b128x96",
                    "fwd_d256_fp16_batch_nmask_sm90a_generic_b64x64w4"]),
        (16, 256, ["fwd_d256_fp16_batch_nmask_sm90a_hopper_b128x64s4", "fwd_d256_fp16_batch_nmask_sm90a_generic_b64x64w4"]),
    ])
    def test_tightest_bucket_per_family(self, hq, hv, expected):
        assert entry("fp16", hq, hv).instance_names == expected

    @pytest.mark.parametrize("hq, hv, expected", [
        (1, 1, ["fwd_d32_bf16_batch_nmask_sm90a_generic_b128x128w4"]),
        (3, 3, ["fwd_d32_bf16_batch_nmask_sm90a_generic_b128x128w4"]),
        (59, 59, ["fwd_d64_bf16_batch_nmask_sm90a_generic_b128x128w4"]),
        (111, 59, ["fwd_d128_bf16_batch_nmask_sm90a_generic_b128x64w4"]),
        (111, 111, ["fwd_d128_bf16_batch_nmask_sm90a_generic_b128x64w4"]),
        (185, 127, ["fwd_d192x128_bf16_batch_nmask_sm90a_generic_b64x64w4"]),
        (255, 255, ["fwd_d256_bf16_batch_nmask_sm90a_generic_b64x64w4"]),
        (56, 56, ["fwd_d64_bf16_batch_nmask_sm90a_hopper_b192x128", "fwd_d64_bf16_batch_nmask_sm90a_generic_b128x128w4"]),
    ])
    def test_any_head_dim_gets_the_smallest_bucket_and_odd_ones_skip_hopper(self, hq, hv, expected):
        # [head_dims] accepts 1..256; [fwd.hopper] head_dim_multiple = 8, so JIT builds no hopper instance for 59
        assert entry("bf16", hq, hv).instance_names == expected

    @pytest.mark.parametrize("api, arch", [("fwd", "sm_90a"), ("bwd", "sm_90a"), ("fwd", "sm_80"), ("fwd", "gfx942")])
    def test_entries_within_covers_every_head_dim(self, api, arch):
        """entries_within derives entries from a few representative head dims; every accepted (hq, hv) pair (here:
        every hq against every hv of a spread) must derive one of them."""
        specs = jit._catalogue_specs(api, arch)
        names = {e.name for e in jit.entries_within(api, arch, specs)}
        head_dims = catalogue_mod.load(catalogue_mod.backend_of_arch(arch)).head_dims
        dims = range(head_dims.multiple, head_dims.max + 1, head_dims.multiple)
        for hq in dims:
            for hv in sorted({hq, 8, 56, 64, 120, 128, 200, 256, hq - head_dims.multiple} & set(dims)):
                for masked in (False, True):
                    e = jit.derive_entry(api, arch, "fp16", hq, hv, "batch", masked)
                    assert e.name in names, (hq, hv, masked, e.name)
                    if arch.startswith("sm"):
                        for mods in (SOFTCAP, BIAS | SINK, SINK, DROPOUT, ALIBI | DROPOUT):
                            e = jit.derive_entry(api, arch, "fp16", hq, hv, "batch", masked, mods=mods)
                            assert e.name in names, (hq, hv, masked, mods, e.name)

    def test_group_mode_and_other_arches(self):
        assert entry(mode="group").instance_names == ["fwd_d128_bf16_group_nmask_sm90a_hopper_b128x128",
                                                      "fwd_d128_bf16_group_nmask_sm90a_generic_b128x64w4"]
        assert entry(api="bwd", mode="group").instance_names == [
            "bwd_d128_bf16_group_nmask_sm90a_hopper_b64x128", "bwd_d128_bf16_group_nmask_sm90a_generic_b64x64w4"]
        assert entry(arch="sm_80").instance_names == ["fwd_d128_bf16_batch_nmask_sm80_generic_b128x64w4"]
        assert entry(arch="sm_100", mode="group", masked=True).instance_names == [
            "fwd_d128_bf16_group_mask_sm100_generic_b128x64w4"]

    def test_splitkv_entries_live_in_the_forward_library(self):
        """mha_fwd_kvcache's calls derive entries of the decode families (one instance per bucket serves every
        mask), built as libmha_fwd.so: on sm_90a the decode_tma instance first where its static guards admit the head
        dims (multiples of 8 within 64 / 128; with its mma.sync tile its wgmma tiles, which the runtime picks
        by the call's packed rows) with the decode one as the fallback, else decode alone; mha_fwd's
        entries never pull a decode instance in."""
        tile = {64: "b64x64w4", 128: "b32x64w4", 256: "b16x32w2"}
        for hq, hv, bucket in [(59, 100, 128), (200, 64, 256), (72, 256, 256)]:
            e = jit.derive_entry("splitkv", "sm_90a", "fp16", hq, hv, "batch", True)
            assert e.api == "fwd" and e.instance_names == [f"splitkv_d{bucket}_fp16_batch_mask_sm90a_decode_"
                                                           + tile[bucket]]
        wgmma = {64: ["splitkv_d64_fp16_batch_mask_sm90a_decode_tma_b64x64g1"],
                 128: ["splitkv_d128_fp16_batch_mask_sm90a_decode_tma_b128x64g2",
                       "splitkv_d128_fp16_batch_mask_sm90a_decode_tma_b64x64g1"]}
        for hq, hv, bucket in [(128, 128, 128), (8, 64, 64), (72, 128, 128), (128, 64, 128)]:
            e = jit.derive_entry("splitkv", "sm_90a", "fp16", hq, hv, "batch", True)
            assert e.api == "fwd" and e.instance_names == [
                *sorted([f"splitkv_d{bucket}_fp16_batch_mask_sm90a_decode_tma_{'b32x64w4'}", *wgmma[bucket]]),
                f"splitkv_d{bucket}_fp16_batch_mask_sm90a_decode_{tile[bucket]}"]
        assert jit.derive_entry("splitkv", "sm_80", "bf16", 128, 128, "batch", True).instance_names == [
            "splitkv_d128_bf16_batch_mask_sm80_decode_b32x64w4"]
        assert all(not n.startswith("splitkv") for n in entry(masked=True).instance_names)

    @pytest.mark.parametrize("api", ["fwd", "bwd"])
    def test_a_modifier_call_gets_the_modifier_instance_alone(self, api):
        """Modifier calls that no Hopper instance takes (an arch without the Hopper family, a head dim that is not a
        multiple of 8) need the "_mods" instance of the tightest generic bucket alone; plain calls never pull one
        in."""
        tile = {"fwd": {64: "b128x128w4", 128: "b128x64w4"}, "bwd": {64: "b64x128w8", 128: "b64x64w4"}}[api]
        for mods in (DROPOUT, DROPOUT | SOFTCAP):
            e = entry(api=api, mods=mods, masked=True, arch="sm_80")
            assert e.instance_names == [f"{api}_d128_bf16_batch_mask_mods_sm80_generic_{tile[128]}"], mods
            assert e.name == f"{api}_bf16_batch_mask_mods_sm80-generic_d128"
            # an unmasked one too: the masked modifier instance serves it (the default profile builds only those)
            assert entry(api=api, hq=59, hv=59, mods=mods, mode="group").instance_names == [
                f"{api}_d64_bf16_group_mask_mods_sm90a_generic_{tile[64]}"]
        for masked in (False, True):
            assert not any("_mods_" in n for n in entry(api=api, masked=masked).instance_names)
        with pytest.raises(ValueError, match=r"with score modifiers \(softcap\)"):
            entry(api=api, arch="gfx942", mods=SOFTCAP)
        with pytest.raises(ValueError, match="unknown score-modifier bits 0x20"):
            entry(api=api, mods=32)

    @pytest.mark.parametrize("api", ["fwd", "bwd"])
    @pytest.mark.parametrize("mods", [SOFTCAP, BIAS, ALIBI, SOFTCAP | ALIBI | SINK, BIAS | SINK, DROPOUT,
                                      DROPOUT | SOFTCAP | SINK])
    def test_a_hopper_modifier_call_gets_the_hopper_modifier_instance(self, mods, api):
        """Soft-cap, bias / ALiBi, sinks and dropout run on the Hopper "_mods" instance, forward and backward
        (catalogue score_mods), with the generic one as the fallback for the calls Hopper refuses at run time
        (unaligned, odd head dims). The forward's masked instance serves unmasked calls too; the backward's unmasked
        d128 calls take an unmasked one (catalogue unmasked_mods), beside the generic masked one."""
        tiles = {"fwd": ("b128x128", "b128x64w4", "b128x96", "b64x64w4", "b128x128w4"),
                 "bwd": ("b64x128", "b64x64w4", "b64x64", "b32x64w8", "b64x128w8")}[api]
        for masked in (False, True):
            e = entry(api=api, mods=mods, masked=masked)
            own = api == "bwd" and not masked
            cls = "nmask" if own else "mask"
            assert e.instance_names == [f"{api}_d128_bf16_batch_{cls}_mods_sm90a_hopper_{tiles[0]}",
                                        f"{api}_d128_bf16_batch_mask_mods_sm90a_generic_{tiles[1]}"]
            assert e.name == f"{api}_bf16_batch_{cls}_mods_sm90a-hopper_d128-generic_d128" + ("_mask_mods" if own else "")
        # (192, 128) has no unmasked "_mods" tile: the masked one of its own bucket, not the d192 bucket's unmasked one
        assert entry(api=api, mods=mods, hq=192, hv=128, mode="group").instance_names == [
            f"{api}_d192x128_bf16_group_mask_mods_sm90a_hopper_{tiles[2]}",
            f"{api}_d192x128_bf16_group_mask_mods_sm90a_generic_{tiles[3]}"]
        # a head dim Hopper does not take (not a multiple of 8): generic alone
        assert entry(api=api, mods=mods, hq=59, hv=59).instance_names == [
            f"{api}_d64_bf16_batch_mask_mods_sm90a_generic_{tiles[4]}"]

    def test_a_sink_alone_gets_the_plain_instances(self):
        """A sink changes no score, only the final normalisation (and d sink): the plain instances of both families
        serve it (catalogue score_mods.plain), forward and backward, so a sink call's entry is the plain call's."""
        for masked, mask, tile in ((False, "nmask", "b128x176"), (True, "mask", "b128x128")):
            e = entry(mods=SINK, masked=masked)
            assert e.instance_names == [f"fwd_d128_bf16_batch_{mask}_sm90a_hopper_{tile}",
                                        f"fwd_d128_bf16_batch_{mask}_sm90a_generic_b128x64w4"]
            assert e.name == entry(masked=masked).name == f"fwd_bf16_batch_{mask}_sm90a-hopper_d128-generic_d128"
            assert entry(api="bwd", mods=SINK, masked=masked).instance_names == [
                f"bwd_d128_bf16_batch_{mask}_sm90a_hopper_b64x128", f"bwd_d128_bf16_batch_{mask}_sm90a_generic_b64x64w4"]
        # with a per-score modifier beside it, the "_mods" instances
        assert entry(mods=SINK | SOFTCAP).instance_names[0] == "fwd_d128_bf16_batch_mask_mods_sm90a_hopper_b128x128"

    def test_modifier_entries_within_a_profile(self):
        default = profiles_mod.select("bwd", "sm_90a", "default").specs
        mods = [e.name for e in jit.entries_within("bwd", "sm_90a", default) if "_mods_" in e.name]
        # the default profile's masked modifier instances of 64 / 128 / 256: generic alone (fp16, bf16; batch, group:
        # 12), and each bf16 Hopper one with its generic "_mods" fallback (6; a sink alone takes the plain entries);
        # the backward's unmasked d64 / d128 calls: each bf16 Hopper unmasked one with the generic masked one (4)
        assert len(mods) == 22 and sum("_nmask_mods_" in n for n in mods) == 4
        assert all("_mask_mods_" in n for n in mods if "_nmask_mods_" not in n)
        for api, unmasked in (("fwd", 0), ("bwd", 4)):
            entries = jit.entries_within(api, "sm_90a", profiles_mod.select(api, "sm_90a", "default").specs)
            hopper_mods = {sp.name for e in entries for sp in e.specs
                           if sp.signature.mods and sp.algorithm.family == "hopper"}
            assert len(hopper_mods) == 6 + unmasked and all("_bf16_" in n for n in hopper_mods)
            assert sum(n.split("_")[4] == "nmask" for n in hopper_mods) == unmasked

    def test_unknown_values_are_refused(self):
        with pytest.raises(ValueError, match="dtype must be one of"):
            jit.derive_entry("fwd", "sm_90a", "fp32", 128, 128, "batch", False)
        with pytest.raises(ValueError, match="no fwd kernel in the catalogue serves"):
            jit.derive_entry("fwd", "sm_90a", "bf16", 264, 128, "batch", False)

    def test_entries_within_a_profile(self):
        minimal = profiles_mod.select("fwd", "sm_90a", "minimal").specs
        names = [e.name for e in jit.entries_within("fwd", "sm_90a", minimal)]
        assert names == ["fwd_bf16_batch_mask_mods_sm90a-generic_d128",
                         "fwd_bf16_batch_mask_mods_sm90a-hopper_d128-generic_d128",
                         "fwd_bf16_batch_mask_sm90a-generic_d128", "fwd_bf16_batch_mask_sm90a-hopper_d128-generic_d128",
                         "fwd_bf16_batch_nmask_sm90a-generic_d128", "fwd_bf16_batch_nmask_sm90a-hopper_d128-generic_d128"]
        default = jit.entries_within("fwd", "sm_90a", profiles_mod.select("fwd", "sm_90a", "default").specs)
        # 80 plain entries, 12 of the generic modifier instances alone (the masked ones of 64 / 128 / 256: the
        # modifier calls Hopper's head-dim rule refuses, and fp16 ones), 6 with a Hopper modifier instance (bf16 64 /
        # 128 / 256, batch and group, with the generic modifier instance; a sink alone takes the plain entries), 4 fp8
        # ones (fp8bf16, 128 / 256, masked and not: hopper only, no generic fallback)
        assert len(default) == 102 and len({e.name for e in default}) == 102
        fp8 = [e.name for e in default if "fp8" in e.name]
        assert sorted(fp8) == ["fwd_fp8bf16_batch_mask_sm90a-hopper_d128", "fwd_fp8bf16_batch_mask_sm90a-hopper_d256",
                               "fwd_fp8bf16_batch_nmask_sm90a-hopper_d128", "fwd_fp8bf16_batch_nmask_sm90a-hopper_d256"]

    def test_arch_for_compute_capability(self):
        f = toolchain_mod.arch_for_compute_capability
        assert (f(9, 0), f(8, 0), f(8, 6), f(10, 3), f(12, 1)) == ("sm_90a", "sm_80", "sm_86", "sm_100", "sm_120")
        with pytest.raises(toolchain_mod.ToolchainError, match="compute capability 7.5 is not supported"):
            f(7, 5)


# ----------------------------------------------------------------------------------------------------------------
# Keys: content, flags, toolchain and arch change them; times, PATH and locations do not
# ----------------------------------------------------------------------------------------------------------------

@pytest.fixture
def csrc_copy(tmp_path):
    dest = tmp_path / "elsewhere" / "csrc"
    shutil.copytree(toolchain_mod.CSRC, dest)
    return dest


class TestKeys:
    def test_key_is_stable_and_location_independent(self, csrc_copy):
        a = jit.make_plan(entry(), fake_toolchain())
        b = jit.make_plan(entry(), fake_toolchain())
        c = jit.make_plan(entry(), fake_toolchain(), csrc=csrc_copy)  # same content, another directory
        assert a.key == b.key == c.key and a.dirname == c.dirname
        assert a.dirname.startswith("fwd_bf16_batch_nmask_sm90a-hopper_d128-generic_d128-")
        assert set(a.inputs["csrc"]) >= {"include/mha_fwd.h", "kernels/common/mask.h", "runtime/mha_fwd.cpp",
                                         "kernels/hopper/fmha_fwd_hopper.cuh", "kernels/generic/fmha_fwd_generic.cuh"}
        assert "benchmark/benchmark_mha_fwd.cpp" not in a.inputs["csrc"]  # only what the library compiles
        text = json.dumps(a.inputs)
        assert str(REPO) not in text and "/opt/fake" not in text  # no machine paths in the key material

    def test_header_edit_changes_the_key(self, csrc_copy):
        base = jit.make_plan(entry(), fake_toolchain(), csrc=csrc_copy)
        mask_h = csrc_copy / "kernels" / "common" / "mask.h"
        mask_h.write_text(mask_h.read_text() + "\n// edited\n")
        edited = jit.make_plan(entry(), fake_toolchain(), csrc=csrc_copy)
        assert edited.source_key != base.source_key and edited.key != base.key
        assert edited.toolchain_key == base.toolchain_key

    def test_unrelated_csrc_edit_keeps_the_key(self, csrc_copy):
        base = jit.make_plan(entry(), fake_toolchain(), csrc=csrc_copy)
        bench = csrc_copy / "benchmark" / "benchmark_mha_fwd.cpp"
        bench.write_text(bench.read_text() + "\n// edited\n")
        assert jit.make_plan(entry(), fake_toolchain(), csrc=csrc_copy).key == base.key

    def test_template_edit_changes_the_key(self, tmp_path, monkeypatch):
        base = jit.make_plan(entry(), fake_toolchain())
        templates = tmp_path / "templates"
        shutil.copytree(render_mod.TEMPLATE_DIR, templates)
        generic = templates / "instance_generic.cu.j2"
        generic.write_text(generic.read_text() + "\n// edited\n")
        monkeypatch.setattr(render_mod, "TEMPLATE_DIR", templates)
        edited = jit.make_plan(entry(), fake_toolchain())
        assert edited.source_key != base.source_key
        changed = [k for k in base.inputs["rendered"] if base.inputs["rendered"][k] != edited.inputs["rendered"][k]]
        assert changed == ["instances/fwd_d128_bf16_batch_nmask_sm90a_generic_b128x64w4.cu"]

    def test_flags_version_and_arch_change_the_key(self, monkeypatch):
        base = jit.make_plan(entry(), fake_toolchain())
        assert jit.make_plan(entry(), fake_toolchain(version="12.8.93")).key != base.key
        generic_90 = jit.make_plan(entry(arch="sm_90a", mode="group"), fake_toolchain("sm_90a"))
        generic_80 = jit.make_plan(entry(arch="sm_80", mode="group"), fake_toolchain("sm_80"))
        assert generic_90.key != generic_80.key and generic_90.toolchain_key != generic_80.toolchain_key
        original = toolchain_mod.Nvcc.compile_flags
        monkeypatch.setattr(toolchain_mod.Nvcc, "compile_flags", lambda self: original(self) + ["-DMHAKIT_EXTRA=1"])
        flagged = jit.make_plan(entry(), fake_toolchain())
        assert flagged.toolchain_key != base.toolchain_key and flagged.source_key == base.source_key

    def test_file_times_do_not_change_the_key(self, csrc_copy):
        base = jit.make_plan(entry(), fake_toolchain(), csrc=csrc_copy)
        future = time.time() + 86400
        for path in csrc_copy.rglob("*"):
            os.utime(path, (future, future))
        assert jit.make_plan(entry(), fake_toolchain(), csrc=csrc_copy).key == base.key

    def test_path_does_not_change_the_key_and_nvcc_is_probed_once(self, tmp_path, monkeypatch):
        bindir = tmp_path / "cuda" / "bin"
        bindir.mkdir(parents=True)
        probes = tmp_path / "probes.txt"
        nvcc = bindir / "nvcc"
        nvcc.write_text(f'#!/bin/sh\necho probe >> "{probes}"\n'
                        'echo "Cuda compilation tools, release 13.0, V13.0.88"\n')
        nvcc.chmod(0o755)
        for var in ("NVCC", "CUDA_HOME", "CUDA_PATH"):
            monkeypatch.delenv(var, raising=False)
        root = tmp_path / "cache" / "v1"
        monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}/usr/bin:/bin")
        tc1, why = jit.toolchain_for("sm_90a", root)
        assert why is None and tc1.version == "13.0.88"
        monkeypatch.setenv("PATH", f"/nonexistent{os.pathsep}{bindir}{os.pathsep}/bin:/usr/bin:/usr/local/bin")
        tc2, _ = jit.toolchain_for("sm_90a", root)
        assert probes.read_text().count("probe") == 1, "the version must come from the memo the second time"
        assert jit.make_plan(entry(), tc1).key == jit.make_plan(entry(), tc2).key
        # a different nvcc file (size/mtime change) is probed again
        nvcc.write_text(nvcc.read_text().replace("V13.0.88", "V13.0.99"))
        tc3, _ = jit.toolchain_for("sm_90a", root)
        assert tc3.version == "13.0.99" and probes.read_text().count("probe") == 2
        assert jit.make_plan(entry(), tc3).key != jit.make_plan(entry(), tc1).key

    def test_no_nvcc_means_no_toolchain_key(self, monkeypatch, tmp_path):
        for var in ("NVCC", "CUDA_HOME", "CUDA_PATH"):
            monkeypatch.delenv(var, raising=False)
        monkeypatch.setenv("PATH", str(tmp_path))
        tc, why = jit.toolchain_for("sm_90a", tmp_path)
        assert tc is None and "nvcc was not found" in why
        plan = jit.make_plan(entry(), tc, why_no_toolchain=why)
        assert plan.key is None and plan.dirname is None
        assert plan.source_key == jit.make_plan(entry(), fake_toolchain()).source_key


# ----------------------------------------------------------------------------------------------------------------
# The cache: install, lookup, corruption, locking, killed builds
# ----------------------------------------------------------------------------------------------------------------

class TestCache:
    def test_build_once_then_hit(self, tmp_path):
        builder = FakeBuilder()
        cache = make_cache(tmp_path, builder)
        plan = jit.make_plan(entry(), fake_toolchain())
        assert cache.find(plan) is None
        lib = cache.ensure(plan)
        assert lib == cache.entry_dir(plan) / "libmha_fwd.so" and lib.is_file()
        assert cache.ensure(plan) == lib and builder.calls == 1
        manifest = json.loads((lib.parent / "manifest.json").read_text())
        assert manifest["key"] == plan.key and manifest["instances"] == plan.entry.instance_names
        assert manifest["inputs"]["toolchain"]["version"] == "13.0.88"
        assert not list(cache.tmp_dir.iterdir()), "nothing may stay behind in tmp/"

    @pytest.mark.parametrize("damage", ["truncate", "flip", "no_manifest", "bad_json", "wrong_key", "no_library"])
    def test_corrupt_entries_are_detected_and_rebuilt(self, tmp_path, damage):
        builder = FakeBuilder()
        cache = make_cache(tmp_path, builder)
        plan = jit.make_plan(entry(), fake_toolchain())
        lib = cache.ensure(plan)
        good = lib.read_bytes()
        manifest = lib.parent / "manifest.json"
        if damage == "truncate":
            lib.write_bytes(good[: len(good) // 2])
        elif damage == "flip":
            lib.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))  # same size, other content
        elif damage == "no_manifest":
            manifest.unlink()
        elif damage == "bad_json":
            manifest.write_text('{"format": 1, "key": ')
        elif damage == "wrong_key":
            m = json.loads(manifest.read_text())
            m["key"] = "0" * 64
            manifest.write_text(json.dumps(m))
        else:
            lib.unlink()
        assert cache.find(plan) is None
        assert cache.ensure(plan) == lib and builder.calls == 2
        assert lib.read_bytes() == good and cache.find(plan) == lib

    def test_no_toolchain_uses_any_intact_build_of_the_same_sources(self, tmp_path):
        cache = make_cache(tmp_path)
        built = cache.ensure(jit.make_plan(entry(), fake_toolchain(version="12.9.41")))
        lookup = jit.make_plan(entry(), None, why_no_toolchain="nvcc was not found")
        assert cache.find(lookup) == built and cache.ensure(lookup) == built
        other = jit.make_plan(entry(masked=True), None, why_no_toolchain="nvcc was not found")
        with pytest.raises(jit.NoCompilerError, match="nvcc was not found.*python -m mhakit prebuild"):
            cache.ensure(other)

    def test_progress_lines(self, tmp_path):
        lines = []
        cache = jit.KernelCache(tmp_path / "cache", builder=FakeBuilder(), log=lines.append)
        cache.ensure(jit.make_plan(entry(), fake_toolchain()))
        assert len(lines) == 2
        assert lines[0].startswith("[mhakit] first use of fwd_bf16_batch_nmask_sm90a-hopper_d128-generic_d128: "
                                   "building 2 kernel instances for sm_90a with nvcc 13.0.88")
        assert lines[1].startswith("[mhakit] built fwd_bf16_batch_nmask_sm90a-hopper_d128-generic_d128 in ")

    def test_builder_failure_leaves_nothing(self, tmp_path):
        def failing(plan, stage, build_dir, jobs):
            (stage / "libmha_fwd.so").write_bytes(b"half")
            raise jit.JitError("compiler exploded")
        cache = make_cache(tmp_path, failing)
        plan = jit.make_plan(entry(), fake_toolchain())
        with pytest.raises(jit.JitError, match="compiler exploded"):
            cache.ensure(plan)
        assert not cache.entry_dir(plan).exists() and not list(cache.tmp_dir.iterdir())

    def test_index_skips_rendering_on_the_next_lookup(self, tmp_path, monkeypatch):
        builder = FakeBuilder()
        cache = make_cache(tmp_path, builder)
        monkeypatch.setattr(jit, "toolchain_for", lambda arch, root, refresh=False: (fake_toolchain(arch), None))
        monkeypatch.setattr(jit, "_toolchain_identity", lambda root: ("13.0.88", "4.2.0"))
        lib = cache.library_for("fwd", "sm_90a", "bf16", 120, 120, "batch", False)
        assert builder.calls == 1
        assert [len(list((cache.root / "index" / kind).iterdir())) for kind in ("calls", "entries")] == [1, 1]
        # another signature with the same instances is found through the entry index: derived, not rendered
        monkeypatch.setattr(jit, "make_plan", lambda *a, **k: pytest.fail("the entry index must serve this call"))
        assert cache.library_for("fwd", "sm_90a", "bf16", 104, 104, "batch", False) == lib
        assert len(list((cache.root / "index" / "calls").iterdir())) == 2

        def no_render(*args, **kwargs):
            raise AssertionError("an indexed call must not derive or render")
        monkeypatch.setattr(jit, "derive_entry", no_render)
        monkeypatch.setattr(jit, "make_plan", no_render)
        assert cache.library_for("fwd", "sm_90a", "bf16", 120, 120, "batch", False) == lib
        # a damaged entry behind the index is not trusted: the slow path rebuilds it
        monkeypatch.undo()
        monkeypatch.setattr(jit, "toolchain_for", lambda arch, root, refresh=False: (fake_toolchain(arch), None))
        monkeypatch.setattr(jit, "_toolchain_identity", lambda root: ("13.0.88", "4.2.0"))
        lib.write_bytes(b"garbage")
        assert cache.library_for("fwd", "sm_90a", "bf16", 120, 120, "batch", False) == lib and builder.calls == 2

    def test_cache_dir_environment(self, monkeypatch, tmp_path):
        monkeypatch.delenv(jit.ENV_CACHE_DIR, raising=False)
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
        assert jit.cache_dir() == tmp_path / "xdg" / "mhakit"
        monkeypatch.delenv("XDG_CACHE_HOME")
        monkeypatch.setenv("HOME", str(tmp_path / "home"))
        assert jit.cache_dir() == tmp_path / "home" / ".cache" / "mhakit"
        monkeypatch.setenv(jit.ENV_CACHE_DIR, str(tmp_path / "mine"))
        assert jit.cache_dir() == tmp_path / "mine"
        assert jit.default_cache().root == tmp_path / "mine" / f"v{jit.FORMAT}"


_CHILD = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from mhakit import jit, _codegen
    root, record, delay, mode = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    tc = _codegen.submodule("toolchain").Nvcc(arch="sm_90a", gencode="arch=compute_90a,code=sm_90a",
                                              path="/opt/fake-cuda/bin/nvcc", version="13.0.88",
                                              cutlass=Path("/opt/fake-cutlass"))
    def builder(plan, stage, build_dir, jobs):
        with open(record, "a") as f:
            f.write(f"{os.getpid()}\\n")
        lib = stage / "libmha_fwd.so"
        if mode == "die":
            lib.write_bytes(b"\\x7fELF half a library")
            Path(str(record) + ".started").touch()
            time.sleep(120)
        time.sleep(delay)
        lib.write_bytes(b"\\x7fELF " + plan.key.encode() * 50)
        return lib
    cache = jit.KernelCache(root, builder=builder)
    plan = jit.make_plan(jit.derive_entry("fwd", "sm_90a", "bf16", 128, 128, "batch", False), tc)
    print(cache.ensure(plan), flush=True)
""")


class TestProcesses:
    def spawn(self, tmp_path, delay, mode="ok"):
        script = tmp_path / "child.py"
        script.write_text(_CHILD)
        return subprocess.Popen([sys.executable, str(script), str(tmp_path / "cache"), str(tmp_path / "builds.txt"),
                                 str(delay), mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=sub_env())

    def test_two_processes_build_once(self, tmp_path):
        procs = [self.spawn(tmp_path, 1.5) for _ in range(2)]
        outs = [p.communicate(timeout=120) for p in procs]
        assert all(p.returncode == 0 for p in procs), outs
        assert len((tmp_path / "builds.txt").read_text().split()) == 1, "exactly one process may build"
        paths = {out.strip() for out, _ in outs}
        assert len(paths) == 1 and Path(paths.pop()).is_file()
        stderr = "".join(err for _, err in outs)
        assert stderr.count("first use of") == 1 and "waiting for another process" in stderr

    def test_killed_build_leaves_no_loadable_entry(self, tmp_path):
        proc = self.spawn(tmp_path, 0, mode="die")
        started = Path(str(tmp_path / "builds.txt") + ".started")
        deadline = time.monotonic() + 60
        while not started.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        cache = make_cache(tmp_path)
        plan = jit.make_plan(entry(), fake_toolchain())
        assert not cache.entry_dir(plan).exists() and cache.find(plan) is None
        assert list(cache.tmp_dir.iterdir()), "the dead build's work directory is what remains"
        lib = cache.ensure(plan)  # the lock died with the process; the leftover is cleaned up
        assert cache.find(plan) == lib and not list(cache.tmp_dir.iterdir())


# ----------------------------------------------------------------------------------------------------------------
# Ahead of time
# ----------------------------------------------------------------------------------------------------------------

class TestPrebuild:
    def test_prebuild_fills_the_cache_once(self, tmp_path, monkeypatch):
        builder = FakeBuilder()
        cache = make_cache(tmp_path, builder)
        monkeypatch.setattr(jit, "toolchain_for", lambda arch, root, refresh=False: (fake_toolchain(arch), None))
        monkeypatch.setattr(jit, "_toolchain_identity", lambda root: ("13.0.88", "4.2.0"))
        compiled = []
        requests = []
        monkeypatch.setattr(build_mod, "build", lambda request, log=None: (compiled.append(len(request.specs)),
                                                                           requests.append(request)))
        paths = jit.prebuild("minimal", "sm_90a", cache=cache, quiet=True)
        # every library's instance table is compiled in the one ninja run, so that each library then only links
        (request,) = requests
        union = {sp.name for sp in request.specs}
        assert len(request.also_dispatch) == 8 and all(t and {sp.name for sp in t} <= union
                                                        for t in request.also_dispatch)
        # four mha_fwd libraries, two with modifier instances (generic alone: what Hopper refuses; hopper + generic; a
        # sink alone takes a plain library) and two split-KV ones (decode alone, decode_tma + decode)
        assert len(paths) == 8 and builder.calls == 8 and compiled == [10]
        from mhakit import _ext
        assert _ext.compiler() is None or _ext.cached(cache) is not None, "prebuild fills in the C call path too"
        assert jit.prebuild("minimal", "sm_90a", cache=cache, quiet=True) == paths and builder.calls == 8
        # a first call of a prebuilt configuration finds it without building or rendering
        monkeypatch.setattr(jit, "make_plan", lambda *a, **k: pytest.fail("prebuilt entries are indexed"))
        assert cache.library_for("fwd", "sm_90a", "bf16", 128, 128, "batch", True) in paths and builder.calls == 8
        # an unmasked modifier call too: the masked modifier instance serves it
        mods_lib = cache.library_for("fwd", "sm_90a", "bf16", 100, 100, "batch", False, mods=SOFTCAP)
        assert mods_lib in paths and "mask_mods" in str(mods_lib)
        assert mods_lib != cache.library_for("fwd", "sm_90a", "bf16", 100, 100, "batch", False)
        assert cache.library_for("splitkv", "sm_90a", "bf16", 128, 128, "batch", True) in paths
        assert cache.library_for("fwd", "sm_90a", "bf16", 112, 64, "batch", False) in paths  # generic-only entry

    def test_prebuild_keeps_its_objects_in_a_given_build_dir(self, tmp_path, monkeypatch):
        """--build-dir: the one ninja run and every library's link use that directory (compile.py's objects are
        reused), not a temporary one."""
        builder = FakeBuilder()
        cache = make_cache(tmp_path, builder)
        monkeypatch.setattr(jit, "toolchain_for", lambda arch, root, refresh=False: (fake_toolchain(arch), None))
        monkeypatch.setattr(jit, "_toolchain_identity", lambda root: ("13.0.88", "4.2.0"))
        dirs = []
        monkeypatch.setattr(build_mod, "build", lambda request, log=None: dirs.append(request.build_dir))
        real_ensure = cache.ensure
        monkeypatch.setattr(cache, "ensure", lambda plan, **kw: (dirs.append(kw["build_dir"]), real_ensure(plan, **kw))[1])
        jit.prebuild("minimal", "sm_90a", cache=cache, quiet=True, build_dir=tmp_path / "objects")
        assert len(dirs) == 9 and set(dirs) == {(tmp_path / "objects").resolve()}  # one build + 8 libraries
        # a build directory that cannot be one: a sentence, nothing built
        (tmp_path / "a_file").write_text("")
        cache2 = make_cache(tmp_path / "second", FakeBuilder())
        with pytest.raises(jit.JitError, match=r"the build directory .*a_file.* cannot be created.*--build-dir"):
            jit.prebuild("minimal", "sm_90a", cache=cache2, quiet=True, build_dir=tmp_path / "a_file" / "objects")
        assert len(dirs) == 9

    def test_prebuild_errors(self, tmp_path, monkeypatch):
        cache = make_cache(tmp_path)
        with pytest.raises(profiles_mod.SelectionError, match="unknown profile 'huge'"):
            jit.prebuild("huge", "sm_90a", cache=cache, quiet=True)
        with pytest.raises(profiles_mod.SelectionError, match="holds no complete fwd library"):
            # (the 16-bit hopper instances of 256 only: every entry also needs its generic fallback)
            jit.prebuild("default", "sm_90a", name_filter="hopper_b128x64", cache=cache, quiet=True)
        monkeypatch.setattr(jit, "toolchain_for", lambda arch, root, refresh=False: (None, "nvcc was not found"))
        with pytest.raises(jit.NoCompilerError, match="prebuild needs a toolchain: nvcc was not found"):
            jit.prebuild("minimal", "sm_90a", cache=cache, quiet=True)

    def test_cli(self, tmp_path):
        env = sub_env(MHAKIT_CACHE_DIR=str(tmp_path / "c"))
        bad = subprocess.run([sys.executable, "-m", "mhakit", "prebuild", "--profile", "huge", "--arch", "sm_90a"],
                             capture_output=True, text=True, env=env, cwd=tmp_path)
        assert bad.returncode == 2 and "unknown profile 'huge'" in bad.stderr and "Traceback" not in bad.stderr
        info = subprocess.run([sys.executable, "-m", "mhakit", "cache"], capture_output=True, text=True, env=env,
                              cwd=tmp_path)
        assert info.returncode == 0 and str(tmp_path / "c" / "v1") in info.stdout and "0 entries" in info.stdout


# ----------------------------------------------------------------------------------------------------------------
# Real builds (nvcc)
# ----------------------------------------------------------------------------------------------------------------

_REAL_CHILD = textwrap.dedent("""
    import sys
    from mhakit import jit
    cache = jit.KernelCache(sys.argv[1])
    print(cache.library_for("fwd", "sm_80", "fp16", 64, 64, "group", False, jobs=2), flush=True)
""")


@pytest.mark.compile
def test_real_build_two_processes_one_compile(tmp_path):
    """Two processes need the same small library (one generic instance for sm_80): one runs nvcc, the other waits
    for it and loads the result; the library serves the call's traits and nothing else is left behind."""
    if not have_nvcc():
        pytest.skip("nvcc not found")
    script = tmp_path / "real_child.py"
    script.write_text(_REAL_CHILD)
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path / "cache")], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=sub_env()) for _ in range(2)]
    outs = [p.communicate(timeout=900) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    paths = {out.strip() for out, _ in outs}
    assert len(paths) == 1
    lib_path = Path(paths.pop())
    stderr = "".join(err for _, err in outs)
    assert stderr.count("first use of fwd_fp16_group_nmask_sm80-generic_d64") == 1, stderr
    assert stderr.count("[mhakit] built fwd_fp16_group_nmask_sm80-generic_d64 in") == 1, stderr
    manifest = json.loads((lib_path.parent / "manifest.json").read_text())
    assert manifest["instances"] == ["fwd_d64_fp16_group_nmask_sm80_generic_b128x128w4"]
    assert manifest["inputs"]["toolchain"]["version"] and manifest["inputs"]["toolchain"]["arch"] == "sm_80"
    cache = jit.KernelCache(tmp_path / "cache")
    assert not list(cache.tmp_dir.iterdir())

    from mhakit import _capi
    lib = _capi.load_library(lib_path)
    args = _capi.make_fwd_args(dtype="fp16", q_ptr=256, k_ptr=256, v_ptr=256, o_ptr=256, batch=2, nhead_q=4, nhead_k=2,
                               hdim_q=40, hdim_v=64, q_strides=(0, 64, 256), k_strides=(0, 64, 128),
                               v_strides=(0, 64, 128), o_strides=(0, 64, 256), seqstart_q_ptr=512,
                               seqstart_k_ptr=512, max_seqlen_q=7)
    assert lib.kernel_name(args) == "fwd_d64_fp16_group_nmask_sm80_generic_b128x128w4"
    # a third process finds it through the cache (and the index) without building
    again = subprocess.run([sys.executable, str(script), str(tmp_path / "cache")], capture_output=True, text=True,
                           env=sub_env(), timeout=300)
    assert again.returncode == 0 and again.stdout.strip() == str(lib_path) and "first use" not in again.stderr


# ----------------------------------------------------------------------------------------------------------------
# The backward: the same derivation, cache and prebuild path for libmha_bwd.so
# ----------------------------------------------------------------------------------------------------------------

spec_mod = _codegen.submodule("spec")


def bwd_hopper_candidates(arch="sm_90a"):
    """The catalogue's backward specs plus a [bwd.hopper] family as it is announced (batch mode, hdim_q == hdim_v in
    {64, 128, 256}, priority above the generic family), whether or not the catalogue lists it yet."""
    real = [sp for sp in jit._catalogue_specs("bwd", arch) if sp.algorithm.family != "hopper"]
    tiles = {64: (128, 128), 128: (64, 128), 256: (64, 64)}
    hopper = [spec_mod.KernelSpec(spec_mod.Signature("bwd", dtype, d, d, "batch", mask),
                                  spec_mod.Algorithm("hopper", arch, (("block_m", bm), ("block_n", bn),
                                                                      ("hdim_q", d), ("hdim_v", d))),
                                  priority=10, template="instance_hopper.cu.j2",
                                  guards=spec_mod.Guards(equal_head_dims=True, deterministic=False, align_bytes=16))
              for d, (bm, bn) in tiles.items() for dtype in ("fp16", "bf16") for mask in ("nmask", "mask")]
    return real + hopper


class TestDeriveBwd:
    @pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
    @pytest.mark.parametrize("dtype, hq, hv, mode, masked", [
        ("bf16", 128, 128, "batch", False), ("fp16", 64, 64, "batch", True), ("bf16", 96, 96, "batch", True),
        ("fp16", 160, 128, "batch", False), ("bf16", 128, 128, "group", True), ("fp16", 256, 256, "group", False),
        ("bf16", 16, 256, "batch", False),
    ])
    def test_every_entry_ends_with_its_generic_fallback(self, arch, dtype, hq, hv, mode, masked):
        """Whatever fast family the catalogue has, an entry holds the generic instance (last) that serves what the
        fast one refuses at run time (deterministic mode, unaligned strides, group mode)."""
        e = jit.derive_entry("bwd", arch, dtype, hq, hv, mode, masked)
        families = [sp.algorithm.family for sp in e.specs]
        assert families[-1] == "generic" and families.count("generic") == 1
        assert all(name.startswith("bwd_") and f"_{dtype}_{mode}_{'mask' if masked else 'nmask'}_" in name
                   for name in e.instance_names)
        assert e.name.startswith(f"bwd_{dtype}_{mode}_{'mask' if masked else 'nmask'}_{arch.replace('_', '')}-")
        if "hopper" in families:
            assert arch == "sm_90a"

    def test_generic_buckets(self):
        e = jit.derive_entry("bwd", "sm_90a", "fp16", 160, 128, "batch", False)
        assert e.instance_names == ["bwd_d192x128_fp16_batch_nmask_sm90a_hopper_b64x96",
                                    "bwd_d192x128_fp16_batch_nmask_sm90a_generic_b32x64w8"]
        assert jit.derive_entry("bwd", "sm_80", "bf16", 40, 40, "group", True).instance_names == [
            "bwd_d64_bf16_group_mask_sm80_generic_b64x128w8"]

    @pytest.mark.parametrize("hq, hv, mode, expected", [
        (128, 128, "batch", ["bwd_d128_bf16_batch_nmask_sm90a_hopper_b64x128",
                             "bwd_d128_bf16_batch_nmask_sm90a_generic_b64x64w4"]),
        (96, 96, "batch", ["bwd_d128_bf16_batch_nmask_sm90a_hopper_b64x128",
                           "bwd_d128_bf16_batch_nmask_sm90a_generic_b64x64w4"]),
        (40, 40, "batch", ["bwd_d64_bf16_batch_nmask_sm90a_hopper_b128x128",
                           "bwd_d64_bf16_batch_nmask_sm90a_generic_b64x128w8"]),
        (256, 256, "batch", ["bwd_d256_bf16_batch_nmask_sm90a_hopper_b64x64",
                             "bwd_d256_bf16_batch_nmask_sm90a_generic_b32x32w4"]),
        (160, 128, "batch", ["bwd_d192x128_bf16_batch_nmask_sm90a_generic_b32x64w8"]),   # d != d_v: no hopper
        (128, 128, "group", ["bwd_d128_bf16_group_nmask_sm90a_generic_b64x64w4"]),       # group mode: no hopper
    ])
    def test_with_a_hopper_backward_family(self, hq, hv, mode, expected):
        e = jit.derive_entry("bwd", "sm_90a", "bf16", hq, hv, mode, False, candidates=bwd_hopper_candidates())
        assert e.instance_names == expected
        if len(expected) == 2:
            bucket = expected[0].split("_")[1]
            assert e.name == f"bwd_bf16_{mode}_nmask_sm90a-hopper_{bucket}-generic_{bucket}"

    def test_library_loads_the_backward_through_its_loader(self, monkeypatch, tmp_path):
        from mhakit import _capi
        assert jit.LOADERS["bwd"] is jit._load_bwd and jit.LOADERS["fwd"] is jit._load_fwd
        asked, loaded = [], []

        class Cache:
            def library_for(self, *args, mods=0):
                asked.append(args)
                return tmp_path / "libmha_bwd.so"

        monkeypatch.setattr(jit, "_LIBS", {})
        monkeypatch.setattr(jit, "default_cache", lambda: Cache())
        monkeypatch.setattr(jit, "device_arch", lambda device, backend="cuda": "sm_90a")
        monkeypatch.setattr(_capi, "load_bwd_library", lambda path: loaded.append(path) or ("bwd", path))
        monkeypatch.setattr(_capi, "load_library", lambda path: pytest.fail("the forward loader must not be used"))
        lib = jit.library("bwd", 0, "bf16", 128, 128, "group", True)
        assert lib == ("bwd", tmp_path / "libmha_bwd.so")
        assert jit.library("bwd", 0, "bf16", 128, 128, "group", True) is lib
        assert asked == [("bwd", "sm_90a", "bf16", 128, 128, "group", True)] and len(loaded) == 1
        with pytest.raises(ValueError, match="api must be one of"):
            jit.library("bwd_v3", 0, "bf16", 128, 128, "group", True)

    def test_bwd_and_fwd_entries_never_share_a_cache_directory(self, tmp_path):
        cache = make_cache(tmp_path)
        fwd = jit.make_plan(entry(mode="group"), fake_toolchain())
        bwd = jit.make_plan(jit.derive_entry("bwd", "sm_90a", "bf16", 128, 128, "group", False), fake_toolchain())
        assert cache.entry_dir(bwd).parent.name == "bwd" and cache.entry_dir(fwd).parent.name == "fwd"
        assert bwd.key != fwd.key and "runtime/mha_bwd.cpp" in bwd.inputs["csrc"]
        assert "runtime/mha_fwd.cpp" not in bwd.inputs["csrc"]


class ApiBuilder(FakeBuilder):
    """FakeBuilder naming the library after the entry's API (libmha_fwd.so / libmha_bwd.so)."""

    def __call__(self, plan, stage, build_dir, jobs):
        lib = super().__call__(plan, stage, build_dir, jobs)
        return lib.rename(stage / f"libmha_{plan.entry.api}.so")


class TestPrebuildBwd:
    def test_prebuild_bwd_fills_the_cache_once(self, tmp_path, monkeypatch):
        builder = ApiBuilder()
        cache = make_cache(tmp_path, builder)
        monkeypatch.setattr(jit, "toolchain_for", lambda arch, root, refresh=False: (fake_toolchain(arch), None))
        monkeypatch.setattr(jit, "_toolchain_identity", lambda root: ("13.0.88", "4.2.0"))
        compiled = []
        monkeypatch.setattr(build_mod, "build",
                            lambda request, log=None: compiled.append((request.api, len(request.specs))))
        minimal = profiles_mod.select("bwd", "sm_90a", "minimal").specs
        expected = jit.entries_within("bwd", "sm_90a", minimal)
        paths = jit.prebuild("minimal", "sm_90a", api="bwd", cache=cache, quiet=True)
        assert len(paths) == len(expected) >= 2 and builder.calls == len(paths)
        assert compiled == [("bwd", len(minimal))]
        assert all(p.name == "libmha_bwd.so" and p.parent.parent.name == "bwd" for p in paths)
        assert jit.prebuild("minimal", "sm_90a", api="bwd", cache=cache, quiet=True) == paths
        assert builder.calls == len(paths)
        # a first mha_bwd call of a prebuilt configuration finds it without building or rendering
        monkeypatch.setattr(jit, "make_plan", lambda *a, **k: pytest.fail("prebuilt entries are indexed"))
        assert cache.library_for("bwd", "sm_90a", "bf16", 128, 128, "batch", True) in paths
        assert cache.library_for("bwd", "sm_90a", "bf16", 120, 128, "batch", False) in paths
        assert builder.calls == len(paths)

    def test_prebuild_bwd_errors(self, tmp_path, monkeypatch):
        cache = make_cache(tmp_path)
        with pytest.raises(ValueError, match="api must be one of"):
            jit.prebuild("minimal", "sm_90a", api="backward", cache=cache, quiet=True)
        with pytest.raises(profiles_mod.SelectionError, match="bwd"):
            jit.prebuild("default", "sm_90a", api="bwd", name_filter="*_hopper_*", cache=cache, quiet=True)
        monkeypatch.setattr(jit, "toolchain_for", lambda arch, root, refresh=False: (None, "nvcc was not found"))
        with pytest.raises(jit.NoCompilerError, match="prebuild needs a toolchain: nvcc was not found"):
            jit.prebuild("minimal", "sm_90a", api="bwd", cache=cache, quiet=True)

    def test_cli(self, tmp_path):
        env = sub_env(MHAKIT_CACHE_DIR=str(tmp_path / "c"))
        run = lambda *args: subprocess.run([sys.executable, "-m", "mhakit", *args], capture_output=True,  # noqa: E731
                                           text=True, env=env, cwd=tmp_path)
        bad = run("prebuild", "--api", "bwd", "--profile", "huge", "--arch", "sm_90a")
        assert bad.returncode == 2 and "unknown profile 'huge'" in bad.stderr and "Traceback" not in bad.stderr
        wrong = run("prebuild", "--api", "backward")
        assert wrong.returncode == 2 and "invalid choice: 'backward'" in wrong.stderr
        helptext = run("prebuild", "--help")
        assert helptext.returncode == 0 and "mha_bwd" in helptext.stdout


_REAL_BWD_CHILD = textwrap.dedent("""
    import sys
    from mhakit import jit
    cache = jit.KernelCache(sys.argv[1])
    print(cache.library_for("bwd", "sm_80", "fp16", 64, 64, "group", True, jobs=2), flush=True)
""")


@pytest.mark.compile
def test_real_bwd_build_and_load(tmp_path):
    """The backward's JIT path builds a real libmha_bwd.so (one generic instance for sm_80) that loads as a
    BwdLibrary, chooses that instance and sizes its workspace; a second process loads it without building."""
    if not have_nvcc():
        pytest.skip("nvcc not found")
    script = tmp_path / "real_bwd_child.py"
    script.write_text(_REAL_BWD_CHILD)
    first = subprocess.run([sys.executable, str(script), str(tmp_path / "cache")], capture_output=True, text=True,
                           env=sub_env(), timeout=900)
    assert first.returncode == 0, first.stderr
    assert first.stderr.count("first use of bwd_fp16_group_mask_sm80-generic_d64") == 1, first.stderr
    lib_path = Path(first.stdout.strip())
    assert lib_path.name == "libmha_bwd.so" and lib_path.parent.parent.name == "bwd"
    from mhakit import _capi
    lib = _capi.load_bwd_library(lib_path)
    args = _capi.make_bwd_args(dtype="fp16", q_ptr=256, k_ptr=256, v_ptr=256, o_ptr=256, lse_ptr=256, do_ptr=256,
                               dq_ptr=256, dk_ptr=256, dv_ptr=256, batch=2, nhead_q=4, nhead_k=2, hdim_q=64,
                               hdim_v=64, q_strides=(0, 64, 256), k_strides=(0, 64, 128), v_strides=(0, 64, 128),
                               o_strides=(0, 64, 256), lse_strides=(0, 100), seqstart_q_ptr=512, seqstart_k_ptr=512,
                               max_seqlen_q=50, max_seqlen_k=70, mask_type=2, window_right=0, deterministic=True)
    assert lib.kernel_name(args) == "bwd_d64_fp16_group_mask_sm80_generic_b64x128w8"
    assert lib.workspace_size(args) > 0
    again = subprocess.run([sys.executable, str(script), str(tmp_path / "cache")], capture_output=True, text=True,
                           env=sub_env(), timeout=300)
    assert again.returncode == 0 and again.stdout.strip() == str(lib_path) and "first use" not in again.stderr
