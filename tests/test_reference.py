"""CPU tests of the NumPy reference (mhakit.reference) against hand-computed cases."""

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from host_check import build_cpp
from mhakit import reference as ref
from mhakit.reference import (MASK_BOTTOM_RIGHT, MASK_GENERIC, MASK_NONE, MASK_TOP_LEFT, attention_fwd,
                              attention_varlen_fwd, check_close, flops_fwd, mask_coord, parse_mask, visible_mask)

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------------


def uniform_probe(sq, sk, mask_type, left, right):
    """Run the reference with q = 0 (every visible score is 0, so the weights are uniform over the visible keys)
    and v[j] = e_j, so that O[i] = vis[i] / count_i and LSE[i] = log(count_i)."""
    q = np.zeros((1, 1, sq, 8), dtype=np.float32)
    k = np.ones((1, 1, sk, 8), dtype=np.float32)
    v = np.eye(sk, dtype=np.float32)[None, None] if sk else np.zeros((1, 1, 0, 1), np.float32)
    o, lse = attention_fwd(q, k, v, scale=1.0, mask_type=mask_type, window_left=left, window_right=right,
                           return_lse=True)
    return o[0, 0], lse[0, 0]


def expected_from_visibility(vis):
    vis = np.asarray(vis, dtype=np.float64)
    count = vis.sum(axis=1)
    o = np.where(count[:, None] > 0, vis / np.maximum(count, 1)[:, None], 0.0)
    with np.errstate(divide="ignore"):
        lse = np.where(count > 0, np.log(np.maximum(count, 1)), -np.inf)
    return o, lse


def assert_mask(sq, sk, mask_type, left, right, vis):
    vis = np.array(vis, dtype=bool)
    assert vis.shape == (sq, sk)
    np.testing.assert_array_equal(visible_mask(mask_type, left, right, sq, sk), vis)
    o, lse = uniform_probe(sq, sk, mask_type, left, right)
    o_exp, lse_exp = expected_from_visibility(vis)
    np.testing.assert_allclose(o, o_exp, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_exp))
    np.testing.assert_allclose(lse[np.isfinite(lse_exp)], lse_exp[np.isfinite(lse_exp)], rtol=0, atol=1e-6)


def naive_attention(q, k, v, scale, vis):
    """Independent float64 softmax attention for one head, visibility given as a boolean matrix."""
    s = scale * (q.astype(np.float64) @ k.astype(np.float64).T)
    o = np.zeros((q.shape[0], v.shape[1]))
    lse = np.full(q.shape[0], -np.inf)
    for i in range(q.shape[0]):
        js = np.nonzero(vis[i])[0]
        if js.size == 0:
            continue
        row = s[i, js]
        w = np.exp(row - row.max())
        o[i] = (w / w.sum()) @ v[js].astype(np.float64)
        lse[i] = row.max() + math.log(w.sum())
    return o, lse


# ---------------------------------------------------------------------------------------------------------------
# the forward pass on hand-computed cases
# ---------------------------------------------------------------------------------------------------------------


def test_single_query_single_key_returns_v():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 1, 1, 8)).astype(np.float32)
    k = rng.standard_normal((1, 1, 1, 8)).astype(np.float32)
    v = rng.standard_normal((1, 1, 1, 16)).astype(np.float32)
    o, lse = attention_fwd(q, k, v, return_lse=True)
    assert o.dtype == np.float32 and o.shape == (1, 1, 1, 16)
    assert lse.dtype == np.float32 and lse.shape == (1, 1, 1)
    np.testing.assert_allclose(o, v, rtol=1e-6, atol=0)
    expected_lse = float(q.astype(np.float64).ravel() @ k.astype(np.float64).ravel()) / math.sqrt(8)
    assert lse[0, 0, 0] == pytest.approx(expected_lse, rel=1e-6, abs=1e-6)


