// mhakit hopper family — dropout on a consumer warpgroup's wgmma accumulator (modifier instances, "_mods", with
// dropout.on). The random byte of each score is dropout.h's (Philox4x32-10 per 16 x 16 block and residue pair), so
// these kernels draw exactly the generic family's and the host references' bytes; each warp of a warpgroup holds 16
// rows of the 64-row accumulator in the m16n8 C layout, so dropout_lanes.cuh's lane-pair split of the Philox calls
// serves as it serves mma.sync. The randval store (tests) is a kernel of its own (common/dropout_randval.cuh, launched
// by the forward's run()): its store code in the key loop made the d256 modifier instance spill.
//
// The forward (FlashAttention's convention, as the generic family): the row sums and the LSE are of the undropped
// softmax; P ∘ keep goes into P·V and O is scaled by 1 / (1 − p) once at the end (scale_kept), which is the same sum
// as scaling each kept probability.
// The backward (on the transposed Sᵀ tile: rows are keys, columns queries): dV takes Pᵀ ∘ keep (its 1 / (1 − p) in
// the epilogue's scale) and dSᵀ = Pᵀ ∘ (dPᵀ ∘ keep / (1 − p) − D). The keep flag of each element lives in the sign
// of Pᵀ between the two (P >= 0; a dropped one is stored negated), so no register holds the bytes across the dV
// product: pack_kept packs max(Pᵀ, 0), softmax_grad_dropout_t reads |Pᵀ| and its sign.
#pragma once

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"

#include "kernels/common/dropout_lanes.cuh"

#include "hopper_types.hpp"

namespace mhakit::hopper {

namespace detail {

// The accumulator register of byte k of word w of the thread's rnd[np] (dropout_lanes.cuh's packing):
//   S   (kT = false): word = row half, byte = (nt & 1)·2 + column parity;
//   S^T (kT = true):  word = column (query) parity, byte = (nt & 1)·2 + row (key) half;
// with nt = 2·np + (k >> 1) and register 4·nt + 2·(row half) + (column parity).
template <bool kT>
CUTLASS_DEVICE constexpr int drop_reg(int np, int w, int k) {
    return 4 * (2 * np + (k >> 1)) + (kT ? 2 * (k & 1) + w : 2 * w + (k & 1));
}

// The four registers of one rnd word, each through op(register, all-ones-when-dropped).
template <bool kT, class Op>
CUTLASS_DEVICE void for_word(float* s, int np, int w, uint32_t flags, Op op) {
    op(s[drop_reg<kT>(np, w, 0)], drop_mask<0>(flags));
    op(s[drop_reg<kT>(np, w, 1)], drop_mask<1>(flags));
    op(s[drop_reg<kT>(np, w, 2)], drop_mask<2>(flags));
    op(s[drop_reg<kT>(np, w, 3)], drop_mask<3>(flags));
}

// Every register of a fragment of kNP 16 x 16 blocks (one 16-row slab of the warp, 16·kNP columns).
template <bool kT, int kNP, class Op>
CUTLASS_DEVICE void for_fragment(float* s, uint2 const (&rnd)[1][kNP], int keep_max, Op op) {
    const uint32_t c4 = drop_flag_bias(keep_max);
    CUTLASS_PRAGMA_UNROLL
    for (int np = 0; np < kNP; ++np) {
        for_word<kT>(s, np, 0, drop_flags(rnd[0][np].x, c4), op);
        for_word<kT>(s, np, 1, drop_flags(rnd[0][np].y, c4), op);
    }
}

// The first row and column of this warp's 16-row slab, from the coordinate of its first accumulator register
// (row 16·warp + g, column 2·t4 of the warpgroup's tile).
template <class TensorC>
CUTLASS_DEVICE int slab_row(TensorC const& c) { return cute::get<0>(c(0)) & ~15; }
template <class TensorC>
CUTLASS_DEVICE int slab_col(TensorC const& c) { return cute::get<1>(c(0)) & ~15; }

}  // namespace detail

// The forward's dropout of one key tile: P (acc_s, the 64 x kBlockN accumulator whose coordinates c_mn gives, after
// the softmax's update) -> P ∘ keep, in place. row0: the warpgroup's first query row, col0: the tile's first key,
// both counted from the sequence's start; bh = b·nhead_q + h.
template <class TensorS, class TensorC>
CUTLASS_DEVICE void drop_p(TensorS& acc_s, TensorC const& c_mn, Dropout const& d, uint32_t bh, int row0, int col0) {
    constexpr int kFrag = decltype(cute::size(acc_s))::value;  // 64 x kBlockN over 128 threads
    static_assert(kFrag % 8 == 0, "whole 16 x 16 blocks per warp");
    constexpr int kNP = kFrag / 8;
    const int r = row0 + detail::slab_row(c_mn);
    uint2 rnd[1][kNP];
    dropout_bytes<false, 1, kNP>(rnd, drop_key(d), bh, r, col0);
    float* s = cute::raw_pointer_cast(acc_s.data());
    detail::for_fragment<false>(s, rnd, d.keep_max, [](float& x, uint32_t dropped) {
        x = __uint_as_float(__float_as_uint(x) & ~dropped);
    });
}

// O (fp32 accumulator) *= 1 / (1 − p): the kept probabilities' scale, once for every key tile.
template <class TensorO>
CUTLASS_DEVICE void scale_kept(TensorO& acc_o, Dropout const& d) {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < decltype(cute::size(acc_o))::value; ++i) acc_o(i) *= d.rp;
}

