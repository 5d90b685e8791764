"""Argument validation through the C ABI of a real libmha_fwd.so (minimal profile). Needs nvcc to build the
library, not a GPU: invalid arguments are refused before any CUDA call, and instance choice launches nothing."""
from __future__ import annotations

import math

import pytest

from mhakit import _capi

pytestmark = pytest.mark.compile

FAKE = 0x7F0000000000  # 16-byte-aligned, never dereferenced: nothing is launched in these tests


def valid_args(**overrides) -> _capi.MhakitFwdArgs:
    """bf16, batch mode, b=2 h=8 s=256 d=128, b·h·s·d layout: everything the minimal library serves."""
    b, h, s, d = 2, 8, 256, 128
    a = _capi.MhakitFwdArgs()
    a.data_type = _capi.DTYPE_BF16
    a.q_ptr = a.k_ptr = a.v_ptr = a.o_ptr = a.lse_ptr = FAKE
    a.seqlen_q = a.seqlen_k = a.max_seqlen_q = s
    a.batch, a.nhead_q, a.nhead_k, a.hdim_q, a.hdim_v = b, h, h, d, d
    a.scale_s = 1.0 / math.sqrt(d)
    for t in "qkvo":
        setattr(a, f"stride_{t}", d)
        setattr(a, f"nhead_stride_{t}", s * d)
        setattr(a, f"batch_stride_{t}", h * s * d)
    a.nhead_stride_lse, a.batch_stride_lse = s, h * s
    a.window_size_left = a.window_size_right = -1
    for key, value in overrides.items():
        setattr(a, key, value)
    return a


@pytest.fixture(scope="module")
def lib(minimal_fwd_build):
    return _capi.load_library(minimal_fwd_build / "libmha_fwd.so")


@pytest.mark.parametrize("overrides, message", [
    (dict(scale_s=0.0), "scale_s must be finite and > 0"),
    (dict(scale_s=-0.5), "scale_s must be finite and > 0"),
    (dict(scale_s=float("nan")), "scale_s must be finite and > 0"),
    (dict(scale_s=float("inf")), "scale_s must be finite and > 0"),
    (dict(nhead_q=8, nhead_k=3), "nhead_q (8) must be a multiple of nhead_k (3)"),
    (dict(nhead_k=0), "nhead_q and nhead_k must be >= 1"),
    (dict(hdim_q=257), "hdim_q and hdim_v must be in [1, 256] (got 257 and 128)"),
    (dict(hdim_v=264), "hdim_q and hdim_v must be in [1, 256] (got 128 and 264)"),
    (dict(hdim_q=0), "hdim_q and hdim_v must be in [1, 256] (got 0 and 128)"),
    (dict(hdim_q=-59, hdim_v=-59), "hdim_q and hdim_v must be in [1, 256] (got -59 and -59)"),
    (dict(batch=-1), "batch must be >= 0"),
    (dict(seqlen_q=-3), "seqlen_q and seqlen_k must be >= 0"),
    (dict(q_ptr=None), "q_ptr and o_ptr must not be NULL"),
    (dict(o_ptr=None), "q_ptr and o_ptr must not be NULL"),
    (dict(k_ptr=None), "k_ptr and v_ptr must not be NULL"),
    (dict(has_lse=1, lse_ptr=None), "has_lse is set but lse_ptr is NULL"),
    (dict(is_group_mode=1), "group mode needs seqstart_q_ptr and seqstart_k_ptr"),
    (dict(is_group_mode=1, seqstart_q_ptr=FAKE, seqstart_k_ptr=FAKE, max_seqlen_q=-1), "max_seqlen_q must be >= 0"),
    (dict(stride_k=-128), "strides must be >= 0"),
    (dict(mask_type=7), "mask_type 7 is unknown"),
    (dict(data_type=5), "data_type 5 is not supported"),
    # grid limits: -2 with the limit, never "rebuild with a profile" (issue 8, item 4)
    (dict(batch=65536), "batch (65536) is above the limit of 65535 sequences per call"),
    (dict(batch=2**31 - 1), "is above the limit of 65535 sequences per call"),
    (dict(nhead_q=70000, nhead_k=70000), "nhead_q (70000) is above the limit of 65535 query heads per call"),
    # alignment of every pointer to its element (item 11)
    (dict(q_ptr=FAKE + 1), "q_ptr (0x7f0000000001) is misaligned: fp16/bf16 data must be 2-byte aligned"),
    (dict(k_ptr=FAKE + 1), "k_ptr (0x7f0000000001) is misaligned"),
    (dict(o_ptr=FAKE + 7), "o_ptr (0x7f0000000007) is misaligned"),
    (dict(has_lse=1, lse_ptr=FAKE + 2), "lse_ptr (0x7f0000000002) is misaligned: the fp32 LSE must be 4-byte aligned"),
    (dict(is_group_mode=1, seqstart_q_ptr=FAKE + 1, seqstart_k_ptr=FAKE),
     "seqstart_q_ptr (0x7f0000000001) is misaligned: int32 offsets must be 4-byte aligned"),
    (dict(workspace_ptr=FAKE + 16), "workspace_ptr (0x7f0000000010) is misaligned: the workspace must be 256-byte"),
    # fp8 (issue 12, item 5): what the validator refuses whatever the library holds
    (dict(q_descale_ptr=FAKE), "descale factors are for fp8 data only"),
    (dict(data_type=_capi.DTYPE_FP8_BF16), "fp8 data needs q_descale_ptr, k_descale_ptr and v_descale_ptr"),
    (dict(data_type=_capi.DTYPE_FP8_BF16, q_descale_ptr=FAKE, k_descale_ptr=FAKE), "fp8 data needs q_descale_ptr"),
    (dict(data_type=_capi.DTYPE_FP8_BF16, q_descale_ptr=FAKE + 2, k_descale_ptr=FAKE, v_descale_ptr=FAKE),
     "q_descale_ptr (0x7f0000000002) is misaligned: fp32 descale factors must be 4-byte aligned"),
    (dict(data_type=_capi.DTYPE_FP8_FP16, q_descale_ptr=FAKE, k_descale_ptr=FAKE, v_descale_ptr=FAKE,
          is_group_mode=1, seqstart_q_ptr=FAKE, seqstart_k_ptr=FAKE), "fp8 runs in batch mode only"),
    (dict(data_type=_capi.DTYPE_FP8_BF16, q_descale_ptr=FAKE, k_descale_ptr=FAKE, v_descale_ptr=FAKE,
          logits_soft_cap=30.0), "fp8 takes no score modifiers"),
    (dict(data_type=_capi.DTYPE_FP8_BF16, q_descale_ptr=FAKE, k_descale_ptr=FAKE, v_descale_ptr=FAKE,
          sink_ptr=FAKE), "fp8 takes no score modifiers"),
    (dict(data_type=_capi.DTYPE_FP8_BF16, q_descale_ptr=FAKE, k_descale_ptr=FAKE, v_descale_ptr=FAKE,
          p_drop=0.1), "fp8 takes no dropout"),
    (dict(data_type=_capi.DTYPE_FP8_BF16, q_descale_ptr=FAKE, k_descale_ptr=FAKE, v_descale_ptr=FAKE,
          o_ptr=FAKE + 1), "o_ptr (0x7f0000000001) is misaligned: fp16/bf16 output must be 2-byte aligned"),
])
def test_invalid_arguments_are_refused_with_one_sentence(lib, overrides, message):
    args = valid_args(**overrides)
    assert lib.mha_fwd_raw(args) == _capi.ERROR_INVALID_ARGS
    assert message in lib.last_error()
    assert lib.kernel_name(args) is None and message in lib.last_error()


