// mhakit hopper family — the forward's online softmax on one warpgroup's S accumulator (rows x keys view): running
// row max and sum in fp32, exp2 with scale·log2(e) folded into one FMA, P written over S, and the factor by which
// the O accumulator must be rescaled after each tile. Four threads share a row (the wgmma C layout), so row
// reductions are two xor-shuffles.
//
// Lazy rescaling (kLazy; FlashAttention-4's idea): a row's reference maximum moves only when a tile's maximum
// exceeds it by more than kRescaleLog2 in log2 units (a factor of 2^8); otherwise the tile's probabilities are taken
// against the old reference, so they may reach 2^8 instead of 1 (in fp32, and in P's 16-bit or e4m3 operand: all
// hold 256 with their usual relative precision), and O keeps its scale. The row sum, O and the LSE are all taken
// against the same reference, so the result is the same softmax. A warp whose rows all kept their reference skips
// O's rescale (hdim_v / 2 multiplies per thread, on the path between one P·V and the next); after a row's first
// tiles that is almost every tile. It pays where O holds many registers per score: the kernel's rule
// (HopperFwdKernelBody::kLazyRescale) and its measurements are there.
#pragma once

#include <cmath>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"

#include "hopper_types.hpp"

namespace mhakit::hopper {

constexpr float kRescaleLog2 = 8.f;  // how far (log2 units) a row's maximum may pass its reference unrescaled

template <int R, bool kLazy = false>  // R: rows held by one thread
struct OnlineSoftmax {
    float row_max[R], row_sum[R], scale_o[R];
    bool rescale_warp;  // kLazy: some row of this warp moved its reference in the last update (O must be rescaled)

    CUTLASS_DEVICE OnlineSoftmax() {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < R; ++i) {
            row_max[i] = -INFINITY;
            row_sum[i] = 0.f;
            scale_o[i] = 1.f;
        }
        rescale_warp = false;
    }

