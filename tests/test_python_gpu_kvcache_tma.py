"""The decode_tma family (sm_90a: TMA producer warp, mbarrier ring) on the GPU, against
mhakit.reference.attention_fwd_kvcache: which family serves a call (the instance name the library prints at log level
1) and that its result is right. Contiguous caches and pages of 64, 192 (not a power of two) and 256 rows (whole
64-key blocks: decode_tma), pages of 16 and head dims that are not multiples of 8 (refused by its guards: the decode
family serves them); ragged cache lengths incl. 0 and lengths that end inside a block (the producer's cp.async tail);
GQA 1 / 3 / 4 / 8; s_q 1 / 4 / 8 / 16: the one-row-tile kernel, the key split (up to 32 packed rows) and the row
split (48 rows: one chunk with padded rows; 64 and 128 rows now go to the wgmma tiles, which the family's name
pattern below still matches; tests/test_gpu_decode_wgmma.py checks which tile); forced splits (2, 3, 7: some parts empty) and the
heuristic; causal and sliding-window masks; appended rows; cache_batch_idx; d64, d128, d72 and d != d_v (a V box
left unread). Caches hold NaN past each
batch's length (make_case), so a kernel that computed on those rows fails."""
from __future__ import annotations

import re
import zlib

import numpy as np
import pytest

import mhakit
from test_python_gpu import host_of, kernel_cache  # noqa: F401 (fixture)
from test_python_gpu_kvcache import check_against_reference, make_case

pytestmark = [pytest.mark.gpu, pytest.mark.compile]

cp = pytest.importorskip("cupy")


def device_is_sm90() -> bool:
    try:
        return cp.cuda.Device().compute_capability == "90"
    except Exception:  # no device: the gpu marker's skip applies
        return False


CASES = [
    # dtype, b, sq, hq, hk, d, dv, cache lengths, page, s_new, cache_batch_idx, mask kwargs, num_splits, family
    ("bf16", 4, 1, 32, 8, 128, 128, [0, 17, 1000, 4096], 0, 0, False, {}, 0, "decode_tma"),
    ("fp16", 4, 1, 32, 8, 128, 128, [64, 4033, 1, 640], 64, 0, False, {}, 0, "decode_tma"),
    ("bf16", 3, 1, 8, 8, 128, 128, [5000, 63, 65], 256, 0, False, {}, 7, "decode_tma"),      # MHA, 7 splits
    ("bf16", 2, 4, 32, 4, 128, 128, [700, 2049], 192, 0, False, {"causal": True}, 2, "decode_tma"),  # 32 rows
    ("fp16", 3, 4, 32, 8, 128, 128, [63, 1, 300], 64, 3, False, {"causal": True}, 0, "decode_tma"),
    ("bf16", 2, 1, 64, 8, 128, 128, [2048, 777], 64, 0, False, {}, 0, "decode_tma"),          # GQA 8
    ("bf16", 2, 16, 8, 8, 128, 128, [100, 2000], 0, 0, False, {"window": (64, 0)}, 3, "decode_tma"),
    ("bf16", 2, 16, 16, 16, 128, 128, [3000, 129], 256, 2, False, {"causal": True}, 0, "decode_tma"),
    ("bf16", 3, 1, 8, 4, 128, 128, [500, 7, 1], 0, 2, True, {}, 0, "decode_tma"),             # cache_batch_idx
    ("fp16", 2, 3, 8, 2, 64, 64, [700, 33], 64, 0, False, {"causal": True}, 0, "decode_tma"),
    ("bf16", 2, 2, 8, 8, 64, 64, [4100, 0], 0, 1, False, {"window": (100, 3)}, 7, "decode_tma"),
    ("fp16", 2, 1, 16, 2, 128, 64, [1111, 250], 0, 1, False, {}, 2, "decode_tma"),            # d != d_v
    ("bf16", 2, 4, 8, 2, 72, 72, [300, 999], 64, 0, False, {"causal": True}, 0, "decode_tma"),  # partial box
    ("bf16", 2, 2, 8, 2, 128, 128, [0, 0], 64, 0, False, {}, 0, "decode_tma"),                # empty caches
    # the key split's two row tiles, partly padded: 20 and 24 rows
    ("fp16", 2, 4, 20, 4, 128, 128, [333, 1025], 0, 0, False, {"causal": True}, 0, "decode_tma"),
    ("bf16", 2, 3, 32, 4, 64, 64, [100, 2000], 0, 0, False, {}, 2, "decode_tma"),
    # the row split: 64 rows (one chunk), 48 (a chunk with 16 padded rows), 128 (two chunks)
    ("fp16", 2, 16, 32, 8, 128, 128, [700, 33], 0, 2, False, {"causal": True}, 0, "decode_tma"),
    ("bf16", 2, 16, 24, 8, 128, 128, [1000, 4097], 64, 0, False, {"causal": True}, 3, "decode_tma"),
    ("bf16", 2, 16, 64, 8, 128, 128, [2100, 65], 256, 1, False, {"window": (300, 0)}, 0, "decode_tma"),
    ("fp16", 2, 8, 64, 8, 64, 64, [999, 1500], 0, 0, False, {"causal": True}, 7, "decode_tma"),
    # refused by decode_tma's guards: the decode family serves them
    ("bf16", 3, 1, 32, 8, 128, 128, [300, 17, 1000], 16, 0, False, {}, 0, "decode"),          # pages of 16
    ("bf16", 2, 4, 8, 2, 59, 100, [77, 250], 0, 1, False, {"causal": True}, 2, "decode"),     # head dims
]


