"""Argument validation of mhakit_mha_fwd_splitkv through the C ABI of a real libmha_fwd.so (minimal profile: the
bf16 d128 split-KV instance). Needs nvcc to build the library, not a GPU: invalid arguments are refused before any
CUDA call, and instance choice launches nothing."""
from __future__ import annotations

import math

import pytest

from mhakit import _capi

pytestmark = pytest.mark.compile

FAKE = 0x7F0000000000  # 16-byte-aligned, never dereferenced: nothing is launched in these tests


def valid_args(*, b=4, hq=32, hk=8, sq=1, d=128, **overrides) -> _capi.MhakitFwdSplitkvArgs:
    """bf16 decode: b=4, h_q=32, h_k=8, s_q=1, a contiguous [b, 4096, h_k, 128] cache, no new keys (the shape
    arguments change those; overrides: fields set afterwards)."""
    cap = 4096
    a = _capi.MhakitFwdSplitkvArgs()
    a.data_type = _capi.DTYPE_BF16
    a.q_ptr = a.k_cache_ptr = a.v_cache_ptr = a.o_ptr = a.lse_ptr = a.seqlen_k_ptr = FAKE
    a.seqlen_q, a.max_seqlen_k, a.batch = sq, cap, b
    a.nhead_q, a.nhead_k, a.hdim_q, a.hdim_v = hq, hk, d, d
    a.num_splits = 1
    a.scale_s = 1.0 / math.sqrt(d)
    a.stride_q, a.nhead_stride_q, a.batch_stride_q = hq * d, d, sq * hq * d
    a.stride_o, a.nhead_stride_o, a.batch_stride_o = hq * d, d, sq * hq * d
    for t in "kv":
        setattr(a, f"stride_{t}", hk * d)
        setattr(a, f"nhead_stride_{t}", d)
        setattr(a, f"batch_stride_{t}", cap * hk * d)
    a.nhead_stride_lse, a.batch_stride_lse = sq, hq * sq
    a.window_size_left = a.window_size_right = -1
    for key, value in overrides.items():
        setattr(a, key, value)
    return a


@pytest.fixture(scope="module")
def lib(minimal_fwd_build):
    return _capi.load_library(minimal_fwd_build / "libmha_fwd.so")