    // Row i of s_mn -> exp2(s·scale_log2 + neg) in place; returns the row's sum (this thread's columns).
    template <class TensorS>
    CUTLASS_DEVICE static float exp_row(TensorS& s_mn, int i, float scale_log2, float neg) {
        float sum = 0.f;
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < decltype(cute::size<1>(s_mn))::value; ++j) {
            const float pj = detail::exp2_approx(fmaf(s_mn(i, j), scale_log2, neg));
            s_mn(i, j) = pj;
            sum += pj;
        }
        return sum;
    }

    // The fresh (masked) scores of one key tile in s_mn: P overwrites S; scale_o gets O's rescale factor.
    // kOff: this thread's scores of row i are s_mn(i, ·) + off[i] (a term the caller left out of each of them: the
    // folded ALiBi tile, hopper_score_mod.hpp; it may differ between the four threads of a row), which joins the
    // thread's maximum before the row's reduction and the exp's constant: one FADD per row each.
    template <bool kFirst, bool kOff = false, class TensorS>
    CUTLASS_DEVICE void update(TensorS& s_mn, float scale_log2, [[maybe_unused]] float const* off = nullptr) {
        constexpr int C = decltype(cute::size<1>(s_mn))::value;
        static_assert(decltype(cute::size<0>(s_mn))::value == R);
        [[maybe_unused]] bool moved = false;
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < R; ++i) {
            float mx = kOff ? -INFINITY : row_max[i];  // kOff: the tile's own maximum first, then the offset
            CUTLASS_PRAGMA_UNROLL
            for (int j = 0; j < C; ++j) mx = fmaxf(mx, s_mn(i, j));
            // kOff: off[i] is this thread's (it holds the term of its own first key), so it joins before the four
            // threads of the row compare: their maxima are then in the same units (-inf stays -inf).
            if constexpr (kOff) mx += off[i];
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            if constexpr (kOff) mx = fmaxf(row_max[i], mx);
            [[maybe_unused]] bool move = true;  // the reference moves to mx (always, without kLazy)
            if constexpr (!kFirst && kLazy) {
                // Only past the threshold (-inf to a finite maximum always: +inf > it; a row with nothing visible
                // yet compares NaN and keeps -inf).
                move = (mx - row_max[i]) * scale_log2 > kRescaleLog2;
                if (!move) mx = row_max[i];
                moved |= move;
            }
            const float m_ref = (mx == -INFINITY) ? 0.f : mx;  // rows with nothing visible yet: no NaN
            float neg = -m_ref * scale_log2;
            if constexpr (kOff) neg = (off[i] - m_ref) * scale_log2;
            if constexpr (!kFirst) scale_o[i] = move ? detail::exp2_approx((row_max[i] - m_ref) * scale_log2) : 1.f;
            row_max[i] = mx;
            const float sum = exp_row(s_mn, i, scale_log2, neg);
            row_sum[i] = kFirst ? sum : fmaf(row_sum[i], scale_o[i], sum);
        }
        if constexpr (!kFirst && kLazy) rescale_warp = __any_sync(0xffffffffu, moved);
    }

    // A fixed reference maximum m for every row instead of the running one, where the caller knows that no score
    // exceeds m and that exp2((s - m)·scale_log2) of the smallest stays a normal float (the soft-cap's calls,
    // fmha_hopper_kernel.hpp): update_fixed then takes no row maximum (no compares, no shuffles) and O needs no
    // rescale. finalize reads row_max as usual.
    CUTLASS_DEVICE void fix_reference(float m) {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < R; ++i) row_max[i] = m;
    }
    template <class TensorS>
    CUTLASS_DEVICE void update_fixed(TensorS& s_mn, float scale_log2) {
        static_assert(decltype(cute::size<0>(s_mn))::value == R);
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < R; ++i) row_sum[i] += exp_row(s_mn, i, scale_log2, -row_max[i] * scale_log2);
    }

    // O *= the factor of the last update (O in its rows x columns view), unless no row of the warp moved.
    template <class TensorO>
    CUTLASS_DEVICE void rescale(TensorO& o_mn) const {
        if (kLazy && !rescale_warp) return;
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < R; ++i) scale_row(o_mn, i, scale_o[i]);
    }

    // Row i's sum over the four threads that share it.
    CUTLASS_DEVICE float row_total(int i) const {
        float s = row_sum[i];
        s += __shfl_xor_sync(0xffffffffu, s, 1);
        s += __shfl_xor_sync(0xffffffffu, s, 2);
        return s;
    }
    template <class TensorO>
    CUTLASS_DEVICE static void scale_row(TensorO& o_mn, int i, float f) {
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < decltype(cute::size<1>(o_mn))::value; ++j) o_mn(i, j) *= f;
    }

    // O /= row sum, and the natural-log LSE (-inf, with O = 0, for rows that saw no key).
    template <class TensorO>
    CUTLASS_DEVICE void finalize(TensorO& o_mn, float scale, float (&lse)[R]) const {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < R; ++i) {
            const float s = row_total(i);
            const bool any = s > 0.f;
            const float inv = any ? 1.f / s : 0.f;
            lse[i] = any ? row_max[i] * scale + __logf(s) : -INFINITY;
            scale_row(o_mn, i, inv);
        }
    }

    // The same with an attention sink (the modifier instances; -inf: none): the sink logit joins every row's
    // denominator and LSE, in logit units (scale: q·k -> logit); a row that saw no key gets O = 0 and LSE = sink.
    template <class TensorO>
    CUTLASS_DEVICE void finalize(TensorO& o_mn, float scale, float (&lse)[R], float sink) const {
        if (sink == -INFINITY) return finalize(o_mn, scale, lse);
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < R; ++i) {
            const float s = row_total(i);
            const bool any = s > 0.f;
            const float m = any ? row_max[i] * scale : -INFINITY;
            const float mm = fmaxf(m, sink);
            const float a = any ? expf(m - mm) : 0.f;
            const float total = s * a + expf(sink - mm);
            lse[i] = mm + logf(total);
            scale_row(o_mn, i, a / total);
        }
    }
};

}  // namespace mhakit::hopper