def case_id(c) -> str:
    return "-".join(map(str, c[:11])) + f"-{c[12]}-{c[13]}"


@pytest.mark.parametrize("path", ["c", "python"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_decode_tma(case, path, monkeypatch, capfd):
    run_decode_case(case[:13], path, monkeypatch, capfd, rf"_sm90a_{case[13]}_b")


def run_decode_case(case, path, monkeypatch, capfd, instance_pattern: str) -> None:
    """One mha_fwd_kvcache call of case (CASES' first 13 fields) on the C or the pure-Python call path against the
    reference; on the Python path every instance the library names must match instance_pattern."""
    from mhakit import _ext
    if not device_is_sm90():
        pytest.skip("decode_tma is built for sm_90a only")
    if path == "python":
        monkeypatch.setenv(_ext.ENV_DISABLE, "1")
    else:
        monkeypatch.delenv(_ext.ENV_DISABLE, raising=False)
    _ext.reset()
    dtype, b, sq, hq, hk, d, dv, lens, page, s_new, use_idx, mask_kwargs, splits = case
    rng = np.random.default_rng(zlib.crc32(repr(case[:11]).encode()))
    host, dev = make_case(rng, dtype, b, sq, hq, hk, d, dv, lens, page, s_new, use_idx)
    if path == "python":  # the library names the instance it launches (log level 1; the Python path flushes it)
        monkeypatch.setattr(mhakit.api, "LOG_LEVEL", 1)
        capfd.readouterr()
    o, lse = mhakit.mha_fwd_kvcache(**dev, num_splits=splits, return_lse=True,
                                    dtype="bf16" if dtype == "bf16" else None, **mask_kwargs)
    cp.cuda.runtime.deviceSynchronize()
    if path == "python":
        names = re.findall(r"mha_fwd_splitkv -> (\S+)", capfd.readouterr().out)
        assert names and all(re.search(instance_pattern, n) for n in names), (names, instance_pattern)
    check_against_reference(host, dev, o, lse, dtype, mask_kwargs, s_new)
    _ext.reset()


def test_decode_tma_repeats_bitwise():
    """The same call twice gives the same bits (the ring's phases and the split partials carry no state across
    calls); a long cache with the heuristic's splits, paged."""
    if not device_is_sm90():
        pytest.skip("decode_tma is built for sm_90a only")
    rng = np.random.default_rng(7)
    _, dev = make_case(rng, "bf16", 2, 1, 32, 8, 128, 128, [16384, 9001], 64, 0, False)
    first = host_of(mhakit.mha_fwd_kvcache(**dev, dtype="bf16")).tobytes()
    for _ in range(3):
        assert host_of(mhakit.mha_fwd_kvcache(**dev, dtype="bf16")).tobytes() == first