def test_two_keys_known_softmax():
    # scores 0 and ln 3 -> weights 1/4, 3/4; LSE = ln(1 + 3) = ln 4
    q = np.array([1.0, 0.0], dtype=np.float32).reshape(1, 1, 1, 2)
    k = np.array([[0.0, 0.0], [math.log(3.0), 0.0]], dtype=np.float64).reshape(1, 1, 2, 2)
    v = np.array([[1.0, 0.0, 10.0], [0.0, 1.0, 20.0]]).reshape(1, 1, 2, 3)
    o, lse = attention_fwd(q, k, v, scale=1.0, return_lse=True)
    np.testing.assert_allclose(o[0, 0, 0], [0.25, 0.75, 17.5], rtol=1e-6)
    assert lse[0, 0, 0] == pytest.approx(math.log(4.0), rel=1e-6)


def test_scale_is_applied_to_scores():
    # q.k = 0 and 2 ln 3; scale 1/2 -> scores 0 and ln 3 -> weights 1/4, 3/4, LSE ln 4
    q = np.array([2.0, 0.0]).reshape(1, 1, 1, 2)
    k = np.array([[0.0, 0.0], [math.log(3.0), 0.0]]).reshape(1, 1, 2, 2)
    v = np.array([[4.0], [8.0]]).reshape(1, 1, 2, 1)
    o, lse = attention_fwd(q, k, v, scale=0.5, return_lse=True)
    assert o[0, 0, 0, 0] == pytest.approx(0.25 * 4 + 0.75 * 8, rel=1e-6)
    assert lse[0, 0, 0] == pytest.approx(math.log(4.0), rel=1e-6)
    # default scale is 1/sqrt(d): d = 4 -> 1/2
    q4 = np.array([2.0, 0, 0, 0]).reshape(1, 1, 1, 4)
    k4 = np.array([[0.0, 0, 0, 0], [math.log(3.0), 0, 0, 0]]).reshape(1, 1, 2, 4)
    o4, lse4 = attention_fwd(q4, k4, v, return_lse=True)
    assert o4[0, 0, 0, 0] == pytest.approx(7.0, rel=1e-6)
    assert lse4[0, 0, 0] == pytest.approx(math.log(4.0), rel=1e-6)
    with pytest.raises(ValueError):
        attention_fwd(q, k, v, scale=0.0)


def test_causal_top_left_3x5():
    assert_mask(3, 5, MASK_TOP_LEFT, -1, 0, [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
    ])


def test_causal_bottom_right_3x5():
    assert_mask(3, 5, MASK_BOTTOM_RIGHT, -1, 0, [
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1],
    ])


def test_causal_top_left_5x3():
    assert_mask(5, 3, MASK_TOP_LEFT, -1, 0, [
        [1, 0, 0],
        [1, 1, 0],
        [1, 1, 1],
        [1, 1, 1],
        [1, 1, 1],
    ])


def test_causal_bottom_right_5x3_has_fully_masked_rows():
    vis = [
        [0, 0, 0],
        [0, 0, 0],
        [1, 0, 0],
        [1, 1, 0],
        [1, 1, 1],
    ]
    assert_mask(5, 3, MASK_BOTTOM_RIGHT, -1, 0, vis)
    o, lse = uniform_probe(5, 3, MASK_BOTTOM_RIGHT, -1, 0)
    assert np.all(o[:2] == 0.0)
    assert np.all(np.isneginf(lse[:2]))
    assert lse[2] == 0.0  # one visible key: ln 1


def test_no_mask():
    assert_mask(2, 3, MASK_NONE, -1, -1, np.ones((2, 3)))
    # window values are ignored for mask type 0
    assert_mask(2, 3, MASK_NONE, 0, 0, np.ones((2, 3)))


def test_sliding_window_top_left_1_1():
    assert_mask(4, 4, MASK_TOP_LEFT, 1, 1, [
        [1, 1, 0, 0],
        [1, 1, 1, 0],
        [0, 1, 1, 1],
        [0, 0, 1, 1],
    ])


def test_sliding_window_bottom_right_0_0():
    assert_mask(3, 5, MASK_BOTTOM_RIGHT, 0, 0, [
        [0, 0, 1, 0, 0],
        [0, 0, 0, 1, 0],
        [0, 0, 0, 0, 1],
    ])


def test_sliding_window_left_bounded_right_unbounded():
    # t:1,-1 on 3x4: i - 1 <= j, no right bound
    assert_mask(3, 4, MASK_TOP_LEFT, 1, -1, [
        [1, 1, 1, 1],
        [1, 1, 1, 1],
        [0, 1, 1, 1],
    ])


