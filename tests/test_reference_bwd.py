"""CPU tests of the NumPy backward reference (mhakit.reference.attention_bwd / attention_varlen_bwd): hand-computed
cases, structural identities (GQA sums, layouts, group mode = per-sequence batch), and central finite differences of
the float64 forward (attention_fwd / attention_varlen_fwd) on small random problems incl. masks, GQA and group
mode."""

import math
import subprocess

import numpy as np
import pytest

from host_check import build_cpp
from mhakit.reference import (MASK_BOTTOM_RIGHT, MASK_GENERIC, MASK_NONE, MASK_TOP_LEFT, attention_bwd,
                              attention_fwd, attention_varlen_bwd, attention_varlen_fwd, check_close, flops_bwd,
                              flops_fwd, tolerances_bwd, visible_mask)

F64 = dict(compute_dtype=np.float64, out_dtype=np.float64)


def rand(rng, *shape):
    return rng.uniform(-1.0, 1.0, size=shape)


# ---------------------------------------------------------------------------------------------------------------
# hand-computed cases
# ---------------------------------------------------------------------------------------------------------------


def test_two_keys_known_gradients():
    # scores 0 and ln 3 -> P = [1/4, 3/4]; v = [1, 3] -> O = 2.5; dO = 2 -> dP = [2, 6], D = 5,
    # dS = [1/4 (2 - 5), 3/4 (6 - 5)] = [-3/4, 3/4]; dQ = dS K = 3/4 [ln 3, 0]; dK = dS^T q; dV = P^T dO = [1/2, 3/2]
    q = np.array([1.0, 0.0]).reshape(1, 1, 1, 2)
    k = np.array([[0.0, 0.0], [math.log(3.0), 0.0]]).reshape(1, 1, 2, 2)
    v = np.array([[1.0], [3.0]]).reshape(1, 1, 2, 1)
    do = np.array([2.0]).reshape(1, 1, 1, 1)
    dq, dk, dv = attention_bwd(q, k, v, do, scale=1.0, **F64)
    np.testing.assert_allclose(dq[0, 0, 0], [0.75 * math.log(3.0), 0.0], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dk[0, 0], [[-0.75, 0.0], [0.75, 0.0]], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dv[0, 0], [[0.5], [1.5]], rtol=1e-12, atol=1e-12)
    # the scale multiplies dQ and dK (with the scores scaled too: q = 2 [1, 0] and scale 1/2 give the same P)
    dq2, dk2, dv2 = attention_bwd(2.0 * q, k, v, do, scale=0.5, **F64)
    np.testing.assert_allclose(dq2, 0.5 * dq, rtol=1e-12)
    np.testing.assert_allclose(dk2, 2.0 * 0.5 * dk, rtol=1e-12)
    np.testing.assert_allclose(dv2, dv, rtol=1e-12)
    assert dq.dtype == np.float64
    assert attention_bwd(q, k, v, do, scale=1.0)[0].dtype == np.float32  # default output type


def test_single_visible_key_gives_zero_dq_dk():
    # one key per row: P = 1, O = v, D = dO . v = dP -> dS = 0, so dQ = dK = 0 and dV = sum of dO over the rows
    rng = np.random.default_rng(1)
    q, k = rand(rng, 1, 1, 3, 8), rand(rng, 1, 1, 1, 8)
    v, do = rand(rng, 1, 1, 1, 4), rand(rng, 1, 1, 3, 4)
    dq, dk, dv = attention_bwd(q, k, v, do, **F64)
    np.testing.assert_allclose(dq, 0.0, atol=1e-15)
    np.testing.assert_allclose(dk, 0.0, atol=1e-15)
    np.testing.assert_allclose(dv[0, 0, 0], do[0, 0].sum(axis=0), rtol=1e-12)


