// mhakit hopper family — the score modifiers (kernels/common/score_mod.h) on one consumer warpgroup's S accumulator
// (the wgmma C fragment in its rows x keys view, coordinates from the identity tensor partitioned the same way).
// Only the modifier instances ("_mods", kMods) compile this. Forward: soft-cap and bias / ALiBi turn the raw q·k into
// logits divided by a unit U (FwdModUnits) in place, before the mask (the softmax then runs with scale U); the sink
// joins each row's denominator and LSE in OnlineSoftmax::finalize (hopper_softmax.hpp). Backward (the *_t pieces at
// the end, on the transposed Sᵀ tile): the logits before Pᵀ is recomputed, then dbias and the soft-cap's derivative
// on dSᵀ.
//
// Elementwise bias values: a quad of threads holds 8 consecutive keys of a row (a pair each), the 8 quads of a warp 8
// rows, so a warp's read of one pair per thread covers 8 rows x 16 (16-bit bias) or 32 (fp32) contiguous bytes. A
// 16-bit bias of a stageable layout (bias_stageable) comes from the shared-memory ring that the producer warpgroup's
// bias warp fills by TMA into 128-byte swizzled boxes (hopper_bias_stage.hpp; forward: apply_score_mods_staged, one
// 4-byte shared load per pair; backward, on Sᵀ: apply_score_mods_t_staged, ldmatrix .trans; no predicates: the slot
// holds zeros past the sequence, and group mode leaves a slot that would reach past it unstaged); any other bias, and
// such a tile, is read from global memory by the consumer threads: the forward in the loop that applies it
// (apply_score_mods), the backward's 16-bit one all loads of the part ahead of that loop (load_bias16_t; fp32: in the
// loop, apply_score_mods_t).
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_fp16.h>

#include "cute/arch/copy_sm90_desc.hpp"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"

#include "kernels/common/score_mod.h"

#include "hopper_types.hpp"  // detail::pack2

namespace mhakit::hopper {

// The modifier instances' part of the kernel parameters: the call's modifiers (a plain instance's Params derive from
// the empty one, so their layout is unchanged) and, for a staged elementwise bias (the instances with a bias ring,
// hopper_bias_stage.hpp), its tensor map: bias_staged when the launcher made one.
template <bool kMods>
struct ModParams {};
template <>
struct ModParams<true> {
    ScoreMods mods;
    cute::TmaDescriptor bias_map;
    bool bias_staged;
};

// The backward's: the modifiers, where dS goes for an elementwise bias (dbias, the bias's element type; null when
// not asked for) and, for a staged one (bias_stageable, in the instances with a bias ring), its tensor map. Plain
// instances: nothing.
template <bool kMods>
struct BwdModParams {};
template <>
struct BwdModParams<true> {
    ScoreMods mods;
    char* dbias;
    int64_t dbias_row, dbias_head, dbias_batch;  // elements
    cute::TmaDescriptor bias_map;
};

// Whether the call has a modifier that changes each score before the softmax (soft-cap, bias / ALiBi; dropout acts on
// P, hopper_dropout.hpp): without one (a sink or dropout alone) both directions keep S = q·k and the plain softmax
// scale, and skip the modifier pass.
CUTLASS_DEVICE bool per_score_mods(ScoreMods const& m) { return m.softcap > 0.f || m.bias_type != 0; }

// The forward keeps S in units of U, logit = U·S (FwdModUnits): U = the soft-cap with one (S = tanh(scale·q·k / cap)),
// else the softmax scale (S = q·k, untouched). So the softmax runs with scale U (U·log2 e in its one FFMA per score),
// no multiply turns q·k or tanh into a logit, and a call without a per-score modifier (a sink alone) runs the plain
// kernel's key loop. ALiBi and bias terms join S divided by U.
struct FwdModUnits {
    float unit;     // U
    float slope_u;  // ALiBi: -slope / U (0 without)

