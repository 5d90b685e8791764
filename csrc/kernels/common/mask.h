// Attention-mask geometry shared by every kernel family, the runtime and the host reference.
//
// All masks are expressed in CK's generic coordinate (y, x), per sequence (so that bottom-right masks follow each
// sequence's own lengths in group mode): row i sees keys j with
//     i - y + 1 <= j < min(i + x, seqlen_k).
// "No mask" is the coordinate that excludes nothing: y = seqlen_q, x = seqlen_k (clamped to the key range).
#pragma once

#if defined(__HIPCC__)
#include <hip/hip_runtime.h>  // __host__, __device__, __forceinline__ (nvcc knows them without a header)
#endif

#if defined(__CUDACC__) || defined(__HIPCC__)
#define MHAKIT_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define MHAKIT_HOST_DEVICE inline
#endif

namespace mhakit {

struct MaskCoord {
    int y;  // row i sees keys from i - y + 1 on
    int x;  // ... up to, not including, min(i + x, seqlen_k)
};

// mask_type / left / right as in mhakit_mask_type (mha_common.h). seqlen_q, seqlen_k: this sequence's lengths.
MHAKIT_HOST_DEVICE MaskCoord make_mask_coord(int mask_type, int left, int right, int seqlen_q, int seqlen_k) {
    MaskCoord c;
    if (mask_type == 0) {  // none: row i < seqlen_q reaches key 0 (i - y + 1 <= 0) and key seqlen_k - 1
        c.y = seqlen_q;
        c.x = seqlen_k;
        return c;
    }
    if (mask_type == 3) {  // generic: raw (y, x)
        c.y = left;
        c.x = right;
        return c;
    }
    const bool top_left = (mask_type == 1);
    if (left < 0) left = top_left ? seqlen_q - 1 : seqlen_k - 1;
    if (right < 0) right = top_left ? seqlen_k - 1 : seqlen_q - 1;
    c.x = 1 + right + (top_left ? 0 : seqlen_k - seqlen_q);
    c.y = 1 + left + (top_left ? 0 : seqlen_q - seqlen_k);
    return c;
}

// The same coordinate clamped to x in [-seqlen_q, seqlen_k] and y in [-seqlen_k, seqlen_q]: values beyond those
// bounds select the same keys, and the clamp keeps later sums of lengths and coordinates inside 32 bits.
MHAKIT_HOST_DEVICE MaskCoord clamp_mask_coord(MaskCoord c, int seqlen_q, int seqlen_k) {
    c.x = c.x > seqlen_k ? seqlen_k : (c.x < -seqlen_q ? -seqlen_q : c.x);
    c.y = c.y > seqlen_q ? seqlen_q : (c.y < -seqlen_k ? -seqlen_k : c.y);
    return c;
}

// The clamped coordinate of one sequence straight from the call's mask (none: the coordinate that excludes nothing).
MHAKIT_HOST_DEVICE MaskCoord make_clamped_mask_coord(int mask_type, int left, int right, int seqlen_q, int seqlen_k) {
    if (mask_type == 0) return MaskCoord{seqlen_q, seqlen_k};
    return clamp_mask_coord(make_mask_coord(mask_type, left, right, seqlen_q, seqlen_k), seqlen_q, seqlen_k);
}

// First visible key of row i (may be < 0: clamp at the caller) and one past the last (already clamped to seqlen_k).
MHAKIT_HOST_DEVICE int mask_key_begin(MaskCoord c, int i) { return i - c.y + 1; }
MHAKIT_HOST_DEVICE int mask_key_end(MaskCoord c, int i, int seqlen_k) {
    return (i + c.x < seqlen_k) ? i + c.x : seqlen_k;
}
MHAKIT_HOST_DEVICE bool mask_visible(MaskCoord c, int i, int j, int seqlen_k) {
    return j >= i - c.y + 1 && j < mask_key_end(c, i, seqlen_k);
}

}  // namespace mhakit
