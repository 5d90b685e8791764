"""Our CK-tile instances against CK's own generator: for the same traits, every instance mhakit renders must be one
that CK's example/ck_tile/01_fmha/generate.py emits (same tile, warp layout, pipeline, padding, mask, LSE, mode),
and the CK-tile types in our source must be the ones in CK's. Needs a CK tree (MHAKIT_CK_DIR or
3rdparty/composable_kernel; tools/rocm_sdk.sh prepares the pinned one); skipped without one. CPU only."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from codegen import catalogue, profiles, render, toolchain

ARCHES = ("gfx90a", "gfx942", "gfx950")


@pytest.fixture(scope="module")
def ck_root() -> Path:
    try:
        return toolchain.find_ck()
    except toolchain.ToolchainError as exc:
        pytest.skip(f"no composable_kernel tree: {exc}")


def _generate(ck_root: Path, out: Path, api: str, name_filter: str) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, str(ck_root / "example" / "ck_tile" / "01_fmha" / "generate.py"),
                           "--targets", ",".join(ARCHES), "--api", api, "--filter", name_filter,
                           "--output_dir", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {p.name: p for p in out.glob("*.cpp")}


@pytest.fixture(scope="module")
def ck_fwd(ck_root, tmp_path_factory) -> dict[str, Path]:
    """CK's forward instances for mhakit's feature set (no logits soft-cap, bias, dropout, skip or quantisation)."""
    return _generate(ck_root, tmp_path_factory.mktemp("ck_fwd"), "fwd", "*_nlogits_nbias_*_ndropout_nskip_nsquant_*")


@pytest.fixture(scope="module")
def ck_bwd(ck_root, tmp_path_factory) -> dict[str, Path]:
    """CK's backward kernels (dot@convert@dq_dk_dv) without bias, bias gradient or dropout."""
    return _generate(ck_root, tmp_path_factory.mktemp("ck_bwd"), "bwd", "*@*@*_nbias_ndbias_*_ndropout_*")


# CK's file names, restated from its generator's naming scheme (a fact about CK: the tokens it writes per trait).
def _ck_arch(spec) -> str:
    return dict(spec.knobs)["ck_arch"]


def ck_fwd_file(spec) -> str:
    s, t, v = spec.signature, dict(spec.algorithm.tile), dict(spec.algorithm.variant)
    tile = (f"b{t['block_m']}x{t['block_n']}x{t['bk0']}x{t['bn1']}x{t['bk1']}x{t['bk0max']}"
            f"_r{t['rm0']}x{t['rn0']}x{t['rk0']}_r{t['rm1']}x{t['rn1']}x{t['rk1']}"
            f"_w{t['wm0']}x{t['wn0']}x{t['wk0']}_w{t['wm1']}x{t['wn1']}x{t['wk1']}"
            + ("" if t["occupancy"] == -1 else f"_o{t['occupancy']}"))
    trload = "trload" if spec.algorithm.family.endswith("trload") else "ntrload"
    return (f"fmha_fwd_d{s.hdim_q}_{s.dtype}_{s.mode}_{tile}_{spec.algorithm.family}_vr_{v['pad']}_nlogits_nbias_"
            f"{s.mask}_{v['lse']}_ndropout_nskip_nsquant_{trload}_{_ck_arch(spec)}.cpp")


def ck_bwd_files(spec) -> list[str]:
    s, t, v = spec.signature, dict(spec.algorithm.tile), dict(spec.algorithm.variant)
    pads = catalogue.load("rocm").table("ck")["bwd_pads"][v["pad"]]
    det, arch = v["deterministic"], _ck_arch(spec)
    tile = (f"b{t['block_m']}x{t['block_n']}x{t['bk0']}x{t['bk1']}x{t['bk2']}x{t['bk3']}x{t['bk4']}x{t['bhdq']}x{t['bhdv']}"
            f"_r{t['rm0']}x{t['rn0']}x{t['rk0']}_r{t['rm1']}x{t['rn1']}x{t['rk1']}_r{t['rm2']}x{t['rn2']}x{t['rk2']}"
            f"_w{t['wm0']}x{t['wn0']}x{t['wk0']}_w{t['wm1']}x{t['wn1']}x{t['wk1']}_o{t['occupancy']}_maxq0")
    trload = "trload" if spec.algorithm.family.endswith("trload") else "ntrload"
    h = t["bhdq"]
    return [
        f"fmha_bwd_d{h}_{s.dtype}_{s.mode}_{tile}_{v['pad']}_nbias_ndbias_{s.mask}_ndropout_{det}_{trload}_{arch}.cpp",
        f"fmha_bwd_dot_do_o_d{h}_{s.dtype}_b64_{s.mode}_o2_{'psdv' if pads['dvpad'] else 'ps'}_{arch}.cpp",
        f"fmha_bwd_convert_dq_d{h}_{s.dtype}_b64x{t['block_n'] if det == 'deterministic' else 0}_{s.mode}_o2_"
        f"{'psd' if pads['dpad'] else 'ps'}_{det}_{arch}.cpp",
    ]


