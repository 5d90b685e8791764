// mhakit generic family — softmax pieces. The forward's online softmax on the S accumulators of one warp (kMT 16-row mma tiles; a
// thread holds rows g and g + 8 of each, as mma.sync m16n8k16's D fragments): running max and sum in fp32, exp2
// with scale·log2(e) folded into one FMA, P written over S, O rescaled in place. Rows that have seen no key keep
// max -inf without producing NaN. Four threads share a row, so row reductions are two xor-shuffles. And the
// backward's recomputation of P from the forward's LSE, with dS = P ∘ (dP − D), in both accumulator orientations.
#pragma once

#include <cuda_runtime.h>

#include "../common/mask_geometry.h"
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

    // S of one key tile (masked) -> P; O *= exp2((old max - new max)·scale·log2e) row by row.
    template <int kNT, int kOT>
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
#pragma unroll
                for (int nt = 0; nt < kOT; ++nt) {
                    acc_o[mt][nt][2 * hf] *= alpha;
                    acc_o[mt][nt][2 * hf + 1] *= alpha;
                }
            }
        }
    }

    // Row (mt, hf): 1 / row sum (0 for rows that saw nothing) and the natural-log LSE (-inf for those rows).
    __device__ __forceinline__ void finalize(float scale, float (&inv)[kMT][2], float (&lse)[kMT][2]) const {
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                float l = row_sum[mt][hf];
                l += __shfl_xor_sync(0xffffffffu, l, 1);
                l += __shfl_xor_sync(0xffffffffu, l, 2);
                const bool seen = l > 0.f;
                inv[mt][hf] = seen ? 1.f / l : 0.f;
                lse[mt][hf] = seen ? row_max[mt][hf] * scale + logf(l) : -INFINITY;
            }
    }
};

// The backward's softmax, on one warp's transposed accumulators (keys x queries: key row r = key0 + mt*16 + g + 8 hf,
// query column c = query0 + nt*8 + 2 t4 + (e & 1)): P^T = exp2(S^T·scale·log2e − LSE2) (0 where need_mask and the
// mask hides the pair), written over S^T, and dS^T = P^T ∘ (dP^T − D) over dP^T. lse2 / dsum: LSE·log2e and D of
// the tile's query columns (shared memory, indexed from the tile's first query, which is row `query0` globally).
template <bool kMasked, int kMT, int kNT>
__device__ __forceinline__ void recompute_pt_dst(float (&st)[kMT][kNT][4], float (&dpt)[kMT][kNT][4],
                                                 const float* lse2, const float* dsum, int col0, int key0,
                                                 int query0, bool need_mask, const MaskGeometry<kMasked>& geom,
                                                 float scale_log2) {
    // Not ptx::for_each_frag_pair: the LSE2 / D pair of a column is read once for both row halves (the main pass is
    // bound by shared-memory bandwidth; reading it per half measured 2-4% slower).
    const int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
            const int ql = col0 + nt * 8 + 2 * t4;
            const float2 l2 = *reinterpret_cast<const float2*>(lse2 + ql);
            const float2 ds = *reinterpret_cast<const float2*>(dsum + ql);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float pv = ptx::ex2(fmaf(st[mt][nt][e], scale_log2, (e & 1) ? -l2.y : -l2.x));
                if (need_mask && !geom.visible(query0 + ql + (e & 1), key0 + mt * 16 + g + 8 * (e >> 1))) pv = 0.f;
                st[mt][nt][e] = pv;
                dpt[mt][nt][e] = pv * (dpt[mt][nt][e] - ((e & 1) ? ds.y : ds.x));
            }
        }
}

// The same on untransposed accumulators (queries x keys, the dQ pass): row (mt, hf) = row0 + mt*16 + g + 8 hf with
// LSE2 / D in registers, key column = key0 + nt*8 + 2 t4 + (e & 1); dS = P ∘ (dP − D) is written over S.
template <bool kMasked, int kMT, int kNT>
__device__ __forceinline__ void recompute_ds(float (&s)[kMT][kNT][4], const float (&dp)[kMT][kNT][4],
                                             const float (&lse2)[kMT][2], const float (&dsum)[kMT][2], int row0,
                                             int key0, bool need_mask, const MaskGeometry<kMasked>& geom,
                                             float scale_log2) {
    ptx::for_each_frag_pair<kMT, kNT>([&](int mt, int nt, int hf, int r, int c) {
#pragma unroll
        for (int e1 = 0; e1 < 2; ++e1) {
            const int e = 2 * hf + e1;
            float pv = ptx::ex2(fmaf(s[mt][nt][e], scale_log2, -lse2[mt][hf]));
            if (need_mask && !geom.visible(row0 + r, key0 + c + e1)) pv = 0.f;
            s[mt][nt][e] = pv * (dp[mt][nt][e] - dsum[mt][hf]);
        }
    });
}

#endif  // __CUDACC__

}  // namespace mhakit::generic::detail