@pytest.mark.parametrize("overrides, message", [
    (dict(scale_s=0.0), "scale_s must be finite and > 0"),
    (dict(nhead_q=32, nhead_k=5), "nhead_q (32) must be a multiple of nhead_k (5)"),
    (dict(hdim_q=257), "hdim_q and hdim_v must be in [1, 256] (got 257 and 128)"),
    (dict(batch=-1), "batch must be >= 0"),
    (dict(seqlen_q=-1), "seqlen_q, seqlen_knew and max_seqlen_k must be >= 0"),
    (dict(seqlen_knew=-2), "seqlen_q, seqlen_knew and max_seqlen_k must be >= 0"),
    (dict(max_seqlen_k=2**31 - 1, seqlen_knew=1, k_new_ptr=FAKE, v_new_ptr=FAKE),
     "max_seqlen_k + seqlen_knew (2147483648) must fit in int32"),
    (dict(seqlen_q=2**30), "query rows per kv head) must fit in int32"),
    (dict(num_splits=-1), "num_splits must be 0 (heuristic) or in [1, 128] (got -1)"),
    (dict(num_splits=129), "num_splits must be 0 (heuristic) or in [1, 128] (got 129)"),
    (dict(q_ptr=None), "q_ptr, o_ptr, k_cache_ptr and v_cache_ptr must not be NULL"),
    (dict(v_cache_ptr=None), "q_ptr, o_ptr, k_cache_ptr and v_cache_ptr must not be NULL"),
    (dict(seqlen_k_ptr=None), "seqlen_k_ptr must not be NULL"),
    (dict(has_lse=1, lse_ptr=None), "has_lse is set but lse_ptr is NULL"),
    (dict(seqlen_knew=3), "seqlen_knew is 3 but k_new_ptr or v_new_ptr is NULL"),
    (dict(seqlen_knew=3, k_new_ptr=FAKE), "seqlen_knew is 3 but k_new_ptr or v_new_ptr is NULL"),
    (dict(block_table_ptr=FAKE), "a paged cache (block_table_ptr set) needs page_block_size >= 1 (got 0)"),
    (dict(block_table_ptr=FAKE, page_block_size=16, cache_batch_idx_ptr=FAKE),
     "cache_batch_idx_ptr works with contiguous caches only"),
    (dict(page_block_size=16), "page_block_size is 16 but block_table_ptr is NULL"),
    (dict(batch=65536), "batch (65536) is above the limit of 65535 sequences per call"),
    (dict(q_ptr=FAKE + 1), "q_ptr (0x7f0000000001) is misaligned: fp16/bf16 data must be 2-byte aligned"),
    (dict(k_cache_ptr=FAKE + 3), "k_cache_ptr (0x7f0000000003) is misaligned"),
    (dict(seqlen_knew=1, k_new_ptr=FAKE, v_new_ptr=FAKE + 1), "v_new_ptr (0x7f0000000001) is misaligned"),
    (dict(o_acc_ptr=FAKE + 2), "o_acc_ptr (0x7f0000000002) is misaligned: fp32 data must be 4-byte aligned"),
    (dict(seqlen_k_ptr=FAKE + 2), "seqlen_k_ptr (0x7f0000000002) is misaligned: int32 arrays must be 4-byte aligned"),
    (dict(block_table_ptr=FAKE + 1, page_block_size=16), "block_table_ptr (0x7f0000000001) is misaligned"),
    (dict(stride_knew=-1), "strides must be >= 0"),
    (dict(batch_stride_block_table=-4), "strides must be >= 0"),
    (dict(mask_type=9), "mask_type 9 is unknown"),
    (dict(data_type=5), "data_type 5 is not supported"),
    (dict(data_type=3), "data_type fp8fp16 is not supported by the split-KV forward: fp8 is forward-only"),
])
def test_invalid_arguments_are_refused_with_one_sentence(lib, overrides, message):
    args = valid_args(**overrides)
    assert lib.mha_fwd_splitkv_raw(args) == _capi.ERROR_INVALID_ARGS
    assert message in lib.last_error()
    assert lib.splitkv_kernel_name(args) is None and message in lib.last_error()
    with pytest.raises(_capi.MhakitValueError, match="."):
        lib.splitkv_acc_size(args)


def test_null_pointers_to_the_entry_points(lib):
    assert lib.cdll.mhakit_mha_fwd_splitkv(None, None) == _capi.ERROR_INVALID_ARGS
    assert "args must not be NULL" in lib.last_error()
    assert lib.cdll.mhakit_mha_fwd_splitkv_kernel_name(None) is None