    CUTLASS_DEVICE static FwdModUnits of(ScoreMods const& m, int b, int h) {
        FwdModUnits u;
        u.unit = m.softcap > 0.f ? m.softcap : m.scale;
        u.slope_u = 0.f;
        if (m.bias_type == 2)
            u.slope_u = -static_cast<const float*>(m.bias)[int64_t(b) * m.bias_batch_stride +
                                                           int64_t(h) * m.bias_head_stride] / u.unit;
        return u;
    }
};

namespace detail {

// Two consecutive bias elements (p 2-element aligned) as floats: one 4-byte (16-bit bias) or 8-byte (fp32) load.
template <class BiasT>
CUTLASS_DEVICE void load_bias_pair(BiasT const* p, float& a, float& b) {
    if constexpr (sizeof(BiasT) == 4) {
        const float2 v = *reinterpret_cast<float2 const*>(p);
        a = v.x, b = v.y;
    } else {
        const uint32_t w = *reinterpret_cast<uint32_t const*>(p);
        a = float(BiasT::bitcast(uint16_t(w & 0xffffu)));
        b = float(BiasT::bitcast(uint16_t(w >> 16)));
    }
}

// One tile of apply_score_mods for the variant <soft-cap, bias kind> (and, with an elementwise bias, its element
// type BiasT: float, or the data type), in units of U (FwdModUnits): S -> tanh(S·arg) with a soft-cap, then ALiBi's
// -slope/U·|i + s_k − s_q − j| or bias/U. The ALiBi distance is made in fp32 (exact: |d| < 2^24) from one value per
// row and the column's offset inside the thread's fragment, a compile-time constant (the identity tensor's layout is
// static): one FADD, and the |d|·slope FFMA, per score, no integer-to-float conversion. Bias elements are read only
// where the position lies inside the sequence (rows a tile runs over and keys the mask hides next read nothing); a
// thread's fragment holds keys in pairs (columns c, c + 1 of the wgmma C layout: j = 2k, 2k + 1 of the rows x keys
// view), a pair inside the sequence is one load when the bias rows are 2-element aligned (pair_ok).
template <bool kCap, int kBias, class BiasT, class TensorS, class TensorC>
CUTLASS_DEVICE void score_mods_tile(TensorS& s_mn, TensorC const& c_mn, ScoreMods const& m, FwdModUnits const& u,
                                    char const* bias, int64_t bias_row_bytes, int sq, int sk, int row0, int key0,
                                    bool pair_ok) {
    constexpr int R = decltype(cute::size<0>(s_mn))::value;
    constexpr int C = decltype(cute::size<1>(s_mn))::value;
    static_assert(C % 2 == 0, "a thread holds its keys in pairs");
    [[maybe_unused]] const float arg = m.softcap_arg;
    [[maybe_unused]] const float inv_unit = kBias == 1 ? __fdividef(1.f, u.unit) : 0.f;
    const int col0 = int(cute::get<1>(c_mn(0, 0)));
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < R; ++i) {
        const int row = row0 + int(cute::get<0>(c_mn(i, 0)));
        [[maybe_unused]] float dist0 = 0.f;  // ALiBi: i + s_k − s_q − j of the thread's first column
        if constexpr (kBias == 2) dist0 = float(row + (sk - sq) - (key0 + col0));
        [[maybe_unused]] BiasT const* bias_row = nullptr;
        [[maybe_unused]] bool row_in = false;
        if constexpr (kBias == 1) {
            row_in = row < sq;
            bias_row = reinterpret_cast<BiasT const*>(bias + int64_t(row) * bias_row_bytes);
        }
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < C; j += 2) {
            float v[2];
            CUTLASS_PRAGMA_UNROLL
            for (int e = 0; e < 2; ++e) {
                v[e] = s_mn(i, j + e);
                if constexpr (kCap) v[e] = approx_tanh(v[e] * arg);
                if constexpr (kBias == 2) {
                    const float d = dist0 - float(int(cute::get<1>(c_mn(i, j + e))) - col0);
                    v[e] = fmaf(u.slope_u, fabsf(d), v[e]);
                }
            }
            if constexpr (kBias == 1) {
                const int c0 = key0 + int(cute::get<1>(c_mn(i, j)));
                const int c1 = key0 + int(cute::get<1>(c_mn(i, j + 1)));
                if (row_in) {
                    if (pair_ok && c1 == c0 + 1 && c1 < sk) {
                        float b0, b1;
                        load_bias_pair(bias_row + c0, b0, b1);
                        v[0] = fmaf(b0, inv_unit, v[0]);
                        v[1] = fmaf(b1, inv_unit, v[1]);
                    } else {
                        if (c0 < sk) v[0] = fmaf(float(bias_row[c0]), inv_unit, v[0]);
                        if (c1 < sk) v[1] = fmaf(float(bias_row[c1]), inv_unit, v[1]);
                    }
                }
            }
            s_mn(i, j) = v[0];
            s_mn(i, j + 1) = v[1];
        }
    }
}

// ALiBi on a key tile where the distance d = i + s_k − s_q − j keeps one sign σ over every (row, key) of the
// warpgroup's tile (alibi_tile_sign): slope_u·|d| = σ·slope_u·(dist0_i − (j − j0)) splits into a column part, added
// here by one FFMA per score (j − j0, the key's offset in the thread's fragment, a compile-time constant), and a row
// part σ·slope_u·dist0_i, which goes to off[i] for the softmax (OnlineSoftmax::update<·, kOff>) instead of into every
// score: one FFMA per score in place of score_mods_tile's FADD and FFMA. (In units of U, as score_mods_tile.)
template <class TensorS, class TensorC, int R>
CUTLASS_DEVICE void alibi_tile_folded(TensorS& s_mn, TensorC const& c_mn, float sigma_slope_u, float (&off)[R], int sq,
                                      int sk, int row0, int key0) {
    static_assert(decltype(cute::size<0>(s_mn))::value == R);
    constexpr int C = decltype(cute::size<1>(s_mn))::value;
    const int col0 = int(cute::get<1>(c_mn(0, 0)));
    const float c = -sigma_slope_u;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < R; ++i) {
        const int row = row0 + int(cute::get<0>(c_mn(i, 0)));
        off[i] = sigma_slope_u * float(row + (sk - sq) - (key0 + col0));
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < C; ++j) {
            const int dj = int(cute::get<1>(c_mn(i, j))) - col0;  // compile-time: the test folds away
            if (dj != 0) s_mn(i, j) = fmaf(c, float(dj), s_mn(i, j));
        }
    }
}

}  // namespace detail

