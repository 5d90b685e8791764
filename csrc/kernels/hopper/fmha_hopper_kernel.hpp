// mhakit hopper family — the device kernel: one producer warp (TMA loads through the CUTLASS 88 collective) and
// NumMmaWG consumer warpgroups of 64 query rows each, with
//   * intra-warpgroup overlap: the softmax of tile n runs while the P·V wgmma of tile n-1 is in flight;
//   * inter-warpgroup ping-pong: named barriers make the consumer warpgroups take turns issuing their wgmmas, so
//     one warpgroup's softmax overlaps the other's tensor-core work;
//   * an epilogue that stages O through the warpgroup's own (by then idle) Q buffer in shared memory (persistent
//     instances where shared memory allows: a buffer of its own) and writes it with 16-byte stores predicated on the
//     real seqlen_q and head dim, plus the fp32 natural-log LSE;
//   * persistent instances (kPersistent, catalogue `persistent`): a grid of resident CTAs taking work tiles from a
//     counter in the caller's workspace (DynamicPersistentScheduler; persistent() below).
//
// Types, tiled MMAs, TMA descriptors, smem layouts and the TMA load helpers (CollectiveLoadTma) come from
// examples/88_hopper_fmha/collective/fmha_collective_tma_warpspecialized.hpp (included as a library from the
// nvidia-cutlass wheel); the producer loop (which starts at the window's first key tile) and the consumer mainloop
// are our own, composed of this family's pieces: ForwardMask (fmha_hopper_mask.hpp, over the shared tile geometry),
// OnlineSoftmax (hopper_softmax.hpp), FwdEpilogue (hopper_epilogue.hpp), and the shared SingleTileScheduler
// (kernels/common/tile_scheduler.h). The collective's Fusion parameter is never called by this kernel.
//
// kMods: the modifier instances ("_mods"): soft-cap and bias / ALiBi on each S tile before the mask (S in units of U,
// logit = U·S, the softmax with scale U: FwdModUnits), the sink in the final normalisation (hopper_score_mod.hpp),
// dropout on P after the softmax's update and 1 / (1 − p) on O at the end (hopper_dropout.hpp). The plain kernel is the type
// HopperFwdKernelImpl, the modifier kernel HopperFwdKernelModsImpl, both the body below. A sink alone (no per-score
// work) runs on the plain 16-bit instances, in the final normalisation only (Params::sink; catalogue
// score_mods.plain), so that a sink call keeps the plain tiles, persistent grids included.
// fp8 (Element = e4m3, ElementOut = bf16 / fp16; batch mode): Q·Kᵀ as is; V comes transposed (keys contiguous) from
// the caller's workspace with its key slots permuted, and P is packed into the P·V operand registers to match
// (hopper_fp8.hpp); the softmax scale folds in the q and k descale factors and O is multiplied by v's; O is staged
// through the (by then idle) K/V ring, the Q buffer of a warpgroup being half the size of its 16-bit O, or, in a
// persistent instance, in padded rows of its own (kOwnORows).
#pragma once

// CuTe picks each product's wgmma as the widest N that divides the tile, from {8, 16, 32, 64, 96, 128, 192, 256}
// unless this macro admits every multiple of 8 (its "extended" shapes): without it a key tile of 160 or 224 (the fp8
// candidates) would run Q·Kᵀ as 5 or 7 wgmmas of N = 32 per k-step, each re-reading Q. The tiles of the default
// set select the same instruction either way. It must precede the first CuTe header of the translation unit; the
// static_assert on the instruction shapes below catches a unit that included one earlier.
#ifndef CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#endif

#include <cstdint>
#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/arch/reg_reconfig.h"
#include "cutlass/cutlass.h"
#include "cutlass/numeric_types.h"
#include "cutlass/pipeline/pipeline.hpp"

#include "88_hopper_fmha/collective/fmha_collective_tma_warpspecialized.hpp"

#include "kernels/common/mask.h"
#include "kernels/common/tile_scheduler.h"

#include "fmha_hopper_mask.hpp"
#include "hopper_bias_stage.hpp"
#include "hopper_dropout.hpp"
#include "hopper_epilogue.hpp"
#include "hopper_score_mod.hpp"
#include "hopper_fp8.hpp"
#include "hopper_softmax.hpp"
#include "hopper_tile_io.hpp"
#include "hopper_types.hpp"

namespace mhakit::hopper {

using namespace cute;

// Whether the static rows x keys layout n of identity coordinates is the first columns of w: the same (row, key) for
// every element (i, j) of n, and the same rows.
template <class LW, class LN>
CUTLASS_HOST_DEVICE constexpr bool narrow_prefix(LW const& w, LN const& n) {
    for (int i = 0; i < int(size<0>(n)); ++i) {
        for (int j = 0; j < int(size<1>(n)); ++j) {
            if (int(get<0>(w(i, j))) != int(get<0>(n(i, j))) || int(get<1>(w(i, j))) != int(get<1>(n(i, j))))
                return false;
        }
    }
    return int(size<0>(w)) == int(size<0>(n));
}

// The Q·Kᵀ product over the first kN keys of a key tile (the narrow last tile, HopperFwdKernelBody::kNarrowLast), or
// Fallback where the instance has none.
template <bool kOn, class Element, int kN, int kHdim, class Fallback>
struct NarrowMmaQK {
    using type = Fallback;
};
template <class Element, int kN, int kHdim, class Fallback>
struct NarrowMmaQK<true, Element, kN, kHdim, Fallback> {
    using type = decltype(make_tiled_mma(GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kN>, Int<kHdim>>,
                                                              GMMA::Major::K, GMMA::Major::K>()));
};

// O's TMA store descriptor (HopperFwdKernelBody::kTmaStoreO): O as (s_q, hdim_v, (b, (g, hk))) with Q's stride
// type, in boxes of one warpgroup's Q-stage layout SmemLayoutStage; an empty stand-in where the instance has none.
template <bool kOn, class ElementOut, class SmemLayoutStage>
struct TmaStoreOFor {
    struct type {};
};
template <class ElementOut, class SmemLayoutStage>
struct TmaStoreOFor<true, ElementOut, SmemLayoutStage> {
    static auto make(ElementOut* o, int sq, int d, int b, int g, int hk, HopperStrideQ const& stride) {
        return make_tma_copy(SM90_TMA_STORE{},
                             make_tensor(make_gmem_ptr(o), make_shape(sq, d, make_shape(b, make_shape(g, hk))), stride),
                             SmemLayoutStage{});
    }
    using type = decltype(make(nullptr, 0, 0, 0, 0, 0, HopperStrideQ{}));
};

// The forward "_mods" kernel's modifier variant (its kModVar), which the launcher picks per call (fwd_mod_variant,
// FwdKernel::run): the generic kernel dispatches per key tile at run time (score_mods: soft-cap, bias kind and element
// type, staged or not; dropout per tile), a fixed variant knows the call's modifiers at compile time and calls its tile
// function directly (fixed_score_mods). SASS of a full key tile's path, one consumer thread, d128 bf16 batch masked
// (the generic kernel is main's, instruction for instruction): the generic kernel's path without modifier math is 482
// instructions; soft-cap 632 (128 per-score FMUL + MUFU.TANH, 22 of dispatch: uniform branches, constant loads), ALiBi
// 629 (126 FADD + FFMA, 6 of setup, 15 of dispatch); the dropout test also cuts the exp pass from O's rescale and P's
// packing (one basic block in the plain kernel). The fixed variants: soft-cap 598 (the modifier math in the block of
// the Q·Kᵀ wait, the softmax with the rescale and packing in one), ALiBi 605, and 568 with the row part left to the
// softmax on tiles off the diagonal (kAlibiFold: 64 FFMA, no FADD; a diagonal tile 629); the plain kernel (persistent)
// 499. A fixed staged-bias kernel measured 684, as the generic path (its tile function's address math grew), so the
// staged bias keeps the generic kernel (FwdKernel::builds). ptxas (d64 / d256 batch, d128 batch / group): no fixed
// variant spills (the d64 generic kernel 56 / 100 / 100 bytes, as on main). nvcc -cubin of the d128 instance: +4 to +7
// s (2 cores, base / branch interleaved: 39.9, 44.5 / 49.7, 46.5 s). Values: kGeneric, or kFixed with the flags of the
// call's modifiers (as the backward's BwdModVar).
struct FwdModVar {
    static constexpr int kGeneric = 0;
    static constexpr int kFixed = 1;  // no dropout; the flags below fixed at compile time
    static constexpr int kCap = 2;    // soft-cap
    static constexpr int kAlibi = 4;  // ALiBi
    static constexpr int kBias = 8;   // a 16-bit elementwise bias of a stageable layout (bias_stageable)
    // score_mods_tile's bias kind of a fixed variant (a staged bias: 1, the kind of its global-memory fallback)
    static constexpr int bias_kind(int v) { return (v & kAlibi) ? 2 : (v & kBias) ? 1 : 0; }
};

// The fixed variant of a call (every flag as the call sets it), or kGeneric where the call needs what only the
// generic kernel does: dropout, an elementwise bias that is not stageable (fp32, unaligned rows). A sink changes no
// score: a sink alone is kFixed with no flag (the catalogue sends those calls to the plain instances). The launcher
// runs the generic kernel also for a fixed variant its instance does not build (FwdKernel::builds).
CUTLASS_HOST_DEVICE int fwd_mod_variant(ScoreMods const& m) {
    if (m.dropout.on || (m.bias_type == 1 && !bias_stageable(m))) return FwdModVar::kGeneric;
    return FwdModVar::kFixed | (m.softcap > 0.f ? FwdModVar::kCap : 0) | (m.bias_type == 2 ? FwdModVar::kAlibi : 0) |
           (m.bias_type == 1 ? FwdModVar::kBias : 0);
}

template <class Element_, class ElementOut_, int kHdim, int kHdimV, bool kGroup, bool kMasked, int kBlockM,
          int kBlockN, bool kMods, bool kPersistent = false, int kMaxStages = 5, int kModVar = FwdModVar::kGeneric>
struct HopperFwdKernelBody {
    using Element = Element_;       // q, k, v
    using ElementOut = ElementOut_;  // o
    static constexpr bool kFp8 = sizeof(Element) == 1;
    static_assert(!kFp8 || (kBlockN % 32 == 0 && !kGroup && kHdimV == kHdim),
                  "fp8: kBlockN a multiple of 32 (the wgmma's k step), batch mode, equal head-dim buckets");
    static_assert(!(kFp8 && kMods), "fp8 instances have no score modifiers");
    // A fixed modifier variant (FwdModVar; "_mods" instances only): its flags known at compile time, no dropout.
    static constexpr bool kFixedVar = kMods && kModVar != FwdModVar::kGeneric;
    static constexpr bool kGenericMods = kMods && !kFixedVar;
    static constexpr bool kVarCap = kFixedVar && (kModVar & FwdModVar::kCap) != 0;
    static constexpr int kVarBias = kFixedVar ? FwdModVar::bias_kind(kModVar) : 0;
    // The fixed ALiBi kernel leaves each off-diagonal tile's row part of ALiBi to the softmax (apply_alibi_folding,
    // OnlineSoftmax::update's offsets): one FFMA per score instead of an FADD and an FFMA.
    static constexpr bool kAlibiFold = kFixedVar && kVarBias == 2 && !kVarCap;
    static constexpr int kRowsPerThread = 2;  // query rows of S a consumer thread holds (wgmma C: 64 rows, 128 threads)
    static_assert(!kMods || kModVar == FwdModVar::kGeneric || (kModVar & FwdModVar::kFixed) != 0, "a FwdModVar");
    static_assert(kMods || kModVar == FwdModVar::kGeneric, "plain instances have one kernel");
    // kPersistent: a grid of resident CTAs walking work tiles (DynamicPersistentScheduler), batch-mode plain
    // instances only (group mode's empty blocks and the bias warp are one-tile code). fp8 ones stage O in rows of
    // their own (kOwnORows), not in the K/V ring, which the producer fills with the next tile's keys meanwhile.
    static_assert(!kPersistent || (!kGroup && !kMods), "persistent: batch-mode plain instances");
    // kOneTileOrder: a one-tile instance that may run a causal call on the 1-D grid of the persistent kernels' order
    // (fmha_fwd_hopper.cuh decides per call): batch-mode 16-bit, plain (d256, measured with it) or "_mods" of two
    // consumer warpgroups (d128 measured: causal modifier calls 14-19 % faster). The d64 "_mods" tile (three
    // warpgroups at 160 registers) spilled more with the path (92 / 92 -> 120 / 164 bytes) and was not measured with
    // it; it and group mode and fp8 compile without that path.
    static constexpr bool kOneTileOrder = !kPersistent && !kGroup && !kFp8 && (!kMods || kBlockM == 128);
    static_assert(kBlockM == 128 || kBlockM == 192, "kBlockM: 128 or 192 (one consumer warpgroup per 64 rows)");
    static_assert(kBlockN % 16 == 0 && kBlockN >= 16 && kBlockN <= 256, "kBlockN: a multiple of 16, at most 256");
    static_assert(kHdim % 32 == 0 && kHdim >= 64 && kHdim <= 256, "head-dim buckets: multiples of 32 in [64, 256]");
    static_assert(kHdimV % 32 == 0 && kHdimV >= 64 && kHdimV <= kHdim,
                  "V head-dim bucket: a multiple of 32 in [64, kHdim] (a ring slot is sized by the K tile)");

