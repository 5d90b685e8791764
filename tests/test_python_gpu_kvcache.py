"""mhakit.mha_fwd_kvcache on the GPU against mhakit.reference.attention_fwd_kvcache, with CuPy arrays (and PyTorch
where it is installed: the C call path through its DLPack exchange table): contiguous and paged caches (pages of
1, 16, 256), GQA 1/4/8, masks, appended rows (checked in the cache afterwards too), cache_batch_idx, forced and
heuristic splits, both call paths."""
from __future__ import annotations

import zlib

import numpy as np
import pytest

import mhakit
from mhakit import reference
from test_python_gpu import assert_close, host_of, kernel_cache, round_to, to_float, torch  # noqa: F401 (fixture)

pytestmark = [pytest.mark.gpu, pytest.mark.compile]

cp = pytest.importorskip("cupy")


def make_case(rng, dtype, b, sq, hq, hk, d, dv, lens, page, s_new, cache_batch_idx):
    """Host values (rounded) and device arrays of one decode call. Paged: pages shuffled; rows past each batch's
    length are NaN (a kernel reading them fails)."""
    lens = np.asarray(lens)
    cap = int(lens.max()) + s_new + 3
    qh, qr = round_to(rng.standard_normal((b, sq, hq, d)), dtype)
    nan = np.float32("nan")
    kc = np.full((b + (1 if cache_batch_idx else 0), cap, hk, d), nan, np.float32)
    vc = np.full(kc.shape[:3] + (dv,), nan, np.float32)
    for i in range(kc.shape[0]):
        n = int(lens[i]) if i < b else cap
        kc[i, :n] = rng.standard_normal((n, hk, d))
        vc[i, :n] = rng.standard_normal((n, hk, dv))
    kch, kcr = round_to(kc, dtype)
    vch, vcr = round_to(vc, dtype)
    knh, knr = round_to(rng.standard_normal((b, s_new, hk, d)), dtype)
    vnh, vnr = round_to(rng.standard_normal((b, s_new, hk, dv)), dtype)
    idx = np.roll(np.arange(b + 1), 1)[:b].astype(np.int32) if cache_batch_idx else None
    if idx is not None:  # batch i reads cache batch idx[i]: move its rows there, with its own length
        kch2, kcr2, vch2, vcr2 = kch.copy(), kcr.copy(), vch.copy(), vcr.copy()
        for i in range(b):
            kch2[idx[i]], kcr2[idx[i]], vch2[idx[i]], vcr2[idx[i]] = kch[i], kcr[i], vch[i], vcr[i]
        kch, kcr, vch, vcr = kch2, kcr2, vch2, vcr2
    table = None
    if page:
        blocks = -(-cap // page)
        ids = rng.permutation(b * blocks).astype(np.int32)
        table = ids.reshape(b, blocks)
        def paged(x):
            out = np.zeros((b * blocks, page) + x.shape[2:], x.dtype)
            for i in range(b):
                for j in range(cap):
                    out[table[i, j // page], j % page] = x[i, j]
            return out
        kch, kcr, vch, vcr = paged(kch), paged(kcr), paged(vch), paged(vcr)
    host = dict(q=qr, k_cache=kcr, v_cache=vcr, cache_seqlens=lens, block_table=table, cache_batch_idx=idx,
                k=knr if s_new else None, v=vnr if s_new else None)
    dev = dict(q=cp.asarray(qh), k_cache=cp.asarray(kch), v_cache=cp.asarray(vch),
               cache_seqlens=cp.asarray(lens.astype(np.int32)),
               block_table=None if table is None else cp.asarray(table),
               cache_batch_idx=None if idx is None else cp.asarray(idx),
               k=cp.asarray(knh) if s_new else None, v=cp.asarray(vnh) if s_new else None)
    return host, dev


CASES = [
    # dtype, b, sq, hq, hk, d, dv, cache lengths, page, s_new, cache_batch_idx, mask kwargs, num_splits
    ("bf16", 4, 1, 32, 8, 128, 128, [0, 17, 1000, 4096], 0, 0, False, {}, 0),
    ("fp16", 3, 4, 32, 8, 128, 128, [63, 1, 300], 16, 3, False, {"causal": True}, 0),
    ("bf16", 2, 16, 16, 2, 128, 128, [100, 2000], 256, 0, False, {"window": (64, 0)}, 3),
    ("bf16", 2, 16, 32, 4, 128, 128, [700, 33], 0, 2, False, {"causal": True}, 0),     # row split: 64 rows
    ("fp16", 2, 2, 8, 8, 128, 128, [500, 129], 1, 1, False, {"causal": True}, 0),      # pages of 1, MHA
    ("bf16", 3, 1, 8, 4, 128, 128, [500, 7, 1], 0, 2, True, {}, 0),                    # cache_batch_idx + new rows
    ("fp16", 2, 3, 8, 2, 64, 64, [700, 33], 16, 0, False, {"causal": True}, 0),
    ("bf16", 2, 2, 8, 1, 256, 256, [300, 1024], 0, 1, False, {}, 0),
    ("fp16", 2, 5, 6, 3, 59, 100, [77, 250], 0, 1, False, {"causal": True}, 2),        # d != d_v, odd head dim
    ("bf16", 2, 2, 8, 2, 128, 128, [0, 0], 16, 0, False, {}, 0),                      # empty caches
]


@pytest.mark.parametrize("path", ["c", "python"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:11])) + "-" + str(c[12]))
def test_mha_fwd_kvcache(case, path, monkeypatch):
    from mhakit import _ext
    if path == "python":
        monkeypatch.setenv(_ext.ENV_DISABLE, "1")
    else:
        monkeypatch.delenv(_ext.ENV_DISABLE, raising=False)
    _ext.reset()
    dtype, b, sq, hq, hk, d, dv, lens, page, s_new, use_idx, mask_kwargs, splits = case
    rng = np.random.default_rng(zlib.crc32(repr(case[:11]).encode()))
    host, dev = make_case(rng, dtype, b, sq, hq, hk, d, dv, lens, page, s_new, use_idx)
    o, lse = mhakit.mha_fwd_kvcache(**dev, num_splits=splits, return_lse=True,
                                    dtype="bf16" if dtype == "bf16" else None, **mask_kwargs)
    cp.cuda.runtime.deviceSynchronize()
    check_against_reference(host, dev, o, lse, dtype, mask_kwargs, s_new)
    _ext.reset()


def check_against_reference(host, dev, o, lse, dtype, mask_kwargs, s_new) -> None:
    """O and LSE of a decode call against the NumPy reference, and (s_new > 0) the appended rows in the cache."""
    mask_type, left, right = mhakit.api._resolve_mask(mask_kwargs.get("causal", False), None,
                                                      mask_kwargs.get("window"))
    ref_o, ref_lse, ref_kc, _ = reference.attention_fwd_kvcache(
        **host, mask_type=mask_type, window_left=left, window_right=right, return_lse=True)
    assert_close(to_float(host_of(o), dtype), ref_o, dtype, "O")
    assert_close(host_of(lse), ref_lse, "fp16", "LSE")
    if s_new:  # the new rows are in the cache now, where the reference put them
        kc = to_float(cp.asnumpy(dev["k_cache"]), dtype)
        new_rows = ~np.isnan(ref_kc) & np.isnan(host["k_cache"])
        assert np.array_equal(kc[new_rows], ref_kc[new_rows])


@pytest.mark.skipif(torch is None, reason="PyTorch with CUDA is not installed")
def test_torch_tensors_and_out_on_the_c_path(c_path):
    """torch tensors (bf16 natively) through the exchange table: O comes back as a torch tensor; out= is filled;
    a host list of cache lengths takes the Python path (which returns a mhakit.DeviceArray) and agrees."""
    b, sq, hq, hk, d, cap = 2, 1, 16, 4, 128, 512
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16)
    kc = torch.randn(b, cap, hk, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn(b, cap, hk, d, device="cuda", dtype=torch.bfloat16)
    lens = torch.tensor([300, 512], device="cuda", dtype=torch.int32)
    o = mhakit.mha_fwd_kvcache(q, kc, vc, lens, causal=True)
    assert isinstance(o, torch.Tensor) and o.shape == (b, sq, hq, d) and o.dtype == torch.bfloat16
    out = torch.empty_like(o)
    mhakit.mha_fwd_kvcache(q, kc, vc, lens, causal=True, out=out, num_splits=5)
    o_host = torch.from_dlpack(mhakit.mha_fwd_kvcache(q, kc, vc, [300, 512], causal=True))  # Python path: DeviceArray
    torch.cuda.synchronize()
    ref = reference.attention_fwd_kvcache(q.float().cpu().numpy(), kc.float().cpu().numpy(),
                                          vc.float().cpu().numpy(), [300, 512], mask_type=2, window_right=0)[0]
    for got in (o, out, o_host):
        assert_close(got.float().cpu().numpy(), ref, "bf16", "O")