// The sign σ of ALiBi's distance d = i + s_k − s_q − j over a tile of kRows query rows from row0 and kKeys keys from
// key0 (positions in the sequence; rows and keys past its end count too, so it holds for what the tile computes): +1
// where every d >= 0, -1 where every d <= 0, 0 where the diagonal crosses the tile. Uniform over the warpgroup.
template <int kRows, int kKeys>
CUTLASS_HOST_DEVICE int alibi_tile_sign(int sq, int sk, int row0, int key0) {
    const int d_min = row0 + (sk - sq) - (key0 + kKeys - 1), d_max = row0 + kRows - 1 + (sk - sq) - key0;
    return d_min >= 0 ? 1 : d_max <= 0 ? -1 : 0;
}

// ALiBi alone on a key tile, with the row part left to the softmax (off, zero where the tile holds the diagonal and
// score_mods_tile's |d| per score does the whole term): the fixed ALiBi kernel's (fmha_hopper_kernel.hpp).
template <int kRows, int kKeys, class TensorS, class TensorC, int R>
CUTLASS_DEVICE void apply_alibi_folding(TensorS& s_mn, TensorC const& c_mn, ScoreMods const& m, FwdModUnits const& u,
                                        float (&off)[R], int sq, int sk, int row0, int key0) {
    const int sign = alibi_tile_sign<kRows, kKeys>(sq, sk, row0, key0);
    if (sign != 0) {
        detail::alibi_tile_folded(s_mn, c_mn, float(sign) * u.slope_u, off, sq, sk, row0, key0);
    } else {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < R; ++i) off[i] = 0.f;
        detail::score_mods_tile<false, 2, float>(s_mn, c_mn, m, u, nullptr, 0, sq, sk, row0, key0, false);
    }
}

// S (raw q·k, rows x keys view s_mn with tile coordinates c_mn) of the key tile starting at key0, for query rows
// from row0 on (positions count from the sequence's start; sequence b with sq queries and sk keys, query head h) ->
// logits / U, in place. Call it only where per_score_mods(m): without a per-score modifier S is already in its
// units. One branch per tile picks the variant <soft-cap, bias kind, bias element type>, so the element loop has no
// branch on the modifiers. (Written out, not through with_mod_kind's lambda: through it nvcc outlined the whole tile,
// with S on the stack.)
template <class Element, bool kCap, class TensorS, class TensorC>
CUTLASS_DEVICE void apply_score_mods_cap(TensorS& s_mn, TensorC const& c_mn, ScoreMods const& m,
                                         FwdModUnits const& u, int b, int h, int sq, int sk, int row0, int key0) {
    if (m.bias_type == 2) {
        detail::score_mods_tile<kCap, 2, float>(s_mn, c_mn, m, u, nullptr, 0, sq, sk, row0, key0, false);
    } else if (m.bias_type == 1) {
        // (b, h, 0, 0) and the row stride in bytes: every row starts 2-element aligned, or pairs load apart
        const int64_t elem = m.bias_fp32 ? 4 : 2;
        char const* bias = static_cast<char const*>(m.bias) +
                           (int64_t(b) * m.bias_batch_stride + int64_t(h) * m.bias_head_stride) * elem;
        const int64_t row_bytes = m.bias_row_stride * elem;
        const int64_t pair_bytes = 2 * elem;
        const bool pair_ok = ((reinterpret_cast<uintptr_t>(bias) | uintptr_t(row_bytes)) & uintptr_t(pair_bytes - 1)) == 0;
        if (m.bias_fp32)
            detail::score_mods_tile<kCap, 1, float>(s_mn, c_mn, m, u, bias, row_bytes, sq, sk, row0, key0, pair_ok);
        else
            detail::score_mods_tile<kCap, 1, Element>(s_mn, c_mn, m, u, bias, row_bytes, sq, sk, row0, key0, pair_ok);
    } else {
        detail::score_mods_tile<kCap, 0, float>(s_mn, c_mn, m, u, nullptr, 0, sq, sk, row0, key0, false);
    }
}

