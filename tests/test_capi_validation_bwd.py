"""Backward argument validation through the C ABI of a real libmha_bwd.so (minimal profile). Needs nvcc, not a
GPU: invalid arguments and a missing workspace are refused before any CUDA call."""
from __future__ import annotations

import math

import pytest

from mhakit import _capi

pytestmark = pytest.mark.compile

FAKE = 0x7F0000000000  # 256-byte aligned, never dereferenced: nothing is launched in these tests


def valid_args(**overrides) -> _capi.MhakitBwdArgs:
    """bf16, batch mode, b=2 h=8 s=256 d=128, b·h·s·d for every tensor."""
    b, h, s, d = 2, 8, 256, 128
    a = _capi.MhakitBwdArgs()
    a.data_type = _capi.DTYPE_BF16
    for name in ("q", "k", "v", "o", "lse", "do", "dq", "dk", "dv"):
        setattr(a, f"{name}_ptr", FAKE)
    a.seqlen_q = a.seqlen_k = a.max_seqlen_q = a.max_seqlen_k = s
    a.batch, a.nhead_q, a.nhead_k, a.hdim_q, a.hdim_v = b, h, h, d, d
    a.scale = 1.0 / math.sqrt(d)
    for t in ("q", "k", "v", "o", "do", "dq", "dk", "dv"):
        setattr(a, f"stride_{t}", d)
        setattr(a, f"nhead_stride_{t}", s * d)
        setattr(a, f"batch_stride_{t}", h * s * d)
    a.nhead_stride_lse, a.batch_stride_lse = s, h * s
    a.window_size_left = a.window_size_right = -1
    for key, value in overrides.items():
        setattr(a, key, value)
    return a


@pytest.fixture(scope="module")
def lib(minimal_bwd_build):
    return _capi.load_bwd_library(minimal_bwd_build / "libmha_bwd.so")


@pytest.mark.parametrize("overrides, message", [
    (dict(scale=0.0), "scale must be finite and > 0"),
    (dict(scale=float("nan")), "scale must be finite and > 0"),
    (dict(nhead_q=8, nhead_k=3), "must be a multiple of nhead_k"),
    (dict(hdim_v=257), "hdim_q and hdim_v must be in [1, 256] (got 128 and 257)"),
    (dict(hdim_q=0), "hdim_q and hdim_v must be in [1, 256] (got 0 and 128)"),
    (dict(batch=-2), "batch must be >= 0"),
    (dict(seqlen_k=-1), "seqlen_q and seqlen_k must be >= 0"),
    (dict(dq_ptr=None), "dq_ptr must not be NULL"),
    (dict(lse_ptr=None), "lse_ptr"),
    (dict(dv_ptr=None), "dk_ptr and dv_ptr must not be NULL"),
    (dict(is_group_mode=1), "group mode needs seqstart_q_ptr and seqstart_k_ptr"),
    (dict(is_group_mode=1, seqstart_q_ptr=FAKE, seqstart_k_ptr=FAKE, max_seqlen_k=-1), "max_seqlen_k must be >= 0"),
    (dict(stride_dk=-1), "strides must be >= 0"),
    (dict(mask_type=4), "mask_type 4 is unknown"),
    (dict(data_type=5), "data_type 5 is not supported"),
    (dict(data_type=2), "data_type fp8bf16 is not supported by the backward: fp8 is forward-only"),
    (dict(workspace_ptr=FAKE + 8, workspace_bytes=1 << 30), "the workspace must be 256-byte aligned"),
    # grid limits: -2 with the limit, never "rebuild with a profile" (issue 8, item 4)
    (dict(batch=65536), "batch (65536) is above the limit of 65535 sequences per call"),
    (dict(nhead_q=65536, nhead_k=1), "nhead_q (65536) is above the limit of 65535 query heads per call"),
    # alignment of every pointer to its element (item 11)
    (dict(q_ptr=FAKE + 1), "q_ptr (0x7f0000000001) is misaligned: fp16/bf16 data must be 2-byte aligned"),
    (dict(do_ptr=FAKE + 3), "do_ptr (0x7f0000000003) is misaligned"),
    (dict(dv_ptr=FAKE + 1), "dv_ptr (0x7f0000000001) is misaligned"),
    (dict(lse_ptr=FAKE + 2), "lse_ptr (0x7f0000000002) is misaligned: the fp32 LSE must be 4-byte aligned"),
    (dict(is_group_mode=1, seqstart_q_ptr=FAKE, seqstart_k_ptr=FAKE + 2),
     "seqstart_k_ptr (0x7f0000000002) is misaligned: int32 offsets must be 4-byte aligned"),
])
def test_invalid_arguments_are_refused_with_one_sentence(lib, overrides, message):
    args = valid_args(**overrides)
    assert lib.mha_bwd_raw(args) == _capi.ERROR_INVALID_ARGS
    assert message in lib.last_error()
    assert lib.kernel_name(args) is None and message in lib.last_error()


