// mhakit decode family — the combine step of split-KV attention: every split wrote its rows' normalised O and LSE in
// fp32 (o_acc, lse_acc, dense [split][batch][head][row](+[col]), see mha_fwd.h); the row's LSE is the log-sum-exp of
// the splits' LSEs, and O the sum of their O weighted by exp(lse_split - lse). Splits that saw no key carry
// LSE = -inf and weigh 0; a row that no split saw gets O = 0, LSE = -inf. One warp per output row.
// Behind decode_tma's split kernel (sm_90a) the combine is launched as a programmatic dependent (dependent_launch.h):
// its CTAs start while the split kernel's last CTAs run and wait for its results before reading them, so that a call
// pays no launch gap between the two.
#pragma once

#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "../../include/mha_common.h"
#include "../common/dependent_launch.h"
#include "../common/splitkv_params.h"
#include "../generic/generic_ptx.cuh"

namespace mhakit::decode::detail {

// Index of (split, b, h, qi) in the dense accumulators (multiply by hdim_v for o_acc).
__host__ __device__ __forceinline__ int64_t acc_row(const SplitkvParams& p, int split, int b, int h, int qi) {
    return ((int64_t(split) * p.batch + b) * p.nhead_q + h) * p.seqlen_q + qi;
}

// One output element (fp32) as the call's 16-bit type.
template <mhakit_dtype kDtype>
__device__ __forceinline__ uint16_t to_elem(float v) {
    return static_cast<uint16_t>(generic::ptx::Mma<kDtype>::pack(v, 0.f) & 0xffffu);
}

#if defined(__CUDACC__)

constexpr int kCombineWarps = 4;

// kDependent: launched as a programmatic dependent of the split kernel (reads its partials after wait_for_primary).
template <mhakit_dtype kDtype, bool kDependent>
__global__ void __launch_bounds__(kCombineWarps * 32) combine_kernel(const SplitkvParams p) {
    __shared__ float s_weight[kCombineWarps][MHAKIT_MAX_SPLITS];
    if constexpr (kDependent) wait_for_primary();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t rows = int64_t(p.batch) * p.nhead_q * p.seqlen_q;
    const int64_t id = int64_t(blockIdx.x) * kCombineWarps + warp;
    if (id >= rows) return;
    const int qi = int(id % p.seqlen_q), h = int((id / p.seqlen_q) % p.nhead_q), b = int(id / (int64_t(p.seqlen_q) * p.nhead_q));
    const int splits = p.num_splits;
    uint16_t* o = static_cast<uint16_t*>(p.o) + b * p.o_batch_stride + h * p.o_head_stride + qi * p.o_row_stride;
    const int64_t split_stride = int64_t(p.batch) * p.nhead_q * p.seqlen_q * p.hdim_v;
    const float* part = p.o_acc + acc_row(p, 0, b, h, qi) * p.hdim_v;
    const bool vec4 = (p.hdim_v & 3) == 0 && (reinterpret_cast<uintptr_t>(p.o_acc) & 15u) == 0;

    // The split kernel's results are read through L2 only (__ldcg): behind a programmatic dependent launch this grid
    // may start while that kernel runs, so no line of them is taken from an SM's L1.
    // The first kFirst splits' partials of this lane's first four columns are loaded before the LSEs are read: they
    // do not depend on them, so the two latencies overlap, and a d <= 128 row of up to kFirst splits waits for memory
    // once (b=1 32/8 s_k=32k runs 32 splits: two waits where the LSEs and four steps of 8 partials took five).
    constexpr int kFirst = 16;
    const int c_first = lane * 4;
    float4 first[kFirst];
    if (vec4 && c_first < p.hdim_v) {
#pragma unroll
        for (int u = 0; u < kFirst; ++u)
            first[u] = u < splits ? __ldcg(reinterpret_cast<const float4*>(part + u * split_stride + c_first))
                                  : make_float4(0.f, 0.f, 0.f, 0.f);
    }

    // Each lane's LSEs (splits lane, lane + 32, ...), read once.
    constexpr int kLanesSplits = (MHAKIT_MAX_SPLITS + 31) / 32;
    float lse_s[kLanesSplits];
#pragma unroll
    for (int k = 0; k < kLanesSplits; ++k) {
        const int s = lane + 32 * k;
        lse_s[k] = s < splits ? __ldcg(p.lse_acc + acc_row(p, s, b, h, qi)) : -INFINITY;
    }
    float m = -INFINITY;
#pragma unroll
    for (int k = 0; k < kLanesSplits; ++k) m = fmaxf(m, lse_s[k]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    float sum = 0.f;
    if (m != -INFINITY)
#pragma unroll
        for (int k = 0; k < kLanesSplits; ++k) sum += lse_s[k] == -INFINITY ? 0.f : expf(lse_s[k] - m);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    const float lse = m == -INFINITY ? -INFINITY : m + logf(sum);
#pragma unroll
    for (int k = 0; k < kLanesSplits; ++k) {
        const int s = lane + 32 * k;
        if (s < splits) s_weight[warp][s] = lse == -INFINITY ? 0.f : expf(lse_s[k] - lse);
    }
    __syncwarp();

    // Columns spread over the lanes; the splits' partial rows are kSplitStep independent loads at a time (a split
    // of weight 0 holds zeros), so that a warp waits for the memory latency once per kSplitStep splits, not per split.
    // Four columns per lane (16-byte loads) when the rows allow it: a d128 row is then one pass of the lanes, where
    // one column per lane took four passes, each waiting for its loads (the combine then cost 4 % of a b=16 call).
    constexpr int kSplitStep = 8;
    if (vec4) {
        for (int c = c_first; c < p.hdim_v; c += 128) {
            float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
            auto add = [&](float w, float4 x) {
                acc.x = fmaf(w, x.x, acc.x), acc.y = fmaf(w, x.y, acc.y);
                acc.z = fmaf(w, x.z, acc.z), acc.w = fmaf(w, x.w, acc.w);
            };
            int s = 0;
            if (c == c_first) {  // the splits loaded up front, in the same order as the steps below
#pragma unroll
                for (int u = 0; u < kFirst; ++u)
                    if (u < splits) add(s_weight[warp][u], first[u]);
                s = splits < kFirst ? splits : kFirst;
            }
            for (; s + kSplitStep <= splits; s += kSplitStep) {
                float4 x[kSplitStep];
#pragma unroll
                for (int u = 0; u < kSplitStep; ++u)
                    x[u] = __ldcg(reinterpret_cast<const float4*>(part + (s + u) * split_stride + c));
#pragma unroll
                for (int u = 0; u < kSplitStep; ++u) add(s_weight[warp][s + u], x[u]);
            }
            for (; s < splits; ++s) add(s_weight[warp][s], __ldcg(reinterpret_cast<const float4*>(part + s * split_stride + c)));
            o[c] = to_elem<kDtype>(acc.x);
            o[c + 1] = to_elem<kDtype>(acc.y);
            o[c + 2] = to_elem<kDtype>(acc.z);
            o[c + 3] = to_elem<kDtype>(acc.w);
        }
    } else {
        for (int c = lane; c < p.hdim_v; c += 32) {
            float acc = 0.f;
            int s = 0;
            for (; s + kSplitStep <= splits; s += kSplitStep) {
                float x[kSplitStep];
#pragma unroll
                for (int u = 0; u < kSplitStep; ++u) x[u] = __ldcg(part + (s + u) * split_stride + c);
#pragma unroll
                for (int u = 0; u < kSplitStep; ++u) acc = fmaf(s_weight[warp][s + u], x[u], acc);
            }
            for (; s < splits; ++s) acc = fmaf(s_weight[warp][s], __ldcg(part + s * split_stride + c), acc);
            o[c] = to_elem<kDtype>(acc);
        }
    }
    if (p.lse != nullptr && lane == 0) p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + qi] = lse;
}

#endif  // __CUDACC__

// dependent: launch as a programmatic dependent of the split kernel just launched (sm_90a instances only: the split
// kernel triggers its dependents, see dependent_launch.h).
template <mhakit_dtype kDtype>
inline cudaError_t combine_splits(const SplitkvParams& p, cudaStream_t stream, bool dependent = false) {
#if defined(__CUDACC__)
    const int64_t rows = int64_t(p.batch) * p.nhead_q * p.seqlen_q;
    if (rows == 0) return cudaSuccess;
    const dim3 grid(unsigned((rows + kCombineWarps - 1) / kCombineWarps)), block(kCombineWarps * 32);
    if (dependent) return launch_dependent(combine_kernel<kDtype, true>, grid, block, 0, stream, p);
    combine_kernel<kDtype, false><<<grid, block, 0, stream>>>(p);
    return cudaGetLastError();
#else
    return cudaErrorNotSupported;
#endif
}

}  // namespace mhakit::decode::detail