def test_null_args_pointer(lib):
    assert lib.cdll.mhakit_mha_fwd(None, None) == _capi.ERROR_INVALID_ARGS
    assert "args must not be NULL" in lib.last_error()


def test_traits_not_built_are_unsupported_not_invalid(lib):
    args = valid_args(hdim_q=192, hdim_v=128)  # minimal builds only the 128 bucket (which also serves d <= 128)
    assert lib.mha_fwd_raw(args) == _capi.ERROR_UNSUPPORTED
    assert "no forward kernel built into this library serves dtype=bf16 hdim_q=192" in lib.last_error()
    fp16 = valid_args(data_type=_capi.DTYPE_FP16)
    assert lib.kernel_name(fp16) is None and "dtype=fp16" in lib.last_error()


def test_fp8_without_fp8_instances_is_unsupported_with_what_fp8_needs(lib):
    """The minimal library holds no fp8 instance: a valid fp8 call is -1 (a rebuild helps), and the sentence says
    where fp8 runs; its workspace query is 0 with the same sentence."""
    args = valid_args(data_type=_capi.DTYPE_FP8_BF16, q_descale_ptr=FAKE, k_descale_ptr=FAKE, v_descale_ptr=FAKE)
    assert lib.mha_fwd_raw(args) == _capi.ERROR_UNSUPPORTED
    msg = lib.last_error()
    assert "no fp8 forward kernel built into this library serves dtype=fp8bf16" in msg
    assert "fp8 runs on the hopper family only (sm_90a" in msg
    with pytest.raises(_capi.MhakitError, match="no fp8 forward kernel"):
        lib.workspace_size(args)
    # a 16-bit call on a persistent Hopper instance (catalogue `persistent`) asks for its 8-byte tile counter, one on
    # the generic family (a head dim that is not a multiple of 8) for nothing
    assert lib.kernel_name(valid_args()) == "fwd_d128_bf16_batch_nmask_sm90a_hopper_b128x176"
    assert lib.workspace_size(valid_args()) == 8
    assert lib.workspace_size(valid_args(hdim_q=127, hdim_v=127)) == 0