def test_uniform_attention_dv_and_dq():
    # q = 0: P is uniform over the visible keys, so dV_j = sum_i vis_ij / count_i * dO_i; and with dO = const,
    # dP - D = dO . (v_j - mean v) averages to zero over a row
    sq, sk = 4, 6
    vis = visible_mask(MASK_BOTTOM_RIGHT, -1, 0, sq, sk)
    rng = np.random.default_rng(2)
    q = np.zeros((1, 1, sq, 8))
    k, v, do = rand(rng, 1, 1, sk, 8), rand(rng, 1, 1, sk, 5), rand(rng, 1, 1, sq, 5)
    dq, dk, dv = attention_bwd(q, k, v, do, mask_type=MASK_BOTTOM_RIGHT, window_left=-1, window_right=0, **F64)
    p = vis / vis.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(dv[0, 0], p.T @ do[0, 0], rtol=1e-12, atol=1e-14)
    o = p @ v[0, 0]
    ds = p * (do[0, 0] @ v[0, 0].T - (do[0, 0] * o).sum(axis=1, keepdims=True))
    np.testing.assert_allclose(dq[0, 0], ds @ k[0, 0] / math.sqrt(8), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(dk[0, 0], 0.0, atol=1e-15)  # dK = scale dS^T q = 0 for q = 0


def test_fully_masked_rows_and_unseen_keys():
    # bottom-right causal 5x3: rows 0 and 1 see nothing (dQ = 0); top-left window t:0,0 with s_k > s_q leaves the
    # last keys unseen (dK = dV = 0)
    rng = np.random.default_rng(3)
    q, k, v, do = rand(rng, 1, 2, 5, 8), rand(rng, 1, 2, 3, 8), rand(rng, 1, 2, 3, 8), rand(rng, 1, 2, 5, 8)
    dq, dk, dv = attention_bwd(q, k, v, do, mask_type=MASK_BOTTOM_RIGHT, window_left=-1, window_right=0)
    np.testing.assert_array_equal(dq[:, :, :2], 0.0)
    assert np.abs(dq[:, :, 2:]).max() > 0
    q2, do2 = rand(rng, 1, 1, 3, 8), rand(rng, 1, 1, 3, 8)
    k2, v2 = rand(rng, 1, 1, 7, 8), rand(rng, 1, 1, 7, 8)
    dq2, dk2, dv2 = attention_bwd(q2, k2, v2, do2, mask_type=MASK_TOP_LEFT, window_left=0, window_right=0)
    np.testing.assert_array_equal(dk2[:, :, 3:], 0.0)
    np.testing.assert_array_equal(dv2[:, :, 3:], 0.0)
    np.testing.assert_allclose(dq2, 0.0, atol=1e-6)  # one visible key per row: dS = 0 up to rounding
    np.testing.assert_allclose(dv2[0, 0, :3], do2[0, 0], rtol=1e-6)


def test_empty_sequences():
    rng = np.random.default_rng(4)
    # s_k = 0: dQ = 0, dK / dV empty
    dq, dk, dv = attention_bwd(rand(rng, 2, 2, 5, 8), np.zeros((2, 1, 0, 8)), np.zeros((2, 1, 0, 16)),
                               rand(rng, 2, 2, 5, 16))
    assert dq.shape == (2, 2, 5, 8) and dk.shape == (2, 1, 0, 8) and dv.shape == (2, 1, 0, 16)
    np.testing.assert_array_equal(dq, 0.0)
    # s_q = 0: dK = dV = 0
    dq, dk, dv = attention_bwd(np.zeros((1, 2, 0, 8)), rand(rng, 1, 2, 4, 8), rand(rng, 1, 2, 4, 8),
                               np.zeros((1, 2, 0, 8)))
    assert dq.shape == (1, 2, 0, 8)
    np.testing.assert_array_equal(dk, 0.0)
    np.testing.assert_array_equal(dv, 0.0)


def test_d_from_given_o():
    # D = rowsum(dO * O) with the O handed in: only dS (hence dQ, dK) depends on it, dV does not
    rng = np.random.default_rng(5)
    q, k, v, do = rand(rng, 1, 2, 6, 8), rand(rng, 1, 2, 9, 8), rand(rng, 1, 2, 9, 8), rand(rng, 1, 2, 6, 8)
    o = attention_fwd(q, k, v, **F64)
    base = attention_bwd(q, k, v, do, **F64)
    same = attention_bwd(q, k, v, do, o=o, **F64)
    for a, b in zip(base, same):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
    off = attention_bwd(q, k, v, do, o=o + 0.1, **F64)
    np.testing.assert_allclose(off[2], base[2], rtol=1e-12, atol=1e-14)
    assert np.abs(off[0] - base[0]).max() > 1e-3
    # dS changes by -P * 0.1 * rowsum(dO): dQ changes by -scale * 0.1 * rowsum(dO) * (P K) = -scale * 0.1 * sum(dO) * O_K
    s = np.einsum("hid,hjd->hij", q[0], k[0]) / math.sqrt(8)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    expect = -0.1 * do[0].sum(axis=-1)[..., None] * (p @ k[0]) / math.sqrt(8)
    np.testing.assert_allclose(off[0][0] - base[0][0], expect, rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError):
        attention_bwd(q, k, v, do, o=o[:, :, :3])


def test_argument_errors():
    z = np.zeros((1, 2, 4, 8))
    with pytest.raises(ValueError):
        attention_bwd(z, z[:, :1], z[:, :1], z[..., :4])  # do must have d_v = 8
    with pytest.raises(ValueError):
        attention_bwd(z, np.zeros((1, 3, 4, 8)), np.zeros((1, 3, 4, 8)), z)  # 2 % 3 != 0
    with pytest.raises(ValueError):
        attention_bwd(z, z, z, z, scale=-1.0)
    with pytest.raises(ValueError):
        attention_bwd(z, z, z, z, layout="sbhd")
    with pytest.raises(ValueError):
        attention_bwd(z, z, z, z, compute_dtype=np.float16)
    with pytest.raises(ValueError):
        attention_varlen_bwd(z[0], z[0], z[0], z[0], [0, 4], [0, 2, 4])


# ---------------------------------------------------------------------------------------------------------------
# structural identities
# ---------------------------------------------------------------------------------------------------------------


def test_gqa_sums_over_query_heads():
    rng = np.random.default_rng(6)
    b, hq, hk, sq, sk, d, dv = 2, 6, 2, 7, 9, 8, 16
    q, k, v, do = rand(rng, b, hq, sq, d), rand(rng, b, hk, sk, d), rand(rng, b, hk, sk, dv), rand(rng, b, hq, sq, dv)
    g = hq // hk
    kw = dict(mask_type=MASK_TOP_LEFT, window_left=3, window_right=1, **F64)
    dq, dk, dv_ = attention_bwd(q, k, v, do, **kw)
    # the same problem with K / V repeated per query head (MHA), then dK / dV summed per group
    dq_r, dk_r, dv_r = attention_bwd(q, np.repeat(k, g, axis=1), np.repeat(v, g, axis=1), do, **kw)
    np.testing.assert_allclose(dq, dq_r, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(dk, dk_r.reshape(b, hk, g, sk, d).sum(axis=2), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(dv_, dv_r.reshape(b, hk, g, sk, dv).sum(axis=2), rtol=1e-12, atol=1e-14)


def test_bshd_layout_is_a_transpose():
    rng = np.random.default_rng(7)
    q, k, v, do = rand(rng, 2, 4, 5, 8), rand(rng, 2, 2, 6, 8), rand(rng, 2, 2, 6, 8), rand(rng, 2, 4, 5, 8)
    kw = dict(mask_type=MASK_BOTTOM_RIGHT, window_left=-1, window_right=0)
    ref = attention_bwd(q, k, v, do, **kw)
    t = [a.transpose(0, 2, 1, 3) for a in (q, k, v, do)]
    got = attention_bwd(*t, layout="bshd", **kw)
    for a, b in zip(ref, got):
        np.testing.assert_allclose(b.transpose(0, 2, 1, 3), a, rtol=1e-6, atol=1e-7)


def test_group_mode_equals_per_sequence_batch():
    rng = np.random.default_rng(8)
    hq, hk, d, dv = 4, 2, 8, 16
    lq, lk = [5, 0, 9, 3], [7, 4, 2, 0]
    cq, ck = np.concatenate([[0], np.cumsum(lq)]), np.concatenate([[0], np.cumsum(lk)])
    q, k, v = rand(rng, cq[-1], hq, d), rand(rng, ck[-1], hk, d), rand(rng, ck[-1], hk, dv)
    do = rand(rng, cq[-1], hq, dv)
    for mt, l, r in ((MASK_NONE, -1, -1), (MASK_BOTTOM_RIGHT, -1, 0), (MASK_TOP_LEFT, 2, 1), (MASK_GENERIC, 3, 2)):
        dq, dk, dvv = attention_varlen_bwd(q, k, v, do, cq, ck, mask_type=mt, window_left=l, window_right=r, **F64)
        for i in range(len(lq)):
            sl_q, sl_k = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
            e = attention_bwd(q[None, sl_q], k[None, sl_k], v[None, sl_k], do[None, sl_q], layout="bshd",
                              mask_type=mt, window_left=l, window_right=r, **F64)
            np.testing.assert_allclose(dq[sl_q], e[0][0], rtol=1e-12, atol=1e-14)
            np.testing.assert_allclose(dk[sl_k], e[1][0], rtol=1e-12, atol=1e-14)
            np.testing.assert_allclose(dvv[sl_k], e[2][0], rtol=1e-12, atol=1e-14)


def test_float32_accumulation_close_to_float64():
    rng = np.random.default_rng(9)
    q, k, v, do = rand(rng, 1, 2, 40, 32), rand(rng, 1, 1, 50, 32), rand(rng, 1, 1, 50, 32), rand(rng, 1, 2, 40, 32)
    a = attention_bwd(q, k, v, do, mask_type=MASK_TOP_LEFT, window_left=-1, window_right=0, compute_dtype=np.float32)
    b = attention_bwd(q, k, v, do, mask_type=MASK_TOP_LEFT, window_left=-1, window_right=0)
    for x, y in zip(a, b):
        assert check_close(x, y, 1e-4, 1e-5)


def test_long_rows_are_blocked(monkeypatch):
    # a row block smaller than the problem gives the same result as one block
    from mhakit import reference
    rng = np.random.default_rng(10)
    q, k, v, do = rand(rng, 1, 2, 37, 8), rand(rng, 1, 1, 23, 8), rand(rng, 1, 1, 23, 8), rand(rng, 1, 2, 37, 8)
    one = attention_bwd(q, k, v, do, mask_type=MASK_BOTTOM_RIGHT, window_left=5, window_right=2, **F64)
    monkeypatch.setattr(reference, "_BLOCK_ELEMS", 23 * 4)
    many = attention_bwd(q, k, v, do, mask_type=MASK_BOTTOM_RIGHT, window_left=5, window_right=2, **F64)
    for x, y in zip(one, many):
        np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------------------------------------------------------
# finite differences of the float64 forward
# ---------------------------------------------------------------------------------------------------------------


def numeric_grad(f, x, eps=1e-6):
    """Central differences of the scalar f() with respect to every element of x (modified in place, restored)."""
    g = np.zeros_like(x)
    it = np.nditer(x, flags=["multi_index"])
    for _ in it:
        idx = it.multi_index
        old = x[idx]
        x[idx] = old + eps
        fp = f()
        x[idx] = old - eps
        fm = f()
        x[idx] = old
        g[idx] = (fp - fm) / (2 * eps)
    return g


FD_CASES = [
    # b, hq, hk, sq, sk, d, dv, mask_type, left, right
    (1, 2, 2, 4, 5, 4, 3, MASK_NONE, -1, -1),
    (2, 4, 2, 5, 3, 4, 4, MASK_TOP_LEFT, -1, 0),
    (1, 3, 1, 6, 4, 4, 2, MASK_BOTTOM_RIGHT, -1, 0),  # MQA; rows 0, 1 fully masked
    (1, 2, 1, 5, 7, 3, 4, MASK_TOP_LEFT, 1, 2),       # sliding window
    (1, 2, 2, 4, 6, 4, 4, MASK_GENERIC, 2, 3),
]


@pytest.mark.parametrize("case", FD_CASES, ids=[f"b{c[0]}h{c[1]}k{c[2]}s{c[3]}x{c[4]}m{c[7]}" for c in FD_CASES])
def test_finite_differences_batch(case):
    b, hq, hk, sq, sk, d, dv, mt, left, right = case
    rng = np.random.default_rng(hash(case) % (1 << 32))
    q, k, v, do = rand(rng, b, hq, sq, d), rand(rng, b, hk, sk, d), rand(rng, b, hk, sk, dv), rand(rng, b, hq, sq, dv)
    kw = dict(scale=0.7, mask_type=mt, window_left=left, window_right=right)

    def loss():
        return float((attention_fwd(q, k, v, **kw, **F64) * do).sum())

    dq, dk, dv_ = attention_bwd(q, k, v, do, **kw, **F64)
    for name, x, g in (("dq", q, dq), ("dk", k, dk), ("dv", v, dv_)):
        num = numeric_grad(loss, x)
        np.testing.assert_allclose(g, num, rtol=1e-6, atol=1e-8, err_msg=name)


def test_finite_differences_group_mode_gqa():
    rng = np.random.default_rng(11)
    hq, hk, d, dv = 4, 2, 3, 4
    lq, lk = [3, 0, 4], [5, 2, 3]
    cq, ck = np.concatenate([[0], np.cumsum(lq)]), np.concatenate([[0], np.cumsum(lk)])
    q, k, v = rand(rng, cq[-1], hq, d), rand(rng, ck[-1], hk, d), rand(rng, ck[-1], hk, dv)
    do = rand(rng, cq[-1], hq, dv)
    kw = dict(scale=0.9, mask_type=MASK_BOTTOM_RIGHT, window_left=2, window_right=0)

    def loss():
        return float((attention_varlen_fwd(q, k, v, cq, ck, **kw, **F64) * do).sum())

    grads = attention_varlen_bwd(q, k, v, do, cq, ck, **kw, **F64)
    for name, x, g in zip(("dq", "dk", "dv"), (q, k, v), grads):
        np.testing.assert_allclose(g, numeric_grad(loss, x), rtol=1e-6, atol=1e-8, err_msg=name)


# ---------------------------------------------------------------------------------------------------------------
# tolerances and FLOPs
# ---------------------------------------------------------------------------------------------------------------


def test_tolerances_bwd():
    assert tolerances_bwd("fp16", 256, 256) == (1e-2, 1e-2)
    assert tolerances_bwd("bf16", 128, 128) == (1e-2, 1e-2)
    assert tolerances_bwd("bf16", 256, 128) == (1e-2, 1e-2)
    assert tolerances_bwd("bfloat16", 256, 256) == (3.2e-2, 3.2e-2)
    with pytest.raises(ValueError):
        tolerances_bwd("int8")


def test_flops_bwd():
    assert flops_bwd(2, 8, 100, 200, 128) == 2.5 * flops_fwd(2, 8, 100, 200, 128) == 10 * 2 * 8 * 100 * 200 * 128
    assert flops_bwd(1, 1, 10, 10, 64, 32, causal=True) == 2.5 * 2 * 10 * 10 * 96 / 2


# ---------------------------------------------------------------------------------------------------------------
# the C++ host reference (csrc/reference/host_attention_bwd.hpp) agrees with this one
# ---------------------------------------------------------------------------------------------------------------

_HARNESS = r"""
// argv: mode b hq hk d dv mask left right scale d_from_o dir seqlens_q... seqlens_k...
// reads dir/{q,k,v,do,o}.bin (fp16 bits; batch: [b,h,s,d]; group: [total,h,d]); writes dir/{dq,dk,dv}.f32
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>
#include "reference/host_attention_bwd.hpp"
static std::vector<uint16_t> rd(const std::string& f, size_t n) {
    std::vector<uint16_t> v(n); FILE* fp = std::fopen(f.c_str(), "rb");
    if (!fp || std::fread(v.data(), 2, n, fp) != n) { std::fprintf(stderr, "read %s\n", f.c_str()); std::exit(1); }
    std::fclose(fp); return v;
}
static void wr(const std::string& f, const std::vector<float>& v) {
    FILE* fp = std::fopen(f.c_str(), "wb"); std::fwrite(v.data(), 4, v.size(), fp); std::fclose(fp);
}
int main(int argc, char** argv) {
    if (argc < 13) { std::fprintf(stderr, "usage: harness mode b hq hk d dv mask left right scale d_from_o dir ...\n"); return 2; }
    int i = 1;
    const int mode = std::atoi(argv[i++]), b = std::atoi(argv[i++]), hq = std::atoi(argv[i++]), hk = std::atoi(argv[i++]);
    const int d = std::atoi(argv[i++]), dv = std::atoi(argv[i++]), mt = std::atoi(argv[i++]);
    const int left = std::atoi(argv[i++]), right = std::atoi(argv[i++]);
    const float scale = std::strtof(argv[i++], nullptr);
    const int d_from_o = std::atoi(argv[i++]);
    const std::string dir = argv[i++];
    std::vector<int32_t> sq(1, 0), sk(1, 0);
    for (int j = 0; j < b; ++j) sq.push_back(sq.back() + std::atoi(argv[i++]));
    for (int j = 0; j < b; ++j) sk.push_back(sk.back() + std::atoi(argv[i++]));
    mhakit_bwd_args a{};
    a.data_type = MHAKIT_DTYPE_FP16; a.is_group_mode = mode; a.batch = b; a.nhead_q = hq; a.nhead_k = hk;
    a.hdim_q = d; a.hdim_v = dv; a.scale = scale; a.mask_type = mt; a.window_size_left = left; a.window_size_right = right;
    const int64_t TQ = mode ? sq.back() : sq[1], TK = mode ? sk.back() : sk[1], B = mode ? 1 : b;
    a.seqlen_q = int(TQ); a.seqlen_k = int(TK);
    auto set = [&](int64_t T, int h, int dim, int64_t* rs, int64_t* hs, int64_t* bs) {
        if (mode) { *rs = int64_t(h) * dim; *hs = dim; *bs = 0; } else { *rs = dim; *hs = T * dim; *bs = h * T * dim; }
    };
    set(TQ, hq, d, &a.stride_q, &a.nhead_stride_q, &a.batch_stride_q);
    set(TQ, hq, d, &a.stride_dq, &a.nhead_stride_dq, &a.batch_stride_dq);
    set(TK, hk, d, &a.stride_k, &a.nhead_stride_k, &a.batch_stride_k);
    set(TK, hk, d, &a.stride_dk, &a.nhead_stride_dk, &a.batch_stride_dk);
    set(TK, hk, dv, &a.stride_v, &a.nhead_stride_v, &a.batch_stride_v);
    set(TK, hk, dv, &a.stride_dv, &a.nhead_stride_dv, &a.batch_stride_dv);
    set(TQ, hq, dv, &a.stride_o, &a.nhead_stride_o, &a.batch_stride_o);
    set(TQ, hq, dv, &a.stride_do, &a.nhead_stride_do, &a.batch_stride_do);
    a.nhead_stride_lse = TQ; a.batch_stride_lse = hq * TQ;
    const auto q = rd(dir + "/q.bin", size_t(B * hq * TQ * d)), k = rd(dir + "/k.bin", size_t(B * hk * TK * d));
    const auto v = rd(dir + "/v.bin", size_t(B * hk * TK * dv)), o = rd(dir + "/o.bin", size_t(B * hq * TQ * dv));
    const auto dO = rd(dir + "/do.bin", size_t(B * hq * TQ * dv));
    a.q_ptr = q.data(); a.k_ptr = k.data(); a.v_ptr = v.data(); a.o_ptr = o.data(); a.do_ptr = dO.data();
    a.seqstart_q_ptr = mode ? sq.data() : nullptr; a.seqstart_k_ptr = mode ? sk.data() : nullptr;
    std::vector<float> dq(q.size(), 7.f), dk(k.size(), 7.f), dvv(v.size(), 7.f);
    mhakit::host::BwdRefOptions opt; opt.d_from_o = d_from_o != 0; opt.max_block_elems = 64;  // force chunking
    mhakit::host::reference_mha_bwd(a, dq.data(), dk.data(), dvv.data(), nullptr, nullptr, opt);
    wr(dir + "/dq.f32", dq); wr(dir + "/dk.f32", dk); wr(dir + "/dv.f32", dvv);
    return 0;
}
"""

CPP_CASES = [
    # mode, b, hq, hk, d, dv, (mask_type, left, right), seqlens_q, seqlens_k, d_from_o
    (0, 2, 4, 2, 16, 8, (MASK_NONE, -1, -1), [9, 9], [13, 13], False),
    (0, 1, 3, 1, 8, 16, (MASK_BOTTOM_RIGHT, -1, 0), [11], [6], True),
    (1, 3, 2, 1, 16, 16, (MASK_TOP_LEFT, 3, 1), [5, 0, 12], [7, 3, 0], False),
    (1, 2, 4, 4, 8, 8, (MASK_GENERIC, 4, 2), [10, 6], [8, 9], True),
]


@pytest.fixture(scope="module")
def cpp_harness(tmp_path_factory):
    return build_cpp(tmp_path_factory.mktemp("host_bwd"), "harness", _HARNESS, "-Wall", "-Wextra", "-pthread")


@pytest.mark.parametrize("case", CPP_CASES, ids=[f"case{i}" for i in range(len(CPP_CASES))])
def test_cpp_host_reference_matches_numpy(cpp_harness, tmp_path, case):
    mode, b, hq, hk, d, dv, (mt, left, right), lq, lk, d_from_o = case
    rng = np.random.default_rng(100 + len(lq) + d)
    if mode:
        tq, tk = sum(lq), sum(lk)
        shapes = dict(q=(tq, hq, d), k=(tk, hk, d), v=(tk, hk, dv), do=(tq, hq, dv))
    else:
        shapes = dict(q=(b, hq, lq[0], d), k=(b, hk, lk[0], d), v=(b, hk, lk[0], dv), do=(b, hq, lq[0], dv))
    t = {n: rng.uniform(-1, 1, size=sh).astype(np.float16) for n, sh in shapes.items()}
    t["o"] = (t["do"].astype(np.float32) * 0.5 + 0.1).astype(np.float16)  # an arbitrary "device" O for D
    for n in ("q", "k", "v", "do", "o"):
        t[n].tofile(tmp_path / f"{n}.bin")
    scale = 0.37
    subprocess.run([str(cpp_harness), str(mode), str(b), str(hq), str(hk), str(d), str(dv), str(mt), str(left),
                    str(right), repr(scale), str(int(d_from_o)), str(tmp_path), *map(str, lq), *map(str, lk)],
                   check=True)
    got = [np.fromfile(tmp_path / f"{n}.f32", dtype=np.float32).reshape(shapes[s])
           for n, s in (("dq", "q"), ("dk", "k"), ("dv", "v"))]
    kw = dict(scale=scale, mask_type=mt, window_left=left, window_right=right, o=t["o"] if d_from_o else None)
    if mode:
        cq, ck = np.concatenate([[0], np.cumsum(lq)]), np.concatenate([[0], np.cumsum(lk)])
        want = attention_varlen_bwd(t["q"], t["k"], t["v"], t["do"], cq, ck, **kw)
    else:
        want = attention_bwd(t["q"], t["k"], t["v"], t["do"], **kw)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, err_msg=name)