def test_generic_coordinates():
    # g:2,1 -> i - 1 <= j < i + 1
    assert_mask(4, 4, MASK_GENERIC, 2, 1, [
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [0, 1, 1, 0],
        [0, 0, 1, 1],
    ])
    # g:1,3 on 3x5 -> i <= j < min(i + 3, 5)
    assert_mask(3, 5, MASK_GENERIC, 1, 3, [
        [1, 1, 1, 0, 0],
        [0, 1, 1, 1, 0],
        [0, 0, 1, 1, 1],
    ])
    # g:0,1 -> i + 1 <= j < i + 1: nothing is visible
    assert_mask(2, 2, MASK_GENERIC, 0, 1, np.zeros((2, 2)))


def test_fully_masked_rows_give_zero_and_neg_inf():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 3, 4, 8))
    k = rng.standard_normal((2, 3, 6, 8))
    v = rng.standard_normal((2, 3, 6, 8))
    o, lse = attention_fwd(q, k, v, mask_type=MASK_GENERIC, window_left=0, window_right=1, return_lse=True)
    assert np.all(o == 0.0)
    assert np.all(np.isneginf(lse))


def test_zero_keys():
    q = np.ones((2, 2, 3, 8), dtype=np.float16)
    k = np.ones((2, 2, 0, 8), dtype=np.float16)
    v = np.ones((2, 2, 0, 16), dtype=np.float16)
    for mask in ("0", "t", "b", "t:1,1"):
        spec = parse_mask(mask)
        o, lse = attention_fwd(q, k, v, mask_type=spec.mask_type, window_left=spec.left,
                               window_right=spec.right, return_lse=True)
        assert o.shape == (2, 2, 3, 16) and np.all(o == 0.0)
        assert lse.shape == (2, 2, 3) and np.all(np.isneginf(lse))


def test_zero_queries():
    o, lse = attention_fwd(np.zeros((1, 2, 0, 8)), np.ones((1, 2, 3, 8)), np.ones((1, 2, 3, 8)), return_lse=True)
    assert o.shape == (1, 2, 0, 8) and lse.shape == (1, 2, 0)


def test_gqa_head_mapping():
    # 6 query heads on 2 kv heads: heads 0..2 -> kv 0, heads 3..5 -> kv 1. q = 0: uniform weights, so O is the mean
    # of the kv head's values; kv head g holds the constant g + 1.
    b, hq, hk, sq, sk = 1, 6, 2, 3, 4
    q = np.zeros((b, hq, sq, 8))
    k = np.random.default_rng(2).standard_normal((b, hk, sk, 8))
    v = np.stack([np.full((sk, 8), g + 1.0) for g in range(hk)])[None]
    o = attention_fwd(q, k, v)
    for h in range(hq):
        assert np.all(o[0, h] == h // 3 + 1.0), h
    # and equal to running with the kv heads repeated
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, hq, sq, 8))
    v = rng.standard_normal((2, hk, sk, 16))
    k = rng.standard_normal((2, hk, sk, 8))
    o, lse = attention_fwd(q, k, v, mask_type=MASK_BOTTOM_RIGHT, window_right=0, return_lse=True)
    o2, lse2 = attention_fwd(q, np.repeat(k, 3, axis=1), np.repeat(v, 3, axis=1), mask_type=MASK_BOTTOM_RIGHT,
                             window_right=0, return_lse=True)
    np.testing.assert_array_equal(o, o2)
    np.testing.assert_array_equal(lse, lse2)
    with pytest.raises(ValueError):
        attention_fwd(np.zeros((1, 5, 2, 8)), np.zeros((1, 2, 2, 8)), np.zeros((1, 2, 2, 8)))