    static constexpr int NumMmaWG = kBlockM / 64;
    static constexpr int kSmemLimit = 232448;  // sm_90 opt-in maximum of dynamic shared memory per block
    static constexpr int kQBytes = kBlockM * kHdim * int(sizeof(Element));
    static constexpr int kStageBytes = kBlockN * kHdim * int(sizeof(Element));  // a ring slot: one K or V tile
    static constexpr int kVBytes = kBlockN * kHdimV * int(sizeof(Element));
    // Modifier instances of two consumer warpgroups with whole 64-key boxes (d96, d128, d256): the elementwise-bias
    // ring (hopper_bias_stage.hpp, loaded by TMA) has a stage reserved before the K/V ring takes what is left (d256:
    // 4 K/V slots instead of 5, which measured no slower on the instance's other modifier calls, where its bias read
    // from global memory cost +250 %), and a second stage where kBiasL1Leave bytes remain (d96: 2; d128: 1, a
    // second would cost a K/V ring slot; d256: 1).
    // The d64 tile (three warpgroups of 160 registers) spilled with the staged path (ptxas, the masked group
    // instance: 80 / 92 -> 180 / 172 bytes, with the earlier cp.async loader), and (192, 128)'s 96-key tiles are not
    // whole boxes: both keep the global loads.
    // (the generic kernel's: the fixed variants have no elementwise bias, FwdKernel::builds)
    static constexpr bool kStageBias = kGenericMods && NumMmaWG == 2 && kBlockN % kBiasBoxKeys == 0;
    using BiasStageOf = BiasStage<kBlockN, NumMmaWG, 0, 128>;  // its sizes (no staging: never used)
    static constexpr int kBiasStageBytes = kStageBias ? BiasStageOf::kStageBytes : 0;
    static constexpr int kFitStages = (kSmemLimit - 1024 - kQBytes - kBiasStageBytes) / kStageBytes;
    // K and V tiles alternate in one ring of as many slots as fit, at most kMaxStages (5; a persistent tile's
    // catalogue `stages` may ask for fewer, to leave O a staging buffer of its own)
    static_assert(kMaxStages >= 2 && kMaxStages <= 5);
    static constexpr int kStages = kFitStages < kMaxStages ? kFitStages : kMaxStages;
    static constexpr int kBiasLeft = kSmemLimit - 1024 - kQBytes - kStages * kStageBytes;  // >= kBiasStageBytes
    static constexpr int kBiasStages = !kStageBias ? 0 : kBiasLeft - 2 * kBiasStageBytes >= kBiasL1Leave ? 2 : 1;
    using Bias = BiasStage<kBlockN, NumMmaWG, kBiasStages, 128>;  // a slot per consumer warpgroup
    static_assert(kStages >= 2, "tile too large for shared memory");
    static_assert(!kStageBias || kBiasStages >= 1, "the ring fits beside the K/V ring");

    // O holds at least twice as many registers per thread as a key tile's scores (hdim_v / 2 against block_n / 2):
    // the tiles where skipping O's rescale pays (kLazyRescale, kFixedRef).
    static constexpr bool kWideO = kHdimV >= 2 * kBlockN;
    // Lazy rescaling of O (OnlineSoftmax, hopper_softmax.hpp) where O is wide (kWideO): there the skipped rescale
    // outweighs the per-tile vote. Measured on the H200 (bench_fwd.py, bf16, b·s = 16k, hidden 2048, s = 1k / 4k /
    // 16k, both mask kinds, two rounds): d256 (128 x 64 tiles, 4x) +2 to +5 % on every row, fp8 d256 (128 x 128,
    // 2x) +2 %, d192 (128 x 96, 2x) +1 to +3 %; d128 (128 x 128, 1x) 0 to -5 %, d64 (0.5x) -1 to -3.5 %, fp8 d128
    // (128 x 192) -1 %: those keep the eager rescale. docs/PERFORMANCE.md, "Lazy O rescale for the wide head dims".
    // fp8's three-warpgroup tile (d128 192 x 96, 1.33x), where the softmax sets the pace, takes it too: +4 to +7 %
    // on every row, s = 1k .. 16k (H200, 3 rounds, 2026-11-25; "The fp8 forward on the persistent grid").
    static constexpr bool kLazyRescale = kWideO || (kFp8 && NumMmaWG == 3);
    // A soft-cap alone bounds every score, so the "_mods" softmax may run against a fixed reference maximum
    // (consumer(), fixed_ref): no row maximum and no O rescale. Where O is wide (kWideO; d256's 128 x 64): soft-cap
    // 30 went from +13 / +11 % to -2 / 0 % over the plain call (unmasked / causal), its other modifier calls 1-6 %
    // faster. d128's 128 x 128 read the same on a soft-cap call (its two MUFU operations a score set the pace
    // there) and 1-2.4 % slower on the others, so it keeps the running maximum. (H100, bf16 b=4 s=4096, 2 rounds,
    // 2026-11-25.) bf16 only: P's fp16 operand would lose the small probabilities of a row whose largest score lies
    // well below the cap (fp16's smallest normal is 2^-14).
    static constexpr bool kFixedRef = kMods && std::is_same_v<Element, cutlass::bfloat16_t> && kWideO;

    // Masked kernels: the heaviest query blocks (largest m) first, so the tail of the grid is short.
    using Scheduler = SingleTileScheduler</*kHeaviestFirst=*/kMasked, /*kBatchInY=*/true>;
    using PersistentScheduler = DynamicPersistentScheduler;
    using TileShape = Shape<Int<kBlockM>, Int<kBlockN>, Int<kHdim>>;
    struct UnusedFusion {};  // the collective's fusion hook; this kernel masks with Mask instead
    // V's strides: as K's, or (fp8) those of the transposed V, which makes the P·V B operand K-major.
    using StrideV = std::conditional_t<kFp8, HopperStrideVt, HopperStrideKV>;
    template <int kD>
    using MainloopFor = cutlass::fmha::collective::FmhaMainloopTmaWarpSpecialized<
        Element, float, float, Shape<Int<kBlockM>, Int<kBlockN>, Int<kD>>, HopperStrideQ, HopperStrideKV,
        StrideV, UnusedFusion,
        cutlass::fmha::kernel::Option<cutlass::fmha::kernel::Tag::kNumMmaWarpGroups, Int<NumMmaWG>>,
        cutlass::fmha::kernel::Option<cutlass::fmha::kernel::Tag::kStagesKV, Int<kStages>>>;
    // Q, K, the Q·Kᵀ product and the pipelines from the collective of head dim kHdim; V and the P·V product from the
    // one of head dim kHdimV (the same type when the head dims are equal).
    using Mainloop = MainloopFor<kHdim>;
    using MainloopV = MainloopFor<kHdimV>;
    static constexpr bool kSplitDims = kHdimV != kHdim;

