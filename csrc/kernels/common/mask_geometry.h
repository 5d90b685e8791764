// Which tiles a mask lets a CTA visit, and which of them need an element-wise mask: the one statement of the tile
// geometry of every mask kind, for the forward and the backward of every kernel family.
//
// A mask is CK's generic coordinate (y, x) of one sequence (mask.h): row i sees key j iff
//     i - y + 1 <= j < min(i + x, seqlen_k).
// Seen from the queries (forward, backward dQ pass), a block of rows [r0, r1] walks key tiles of kBlockN keys; seen
// from the keys (backward main pass), a block of keys walks query tiles of kBlockM rows. In both directions a tile
// pair is *full* when every row of the query tile sees every key of the key tile: only the other pairs (window
// edges, the causal diagonal, the seqlen_k tail) need the element-wise mask. Seen from a query block the full key
// tiles form one contiguous range (full_key_tiles); tile_full answers for one pair.
//
// Index is the width of the coordinate arithmetic: int64_t where the raw coordinate (window sizes clamped to 2^29 by
// the runtime, plus sequence lengths) may pass int32; int where the host has clamped x to [-sq, sk] and y to
// [-sk, sq] (the Hopper family), which keeps the per-tile tests as cheap as 32-bit compares. tile_full() and
// visible() run per tile / per element; the range functions once per CTA.
#pragma once

#include <stdint.h>

#include "mask.h"

namespace mhakit {

// Tiles [begin, end) in ascending order; empty when end <= begin.
struct TileRange {
    int begin, end;
    MHAKIT_HOST_DEVICE bool empty() const { return end <= begin; }
    MHAKIT_HOST_DEVICE bool contains(int t) const { return t >= begin && t < end; }
};

template <class Index>
MHAKIT_HOST_DEVICE Index floor_div(Index a, Index b) {
    return a >= 0 ? a / b : -((-a + b - 1) / b);
}
template <class Index>
MHAKIT_HOST_DEVICE Index ceil_div(Index a, Index b) {
    return -floor_div(-a, b);
}

// kMasked = false is the mask that excludes nothing (y = seqlen_q, x = seqlen_k): the compiler folds every
// expression below to the sequence bounds.
template <bool kMasked, class Index = int64_t>
struct MaskGeometry {
    Index y, x;
    int sq, sk;

    // The geometry of one sequence from the call's mask (mask_type, left, right as in mha_common.h).
    MHAKIT_HOST_DEVICE static MaskGeometry make(int mask_type, int left, int right, int sq, int sk) {
        MaskCoord c{sq, sk};
        if (kMasked) c = make_mask_coord(mask_type, left, right, sq, sk);
        return from_coord(c, sq, sk);
    }
    // ... from a coordinate already made (and possibly clamped) on the host.
    MHAKIT_HOST_DEVICE static MaskGeometry from_coord(MaskCoord c, int sq, int sk) {
        MaskGeometry g;
        g.y = kMasked ? c.y : sq;
        g.x = kMasked ? c.x : sk;
        g.sq = sq;
        g.sk = sk;
        return g;
    }

    // Visible keys of row i: [key_begin(i), key_end(i)), both clamped to [0, sk].
    MHAKIT_HOST_DEVICE Index key_begin(Index i) const { return kMasked ? clamp(i - y + 1, sk) : 0; }
    MHAKIT_HOST_DEVICE Index key_end(Index i) const { return kMasked ? clamp(i + x, sk) : sk; }
    // Rows that see key j: [query_begin(j), query_end(j)), both clamped to [0, sq].
    MHAKIT_HOST_DEVICE Index query_begin(Index j) const { return kMasked ? clamp(j - x + 1, sq) : 0; }
    MHAKIT_HOST_DEVICE Index query_end(Index j) const { return kMasked ? clamp(j + y, sq) : sq; }

    // Whether row i sees key j (j < sk included): the element-wise mask of tiles that are not full.
    MHAKIT_HOST_DEVICE bool visible(Index i, Index j) const {
        return j < sk && (!kMasked || (j >= i - y + 1 && j < i + x));
    }

    // Key tiles that some row of [r0, r1] (real rows, r1 < sq) sees. Exact unless the band is empty (a generic mask
    // with x + y <= 1, where no row sees any key): then the range may name tiles that the element mask clears.
    template <int kBlockN>
    MHAKIT_HOST_DEVICE TileRange key_tiles(int r0, int r1) const {
        return tiles_touching(key_begin(r0), key_end(r1), kBlockN);
    }
    // Key tiles that every row of [r0, r1] sees whole (past-the-end keys count as unseen).
    template <int kBlockN>
    MHAKIT_HOST_DEVICE TileRange full_key_tiles(int r0, int r1) const {
        return TileRange{int(ceil_div<Index>(key_begin(r1), kBlockN)), int(floor_div<Index>(key_end(r0), kBlockN))};
    }
    // Query tiles holding a row that sees some key of [n0, n1] (real keys, n1 < sk); the same caveat.
    template <int kBlockM>
    MHAKIT_HOST_DEVICE TileRange query_tiles(int n0, int n1) const {
        return tiles_touching(query_begin(n0), query_end(n1), kBlockM);
    }
    // The query tiles (block_m rows) that key block n (block_n keys, n below the sequence's key blocks) visits: the
    // backward's loop over a key block's query tiles (both families) and the zeroing of the dbias tiles that no key
    // block writes read this one rule (the Hopper family with its tile sizes as constants, which fold the divisions).
    MHAKIT_HOST_DEVICE TileRange key_block_query_tiles(int n, int block_m, int block_n) const {
        const int n0 = n * block_n;
        return tiles_touching(query_begin(n0), query_end((n0 + block_n < sk ? n0 + block_n : sk) - 1), block_m);
    }
    // Whether every row of [r0, r1] sees every key of [n0, n0 + kBlockN) (past-the-end keys count as unseen): the
    // tile pair needs no element-wise mask. The same test as full_key_tiles, for one pair, written without clamps
    // (n0 >= 0 makes them redundant) because the backward loops ask it per tile.
    template <int kBlockN>
    MHAKIT_HOST_DEVICE bool tile_full(Index r0, Index r1, int n0) const {
        const Index n = n0;
        return n + kBlockN <= sk && (!kMasked || (n >= r1 - y + 1 && n + kBlockN <= r0 + x));
    }

  private:
    // Tiles of `block` that hold some index of [lo, hi) (lo >= 0); empty for an empty interval.
    MHAKIT_HOST_DEVICE static TileRange tiles_touching(Index lo, Index hi, int block) {
        if (hi <= lo) return TileRange{0, 0};
        return TileRange{int(lo / block), int((hi + block - 1) / block)};
    }
    MHAKIT_HOST_DEVICE static Index clamp(Index v, int hi) { return v < 0 ? 0 : (v > hi ? Index(hi) : v); }
};

}  // namespace mhakit
