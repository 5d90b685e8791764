// mhakit hopper family — the types and register-level helpers that the forward, the backward and their light
// kernels share: element types by dtype, problem shape and strides of the forward's collective, fp32 -> 16-bit
// packing and the fast exp2.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/numeric_types.h"

#include "kernels/common/mask.h"
#include "mha_common.h"

namespace mhakit::hopper {

// type: the element of q, k, v (and of the backward's tensors); out: the element of o.
template <mhakit_dtype kDtype>
struct DtypeOf;
template <>
struct DtypeOf<MHAKIT_DTYPE_FP16> {
    using type = cutlass::half_t;
    using out = cutlass::half_t;
};
template <>
struct DtypeOf<MHAKIT_DTYPE_BF16> {
    using type = cutlass::bfloat16_t;
    using out = cutlass::bfloat16_t;
};
template <>
struct DtypeOf<MHAKIT_DTYPE_FP8_BF16> {
    using type = cutlass::float_e4m3_t;
    using out = cutlass::bfloat16_t;
};
template <>
struct DtypeOf<MHAKIT_DTYPE_FP8_FP16> {
    using type = cutlass::float_e4m3_t;
    using out = cutlass::half_t;
};

// The forward's problem shape (batch, (heads_per_kv_group, nhead_k), seqlen_q, seqlen_k, hdim, x, y), with (y, x)
// the generic mask coordinate (kernels/common/mask.h); unmasked kernels carry x = seqlen_k, y = seqlen_q.
using HopperProblemShape = cute::tuple<int, cute::tuple<int, int>, int, int, int, int, int>;

// (row, 1, (batch, (heads_per_group, nhead_k))) element strides of Q and of K / V. For K and V the heads_per_group
// stride is a static 0, which is how query head h reads kv head h / heads_per_group (GQA / MQA) with no index
// arithmetic; CuTe drops static-0 modes from the TMA descriptor.
using HopperStrideQ = cute::tuple<int64_t, cute::_1, cute::tuple<int64_t, cute::tuple<int64_t, int64_t>>>;
using HopperStrideKV = cute::tuple<int64_t, cute::_1, cute::tuple<int64_t, cute::tuple<cute::_0, int64_t>>>;
// (key, d, (batch, (heads_per_group, nhead_k))) element strides of fp8's transposed V (hopper_fp8.hpp: keys
// contiguous, the K-major B operand that the fp8 wgmma needs for P·V).
using HopperStrideVt = cute::tuple<cute::_1, int64_t, cute::tuple<int64_t, cute::tuple<cute::_0, int64_t>>>;

// The rows of sequence b in the tensors: its first row and its length. Batch mode (seqstart == nullptr): row 0 of
// batch b's own slice (the caller adds the batch stride) and the call's length; group mode: seqstart[b] of the packed
// tensor and seqstart[b + 1] - seqstart[b]. The forward, the backward and its light kernels all read them here.
struct SeqRows {
    int first, len;
};
CUTLASS_DEVICE SeqRows seq_rows(const int32_t* seqstart, int b, int batch_len) {
    if (seqstart == nullptr) return SeqRows{0, batch_len};
    const int first = seqstart[b];
    return SeqRows{first, seqstart[b + 1] - first};
}

// The sequence a CTA of the forward or the backward works on: its first rows in the tensors TMA sees, its lengths
// and its clamped mask coordinate (x in [-sq, sk], y in [-sk, sq], which keeps the tile tests in 32 bits).
struct HopperSequence {
    int q0, k0, sq, sk;
    MaskCoord mask;
};
// Group mode: sequence b of the packed tensors, its mask made on the device (unmasked kernels: the whole rectangle).
template <bool kMasked>
CUTLASS_DEVICE HopperSequence packed_sequence(const int32_t* seqstart_q, const int32_t* seqstart_k, int b,
                                              int mask_type, int window_left, int window_right) {
    const SeqRows q = seq_rows(seqstart_q, b, 0), k = seq_rows(seqstart_k, b, 0);
    const MaskCoord c = kMasked ? make_clamped_mask_coord(mask_type, window_left, window_right, q.len, k.len)
                                : MaskCoord{q.len, k.len};
    return HopperSequence{q.first, k.first, q.len, k.len, c};
}

namespace detail {

CUTLASS_DEVICE float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

template <class Element>
CUTLASS_DEVICE uint32_t pack2(float a, float b) {
    if constexpr (std::is_same_v<Element, cutlass::bfloat16_t>) {
        __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
        return reinterpret_cast<uint32_t const&>(v);
    } else {
        __half2 v = __floats2half2_rn(a, b);
        return reinterpret_cast<uint32_t const&>(v);
    }
}

// An fp32 accumulator fragment as packed 16-bit pairs: dst (any tensor/array of Element with the same number of
// elements) gets pack2(src[2k], src[2k+1]).
template <class Element, class Src, class Dst>
CUTLASS_DEVICE void pack_fragment(Src const& src, Dst& dst) {
    float const* s = cute::raw_pointer_cast(src.data());
    uint32_t* d = reinterpret_cast<uint32_t*>(cute::raw_pointer_cast(dst.data()));
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < decltype(cute::size(src))::value / 2; ++k) d[k] = pack2<Element>(s[2 * k], s[2 * k + 1]);
}

}  // namespace detail

}  // namespace mhakit::hopper