@pytest.mark.parametrize("mask", ["0", "t", "b", "t:2,1", "b:3,0", "g:3,2", "xt:4", "xb:3"])
@pytest.mark.parametrize("sq,sk", [(7, 7), (5, 9), (9, 5)])
def test_random_against_naive(mask, sq, sk, monkeypatch):
    monkeypatch.setattr(ref, "_BLOCK_ELEMS", 16)  # force several row blocks per head
    spec = parse_mask(mask)
    rng = np.random.default_rng(sq * 100 + sk)
    q = rng.standard_normal((2, 4, sq, 16)).astype(np.float16)
    k = rng.standard_normal((2, 2, sk, 16)).astype(np.float16)
    v = rng.standard_normal((2, 2, sk, 8)).astype(np.float16)
    scale = 0.3
    o, lse = attention_fwd(q, k, v, scale=scale, mask_type=spec.mask_type, window_left=spec.left,
                           window_right=spec.right, return_lse=True)
    vis = visible_mask(spec.mask_type, spec.left, spec.right, sq, sk)
    for b in range(2):
        for h in range(4):
            o_exp, lse_exp = naive_attention(q[b, h], k[b, h // 2], v[b, h // 2], scale, vis)
            assert check_close(o[b, h], o_exp, 1e-5, 1e-5)
            assert check_close(lse[b, h], lse_exp, 1e-5, 1e-5)


def test_float32_compute_matches_float64():
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((1, 2, 33, 32)) for _ in range(3))
    o64 = attention_fwd(q, k, v, mask_type=MASK_TOP_LEFT, window_right=0)
    o32 = attention_fwd(q, k, v, mask_type=MASK_TOP_LEFT, window_right=0, compute_dtype=np.float32)
    assert check_close(o32, o64, 1e-4, 1e-5)


def test_bshd_layout():
    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 4, 6, 8))
    k = rng.standard_normal((2, 2, 5, 8))
    v = rng.standard_normal((2, 2, 5, 8))
    o, lse = attention_fwd(q, k, v, mask_type=MASK_BOTTOM_RIGHT, window_right=0, return_lse=True)
    o2, lse2 = attention_fwd(q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
                             mask_type=MASK_BOTTOM_RIGHT, window_right=0, return_lse=True, layout="bshd")
    np.testing.assert_array_equal(o2, o.transpose(0, 2, 1, 3))
    np.testing.assert_array_equal(lse2, lse)