def test_instance_choice_serves_every_head_dim_up_to_the_bucket(lib):
    """The minimal library holds the bf16 d128 instances of both split-KV families: decode_tma (priority 10; its
    mma.sync tile and its wgmma tiles, by packed rows) where its static guards (16-byte alignment, head dims
    multiples of 8) and run-time guard (pages of whole 64-key blocks, strides TMA takes) hold, decode for every other
    call."""
    tma = "splitkv_d128_bf16_batch_mask_sm90a_decode_tma_b32x64w4"
    name = "splitkv_d128_bf16_batch_mask_sm90a_decode_b32x64w4"
    assert lib.splitkv_kernel_name(valid_args()) == tma, lib.last_error()
    assert lib.last_error() == ""
    for hq, hv, want in [(1, 1, name), (59, 128, name), (128, 40, tma), (96, 96, tma), (72, 128, tma)]:
        assert lib.splitkv_kernel_name(valid_args(hdim_q=hq, hdim_v=hv)) == want, (hq, hv)
    for page, want in [(1, name), (16, name), (64, tma), (192, tma), (256, tma), (96, name)]:
        paged = valid_args(block_table_ptr=FAKE, page_block_size=page, batch_stride_block_table=4096)
        assert lib.splitkv_kernel_name(paged) == want, page
    window = valid_args(mask_type=_capi.MASK_BOTTOM_RIGHT, window_size_left=128, window_size_right=0)
    assert lib.splitkv_kernel_name(window) == tma
    # packed rows per kv head (4 x s_q): up to 32 the mma.sync tile (the key split), from 64 (catalogue min_rows) the
    # wgmma tiles: one warpgroup from 64, two from 128
    wgmma = "splitkv_d128_bf16_batch_mask_sm90a_decode_tma_"
    for sq, want in [(8, tma), (15, tma), (16, wgmma + "b64x64g1"), (31, wgmma + "b64x64g1"),
                     (32, wgmma + "b128x64g2"), (1000, wgmma + "b128x64g2")]:
        assert lib.splitkv_kernel_name(valid_args(seqlen_q=sq)) == want, sq
    # alignment (static guard): base pointers and used strides in 16-byte units
    assert lib.splitkv_kernel_name(valid_args(k_cache_ptr=FAKE + 8)) == name
    assert lib.splitkv_kernel_name(valid_args(stride_v=8 * 128 + 4)) == name
    assert lib.splitkv_kernel_name(valid_args(seqlen_knew=1, k_new_ptr=FAKE, v_new_ptr=FAKE, stride_knew=4,
                                              nhead_stride_knew=4, batch_stride_knew=4)) == name
    # strides of modes that are never stepped do not count (one kv head; one batch of a contiguous cache) ...
    mqa = valid_args(nhead_q=8, nhead_k=1, nhead_stride_k=0, nhead_stride_v=3)
    assert lib.splitkv_kernel_name(mqa) == tma
    assert lib.splitkv_kernel_name(valid_args(batch=1, batch_stride_k=0, batch_stride_v=0)) == tma
    # ... but a cache reached through cache_batch_idx may be stepped in its batch mode
    assert lib.splitkv_kernel_name(valid_args(batch=1, batch_stride_k=0, cache_batch_idx_ptr=FAKE)) == name
    # strides beyond TMA's 2^40 bytes
    assert lib.splitkv_kernel_name(valid_args(batch_stride_k=2**39)) == name


def test_traits_not_built_are_unsupported(lib):
    args = valid_args(hdim_q=192, hdim_v=192)  # minimal builds only the 128 bucket
    assert lib.mha_fwd_splitkv_raw(args) == _capi.ERROR_UNSUPPORTED
    assert "no split-KV kernel built into this library serves dtype=bf16 hdim_q=192 hdim_v=192" in lib.last_error()
    assert lib.splitkv_kernel_name(valid_args(data_type=_capi.DTYPE_FP16)) is None
    assert "dtype=fp16" in lib.last_error()


def test_accumulator_sizes_for_a_given_split_count_need_no_device(lib):
    """num_splits > 0 resolves without reading the device; one split needs no accumulators."""
    assert lib.splitkv_acc_size(valid_args(num_splits=1)) == (0, 0, 1)
    b, hq, sq, dv = 4, 32, 3, 100
    lse, o, n = lib.splitkv_acc_size(valid_args(num_splits=7, seqlen_q=sq, hdim_v=dv))
    assert n == 7 and lse == 7 * b * hq * sq * 4 and o == lse * dv


def test_empty_calls_return_at_once(lib):
    """batch 0, or no query row and no new key: nothing to do, nothing launched, no device needed."""
    assert lib.mha_fwd_splitkv_raw(valid_args(batch=0)) == 0.0
    assert lib.mha_fwd_splitkv_raw(valid_args(seqlen_q=0)) == 0.0
