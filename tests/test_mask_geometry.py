"""The shared mask geometry (csrc/kernels/common/mask_geometry.h) against brute force over mask.h's own visibility
rule: for every mask kind, sequence shape and tile size, the tiles a block visits are exactly those holding a visible
pair, the tiles it leaves unmasked are exactly those whose every pair is visible, in both directions and both index
widths. Host C++ only (the header is __host__ __device__): needs a C++ compiler, not nvcc."""
from __future__ import annotations

import subprocess

from host_check import build_cpp

PROGRAM = r"""
#include <cstdio>
#include <cstdint>
#include "kernels/common/mask_geometry.h"

using namespace mhakit;

static int failures = 0, checked = 0;
#define EXPECT(cond, ...) do { ++checked; if (!(cond)) { if (++failures <= 10) { std::printf(__VA_ARGS__); std::printf("\n"); } } } while (0)

template <bool kMasked, class Index, int kBM, int kBN>
void check(int type, int left, int right, int sq, int sk) {
    const auto g = MaskGeometry<kMasked, Index>::make(type, left, right, sq, sk);
    const MaskCoord c = kMasked ? make_mask_coord(type, left, right, sq, sk) : MaskCoord{sq, sk};
    auto vis = [&](int i, int j) { return j >= 0 && j < sk && mask_visible(c, i, j, sk); };
    const int m_tiles = (sq + kBM - 1) / kBM, n_tiles = (sk + kBN - 1) / kBN;
    for (int i = 0; i < sq; ++i)
        for (int j = 0; j < sk; ++j) EXPECT(g.visible(i, j) == vis(i, j), "visible(%d,%d) t%d %d,%d %dx%d", i, j, type, left, right, sq, sk);
    for (int m = 0; m < m_tiles; ++m) {  // a query block against key tiles
        const int r0 = m * kBM, r1 = (r0 + kBM < sq ? r0 + kBM : sq) - 1;
        int first = -1, last = -1;
        const TileRange visit = g.template key_tiles<kBN>(r0, r1);
        const TileRange full = g.template full_key_tiles<kBN>(r0, r1);
        for (int n = 0; n < n_tiles; ++n) {
            bool any = false, all = true;
            for (int i = r0; i <= r1; ++i)
                for (int j = n * kBN; j < (n + 1) * kBN; ++j) {
                    const bool v = vis(i, j);
                    any = any || v;
                    all = all && v;
                }
            if (any) { if (first < 0) first = n; last = n; }
            EXPECT(full.contains(n) == all, "full_key_tiles m%d n%d t%d %d,%d %dx%d", m, n, type, left, right, sq, sk);
            EXPECT(g.template tile_full<kBN>(r0, r1, n * kBN) == all, "tile_full m%d n%d t%d %d,%d %dx%d", m, n, type, left, right, sq, sk);
        }
        // An empty band (a generic mask with x + y <= 1: no row sees any key) may still name tiles, which the element
        // mask then clears: the kernels have always done so. Otherwise the range is exact.
        if (first < 0) EXPECT(visit.empty() || c.x + c.y <= 1, "key_tiles m%d should be empty t%d %d,%d %dx%d", m, type, left, right, sq, sk);
        else EXPECT(visit.begin == first && visit.end == last + 1, "key_tiles m%d [%d,%d) vs [%d,%d] t%d %d,%d %dx%d", m, visit.begin, visit.end, first, last, type, left, right, sq, sk);
    }
    for (int n = 0; n < n_tiles; ++n) {  // a key block against query tiles
        const int n0 = n * kBN, n1 = (n0 + kBN < sk ? n0 + kBN : sk) - 1;
        int first = -1, last = -1;
        for (int m = 0; m < m_tiles; ++m) {
            bool any = false;
            for (int i = m * kBM; i < (m + 1) * kBM && i < sq; ++i)
                for (int j = n0; j <= n1; ++j) any = any || vis(i, j);
            if (any) { if (first < 0) first = m; last = m; }
        }
        const TileRange q = g.template query_tiles<kBM>(n0, n1);
        if (first < 0) EXPECT(q.empty() || c.x + c.y <= 1, "query_tiles n%d should be empty t%d %d,%d %dx%d", n, type, left, right, sq, sk);
        else EXPECT(q.begin == first && q.end == last + 1, "query_tiles n%d [%d,%d) vs [%d,%d] t%d %d,%d %dx%d", n, q.begin, q.end, first, last, type, left, right, sq, sk);
    }
}

template <class Index, int kBM, int kBN>
void sweep() {
    const int lens[] = {1, 7, 16, 33, 64, 100};
    const int windows[] = {-1, 0, 1, 5, 40, 1000};
    const int raw[] = {-120, -3, 0, 1, 9, 64, 1000};
    for (int sq : lens)
        for (int sk : lens) {
            check<false, Index, kBM, kBN>(0, -1, -1, sq, sk);
            check<true, Index, kBM, kBN>(0, -1, -1, sq, sk);
            for (int type = 1; type <= 2; ++type)
                for (int l : windows)
                    for (int r : windows) check<true, Index, kBM, kBN>(type, l, r, sq, sk);
            for (int y : raw)
                for (int x : raw) check<true, Index, kBM, kBN>(3, y, x, sq, sk);
        }
}

int main() {
    sweep<int64_t, 16, 16>();
    sweep<int64_t, 16, 32>();
    sweep<int, 32, 16>();
    sweep<int, 16, 64>();
    std::printf("checked %d failures %d\n", checked, failures);
    return failures != 0;
}
"""


def test_tile_ranges_match_brute_force(tmp_path):
    exe = build_cpp(tmp_path, "geometry", PROGRAM, "-Wall", "-Werror")
    out = subprocess.run([str(exe)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout
    assert "failures 0" in out.stdout and "checked " in out.stdout
