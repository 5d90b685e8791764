// mhakit hopper family — the forward's view of the mask: which key tiles a CTA visits (from the shared geometry,
// kernels/common/mask_geometry.h) and the element-wise mask on a warpgroup's S accumulator.
//
// A CTA owns query rows [r0, r1] (r0 = block_row0(m), clamped to 0; r1 = min(block_row0(m) + BM, sq) - 1) and visits
// key tiles [visit.begin, visit.end) in ascending order; tiles in `full` are visible to every row of the block and skip
// the element-wise mask. A block of a sequence with keys visits at least one tile, so rows that see no key still finish
// with O = 0 and LSE = -inf.
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"

#include "kernels/common/mask_geometry.h"

#include "hopper_types.hpp"

namespace mhakit::hopper {

struct KeyTiles {
    TileRange visit;  // tiles visited
    TileRange full;   // tiles that need no element-wise mask
};

// kPartialFirst: the query blocks start lead_tiles(sq) 64-row tiles before the sequence, so that the block of fewer
// rows than kBlockM is the first (whose rows see the fewest keys under a mask whose key range grows with the row:
// causal, and the windows' left bound) instead of the last (which sees the most). For tiles of 64-row warpgroups that
// run no product on rows outside the sequence (HopperFwdKernelBody::kTrimIdle): the lead is whole warpgroups.
template <bool kMasked, int kBlockM, int kBlockN, bool kPartialFirst = false>
struct ForwardMask {
    // The problem shape carries the host-clamped coordinate (x in [-sq, sk], y in [-sk, sq]): 32-bit arithmetic.
    using Geometry = MaskGeometry<kMasked, int>;
    Geometry geom;
    int lead;  // kPartialFirst: 64-row tiles of the first block before the sequence's first row

    // The lead of a sequence of sq queries: as many whole 64-row tiles as the last block would leave empty.
    CUTLASS_HOST_DEVICE static int lead_tiles(int sq) {
        const int rem = sq % kBlockM;
        return kPartialFirst && rem != 0 ? (kBlockM - rem) / 64 : 0;
    }

    // One sequence of sq queries and sk keys with its clamped coordinate (clamp_mask_coord).
    CUTLASS_HOST_DEVICE ForwardMask(MaskCoord c, int sq, int sk)
        : geom(Geometry::from_coord(c, sq, sk)), lead(lead_tiles(sq)) {}

    // The first 64-row tile of query block m_block, and its first row (negative for the lead of block 0). The blocks
    // are ceil(sq / kBlockM) either way: the lead is less than what the last block would leave empty.
    CUTLASS_HOST_DEVICE int block_tile0(int m_block) const {
        return kPartialFirst ? m_block * (kBlockM / 64) - lead : m_block * (kBlockM / 64);
    }
    CUTLASS_HOST_DEVICE int block_row0(int m_block) const { return block_tile0(m_block) * 64; }

    // The tiles of query block m_block. Empty only when the sequence has no key (sk = 0, group mode): the block then
    // loads nothing and writes O = 0, LSE = -inf.
    CUTLASS_HOST_DEVICE KeyTiles key_tiles(int m_block) const {
        if (geom.sk == 0) return KeyTiles{TileRange{0, 0}, TileRange{0, 0}};
        const int first = block_row0(m_block);
        const int r0 = kPartialFirst && first < 0 ? 0 : first;
        const int r1 = (first + kBlockM < geom.sq ? first + kBlockM : geom.sq) - 1;
        KeyTiles t{geom.template key_tiles<kBlockN>(r0, r1), geom.template full_key_tiles<kBlockN>(r0, r1)};
        if (t.visit.empty()) {  // no row of this block sees any key: visit one (fully masked) tile
            const int n_tiles = (geom.sk + kBlockN - 1) / kBlockN;  // sk >= 1
            const int n = t.visit.begin < n_tiles ? t.visit.begin : n_tiles - 1;
            t.visit = TileRange{n, n + 1};
        }
        return t;
    }

    // The end (exclusive) of the keys that row `row` sees: min(row + x, sk), sk without a mask. Non-decreasing in
    // the row, so a block's last row bounds every row before it.
    CUTLASS_DEVICE int keys_end(int row) const {
        if constexpr (kMasked) {
            const int l = row + int(geom.x);
            return l < geom.sk ? l : geom.sk;
        } else {
            return geom.sk;
        }
    }

    // S (rows x keys view s_mn, coordinates c_mn within the 64 x kBlockN tile) of key tile n, rows from row0 on:
    // keys a row does not see become -inf. Row i keeps keys lo <= j < hi: lo = i - y + 1, hi = min(i + x, sk).
    // c_mn is an identity tensor: an element's column is this thread's base column plus a compile-time offset of the
    // layout, so each row's bounds are made relative to the base once and every element costs one compare against
    // an immediate and a select (two compares where some row of the warp has a left bound inside the tile: windows).
    template <class TensorS, class TensorC>
    CUTLASS_DEVICE void apply(TensorS& s_mn, TensorC const& c_mn, int row0, int n) const {
        constexpr int R = decltype(cute::size<0>(s_mn))::value;
        constexpr int C = decltype(cute::size<1>(s_mn))::value;
        static_assert(cute::is_static<decltype(c_mn.layout())>::value, "c_mn: an identity tensor of a static layout");
        const int col0 = n * kBlockN + int(cute::get<1>(c_mn(0, 0)));  // this thread's first column, in keys
        int hi[R], lo[R];
        bool any_lo = false;
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < R; ++i) {
            const int row = row0 + int(cute::get<0>(c_mn(i, 0)));
            hi[i] = keys_end(row) - col0;
            lo[i] = (kMasked ? row - int(geom.y) + 1 : 0) - col0;
            any_lo |= kMasked && lo[i] > 0;
        }
        auto mask_rows = [&](auto with_lo) {
            CUTLASS_PRAGMA_UNROLL
            for (int i = 0; i < R; ++i) {
                CUTLASS_PRAGMA_UNROLL
                for (int j = 0; j < C; ++j) {
                    const int dj = int(cute::get<1>(c_mn.layout()(i, j)));  // static
                    if (dj >= hi[i] || (decltype(with_lo)::value && dj < lo[i])) s_mn(i, j) = -INFINITY;
                }
            }
        };
        if (kMasked && __any_sync(0xffffffffu, any_lo))
            mask_rows(cute::true_type{});
        else
            mask_rows(cute::false_type{});
    }
};

}  // namespace mhakit::hopper
