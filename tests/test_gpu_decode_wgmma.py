"""decode_tma's wgmma consumers (sm_90a, csrc/kernels/decode/fmha_fwd_splitkv_wgmma.cuh) on the GPU, against
mhakit.reference.attention_fwd_kvcache: the instance the runtime picks by packed rows per kv head (seqlen_q x
nhead_q / nhead_k; the catalogue's min_rows: the mma.sync tile below the one-warpgroup tile's, the two-warpgroup tile
from its own) and that its result is right. 64 packed rows (32/8 x 16, 16/4 x 16, 64/8 x 8), 96 (one chunk and one
with 32 padded rows), 128 (64/8 x 16: two warpgroups), 192 (a padded two-warpgroup chunk); contiguous caches and pages
of 64 and 256 rows; ragged cache lengths incl. 0 and lengths inside a block (the producer's cp.async tail, whose
rows past the end are NaN in the cache); causal and sliding-window masks (bottom-right, per packed row's query);
appended rows; cache_batch_idx; forced splits (2, 5, 7: some parts empty) and the heuristic; fp16 and bf16; d64;
d72 and d96 (a partial box), d128 x d_v 64 and d64 x d_v 128 (a V or K box past the head dim: zeroed once per slot)."""
from __future__ import annotations


import numpy as np
import pytest

import mhakit
from codegen import profiles
from test_python_gpu import kernel_cache  # noqa: F401 (fixture)
from test_python_gpu_kvcache import make_case
from test_python_gpu_kvcache_tma import device_is_sm90, run_decode_case

pytestmark = [pytest.mark.gpu, pytest.mark.compile]

cp = pytest.importorskip("cupy")


def expected_tile(dtype: str, d: int, dv: int, rows: int) -> str:
    """The decode_tma tile token the runtime picks (catalogue data: the bucket's tiles and their min_rows)."""
    bucket = 64 if max(d, dv) <= 64 else 128
    specs = [s for s in profiles.select("fwd", "sm_90a", "default",
                                        f"splitkv_d{bucket}_{dtype}_batch_mask_sm90a_decode_tma_").specs]
    best = max(specs, key=lambda s: (rows >= dict(s.algorithm.tile).get("min_rows", 0),
                                     dict(s.algorithm.tile).get("min_rows", 0)))
    return best.algorithm.tile_token


CASES = [
    # dtype, b, sq, hq, hk, d, dv, cache lengths, page, s_new, cache_batch_idx, mask kwargs, num_splits
    ("bf16", 3, 16, 32, 8, 128, 128, [0, 17, 4096], 0, 0, False, {}, 0),                       # 64 rows
    ("bf16", 2, 16, 32, 8, 128, 128, [1000, 4097], 64, 0, False, {"causal": True}, 3),
    ("fp16", 2, 16, 16, 4, 128, 128, [700, 33], 256, 2, False, {"causal": True}, 0),          # GQA 4
    ("bf16", 2, 8, 64, 8, 128, 128, [2100, 65], 64, 1, False, {"window": (300, 0)}, 0),       # s_q 8
    ("bf16", 3, 16, 32, 8, 128, 128, [500, 7, 1], 0, 2, True, {}, 5),                         # cache_batch_idx
    ("bf16", 2, 12, 64, 8, 128, 128, [3000, 129], 256, 0, False, {"causal": True}, 0),        # 96 rows
    ("bf16", 2, 16, 64, 8, 128, 128, [5000, 63], 0, 0, False, {}, 0),                         # 128: 2 warpgroups
    ("fp16", 2, 16, 64, 8, 128, 128, [2048, 777], 64, 3, False, {"causal": True}, 7),
    ("bf16", 2, 16, 64, 8, 128, 128, [4100, 0], 256, 0, False, {"window": (100, 3)}, 2),
    ("bf16", 1, 12, 128, 8, 128, 128, [3333], 0, 0, False, {"causal": True}, 0),              # 192 rows
    ("bf16", 2, 16, 32, 8, 64, 64, [1111, 250], 64, 1, False, {"causal": True}, 0),           # d64
    ("fp16", 2, 16, 32, 8, 72, 72, [300, 999], 0, 0, False, {}, 2),                           # partial box
    ("bf16", 2, 16, 64, 8, 96, 96, [640, 1], 64, 0, False, {"causal": True}, 0),
    ("bf16", 2, 16, 32, 8, 128, 64, [1500, 64], 0, 1, False, {}, 0),                          # d != d_v
    ("fp16", 2, 16, 32, 8, 64, 128, [700, 1], 64, 0, False, {}, 2),                           # a K box unloaded
    ("bf16", 2, 16, 32, 8, 128, 128, [0, 0], 64, 0, False, {}, 0),                            # empty caches
    ("bf16", 2, 16, 16, 8, 128, 128, [900, 90], 0, 0, False, {"causal": True}, 0),            # 32: mma.sync
]


def case_id(c) -> str:
    return "-".join(map(str, c[:11])) + f"-{c[12]}"


@pytest.mark.parametrize("path", ["c", "python"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_decode_wgmma(case, path, monkeypatch, capfd):
    dtype, b, sq, hq, hk, d, dv = case[:7]
    run_decode_case(case, path, monkeypatch, capfd,
                    rf"_sm90a_decode_tma_{expected_tile(dtype, d, dv, sq * hq // hk)}$")


def test_decode_wgmma_repeats_bitwise():
    """The same call twice gives the same bits (ring phases, split partials): a long paged cache, 128 rows (two
    warpgroups) and 64 rows (one), with the heuristic's splits."""
    if not device_is_sm90():
        pytest.skip("decode_tma is built for sm_90a only")
    from test_python_gpu import host_of
    for hq in (64, 32):
        rng = np.random.default_rng(hq)
        _, dev = make_case(rng, "bf16", 2, 16, hq, 8, 128, 128, [16384, 9001], 64, 0, False)
        first = host_of(mhakit.mha_fwd_kvcache(**dev, dtype="bf16")).tobytes()
        for _ in range(2):
            assert host_of(mhakit.mha_fwd_kvcache(**dev, dtype="bf16")).tobytes() == first