// The backward's random bytes of one Sᵀ tile (keys x queries; cS: the (key, query) coordinate of each register of
// the warpgroup's part of the (kBlockN, kBlockM) tile). n0: the block's first key, r0: the tile's first query. Drawn
// while the Sᵀ / dPᵀ products run; kNP: 16 x 16 blocks per warp slab.
template <int kNP, class TensorC>
CUTLASS_DEVICE void drop_bytes_t(uint2 (&rnd)[1][kNP], TensorC const& cS, Dropout const& d, uint32_t bh, int n0,
                                 int r0) {
    dropout_bytes<true, 1, kNP>(rnd, drop_key(d), bh, n0 + detail::slab_row(cS), r0 + detail::slab_col(cS));
}

// Pᵀ (after recompute_pt) -> Pᵀ with the dropped elements negated (the keep flag until softmax_grad_dropout_t).
template <int kNP, class TensorP>
CUTLASS_DEVICE void flag_dropped_t(TensorP& acc_p, uint2 const (&rnd)[1][kNP], Dropout const& d) {
    static_assert(decltype(cute::size(acc_p))::value == 8 * kNP);
    float* s = cute::raw_pointer_cast(acc_p.data());
    detail::for_fragment<true>(s, rnd, d.keep_max, [](float& x, uint32_t dropped) {
        x = __uint_as_float(__float_as_uint(x) ^ (dropped & 0x80000000u));
    });
}

// The 16-bit A operand of dV from flagged Pᵀ: the kept probabilities (the dropped ones 0; 1 / (1 − p) comes with
// the dV epilogue's scale).
template <class Element, class Src, class Dst>
CUTLASS_DEVICE void pack_kept(Src const& src, Dst& dst) {
    float const* s = cute::raw_pointer_cast(src.data());
    uint32_t* o = reinterpret_cast<uint32_t*>(cute::raw_pointer_cast(dst.data()));
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < decltype(cute::size(src))::value / 2; ++k)
        o[k] = detail::pack2<Element>(fmaxf(s[2 * k], 0.f), fmaxf(s[2 * k + 1], 0.f));
}

// dSᵀ = Pᵀ ∘ (dPᵀ ∘ keep / (1 − p) − D), written over dPᵀ, from flagged Pᵀ (softmax_grad_t with dropout).
template <class TensorP, class TensorDP, class TensorC>
CUTLASS_DEVICE void softmax_grad_dropout_t(TensorP const& acc_p, TensorDP& acc_dp, TensorC const& cS,
                                           float const* dsum, float rp) {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < decltype(cute::size(cS))::value; ++i) {
        const int qq = cute::get<1>(cS(i));
        const float p = acc_p(i);
        const float dp = p < 0.f ? 0.f : acc_dp(i) * rp;
        acc_dp(i) = fabsf(p) * (dp - dsum[qq]);
    }
}

}  // namespace mhakit::hopper