    using TileShapeQK = typename Mainloop::TileShapeQK;   // (64, kBlockN, kHdim)
    using TileShapePV = typename MainloopV::TileShapePV;  // (64, kHdimV, kBlockN)
    using TiledMmaQK = typename Mainloop::TiledMmaQK;
    using TiledMmaPV = typename MainloopV::TiledMmaPV;
    // One wgmma per k-step spans the whole key tile (Q·Kᵀ) and the whole V head dim (P·V).
    static_assert(size<1>(typename TiledMmaQK::AtomShape_MNK{}) == kBlockN &&
                      size<1>(typename TiledMmaPV::AtomShape_MNK{}) == kHdimV,
                  "a wgmma narrower than the tile: CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED came after a CuTe header");
    // The last key tile a consumer warpgroup visits, cut to what its rows see (kNarrowLast; consumer()). On a causal
    // diagonal the block's first rows see little of it: the first warpgroup of a 128-row tile sees the first half of
    // a 128-key tile, and of a 64-key tile (d256) nothing. Where no row of the warpgroup sees a key in its second
    // half, that tile's Q·Kᵀ, softmax and P·V run on its first kBlockN / 2 keys (narrow: a wgmma of N = kNarrowN
    // into an accumulator of its own, P packed into the first of P·V's k-steps); where they see none of it, the
    // warpgroup runs no product on it (skip, kSkipLast). Masked plain 16-bit instances (the modifiers and fp8 read S
    // and P in their full width, the bias warp stages every tile), whole 16-key k-steps per half.
    // Unmasked, the last tile holds s_k mod kBlockN keys: the plain tile wider than 128 keys whose width is not a
    // power of two (d128's 128 x 176) runs it on its first kBlockN - 32 keys (144) where it holds no more, which
    // holds every power of two from 1024 on (s_k mod 176 = 144, 112, 48, 96, 16, 32, 64 for 1k .. 64k); at s = 1k
    // that is 32 of the 1056 keys a row visits.
    static constexpr bool kNarrowMasked = kMasked && !kMods && !kFp8 && kBlockN % 32 == 0;
    static constexpr bool kNarrowUnmasked =
        !kMasked && !kMods && !kFp8 && kBlockN > 128 && (kBlockN & (kBlockN - 1)) != 0;
    static constexpr bool kNarrowLast = kNarrowMasked || kNarrowUnmasked;
    static constexpr bool kSkipLast = kNarrowMasked;  // unmasked, the last tile holds a key
    static constexpr int kNarrowN = kNarrowMasked ? kBlockN / 2 : kNarrowUnmasked ? kBlockN - 32 : kBlockN;
    static_assert(kNarrowN % 16 == 0, "the narrow tile: whole 16-key k-steps of P·V");
    // A consumer warpgroup with no row in the sequence takes its turns without products (consumer(), idle): the
    // 16-bit plain instances of three consumer warpgroups, where a sequence's last block leaves one or two of them
    // idle whenever s mod 192 is in [1, 128] (s = 1k, 4k, 16k: two). Measured on the H200 (bf16 d64, 4 rounds): 1k
    // unmasked +6.1 %, 4k causal +3.0 %, 4k unmasked +1.4 %. In the two-warpgroup d64 128 x 128 causal tile the
    // branch cost 1.5 % at s = 1k, where no warpgroup is idle; the modifier instances' bias warp fills a slot per
    // warpgroup and tile; with it ptxas spilled 1.3 KB in fp8's masked 128 x 192 tile and serialised its wgmmas.
    // fp8's three-warpgroup 192 x 96 tile compiled without spills with it (and kPartialFirst) but measured slower:
    // 1k causal +4 %, 4k / 16k -1.4 to -4 % unmasked and causal (H200, 3 rounds, 2026-11-25).
    static constexpr bool kTrimIdle = !kMods && !kFp8 && NumMmaWG == 3;
    // Masked, those tiles put the block of fewer rows first (ForwardMask kPartialFirst): at s = 1k / 4k / 16k (s mod
    // 192 = 64) the sequence's last block held one warpgroup of rows, which saw the most keys and ran its products
    // alone, with no other warpgroup's softmax to overlap; as the first block it sees the fewest.
    static constexpr bool kPartialFirst = kTrimIdle && kMasked;
    using Mask = ForwardMask<kMasked, kBlockM, kBlockN, kPartialFirst>;
    using TiledMmaQKNarrow = typename NarrowMmaQK<kNarrowLast, Element, kNarrowN, kHdim, TiledMmaQK>::type;
    using SmemLayoutQ = typename Mainloop::SmemLayoutQ;
    using SmemLayoutK = typename Mainloop::SmemLayoutK;
    // V tiles live in the ring slots of K tiles: one V stage's layout, with the slot size as the stage stride (the
    // slots are 1024-byte multiples, so the swizzle pattern of each stage is unchanged).
    // (The swizzle and the smem-pointer flag stay as the collective made them, so TMA and wgmma see a GMMA layout.)
    using SmemLayoutVRing = typename MainloopV::SmemLayoutV;  // (kHdimV, kBlockN, kStages), stage stride kHdimV·kBlockN
    using SmemLayoutV = std::conditional_t<
        kSplitDims,
        decltype(composition(SmemLayoutVRing{}.layout_a(), SmemLayoutVRing{}.offset(),
                             append(take<0, 2>(SmemLayoutVRing{}.layout_b()),
                                    Layout<Int<kStages>, Int<kBlockN * kHdim>>{}))),
        typename Mainloop::SmemLayoutV>;
    static_assert(!kSplitDims || (kStageBytes % 1024 == 0), "ring slots must keep the swizzle period");
    using LoadV = cutlass::fmha::collective::CollectiveLoadTma<cutlass::fmha::collective::LoadKind::kV,
                                                               typename Mainloop::MainloopPipeline, Element,
                                                               SmemLayoutV, typename MainloopV::TMA_V>;
    using PipelineKV = typename Mainloop::MainloopPipeline;
    using PipelineQ = typename Mainloop::MainloopPipelineQ;
    using StateKV = typename Mainloop::PipelineState;
    using StateQ = typename Mainloop::PipelineStateQ;

    static constexpr int MaxThreadsPerBlock = (NumMmaWG + 1) * 128;
    static constexpr int MinBlocksPerMultiprocessor = 1;
    static constexpr uint32_t kLoadRegs = 24;
    static constexpr uint32_t kMmaRegsFit =
        (((64 * 1024 / MaxThreadsPerBlock / 8) * 8 * MaxThreadsPerBlock / 128 - kLoadRegs) / NumMmaWG / 8) * 8;
    static constexpr uint32_t kMmaRegs = kMmaRegsFit < 240 ? kMmaRegsFit : 240;

    // Named barriers (ids above CUTLASS' reserved ones): [0, NumMmaWG) ping-pong, [NumMmaWG, 2 NumMmaWG) epilogue,
    // 2 NumMmaWG: every consumer done with the K/V ring (fp8's O staging); at most 7 with three consumer warpgroups
    // (CUTLASS reserves 8 of the 16).
    static constexpr uint32_t kBarSched = 0;
    static constexpr uint32_t kBarEpi = NumMmaWG;
    static constexpr uint32_t kBarRingFree = 2 * NumMmaWG;

