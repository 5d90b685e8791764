// mhakit generic family — dropout on the fp32 S fragments of mma.sync m16n8k16. Which random byte belongs to which
// score: csrc/kernels/common/dropout.h; which thread holds it, the lane pairs' split of the Philox calls and the
// randval store: csrc/kernels/common/dropout_lanes.cuh (shared with the Hopper family, whose wgmma accumulators
// have the same per-warp layout). Modifier instances only ("_mods", kMods).
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "../common/dropout_lanes.cuh"

namespace mhakit::generic::detail {

#if defined(__CUDACC__)

using mhakit::call_half;
using mhakit::drop_byte;
using mhakit::drop_key;
using mhakit::DropKey;
using mhakit::dropout_bytes;
using mhakit::store_randval;

// S layout: P (the softmax's probabilities, or their unnormalised exponentials) -> P ∘ keep, in place; the caller
// applies the 1 / (1 − p) of the kept ones to what it accumulates from them (the forward: O, once, at the end).
template <int kMT, int kNT>
__device__ __forceinline__ void apply_dropout(float (&s)[kMT][kNT][4], const uint2 (&rnd)[kMT][kNT / 2],
                                              const Dropout& d) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                if (drop_byte<false>(rnd[mt][nt / 2], nt, e) > static_cast<uint32_t>(d.keep_max)) s[mt][nt][e] = 0.f;
}

#endif  // __CUDACC__

}  // namespace mhakit::generic::detail
