"""The decode family's split heuristic (csrc/kernels/decode/split_heuristic.h, host C++ only), compiled with the
system C++ compiler and asked about grids of every size on 132 SMs with waves of one (the TMA-ring kernels, decode_tma
and its wgmma tiles), two and three (the generic decode kernel d128) CTAs per SM: it never splits a grid whose waves
are already 85 % busy, never cuts more parts than key blocks or MHAKIT_MAX_SPLITS, leaves no part empty, and where it
splits the call is shorter in its time model (waves x (blocks per part + 2)) than unsplit; issue 10's rows get the
counts measured best on the H200 (TMA ring, one CTA per SM: b=1 32/8 s_k=32k 16 parts, b=8 64/8 s_k=64k 2, b=16 32/8
s_k=8k unsplit; generic kernel, three per SM: 512 CTAs in 396 slots, 3)."""
from __future__ import annotations

import subprocess

import pytest

from host_check import build_cpp


PROGRAM = r'''
#include <cstdio>
#include <initializer_list>
#include "kernels/decode/split_heuristic.h"
int main() {
    const int sms = 132;
    for (int per_sm : {1, 2, 3})
        for (long long ctas : {1LL, 8LL, 32LL, 64LL, 128LL, 300LL, 317LL, 512LL, 4096LL})
            for (int blocks : {0, 1, 2, 7, 32, 64, 128, 512, 1024, 100000})
                std::printf("%d %lld %d %d\n", per_sm, ctas, blocks,
                            mhakit::decode::choose_num_splits(ctas, blocks, sms, per_sm));
    std::printf("nosm %d\n", mhakit::decode::choose_num_splits(8, 512, 0, 3));
    return 0;
}
'''


@pytest.fixture(scope="module")
def answers(tmp_path_factory):
    exe = build_cpp(tmp_path_factory.mktemp("heuristic"), "main", PROGRAM)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.splitlines()
    rows = [tuple(int(x) for x in line.split()) for line in out if not line.startswith("nosm")]
    nosm = int(next(line for line in out if line.startswith("nosm")).split()[1])
    return rows, nosm


def test_split_counts_are_bounded_and_leave_no_part_empty(answers):
    rows, nosm = answers
    assert nosm == 1  # no SM count: no split
    for per_sm, ctas, blocks, splits in rows:
        assert 1 <= splits <= max(1, min(blocks, 128)), (per_sm, ctas, blocks, splits)
        if splits > 1:
            per = -(-blocks // splits)
            assert -(-blocks // per) == splits, (per_sm, ctas, blocks, splits)  # every part gets a block


def busy(ctas, splits, slots):
    """Fraction of the launched waves' CTA slots that hold a CTA."""
    return ctas * splits / slots / -(-ctas * splits // slots)


def model_time(ctas, blocks, splits, slots):
    """The heuristic's time model: waves x (blocks per part + the fixed cost of a CTA, 2 blocks)."""
    return -(-ctas * splits // slots) * (-(-blocks // splits) + 2)


def test_busy_grids_are_not_split_and_splits_shorten_the_call(answers):
    rows, _ = answers
    for per_sm, ctas, blocks, splits in rows:
        slots = 132 * per_sm
        if busy(ctas, 1, slots) >= 0.85 or blocks <= 1:
            assert splits == 1, (per_sm, ctas, blocks, splits)
        elif splits > 1:
            assert model_time(ctas, blocks, splits, slots) < model_time(ctas, blocks, 1, slots), \
                (per_sm, ctas, blocks, splits)
    table = {(p, c, b): s for p, c, b, s in rows}
    assert table[(3, 512, 64)] == 3      # decode, b=64 32/8 s_k=4096: measured 3.35 -> 3.84 TB/s with 3 splits
    assert table[(3, 4096, 64)] == 1     # 10.3 waves: 94 % busy already
    # decode_tma (one CTA per SM), measured with bench_decode.py --num-splits N on the H200 (TB/s):
    assert table[(1, 8, 512)] == 16      # b=1 32/8 s_k=32k: 128 CTAs of 32 blocks, 3.22 (32 parts: 3.06)
    assert table[(1, 128, 128)] == 1     # b=16 32/8 s_k=8192: 128 CTAs, 4.20 (2 parts: 4.06)
    assert table[(1, 64, 1024)] == 2     # b=8 64/8 s_k=64k: 128 CTAs, 4.45 (4 parts: 4.36)
    assert table[(1, 512, 64)] == 1      # b=64 32/8 s_k=4096: 3.9 waves, 97 % busy, 4.30 (best)
    assert table[(2, 8, 512)] == 32      # the model at two per SM: 256 CTAs of 16 blocks, one wave