template <class Element, class TensorS, class TensorC>
CUTLASS_DEVICE void apply_score_mods(TensorS& s_mn, TensorC const& c_mn, ScoreMods const& m, FwdModUnits const& u,
                                     int b, int h, int sq, int sk, int row0, int key0) {
    if (m.softcap > 0.f)
        apply_score_mods_cap<Element, true>(s_mn, c_mn, m, u, b, h, sq, sk, row0, key0);
    else
        apply_score_mods_cap<Element, false>(s_mn, c_mn, m, u, b, h, sq, sk, row0, key0);
}

namespace detail {

// One tile of apply_score_mods_staged: S -> tanh(S·arg) with a soft-cap, then + bias/U with the bias pair of each
// (row, key pair) read from the warpgroup's shared-memory slot (Stage: hopper_bias_stage.hpp's BiasStage, 64 rows,
// 16-bit elements of BiasT), one 4-byte shared load per pair. 128-byte swizzled boxes: box col / 64,
// row·128 + 16·((col / 8 % 8) ^ (row % 8)) + 2·(col % 8).
// The wgmma C fragment puts a thread's elements at rows r_t + 8a and columns c_t + 8b (+1), with c_t = 2·(lane % 4) < 8
// (its rows x keys view: the first element, c_mn(0, 0), is the thread's (r_t, c_t)): every element of the thread has
// the row phase r_t % 8 and its pair inside one chunk, so the swizzle is the XOR of the compile-time chunk index with
// one per-thread value (a register set per chunk, eight per tile) and the rest folds into the loads' offsets.
template <bool kCap, class Stage, class BiasT, class TensorS, class TensorC>
CUTLASS_DEVICE void score_mods_tile_staged(TensorS& s_mn, TensorC const& c_mn, ScoreMods const& m,
                                           FwdModUnits const& u, char const* slot) {
    constexpr int R = decltype(cute::size<0>(s_mn))::value;
    constexpr int C = decltype(cute::size<1>(s_mn))::value;
    static_assert(C % 2 == 0, "a thread holds its keys in pairs");
    [[maybe_unused]] const float arg = m.softcap_arg;
    const float inv_unit = __fdividef(1.f, u.unit);
    // The thread's offset of chunk 0 in the slot with its row phase in the chunk bits (4..6: r_t·128 and
    // 2·c_t < 16 leave them clear), made opaque per tile (a volatile move) so that the chunks' eight XORs stay in the
    // tile rather than being hoisted out of the key loop as eight more live registers (the slot's address is loop
    // invariant with one stage).
    int off;
    {
        const int r_t = int(cute::get<0>(c_mn(0, 0))), c_t = int(cute::get<1>(c_mn(0, 0)));
        off = r_t * Stage::kPitch + 2 * c_t + ((r_t % 8) << 4);
        asm volatile("mov.b32 %0, %0;\n" : "+r"(off));
    }
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < R; ++i) {
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < C; j += 2) {
            const int row = int(cute::get<0>(c_mn(i, j))), col = int(cute::get<1>(c_mn(i, j)));
            // compile-time once folded: multiples of 8 from the thread's first element
            const int dr = row - int(cute::get<0>(c_mn(0, 0))), dc = col - int(cute::get<1>(c_mn(0, 0)));
            char const* pair = slot + ((off ^ (((dc / 8) % 8) << 4)) + dr * Stage::kPitch + (dc / 64) * Stage::kBoxBytes);
            float b0, b1;
            load_bias_pair(reinterpret_cast<BiasT const*>(pair), b0, b1);
            float v0 = s_mn(i, j), v1 = s_mn(i, j + 1);
            if constexpr (kCap) {
                v0 = approx_tanh(v0 * arg);
                v1 = approx_tanh(v1 * arg);
            }
            s_mn(i, j) = fmaf(b0, inv_unit, v0);
            s_mn(i, j + 1) = fmaf(b1, inv_unit, v1);
        }
    }
}

}  // namespace detail

// apply_score_mods for an elementwise bias staged in shared memory (hopper_bias_stage.hpp, Stage its BiasStage): slot
// holds the 64 x kBlockN bias tile of this warpgroup's rows and this key tile, zeros outside the sequence.
template <class Element, class Stage, class TensorS, class TensorC>
CUTLASS_DEVICE void apply_score_mods_staged(TensorS& s_mn, TensorC const& c_mn, ScoreMods const& m,
                                            FwdModUnits const& u, char const* slot) {
    if (m.softcap > 0.f)
        detail::score_mods_tile_staged<true, Stage, Element>(s_mn, c_mn, m, u, slot);
    else
        detail::score_mods_tile_staged<false, Stage, Element>(s_mn, c_mn, m, u, slot);
}

// ---- the backward: Sᵀ tiles (keys x queries; cS gives each element's (key, query) tile coordinate) ----------------