@pytest.mark.parametrize("mask", ["0", "t", "b", "b:2,0", "g:2,3"])
def test_varlen_equals_per_sequence_batch(mask):
    spec = parse_mask(mask)
    rng = np.random.default_rng(6)
    seqlens_q = [3, 0, 5, 1, 4]
    seqlens_k = [4, 2, 5, 0, 2]
    cu_q = np.concatenate([[0], np.cumsum(seqlens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(seqlens_k)]).astype(np.int32)
    hq, hk, d, dv = 4, 2, 8, 16
    q = rng.standard_normal((cu_q[-1], hq, d)).astype(np.float32)
    k = rng.standard_normal((cu_k[-1], hk, d)).astype(np.float32)
    v = rng.standard_normal((cu_k[-1], hk, dv)).astype(np.float32)
    o, lse = attention_varlen_fwd(q, k, v, cu_q, cu_k, mask_type=spec.mask_type, window_left=spec.left,
                                  window_right=spec.right, return_lse=True)
    assert o.shape == (cu_q[-1], hq, dv) and lse.shape == (hq, cu_q[-1])
    for b in range(len(seqlens_q)):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        ob, lseb = attention_fwd(q[qs].transpose(1, 0, 2)[None], k[ks].transpose(1, 0, 2)[None],
                                 v[ks].transpose(1, 0, 2)[None], mask_type=spec.mask_type, window_left=spec.left,
                                 window_right=spec.right, return_lse=True)
        np.testing.assert_array_equal(o[qs], ob[0].transpose(1, 0, 2))
        np.testing.assert_array_equal(lse[:, qs], lseb[0])
    # sequence 3 has no keys
    assert np.all(o[cu_q[3]:cu_q[4]] == 0) and np.all(np.isneginf(lse[:, cu_q[3]:cu_q[4]]))


def test_varlen_bottom_right_uses_each_sequences_lengths():
    # two sequences (sq, sk) = (1, 3) and (2, 2), causal bottom-right, q = 0 and v = 1-hot of the key index
    cu_q = np.array([0, 1, 3])
    cu_k = np.array([0, 3, 5])
    q = np.zeros((3, 1, 8))
    k = np.ones((5, 1, 8))
    v = np.eye(5)[:, None, :]
    o, lse = attention_varlen_fwd(q, k, v, cu_q, cu_k, mask_type=MASK_BOTTOM_RIGHT, window_right=0,
                                  return_lse=True)
    np.testing.assert_allclose(o[:, 0], [
        [1 / 3, 1 / 3, 1 / 3, 0, 0],   # seq 0 row 0 sees all 3 keys
        [0, 0, 0, 1, 0],               # seq 1 row 0 sees its key 0
        [0, 0, 0, 0.5, 0.5],           # seq 1 row 1 sees keys 0..1
    ], atol=1e-7)
    np.testing.assert_allclose(lse[0], [math.log(3), 0.0, math.log(2)], atol=1e-6)


def test_varlen_rejects_bad_offsets():
    q = np.zeros((4, 1, 8))
    with pytest.raises(ValueError):
        attention_varlen_fwd(q, q, q, [0, 3, 2], [0, 1, 2])
    with pytest.raises(ValueError):
        attention_varlen_fwd(q, q, q, [0, 5], [0, 1])


def test_inputs_of_other_dtypes_give_float32():
    q = np.ones((1, 1, 2, 8), dtype=np.float16)
    o, lse = attention_fwd(q, q, q, return_lse=True)
    assert o.dtype == np.float32 and lse.dtype == np.float32
    np.testing.assert_array_equal(o, np.ones((1, 1, 2, 8), np.float32))


# ---------------------------------------------------------------------------------------------------------------
# mask_coord / parse_mask / check_close / flops
# ---------------------------------------------------------------------------------------------------------------


def test_mask_coord_values():
    assert mask_coord(MASK_NONE, -1, -1, 3, 5) == (3, 5)
    assert mask_coord(MASK_TOP_LEFT, -1, 0, 3, 5) == (3, 1)        # y = 1 + (sq - 1), x = 1
    assert mask_coord(MASK_BOTTOM_RIGHT, -1, 0, 3, 5) == (3, 3)    # y = 1 + (sk-1) + (sq-sk), x = 1 + (sk-sq)
    assert mask_coord(MASK_BOTTOM_RIGHT, -1, 0, 5, 3) == (5, -1)
    assert mask_coord(MASK_TOP_LEFT, 2, 3, 8, 8) == (3, 4)
    assert mask_coord(MASK_TOP_LEFT, 1, -1, 4, 6) == (2, 6)       # right unbounded: sk - 1
    assert mask_coord(MASK_BOTTOM_RIGHT, 1, -1, 4, 6) == (0, 6)   # y = 1 + 1 + (4 - 6); right = sq - 1 -> x = 6
    assert mask_coord(MASK_GENERIC, 7, 9, 3, 5) == (7, 9)
    c = mask_coord(MASK_GENERIC, 7, 9, 3, 5)
    assert (c.y, c.x) == (7, 9)
    with pytest.raises(ValueError):
        mask_coord(4, 0, 0, 1, 1)


@pytest.mark.parametrize("text,expected", [
    ("0", (0, -1, -1)),
    ("1", (1, -1, 0)),
    ("t", (1, -1, 0)),
    ("2", (2, -1, 0)),
    ("b", (2, -1, 0)),
    ("t:-1,0", (1, -1, 0)),
    ("t:3,5", (1, 3, 5)),
    ("b:10,11", (2, 10, 11)),
    ("b:-1,-1", (2, -1, -1)),
    ("g:2,1", (3, 2, 1)),
    ("g:-4,7", (3, -4, 7)),
    ("xt:4", (1, 2, 1)),
    ("xt:5", (1, 2, 2)),
    ("xb:16", (2, 8, 7)),
    ("xb:1", (2, 0, 0)),
    ("xt:-1", (1, -1, 0)),
    ("xt:0", (1, -1, 0)),
    ("xb:-1", (2, -1, 0)),
])
def test_parse_mask(text, expected):
    spec = parse_mask(text)
    assert tuple(spec) == expected
    assert (spec.mask_type, spec.left, spec.right) == expected


@pytest.mark.parametrize("text", ["", "3", "x", "t:", "t:1", "t:1,2,3", "g:1", "xt:", "xt:1,2", "q:1,2", "t:a,b",
                                  "T"])
def test_parse_mask_rejects(text):
    with pytest.raises(ValueError):
        parse_mask(text)


def test_parse_mask_causal_equals_sdpa_style_for_square():
    # top-left and bottom-right causal coincide when sq == sk
    for s in (1, 4, 7):
        np.testing.assert_array_equal(visible_mask(*parse_mask("t"), s, s), visible_mask(*parse_mask("b"), s, s))
        np.testing.assert_array_equal(visible_mask(*parse_mask("t"), s, s), np.tril(np.ones((s, s), bool)))


def test_check_close_rule():
    # atol + rtol * |ref| = 0.25 + 0.125 * 2 = 0.5 (exact in binary)
    assert check_close([2.5], [2.0], rtol=0.125, atol=0.25)
    assert check_close([1.5], [2.0], rtol=0.125, atol=0.25)
    assert not check_close([2.5000001], [2.0], rtol=0.125, atol=0.25)
    assert not check_close([-2.0], [2.0], rtol=0.125, atol=0.25)
    r = check_close([1.0, 2.0, 3.0], [1.0, 2.1, 3.0], rtol=0.0, atol=0.05)
    assert not r and r.num_bad == 1 and r.first_bad == (1,) and r.max_abs_err == pytest.approx(0.1)
    assert r.num_total == 3


def test_check_close_special_values():
    nan, inf = float("nan"), float("inf")
    assert not check_close([nan], [nan], 1e-2, 1e-2)
    assert not check_close([nan], [0.0], 1e-2, 1e-2)
    assert not check_close([0.0], [nan], 1e-2, 1e-2)
    assert check_close([-inf, 1.0], [-inf, 1.0], 1e-2, 1e-2)
    assert check_close([inf], [inf], 1e-2, 1e-2)
    assert not check_close([inf], [-inf], 1e-2, 1e-2)
    assert not check_close([1e30], [inf], 1e-2, 1e-2)
    assert not check_close([-inf], [-1e30], 1e-2, 1e-2)
    r = check_close(np.array([[0.0, -inf], [1.0, 2.0]]), np.array([[0.0, -inf], [1.0, 2.0]]), 0, 0)
    assert r.ok and r.max_abs_err == 0.0 and r.num_bad == 0 and r.first_bad is None
    with pytest.raises(ValueError):
        check_close(np.zeros(3), np.zeros(4), 1e-3, 1e-3)


def test_tolerances():
    assert ref.tolerances("fp16") == (1e-3, 1e-3)
    assert ref.tolerances("bf16") == (1e-2, 1e-2)
    assert ref.tolerances("bfloat16") == (1e-2, 1e-2)


def test_flops():
    assert flops_fwd(1, 1, 2, 3, 4, 4, False) == 96           # 4 * b * h * sq * sk * d
    assert flops_fwd(1, 1, 2, 3, 4, 4, True) == 48
    assert flops_fwd(2, 3, 5, 7, 8, None, False) == 4 * 2 * 3 * 5 * 7 * 8
    assert flops_fwd(1, 1, 2, 3, 4, 8, False) == 2 * 6 * 12   # 2 * b * h * sq * sk * (d + dv)
    # the FA3 benchmark shape: 16384 tokens, hidden 2048, hdim 128, seqlen 4096
    assert flops_fwd(4, 16, 4096, 4096, 128, 128, False) == 4 * 4 * 16 * 4096 * 4096 * 128


def test_package_import_is_light():
    code = ("import sys, mhakit; "
            "assert 'numpy' not in sys.modules and 'torch' not in sys.modules; "
            "assert mhakit.__version__; "
            "r = mhakit.reference; assert r.attention_fwd; "
            "assert 'torch' not in sys.modules; "
            "c = mhakit._capi; assert c.MhakitFwdArgs; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


# ----------------------------------------------------------------------------------------------------------------
# fp8 e4m3 (the fp8 forward's inputs)
# ----------------------------------------------------------------------------------------------------------------

class TestE4m3:
    def test_decode_known_codes(self):
        codes = np.array([0x00, 0x01, 0x07, 0x08, 0x38, 0x7E, 0xFE, 0x80, 0xB8], np.uint8)
        np.testing.assert_array_equal(ref.e4m3_to_float(codes),
                                      [0.0, 2.0 ** -9, 7 * 2.0 ** -9, 2.0 ** -6, 1.0, 448.0, -448.0, -0.0, -1.0])
        assert np.isnan(ref.e4m3_to_float(np.array([0x7F, 0xFF], np.uint8))).all()
        with pytest.raises(TypeError, match="e4m3 codes must be uint8"):
            ref.e4m3_to_float(np.zeros(3, np.int32))

    def test_encode_is_the_exact_inverse_on_every_finite_code(self):
        codes = np.arange(256, dtype=np.uint8)
        values = ref.e4m3_to_float(codes)
        finite = ~np.isnan(values)
        back = ref.float_to_e4m3(values[finite])
        np.testing.assert_array_equal(ref.e4m3_to_float(back), values[finite])

    def test_encode_rounds_to_nearest_even_and_saturates(self):
        x = np.array([1.0625, 1.1875, 17.0, 2.0 ** -10, 1.5 * 2.0 ** -10, 460.0, 1e9, -1e9, np.nan])
        assert [int(c) for c in ref.float_to_e4m3(x)] == [0x38, 0x3A, 0x58, 0x00, 0x01, 0x7E, 0x7E, 0xFE, 0x7F]

    def test_per_tensor_quantization_uses_the_full_range(self):
        x = np.linspace(-3.0, 2.0, 101)
        codes, descale = ref.quantize_e4m3(x)
        assert descale == pytest.approx(3.0 / 448.0)
        assert ref.e4m3_to_float(codes).min() == -448.0
        np.testing.assert_allclose(ref.e4m3_to_float(codes) * descale, x, rtol=2.0 ** -4, atol=1e-6)
        assert ref.quantize_e4m3(np.zeros(4))[1] == 1.0

    def test_fp8_reference_is_the_reference_on_the_decoded_values(self):
        rng = np.random.default_rng(0)
        q8, k8, v8 = (ref.float_to_e4m3(rng.uniform(-2, 2, (1, 2, 9, 16))) for _ in range(3))
        o = ref.attention_fwd_fp8(q8, k8, v8, 0.5, 2.0, 3.0, mask_type=1, window_left=-1, window_right=0)
        want = ref.attention_fwd(ref.e4m3_to_float(q8) * 0.5, ref.e4m3_to_float(k8) * 2.0,
                                      ref.e4m3_to_float(v8) * 3.0, mask_type=1, window_left=-1, window_right=0)
        np.testing.assert_allclose(o, want, rtol=1e-6)
        assert ref.tolerances_fp8(2.0) == (2e-2, 0.125)


_FP8_HARNESS = r"""
// argv: dir b hq hk sq sk d mask left right scale dq dk dv
// writes dir/decode.f32 (the 256 codes), reads dir/x.f32 and writes dir/enc.u8 (float_to_e4m3 of each), reads
// dir/{q,k,v}.u8 (e4m3, [b, h, s, d]) and writes dir/o.f32, dir/lse.f32 (reference_mha_fwd, fp8bf16)
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>
#include "reference/host_attention.hpp"
template <class T> static std::vector<T> rd(const std::string& f) {
    std::vector<T> v; FILE* fp = std::fopen(f.c_str(), "rb"); T x;
    while (fp && std::fread(&x, sizeof(T), 1, fp) == 1) v.push_back(x);
    if (fp) std::fclose(fp);
    return v;
}
template <class T> static void wr(const std::string& f, const std::vector<T>& v) {
    FILE* fp = std::fopen(f.c_str(), "wb"); std::fwrite(v.data(), sizeof(T), v.size(), fp); std::fclose(fp);
}
int main(int argc, char** argv) {
    if (argc != 15) return 2;
    const std::string dir = argv[1];
    const int b = std::atoi(argv[2]), hq = std::atoi(argv[3]), hk = std::atoi(argv[4]), sq = std::atoi(argv[5]);
    const int sk = std::atoi(argv[6]), d = std::atoi(argv[7]), mt = std::atoi(argv[8]), left = std::atoi(argv[9]);
    const int right = std::atoi(argv[10]);
    const float scale = std::strtof(argv[11], nullptr);
    const float dq = std::strtof(argv[12], nullptr), dk = std::strtof(argv[13], nullptr), dv = std::strtof(argv[14], nullptr);
    std::vector<float> dec(256);
    for (int c = 0; c < 256; ++c) dec[size_t(c)] = mhakit::host::e4m3_to_float(uint8_t(c));
    wr(dir + "/decode.f32", dec);
    std::vector<uint8_t> enc;
    for (float x : rd<float>(dir + "/x.f32")) enc.push_back(mhakit::host::float_to_e4m3(x));
    wr(dir + "/enc.u8", enc);
    const auto q = rd<uint8_t>(dir + "/q.u8"), k = rd<uint8_t>(dir + "/k.u8"), v = rd<uint8_t>(dir + "/v.u8");
    mhakit_fwd_args a{};
    a.data_type = MHAKIT_DTYPE_FP8_BF16; a.batch = b; a.nhead_q = hq; a.nhead_k = hk; a.seqlen_q = sq; a.seqlen_k = sk;
    a.max_seqlen_q = sq; a.hdim_q = d; a.hdim_v = d; a.scale_s = scale; a.mask_type = mt;
    a.window_size_left = left; a.window_size_right = right;
    a.stride_q = a.stride_k = a.stride_v = a.stride_o = d;
    a.nhead_stride_q = a.nhead_stride_o = int64_t(sq) * d; a.nhead_stride_k = a.nhead_stride_v = int64_t(sk) * d;
    a.batch_stride_q = a.batch_stride_o = int64_t(hq) * sq * d; a.batch_stride_k = a.batch_stride_v = int64_t(hk) * sk * d;
    a.nhead_stride_lse = sq; a.batch_stride_lse = int64_t(hq) * sq;
    a.q_ptr = q.data(); a.k_ptr = k.data(); a.v_ptr = v.data();
    a.q_descale_ptr = &dq; a.k_descale_ptr = &dk; a.v_descale_ptr = &dv;
    std::vector<float> o(size_t(b) * hq * sq * d), lse(size_t(b) * hq * sq);
    mhakit::host::reference_mha_fwd(a, o.data(), lse.data());
    wr(dir + "/o.f32", o); wr(dir + "/lse.f32", lse);
    return 0;
}
"""


def test_cpp_host_fp8_codec_and_reference_match_numpy(tmp_path):
    """The benchmark's host side (csrc/reference/host_attention.hpp): the same e4m3 decode and encode as NumPy's, and
    an fp8 forward reference equal to attention_fwd_fp8."""
    exe = build_cpp(tmp_path, "h", _FP8_HARNESS, "-Wall", "-Wextra", "-pthread")
    rng = np.random.default_rng(5)
    x = np.concatenate([rng.uniform(-500, 500, 2000), rng.uniform(-0.02, 0.02, 2000),
                        ref.e4m3_to_float(np.arange(256, dtype=np.uint8))[np.arange(256) % 128 != 127],
                        [1.0625, 1.1875, 17.0, 2.0 ** -10, 460.0, -1e9]]).astype(np.float32)
    x.tofile(tmp_path / "x.f32")
    b, hq, hk, sq, sk, d = 2, 4, 2, 9, 13, 16
    q8 = ref.float_to_e4m3(rng.uniform(-3, 3, (b, hq, sq, d)))
    k8 = ref.float_to_e4m3(rng.uniform(-3, 3, (b, hk, sk, d)))
    v8 = ref.float_to_e4m3(rng.uniform(-3, 3, (b, hk, sk, d)))
    for name, t in (("q", q8), ("k", k8), ("v", v8)):
        t.tofile(tmp_path / f"{name}.u8")
    subprocess.run([str(exe), str(tmp_path), str(b), str(hq), str(hk), str(sq), str(sk), str(d), "2", "-1", "0",
                    "0.3", "0.5", "1.5", "2.0"], check=True)
    dec = np.fromfile(tmp_path / "decode.f32", np.float32)
    np.testing.assert_array_equal(dec, ref.e4m3_to_float(np.arange(256, dtype=np.uint8)))
    np.testing.assert_array_equal(np.fromfile(tmp_path / "enc.u8", np.uint8), ref.float_to_e4m3(x))
    o, lse = ref.attention_fwd_fp8(q8, k8, v8, 0.5, 1.5, 2.0, scale=0.3, mask_type=2, window_left=-1,
                                   window_right=0, return_lse=True)
    np.testing.assert_allclose(np.fromfile(tmp_path / "o.f32", np.float32).reshape(o.shape), o, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.fromfile(tmp_path / "lse.f32", np.float32).reshape(lse.shape), lse, rtol=1e-5)
