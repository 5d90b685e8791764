// Host-side checks and mask set-up that the Hopper forward and backward wrappers share.
#pragma once

#include <cstdint>

#include "kernels/common/mask.h"
#include "kernels/common/smem_opt_in.h"

namespace mhakit::hopper {

// The generic mask coordinate (row i sees keys i - y + 1 <= j < min(i + x, sk)) of a batch-mode problem, clamped to
// x in [-sq, sk] and y in [-sk, sq]: values beyond those bounds select the same keys, and the clamp keeps the
// kernels' later sums of lengths and coordinates in range. Params: FwdParams or BwdParams.
template <class Params>
MaskCoord clamped_mask_coord(const Params& p) {
    if (p.mask_type == 0) return MaskCoord{p.seqlen_q, p.seqlen_k};
    MaskCoord c = make_mask_coord(p.mask_type, p.window_left, p.window_right, p.seqlen_q, p.seqlen_k);
    if (c.x > p.seqlen_k) c.x = p.seqlen_k;
    if (c.x < -p.seqlen_q) c.x = -p.seqlen_q;
    if (c.y > p.seqlen_q) c.y = p.seqlen_q;
    if (c.y < -p.seqlen_k) c.y = -p.seqlen_k;
    return c;
}

inline bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

// A stride that TMA (or a 16-byte access) sees must be a positive multiple of 16 bytes below 2^40 bytes; the stride
// of a mode of extent 1 is never used, so anything goes there.
template <class Element>
bool tma_stride_ok(int64_t stride, int64_t extent) {
    if (extent <= 1) return true;
    if (stride <= 0) return false;
    constexpr int64_t kAlignElems = 16 / int64_t(sizeof(Element));
    return stride % kAlignElems == 0 && stride * int64_t(sizeof(Element)) < (int64_t(1) << 40);
}

}  // namespace mhakit::hopper
