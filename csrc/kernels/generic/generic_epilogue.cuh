// mhakit generic family — the forward's epilogue: O normalised by the softmax's row sums and packed into a shared
// memory tile (so that global memory sees whole 16-byte chunks, written by store_tile), and the fp32 natural-log
// LSE of every real row.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "../../include/mha_common.h"
#include "generic_ptx.cuh"
#include "generic_softmax.cuh"

namespace mhakit::generic::detail {

#if defined(__CUDACC__)

// One warp's rows [warp_row0, warp_row0 + 16 kMT) of the CTA's tile: O (columns below hdim_v) into sO (row stride
// kSV elements), LSE into lse[r] for rows r < rows_valid (lse: the CTA's first row; nullptr: no LSE).
template <mhakit_dtype kDtype, int kMT, int kOT, int kSV>
__device__ __forceinline__ void stage_o_and_lse(uint16_t* sO, const float (&acc_o)[kMT][kOT][4],
                                                const OnlineSoftmax<kMT>& softmax, float scale, int warp_row0,
                                                int hdim_v, float* lse, int rows_valid, float sink = -INFINITY) {
    using Mma = ptx::Mma<kDtype>;
    const int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    float inv[kMT][2], row_lse[kMT][2];
    softmax.finalize(scale, inv, row_lse, sink);
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int r = warp_row0 + mt * 16 + g + 8 * hf;
#pragma unroll
            for (int nt = 0; nt < kOT; ++nt) {
                if (nt * 8 >= hdim_v) break;
                ptx::st_shared_b32(ptx::smem_addr(sO + r * kSV + nt * 8 + 2 * t4),
                                   Mma::pack(acc_o[mt][nt][2 * hf] * inv[mt][hf],
                                             acc_o[mt][nt][2 * hf + 1] * inv[mt][hf]));
            }
            if (lse != nullptr && t4 == 0 && r < rows_valid) lse[r] = row_lse[mt][hf];
        }
    }
}

#endif  // __CUDACC__

}  // namespace mhakit::generic::detail