def test_workspace_is_queried_and_required(lib):
    args = valid_args()
    need = lib.workspace_size(args)
    assert need > 0 and lib.last_error() == ""
    assert lib.mha_bwd_raw(args) == _capi.ERROR_INVALID_ARGS
    assert f"needs {need} bytes for these arguments and got 0" in lib.last_error()
    short = valid_args(workspace_ptr=FAKE, workspace_bytes=need - 1)
    assert lib.mha_bwd_raw(short) == _capi.ERROR_INVALID_ARGS and "workspace is too small" in lib.last_error()
    # deterministic mode may need more scratch, never less than it asks for
    assert lib.workspace_size(valid_args(deterministic=1)) > 0


def test_unsupported_and_empty_problems(lib):
    args = valid_args(hdim_q=192, hdim_v=128)  # minimal builds only the 128 bucket
    assert lib.mha_bwd_raw(args) == _capi.ERROR_UNSUPPORTED
    assert "no backward kernel built into this library serves dtype=bf16 hdim_q=192" in lib.last_error()
    assert lib.mha_bwd_raw(valid_args(batch=0)) == 0.0
    assert lib.mha_bwd_raw(valid_args(seqlen_q=0, seqlen_k=0)) == 0.0 and lib.last_error() == ""


def test_instance_choice(lib):
    assert lib.kernel_name(valid_args()).startswith("bwd_d128_bf16_batch_nmask_sm90a_")
    causal = valid_args(mask_type=1, window_size_left=-1, window_size_right=0)
    assert lib.kernel_name(causal).startswith("bwd_d128_bf16_batch_mask_sm90a_")
    odd = lib.kernel_name(valid_args(stride_dq=129))
    assert odd == "bwd_d128_bf16_batch_nmask_sm90a_generic_b64x64w4"


def test_the_catalogue_guards_of_a_family_steer_the_choice(lib):
    hopper, generic = "bwd_d128_bf16_batch_nmask_sm90a_hopper_b64x128", "bwd_d128_bf16_batch_nmask_sm90a_generic_b64x64w4"
    assert lib.kernel_name(valid_args()) == hopper
    assert lib.kernel_name(valid_args(deterministic=1)) == hopper                 # [bwd.hopper] deterministic = true
    assert lib.kernel_name(valid_args(dk_ptr=FAKE + 8)) == generic                # align_bytes = 16
    assert lib.kernel_name(valid_args(nhead_stride_do=256 * 128 + 4)) == generic  # a stride off the 16 bytes
    assert lib.kernel_name(valid_args(hdim_q=128, hdim_v=120)) == hopper          # equal_head_dims = false
    for d in (1, 59, 111, 127):                                                   # head_dim_multiple = 8
        assert lib.kernel_name(valid_args(hdim_q=d, hdim_v=d)) == generic, lib.last_error()
    assert lib.kernel_name(valid_args(hdim_q=120, hdim_v=120)) == hopper
    # a batch of one never uses its batch stride: the alignment guard ignores it
    assert lib.kernel_name(valid_args(batch=1, batch_stride_q=3)) == hopper