namespace detail {

// The wgmma C fragment of an Sᵀ part (keys x queries, cS its coordinates) in CuTe's value order, which the readers of
// a bias tile (ldmatrix .trans, load_bias16_t) assume: element i at key k_t + 8·((i / 2) % 2) and query
// q_t + 8·(i / 4) + i % 2 (lane l: k_t = kw + l / 4, q_t = qw + 2·(l % 4)), i.e. over the modes (2, 2, N / 4):
// query + 1, key + 8, query + 8. Checked at compile time.
template <class TensorC>
CUTLASS_DEVICE constexpr void assert_st_value_order() {
    using L = decltype(std::declval<TensorC const&>().layout());
    using S0 = std::decay_t<decltype(cute::stride<0>(L{}))>;
    using Z0 = std::decay_t<decltype(cute::shape<0>(L{}))>;
    static_assert(std::is_same_v<std::decay_t<decltype(cute::get<0>(S0{}))>, cute::ScaledBasis<cute::_1, 1>> &&
                      std::is_same_v<std::decay_t<decltype(cute::get<1>(S0{}))>, cute::ScaledBasis<cute::_8, 0>> &&
                      std::is_same_v<std::decay_t<decltype(cute::get<2>(S0{}))>, cute::ScaledBasis<cute::_8, 1>> &&
                      decltype(cute::get<0>(Z0{}))::value == 2 && decltype(cute::get<1>(Z0{}))::value == 2 &&
                      decltype(cute::size<0>(L{}))::value == decltype(cute::size(L{}))::value,
                  "Sᵀ fragment: pairs of consecutive queries, then key + 8, then query + 8");
}

// A 16-bit global load into a 32-bit register (zero-extended), 0 where `in` is off: one predicated load (written as
// C++ conditions, nvcc branched around each load).
CUTLASS_DEVICE uint32_t ld_bias16_or_0(char const* a, bool in) {
    uint32_t w;
    asm("{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n mov.b32 %0, 0;\n @p ld.global.u16 %0, [%1];\n}\n"
        : "=r"(w)
        : "l"(a), "r"(int(in)));
    return w;
}

// The unstaged 16-bit bias of one Sᵀ part (kBias = 1 with a 16-bit BiasT: a bias the bias warp does not stage, or a
// group-mode slot it leaves empty) from global memory: elems[i] the raw bits of element i's bias (assert_st_value_order),
// 0 outside the sequence (rows >= sq, keys >= sk). bias: the element block (b, h, 0, 0) in bytes, rows row_bytes apart,
// any 2-byte alignment (an odd row pitch included). Every load of the part is issued here, ahead of the modifier loop
// that adds them, from one row pointer per query block (stepped by 8 rows: two 64-bit adds; the next query one pitch
// on) at compile-time key offsets (key + 8: 16 bytes), each load predicated on its row and key: a warp's load reads
// 4 rows x 16 contiguous bytes, as the per-element loads did, which made a 64-bit address per element and used each
// load right after it (2-4 in flight: the tile waited on L2 about ten times). SASS, d128 bf16 batch mask generic
// kernel, the bias tile's instructions per thread (no soft-cap / soft-cap): 481 / 589 -> 218 / 323, 32 loads either
// way, about ten in flight; ptxas's spills unchanged (80 / 100 bytes).
// Tried and not kept, for the spills of that kernel (ptxas, bytes of stores / loads): two keys of a query row per
// 4-byte load where the rows are 4-byte aligned, transposed into the fragment's pairs by movmatrix .trans (as
// store_dbias_pairs_t does for dbias; half the loads), 128-156 / 140-156; the loads in two halves of the part,
// 156 / 348; an unpredicated copy of the loads for parts inside the sequence, 204 / 160.
template <int N, class TensorC>
CUTLASS_DEVICE void load_bias16_t(uint32_t (&elems)[N], TensorC const& cS, char const* bias, int64_t row_bytes, int sq,
                                  int sk, int r0, int n0) {
    assert_st_value_order<TensorC>();
    static_assert(N == decltype(cute::size(cS))::value && N % 4 == 0, "whole query blocks of two key halves");
    const int key = n0 + int(cute::get<0>(cS(0))), row = r0 + int(cute::get<1>(cS(0)));
    const int64_t step = 8 * row_bytes;  // the next query block
    char const* a = bias + int64_t(row) * row_bytes + int64_t(key) * 2;
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < N / 4; ++j, a += step) {  // queries + 8j
        CUTLASS_PRAGMA_UNROLL
        for (int h = 0; h < 2; ++h) {  // keys + 8h
            const bool key_in = key + 8 * h < sk;
            elems[4 * j + 2 * h] = ld_bias16_or_0(a + 16 * h, key_in && row + 8 * j < sq);
            elems[4 * j + 2 * h + 1] = ld_bias16_or_0(a + row_bytes + 16 * h, key_in && row + 8 * j + 1 < sq);
        }
    }
}