    struct MainloopStorage {
        cute::array_aligned<Element, cute::cosize_v<SmemLayoutQ>> smem_q;
        union {
            cute::array_aligned<Element, cute::cosize_v<SmemLayoutK>> smem_k;
            cute::array_aligned<Element, cute::cosize_v<SmemLayoutV>> smem_v;
        };
    };
    struct SharedStoragePlain {
        MainloopStorage mainloop;
        alignas(16) typename PipelineKV::SharedStorage pipe_kv;
        alignas(16) typename PipelineQ::SharedStorage pipe_q;
    };
    struct SharedStorageMods : SharedStoragePlain {
        typename Bias::Storage bias;  // the elementwise-bias ring
    };
    // Persistent: the producer's fetch of the CTA's next tile, decoded (the tile index, its work and key tiles: the
    // decode's run-time divisions once per tile in the producer warp instead of in every consumer warp), goes to the
    // consumers through shared memory guarded by a one-slot mbarrier pipeline (full: the producer wrote it; empty:
    // every consumer thread read it), so that each warpgroup takes it when it ends its own tile, without waiting for
    // the other warpgroups.
    using PipelineTile = cutlass::PipelineAsync<1>;
    struct NextTile {
        int t;  // >= total: none
        WorkTile work;
        KeyTiles tiles;  // its key tiles (ForwardMask::key_tiles)
    };
    struct SharedStoragePersistent : SharedStoragePlain {
        alignas(16) typename PipelineTile::SharedStorage pipe_tile;
        alignas(16) NextTile next_tile;
    };
    // fp8 one-tile instances: each consumer warpgroup's O (64 x kHdimV, 16-bit) staged as padded rows in the K/V ring
    // once every consumer is done with it.
    using StagedO = StagedRows<ElementOut, 64, kHdimV>;
    // Persistent, where shared memory allows: O staged in a buffer of its own, so that a warpgroup gives its Q stage
    // back after its last Q·Kᵀ and the next tile's Q loads during its last softmax, P·V and epilogue. Equal head dims
    // where a Q stage's swizzled layout per warpgroup fits (d64, d128): that layout. Otherwise (192: 35 KB left; (192,
    // 128): a Q stage would be 192 columns wide) padded rows of kOCols columns per warpgroup, the largest multiple of
    // 64 up to hdim_v that fits (a row pitch of 64·k + 8 elements puts the 8 rows of a fragment store in different
    // banks), written out in ceil(hdim_v / kOCols) passes of columns ((192, 128): one pass of 128; 192: 128 + 64;
    // d128's 128 x 176, 19 KB left: 64 + 64); none fits: O stays in the Q buffer (d256 with 5 slots: 3 KB left; the
    // catalogue's persistent d256 tiles take 4 slots, which leave 35 KB: rows of 128 columns, two passes). fp8 always
    // takes the rows (its 1-byte Q layout is no 16-bit O's): d128 192 x 96, 5 slots, one pass; d256 128 x 128, 5
    // slots, 35 KB left: two passes of 128.
    struct SharedStoragePersistentQO : SharedStoragePersistent {
        cute::array_aligned<ElementOut, cute::cosize_v<SmemLayoutQ>, 1024> smem_o;
    };
    // (fp8: a Q stage's layout is one of 1-byte elements, so O takes the padded rows.)
    static constexpr bool kOwnOSwizzled =
        kPersistent && !kSplitDims && !kFp8 && int(sizeof(SharedStoragePersistentQO)) <= kSmemLimit;
    static constexpr int kORowsFree = kSmemLimit - int(sizeof(SharedStoragePersistent)) - 128;  // 128: the alignment
    static constexpr int kOColsFit = (kORowsFree / (NumMmaWG * 64 * int(sizeof(ElementOut))) - 8) / 64 * 64;
    static constexpr int kOCols = kOColsFit < kHdimV ? kOColsFit : kHdimV;
    static constexpr bool kOwnORows = kPersistent && !kOwnOSwizzled && kOCols >= 64;
    using StagedOCols = StagedRows<ElementOut, 64, (kOwnORows ? kOCols : 8)>;
    struct SharedStoragePersistentRO : SharedStoragePersistent {
        cute::array_aligned<ElementOut, NumMmaWG * StagedOCols::kElems, 128> smem_o;
    };
    static constexpr bool kOwnO = kOwnOSwizzled || kOwnORows;
    // A swizzled O buffer of its own is written out by a TMA store (FwdEpilogue::store_o_tma) that runs on while the
    // warpgroup starts its next tile: one instruction of one thread in place of a shared-memory load and a global
    // store per 16 bytes in every thread. Measured on the H200 (bf16, 3 interleaved rounds, two A/B calls): d128
    // 128 x 128 causal +1.9 to +2.6 % at s = 1k / 2k / 4k, d64 192 x 128 unmasked +0.9 to +1.9 % at 1k. (A persistent
    // d64 128 x 128 tile lost 0.6 / 0.8 % at 1k causal with it, where the 192 x 128 tile with it gained 0.7 %: the
    // catalogue now gives batch-mode d64 masked calls the latter at every length.)
    static constexpr bool kTmaStoreO = kOwnOSwizzled;
    static_assert(!kTmaStoreO || NumMmaWG > 1, "the O buffer's reuse is ordered by the ping-pong's turns");
    using SmemLayoutOStage = decltype(SmemLayoutQ{}(_, _, _0{}));
    using TmaStoreO = TmaStoreOFor<kTmaStoreO, ElementOut, SmemLayoutOStage>;
    static_assert(!(kPersistent && kHdim == 192) || kOwnO, "the persistent 192 tiles stage O in a buffer of their own");
    static_assert(kMaxStages == 5 || kOwnO, "a shorter ring is for O's own staging buffer");
    using SharedStorage = std::conditional_t<
        (kBiasStages > 0), SharedStorageMods,
        std::conditional_t<kOwnOSwizzled, SharedStoragePersistentQO,
                           std::conditional_t<kOwnORows, SharedStoragePersistentRO,
                                              std::conditional_t<kPersistent, SharedStoragePersistent,
                                                                 SharedStoragePlain>>>>;
    static constexpr int SharedStorageSize = int(sizeof(SharedStorage));
    static_assert(SharedStorageSize <= kSmemLimit);
    static_assert(!kFp8 || NumMmaWG * StagedO::kElems * int(sizeof(ElementOut)) <=
                               int(sizeof(cute::array_aligned<Element, cute::cosize_v<SmemLayoutK>>)),
                  "fp8: the K/V ring must hold the consumers' O tiles");

    struct Params : ModParams<kMods> {  // kMods: the call's score modifiers (`mods`) first; plain: nothing
        // (b, (g, hk), sq, sk, d, x, y) as the TMA descriptors see the tensors. Group mode: (1, (g, hk), total_q,
        // total_k, d, -, -), the packed tensors as one batch; the sequences come from seqstart_q / seqstart_k.
        HopperProblemShape problem;
        typename Mainloop::Params mainloop;
        typename MainloopV::TMA_V tma_load_v;  // V's descriptor (head dim hdim_v)
        int hdim_v;
        ElementOut* o;
        int64_t o_row, o_head, o_batch;
        float* lse;
        int64_t lse_head, lse_batch;
        const int32_t* seqstart_q;  // group mode: [batch + 1] row offsets into the packed tensors
        const int32_t* seqstart_k;
        int mask_type, window_left, window_right;  // group mode: each sequence's mask is made on the device
        // Plain 16-bit instances: the call's attention sink logits [h] (catalogue score_mods.plain: a sink alone needs
        // no per-score work, only the final normalisation), or null. The "_mods" instances read mods.sink instead.
        const float* sink;
        const float* descale_q;  // fp8: device fp32 descale factors of q, k, v
        const float* descale_k;
        const float* descale_v;
        typename TmaStoreO::type tma_store_o;  // kTmaStoreO: O's descriptor (fmha_fwd_hopper.cuh)
        typename PersistentScheduler::Params sched;  // the work tiles and (kPersistent) the counter; one-tile
                                                     // instances: total = 0 for the 3-D grid
    };

    using Sequence = HopperSequence;
    CUTLASS_DEVICE static Sequence sequence(Params const& params, int b) {
        if constexpr (kGroup) {
            return packed_sequence<kMasked>(params.seqstart_q, params.seqstart_k, b, params.mask_type,
                                            params.window_left, params.window_right);
        } else {
            return Sequence{0, 0, get<2>(params.problem), get<3>(params.problem),
                            MaskCoord{get<6>(params.problem), get<5>(params.problem)}};
        }
    }
    using Work = typename Scheduler::Work;

    static dim3 grid(int m_blocks, int nhead_q, int batch) { return Scheduler::grid(m_blocks, nhead_q, batch); }

    CUTLASS_DEVICE void operator()(Params const& params, char* smem) {
#if defined(CUTLASS_ARCH_MMA_SM90A_ENABLED)
        const Work work = kPersistent ? PersistentScheduler::decode(params.sched, PersistentScheduler::first())
                          : kOneTileOrder && params.sched.total > 0  // a causal call's 1-D grid (fmha_fwd_hopper.cuh)
                              ? PersistentScheduler::decode</*kLastAbsorbs=*/true>(params.sched, PersistentScheduler::first())
                              : Scheduler::work();
        const Sequence seq = sequence(params, work.batch);
        if (work.block * kBlockM >= seq.sq) return;  // group mode: past this sequence's last query (the whole CTA)

        auto& storage = *reinterpret_cast<SharedStorage*>(smem);
        const int warp_idx = cutlass::canonical_warp_idx_sync();
        const int wg_idx = cutlass::canonical_warp_group_idx();
        const int warp_in_wg = warp_idx % 4;
        const int lane_predicate = cute::elect_one_sync();

        if (warp_idx == 0 && lane_predicate) {
            Mainloop::prefetch_tma_descriptors(params.mainloop);
            if constexpr (kSplitDims || kFp8) cute::prefetch_tma_descriptor(params.tma_load_v.get_tma_descriptor());
            if constexpr (kTmaStoreO) cute::prefetch_tma_descriptor(params.tma_store_o.get_tma_descriptor());
            if constexpr (kBiasStages > 0) {
                if (params.bias_staged) cute::prefetch_tma_descriptor(&params.bias_map);
            }
        }

        const bool producer_warp = (wg_idx == 0 && warp_in_wg == 0);

        typename PipelineQ::Params pq;
        pq.transaction_bytes = Mainloop::kOuterLoadBytes;
        pq.is_leader = producer_warp && lane_predicate;
        pq.num_consumers = 128;
        typename PipelineKV::Params pkv;
        pkv.transaction_bytes = kVBytes;  // K tiles, larger when kHdimV < kHdim, expect the rest themselves
        pkv.is_leader = producer_warp && lane_predicate;
        pkv.num_consumers = NumMmaWG * 128;
        if (producer_warp) {
            pq.role = PipelineQ::ThreadCategory::Producer;
            pkv.role = PipelineKV::ThreadCategory::Producer;
        } else if (wg_idx > 0) {
            pq.role = PipelineQ::ThreadCategory::Consumer;
            pkv.role = PipelineKV::ThreadCategory::Consumer;
        }
        PipelineQ pipe_q(storage.pipe_q, pq, Shape<_1, _1, _1>{});
        PipelineKV pipe_kv(storage.pipe_kv, pkv, Shape<_1, _1, _1>{});
        [[maybe_unused]] auto pipe_tile = [&] {
            if constexpr (kPersistent) {
                typename PipelineTile::Params pt;
                pt.producer_arv_count = 32;  // the producer warp
                pt.consumer_arv_count = NumMmaWG * 128;
                pt.role = producer_warp ? PipelineTile::ThreadCategory::Producer
                          : wg_idx > 0  ? PipelineTile::ThreadCategory::Consumer
                                        : PipelineTile::ThreadCategory::NonParticipant;
                return PipelineTile(storage.pipe_tile, pt);
            } else {
                return 0;
            }
        }();
        if constexpr (kBiasStages > 0) {
            if (warp_idx == 0 && lane_predicate) Bias::init(storage.bias);
        }
        __syncthreads();

        if constexpr (kPersistent) {
            persistent(params, storage, pipe_q, pipe_kv, pipe_tile, wg_idx, warp_in_wg);
            return;
        }
        const Mask mask(seq.mask, seq.sq, seq.sk);
        const KeyTiles tiles = mask.key_tiles(work.block);

        if (wg_idx == 0) {
            cutlass::arch::warpgroup_reg_dealloc<kLoadRegs>();
            if (warp_in_wg == 0 && !tiles.visit.empty()) {
                StateKV wkv = cutlass::make_producer_start_state<PipelineKV>();
                StateQ wq = cutlass::make_producer_start_state<PipelineQ>();
                producer(params, storage, pipe_q, pipe_kv, work, seq, mask.block_tile0(work.block), tiles.visit,
                         wq, wkv);
            }
            if constexpr (kBiasStages > 0) {  // the bias warp: the staged elementwise bias of each key tile, if any
                if (warp_in_wg == 1 && staged_bias(params)) {
                    for (int n = tiles.visit.begin; n < tiles.visit.end; ++n)
                        Bias::template load<kGroup>(storage.bias, &params.bias_map, params.mods, work.batch,
                                                    work.head, n - tiles.visit.begin, mask.block_row0(work.block),
                                                    n * kBlockN, seq.sq, seq.sk);
                }
            }
        } else {
            cutlass::arch::warpgroup_reg_alloc<kMmaRegs>();
            StateQ rq;
            rq.advance(wg_idx - 1);  // warpgroup w owns Q stage w
            StateKV rkv;             // K0, V0, K1, V1, ... alternate in the ring
            consumer(params, storage, pipe_q, pipe_kv, work, seq, mask, tiles, wg_idx - 1, rq, rkv);
        }
#endif
    }