def test_smaller_head_dims_are_served_by_a_larger_bucket(lib):
    assert lib.kernel_name(valid_args(hdim_q=64, hdim_v=64)).startswith("fwd_d128_bf16_batch_nmask_sm90a_")
    # hdim_q != hdim_v, each within the bucket: the Hopper forward too (Q·Kᵀ over hdim_q, P·V over hdim_v)
    assert lib.kernel_name(valid_args(hdim_q=64, hdim_v=128)) == "fwd_d128_bf16_batch_nmask_sm90a_hopper_b128x176"


@pytest.mark.parametrize("d", [1, 3, 59, 111, 127])
def test_head_dims_that_are_not_multiples_of_8_run_on_the_generic_family(lib, d):
    """Any head dim up to 256 is accepted (catalogue [head_dims]); the hopper family's head_dim_multiple = 8 leaves
    these to the generic family even when every pointer and stride is 16-byte aligned (rows of 128 elements)."""
    name = lib.kernel_name(valid_args(hdim_q=d, hdim_v=d))
    assert name == "fwd_d128_bf16_batch_nmask_sm90a_generic_b128x64w4", lib.last_error()
    contiguous = dict(stride_q=d, stride_k=d, stride_v=d, stride_o=d, nhead_stride_q=256 * d, nhead_stride_k=256 * d,
                      nhead_stride_v=256 * d, nhead_stride_o=256 * d)
    assert lib.kernel_name(valid_args(hdim_q=d, hdim_v=d, **contiguous)) == name
    # a multiple of 8 below the bucket keeps the hopper instance
    assert lib.kernel_name(valid_args(hdim_q=56, hdim_v=56)) == "fwd_d128_bf16_batch_nmask_sm90a_hopper_b128x176"


def test_instance_choice(lib):
    assert lib.kernel_name(valid_args()) == "fwd_d128_bf16_batch_nmask_sm90a_hopper_b128x176"
    assert lib.last_error() == ""
    causal = valid_args(mask_type=1, window_size_left=-1, window_size_right=0)
    assert lib.kernel_name(causal) == "fwd_d128_bf16_batch_mask_sm90a_hopper_b128x128"


def test_padded_and_unaligned_cases_fall_back_to_the_generic_family(lib):
    # head dim 120 is served by the 128 bucket; an odd row stride defeats TMA, so the generic family takes it
    name = lib.kernel_name(valid_args(hdim_q=120, hdim_v=120, stride_q=120, stride_k=120, stride_v=120, stride_o=120))
    assert name is not None and name.startswith("fwd_d128_bf16_batch_nmask_sm90a_")
    odd = lib.kernel_name(valid_args(stride_q=129))
    assert odd == "fwd_d128_bf16_batch_nmask_sm90a_generic_b128x64w4"
    # the catalogue's align_bytes = 16 of [fwd.hopper]: a base pointer 8 bytes off, a head stride 4 elements off
    assert lib.kernel_name(valid_args(v_ptr=FAKE + 8)) == "fwd_d128_bf16_batch_nmask_sm90a_generic_b128x64w4"
    assert lib.kernel_name(valid_args(nhead_stride_o=256 * 128 + 4)) == "fwd_d128_bf16_batch_nmask_sm90a_generic_b128x64w4"
    assert lib.kernel_name(valid_args(batch=1, batch_stride_k=3)) == "fwd_d128_bf16_batch_nmask_sm90a_hopper_b128x176"


def test_empty_problems_return_zero_without_launching(lib):
    assert lib.mha_fwd_raw(valid_args(batch=0)) == 0.0
    assert lib.mha_fwd_raw(valid_args(seqlen_q=0)) == 0.0


def test_limits_are_documented_where_the_validator_takes_them_from():
    """The grid and head-dim limits the validator enforces come from mha_common.h, which documents them."""
    from conftest import REPO
    header = (REPO / "csrc" / "include" / "mha_common.h").read_text()
    for name, value in (("MHAKIT_MAX_BATCH", 65535), ("MHAKIT_MAX_NHEAD", 65535), ("MHAKIT_MAX_HDIM", 256)):
        assert f"{name} = {value}" in header
    assert "MHAKIT_MAX_BATCH" in (REPO / "csrc" / "runtime" / "api_common.cpp").read_text()


def test_without_a_gpu_a_valid_call_is_a_cuda_error_saying_so(lib):
    from conftest import have_gpu
    if have_gpu():
        pytest.skip("a GPU is present: the GPU tests run this call for real")
    assert lib.mha_fwd_raw(valid_args()) == _capi.ERROR_CUDA
    assert lib.last_error().startswith("no CUDA device/driver is available to this process (")