// One tile of apply_score_mods_t for the variant <soft-cap, bias kind, BiasT>: the logit of score_mod.h (soft-cap with
// approx_tanh, as the forward) with ALiBi's |i + s_k − s_q − j| made in fp32 from one value per tile and each
// element's compile-time offset in the thread's fragment (one FADD and the FFMA, no integer-to-float conversion per
// element). Every element gets its logit, also outside the sequence, where its P is 0 anyway (a key past s_k:
// recompute_pt masks it, the tile not being full; a row past s_q: LSE = +inf); only the bias is read inside it alone.
// kBias = 1: an elementwise bias from global memory, 16-bit all at once ahead of the loop (load_bias16_t), fp32 a
// load per element in it. kBias = 3: a 16-bit bias staged in shared memory (Stage: hopper_bias_stage.hpp's BiasStage of one 64-row slot, 128-
// byte swizzled boxes of 64 keys, zero outside the sequence), read with ldmatrix .trans. The wgmma C fragment of
// Sᵀ (keys x queries) gives lane l the key k_t = kw + l / 4 (kw: its warp's first key) and the queries
// q_t = qw + 2·(l % 4) (+1) (qw: its warpgroup's first query), then (CuTe's value order, static_assert below) its
// element pairs p = 0, 1, ... at key k_t + 8·(p % 2), queries q_t + 8·(p / 2) (+1). The bias tile is stored (query
// rows, keys), so pair p is the lane's pair of the 8 x 8 matrix "rows qw + 8·(p / 2) .. + 7 (queries), key chunk
// kw + 8·(p % 2)", as ldmatrix .trans hands it out: register j of a load is matrix j's (row 2·(l % 4) (+1), column
// l / 4). kLdX matrices per load (.x2: pairs 2c, 2c + 1, the two key chunks of query rows 8c ..; .x4: pairs 4c ..
// 4c + 3), matrix j = l / 8 taking its row l % 8 from lane l, one 16-byte row each; the swizzle puts a matrix's 8
// rows (8 consecutive row phases) on 8 distinct chunks of 128-byte rows, so each matrix is read conflict-free. Per
// tile: kSFrag / (2·kLdX) ldmatrix instead of kSFrag 2-byte loads. ptxas, d128 _mods (bytes of spill stores /
// loads; main's cp.async ring 96 / 88 in both modes): .x4 batch 80 / 80, group 100 / 88; .x2 96 / 88 in both.
template <bool kCap, int kBias, class BiasT, class Stage = void, class TensorS, class TensorC, class Dcap>
CUTLASS_DEVICE void score_mods_tile_t(TensorS& acc_S, TensorC const& cS, RowMods const& r, int r0, int n0,
                                      Dcap& dcap, char const* tile = nullptr) {
    const auto unused16 = [](uint16_t) { return 0.f; };  // the bias is added here, not by modified_logit_t
    constexpr int N = decltype(cute::size(cS))::value;
    const int k00 = int(cute::get<0>(cS(0))), q00 = int(cute::get<1>(cS(0)));
    [[maybe_unused]] const float dist0 = float((r0 + q00) + (r.seqlen_k - r.seqlen_q) - (n0 + k00));
    [[maybe_unused]] char const* ld_row = nullptr;  // kBias = 3: this lane's ldmatrix row of the first load
    constexpr int kLdX = 4;                         // kBias = 3: matrices (pairs) per ldmatrix
    if constexpr (kBias == 3) {
        static_assert(N % (2 * kLdX) == 0, "whole ldmatrix loads");
        static_assert(Stage::kSlots == 1, "one 64-row slot (kBlockM = 64)");
        assert_st_value_order<TensorC>();  // the fragment's value order assumed above
        const int lane = int(threadIdx.x % 32);
        const int key = k00 - lane / 4 + 8 * ((lane / 8) % 2);
        const int row = q00 - 2 * (lane % 4) + 8 * ((lane / 8) % kLdX / 2) + lane % 8;
        ld_row = tile + (key / Stage::kBoxKeys) * Stage::kBoxBytes + row * Stage::kPitch +
                 16 * (((key / 8) % 8) ^ (row % 8));
    }
    [[maybe_unused]] uint32_t bias_pairs[kLdX];
    // kBias = 1, a 16-bit bias: the part's elements from global memory, every load issued before the loop
    constexpr bool kGlobal16 = kBias == 1 && sizeof(BiasT) == 2;
    [[maybe_unused]] uint32_t global_elems[kGlobal16 ? N : 1];
    if constexpr (kGlobal16) load_bias16_t(global_elems, cS, r.bias, r.bias_row_bytes, r.seqlen_q, r.seqlen_k, r0, n0);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; i += 2) {
        if constexpr (kBias == 3) {
            // pairs i / 2 .. + kLdX - 1: 8 · kLdX / 2 rows further down the slot per load (the row phase kept)
            if (i % (2 * kLdX) == 0) {
                const uint32_t a = cute::cast_smem_ptr_to_uint(ld_row + (i / (2 * kLdX)) * 4 * kLdX * Stage::kPitch);
                if constexpr (kLdX == 4)
                    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                                 : "=r"(bias_pairs[0]), "=r"(bias_pairs[1]), "=r"(bias_pairs[2]), "=r"(bias_pairs[3])
                                 : "r"(a));
                else
                    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                                 : "=r"(bias_pairs[0]), "=r"(bias_pairs[1])
                                 : "r"(a));
            }
        }
        float d[2] = {1.f, 1.f};
        CUTLASS_PRAGMA_UNROLL
        for (int e = 0; e < 2; ++e) {
            const int kk = int(cute::get<0>(cS(i + e)));
            const int qq = int(cute::get<1>(cS(i + e)));
            float l = modified_logit_t<kCap, 0, decltype(unused16), /*kApproxTanh=*/true>(
                r, acc_S(i + e), 0, 0, unused16, kCap ? &d[e] : nullptr);
            if constexpr (kBias == 2) l = fmaf(-r.slope, fabsf(dist0 + float((qq - q00) - (kk - k00))), l);
            if constexpr (kBias == 1 && !kGlobal16) {  // fp32: a load per element
                const int key = n0 + kk, row = r0 + qq;
                if (row < r.seqlen_q && key < r.seqlen_k)
                    l += float(reinterpret_cast<BiasT const*>(r.bias + int64_t(row) * r.bias_row_bytes)[key]);
            }
            if constexpr (kGlobal16) l += float(BiasT::bitcast(uint16_t(global_elems[i + e])));
            if constexpr (kBias == 3) {
                const uint32_t w = bias_pairs[(i / 2) % kLdX];
                l += float(BiasT::bitcast(uint16_t(e == 0 ? w & 0xffffu : w >> 16)));
            }
            acc_S(i + e) = l;
        }
        if constexpr (kCap) {
            const __half2 h = __floats2half2_rn(d[0], d[1]);
            dcap[i / 2] = reinterpret_cast<uint32_t const&>(h);
        }
    }
}

}  // namespace detail

