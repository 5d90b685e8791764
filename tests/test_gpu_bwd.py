"""The backward pass on the GPU against the NumPy reference, through the C ABI with CuPy arrays.

O and LSE come from the reference (rounded O, fp32 LSE), so a failure here is the backward's own. dQ/dK/dV are
poisoned with NaN and, in some cases, laid out differently from Q/K/V. The reference itself is checked against
finite differences of the forward in tests/test_reference_bwd.py."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO
from gpu_arrays import (NAN_BITS, assert_close, assert_outside_untouched, cp, download, make_strided, to_bits,
                        upload)
from mhakit import _capi, reference

pytestmark = [pytest.mark.gpu, pytest.mark.compile]


@pytest.fixture(scope="module")
def lib(gpu_libraries):
    return _capi.load_bwd_library(gpu_libraries / "libmha_bwd.so")


def uniform(rng, shape):
    """aiter's backward default (-init=1): uniform in [-1, 1). With N(0, 1) inputs, bf16 gradients can land at
    the 1e-2 tolerance itself, through the rounding of P that every bf16 kernel (FlashAttention's too) performs."""
    return rng.uniform(-1.0, 1.0, shape).astype(np.float32)


def upload_exact(rounded_bhsd: np.ndarray, dtype: str, order: str):
    """Upload values that are already representable in dtype (e.g. a rounded reference O)."""
    return upload(rounded_bhsd, dtype, order, 0)[0]


LAST_WORKSPACE = {}  # run_bwd's last workspace query: {"need": bytes}


def run_bwd(lib, args_kwargs, deterministic=False):
    """Query the workspace, allocate it, run; returns the workspace so it outlives the call."""
    args = _capi.make_bwd_args(**args_kwargs, deterministic=deterministic)
    need = lib.workspace_size(args)
    LAST_WORKSPACE["need"] = need
    workspace = cp.empty(max(need, 1), dtype=cp.uint8)
    args = _capi.make_bwd_args(**args_kwargs, deterministic=deterministic, workspace_ptr=int(workspace.data.ptr),
                               workspace_bytes=int(workspace.nbytes))
    name = lib.kernel_name(args)
    assert name is not None, lib.last_error()
    lib.mha_bwd(args)
    cp.cuda.runtime.deviceSynchronize()
    return name, workspace


BATCH_CASES = [
    # dtype, b, hq, hk, sq, sk, d, dv, order_in, order_grad, pad_grad, mask, deterministic
    ("bf16", 2, 4, 4, 128, 128, 128, 128, "bhsd", "bhsd", 0, "0", False),
    ("fp16", 1, 4, 2, 259, 259, 64, 64, "bshd", "bshd", 0, "0", False),
    ("bf16", 2, 2, 2, 516, 253, 128, 128, "bhsd", "bshd", 0, "1", False),
    ("fp16", 1, 4, 1, 500, 251, 128, 128, "bshd", "bhsd", 0, "1", True),
    ("bf16", 1, 2, 2, 900, 258, 64, 64, "bhsd", "bhsd", 0, "2", False),
    ("fp16", 2, 1, 1, 987, 219, 32, 32, "bshd", "bshd", 0, "t:128,30", False),
    ("bf16", 2, 3, 1, 244, 499, 256, 256, "bhsd", "bhsd", 0, "b:4,35", False),
    ("bf16", 2, 4, 2, 300, 517, 96, 96, "bshd", "bshd", 0, "b", False),  # the Hopper d96 instance
    ("fp16", 1, 2, 2, 129, 1000, 80, 80, "bhsd", "bhsd", 0, "0", False),  # d80 on it, padded
    ("fp16", 1, 2, 2, 77, 0, 64, 64, "bhsd", "bhsd", 0, "0", False),
    ("bf16", 1, 2, 1, 100, 150, 192, 128, "bshd", "bshd", 0, "g:30,7", True),
    ("fp16", 2, 2, 2, 130, 129, 16, 256, "bhsd", "bhsd", 0, "t", False),
    ("bf16", 1, 2, 2, 96, 140, 128, 128, "bshd", "bshd", 1, "b", False),
    ("bf16", 1, 16, 16, 1024, 1024, 128, 128, "bhsd", "bhsd", 0, "t", False),
]


# Head dims that are not multiples of 8 (issue 13): inputs with contiguous rows of odd byte length (element-wise
# loads), gradients contiguous or padded to a 16-byte row stride (pad 5 for 59, 1 for 111 / 255: 16-byte stores with
# a partial last chunk); GQA splits (fp32 dK/dV partials), the dQ pass and fp32 dQ reductions, deterministic mode.
ODD_BATCH_CASES = [
    ("bf16", 1, 4, 2, 259, 259, 59, 59, "bshd", "bshd", 0, "0", False),
    ("fp16", 2, 2, 2, 216, 153, 59, 59, "bhsd", "bhsd", 5, "2", False),
    ("bf16", 1, 4, 1, 200, 251, 111, 111, "bshd", "bhsd", 1, "1", True),
    ("fp16", 2, 3, 1, 144, 199, 111, 111, "bhsd", "bshd", 0, "t:64,10", False),
    ("bf16", 1, 2, 2, 130, 120, 111, 59, "bhsd", "bhsd", 0, "b:4,35", False),
    ("fp16", 1, 4, 2, 96, 170, 59, 111, "bshd", "bshd", 5, "t", True),
    ("fp16", 1, 2, 1, 100, 90, 1, 1, "bshd", "bshd", 0, "0", False),
    ("bf16", 1, 2, 2, 130, 200, 255, 255, "bhsd", "bhsd", 1, "b", False),
]


# Deterministic mode on the Hopper family (dQ tiles added in a fixed key-block order): every Hopper head-dim bucket
# (the d256 instance adds dQ with vector atomics, the others by bulk reductions), every mask kind (the order of turns
# follows each mask's query ranges), GQA, key tails; large enough that unordered fp32 adds would differ between runs.
DETERMINISTIC_HOPPER_CASES = [
    ("bf16", 2, 16, 4, 1024, 1024, 128, 128, "bshd", "bshd", 0, "0", True),
    ("fp16", 1, 8, 8, 1000, 1100, 64, 64, "bhsd", "bhsd", 0, "t", True),
    ("bf16", 1, 8, 2, 700, 1500, 128, 128, "bshd", "bshd", 0, "b", True),
    ("fp16", 2, 4, 4, 640, 513, 96, 96, "bshd", "bshd", 0, "t:100,40", True),
    ("bf16", 1, 6, 3, 777, 900, 256, 256, "bhsd", "bhsd", 0, "1", True),
    ("fp16", 1, 4, 1, 512, 640, 256, 256, "bshd", "bshd", 0, "0", True),
    ("bf16", 1, 4, 2, 800, 600, 64, 64, "bshd", "bhsd", 0, "g:200,9", True),
    ("fp16", 1, 4, 2, 600, 700, 192, 192, "bshd", "bshd", 0, "b", True),
]


# hdim_q != hdim_v on the Hopper backward: the (192, 128) instance (query split; default profile), padded pairs on
# it, and unequal dims inside one bucket (64 x 128 and 128 x 64 on the d128 instance, key split), deterministic too.
UNEQUAL_HOPPER_CASES = [
    ("bf16", 2, 8, 2, 700, 513, 192, 128, "bshd", "bshd", 0, "0", False),
    ("fp16", 1, 4, 4, 300, 1000, 192, 128, "bhsd", "bshd", 0, "b", False),
    ("bf16", 1, 4, 1, 257, 300, 176, 120, "bshd", "bshd", 0, "t:100,7", True),
    ("fp16", 2, 2, 2, 257, 300, 64, 128, "bhsd", "bhsd", 0, "t", False),
    ("bf16", 1, 4, 2, 200, 513, 128, 64, "bshd", "bshd", 0, "0", True),
]


# The Hopper GQA split (bwd_gqa_split.h): b = 1 (or 2) with one or two kv heads, so that the unsplit grid leaves SMs
# idle and several CTAs share a kv group's query heads, dK / dV coming from fp32 partial sums (reduce_dkv_kernel):
# every layout (d64 / d128 key split, d256 query split, (192, 128) swapped key split, d != d_v in one bucket), every
# mask kind, odd and short key lengths (a last key block of a few keys, a single block), keys that no query sees
# (bottom-right, s_k > s_q: dK = dV = 0 from every split), gradients with rows padded by 16 bytes (pad 8: still
# Hopper's), deterministic (bitwise reruns).
GQA_SPLIT_CASES = [
    ("bf16", 1, 16, 2, 1031, 1031, 128, 128, "bshd", "bshd", 0, "0", False),
    ("bf16", 1, 8, 1, 777, 1531, 128, 128, "bhsd", "bshd", 0, "t", False),
    ("fp16", 1, 8, 1, 300, 1000, 128, 128, "bshd", "bshd", 0, "b", False),
    ("bf16", 1, 12, 2, 500, 77, 64, 64, "bshd", "bhsd", 8, "t:100,40", False),
    ("fp16", 1, 6, 1, 64, 100, 64, 64, "bhsd", "bhsd", 0, "g:30,7", False),
    ("bf16", 1, 16, 1, 900, 700, 256, 256, "bshd", "bshd", 0, "1", False),
    ("bf16", 1, 8, 2, 500, 513, 192, 128, "bshd", "bshd", 0, "b", False),
    ("fp16", 1, 4, 1, 300, 400, 128, 64, "bhsd", "bhsd", 0, "t", False),
    ("bf16", 2, 8, 1, 129, 3000, 128, 128, "bshd", "bshd", 8, "b:64,0", False),
    ("bf16", 1, 8, 1, 1200, 1300, 128, 128, "bshd", "bshd", 0, "0", True),
    ("fp16", 1, 8, 1, 1000, 1100, 64, 64, "bhsd", "bhsd", 0, "t", True),
    ("bf16", 1, 12, 2, 900, 700, 256, 256, "bshd", "bshd", 0, "1", True),
    ("bf16", 1, 8, 2, 600, 777, 192, 128, "bshd", "bshd", 0, "t:128,30", True),
]


# The Hopper 192 backward (`all` profile; query split with 64B-swizzled tiles), and 160 padded onto it.
HOPPER_192_CASES = [
    ("bf16", 2, 4, 2, 300, 517, 192, 192, "bshd", "bshd", 0, "0", False),
    ("fp16", 1, 4, 4, 700, 650, 192, 192, "bhsd", "bhsd", 0, "t", False),
    ("bf16", 1, 6, 3, 257, 1000, 160, 160, "bshd", "bhsd", 0, "t:128,30", False),
]


@pytest.mark.parametrize("case", BATCH_CASES, ids=lambda c: "-".join(map(str, c)))
def test_batch_mode_gradients_match_reference(lib, case):
    check_batch_mode(lib, case)


@pytest.mark.parametrize("case", UNEQUAL_HOPPER_CASES, ids=lambda c: "-".join(map(str, c)))
def test_unequal_head_dims_on_hopper(lib, case):
    name = check_batch_mode(lib, case)
    assert "_hopper_" in name, name  # [bwd.hopper] equal_head_dims = false


@pytest.mark.parametrize("case", HOPPER_192_CASES, ids=lambda c: "-".join(map(str, c)))
def test_hopper_192_backward(lib, case):
    if os.environ.get("MHAKIT_TEST_PROFILE", "default") != "all":
        pytest.skip("the Hopper 192 backward is built by the `all` profile")
    name = check_batch_mode(lib, case)
    assert "_hopper_" in name, name


@pytest.mark.parametrize("case", DETERMINISTIC_HOPPER_CASES, ids=lambda c: "-".join(map(str, c)))
def test_deterministic_hopper_is_bitwise_reproducible(lib, case):
    name = check_batch_mode(lib, case)
    assert "_hopper_" in name  # [bwd.hopper] deterministic = true


@pytest.mark.parametrize("case", GQA_SPLIT_CASES, ids=lambda c: "-".join(map(str, c)))
def test_gqa_split_on_hopper(lib, case):
    name = check_batch_mode(lib, case)
    assert "_hopper_" in name, name
    assert_workspace_holds_split_slots(lib, case)


def assert_workspace_holds_split_slots(lib, case) -> None:
    """The workspace query gave the call the split's slots: more than the unsplit layout (fmha_bwd_hopper_common.hpp:
    LSE and D rows, the fp32 dQ accumulator of the instance's head-dim bucket, the turn counters; 64-row tiles)."""
    dtype, b, hq, hk, sq, sk, d, dv = case[:8]
    bucket = next(x for x in (64, 128, 192, 256) if x >= max(d, dv))
    rows = b * hq * -(-sq // 64) * 64
    align = lambda n: -(-n // 256) * 256  # noqa: E731
    unsplit = align(align(align(align(rows * 4) + rows * 4) + rows * bucket * 4) + rows // 64 * 4)
    assert LAST_WORKSPACE["need"] > unsplit, (LAST_WORKSPACE["need"], unsplit)


@pytest.mark.parametrize("case", ODD_BATCH_CASES, ids=lambda c: "-".join(map(str, c)))
def test_odd_head_dims_batch_mode(lib, case):
    name = check_batch_mode(lib, case)
    assert "_generic_" in name  # [bwd.hopper] head_dim_multiple = 8


def check_batch_mode(lib, case) -> str:
    """Runs one batch-mode case against the reference (twice, bitwise, when deterministic); returns the kernel."""
    dtype, b, hq, hk, sq, sk, d, dv, order, gorder, gpad, mask, deterministic = case
    rng = np.random.default_rng(hash(case) % 2**32)
    m = reference.parse_mask(mask)
    q, qr = upload(uniform(rng, (b, hq, sq, d)), dtype, order, 0)
    k, kr = upload(uniform(rng, (b, hk, sk, d)), dtype, order, 0)
    v, vr = upload(uniform(rng, (b, hk, sk, dv)), dtype, order, 0)
    do, dor = upload(uniform(rng, (b, hq, sq, dv)), dtype, order, 0)
    ref_o, ref_lse = reference.attention_fwd(qr, kr, vr, mask_type=m.mask_type, window_left=m.left,
                                             window_right=m.right, return_lse=True)
    o = upload_exact(to_bits(ref_o, dtype)[1], dtype, order)
    lse = cp.asarray(np.ascontiguousarray(ref_lse, dtype=np.float32))
    dq = make_strided((b, hq, sq, d), gorder, gpad, NAN_BITS[dtype])
    dk = make_strided((b, hk, sk, d), gorder, gpad, NAN_BITS[dtype])
    dv_ = make_strided((b, hk, sk, dv), gorder, gpad, NAN_BITS[dtype])
    kwargs = dict(dtype=dtype, q_ptr=q.ptr, k_ptr=k.ptr, v_ptr=v.ptr, o_ptr=o.ptr, lse_ptr=int(lse.data.ptr),
                  do_ptr=do.ptr, dq_ptr=dq.ptr, dk_ptr=dk.ptr, dv_ptr=dv_.ptr, batch=b, nhead_q=hq, nhead_k=hk,
                  hdim_q=d, hdim_v=dv, seqlen_q=sq, seqlen_k=sk, q_strides=q.strides, k_strides=k.strides,
                  v_strides=v.strides, o_strides=o.strides, do_strides=do.strides, dq_strides=dq.strides,
                  dk_strides=dk.strides, dv_strides=dv_.strides, lse_strides=(hq * sq, sq),
                  mask_type=m.mask_type, window_left=m.left, window_right=m.right)
    name, _ = run_bwd(lib, kwargs, deterministic)
    ref_dq, ref_dk, ref_dv = reference.attention_bwd(qr, kr, vr, dor, o=to_bits(ref_o, dtype)[1],
                                                     mask_type=m.mask_type, window_left=m.left, window_right=m.right)
    tol = reference.tolerances_bwd(dtype, d, dv)
    outs = {"dQ": download(dq, dtype), "dK": download(dk, dtype), "dV": download(dv_, dtype)}
    for label, out, ref in (("dQ", outs["dQ"], ref_dq), ("dK", outs["dK"], ref_dk), ("dV", outs["dV"], ref_dv)):
        assert_close(out, ref, tol, f"{label} ({name})")
    for label, t in (("dQ", dq), ("dK", dk), ("dV", dv_)):
        assert_outside_untouched(t, NAN_BITS[dtype], f"{label} ({name})")
    if deterministic:
        assert_reruns_bitwise_equal(lib, kwargs, outs, {"dQ": dq, "dK": dk, "dV": dv_}, dtype, name)
    return name


def assert_reruns_bitwise_equal(lib, kwargs, outs, tensors, dtype, name, reruns=2) -> None:
    """Deterministic mode: `reruns` more runs (3 in all) give the first run's gradients bit for bit."""
    for _ in range(reruns):
        run_bwd(lib, kwargs, True)
        for label, t in tensors.items():
            again = download(t, dtype)
            assert np.array_equal(outs[label].view(np.uint32), again.view(np.uint32)), \
                f"{label} differs bitwise between deterministic runs ({name})"


GROUP_CASES = [
    # dtype, hq, hk, seqlens_q, seqlens_k, d, dv, mask, deterministic, family (the runtime's choice, checked)
    ("bf16", 4, 2, [0, 7, 100, 33], [5, 0, 130, 64], 128, 128, "0", False, "hopper"),
    ("fp16", 2, 2, [65, 1, 129], [65, 200, 40], 64, 64, "t", True, "hopper"),  # deterministic dQ turns, per sequence
    ("bf16", 3, 1, [31, 0, 257], [64, 10, 255], 192, 128, "b", False, "hopper"),  # the (192, 128) instance
    ("fp16", 2, 1, [50, 120], [120, 50], 32, 32, "t:16,3", False, "hopper"),  # d32 on the Hopper d64 instance
    # Hopper group mode: tiles crossing into the next sequence, empty sequences on both sides, every mask kind, GQA
    ("bf16", 8, 2, [300, 1, 0, 129, 517], [257, 64, 9, 0, 1000], 128, 128, "b", False, "hopper"),
    ("fp16", 4, 4, [200, 333], [777, 45], 128, 128, "t:50,20", False, "hopper"),
    ("bf16", 6, 3, [191, 193, 385], [190, 500, 64], 64, 64, "g:40,9", False, "hopper"),
    ("fp16", 2, 1, [129, 64, 1], [1, 300, 257], 256, 256, "b:0,0", False, "hopper"),
    ("bf16", 4, 1, [1000, 24], [1000, 24], 64, 64, "0", False, "hopper"),
    ("fp16", 4, 2, [333, 0, 129], [200, 64, 500], 96, 96, "b", False, "hopper"),
    # deterministic Hopper group mode: turns per sequence, empty sequences, GQA, windows, the d256 atomics path
    ("bf16", 8, 2, [700, 0, 129, 1030], [900, 64, 0, 1030], 128, 128, "b", True, "hopper"),
    ("fp16", 4, 4, [513, 300], [800, 45], 64, 64, "t:150,30", True, "hopper"),
    ("bf16", 4, 2, [400, 257], [300, 600], 256, 256, "0", True, "hopper"),
]


# The GQA split in group mode: key blocks past a short sequence (the grid is sized by max_seqlen_k: those CTAs and
# their reductions return at once), empty sequences on either side, deterministic.
GQA_SPLIT_GROUP_CASES = [
    ("bf16", 8, 1, [300, 0, 129, 517], [257, 64, 0, 1000], 128, 128, "b", False, "hopper"),
    ("fp16", 6, 2, [700, 1, 0, 90], [650, 0, 33, 90], 64, 64, "t", True, "hopper"),
    ("bf16", 8, 2, [400, 0, 257], [300, 600, 0], 256, 256, "0", True, "hopper"),
    ("bf16", 8, 1, [31, 0, 257], [64, 10, 255], 192, 128, "t:50,20", False, "hopper"),
]


ODD_GROUP_CASES = [
    ("bf16", 4, 2, [0, 7, 100, 33], [5, 0, 130, 64], 59, 59, "0", False, "generic"),
    ("fp16", 2, 1, [65, 1, 129], [65, 200, 40], 111, 111, "t", True, "generic"),
    ("bf16", 3, 1, [31, 0, 157], [64, 10, 155], 111, 59, "b", False, "generic"),
]


@pytest.mark.parametrize("case", GROUP_CASES, ids=lambda c: "-".join(map(str, c)).replace(" ", ""))
def test_group_mode_gradients_match_reference(lib, case):
    check_group_mode(lib, case)


@pytest.mark.parametrize("case", GQA_SPLIT_GROUP_CASES, ids=lambda c: "-".join(map(str, c)).replace(" ", ""))
def test_gqa_split_group_mode(lib, case):
    check_group_mode(lib, case)


@pytest.mark.parametrize("case", ODD_GROUP_CASES, ids=lambda c: "-".join(map(str, c)).replace(" ", ""))
def test_odd_head_dims_group_mode(lib, case):
    check_group_mode(lib, case)


def check_group_mode(lib, case) -> str:
    dtype, hq, hk, lens_q, lens_k, d, dv, mask, deterministic, family = case
    rng = np.random.default_rng(sum(lens_q) * 13 + sum(lens_k))
    m = reference.parse_mask(mask)
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    q, qr = upload(uniform(rng, (1, hq, tq, d)), dtype, "bshd", 0)
    k, kr = upload(uniform(rng, (1, hk, tk, d)), dtype, "bshd", 0)
    v, vr = upload(uniform(rng, (1, hk, tk, dv)), dtype, "bshd", 0)
    do, dor = upload(uniform(rng, (1, hq, tq, dv)), dtype, "bshd", 0)
    packed = lambda a: a[0].transpose(1, 0, 2)  # noqa: E731  [1, h, total, d] -> [total, h, d]
    ref_o, ref_lse = reference.attention_varlen_fwd(packed(qr), packed(kr), packed(vr), cu_q, cu_k,
                                                    mask_type=m.mask_type, window_left=m.left, window_right=m.right,
                                                    return_lse=True)
    o_rounded = to_bits(ref_o, dtype)[1]  # [total, h, dv]
    o = upload_exact(o_rounded.transpose(1, 0, 2)[None], dtype, "bshd")
    lse = cp.asarray(np.ascontiguousarray(ref_lse, dtype=np.float32))  # [h, total_q]
    dq = make_strided((1, hq, tq, d), "bshd", 0, NAN_BITS[dtype])
    dk = make_strided((1, hk, tk, d), "bshd", 0, NAN_BITS[dtype])
    dv_ = make_strided((1, hk, tk, dv), "bshd", 0, NAN_BITS[dtype])
    seq_q, seq_k = cp.asarray(cu_q), cp.asarray(cu_k)
    kwargs = dict(dtype=dtype, q_ptr=q.ptr, k_ptr=k.ptr, v_ptr=v.ptr, o_ptr=o.ptr, lse_ptr=int(lse.data.ptr),
                  do_ptr=do.ptr, dq_ptr=dq.ptr, dk_ptr=dk.ptr, dv_ptr=dv_.ptr, batch=len(lens_q), nhead_q=hq,
                  nhead_k=hk, hdim_q=d, hdim_v=dv, seqlen_q=tq, seqlen_k=tk, q_strides=q.strides,
                  k_strides=k.strides, v_strides=v.strides, o_strides=o.strides, lse_strides=(0, tq),
                  seqstart_q_ptr=int(seq_q.data.ptr),
                  seqstart_k_ptr=int(seq_k.data.ptr), max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k),
                  mask_type=m.mask_type, window_left=m.left, window_right=m.right)
    name, _ = run_bwd(lib, kwargs, deterministic)
    assert "_group_" in name and f"_{family}_" in name, name
    ref_dq, ref_dk, ref_dv = reference.attention_varlen_bwd(
        packed(qr), packed(kr), packed(vr), packed(dor), cu_q, cu_k, o=o_rounded, mask_type=m.mask_type,
        window_left=m.left, window_right=m.right)
    tol = reference.tolerances_bwd(dtype, d, dv)
    assert_close(packed(download(dq, dtype)), ref_dq, tol, f"dQ ({name})")
    assert_close(packed(download(dk, dtype)), ref_dk, tol, f"dK ({name})")
    assert_close(packed(download(dv_, dtype)), ref_dv, tol, f"dV ({name})")
    if deterministic:
        outs = {"dQ": download(dq, dtype), "dK": download(dk, dtype), "dV": download(dv_, dtype)}
        assert_reruns_bitwise_equal(lib, kwargs, outs, {"dQ": dq, "dK": dk, "dV": dv_}, dtype, name)
    return name


# The swapped key split (tile b64x96, every plain (192, 128) instance's tile; fmha_bwd_hopper_kernel.hpp,
# consumer_swapped), on the profile's library: masks of every kind (an unbounded window, unmasked in effect, runs on
# the masked instance too), key tails of 96-key blocks, GQA / MQA, padded head dims, deterministic turns through the
# dQ writer, group mode with empty sequences on both sides. Each case must name the b64x96 instance.
BWD96_BATCH_CASES = [
    ("bf16", 2, 4, 4, 333, 517, 192, 128, "bshd", "bshd", 0, "b", False),
    ("fp16", 1, 4, 1, 700, 650, 192, 128, "bhsd", "bhsd", 0, "t", False),
    ("bf16", 1, 6, 2, 257, 1000, 192, 128, "bshd", "bhsd", 0, "t:128,30", False),
    ("bf16", 1, 4, 2, 500, 400, 192, 128, "bhsd", "bhsd", 0, "t:-1,-1", False),
    ("fp16", 1, 4, 2, 640, 777, 192, 128, "bshd", "bshd", 0, "b", True),
    ("bf16", 1, 2, 2, 130, 97, 176, 120, "bshd", "bshd", 0, "g:30,7", False),  # gradients 16-byte aligned: Hopper
    ("bf16", 1, 8, 8, 1024, 1024, 192, 128, "bhsd", "bhsd", 0, "t", False),
]
BWD96_GROUP_CASES = [
    ("bf16", 3, 1, [31, 0, 257], [64, 10, 255], 192, 128, "b", False, "hopper"),
    ("fp16", 4, 2, [300, 1, 0, 129], [257, 64, 9, 0], 192, 128, "t:50,20", True, "hopper"),
]


@pytest.mark.parametrize("case", BWD96_BATCH_CASES, ids=lambda c: "-".join(map(str, c)))
def test_bwd96_swapped_key_split_batch(lib, case):
    name = check_batch_mode(lib, case)
    assert name.endswith("_hopper_b64x96"), name


@pytest.mark.parametrize("case", BWD96_GROUP_CASES, ids=lambda c: "-".join(map(str, c)).replace(" ", ""))
def test_bwd96_swapped_key_split_group(lib, case):
    name = check_group_mode(lib, case)
    assert name.endswith("_hopper_b64x96"), name


def test_missing_or_small_workspace_launches_nothing(lib):
    b, h, s, d = 1, 2, 256, 128
    q = make_strided((b, h, s, d), "bhsd", 0, 0)
    lse = cp.zeros(b * h * s, dtype=cp.float32)
    kwargs = dict(dtype="bf16", q_ptr=q.ptr, k_ptr=q.ptr, v_ptr=q.ptr, o_ptr=q.ptr, lse_ptr=int(lse.data.ptr),
                  do_ptr=q.ptr, dq_ptr=q.ptr, dk_ptr=q.ptr, dv_ptr=q.ptr, batch=b, nhead_q=h, nhead_k=h, hdim_q=d,
                  hdim_v=d, seqlen_q=s, seqlen_k=s, q_strides=q.strides, k_strides=q.strides, v_strides=q.strides,
                  o_strides=q.strides, lse_strides=(h * s, s))
    args = _capi.make_bwd_args(**kwargs)
    need = lib.workspace_size(args)
    if need == 0:
        pytest.skip("the chosen instance needs no workspace")
    before = cp.asnumpy(q.storage)
    assert lib.mha_bwd_raw(args) == _capi.ERROR_INVALID_ARGS
    assert "workspace is too small" in lib.last_error()
    small = cp.empty(need // 2, dtype=cp.uint8)
    args = _capi.make_bwd_args(**kwargs, workspace_ptr=int(small.data.ptr), workspace_bytes=need // 2)
    assert lib.mha_bwd_raw(args) == _capi.ERROR_INVALID_ARGS
    cp.cuda.runtime.deviceSynchronize()
    assert np.array_equal(before, cp.asnumpy(q.storage)), "a refused call wrote to the outputs"


def test_benchmark_smoke_subset(lib):
    """benchmark_mha_bwd over the quick slice of the smoke grid (the full grid runs in smoke_tests/)."""
    bench = Path(lib.path).parent / "benchmark_mha_bwd"
    proc = subprocess.run(["bash", str(REPO / "smoke_tests" / "smoke_test_bwd.sh"), "-q", "-j", "0"],
                          capture_output=True, text=True, timeout=1200, env=dict(os.environ, BENCH=str(bench)))
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " 0 failed" in proc.stdout