namespace mhakit::hopper {

// The backward's softmax: P recomputed from the forward's LSE, on a transposed (keys x queries) accumulator whose
// element i sits at (key, query) = cS(i) of the tile: Pᵀ = exp2(Sᵀ·scale·log2e − LSE·log2e), 0 where the mask hides
// the pair (need_mask: the tile pair is not full) or the key is past seqlen_k. lse2: LSE·log2e of the tile's
// query columns (+inf for padding rows, which makes their P exactly 0).
// kMaskBlock: the element mask in a loop of its own under the tile's uniform need_mask test, so that the full tiles
// (most of a causal call's) branch past it; otherwise the test sits in the exp2 loop and nvcc predicates the mask's
// compares and selects, issued on every tile. The plain instances take it: d128 causal 693 -> 502 instructions per
// consumer thread and full tile (SASS), and bench_bwd.py (bf16, H100, 2 rounds, 2026-11-25) read d128 unmasked
// +5 to +11 %, causal d64 +2 to +7 %, d128 0 to +7 %, d256 -1 to +2 %. In the generic "_mods" kernel the separate
// loop made ptxas spill (d128: 152 / 188 bytes), so it keeps the predicated form; its fixed variants (BwdModVar,
// fmha_bwd_hopper_kernel.hpp), without the per-tile dispatch, take the block.
template <bool kMasked, bool kMaskBlock = false, class TensorS, class TensorC>
CUTLASS_DEVICE void recompute_pt(TensorS& acc_S, TensorC const& cS, float const* lse2, float scale_log2,
                                 bool need_mask, int n0, int r0, int sk, int x, int y) {
    // whether the element (key kk, query qq) of the tile is visible
    auto visible = [&](int kk, int qq) {
        const int key = n0 + kk;
        bool vis = key < sk;
        if constexpr (kMasked) {
            const int d = key - (r0 + qq);  // visible iff 1 - y <= key - row < x
            vis = vis && d >= 1 - y && d < x;
        }
        return vis;
    };
    if constexpr (kMaskBlock) {
        if (need_mask) {
            CUTLASS_PRAGMA_UNROLL
            for (int i = 0; i < decltype(cute::size(cS))::value; ++i)
                if (!visible(cute::get<0>(cS(i)), cute::get<1>(cS(i)))) acc_S(i) = -INFINITY;
        }
    }
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < decltype(cute::size(cS))::value; ++i) {
        const int kk = cute::get<0>(cS(i));
        const int qq = cute::get<1>(cS(i));
        float s = acc_S(i);
        if constexpr (!kMaskBlock) {
            if (need_mask) {
                if (!visible(kk, qq)) s = -INFINITY;
            }
        }
        acc_S(i) = detail::exp2_approx(fmaf(s, scale_log2, -lse2[qq]));
    }
}

// dSᵀ = Pᵀ ∘ (dPᵀ − D), written over dPᵀ; dsum: D of the tile's query columns.
template <class TensorP, class TensorDP, class TensorC>
CUTLASS_DEVICE void softmax_grad_t(TensorP const& acc_P, TensorDP& acc_dP, TensorC const& cS, float const* dsum) {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < decltype(cute::size(cS))::value; ++i) {
        const int qq = cute::get<1>(cS(i));
        acc_dP(i) = acc_P(i) * (acc_dP(i) - dsum[qq]);
    }
}

// The same two steps on a (query, key) accumulator (the swapped key split's S and dP), in its rows x keys view s_mn
// with coordinates c_mn in the tile: one LSE / D per row (query). The mask is the forward's (ForwardMask::apply on
// the same view), applied by the caller before recompute_p where the tile pair is not full.
template <class TensorS, class TensorC>
CUTLASS_DEVICE void recompute_p(TensorS& s_mn, TensorC const& c_mn, float const* lse2, float scale_log2) {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < decltype(cute::size<0>(s_mn))::value; ++i) {
        const float l = lse2[cute::get<0>(c_mn(i, 0))];
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < decltype(cute::size<1>(s_mn))::value; ++j)
            s_mn(i, j) = detail::exp2_approx(fmaf(s_mn(i, j), scale_log2, -l));
    }
}

// dS = P ∘ (dP − D), written over dP (both rows x keys views); dsum: D of the tile's rows.
template <class TensorP, class TensorDP, class TensorC>
CUTLASS_DEVICE void softmax_grad(TensorP const& p_mn, TensorDP& dp_mn, TensorC const& c_mn, float const* dsum) {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < decltype(cute::size<0>(dp_mn))::value; ++i) {
        const float d = dsum[cute::get<0>(c_mn(i, 0))];
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < decltype(cute::size<1>(dp_mn))::value; ++j) dp_mn(i, j) = p_mn(i, j) * (dp_mn(i, j) - d);
    }
}

}  // namespace mhakit::hopper