    // The persistent grid (kPersistent): the producer warp and the consumer warpgroups walk the same work tiles, the
    // pipelines' states running on from tile to tile. After issuing a tile's loads the producer fetches the CTA's
    // next tile (DynamicPersistentScheduler::fetch) and hands it over through pipe_tile's one slot, which each
    // consumer warpgroup reads after its own epilogue. So the producer runs at most one tile ahead, the next tile's K
    // / V go into the ring while the consumers finish the current one, and no warpgroup waits for another at a tile's
    // end: the ping-pong's turns run on across tiles (consumer(), kTurnsAcrossTiles), the warpgroups staying half a
    // key step apart, so one's first product of the next tile runs under the other's last softmax. Every tile loads
    // Q, even one whose window holds no keys, so that each warpgroup's Q stage is taken and given back once per tile
    // on both sides.
    CUTLASS_DEVICE void persistent(Params const& params, SharedStorage& storage, PipelineQ& pipe_q,
                                   PipelineKV& pipe_kv, PipelineTile& pipe_tile, int wg_idx, int warp_in_wg) {
        static_assert(kPersistent, "the persistent grid's walk");
        using StateTile = typename PipelineTile::PipelineState;
        auto const& sp = params.sched;
        // Batch mode (the persistent instances'): every tile has the same sequence and mask geometry.
        const Sequence seq = sequence(params, 0);
        const Mask mask(seq.mask, seq.sq, seq.sk);
        // Tile t decoded (its work and key tiles); t >= total: none.
        auto tile_of = [&](int t) {
            NextTile n{t, {}, {}};
            if (t < sp.total) {
                n.work = PersistentScheduler::decode(sp, t);
                n.tiles = mask.key_tiles(n.work.block);
            }
            return n;
        };
        NextTile cur = tile_of(PersistentScheduler::first());
        if (wg_idx == 0) {
            cutlass::arch::warpgroup_reg_dealloc<kLoadRegs>();
            if (warp_in_wg != 0) return;
            StateKV wkv = cutlass::make_producer_start_state<PipelineKV>();
            StateQ wq = cutlass::make_producer_start_state<PipelineQ>();
            StateTile wt = cutlass::make_producer_start_state<PipelineTile>();
            const bool lane0 = threadIdx.x % 32 == 0;
            while (cur.t < sp.total) {
                producer(params, storage, pipe_q, pipe_kv, cur.work, seq, mask.block_tile0(cur.work.block),
                         cur.tiles.visit, wq, wkv);
                const int t = lane0 ? PersistentScheduler::fetch(sp) : 0;
                const NextTile next = tile_of(__shfl_sync(0xffffffffu, t, 0));
                pipe_tile.producer_acquire(wt);  // every consumer read the previous hand-over
                if (lane0) storage.next_tile = next;
                pipe_tile.producer_commit(wt);   // all 32 lanes arrive, lane 0 after its write
                ++wt;
                cur = next;
            }
        } else {
            cutlass::arch::warpgroup_reg_alloc<kMmaRegs>();
            const int wg = wg_idx - 1;
            StateQ rq;
            rq.advance(wg);
            StateKV rkv;
            StateTile rt;
            // The ping-pong's first turn (warpgroup 0's), opened once for the whole grid walk.
            if constexpr (NumMmaWG > 1) {
                if (wg == NumMmaWG - 1) cutlass::arch::NamedBarrier::arrive(2 * 128, kBarSched + 0);
            }
            while (cur.t < sp.total) {
                consumer(params, storage, pipe_q, pipe_kv, cur.work, seq, mask, cur.tiles, wg, rq, rkv);
                pipe_tile.consumer_wait(rt);
                cur = storage.next_tile;
                pipe_tile.consumer_release(rt);
                ++rt;
            }
            // Every warpgroup takes as many turns per tile, so the last one's final turn hands over to warpgroup
            // 0: it takes that arrive, so that no barrier is left half-arrived at exit.
            if constexpr (NumMmaWG > 1) {
                if (wg == 0) cutlass::arch::NamedBarrier::sync(2 * 128, kBarSched + 0);
            }
            if constexpr (kTmaStoreO) FwdEpilogue<ElementOut, kHdimV>::tma_store_drain(int(threadIdx.x % 128));
        }
    }

    struct TileIter {
        int i;
        CUTLASS_DEVICE int operator*() const { return i; }
        CUTLASS_DEVICE TileIter& operator++() {
            ++i;
            return *this;
        }
    };
    struct QTileIter : TileIter {
        CUTLASS_DEVICE int operator*() const { return kPartialFirst && this->i < 0 ? 0 : this->i; }
    };

    // One warp: Q tiles of all consumer warpgroups (from q_tile0: the block's first, Mask::block_tile0), then
    // K/V tiles visit.begin .. visit.end-1 (K_n and V_n alternate in one ring, so the consumers' wait order is K0 V0
    // K1 V1 ...).
    // wq / wkv: the pipelines' write states, which a persistent CTA carries from tile to tile. A window without keys
    // (visit empty) loads Q only (persistent instances; the one-tile kernel does not call the producer then).
    CUTLASS_DEVICE void producer(Params const& params, SharedStorage& storage, PipelineQ& pipe_q, PipelineKV& pipe_kv,
                                 Work const& work, Sequence const& seq, int q_tile0, TileRange const& visit,
                                 StateQ& wq, StateKV& wkv) {
        using LoadQ = typename Mainloop::LoadQ;
        using LoadK = typename Mainloop::LoadK;
        using IO = FwdTileIO<TileShapeQK, TileShapePV>;
        const int lane_predicate = cute::elect_one_sync();

        auto const& mp = params.mainloop;
        auto& sm = storage.mainloop;
        const auto bh = make_coord(kGroup ? 0 : work.batch, work.head);
        LoadQ load_q{mp.tma_load_q, pipe_q, sm.smem_q};
        auto st_q = IO::q(mp.tma_load_q, params.problem, bh, seq.q0, sm.smem_q.data(), SmemLayoutQ{});
        LoadK load_k{mp.tma_load_k, pipe_kv, sm.smem_k};
        auto st_k = IO::k(mp.tma_load_k, params.problem, bh, seq.k0, sm.smem_k.data(), SmemLayoutK{});
        LoadV load_v{params.tma_load_v, pipe_kv, sm.smem_v};
        // (fp8: the transposed V's key extent is seqlen_k rounded up to whole slot groups, hopper_fp8.hpp)
        auto problem_v = replace<3>(replace<4>(params.problem, params.hdim_v),
                                    kFp8 ? int(VtLayout::of(0, 1, 1, get<3>(params.problem)).keys)
                                         : get<3>(params.problem));
        auto st_v = IO::v(params.tma_load_v, problem_v, bh, seq.k0, sm.smem_v.data(), SmemLayoutV{});

        // Warpgroup w's Q: tile q_tile0 + w of 64 rows; a lead's warpgroup (kPartialFirst: no row in the sequence,
        // q_tile0 + w < 0) takes tile 0, which it does not read.
        QTileIter q_it{q_tile0};
        int q_count = NumMmaWG;
        TileIter kv_it{visit.begin};
        int kv_count = 2 * (visit.end - visit.begin);

        // The ring's barriers expect a V tile's bytes; a larger K tile (kHdim > kHdimV) expects the rest itself.
        auto step_k = [&] {
            if constexpr (kSplitDims) {
                if (lane_predicate == 1 && kv_count > 0) {
                    pipe_kv.producer_acquire(wkv);
                    cutlass::arch::ClusterTransactionBarrier::expect_transaction(
                        pipe_kv.producer_get_barrier(wkv), uint32_t(kStageBytes - kVBytes));
                }
                load_k.template step<false, true, false>(kv_it, st_k, wkv, lane_predicate, kv_count);
            } else {
                load_k.template step<false>(kv_it, st_k, wkv, lane_predicate, kv_count);
            }
        };
        if constexpr (kPersistent) {
            // The first K before Q: a Q stage comes free only after its warpgroup's epilogue of the previous tile,
            // a ring slot earlier.
            step_k();
            while (q_count > 0) load_q.step(q_it, st_q, wq, lane_predicate, q_count);
        } else {
            load_q.step(q_it, st_q, wq, lane_predicate, q_count);                 // Q of warpgroup 0
            step_k();                                                             // first K
            while (q_count > 0) load_q.step(q_it, st_q, wq, lane_predicate, q_count);
        }
        load_v.template step<true>(kv_it, st_v, wkv, lane_predicate, kv_count);   // first V
        CUTLASS_PRAGMA_NO_UNROLL
        while (kv_count > 0) {
            step_k();
            load_v.template step<true>(kv_it, st_v, wkv, lane_predicate, kv_count);
        }
    }