def all_specs(api: str) -> list:
    return [spec for arch in ARCHES for spec in profiles.select(api, arch, "default").specs]


def test_every_forward_instance_is_one_ck_generates(ck_fwd):
    missing = [spec.name for spec in all_specs("fwd") if ck_fwd_file(spec) not in ck_fwd]
    assert not missing, f"{len(missing)} instances CK does not generate, e.g. {missing[:3]}"


def test_every_backward_instance_is_one_ck_generates(ck_bwd):
    missing = [(spec.name, f) for spec in all_specs("bwd") for f in ck_bwd_files(spec) if f not in ck_bwd]
    assert not missing, f"{len(missing)} kernels CK does not generate, e.g. {missing[:3]}"


def test_ck_generator_covers_what_the_catalogue_leaves_out_only_by_choice(ck_fwd):
    """The other direction, for the traits mhakit serves: CK's batch-mode gfx9 forward instances for bf16 d128
    without a mask are exactly ours (same tiles, pipelines and padding)."""
    ours = {ck_fwd_file(s) for s in all_specs("fwd") if s.algorithm.arch == "gfx942"}
    pattern = re.compile(r"fmha_fwd_d128_bf16_batch_.*_nmask_.*_gfx9\.cpp")
    theirs = {name for name in ck_fwd if pattern.fullmatch(name)}
    assert theirs and {n for n in ours if pattern.fullmatch(n)} == theirs


# The CK-tile types, read from a source file: what makes the kernel (shape, traits, pipeline, mask, problem flags).
_TYPES = {
    "fwd": [r"sequence<\s*(\d+(?:,\s*\d+){5})\s*>", r"TileFmhaTraits<([^<>]*)>", r"(BlockFmhaPipeline(?!Problem)\w+)<",
            r"SimplifiedGenericAttentionMask<(\w+)>", r"Default2DEpilogueProblem<[^,]+,[^,]+,\s*(\w+),\s*(\w+)>"],
    "bwd": [r"sequence<\s*(\d+(?:,\s*\d+){8})\s*>", r"TileFmhaBwdTraits<([^<>]*)>",
            r"SimplifiedGenericAttentionMask<(\w+)>", r"TileFmhaBwdOGradDotOTraits<([^>]*)>",
            r"TileFmhaBwdConvertQGradTraits<([^>]*)>"],
}


def _normalise(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", "", text)
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r"\s+", " ", text)
    return text.replace("ck_tile::", "").replace("true", "t").replace("false", "f")


def _types(text: str, api: str) -> list:
    text = _normalise(text)
    found = []
    for pattern in _TYPES[api]:
        m = re.search(pattern, text)
        found.append(re.sub(r"\s", "", ",".join(m.groups())) if m else None)
    return found


@pytest.mark.parametrize("api", ["fwd", "bwd"])
def test_rendered_ck_types_match_ck_sources(api, ck_fwd, ck_bwd):
    generated = ck_fwd if api == "fwd" else ck_bwd
    specs = all_specs(api)
    # one instance per (arch class, family, pad variant, mode): every distinct combination of template arguments
    seen, checked = set(), 0
    for spec in specs:
        key = (_ck_arch(spec), spec.algorithm.family, spec.algorithm.variant, spec.signature.mode,
               spec.signature.mask, spec.algorithm.tile)
        if key in seen or spec.signature.dtype != "bf16":
            continue
        seen.add(key)
        ours = _types(render.render_instance(spec), api)
        name = ck_fwd_file(spec) if api == "fwd" else ck_bwd_files(spec)[0]
        theirs = _types(generated[name].read_text(), api)
        if api == "bwd":  # the 1-D kernels live in their own CK files
            dot, convert = (generated[f] for f in ck_bwd_files(spec)[1:])
            theirs[3] = _types(dot.read_text(), api)[3]
            theirs[4] = _types(convert.read_text(), api)[4]
        assert None not in ours and ours == theirs, (spec.name, ours, theirs)
        checked += 1
    assert checked >= 10