template <class Element, bool kCap, class TensorS, class TensorC, class Dcap>
CUTLASS_DEVICE void apply_score_mods_t_cap(TensorS& acc_S, TensorC const& cS, RowMods const& r, int r0, int n0,
                                           Dcap& dcap) {
    if (r.bias_type == 2) {
        detail::score_mods_tile_t<kCap, 2, float>(acc_S, cS, r, r0, n0, dcap);
    } else if (r.bias_type == 1) {
        if (r.bias_fp32)
            detail::score_mods_tile_t<kCap, 1, float>(acc_S, cS, r, r0, n0, dcap);
        else
            detail::score_mods_tile_t<kCap, 1, Element>(acc_S, cS, r, r0, n0, dcap);
    } else {
        detail::score_mods_tile_t<kCap, 0, float>(acc_S, cS, r, r0, n0, dcap);
    }
}

// The backward's half of a tile's modifiers, on Sᵀ (raw q·k, in place -> logits) before recompute_pt, which then
// runs in logit units (scale_log2 = log2 e); called only where per_score_mods (else Sᵀ stays q·k, with the plain
// scale). dcap (kSFrag / 2 words) receives the soft-cap's derivative 1 − tanh² of each element as packed fp16 pairs
// (in [0, 1]; 11 bits, below the 16-bit dS's own rounding), left untouched without a soft-cap. Returns whether a soft-cap is set (finish_ds_t multiplies by dcap then). The variants are
// written out as in the forward (dispatched through a lambda, the tile may be outlined with S on the stack).
template <class Element, class TensorS, class TensorC, class Dcap>
CUTLASS_DEVICE bool apply_score_mods_t(TensorS& acc_S, TensorC const& cS, RowMods const& r, int r0, int n0,
                                       Dcap& dcap) {
    if (r.softcap > 0.f) {
        apply_score_mods_t_cap<Element, true>(acc_S, cS, r, r0, n0, dcap);
        return true;
    }
    apply_score_mods_t_cap<Element, false>(acc_S, cS, r, r0, n0, dcap);
    return false;
}

// apply_score_mods_t for an elementwise bias staged in shared memory by the backward's bias warp
// (hopper_bias_stage.hpp, Stage its BiasStage): tile holds the bias of the query tile's 64 rows and the key block.
template <class Element, class Stage, class TensorS, class TensorC, class Dcap>
CUTLASS_DEVICE bool apply_score_mods_t_staged(TensorS& acc_S, TensorC const& cS, RowMods const& r, Dcap& dcap,
                                              char const* tile) {
    if (r.softcap > 0.f) {
        detail::score_mods_tile_t<true, 3, Element, Stage>(acc_S, cS, r, 0, 0, dcap, tile);
        return true;
    }
    detail::score_mods_tile_t<false, 3, Element, Stage>(acc_S, cS, r, 0, 0, dcap, tile);
    return false;
}

