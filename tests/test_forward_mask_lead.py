"""The Hopper forward's query blocks (csrc/kernels/hopper/fmha_hopper_mask.hpp, ForwardMask) against brute force over
mask.h's visibility rule: with kPartialFirst (the three-warpgroup masked tiles) the blocks start lead_tiles(s_q) whole
64-row tiles before the sequence, so that the block of fewer rows is the first. For every mask kind and a sweep of
lengths: the blocks are as many as without the lead, every row lies in exactly one warpgroup of one block, no
warpgroup of the last block lies past the sequence (what the lead is for), only block 0 holds rows before it, and
each block's key tiles (visited, and those that need no element-wise mask) are exactly those of its rows. Host code
compiled by nvcc (the header includes CuTe), run on the CPU."""
from __future__ import annotations

import pytest

from host_check import run_host_check

ARCH = "sm_90a"

PROGRAM = r"""
#include <cstdio>
#include "kernels/hopper/fmha_hopper_mask.hpp"

using namespace mhakit;
using namespace mhakit::hopper;

template <bool kMasked, int kBM, int kBN, bool kPartialFirst>
void check(int type, int left, int right, int sq, int sk) {
    const MaskCoord c = make_clamped_mask_coord(kMasked ? type : 0, left, right, sq, sk);
    const ForwardMask<kMasked, kBM, kBN, kPartialFirst> mask(c, sq, sk);
    auto vis = [&](int i, int j) { return j >= 0 && j < sk && mask_visible(c, i, j, sk); };
    const int blocks = (sq + kBM - 1) / kBM, n_tiles = (sk + kBN - 1) / kBN, wgs = kBM / 64;
    const int lead = ForwardMask<kMasked, kBM, kBN, kPartialFirst>::lead_tiles(sq);
    EXPECT(lead >= 0 && lead < wgs && (kPartialFirst || lead == 0), "lead %d, s_q %d", lead, sq);
    EXPECT(sq + 64 * lead <= blocks * kBM, "the lead adds a block: s_q %d lead %d", sq, lead);
    EXPECT(mask.block_row0(0) == -64 * lead, "block 0 starts at %d, lead %d", mask.block_row0(0), lead);
    // every row in exactly one warpgroup of one block
    for (int i = 0; i < sq; ++i) {
        int owners = 0;
        for (int m = 0; m < blocks; ++m)
            for (int w = 0; w < wgs; ++w) {
                const int r = mask.block_row0(m) + 64 * w;
                owners += (i >= r && i < r + 64);
            }
        EXPECT(owners == 1, "row %d of s_q %d in %d warpgroups", i, sq, owners);
    }
    for (int m = 1; m < blocks; ++m) EXPECT(mask.block_row0(m) >= 0, "block %d starts before the sequence", m);
    if (kPartialFirst) EXPECT(mask.block_row0(blocks - 1) + kBM - 64 < sq, "s_q %d: the last block has an empty warpgroup", sq);
    // each block's key tiles, from its rows in the sequence
    for (int m = 0; m < blocks; ++m) {
        const int first_row = mask.block_row0(m) > 0 ? mask.block_row0(m) : 0;
        const int end_row = mask.block_row0(m) + kBM < sq ? mask.block_row0(m) + kBM : sq;
        EXPECT(first_row < end_row, "block %d of s_q %d holds no row", m, sq);
        const KeyTiles t = mask.key_tiles(m);
        int first = -1, last = -1;
        for (int n = 0; n < n_tiles; ++n) {
            bool any = false, all = true;
            for (int i = first_row; i < end_row; ++i)
                for (int j = n * kBN; j < (n + 1) * kBN; ++j) {
                    const bool v = vis(i, j);
                    any = any || v;
                    all = all && v;
                }
            if (any) { if (first < 0) first = n; last = n; }
            EXPECT(t.full.contains(n) == all, "full m%d n%d t%d %d,%d %dx%d", m, n, type, left, right, sq, sk);
        }
        if (first < 0) EXPECT(t.visit.end - t.visit.begin == 1, "m%d sees no key: one tile, not [%d,%d) t%d %d,%d %dx%d", m, t.visit.begin, t.visit.end, type, left, right, sq, sk);
        else EXPECT(t.visit.begin == first && t.visit.end == last + 1, "visit m%d [%d,%d) vs [%d,%d] t%d %d,%d %dx%d", m, t.visit.begin, t.visit.end, first, last, type, left, right, sq, sk);
    }
}

template <int kBM, int kBN, bool kPartialFirst>
void sweep() {
    const int lens_q[] = {1, 2, 63, 64, 65, 127, 128, 129, 191, 192, 193, 255, 256, 257, 320, 383, 384, 385, 449, 577, 1000, 1024};
    const int lens_k[] = {1, 100, 300, 1024};
    for (int sq : lens_q)
        for (int sk : lens_k) {
            check<false, kBM, kBN, kPartialFirst>(0, -1, -1, sq, sk);
            check<true, kBM, kBN, kPartialFirst>(1, -1, 0, sq, sk);     // causal, top-left
            check<true, kBM, kBN, kPartialFirst>(2, -1, 0, sq, sk);     // causal, bottom-right
            check<true, kBM, kBN, kPartialFirst>(1, 128, 16, sq, sk);   // windows
            check<true, kBM, kBN, kPartialFirst>(2, 300, 0, sq, sk);
            check<true, kBM, kBN, kPartialFirst>(2, 0, 40, sq, sk);
            check<true, kBM, kBN, kPartialFirst>(3, 40, 9, sq, sk);     // generic (y, x)
            check<true, kBM, kBN, kPartialFirst>(3, -3, 64, sq, sk);
        }
}

int main() {
    sweep<192, 128, true>();   // the d64 masked tile (kPartialFirst)
    sweep<192, 128, false>();  // its unmasked / modifier twins: no lead
    sweep<128, 128, false>();
    sweep<128, 64, false>();
    std::printf("checked %d failures %d\n", checked, failures);
    return failures != 0;
}
"""


@pytest.mark.compile
def test_query_blocks_and_their_key_tiles(tmp_path):
    run_host_check(tmp_path, "forward_mask", PROGRAM, ARCH)
