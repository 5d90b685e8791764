"""Dropout without a GPU: Philox4x32-10 against Random123's known answers, the random-byte rule of
csrc/kernels/common/dropout.h as the NumPy reference draws it, the reference's arithmetic (its backward is the
derivative of its forward under a fixed mask), the C validator's sentences and the dispatch to the generic family's
modifier instances (a real minimal-profile library), and the Python front end's argument checks."""
from __future__ import annotations

import re

import numpy as np
import pytest

from mhakit import _capi
from mhakit import reference as R

from test_capi_validation import FAKE, valid_args
from test_capi_validation_bwd import valid_args as valid_bwd_args
from test_score_mods import assert_qkv_gradients


# ----------------------------------------------------------------------------------------------------------------
# The random bytes
# ----------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("ctr, key, expected", [
    # Random123's kat_vectors for philox4x32 with 10 rounds
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
])
def test_philox_known_answers(ctr, key, expected):
    assert tuple(int(w) for w in R.philox4x32_10(*ctr, *key)) == expected


def test_random_bytes_follow_the_stated_rule():
    """Byte of (b, h, i, j): call (J·4 + (j/2)%4, I·4 + (i/2)%4, lo(offset), hi(offset) + b·h_q + h) under the seed,
    byte (i%2)·8 + ((i/8)%2)·4 + ((j/8)%2)·2 + j%2 of its little-endian words."""
    seed, offset, b, h, nh = 0x1234_5678_9ABC_DEF0, (7 << 32) + 99, 1, 2, 3
    rv = R.dropout_randval(seed, offset, 2, nh, 37, 45)
    for i, j in [(0, 0), (5, 17), (36, 44), (16, 31), (9, 8)]:
        x = R.philox4x32_10((j // 16) * 4 + (j // 2) % 4, (i // 16) * 4 + (i // 2) % 4, offset & 0xFFFFFFFF,
                            7 + b * nh + h, seed & 0xFFFFFFFF, seed >> 32)
        k = (i % 2) * 8 + ((i // 8) % 2) * 4 + ((j // 8) % 2) * 2 + j % 2
        assert rv[b, h, i, j] == (int(x[k // 4]) >> (8 * (k % 4))) & 0xFF
    # a block does not depend on the sequence lengths around it; other heads, seeds and offsets give other bytes
    assert (R.dropout_randval(seed, offset, 2, nh, 20, 30)[:, :, :20, :30] == rv[:, :, :20, :30]).all()
    for other in (rv[1, 1], R.dropout_randval(seed + 1, offset, 2, nh, 37, 45)[b, h],
                  R.dropout_randval(seed, offset + 1, 2, nh, 37, 45)[b, h]):
        assert (other != rv[b, h]).mean() > 0.9
    varlen = R.dropout_randval_varlen(seed, offset, [0, 37, 37, 50], [0, 45, 48, 55], nh)
    assert varlen.shape == (nh, 50, 45) and (varlen[:, :37, :45] == rv[0]).all()
    assert (varlen[:, 37:50, :7] == R.dropout_randval(seed, offset, 3, nh, 13, 7)[2]).all()


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_is_one_minus_p(p):
    """keep_max = floor((1 − p)·255): P(keep) = (keep_max + 1) / 256, within 1/512 of 1 − p; uniform bytes."""
    rv = R.dropout_randval(42, 0, 2, 4, 256, 256)
    keep_max = R.dropout_keep_max(p)
    assert keep_max == int((1 - np.float32(p)) * np.float32(255))
    exact = (keep_max + 1) / 256
    assert abs(exact - (1 - p)) <= 1 / 256
    n = rv.size
    assert abs((rv <= keep_max).mean() - exact) < 5 * np.sqrt(exact * (1 - exact) / n)
    counts = np.bincount(rv.ravel(), minlength=256)
    assert counts.min() > 0.8 * n / 256 and counts.max() < 1.2 * n / 256


# ----------------------------------------------------------------------------------------------------------------
# The NumPy reference
# ----------------------------------------------------------------------------------------------------------------

def test_reference_dropout_semantics():
    """Kept probabilities scaled by 1/(1−p), dropped ones 0; the LSE is the undropped softmax's."""
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((1, 2, 5, 8)), rng.standard_normal((1, 2, 7, 8)), rng.standard_normal((1, 2, 7, 8))
    p = 0.25
    rv = R.dropout_randval(3, 4, 1, 2, 5, 7)
    o, lse = R.attention_fwd(q, k, v, dropout_p=p, randval=rv, return_lse=True, out_dtype=np.float64)
    o0, lse0 = R.attention_fwd(q, k, v, return_lse=True, out_dtype=np.float64)
    np.testing.assert_allclose(lse, lse0)
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(8)
    probs = np.exp(s - lse0[..., None])
    keep = rv <= R.dropout_keep_max(p)
    np.testing.assert_allclose(o, (probs * keep / (1 - np.float32(p))) @ v, rtol=1e-6)
    with pytest.raises(ValueError, match="dropout_p > 0 needs randval"):
        R.attention_fwd(q, k, v, dropout_p=p)


@pytest.mark.parametrize("mask_type", [0, 2])
@pytest.mark.parametrize("mods", [{}, dict(softcap=2.0, sink="s")])
def test_reference_backward_is_the_derivative_of_the_forward(mask_type, mods):
    rng = np.random.default_rng(1)
    b, h, hk, sq, sk, d = 2, 4, 2, 6, 9, 8
    q, k, v = rng.standard_normal((b, h, sq, d)), rng.standard_normal((b, hk, sk, d)), rng.standard_normal((b, hk, sk, d))
    do = rng.standard_normal((b, h, sq, d))
    kw = dict(mods, dropout_p=0.3, randval=R.dropout_randval(11, 5, b, h, sq, sk))
    if kw.get("sink") == "s":
        kw["sink"] = rng.standard_normal(h)

    def loss(**arrays):
        a = dict(q=q, k=k, v=v)
        a.update(arrays)
        return float((R.attention_fwd(a["q"], a["k"], a["v"], mask_type=mask_type, out_dtype=np.float64, **kw)
                      * do).sum())

    dq, dk, dv = R.attention_bwd(q, k, v, do, mask_type=mask_type, out_dtype=np.float64, **kw)
    assert_qkv_gradients(loss, q, k, v, dq, dk, dv)


def test_reference_varlen_dropout_is_the_batch_one_per_sequence():
    rng = np.random.default_rng(2)
    lq, lk, h, d = [5, 9], [7, 4], 2, 8
    cq, ck = np.concatenate([[0], np.cumsum(lq)]), np.concatenate([[0], np.cumsum(lk)])
    q, k, v = rng.standard_normal((cq[-1], h, d)), rng.standard_normal((ck[-1], h, d)), rng.standard_normal((ck[-1], h, d))
    rv = R.dropout_randval_varlen(8, 1, cq, ck, h)
    o = R.attention_varlen_fwd(q, k, v, cq, ck, dropout_p=0.4, randval=rv, out_dtype=np.float64)
    for bi in range(2):
        rows, keys = slice(cq[bi], cq[bi + 1]), slice(ck[bi], ck[bi + 1])
        ob = R.attention_fwd(q[None, rows].transpose(0, 2, 1, 3), k[None, keys].transpose(0, 2, 1, 3),
                             v[None, keys].transpose(0, 2, 1, 3), dropout_p=0.4, out_dtype=np.float64,
                             randval=rv[None, :, rows, :lk[bi]])
        np.testing.assert_allclose(o[rows], ob[0].transpose(1, 0, 2))


# ----------------------------------------------------------------------------------------------------------------
# The C validator and the dispatch (a real minimal-profile library, no GPU)
# ----------------------------------------------------------------------------------------------------------------

DROP_CASES = [
    (dict(p_drop=-0.1), "p_drop must be in [0, 1)"),
    (dict(p_drop=1.0), "p_drop must be in [0, 1)"),
    (dict(p_drop=float("nan")), "p_drop must be in [0, 1)"),
    (dict(p_drop=0.1, drop_seed_ptr=FAKE), "drop_seed_ptr and drop_offset_ptr must be given together"),
    (dict(p_drop=0.1, drop_offset_ptr=FAKE), "drop_seed_ptr and drop_offset_ptr must be given together"),
    (dict(p_drop=0.1, drop_seed_ptr=FAKE + 4, drop_offset_ptr=FAKE),
     "drop_seed_ptr (0x7f0000000004) is misaligned: the uint64 dropout seed and offset must be 8-byte aligned"),
]


@pytest.mark.compile
@pytest.mark.parametrize("overrides, message", DROP_CASES + [
    (dict(randval_ptr=FAKE), "randval_ptr is given but p_drop is 0: there is no dropout to record"),
    (dict(p_drop=0.2, randval_ptr=FAKE, stride_randval=-1), "strides must be >= 0"),
])
def test_forward_dropout_arguments_are_refused_with_one_sentence(fwd_lib, overrides, message):
    assert fwd_lib.mha_fwd_raw(valid_args(**overrides)) == _capi.ERROR_INVALID_ARGS
    assert message in fwd_lib.last_error()


@pytest.mark.compile
@pytest.mark.parametrize("overrides, message", DROP_CASES)
def test_backward_dropout_arguments_are_refused_with_one_sentence(bwd_lib, overrides, message):
    assert bwd_lib.mha_bwd_raw(valid_bwd_args(**overrides)) == _capi.ERROR_INVALID_ARGS
    assert message in bwd_lib.last_error()


@pytest.mark.compile
@pytest.mark.parametrize("overrides", [dict(p_drop=0.1), dict(p_drop=0.5, drop_seed_ptr=FAKE, drop_offset_ptr=FAKE),
                                       dict(p_drop=0.1, randval_ptr=FAKE, stride_randval=256)])
def test_dropout_calls_run_on_the_modifier_instances(fwd_lib, bwd_lib, overrides):
    """Dropout runs on the Hopper "_mods" instances (catalogue score_mods, forward and backward: the forward's masked
    one serves this unmasked call, the backward's d128 tile has an unmasked one, catalogue unmasked_mods), a head dim
    Hopper does not take on generic's."""
    assert fwd_lib.kernel_name(valid_args(**overrides)) == "fwd_d128_bf16_batch_mask_mods_sm90a_hopper_b128x128"
    assert fwd_lib.kernel_name(valid_args(hdim_q=100, hdim_v=100, **overrides)) == \
        "fwd_d128_bf16_batch_mask_mods_sm90a_generic_b128x64w4"
    bwd_overrides = {k: v for k, v in overrides.items() if "randval" not in k}
    name = bwd_lib.kernel_name(valid_bwd_args(**bwd_overrides))
    assert name == "bwd_d128_bf16_batch_nmask_mods_sm90a_hopper_b64x128", bwd_lib.last_error()
    name = bwd_lib.kernel_name(valid_bwd_args(hdim_q=100, hdim_v=100, **bwd_overrides))
    assert name == "bwd_d128_bf16_batch_mask_mods_sm90a_generic_b64x64w4", bwd_lib.last_error()


# ----------------------------------------------------------------------------------------------------------------
# The Python front end's arguments (checked before anything touches a GPU)
# ----------------------------------------------------------------------------------------------------------------

class _Call:
    """The parts of mhakit.api._Call that _dropout uses (views of host-side stand-ins)."""

    def view(self, obj, name):
        return obj


class _View:
    def __init__(self, dtype, shape, strides=None, ptr=0x7F0000000000, readonly=False):
        from mhakit._arrays import dtype_by_name
        self.dtype, self.shape, self.ptr, self.readonly = dtype_by_name(dtype), shape, ptr, readonly
        self.strides = strides or tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))


@pytest.mark.parametrize("kwargs, message", [
    (dict(dropout_p=1.0, seed=1), "dropout_p must be a number in [0, 1)"),
    (dict(dropout_p="0.1", seed=1), "dropout_p must be a number in [0, 1)"),
    (dict(dropout_p=0.1), "dropout_p > 0 needs seed="),
    (dict(dropout_p=0.1, seed=-1), "seed must be an int in [0, 2**64)"),
    (dict(dropout_p=0.1, seed=1 << 64), "seed must be an int in [0, 2**64)"),
    (dict(dropout_p=0.1, seed=_View("uint64", (1,)), offset=3), "seed and offset must both be ints or both be"),
    (dict(dropout_p=0.1, seed=_View("float32", (1,)), offset=_View("uint64", (1,))), "seed must be a device array of one"),
    (dict(dropout_p=0.0, randval=_View("uint8", (2, 3, 4, 5))), "randval is given but dropout_p is 0"),
    (dict(dropout_p=0.1, seed=1, randval=_View("uint8", (2, 3, 4, 6))), "randval must be a writable uint8 array of shape"),
    (dict(dropout_p=0.1, seed=1, randval=_View("int8", (2, 3, 4, 5))), "randval must be a writable uint8 array"),
])
def test_python_dropout_arguments_are_refused_with_one_sentence(kwargs, message):
    from mhakit import api
    kw = dict(dict(dropout_p=0.0, seed=None, offset=0, randval=None), **kwargs)
    with pytest.raises(ValueError, match=re.escape(message)):
        api._dropout(_Call(), {}, [], kw["dropout_p"], kw["seed"], kw["offset"], kw["randval"], (2, 3, 4, 5))


def test_python_dropout_fields():
    from mhakit import api
    fields, views = {}, []
    api._dropout(_Call(), fields, views, 0.25, 2**63 + 5, 17, _View("uint8", (2, 3, 4, 5)), (2, 3, 4, 5))
    assert fields == dict(p_drop=0.25, drop_seed=2**63 + 5, drop_offset=17, randval_ptr=0x7F0000000000,
                          stride_randval=5, nhead_stride_randval=20, batch_stride_randval=60)
    fields = {}
    api._dropout(_Call(), fields, [], 0.5, _View("uint64", (1,), ptr=0x1000), _View("int64", (), ptr=0x2000), None, None)
    assert fields == dict(p_drop=0.5, drop_seed_ptr=0x1000, drop_offset_ptr=0x2000)
    assert api._modifier_kinds(fields) == 16 and api._modifier_kinds({}) == 0  # MHAKIT_MOD_DROPOUT; none
    fields = {}
    api._dropout(_Call(), fields, [], 0.5, 1, 2, _View("uint8", (3, 40, 9)), (3, 40, 9))  # varlen [h, total_q, max_k]
    assert (fields["batch_stride_randval"], fields["nhead_stride_randval"], fields["stride_randval"]) == (0, 360, 9)
    with pytest.raises(ValueError, match="randval is a forward output"):
        api._dropout(_Call(), {}, [], 0.5, 1, 2, _View("uint8", (3, 40, 9)), None)


def test_dropout_calls_take_the_python_call_path():
    """The C call path knows no dropout: such calls go to the Python path; dropout_p=0 stays on the C path."""
    from mhakit import api
    assert api._ext_mods({"dropout_p": 0.1, "seed": 3}, api._FWD_MODS) is api._PYTHON_PATH
    assert api._ext_mods({"dropout_p": 0.0, "seed": 3, "offset": 0}, api._FWD_MODS) is None
    assert api._ext_mods({"dropout_p": 0.0, "softcap": 2.0}, api._FWD_MODS) == (2.0, None, None, None)
    assert api._ext_mods({"dropout_p": 0.0, "randval": object()}, api._FWD_MODS) is api._PYTHON_PATH
