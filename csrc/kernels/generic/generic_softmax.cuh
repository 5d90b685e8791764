// mhakit generic family — the forward's online softmax on the S accumulators of one warp (kMT 16-row mma tiles; a
// thread holds rows g and g + 8 of each, as mma.sync m16n8k16's D fragments): running max and sum in fp32, exp2
// with scale·log2(e) folded into one FMA, P written over S, O rescaled in place. Rows that have seen no key keep
// max -inf without producing NaN. Four threads share a row, so row reductions are two xor-shuffles.
#pragma once

#include <cuda_runtime.h>

#include "generic_ptx.cuh"

namespace mhakit::generic::detail {

#if defined(__CUDACC__)

template <int kMT>
struct OnlineSoftmax {
    float row_max[kMT][2], row_sum[kMT][2];

    __device__ __forceinline__ OnlineSoftmax() {
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                row_max[mt][hf] = -INFINITY;
                row_sum[mt][hf] = 0.f;
            }
    }

    // S of one key tile (masked) -> P; O *= exp2((old max - new max)·scale·log2e) row by row. kSkipUnitRescale: leave
    // O alone when no row of the warp's row pair changed its max (every factor is exactly 1 then), a warp-uniform
    // test that pays where the key tiles are small and O wide (decode: 16 keys a step, 128 columns; the max settles
    // after a few tiles, and the rescale was 29 % of the decode loop's instructions).
    template <bool kSkipUnitRescale = false, int kNT, int kOT>
    __device__ __forceinline__ void update(float (&s)[kMT][kNT][4], float (&acc_o)[kMT][kOT][4], float scale_log2) {
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                float mx_ = row_max[mt][hf];
#pragma unroll
                for (int nt = 0; nt < kNT; ++nt) mx_ = fmaxf(mx_, fmaxf(s[mt][nt][2 * hf], s[mt][nt][2 * hf + 1]));
                mx_ = fmaxf(mx_, __shfl_xor_sync(0xffffffffu, mx_, 1));
                mx_ = fmaxf(mx_, __shfl_xor_sync(0xffffffffu, mx_, 2));
                // A row that has seen no key keeps max -inf: subtract 0 instead so that exp2 gives 0, not NaN.
                const float m_scaled = (mx_ == -INFINITY) ? 0.f : mx_ * scale_log2;
                const float alpha = ptx::ex2(row_max[mt][hf] * scale_log2 - m_scaled);
                row_max[mt][hf] = mx_;
                float sum = 0.f;
#pragma unroll
                for (int nt = 0; nt < kNT; ++nt) {
                    const float p0 = ptx::ex2(fmaf(s[mt][nt][2 * hf], scale_log2, -m_scaled));
                    const float p1 = ptx::ex2(fmaf(s[mt][nt][2 * hf + 1], scale_log2, -m_scaled));
                    s[mt][nt][2 * hf] = p0;
                    s[mt][nt][2 * hf + 1] = p1;
                    sum += p0 + p1;
                }
                row_sum[mt][hf] = row_sum[mt][hf] * alpha + sum;
                if (!kSkipUnitRescale || __any_sync(0xffffffffu, alpha != 1.f)) {
#pragma unroll
                    for (int nt = 0; nt < kOT; ++nt) {
                        acc_o[mt][nt][2 * hf] *= alpha;
                        acc_o[mt][nt][2 * hf + 1] *= alpha;
                    }
                }
            }
        }
    }

    // Row (mt, hf): 1 / row sum (0 for rows that saw nothing) and the natural-log LSE (-inf for those rows).
    // sink (natural-log units, -inf: none) joins the denominator as exp(sink): a key of value zero every row sees,
    // merged here so that the key loop stays the plain one; a row that saw nothing then gets LSE = sink.
    __device__ __forceinline__ void finalize(float scale, float (&inv)[kMT][2], float (&lse)[kMT][2],
                                             float sink = -INFINITY) const {
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                float l = row_sum[mt][hf];
                l += __shfl_xor_sync(0xffffffffu, l, 1);
                l += __shfl_xor_sync(0xffffffffu, l, 2);
                const bool seen = l > 0.f;
                if (sink == -INFINITY) {
                    inv[mt][hf] = seen ? 1.f / l : 0.f;
                    lse[mt][hf] = seen ? row_max[mt][hf] * scale + logf(l) : -INFINITY;
                } else {
                    const float m = seen ? row_max[mt][hf] * scale : -INFINITY;
                    const float mm = fmaxf(m, sink);
                    const float a = seen ? expf(m - mm) : 0.f;
                    const float total = l * a + expf(sink - mm);
                    inv[mt][hf] = a / total;
                    lse[mt][hf] = mm + logf(total);
                }
            }
    }
};

#endif  // __CUDACC__

}  // namespace mhakit::generic::detail
