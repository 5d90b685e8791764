// mhakit generic family — the score modifiers (csrc/kernels/common/score_mod.h) on the fp32 S fragments of
// mma.sync m16n8k16 (a thread holds rows g, g + 8 and columns 2·t4, 2·t4 + 1 of each 16 x 8 tile), and the
// element conversion both directions use. Only the modifier instances ("_mods", kMods) compile this path; the
// runtime gives them the calls with ScoreMods::per_element, so calls without them run the plain instances' code.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "../../include/mha_common.h"
#include "../common/mma_fragment.cuh"
#include "../common/score_mod.h"

namespace mhakit::generic::detail {

#if defined(__CUDACC__)

constexpr float kLog2e = 1.4426950408889634f;

template <mhakit_dtype kDtype>
__device__ __forceinline__ float to_float(uint16_t v) {
    if constexpr (kDtype == MHAKIT_DTYPE_FP16) {
        return __half2float(__ushort_as_half(v));
    } else {
        return __uint_as_float(static_cast<uint32_t>(v) << 16);
    }
}

// The modified logit of query i, key j from the raw q·k, for the variant <kSoftcap, kBias> (score_mod.h); with an
// elementwise bias, positions past the sequence keep scale·q·k (no element to read there; the caller masks them).
template <mhakit_dtype kDtype, bool kSoftcap, int kBias>
__device__ __forceinline__ float logit_at(const RowMods& r, float qk, int i, int j, float* dcap = nullptr) {
    if constexpr (kBias == 1) {
        if (i >= r.seqlen_q || j >= r.seqlen_k) {
            if (dcap) *dcap = 1.f;
            return qk * r.scale;
        }
    }
    return modified_logit_t<kSoftcap, kBias>(r, qk, i, j, [](uint16_t v) { return to_float<kDtype>(v); }, dcap);
}

// f(soft-cap tag, bias-kind tag) for the call's modifiers in a kMods kernel (with_mod_kind), f(false, none) in the
// plain one: the element loops of the P / dS stages are written once for both.
template <bool kMods, class F>
__device__ __forceinline__ void with_mods(const RowMods& r, F&& f) {
    if constexpr (kMods)
        with_mod_kind(r, f);
    else
        f(std::false_type{}, std::integral_constant<int, 0>{});
}

// S (raw q·k) -> logits, in place, for a thread's fragments of kMT x kNT tiles (MmaFragLane::row / col
// from row0, col0); one branch per tile picks the variant.
template <mhakit_dtype kDtype, int kMT, int kNT>
__device__ __forceinline__ void apply_score_mods(float (&s)[kMT][kNT][4], const RowMods& r, int row0, int col0) {
    const MmaFragLane fl = MmaFragLane::of_thread();
    with_mod_kind(r, [&](auto cap, auto bias) {
        constexpr bool kCap = decltype(cap)::value;
        constexpr int kBias = decltype(bias)::value;
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    s[mt][nt][e] = logit_at<kDtype, kCap, kBias>(r, s[mt][nt][e], fl.row(row0, mt, e),
                                                                  fl.col(col0, nt, e));
    });
}

#endif  // __CUDACC__

}  // namespace mhakit::generic::detail
