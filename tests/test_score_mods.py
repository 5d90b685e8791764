"""Score modifiers (logits soft-cap, elementwise bias / ALiBi, attention sinks): the C validator's sentences and the
catalogue guard that steers such calls to the generic family (through a real minimal-profile library, no GPU), and
the NumPy reference's arithmetic (finite differences of its forward against its backward)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mhakit import _capi
from mhakit import reference as R

from test_capi_validation import FAKE, valid_args
from test_capi_validation_bwd import valid_args as valid_bwd_args


MOD_CASES = [
    (dict(logits_soft_cap=-1.0), "logits_soft_cap must be finite and >= 0"),
    (dict(logits_soft_cap=float("inf")), "logits_soft_cap must be finite and >= 0"),
    (dict(logits_soft_cap=float("nan")), "logits_soft_cap must be finite and >= 0"),
    (dict(bias_type=3, bias_ptr=FAKE), "bias_type 3 is unknown: 0 none, 1 elementwise, 2 alibi"),
    (dict(bias_type=2), "bias_type 2 needs bias_ptr (fp32 ALiBi slopes)"),
    (dict(bias_type=1), "bias_type 1 needs bias_ptr (the elementwise bias)"),
    (dict(bias_type=1, bias_ptr=FAKE, bias_fp32=2), "bias_fp32 must be 0 (bias of the data type) or 1 (fp32 bias)"),
    (dict(bias_type=1, bias_ptr=FAKE, stride_bias=-1), "strides must be >= 0"),
    (dict(bias_type=2, bias_ptr=FAKE + 2), "bias_ptr (0x7f0000000002) is misaligned: fp32 bias must be 4-byte aligned"),
    (dict(bias_type=1, bias_ptr=FAKE + 1), "bias_ptr (0x7f0000000001) is misaligned: fp16/bf16 bias must be 2-byte"),
    (dict(sink_ptr=FAKE + 2), "sink_ptr (0x7f0000000002) is misaligned: the fp32 sink logits must be 4-byte aligned"),
]


@pytest.mark.compile
@pytest.mark.parametrize("overrides, message", MOD_CASES)
def test_forward_modifier_arguments_are_refused_with_one_sentence(fwd_lib, overrides, message):
    args = valid_args(**overrides)
    assert fwd_lib.mha_fwd_raw(args) == _capi.ERROR_INVALID_ARGS
    assert message in fwd_lib.last_error()


@pytest.mark.compile
@pytest.mark.parametrize("overrides, message", MOD_CASES + [
    (dict(dbias_ptr=FAKE), "dbias_ptr is given but bias_type is not elementwise (1)"),
    (dict(bias_type=2, bias_ptr=FAKE, dbias_ptr=FAKE), "dbias_ptr is given but bias_type is not elementwise (1)"),
    (dict(bias_type=1, bias_ptr=FAKE, dbias_ptr=FAKE, stride_dbias=256, nhead_stride_dbias=0,
          batch_stride_dbias=8 * 256 * 256), "nhead_stride_dbias and batch_stride_dbias must be > 0"),
    (dict(bias_type=1, bias_ptr=FAKE, bias_fp32=1, dbias_ptr=FAKE + 2, stride_dbias=256,
          nhead_stride_dbias=256 * 256, batch_stride_dbias=8 * 256 * 256), "dbias_ptr (0x7f0000000002) is misaligned"),
    (dict(dsink_ptr=FAKE), "dsink_ptr is given but sink_ptr is NULL: there is no sink"),
    (dict(sink_ptr=FAKE, dsink_ptr=FAKE + 1), "dsink_ptr (0x7f0000000001) is misaligned"),
])
def test_backward_modifier_arguments_are_refused_with_one_sentence(bwd_lib, overrides, message):
    args = valid_bwd_args(**overrides)
    assert bwd_lib.mha_bwd_raw(args) == _capi.ERROR_INVALID_ARGS
    assert message in bwd_lib.last_error()


MOD_CALLS = [dict(logits_soft_cap=30.0), dict(bias_type=2, bias_ptr=FAKE),
             dict(bias_type=1, bias_ptr=FAKE, stride_bias=256, nhead_stride_bias=0, batch_stride_bias=0),
             dict(bias_type=1, bias_ptr=FAKE, bias_fp32=1, stride_bias=256), dict(sink_ptr=FAKE),
             dict(logits_soft_cap=30.0, bias_type=2, bias_ptr=FAKE, sink_ptr=FAKE)]


@pytest.mark.compile
@pytest.mark.parametrize("overrides", MOD_CALLS)
def test_forward_modifier_calls_run_on_the_hopper_modifier_instance(fwd_lib, overrides):
    """The Hopper forward serves soft-cap, bias / ALiBi (with or without a sink) on its "_mods" instances (catalogue
    score_mods: the minimal profile's masked one serves this unmasked call too), a sink alone on its plain ones; what
    Hopper refuses (a head dim not a multiple of 8) goes to the generic "_mods" instance, or, for a sink alone, to the
    plain generic one; plain calls never reach a modifier instance."""
    assert fwd_lib.kernel_name(valid_args()) == "fwd_d128_bf16_batch_nmask_sm90a_hopper_b128x176"
    assert fwd_lib.kernel_name(valid_args(mask_type=1, hdim_q=59, hdim_v=59)) == \
        "fwd_d128_bf16_batch_mask_sm90a_generic_b128x64w4"
    sink_alone = overrides == dict(sink_ptr=FAKE)
    for mask_type in (0, 1, 2, 3):
        plain = "fwd_d128_bf16_batch_nmask_sm90a_hopper_b128x176" if mask_type == 0 else \
            "fwd_d128_bf16_batch_mask_sm90a_hopper_b128x128"
        assert fwd_lib.kernel_name(valid_args(mask_type=mask_type, **overrides)) == \
            (plain if sink_alone else "fwd_d128_bf16_batch_mask_mods_sm90a_hopper_b128x128"), fwd_lib.last_error()
    odd = fwd_lib.kernel_name(valid_args(hdim_q=59, hdim_v=59, **overrides))
    assert odd == ("fwd_d128_bf16_batch_nmask_sm90a_generic_b128x64w4" if overrides == dict(sink_ptr=FAKE)
                   else "fwd_d128_bf16_batch_mask_mods_sm90a_generic_b128x64w4")


@pytest.mark.compile
def test_forward_dropout_runs_on_the_hopper_modifier_instance(fwd_lib):
    """The Hopper forward serves dropout on its "_mods" instances (catalogue score_mods), with or without other
    modifiers, every mask type; an odd head dim goes to the generic "_mods" instance."""
    for extra in ({}, dict(logits_soft_cap=30.0), dict(sink_ptr=FAKE)):
        for mask_type in (0, 2):
            assert fwd_lib.kernel_name(valid_args(p_drop=0.1, mask_type=mask_type, **extra)) == \
                "fwd_d128_bf16_batch_mask_mods_sm90a_hopper_b128x128", fwd_lib.last_error()
        assert fwd_lib.kernel_name(valid_args(p_drop=0.1, hdim_q=59, hdim_v=59, **extra)) == \
            "fwd_d128_bf16_batch_mask_mods_sm90a_generic_b128x64w4", fwd_lib.last_error()


@pytest.mark.compile
@pytest.mark.parametrize("overrides", MOD_CALLS)
def test_backward_modifier_calls_run_on_the_hopper_modifier_instance(bwd_lib, overrides):
    """The Hopper backward serves soft-cap, bias / ALiBi (+ dbias, with or without a sink) on its "_mods" instances,
    for every mask type (unmasked calls on the unmasked one, catalogue unmasked_mods), deterministic or not, a sink
    alone (+ d sink) on its plain ones; an odd head dim goes to the generic "_mods" instance, or, for a sink alone, to
    the plain generic one."""
    assert bwd_lib.kernel_name(valid_bwd_args()) == "bwd_d128_bf16_batch_nmask_sm90a_hopper_b64x128"
    sink_alone = overrides == dict(sink_ptr=FAKE)
    for mask_type in (0, 1, 2, 3):
        for deterministic in (0, 1):
            name = bwd_lib.kernel_name(valid_bwd_args(mask_type=mask_type, deterministic=deterministic, **overrides))
            cls = "nmask" if mask_type == 0 else "mask"
            assert name == (f"bwd_d128_bf16_batch_{cls}_sm90a_hopper_b64x128" if sink_alone
                            else f"bwd_d128_bf16_batch_{cls}_mods_sm90a_hopper_b64x128"), bwd_lib.last_error()
    odd = bwd_lib.kernel_name(valid_bwd_args(hdim_q=59, hdim_v=59, **overrides))
    assert odd == ("bwd_d128_bf16_batch_nmask_sm90a_generic_b64x64w4" if overrides == dict(sink_ptr=FAKE)
                   else "bwd_d128_bf16_batch_mask_mods_sm90a_generic_b64x64w4"), bwd_lib.last_error()


@pytest.mark.compile
def test_backward_dropout_runs_on_the_hopper_modifier_instance(bwd_lib):
    """The Hopper backward serves dropout on its "_mods" instances (this unmasked call on the unmasked one, catalogue
    unmasked_mods), with or without other modifiers, deterministic or not; an odd head dim goes to generic's."""
    for extra in ({}, dict(logits_soft_cap=30.0), dict(sink_ptr=FAKE)):
        for deterministic in (0, 1):
            assert bwd_lib.kernel_name(valid_bwd_args(p_drop=0.1, deterministic=deterministic, **extra)) == \
                "bwd_d128_bf16_batch_nmask_mods_sm90a_hopper_b64x128", bwd_lib.last_error()
        assert bwd_lib.kernel_name(valid_bwd_args(p_drop=0.1, hdim_q=59, hdim_v=59, **extra)) == \
            "bwd_d128_bf16_batch_mask_mods_sm90a_generic_b64x64w4", bwd_lib.last_error()


@pytest.fixture(scope="module")
def plain_fwd_lib(minimal_fwd_build, build_root):
    """The minimal forward library without its modifier instances (the same objects, another table)."""
    from conftest import run_compile
    out = build_root / "minimal-plain"
    out.mkdir(exist_ok=True)
    proc = run_compile(["--api", "fwd", "--profile", "minimal", "--arch", "sm_90a", "--filter", "_nmask_,_mask_sm",
                        "--build-dir", str(build_root / "objects")], cwd=out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return _capi.load_library(out / "libmha_fwd.so")


@pytest.mark.compile
def test_a_library_without_the_modifier_instance_refuses_modifier_calls(plain_fwd_lib):
    # a sink alone: the plain Hopper instance (its final normalisation takes the sink)
    assert plain_fwd_lib.kernel_name(valid_args(sink_ptr=FAKE)) == "fwd_d128_bf16_batch_nmask_sm90a_hopper_b128x176"
    assert plain_fwd_lib.mha_fwd_raw(valid_args(logits_soft_cap=30.0)) == _capi.ERROR_UNSUPPORTED
    message = plain_fwd_lib.last_error()
    assert message.startswith("no forward kernel built into this library serves dtype=bf16 hdim_q=128") and \
        'with score modifiers (soft-cap, bias / ALiBi or dropout: a "_mods" instance)' in message, message


def test_catalogue_states_which_families_serve_modifiers():
    from codegen import catalogue
    cat = catalogue.load("cuda")
    served = {(api, name): (fam.plain_mods, fam.instance_mods) for (api, name), fam in cat.families.items()}
    for api in ("fwd", "bwd"):
        for family in ("generic", "hopper"):  # a sink alone on the plain instances, the rest on "_mods" ones
            assert served[(api, family)] == (("sink",), ("softcap", "bias", "alibi", "dropout"))
    assert not served[("splitkv", "decode")][0] and not served[("splitkv", "decode")][1]
    assert not any(f.plain_mods or f.instance_mods for f in catalogue.load("rocm").families.values())


def test_the_modifier_names_are_the_c_enum_and_the_python_bits():
    """One vocabulary: the catalogue's names, the C enum mhakit_score_mod (MHAKIT_MOD_<NAME>, mha_common.h) and the
    Python mirror (_capi.SCORE_MOD_BITS, which the JIT and the call paths use) agree."""
    import re
    from pathlib import Path
    from codegen import catalogue
    header = (Path(__file__).resolve().parents[1] / "csrc" / "include" / "mha_common.h").read_text()
    body = re.search(r"typedef enum mhakit_score_mod \{(.*?)\} mhakit_score_mod;", header, re.S).group(1)
    enum = {name.lower(): int(value) for name, value in re.findall(r"MHAKIT_MOD_(\w+) = (\d+)", body)}
    assert enum == _capi.SCORE_MOD_BITS
    assert tuple(enum) == catalogue.SCORE_MODS
    from mhakit import api
    assert api._modifier_kinds(dict(logits_soft_cap=30.0, bias_type=2, sink_ptr=0x100)) == 1 | 4 | 8
    assert api._modifier_kinds(dict(logits_soft_cap=0.0, bias_type=1, p_drop=0.0)) == 2


def test_catalogue_score_mods_errors(tmp_path, monkeypatch):
    from codegen import catalogue
    for raw, message in [({"mods": ["softcap", "fp8"]}, "must list distinct names of softcap"),
                         ({"plain": ["sink"], "mods": ["sink"]}, "listed under both plain and mods"),
                         ({"instances": ["sink"]}, "must be a table with the keys plain and mods"),
                         (True, "must be a table with the keys plain and mods"),
                         ({"mods": ["sink"], "dtypes": ["fp8bf16"]}, "dtypes: must be a non-empty list of the family"),
                         ({"mods": ["sink"], "dtypes": []}, "dtypes: must be a non-empty list of the family")]:
        with pytest.raises(catalogue.CatalogueError, match=message):
            catalogue._parse_score_mods(raw, "cuda.toml: fwd.x", ["fp16", "bf16"])
    assert catalogue._parse_score_mods({"mods": ["sink"]}, "w", ["fp16", "bf16"])["mod_dtypes"] == ("fp16", "bf16")


def test_unmasked_modifier_instances_are_catalogue_data():
    """Which tiles give their unmasked modifier calls an unmasked "_mods" instance is the catalogue's unmasked_mods
    (the Hopper backward's d64 and d128 tiles, measured faster there): only their modifier specs carry it, the key is
    refused where no unmasked modifier instance could exist, and every profile that keeps such a tile's masked
    modifier instance keeps the unmasked one too (a rule of the profiles, not a line of each), so that their libraries
    and the JIT's prebuilt entries serve those calls."""
    from codegen import profiles
    from codegen.catalogue import CatalogueError, _parse_tile
    every = profiles.enumerate_specs("bwd", "sm_90a").specs + profiles.enumerate_specs("fwd", "sm_90a").specs
    flagged = {(s.signature.api, s.algorithm.family, s.signature.hdim_q) for s in every if s.unmasked_mods}
    assert flagged == {("bwd", "hopper", 64), ("bwd", "hopper", 128)}
    assert all(s.signature.mods for s in every if s.unmasked_mods)
    family = {"masks": ["nmask", "mask"], "score_mods": {"mods": ["softcap"]}}
    for raw, message in (({"unmasked_mods": 1}, "unmasked_mods: must be true or false"),
                         ({"unmasked_mods": True, "plain_only": True}, "unmasked_mods needs"),
                         ({"unmasked_mods": True, "masks": ["mask"]}, "unmasked_mods needs")):
        with pytest.raises(CatalogueError, match=message):
            _parse_tile({"hdim_q": 64, "hdim_v": 64, "block_m": 64, "block_n": 128, **raw}, "bwd.x.tiles[0]", family)
    with pytest.raises(CatalogueError, match="unmasked_mods needs"):
        _parse_tile({"hdim_q": 64, "hdim_v": 64, "block_m": 64, "unmasked_mods": True}, "w", {"masks": ["nmask"]})
    assert _parse_tile({"hdim_q": 64, "hdim_v": 64, "block_m": 64, "unmasked_mods": True}, "w", family).unmasked_mods
    for name in ("minimal", "default", "all"):
        for api in ("fwd", "bwd"):
            specs = profiles.select(api, "sm_90a", name).specs
            have = {(s.algorithm.family, s.signature) for s in specs}
            for s in specs:
                if s.unmasked_mods and s.signature.mask == "mask":
                    twin = dataclasses.replace(s.signature, mask="nmask")
                    assert (s.algorithm.family, twin) in have, (name, s.name)
    # the rule, on a profile's own terms: the unmasked instance follows its masked twin's table, and a top-level
    # mask key still applies
    unmasked = next(s for s in every if s.unmasked_mods and s.signature.mask == "nmask" and s.signature.hdim_q == 64)
    assert profiles._profile_admits({"mods": {"mask": ["mask"]}}, unmasked)
    assert profiles._profile_admits({"mods": [{"hdim": ["256x256"]}, {"hdim": ["64x64"], "mask": ["mask"]}]}, unmasked)
    assert not profiles._profile_admits({"mods": {"mask": ["mask"], "hdim": ["128x128"]}}, unmasked)
    assert not profiles._profile_admits({"mask": ["mask"]}, unmasked)
    assert not profiles._profile_admits({"mods": False}, unmasked)
    # (the `api` key narrows a profile or one of its mods tables to one direction)
    assert profiles._profile_admits({"mods": {"api": ["bwd"], "mask": ["mask"]}}, unmasked)
    assert not profiles._profile_admits({"mods": {"api": ["fwd"], "mask": ["mask"]}}, unmasked)
    assert not profiles._profile_admits({"api": ["fwd"]}, unmasked)


def test_fp8_instances_have_no_score_modifiers():
    """The Hopper forward's modifier instances are 16-bit only (catalogue score_mods.dtypes): no fp8 "_mods"
    instance in any profile, and the rules say why one would be refused."""
    from codegen import profiles, rules
    every = profiles.enumerate_specs("fwd", "sm_90a").specs
    assert any(s.signature.dtype.startswith("fp8") for s in every)
    assert not any(s.signature.dtype.startswith("fp8") and s.signature.mods for s in every)
    fp8 = next(s for s in every if s.signature.dtype == "fp8bf16")
    import dataclasses
    mods = dataclasses.replace(fp8, signature=dataclasses.replace(fp8.signature, mods=True))
    assert any("score_mods.dtypes" in r and "fp8bf16" in r for r in rules.violations(mods))


# ----------------------------------------------------------------------------------------------------------------
# The NumPy reference: its backward is the derivative of its forward (soft-cap, bias, ALiBi, sink, masks, GQA)
# ----------------------------------------------------------------------------------------------------------------

def assert_qkv_gradients(loss, q, k, v, dq, dk, dv, eps=1e-6):
    """dq, dk, dv at a few points against central differences of loss(q=..., k=..., v=...) (b=2, h=4, h_k=2, s_q=6,
    s_k=9 shapes); returns the difference function fd(name, array, index) for further checks."""
    def fd(name, arr, idx):
        plus, minus = arr.copy(), arr.copy()
        plus[idx] += eps
        minus[idx] -= eps
        return (loss(**{name: plus}) - loss(**{name: minus})) / (2 * eps)

    for idx in [(0, 1, 2, 3), (1, 3, 5, 7)]:
        assert dq[idx] == pytest.approx(fd("q", q, idx), rel=1e-5, abs=1e-7)
    for idx in [(0, 1, 4, 2), (1, 0, 8, 5)]:
        assert dk[idx] == pytest.approx(fd("k", k, idx), rel=1e-5, abs=1e-7)
        assert dv[idx] == pytest.approx(fd("v", v, idx), rel=1e-5, abs=1e-7)
    return fd


def _fd_case(mods, mask_type, seed=0):
    rng = np.random.default_rng(seed)
    b, h, hk, sq, sk, d = 2, 4, 2, 6, 9, 8
    q, k, v = rng.standard_normal((b, h, sq, d)), rng.standard_normal((b, hk, sk, d)), rng.standard_normal((b, hk, sk, d))
    do = rng.standard_normal((b, h, sq, d))
    kw = dict(mods)
    if kw.get("bias") == "e":
        kw["bias"] = rng.standard_normal((1, h, sq, sk))
    if kw.get("sink") == "s":
        kw["sink"] = rng.standard_normal(h)
    if kw.get("alibi_slopes") == "a":
        kw["alibi_slopes"] = rng.uniform(0.1, 1.0, (b, h))
    return q, k, v, do, kw, mask_type


@pytest.mark.parametrize("mods", [dict(softcap=2.0), dict(bias="e"), dict(alibi_slopes="a"), dict(sink="s"),
                                  dict(softcap=1.5, bias="e", sink="s"), dict(softcap=3.0, alibi_slopes="a")])
@pytest.mark.parametrize("mask_type", [0, 2])
def test_reference_backward_is_the_derivative_of_the_forward(mods, mask_type):
    q, k, v, do, kw, mt = _fd_case(mods, mask_type)

    def loss(**arrays):
        a = dict(q=q, k=k, v=v, **{n: kw.get(n) for n in ("bias", "sink")})
        a.update(arrays)
        o = R.attention_fwd(a["q"], a["k"], a["v"], mask_type=mt, out_dtype=np.float64, softcap=kw.get("softcap"),
                            alibi_slopes=kw.get("alibi_slopes"), bias=a["bias"], sink=a["sink"])
        return float((o * do).sum())

    dq, dk, dv, dbias, dsink = R.attention_bwd(q, k, v, do, mask_type=mt, out_dtype=np.float64, return_mod_grads=True,
                                               **kw)
    fd = assert_qkv_gradients(loss, q, k, v, dq, dk, dv)
    if isinstance(kw.get("bias"), np.ndarray):  # broadcast over the batch: the gradient sums dS over it
        for idx in [(0, 1, 5, 8), (0, 3, 2, 2)]:
            assert dbias.sum(axis=0)[idx[1:]] == pytest.approx(fd("bias", kw["bias"], idx), rel=1e-5, abs=1e-7)
    if isinstance(kw.get("sink"), np.ndarray):
        for hh in range(q.shape[1]):
            assert dsink[hh] == pytest.approx(fd("sink", kw["sink"], (hh,)), rel=1e-5, abs=1e-7)


def test_reference_alibi_and_sink_semantics():
    """ALiBi is -slope·|i + s_k - s_q - j| (bottom-right); a row without keys gets O = 0 and LSE = sink."""
    q = np.zeros((1, 1, 3, 4))
    k = np.zeros((1, 1, 5, 4))
    v = np.arange(5, dtype=np.float64).reshape(1, 1, 5, 1).repeat(4, axis=3)
    o, lse = R.attention_fwd(q, k, v, alibi_slopes=np.array([0.5]), return_lse=True, out_dtype=np.float64)
    logits = -0.5 * np.abs(np.arange(3)[:, None] + 2 - np.arange(5)[None, :])
    p = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(o[0, 0, :, 0], p @ np.arange(5))
    np.testing.assert_allclose(lse[0, 0], np.log(np.exp(logits).sum(axis=1)))
    o, lse = R.attention_fwd(q, k[:, :, :0], v[:, :, :0], sink=np.array([0.7]), return_lse=True, out_dtype=np.float64)
    assert (o == 0).all() and np.allclose(lse, 0.7)
    o2, lse2 = R.attention_fwd(q, k, v, sink=np.array([0.7]), return_lse=True, out_dtype=np.float64)
    np.testing.assert_allclose(lse2[0, 0], np.log(5 + np.exp(0.7)))
    np.testing.assert_allclose(o2[0, 0, :, 0], 10 / (5 + np.exp(0.7)))


def test_reference_varlen_is_the_batch_reference_per_sequence():
    """Group mode: each sequence with its own positions, its ALiBi slope row, its bias block and the sinks."""
    rng = np.random.default_rng(3)
    lq, lk, h, hk, d = [5, 0, 9], [7, 3, 4], 4, 2, 8
    cq, ck = np.concatenate([[0], np.cumsum(lq)]), np.concatenate([[0], np.cumsum(lk)])
    q, k, v = rng.standard_normal((cq[-1], h, d)), rng.standard_normal((ck[-1], hk, d)), rng.standard_normal((ck[-1], hk, d))
    do = rng.standard_normal((cq[-1], h, d))
    bias = rng.standard_normal((3, 1, max(lq), max(lk)))
    kw = dict(softcap=2.0, bias=bias, sink=rng.standard_normal(h), mask_type=2, window_left=-1, window_right=0)
    o, lse = R.attention_varlen_fwd(q, k, v, cq, ck, return_lse=True, out_dtype=np.float64, **kw)
    dq, dk, dv, dbias, dsink = R.attention_varlen_bwd(q, k, v, do, cq, ck, out_dtype=np.float64,
                                                      return_mod_grads=True, **kw)
    slopes = rng.uniform(0.1, 1.0, (3, h))
    o_alibi = R.attention_varlen_fwd(q, k, v, cq, ck, out_dtype=np.float64, alibi_slopes=slopes)
    total_dsink = np.zeros(h)
    for b in range(3):
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        bhsd = lambda x: x[None].transpose(0, 2, 1, 3)  # noqa: E731
        one = dict(kw, bias=bias[b:b + 1, :, :q1 - q0, :k1 - k0])
        ob, lb = R.attention_fwd(bhsd(q[q0:q1]), bhsd(k[k0:k1]), bhsd(v[k0:k1]), return_lse=True,
                                 out_dtype=np.float64, **one)
        np.testing.assert_allclose(o[q0:q1], ob[0].transpose(1, 0, 2), atol=1e-12)
        np.testing.assert_allclose(lse[:, q0:q1], lb[0], atol=1e-12)
        r = R.attention_bwd(bhsd(q[q0:q1]), bhsd(k[k0:k1]), bhsd(v[k0:k1]), bhsd(do[q0:q1]), out_dtype=np.float64,
                            return_mod_grads=True, **one)
        np.testing.assert_allclose(dq[q0:q1], r[0][0].transpose(1, 0, 2), atol=1e-12)
        np.testing.assert_allclose(dk[k0:k1], r[1][0].transpose(1, 0, 2), atol=1e-12)
        np.testing.assert_allclose(dbias[b, :, :q1 - q0, :k1 - k0], r[3][0], atol=1e-12)
        total_dsink += r[4]
        oa = R.attention_fwd(bhsd(q[q0:q1]), bhsd(k[k0:k1]), bhsd(v[k0:k1]), out_dtype=np.float64,
                             alibi_slopes=slopes[b])
        np.testing.assert_allclose(o_alibi[q0:q1], oa[0].transpose(1, 0, 2), atol=1e-12)
    np.testing.assert_allclose(dsink, total_dsink, atol=1e-12)
    assert (lse[:, cq[1]:cq[2]].size == 0) and np.all(dbias[1] == 0)