    // Whether the call's elementwise bias comes staged from the bias warp's ring: the launcher made its tensor map
    // (bias_stageable, make_bias_map; the same for every CTA). The consumers make it once before the key loop and
    // score_mods() takes it.
    CUTLASS_DEVICE static bool staged_bias(Params const& params) {
        if constexpr (kBiasStages > 0)
            return per_score_mods(params.mods) && params.bias_staged;
        else
            return false;
    }

    // The modifiers' terms (S / U) of key tile n (the t-th visited) on warpgroup wg's S, where the call has per-score
    // ones: a stageable 16-bit elementwise bias from the bias warp's shared-memory ring (staged: staged_bias(), made
    // once per CTA by the consumer), any other from global memory. A member, not a lambda of consumer(): as a lambda
    // nvcc outlined it, with S on the stack.
    template <class TensorS, class TensorC>
    CUTLASS_DEVICE static void score_mods(TensorS& s_mn, TensorC const& c_mn, Params const& params,
                                          SharedStorage& storage, FwdModUnits const& units, bool staged,
                                          Work const& work, Sequence const& seq, int row0, int wg, int n, int t,
                                          [[maybe_unused]] float (&row_off)[kRowsPerThread]) {
        if constexpr (kFixedVar) {
            fixed_score_mods(s_mn, c_mn, params, units, seq, row0, n, row_off);
            return;
        }
        if (!per_score_mods(params.mods)) return;
        if constexpr (kBiasStages > 0) {
            if (staged) {  // group mode: a slot past the sequence is left empty (Bias::staged_slot), read from global
                char const* slot = Bias::acquire(storage.bias, wg, t);
                const bool in_slot = Bias::template staged_slot<kGroup>(row0, n * kBlockN, seq.sq, seq.sk);
                if (in_slot) apply_score_mods_staged<Element, Bias>(s_mn, c_mn, params.mods, units, slot);
                Bias::release(storage.bias, wg, t);
                if (in_slot) return;
            }
        }
        apply_score_mods<Element>(s_mn, c_mn, params.mods, units, work.batch, work.head, seq.sq, seq.sk, row0,
                                  n * kBlockN);
    }

    // A fixed variant's modifiers on key tile n: its tile function called directly, no branch on the call's
    // modifiers (soft-cap, ALiBi: FwdKernel::builds); ALiBi alone leaves the rows' part to the softmax (row_off).
    template <class TensorS, class TensorC>
    CUTLASS_DEVICE static void fixed_score_mods(TensorS& s_mn, TensorC const& c_mn, Params const& params,
                                                FwdModUnits const& units, Sequence const& seq, int row0, int n,
                                                [[maybe_unused]] float (&row_off)[kRowsPerThread]) {
        static_assert(kFixedVar && (kModVar & FwdModVar::kBias) == 0, "a fixed variant without elementwise bias");
        if constexpr (kAlibiFold)
            apply_alibi_folding<64, kBlockN>(s_mn, c_mn, params.mods, units, row_off, seq.sq, seq.sk, row0,
                                             n * kBlockN);
        else
            detail::score_mods_tile<kVarCap, kVarBias, float>(s_mn, c_mn, params.mods, units, nullptr, 0, seq.sq,
                                                              seq.sk, row0, n * kBlockN, false);
    }

    // One consumer warpgroup (64 query rows): S = Q·Kᵀ, mask, online softmax and O += P·V per key tile, with the
    // P·V of tile n-1 in flight during the softmax of tile n; then the epilogue. A sequence without keys visits no
    // tile and goes straight to the epilogue (O = 0, LSE = -inf). rq / rkv: the pipelines' read states (warpgroup w
    // owns Q stage w; K0, V0, K1, V1, ... alternate in the ring), which a persistent CTA carries from tile to tile: it
    // waits for Q even without keys and gives its Q stage back after its last Q·Kᵀ (kOwnO) or after the epilogue.
    CUTLASS_DEVICE void consumer(Params const& params, SharedStorage& storage, PipelineQ& pipe_q, PipelineKV& pipe_kv,
                                 Work const& work, Sequence const& seq, Mask const& mask, KeyTiles const& tiles,
                                 int wg, StateQ& rq, StateKV& rkv) {
        using namespace cutlass::fmha::collective;

        const int tidx = int(threadIdx.x % 128);
        const int q_tile = mask.block_tile0(work.block) + wg;  // this warpgroup's 64-row tile of Q and O
        const int row0 = q_tile * 64;                            // its first query row
        // Modifier instances: S in units of U (FwdModUnits: logit = U·S; U = the soft-cap, or the softmax scale), so
        // the softmax's scale is U; the ALiBi slope / U and whether the bias is staged (staged_bias) are made once
        // here (a register and a predicate), the rest of what the modifiers need of this (sequence, head) is made per
        // tile from the kernel parameters (constant memory), so that it holds no registers across the key loop (kept
        // live, it made the d64 / d256 consumers spill).
        float scale_log2 = params.mainloop.scale_softmax_log2;
        float scale = params.mainloop.scale_softmax;
        [[maybe_unused]] FwdModUnits units{};
        [[maybe_unused]] bool staged = false;  // this CTA's bias comes from the bias warp's ring (score_mods)
        if constexpr (kMods) {
            units = FwdModUnits::of(params.mods, work.batch, work.head);
            staged = staged_bias(params);
            scale = units.unit;
            scale_log2 = units.unit * 1.4426950408889634f;  // log2(e)
        }
        float o_scale = 1.f;
        if constexpr (kFp8) {  // the logits scale folds dq·dk in; O gets dv
            const float dqk = *params.descale_q * *params.descale_k;
            scale_log2 *= dqk;
            scale *= dqk;
            o_scale = *params.descale_v;
        }

        TiledMmaQK mma_qk;
        TiledMmaPV mma_pv;
        auto thr_qk = mma_qk.get_thread_slice(tidx);
        auto thr_pv = mma_pv.get_thread_slice(tidx);

        Tensor sQ = make_tensor(make_smem_ptr(storage.mainloop.smem_q.data()), SmemLayoutQ{});
        Tensor sK = make_tensor(make_smem_ptr(storage.mainloop.smem_k.data()), SmemLayoutK{});
        Tensor sV = make_tensor(make_smem_ptr(storage.mainloop.smem_v.data()), SmemLayoutV{});
        Tensor tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(sQ));  // (MMA, M, K, StagesQ)
        Tensor tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(sK));  // (MMA, N, K, Stages)
        Tensor tOrV = thr_pv.make_fragment_B(thr_pv.partition_B(sV));  // (MMA, N, K, Stages)

        Tensor acc_s = partition_fragment_C(mma_qk, take<0, 2>(TileShapeQK{}));  // S / P in fp32
        Tensor acc_o = partition_fragment_C(mma_pv, take<0, 2>(TileShapePV{}));  // O in fp32
        Tensor s_mn = make_tensor(acc_s.data(), layout_acc_mn(mma_qk, acc_s.layout()));
        Tensor o_mn = make_tensor(acc_o.data(), layout_acc_mn(mma_pv, acc_o.layout()));
        Tensor c_mn = [&] {
            Tensor tScS = thr_qk.partition_C(make_identity_tensor(take<0, 2>(TileShapeQK{})));
            return make_tensor(tScS.data(), layout_acc_mn(mma_qk, tScS.layout()));
        }();
        constexpr int R = decltype(size<0>(s_mn))::value;  // query rows held by this thread
        static_assert(R == decltype(size<0>(o_mn))::value);

        // P as the A operand (registers) of the P·V wgmma (fp8: its own layout and packing, hopper_fp8.hpp).
        Tensor tOrP = [&] {
            if constexpr (kFp8) {
                return make_p_operand_fp8<Element, kBlockN>();
            } else {
                return make_fragment_like<Element>(
                    convert_c_layout_to_a_layout(acc_s.layout(), shape<1>(typename TiledMmaPV::LayoutA_TV{})));
            }
        }();
        static_assert(decltype(size(tOrP))::value == decltype(size(acc_s))::value);
        auto pack_p = [&] {
            if constexpr (kFp8) {
                pack_p_fp8(acc_s, tOrP);
            } else {
                detail::pack_fragment<Element>(acc_s, tOrP);
            }
        };

