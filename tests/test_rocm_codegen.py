"""The ROCm backend without a compiler: its catalogue, the instances it lists, its rules, its rendered CK-tile sources
and the HIP toolchain's flags and one-line errors."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from codegen import catalogue, profiles, render, toolchain
from conftest import REPO, run_compile

ARCHES = ("gfx90a", "gfx942", "gfx950")


def names(api, arch, profile="default", name_filter=None):
    return [s.name for s in profiles.select(api, arch, profile, name_filter).specs]


class TestCatalogue:
    def test_arches_are_data_with_their_offload_target(self):
        cat = catalogue.load("rocm")
        assert set(cat.arches) == set(ARCHES)
        for arch in ARCHES:
            assert cat.arch(arch).target == arch
        assert "trload" in cat.arch("gfx950").trait("features")
        assert cat.arch("gfx942").trait("ck_arch") == "gfx9" and cat.arch("gfx950").trait("ck_arch") == "gfx950"

    def test_loads_through_the_shared_catalogue_records(self):
        """The facts every backend states (codegen/catalogue.py): head-dim rule, default arch, arch records, guards."""
        cat = catalogue.load("rocm")
        assert (cat.head_dims.multiple, cat.head_dims.max) == (8, 256) and cat.default_arch == "gfx942"
        assert {a: (r.compute_capabilities, r.arch_specific) for a, r in cat.arches.items()} == {
            "gfx90a": (("9.0",), True), "gfx942": (("9.4",), True), "gfx950": (("9.5",), True)}
        for (api, name), fam in cat.families.items():
            assert not fam.needs_arch_specific and not fam.equal_head_dims and fam.align_bytes == 16, name
            assert fam.deterministic, name  # bwd: the deterministic variant serves such calls; fwd: nothing to choose
        assert not set(dict(cat.tables)) & {"head_dims", "default_arch"}, "shared tables hold only template data"

    def test_every_family_has_the_knobs_its_template_reads(self):
        cat = catalogue.load("rocm")
        for (api, name), fam in cat.families.items():
            assert fam.variants and fam.knob("trload") is not None, name
            if api == "fwd":
                assert fam.knob("pipeline").startswith("ck_tile::BlockFmhaPipeline") and fam.knob("checks"), name
                assert {v for axis, vals in fam.variants if axis == "pad" for v in vals} <= set(cat.table("ck")["fwd_pads"])

    def test_backend_of_arch(self):
        assert catalogue.backend_of_arch("gfx942") == "rocm" and catalogue.backend_of_arch("sm_90a") == "cuda"
        with pytest.raises(catalogue.CatalogueError, match="unknown arch 'banana'"):
            catalogue.backend_of_arch("banana")


class TestListing:
    @pytest.mark.parametrize("arch", ARCHES)
    @pytest.mark.parametrize("api", ["fwd", "bwd"])
    def test_list_covers_head_dims_modes_and_masks(self, tmp_path, api, arch):
        proc = run_compile(["--arch", arch, "--api", api, "--list"], cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.strip().splitlines()
        listed = lines[:-1]
        assert lines[-1] == f"{len(listed)} {api} instances for {arch} (profile default)"
        assert {re.match(rf"{api}_(d\w+?)_", n).group(1) for n in listed} >= {"d32", "d64", "d128", "d256"}
        if api == "fwd":
            assert any(n.startswith("fwd_d192x128_") for n in listed)
        for token in ("_batch_", "_group_", "_nmask_", "_mask_", "_bf16_", "_fp16_"):
            assert any(token in n for n in listed), token
        assert not list(tmp_path.iterdir()), "--list must not write anything"

    def test_gfx950_adds_the_transposed_load_pipelines(self):
        assert any("_qr_async_trload_" in n for n in names("fwd", "gfx950"))
        assert any("_dqdkdv_trload_" in n for n in names("bwd", "gfx950"))
        assert not any("trload" in n for arch in ("gfx90a", "gfx942") for api in ("fwd", "bwd")
                       for n in names(api, arch))

    def test_names_carry_tile_pipeline_and_variants(self):
        assert "fwd_d128_bf16_batch_nmask_gfx942_qr_async_b128x128x32x128x32x128_psddv_lse" in names("fwd", "gfx942")
        assert ("bwd_d128_bf16_group_mask_gfx90a_dqdkdv_b16x128x128x16x128x16x32x128x128_pd8dv8_deterministic"
                in names("bwd", "gfx90a"))

    def test_group_mode_only_with_padded_sequences(self):
        selection = profiles.enumerate_specs("fwd", "gfx942", "rocm")
        assert all("_psskddv_" in s.name or "_pssk_" in s.name for s in selection.specs if s.signature.mode == "group")
        rejected = dict(selection.rejected)
        assert any("group mode pads seqlen_q and seqlen_k" in r for rs in rejected.values() for r in rs)

    def test_unpadded_variants_rank_first_within_a_family(self):
        by_name = {s.name: s for s in profiles.enumerate_specs("fwd", "gfx942", "rocm").specs}
        base = "fwd_d256_bf16_batch_nmask_gfx942_qr_b128x128x32x256x32x256"
        ranks = [by_name[f"{base}_{pad}_lse"].priority for pad in ("npad", "pssk", "psskddv")]
        assert ranks == sorted(ranks, reverse=True) and len(set(ranks)) == 3
        trload = by_name["fwd_d128_bf16_batch_nmask_gfx942_qr_async_b128x128x32x128x32x128_psddv_lse"]
        assert max(by_name[n].priority for n in by_name if "_qr_b" in n) < trload.priority

    def test_cuda_names_are_unchanged(self):
        assert "fwd_d128_bf16_batch_nmask_sm90a_hopper_b128x176" in names("fwd", "sm_90a")
        assert "fwd_d128_bf16_batch_nmask_sm90a_generic_b128x64w4" in names("fwd", "sm_90a")


class TestRendering:
    def spec(self, name_filter, api="fwd", arch="gfx942"):
        specs = profiles.select(api, arch, "default", name_filter).specs
        assert len(specs) == 1, [s.name for s in specs]
        return specs[0]

    def test_forward_instance_instantiates_ck_tile_from_catalogue_data(self):
        spec = self.spec("fwd_d192x128_fp16_group_mask_gfx942_qr_async_b128x128x32x128x32x192_psskddv_nlse")
        text = render.render_instance(spec)
        assert "ck_tile::sequence<128, 128, 32, 128, 32, 192>" in text
        assert "ck_tile::TileFmhaTraits<true, true, true, true," in text
        assert "/*kIsGroupMode=*/true" in text and "SimplifiedGenericAttentionMask<true>" in text
        assert "ck_tile::FmhaFwdKernel<ck_tile::BlockFmhaPipelineQRKSVSAsync<Problem>, Epilogue>" in text
        assert "FmhaFwdTypeConfig<FmhaFwdFp16>" in text and "ck_tile::gfx9_t" in text
        assert "#define CK_TILE_FMHA_FWD_FAST_EXP2 1" in text
        assert "(defined(__gfx9__) && !defined(__gfx950__))" in text
        assert f"dev::Error {spec.name}_run(const FwdParams& p, dev::Stream stream)" in text

    def test_backward_instance_has_its_three_kernels(self):
        spec = self.spec("bwd_d64_bf16_batch_nmask_gfx950_dqdkdv_trload_b32x128x64x32x64x32x32x64x64_npad_deterministic",
                         api="bwd", arch="gfx950")
        text = render.render_instance(spec)
        for kernel in ("FmhaBwdOGradDotOKernel", "FmhaBwdDQDKDVKernel", "FmhaBwdConvertQGradKernel"):
            assert kernel in text
        assert "/*kIsDeterministic=*/true" in text and "/*kUseTrLoad=*/true" in text
        assert "ck_tile::gfx950_t" in text and "#define CK_TILE_FLOAT_TO_BFLOAT16_DEFAULT 3" in text
        assert f"size_t {spec.name}_workspace_bytes(const BwdParams& p)" in text

    def test_dispatch_table_lists_the_instances(self):
        specs = profiles.select("fwd", "gfx942", "minimal", "_batch_nmask_").specs
        text = render.render_dispatch("fwd", "gfx942", specs)
        assert 'const BuiltArch kFwdBuiltArch = {"gfx942", 9, 4, /*arch_specific=*/true};' in text
        assert "const HeadDimRule kFwdHeadDims = {/*multiple=*/8, /*max=*/256};" in text
        assert f"kNumFwdInstances = {len(specs)};" in text
        assert text.count("/*equal_head_dims=*/false") == text.count("/*align_bytes=*/16") == len(specs)


class TestToolchain:
    def make(self, tmp_path, kind="clang"):
        root = tmp_path / "rocm"
        (root / "include" / "hip").mkdir(parents=True, exist_ok=True)
        ck = tmp_path / "ck"
        return toolchain.Hipcc(arch="gfx942", offload_arch="gfx942", path="/usr/bin/clang++-22", version="22.1.8",
                               kind=kind, rocm=root, ck=ck)

    def test_flags_name_the_target_rocm_root_and_ck(self, tmp_path):
        tc = self.make(tmp_path)
        flags = tc.compile_flags()
        assert flags[:2] == ["-x", "hip"] and "--offload-arch=gfx942" in flags and "-DMHAKIT_HIP=1" in flags
        assert f"--rocm-path={tmp_path / 'rocm'}" in flags and ["-isystem", str(tmp_path / "rocm" / "include")] == \
            flags[flags.index("-isystem"):flags.index("-isystem") + 2]
        assert f"-I{tmp_path / 'ck' / 'include'}" in flags and f"-I{tmp_path / 'ck' / 'example/ck_tile/01_fmha'}" in flags
        assert "-amdgpu-function-calls=false" not in flags  # hangs upstream clang together with early-inline-all
        assert "--offload-host-only" in tc.host_flags() and "--offload-arch=gfx942" not in tc.host_flags()
        assert "-amdgpu-function-calls=false" in self.make(tmp_path, "hipcc").compile_flags()

    def test_without_a_hip_runtime_library_nothing_executable_is_linked(self, tmp_path):
        tc = self.make(tmp_path)
        assert not tc.can_link_executables and "-lamdhip64" not in tc.ninja_rules()["link_shared"]
        (tmp_path / "rocm" / "lib").mkdir()
        (tmp_path / "rocm" / "lib" / "libamdhip64.so").write_bytes(b"")
        assert tc.can_link_executables and "-lamdhip64" in tc.ninja_rules()["link_exe"]

    def test_description_is_free_of_paths(self, tmp_path):
        described = self.make(tmp_path).describe()
        assert str(tmp_path) not in repr(described) and "<ck>/include" in " ".join(described["device_flags"])

    def test_missing_ck_names_the_variable_to_set(self, tmp_path, monkeypatch):
        monkeypatch.setenv("MHAKIT_CK_DIR", str(tmp_path / "nowhere"))
        with pytest.raises(toolchain.ToolchainError, match="set MHAKIT_CK_DIR to a composable_kernel checkout"):
            toolchain.find_ck()

    def test_missing_compiler_is_one_line(self, tmp_path):
        env = {k: v for k, v in os.environ.items() if k not in ("HIPCC", "MHAKIT_HIP_CLANG", "HIP_PATH")}
        env.update(PATH="/nonexistent", ROCM_PATH=str(tmp_path / "no-rocm"))
        proc = subprocess.run([sys.executable, str(REPO / "compile.py"), "--arch", "gfx942", "--profile", "minimal"],
                              cwd=tmp_path, capture_output=True, text=True, env=env)
        if Path("/opt/rocm").is_dir():
            pytest.skip("a ROCm install in /opt/rocm provides a compiler")
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and "no HIP compiler found" in proc.stderr


class TestJitEntries:
    """The Python JIT's unit of caching on ROCm: every instance the runtime may choose for a call."""

    def entry(self, *args):
        from mhakit import jit
        return jit.derive_entry(*args)

    def test_an_entry_holds_every_variant_of_its_bucket(self):
        e = self.entry("fwd", "gfx942", "bf16", 100, 100, "batch", False)
        assert e.instance_names == [f"fwd_d128_bf16_batch_nmask_gfx942_qr_async_b128x128x32x128x32x128_{v}"
                                    for v in ("psddv_nlse", "psddv_lse", "psskddv_nlse", "psskddv_lse")]

    def test_a_complete_family_ends_the_entry_and_others_precede_it(self):
        e = self.entry("fwd", "gfx950", "bf16", 128, 128, "batch", True)
        families = list(dict.fromkeys(sp.algorithm.family for sp in e.specs))
        assert families == ["qr_async_trload", "qr_async"]  # qr (d256) would never be chosen after qr_async
        assert len([sp for sp in e.specs if sp.algorithm.family == "qr_async_trload"]) == 3 * 2 * 2  # tiles x pad x lse
        assert self.entry("fwd", "gfx942", "fp16", 200, 200, "group", True).name == "fwd_fp16_group_mask_gfx942-qr_d256"

    def test_cuda_entries_are_unchanged(self):
        assert self.entry("fwd", "sm_90a", "bf16", 128, 128, "batch", True).instance_names == [
            "fwd_d128_bf16_batch_mask_sm90a_hopper_b128x128", "fwd_d128_bf16_batch_mask_sm90a_generic_b128x64w4"]


@pytest.mark.rocm
def test_jit_plans_rocm_libraries_with_the_hip_toolchain(tmp_path):
    from mhakit import jit
    tc, why = jit.toolchain_for("gfx942", tmp_path)
    assert why is None and tc.backend == "rocm" and tc.offload_arch == "gfx942"
    plan = jit.make_plan(jit.derive_entry("bwd", "gfx942", "bf16", 128, 128, "batch", False), tc)
    described = plan.inputs["toolchain"]
    assert described["offload_arch"] == "gfx942" and "--offload-arch=gfx942" in described["device_flags"]
    assert any(name.endswith(".cpp") for name in plan.inputs["rendered"]) and plan.key
