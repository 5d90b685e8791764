// mhakit hopper family — mask geometry: which key tiles a query block visits and which of them need an
// element-wise mask.
//
// The problem shape every piece of this family passes around is
//     (batch, (heads_per_kv_group, nhead_k), seqlen_q, seqlen_k, hdim, x, y)
// with (y, x) CK's generic mask coordinate: row i sees keys j with i - y + 1 <= j < min(i + x, seqlen_k)
// (kernels/common/mask.h). Unmasked kernels carry x = seqlen_k, y = seqlen_q. The host clamps x to [-sq, sk] and
// y to [-sk, sq] (values outside change nothing), so none of the sums below overflow.
//
// A CTA owns query rows [r0, r1] (r1 = min(r0 + BM, sq) - 1) and visits key tiles [n_begin, n_end) in ascending
// order. Tiles [full_lo, full_hi) are visible to every row of the block and skip the element-wise mask; the others
// (window edges, causal diagonal, seqlen_k tail) are masked. A block always visits at least one tile, so rows that
// see no key at all still finish with O = 0 and LSE = -inf.
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"

namespace mhakit::hopper {

using HopperProblemShape = cute::tuple<int, cute::tuple<int, int>, int, int, int, int, int>;

struct KeyTileRange {
    int n_begin, n_end;  // tiles visited
    int full_lo, full_hi;  // tiles that need no element-wise mask
};

CUTLASS_HOST_DEVICE int floor_div_int(int a, int b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }
CUTLASS_HOST_DEVICE int ceil_div_int(int a, int b) { return -floor_div_int(-a, b); }

template <bool kMasked>
struct MaskPolicy {
    template <int kBlockM, int kBlockN, class ProblemShape>
    CUTLASS_HOST_DEVICE static KeyTileRange key_tiles(int m_block, ProblemShape const& ps) {
        using cute::get;
        const int sq = get<2>(ps), sk = get<3>(ps);
        const int n_tiles = (sk + kBlockN - 1) / kBlockN;  // sk >= 1
        KeyTileRange r;
        if constexpr (!kMasked) {
            r.n_begin = 0;
            r.n_end = n_tiles;
            r.full_lo = 0;
            r.full_hi = sk / kBlockN;
        } else {
            const int x = get<5>(ps), y = get<6>(ps);
            const int r0 = m_block * kBlockM;
            const int r1 = (r0 + kBlockM < sq ? r0 + kBlockM : sq) - 1;
            // union of the rows' key ranges: [r0 - y + 1, min(r1 + x, sk))
            int kb = r0 - y + 1;
            if (kb < 0) kb = 0;
            int ke = r1 + x;
            if (ke > sk) ke = sk;
            r.n_begin = kb / kBlockN;
            r.n_end = ke > 0 ? (ke + kBlockN - 1) / kBlockN : 0;
            if (r.n_end <= r.n_begin) {  // no row of this block sees any key: visit one (fully masked) tile
                int n = r.n_begin < n_tiles ? r.n_begin : n_tiles - 1;
                r.n_begin = n;
                r.n_end = n + 1;
            }
            // intersection: [r1 - y + 1, min(r0 + x, sk))
            r.full_lo = ceil_div_int(r1 - y + 1, kBlockN);
            int fe = r0 + x;
            if (fe > sk) fe = sk;
            r.full_hi = floor_div_int(fe, kBlockN);
        }
        return r;
    }
};

}  // namespace mhakit::hopper