        // The narrow last tile's product, S and views (kNarrowLast): S's first kNarrowN keys. Its accumulator has
        // registers of its own: written into the first half of acc_s, ptxas serialised every wgmma of the d64 / d256
        // masked instances (insufficient register resources for the wgmma pipeline).
        TiledMmaQKNarrow mma_qk_n;
        auto thr_qk_n = mma_qk_n.get_thread_slice(tidx);
        Tensor tSrQ_n = thr_qk_n.make_fragment_A(thr_qk_n.partition_A(sQ));  // (MMA, 1, K, StagesQ)
        // B: the first kNarrowN keys of each ring slot (N-tile 0 of kBlockN / kNarrowN; where that does not divide,
        // a view of the slots' first kNarrowN keys: whole 8-row core matrices of the GMMA layout)
        Tensor tSrK_n = thr_qk_n.make_fragment_B(thr_qk_n.partition_B([&] {
            if constexpr (kBlockN % kNarrowN == 0)
                return sK;
            else
                return local_tile(sK, Shape<Int<kNarrowN>, Int<kHdim>, Int<kStages>>{}, make_coord(_0{}, _0{}, _0{}));
        }()));  // (MMA, N-tiles, K, Stages)
        using ShapeSN = Shape<_64, Int<kNarrowN>>;
        Tensor acc_s_n = partition_fragment_C(mma_qk_n, ShapeSN{});
        Tensor s_mn_n = make_tensor(acc_s_n.data(), layout_acc_mn(mma_qk_n, acc_s_n.layout()));
        Tensor c_mn_n = [&] {
            Tensor tScS = thr_qk_n.partition_C(make_identity_tensor(ShapeSN{}));
            return make_tensor(tScS.data(), layout_acc_mn(mma_qk_n, tScS.layout()));
        }();
        // P of the narrow tile is packed into the first half of P·V's operand registers (its first k-steps).
        static_assert(narrow_prefix(decltype(c_mn.layout()){}, decltype(c_mn_n.layout()){}),
                      "the narrow product's C fragment: the first half of the wide one's, element for element");
        // How many keys of the last tile it visits this warpgroup's rows see (from its last row: keys_end is
        // non-decreasing; a warpgroup past the sequence's end counts as seeing them all). None (skip, kNarrowLast;
        // not where it is the only tile): the warpgroup takes its turns but runs no product on that tile, and the
        // previous tile's P·V is its last. Up to kNarrowN: narrow.
        const int n_tiles = tiles.visit.end - tiles.visit.begin;
        const int last_keys = [&] {
            const int last_row = row0 + 63 < seq.sq ? row0 + 63 : seq.sq - 1;
            return kNarrowLast && last_row >= row0 ? mask.keys_end(last_row) - (tiles.visit.end - 1) * kBlockN
                                                   : kBlockN;
        }();
        const bool skip = kSkipLast && n_tiles > 1 && last_keys <= 0;
        // Whether this warpgroup holds rows of the sequence: not in the last block of a sequence that ends in an
        // earlier warpgroup's rows (e.g. s = 1k in 192-row tiles), nor in the first block's lead (kPartialFirst). One
        // that holds none runs no product at all (kTrimIdle) and stores no O.
        const bool in_seq = (!kPartialFirst || row0 >= 0) && row0 < seq.sq;
        const bool idle = kTrimIdle && !in_seq;
        const bool narrow = kNarrowLast && !skip && last_keys <= kNarrowN;
        // f(true_type) where the narrow tile applies and is asked for, else f(false_type).
        auto with_width = [&](bool narrow_now, auto&& f) {
            if constexpr (kNarrowLast) {
                if (narrow_now) {
                    f(cute::true_type{});
                    return;
                }
            }
            f(cute::false_type{});
        };

        // kOwnO: the Q stage goes back to the producer once the warpgroup's last Q·Kᵀ has completed (the tile's last
        // one it runs: the one before a skipped last tile), so that the next tile's Q loads under this tile's last
        // softmax, P·V and epilogue; a warpgroup that runs no product gives it back after its turns.
        const int last_qk = tiles.visit.end - 1 - (skip ? 1 : 0);
        auto release_q = [&] {
            if constexpr (kOwnO) {
                pipe_q.consumer_release(rq);
                rq.advance(NumMmaWG);
            }
        };

        OnlineSoftmax<R, kLazyRescale> softmax;
        static_assert(R == kRowsPerThread);
        [[maybe_unused]] float row_off[R];  // kAlibiFold: each row's ALiBi term left out of the tile's scores
        // A soft-capped call without bias or ALiBi has every score S = tanh(·) <= 1 in the units of U (the cap), so
        // the softmax may take 1 as each row's fixed reference maximum (OnlineSoftmax::fix_reference): no row
        // maximum per tile and no rescale of O. A masked score is -inf as before, and the smallest visible one,
        // S = -1, gives exp2(-2·cap·log2 e), a normal float up to kFixedRefMaxCap. The tiles of kFixedRef only.
        [[maybe_unused]] bool fixed_ref = false;
        if constexpr (kFixedRef) {
            constexpr float kFixedRefMaxCap = 40.f;  // 2·40·log2 e = 115.4 < 126
            fixed_ref = params.mods.softcap > 0.f && params.mods.softcap <= kFixedRefMaxCap &&
                        params.mods.bias_type == 0;
            if (fixed_ref) softmax.fix_reference(1.f);
        }
        clear(acc_o);
        if constexpr (kPersistent) pipe_q.consumer_wait(rq);

        // (narrow_c below: true_type for the narrow last tile's first kNarrowN keys, else false_type.)
        // The S accumulator that a Q·Kᵀ of this width writes.
        auto fence_s = [&](auto narrow_c) {
            if constexpr (decltype(narrow_c)::value)
                warpgroup_fence_operand(acc_s_n);
            else
                warpgroup_fence_operand(acc_s);
        };
        // S = Q·K^T and O += P·V of the tiles in ring slot k / v, issued asynchronously (one wgmma batch each).
        auto issue_qk = [&](StateKV const& k, auto narrow_c) {
            pipe_kv.consumer_wait(k);
            fence_s(narrow_c);
            warpgroup_arrive();
            if constexpr (decltype(narrow_c)::value)
                gemm_zero_acc(mma_qk_n, tSrQ_n(_, 0, _, rq.index()), tSrK_n(_, 0, _, k.index()), acc_s_n(_, 0, 0));
            else
                gemm_zero_acc(mma_qk, tSrQ(_, _, _, rq.index()), tSrK(_, _, _, k.index()), acc_s);
            warpgroup_commit_batch();
        };
        // A K or V tile this warpgroup runs no product on (an idle warpgroup's, a skipped tile's), given back once
        // it has loaded: a release before the load would count towards the slot's previous fill.
        auto pass_kv = [&](StateKV const& kv) {
            pipe_kv.consumer_wait(kv);
            pipe_kv.consumer_release(kv);
        };
        auto issue_pv = [&](StateKV const& v, auto narrow_c) {
            pipe_kv.consumer_wait(v);
            warpgroup_fence_operand(acc_o);
            warpgroup_arrive();
            if constexpr (decltype(narrow_c)::value) {
                CUTLASS_PRAGMA_UNROLL
                for (int kb = 0; kb < kNarrowN / 16; ++kb)
                    cute::gemm(mma_pv, tOrP(_, _, kb), tOrV(_, _, kb, v.index()), acc_o);
            } else {
                cute::gemm(mma_pv, tOrP, tOrV(_, _, _, v.index()), acc_o);
            }
            warpgroup_commit_batch();
        };
        // Tile n's S (its first kNarrowN keys where narrow): the mask where the block does not see the tile whole,
        // then the softmax's update. pack_tile then packs P (into the first of P·V's k-steps where narrow).
        auto softmax_tile = [&](int n, auto first_c, auto narrow_c) {
            auto run = [&](auto& sv, auto const& cv) {
                if (!tiles.full.contains(n)) mask.apply(sv, cv, row0, n);
                if constexpr (kFixedRef) {
                    if (fixed_ref) {
                        softmax.update_fixed(sv, scale_log2);
                        return;
                    }
                }
                if constexpr (kAlibiFold)
                    softmax.template update<decltype(first_c)::value, true>(sv, scale_log2, row_off);
                else
                    softmax.template update<decltype(first_c)::value>(sv, scale_log2);
            };
            if constexpr (decltype(narrow_c)::value)
                run(s_mn_n, c_mn_n);
            else
                run(s_mn, c_mn);
        };
        auto pack_tile = [&](auto narrow_c) {
            if constexpr (decltype(narrow_c)::value)
                detail::pack_fragment<Element>(acc_s_n, tOrP);
            else
                pack_p();
        };
        // Dropout (modifier instances): P of tile n -> P ∘ keep after the softmax's update (hopper_dropout.hpp); what
        // it needs is made per tile from the kernel parameters, so that nothing stays live across the key loop. It
        // runs under the previous tile's P·V, except with three consumer warpgroups (160 registers each), where it
        // waits for that product to free P's operand registers first (under it the d64 instance spilled more).
        constexpr bool kDropUnderPV = NumMmaWG < 3;
        auto drop_tile = [&](int n) {
            if constexpr (kGenericMods) {  // (a fixed variant: no dropout, fwd_mod_variant)
                Dropout const& d = params.mods.dropout;
                if (d.on) {
                    const int nhead_q = get<1, 0>(params.problem) * get<1, 1>(params.problem);
                    drop_p(acc_s, c_mn, d, uint32_t(work.batch * nhead_q + work.head), row0, n * kBlockN);
                }
            }
        };