// dSᵀ · (1 − tanh²): the soft-cap's derivative, dcap as apply_score_mods_t left it (packed fp16 pairs).
template <class TensorDS, class Dcap>
CUTLASS_DEVICE void apply_dcap_t(TensorDS& acc_dS, Dcap const& dcap) {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < decltype(cute::size(acc_dS))::value; i += 2) {
        const float2 d = __half22float2(reinterpret_cast<__half2 const&>(dcap[i / 2]));
        acc_dS(i) *= d.x;
        acc_dS(i + 1) *= d.y;
    }
}

// Whether store_dbias_pairs_t serves a dbias block (its first element and row pitch in bytes): 16-bit, rows 4-byte
// aligned.
CUTLASS_HOST_DEVICE bool dbias_pairs(char const* dbias, int64_t row_bytes, bool fp32) {
    return !fp32 && ((reinterpret_cast<uintptr_t>(dbias) | uintptr_t(row_bytes)) & 3u) == 0;
}

// dbias = dSᵀ (logit units) in a 16-bit type, from its packed C fragment of Sᵀ (keys x queries; packed[k] holds
// elements 2k, 2k + 1, pack_fragment's order) transposed 8 x 8 block by block across the warp (movmatrix .trans): a
// thread then holds two consecutive keys of one query, one 4-byte store (the rows of the element block 4-byte
// aligned: dbias_pairs) where the fragment's own pairs (two queries of one key) took two 2-byte stores into different
// rows. In the fragment, lane t holds key kb + t/4 and queries qb + 2(t%4), + 1 of each block; after the transpose,
// query qb + t/4 and keys kb + 2(t%4), + 1 (the low half the lower key). full: every key and row of the tile inside
// the sequence (no test per pair).
template <class TensorC>
CUTLASS_DEVICE void store_dbias_pairs_t(uint32_t const* packed, TensorC const& cS, char* dbias, int64_t row_bytes,
                                        int sq, int sk, int r0, int n0, bool full) {
    constexpr int N = decltype(cute::size(cS))::value;
    static_assert(N % 2 == 0, "pairs of queries");
    const int lane = int(threadIdx.x) % 32;
    const int shift = (lane >> 2) - 2 * (lane & 3);  // query + shift, key - shift: the pair this lane receives
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; i += 2) {
        uint32_t pair;
        asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(pair) : "r"(packed[i / 2]));
        const int key = n0 + int(cute::get<0>(cS(i))) - shift;
        const int row = r0 + int(cute::get<1>(cS(i))) + shift;
        char* dst = dbias + int64_t(row) * row_bytes + int64_t(key) * 2;
        if (full || (row < sq && key + 1 < sk))
            *reinterpret_cast<uint32_t*>(dst) = pair;
        else if (row < sq && key < sk)
            *reinterpret_cast<uint16_t*>(dst) = uint16_t(pair & 0xffffu);
    }
}

// The other half, on dSᵀ (logit units, from softmax_grad_t): dbias (when given: the element block of (sequence b,
// query head h), DbiasT its element type) receives dS inside the sequence, then dS becomes dS · (1 − tanh²) with a
// soft-cap. The epilogue's scale (dK, and dQ's convert) completes the chain rule: dL/d(q·k) = scale · (1 − tanh²).
// Without a soft-cap the dS that the products take is dbias: a 16-bit dbias with 4-byte rows (dbias_pairs) is left to
// the caller, to store from that packed fragment by store_dbias_pairs_t (true returned). With a soft-cap (a second
// packed copy made ptxas spill more in the generic kernel), fp32, or odd rows: a store per element here.
template <class DbiasT, class TensorDS, class TensorC, class Dcap>
CUTLASS_DEVICE bool finish_ds_t(TensorDS& acc_dS, TensorC const& cS, char* dbias, int64_t dbias_row_bytes, int sq,
                                int sk, int r0, int n0, bool cap, Dcap const& dcap) {
    constexpr int N = decltype(cute::size(cS))::value;
    bool deferred = false;
    if (dbias != nullptr) {
        if (!cap && dbias_pairs(dbias, dbias_row_bytes, sizeof(DbiasT) == 4)) {
            deferred = true;
        } else {
            CUTLASS_PRAGMA_UNROLL
            for (int i = 0; i < N; ++i) {
                const int key = n0 + int(cute::get<0>(cS(i)));
                const int row = r0 + int(cute::get<1>(cS(i)));
                if (row < sq && key < sk)
                    reinterpret_cast<DbiasT*>(dbias + int64_t(row) * dbias_row_bytes)[key] = DbiasT(acc_dS(i));
            }
        }
    }
    if (cap) apply_dcap_t(acc_dS, dcap);
    return deferred;
}

}  // namespace mhakit::hopper
