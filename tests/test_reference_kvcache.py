"""mhakit.reference.attention_fwd_kvcache (the decode reference) against the batch-mode reference: paged and
contiguous caches, appended rows, cache_batch_idx and the bottom-right causal mask all mean what
flash_attn_with_kvcache means."""
from __future__ import annotations

import numpy as np
import pytest

from mhakit import reference as ref


def rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def test_full_caches_match_batch_mode_attention():
    rng = np.random.default_rng(0)
    q, kc, vc = rand(rng, 2, 3, 8, 16), rand(rng, 2, 40, 2, 16), rand(rng, 2, 40, 2, 24)
    o, lse, kc2, vc2 = ref.attention_fwd_kvcache(q, kc, vc, [40, 40], mask_type=2, window_right=0, return_lse=True)
    o_ref, lse_ref = ref.attention_fwd(q, kc, vc, mask_type=2, window_right=0, layout="bshd", return_lse=True)
    np.testing.assert_allclose(o, o_ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-6, atol=1e-6)
    assert np.array_equal(kc2, kc) and np.array_equal(vc2, vc)


def test_ragged_lengths_see_only_their_rows_and_empty_caches_give_zero():
    rng = np.random.default_rng(1)
    q, kc, vc = rand(rng, 3, 2, 4, 8), rand(rng, 3, 30, 4, 8), rand(rng, 3, 30, 4, 8)
    o, lse, _, _ = ref.attention_fwd_kvcache(q, kc, vc, [30, 7, 0], return_lse=True)
    o1 = ref.attention_fwd(q[1:2], kc[1:2, :7], vc[1:2, :7], layout="bshd")
    np.testing.assert_allclose(o[1:2], o1, rtol=1e-6, atol=1e-6)
    assert np.all(o[2] == 0) and np.all(lse[2] == -np.inf)


def test_bottom_right_causal_counts_from_the_end_of_the_cache():
    rng = np.random.default_rng(2)
    q, kc, vc = rand(rng, 1, 3, 1, 8), rand(rng, 1, 10, 1, 8), rand(rng, 1, 10, 1, 8)
    o = ref.attention_fwd_kvcache(q, kc, vc, [6], mask_type=2, window_right=0)[0]
    for i in range(3):  # query row i sees keys 0 .. 6 - 3 + i
        expect = ref.attention_fwd(q[:, i:i + 1], kc[:, :4 + i], vc[:, :4 + i], layout="bshd")
        np.testing.assert_allclose(o[:, i:i + 1], expect, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("page", [1, 3, 16])
def test_paged_caches_and_appended_rows_match_the_contiguous_cache(page):
    rng = np.random.default_rng(page)
    b, hk, d, s_new = 2, 2, 8, 2
    lens = np.array([9, 4])
    q = rand(rng, b, 2, 4, d)
    kn, vn = rand(rng, b, s_new, hk, d), rand(rng, b, s_new, hk, d)
    cap = 16
    kc, vc = rand(rng, b, cap, hk, d), rand(rng, b, cap, hk, d)
    o_c, k_c, v_c = ref.attention_fwd_kvcache(q, kc, vc, lens, k=kn, v=vn, mask_type=2, window_right=0)
    # the same rows in shuffled pages
    blocks = -(-cap // page)
    perm = rng.permutation(b * blocks)
    table = perm.reshape(b, blocks)
    kp = np.zeros((b * blocks, page, hk, d), np.float32)
    vp = np.zeros_like(kp)
    for i in range(b):
        for j in range(cap):
            kp[table[i, j // page], j % page] = kc[i, j]
            vp[table[i, j // page], j % page] = vc[i, j]
    o_p, k_p, _ = ref.attention_fwd_kvcache(q, kp, vp, lens, block_table=table, k=kn, v=vn, mask_type=2,
                                            window_right=0)
    np.testing.assert_allclose(o_p, o_c, rtol=1e-6, atol=1e-6)
    for i in range(b):
        for t in range(s_new):
            j = lens[i] + t
            assert np.array_equal(k_c[i, j], kn[i, t]) and np.array_equal(k_p[table[i, j // page], j % page], kn[i, t])


def test_cache_batch_idx_reads_other_cache_batches():
    rng = np.random.default_rng(5)
    q, kc, vc = rand(rng, 2, 1, 2, 8), rand(rng, 3, 12, 1, 8), rand(rng, 3, 12, 1, 8)
    o = ref.attention_fwd_kvcache(q, kc, vc, [12, 5], cache_batch_idx=[2, 0])[0]
    np.testing.assert_allclose(o[0:1], ref.attention_fwd(q[0:1], kc[2:3], vc[2:3], layout="bshd"), rtol=1e-6,
                               atol=1e-6)
    np.testing.assert_allclose(o[1:2], ref.attention_fwd(q[1:2], kc[0:1, :5], vc[0:1, :5], layout="bshd"),
                               rtol=1e-6, atol=1e-6)