        if (!tiles.visit.empty()) {
            // Ping-pong: warpgroup w waits for its turn, issues its wgmmas, hands the turn to w + 1. One-tile
            // kernels: the last warpgroup opens the round with an extra arrive and skips its final one. Persistent
            // ones (kTurnsAcrossTiles): the turns run on from tile to tile (persistent() opens them once), the last
            // warpgroup's final turn of a tile handing over to warpgroup 0's first of the next.
            constexpr bool kTurnsAcrossTiles = kPersistent;
            using cutlass::arch::NamedBarrier;
            auto sched_sync = [&] {
                if constexpr (NumMmaWG > 1) NamedBarrier::sync(2 * 128, kBarSched + wg);
            };
            auto sched_arrive = [&](bool last) {
                if constexpr (NumMmaWG > 1) {
                    if (kTurnsAcrossTiles || !(last && wg == NumMmaWG - 1))
                        NamedBarrier::arrive(2 * 128, kBarSched + (wg + 1) % NumMmaWG);
                }
            };
            if constexpr (NumMmaWG > 1 && !kTurnsAcrossTiles) {
                if (wg == NumMmaWG - 1) NamedBarrier::arrive(2 * 128, kBarSched + 0);
            }

            if constexpr (!kPersistent) pipe_q.consumer_wait(rq);

            if (idle) {
                // No row of this warpgroup is in the sequence: its turns, and each K and V given back once loaded.
                for (int n = tiles.visit.begin; n < tiles.visit.end; ++n) {
                    sched_sync();
                    sched_arrive(n == tiles.visit.end - 1);
                    CUTLASS_PRAGMA_UNROLL
                    for (int kv = 0; kv < 2; ++kv, ++rkv) pass_kv(rkv);
                }
            } else {
                // ---- first tile: S = Q K^T, softmax ----
                with_width(narrow && n_tiles == 1, [&](auto narrow_c) CUTLASS_LAMBDA_FUNC_INLINE {
                    sched_sync();
                    issue_qk(rkv, narrow_c);
                    sched_arrive(n_tiles == 1);
                    // The previous tile's O store has read this warpgroup's O buffer by the next turn, which every
                    // thread passes before the epilogue writes the buffer again (a tile of one turn: the epilogue
                    // waits itself). Here, a turn after that store was issued, the wait is seldom a wait.
                    if constexpr (kTmaStoreO) FwdEpilogue<ElementOut, kHdimV>::tma_store_drain(tidx);
                    warpgroup_wait<0>();
                    fence_s(narrow_c);
                    if (last_qk == tiles.visit.begin) release_q();
                    pipe_kv.consumer_release(rkv);
                    ++rkv;  // -> V0
                    if constexpr (kMods)
                        score_mods(s_mn, c_mn, params, storage, units, staged, work, seq, row0, wg, tiles.visit.begin, 0,
                                   row_off);
                    softmax_tile(tiles.visit.begin, cute::true_type{}, narrow_c);
                    drop_tile(tiles.visit.begin);
                    pack_tile(narrow_c);  // P: the A operand (registers) of P·V
                });

                // ---- later tiles: S_n = Q K_n^T and O += P_{n-1} V_{n-1} in flight together ----
                auto step = [&](int n, auto narrow_c) CUTLASS_LAMBDA_FUNC_INLINE {
                    StateKV rv = rkv;  // V_{n-1}
                    ++rkv;             // K_n
                    sched_sync();
                    issue_qk(rkv, narrow_c);
                    issue_pv(rv, cute::false_type{});
                    sched_arrive(n == tiles.visit.end - 1);

                    warpgroup_wait<1>();  // S_n ready; P_{n-1} V_{n-1} may still run
                    fence_s(narrow_c);
                    if (n == last_qk) release_q();
                    pipe_kv.consumer_release(rkv);
                    if constexpr (kMods)
                        score_mods(s_mn, c_mn, params, storage, units, staged, work, seq, row0, wg, n,
                                   n - tiles.visit.begin, row_off);
                    softmax_tile(n, cute::false_type{}, narrow_c);
                    if constexpr (kDropUnderPV) drop_tile(n);  // under the P·V in flight

                    warpgroup_wait<0>();
                    warpgroup_fence_operand(acc_o);
                    pipe_kv.consumer_release(rv);
                    if constexpr (!kDropUnderPV) drop_tile(n);
                    if (!(kFixedRef && fixed_ref)) softmax.rescale(o_mn);
                    pack_tile(narrow_c);
                    ++rkv;  // -> V_n
                };
                // The skipped last tile n: the turn for P_{n-1} V_{n-1} alone; K_n and V_n passed (pass_kv).
                auto step_skip = [&](int n) CUTLASS_LAMBDA_FUNC_INLINE {
                    StateKV rv = rkv;  // V_{n-1}
                    ++rkv;             // K_n
                    sched_sync();
                    issue_pv(rv, cute::false_type{});
                    sched_arrive(true);
                    pass_kv(rkv);
                    warpgroup_wait<0>();
                    warpgroup_fence_operand(acc_o);
                    pipe_kv.consumer_release(rv);
                    ++rkv;  // -> V_n
                    pass_kv(rkv);
                };
                const int n_wide_end = tiles.visit.end - ((narrow || skip) && n_tiles > 1 ? 1 : 0);
                CUTLASS_PRAGMA_NO_UNROLL
                for (int n = tiles.visit.begin + 1; n < n_wide_end; ++n) step(n, cute::false_type{});
                if constexpr (kNarrowLast) {
                    if (kSkipLast && skip)
                        step_skip(n_wide_end);
                    else if (narrow && n_tiles > 1)
                        step(n_wide_end, cute::true_type{});
                }

                // ---- last P·V (none after a skipped tile: its V is given back already) ----
                if (!skip) {
                    with_width(narrow, [&](auto narrow_c) { issue_pv(rkv, narrow_c); });
                    warpgroup_wait<0>();
                    warpgroup_fence_operand(acc_o);
                    pipe_kv.consumer_release(rkv);
                }
                ++rkv;  // -> the next tile's K0
            }
        }

        if (tiles.visit.empty() || idle) release_q();  // (a warpgroup with products gave it back after its last)

        // ---- normalise, LSE, O ----
        float lse[R];
        if constexpr (kGenericMods) {
            if (params.mods.dropout.on) scale_kept(acc_o, params.mods.dropout);
        }
        if constexpr (kMods)
            softmax.finalize(o_mn, scale, lse, sink_logit(params.mods, work.head));
        else if constexpr (!kFp8)
            softmax.finalize(o_mn, scale, lse, sink_logit(params.sink, work.head));
        else
            softmax.finalize(o_mn, scale, lse);
        if constexpr (kFp8) {
            CUTLASS_PRAGMA_UNROLL
            for (int i = 0; i < decltype(size(acc_o))::value; ++i) acc_o(i) *= o_scale;
        }
        const int64_t h = work.head;
        const int64_t o_seq = kGroup ? int64_t(seq.q0) * params.o_row : int64_t(work.batch) * params.o_batch;
        const int64_t lse_seq = kGroup ? int64_t(seq.q0) : int64_t(work.batch) * params.lse_batch;
        const FwdEpilogue<ElementOut, kHdimV> epi{
            params.lse != nullptr ? params.lse + lse_seq + h * params.lse_head : nullptr,
            params.o + o_seq + h * params.o_head, params.o_row, seq.sq, params.hdim_v, row0};
        epi.store_lse(lse, c_mn);
        if constexpr (kFp8 && !kOwnO) {
            // The K/V ring, once no consumer reads it any more (the producer loads no tile that is not consumed).
            cutlass::arch::NamedBarrier::sync(NumMmaWG * 128, kBarRingFree);
            ElementOut* stage = reinterpret_cast<ElementOut*>(storage.mainloop.smem_k.data()) + wg * StagedO::kElems;
            epi.store_o_rows(acc_o, thr_pv, StagedO{stage}, kBarEpi + wg, tidx);
        } else if constexpr (kOwnORows) {
            // this warpgroup's padded rows of the O buffer, kOCols columns at a time
            epi.store_o_rows(acc_o, thr_pv, StagedOCols{storage.smem_o.data() + wg * StagedOCols::kElems}, kBarEpi + wg,
                             tidx);
        } else if constexpr (kOwnOSwizzled) {
            // (64, kHdimV), swizzled as a Q stage: this warpgroup's part of the O buffer, out by a TMA store
            Tensor sOwn = make_tensor(make_smem_ptr(storage.smem_o.data()), SmemLayoutQ{});
            Tensor sO = local_tile(sOwn(_, _, wg), Shape<_64, Int<kHdimV>>{}, make_coord(_0{}, _0{}));
            if (in_seq) {
                using IO = FwdTileIO<TileShapeQK, TileShapePV>;
                auto io = IO::o(params.tma_store_o, replace<4>(params.problem, params.hdim_v),
                                make_coord(work.batch, work.head), storage.smem_o.data(), SmemLayoutQ{});
                epi.store_o_tma(acc_o, mma_pv, sO, params.tma_store_o, get<0>(io)(_, _, _, wg),
                                get<1>(io)(_, _, _, q_tile), /*sO_free=*/n_tiles > 1,
                                kBarEpi + wg, tidx);
            }
        } else {
            // (64, kHdimV), swizzled: the first columns of this warpgroup's Q buffer, free now
            Tensor sO = local_tile(sQ(_, _, rq.index()), Shape<_64, Int<kHdimV>>{}, make_coord(_0{}, _0{}));
            epi.store_o(acc_o, mma_pv, sO, kBarEpi + wg, tidx);
            if constexpr (kPersistent) {
                // O's staging read, then the Q stage back to the producer (its next TMA write: the async proxy).
                cutlass::arch::fence_view_async_shared();
                pipe_q.consumer_release(rq);
                rq.advance(NumMmaWG);
            }
        }
    }
};

// The kernel types (distinct names, so that the plain one keeps its symbol): plain and modifier instances, the
// latter one per modifier variant (FwdModVar) that the instance builds (the generic one keeps its symbol).
template <class Element, class ElementOut, int kHdim, int kHdimV, bool kGroup, bool kMasked, int kBlockM, int kBlockN>
struct HopperFwdKernelImpl
    : HopperFwdKernelBody<Element, ElementOut, kHdim, kHdimV, kGroup, kMasked, kBlockM, kBlockN, false> {};
template <class Element, class ElementOut, int kHdim, int kHdimV, bool kGroup, bool kMasked, int kBlockM, int kBlockN>
struct HopperFwdKernelModsImpl
    : HopperFwdKernelBody<Element, ElementOut, kHdim, kHdimV, kGroup, kMasked, kBlockM, kBlockN, true> {};
template <class Element, class ElementOut, int kHdim, int kHdimV, bool kGroup, bool kMasked, int kBlockM, int kBlockN,
          int kModVar>
struct HopperFwdKernelModsVarImpl
    : HopperFwdKernelBody<Element, ElementOut, kHdim, kHdimV, kGroup, kMasked, kBlockM, kBlockN, true, false, 5,
                          kModVar> {};
// The persistent grid (catalogue `persistent`; batch-mode plain instances): a type of its own, so that the one-tile
// kernels keep their symbols and code.
template <class Element, class ElementOut, int kHdim, int kHdimV, bool kGroup, bool kMasked, int kBlockM, int kBlockN,
          int kMaxStages = 5>
struct HopperFwdKernelPersistentImpl
    : HopperFwdKernelBody<Element, ElementOut, kHdim, kHdimV, kGroup, kMasked, kBlockM, kBlockN, false, true,
                          kMaxStages> {};

}  // namespace mhakit::hopper
