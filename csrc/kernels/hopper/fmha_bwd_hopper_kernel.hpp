// mhakit hopper family, backward pass — the main kernel (dQ/dK/dV) on sm_90a: one CTA per (key block, kv head,
// batch), three warpgroups:
//   * warpgroup 0, warp 0: TMA producer. K and V of the block once; then, for every query head of the kv group and
//     every query tile that sees the block, Q (+ its LSE·log2e row) and dO (+ its D row) through two 2-stage
//     mbarrier pipelines (tiles via TMA, the fp32 rows via 1-D bulk copies on the same barriers);
//   * warpgroup 0, warp 1: dQ writer (key splits). Each consumer warpgroup leaves its fp32 dQ tile in shared memory;
//     this warp adds it into the workspace accumulator with one bulk reduce-add (cp.reduce.async.bulk .add.f32) per
//     tile. Query split, deterministic mode: the turn keeper (dq_turn_keeper), which waits for each dQ tile's turn
//     and passes it on, so that the consumers, who add their dQ themselves, never wait on a turn's round trips;
//   * warpgroups 1 and 2: consumers (tensor-core math, 240 registers each).
//
// Per query tile (BM query rows against BN keys) the consumers compute, all products on wgmma:
//   Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ                        (SS, operands from shared memory)
//   Pᵀ = exp2(Sᵀ·scale·log2e − LSE·log2e)           (masked pairs: 0)
//   dSᵀ = Pᵀ ∘ (dPᵀ − D)
//   dV += Pᵀ·dO,  dK += dSᵀ·Q                        (fp32 accumulators in registers for the whole CTA life)
//   dQ_tile = dS·K                                   (dS through shared memory; added into the workspace)
// Three layouts, chosen by the tile and the head dims (the first two as above, transposed: keys are the rows of Sᵀ):
//   * key split (BN = 128, one head dim, kHdim + BM <= 192: head dims 64 / 96 / 128): warpgroup w owns keys
//     [64w, 64w + 64): its Sᵀ/dPᵀ rows and its
//     dK/dV rows; Pᵀ and dSᵀ stay in registers as the A operand of the dV/dK products (RS wgmma); dSᵀ is also
//     stored to shared memory for the dQ product, which needs all BN keys (one 256-thread named barrier per tile).
//   * query split (every other tile: BN = 64, or BN = 128 where the key split's registers do not suffice; head dims
//     192 / (192, 128) / 256, where 64 keys x kHdim of fp32 dK + dV would not fit one warpgroup's registers):
//     warpgroup w computes Sᵀ/dPᵀ for query columns [BM/2·w, BM/2·(w+1)), both store Pᵀ and dSᵀ to shared memory,
//     and each warpgroup then owns half of the head dim of dK, dV and dQ (SS wgmma). dQ is added straight into the
//     workspace with 16-byte fp32 vector reductions (no shared memory left for a dQ tile at these head dims). With
//     BN = 128 each warpgroup computes its Sᵀ/dPᵀ columns in two parts of 64 keys, one after the other (only one
//     part's accumulators live beside dK and dV), and the dQ adds and the Q / dO reads per key are half those of
//     BN = 64.
//   * swapped key split (BN = 96, BM = 64, head dims multiples of 64 with kHdim + kHdimV <= 320: (192, 128);
//     consumer_swapped; FlashAttention-3's layout for head dim 192): S = Q·Kᵀ and dP = dO·Vᵀ are not transposed
//     (64 query rows x 48 keys per warpgroup, m64n48k16), P and dS = P ∘ (dP − D) take LSE / D per row and the
//     forward's element mask (ForwardMask::apply); each warpgroup stores its 64 x 48 slices of P and dS to shared
//     memory (queries x keys, keys contiguous, 32B swizzle), then computes dVᵀ += dOᵀ·P and dKᵀ += Qᵀ·dS with the
//     head dim as M (A: the (d, queries) views of the dO / Q stages, MN-major; B: its own P / dS slice, so a
//     warpgroup-local barrier for P) into dKᵀ / dVᵀ accumulators of (kHdim + kHdimV)·48/128 registers per thread,
//     and dQ = dS·K over all 96 keys (one 256-thread barrier per tile) through the dQ writer warp, as the key
//     split. The epilogue writes dKᵀ / dVᵀ transposed (BwdEpilogue::store_t). Against the 64-key query split: 2/3
//     of the Q / dO reads and dQ adds per key, and those adds are bulk reductions of the writer warp.
// dQ tiles are added in "fragment order": the element i of consumer thread t (t in [0, 256)) of query tile m lives
// at float offset ((t / 128) · F · 128 + (i / 4) · 512 + (t % 128) · 4 + i % 4) of the tile's BM·D block
// (F = BM·D/256), so that both the shared-memory writes and the bulk reduction are contiguous; the convert kernel
// (fmha_bwd_hopper_aux.hpp) maps it back with the same tiled-MMA partition.
//
// Masks: the CTA visits only query tiles that see some key of the block and masks element-wise only tiles on the
// band's edges or the key tail (MaskGeometry::query_tiles / tile_full, kernels/common/mask_geometry.h). Rows past
// seqlen_q carry LSE = +inf in the workspace, which makes their P (hence dS) exactly zero.
// GQA: the CTA owns one kv head and loops over its query heads, accumulating dK/dV in registers (no atomics, no
// extra workspace for dK/dV). Where that grid leaves SMs idle (few kv heads, b = 1), the launcher runs the split
// twin (kSplit, HopperBwdKernelSplitImpl; bwd_gqa_split.h): the grid's head is kv head x splits + sp, CTA sp takes
// query heads [sp x split_heads, (sp + 1) x split_heads) of its group and stores its dK / dV unscaled to a workspace
// slot (store_partial), which reduce_dkv_kernel adds in slot order. dQ, its turns and dbias are per query head, each
// written by one CTA per key block as before.
// Deterministic mode (params.deterministic, a run-time choice): dK and dV are deterministic anyway (one CTA writes
// each); each dQ tile is added to by the key blocks whose query range holds it, one run [lo, hi] of key blocks, in
// the fixed order hi, hi - 1, .., lo: key block n waits until the tile's turn counter (workspace) reads hi - n, adds,
// waits for its adds to complete and passes the turn on (the dQ writer warp, or at the query split the turn keeper
// warp, for the consumers' adds). Waiting only ever goes to higher key blocks; the grid runs
// the key blocks in reverse in this mode, so those were dispatched earlier and are running or done (no deadlock),
// and under a causal or window mask the higher key blocks, which start at later query tiles, also reach a tile
// first, so the turns cost little waiting. Without a mask every key block reaches a tile together with the block
// above it, so a chain of CTAs that start side by side waits a link per CTA: the query split's deterministic grid
// is 1-D and interleaves a few (kv head, batch) pairs' reversed key blocks (Scheduler::work_interleaved, the
// group from fmha_bwd_hopper.cuh's det_group), so that CTAs which start together as others finish mostly belong to
// different pairs.
// Group mode (kGroup): the TMA descriptors see the packed tensors as one batch of total rows; a CTA offsets its
// tiles by its sequence's first rows (seqstart), makes the sequence's mask coordinate itself, and returns at once
// when its key block lies past the sequence's keys (the grid is sized by max_seqlen_k). Query tiles that run past
// the sequence read the next sequence's rows, whose workspace LSE is +inf: their P, hence their dS, is 0.
//
// kMods: the modifier instances ("_mods"; HopperBwdKernelModsImpl, the plain kernel keeps its type and symbol):
// soft-cap and bias / ALiBi turn each Sᵀ tile into logits before Pᵀ is recomputed (in logit units; the forward's LSE
// holds the sink), dbias receives dSᵀ (logit units), and dSᵀ is multiplied by the soft-cap's derivative, kept as
// packed fp16 pairs between the two (hopper_score_mod.hpp). d sink comes from the workspace
// (dsink_kernel, fmha_bwd_hopper_aux.hpp). Dropout (hopper_dropout.hpp): the forward's random bytes of each Sᵀ tile,
// drawn while its products run; dV takes Pᵀ ∘ keep (1 / (1 − p) in the epilogue's scale), dSᵀ = Pᵀ ∘ (dPᵀ ∘ keep /
// (1 − p) − D). A "_mods" instance holds one main kernel per modifier variant (BwdModVar, kModVar) that it builds:
// the generic one picks the modifiers per tile; the fixed ones (soft-cap, ALiBi, both, a staged bias)
// have them at compile time, hold the ALiBi slope per query head, and mask in recompute_pt's block as the plain
// kernel does. The launcher picks the kernel per call (bwd_mod_variant, BwdKernel::run).
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "cute/tensor.hpp"
// GMMA's extended N shapes (m64n48k16, the swapped key split's): their atoms and traits only; CuTe's op selectors
// keep their standard shapes (CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED stays undefined), so no other tile changes.
#include "cute/arch/mma_sm90_gmma_ext.hpp"
#include "cute/atom/mma_traits_sm90_gmma_ext.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/arch/reg_reconfig.h"
#include "cutlass/cutlass.h"
#include "cutlass/numeric_types.h"
#include "cutlass/pipeline/pipeline.hpp"

#include "88_hopper_fmha/collective/fmha_common.hpp"  // gemm_zero_acc, convert_c_layout_to_a_layout

#include "kernels/common/mask_geometry.h"
#include "kernels/common/tile_scheduler.h"

#include "fmha_bwd_hopper_common.hpp"
#include "fmha_hopper_mask.hpp"
#include "hopper_bias_stage.hpp"
#include "hopper_dropout.hpp"
#include "hopper_epilogue.hpp"
#include "hopper_score_mod.hpp"
#include "hopper_softmax.hpp"
#include "hopper_tile_io.hpp"
#include "hopper_types.hpp"

namespace mhakit::hopper {

using namespace cute;

using BwdGmemShape = cute::Shape<int32_t, int32_t, int32_t, int32_t>;     // (seqlen, d, head, batch)
using BwdGmemStride = cute::Stride<int64_t, cute::_1, int64_t, int64_t>;  // elements

// The "_mods" kernel's modifier variant (its kModVar), which the launcher picks per call (bwd_mod_variant): the
// generic kernel dispatches per key tile at run time (soft-cap, bias kind, staged or not, dropout, dbias), a fixed
// variant knows the call's modifiers at compile time. Why: in the generic kernel (d128 causal, SASS) the dispatch
// took about 53 instructions of uniform branches and row_mods() per tile (with an LDG of the ALiBi slope and 64-bit
// bias address math), kept the modifier math in a basic block apart from recompute_pt's exp pass, and left the mask
// predicated in that pass (its mask block made ptxas spill there): H200, b1 h16 s4096, the causal ALiBi call took
// 0.507 ms against the plain masked one's 0.404. A per-tile switch over whole per-variant loops in one kernel made
// ptxas spill 2.3 KB, so each fixed variant is a kernel of its own, chosen on the host. Instructions on a full tile's
// path (d128 causal batch, SASS; generic -> fixed; the plain kernel: 502): soft-cap
// 990 -> 724, ALiBi 862 -> 598 (+21 where the query head changes), both 1039 -> 783, staged bias 901 -> 643; no
// fixed variant spills. Values: kGeneric, or kFixed with the flags of the call's modifiers.
struct BwdModVar {
    static constexpr int kGeneric = 0;
    static constexpr int kFixed = 1;  // no dropout, no dbias; the flags below fixed at compile time
    static constexpr int kCap = 2;    // soft-cap
    static constexpr int kAlibi = 4;  // ALiBi
    static constexpr int kBias = 8;   // a 16-bit elementwise bias staged by the bias warp (bias_stageable)
    // score_mods_tile_t's bias kind of a fixed variant
    static constexpr int bias_kind(int v) { return (v & kAlibi) ? 2 : (v & kBias) ? 3 : 0; }
};

// The fixed variant of a call (every flag as the call sets it), or kGeneric where the call needs what only the
// generic kernel does: dropout, dbias, an elementwise bias that is not staged (fp32, unaligned rows). The launcher
// runs the generic kernel also for a fixed variant its instance does not build (BwdKernel::builds). A sink changes
// no score (the forward's LSE holds it): a sink alone is kFixed with no flag, the plain kernel's math (no instance
// builds it: BwdKernel::builds).
CUTLASS_HOST_DEVICE int bwd_mod_variant(ScoreMods const& m, bool dbias) {
    if (m.dropout.on || dbias || (m.bias_type == 1 && !bias_stageable(m))) return BwdModVar::kGeneric;
    return BwdModVar::kFixed | (m.softcap > 0.f ? BwdModVar::kCap : 0) | (m.bias_type == 2 ? BwdModVar::kAlibi : 0) |
           (m.bias_type == 1 ? BwdModVar::kBias : 0);
}

template <class Element_, int kHdim_, int kHdimV_, bool kGroup_, bool kMasked_, int kBlockM_, int kBlockN_,
          bool kMods_, int kModVar_ = BwdModVar::kGeneric, bool kSplit_ = false>
struct HopperBwdKernelBody {
    using Element = Element_;
    static constexpr bool kGroup = kGroup_;
    static constexpr int kHdim = kHdim_;    // Q, K, dQ, dK
    static constexpr int kHdimV = kHdimV_;  // V, O, dO, dV
    static constexpr bool kMasked = kMasked_;
    static constexpr int kBlockM = kBlockM_;
    static constexpr int kBlockN = kBlockN_;
    static constexpr bool kMods = kMods_;
    static constexpr int kModVar = kModVar_;
    // The GQA split's kernel (bwd_gqa_split.h): a CTA takes split_heads of its kv group's query heads and leaves its
    // dK / dV partial sums in a workspace slot (store_partial) for reduce_dkv_kernel. The generic kernels only.
    static constexpr bool kSplit = kSplit_;
    // A fixed variant (BwdModVar): its modifiers at compile time; kGenericMods: the per-tile dispatch
    static constexpr bool kFixedVar = (kModVar & BwdModVar::kFixed) != 0;
    static constexpr bool kGenericMods = kMods && !kFixedVar;
    static constexpr bool kVarCap = kFixedVar && (kModVar & BwdModVar::kCap) != 0;
    static constexpr int kVarBias = kFixedVar ? BwdModVar::bias_kind(kModVar) : 0;
    static_assert(kMods || kModVar == BwdModVar::kGeneric, "plain instances: no modifier variant");
    static_assert(!kSplit || kModVar == BwdModVar::kGeneric, "the GQA split: generic kernels only");
    static_assert(kHdim % 32 == 0 && kHdim >= 64 && kHdim <= 256, "head-dim buckets: multiples of 32 in [64, 256]");
    static_assert(kHdimV % 32 == 0 && kHdimV >= 64 && kHdimV <= 256, "V head-dim buckets: multiples of 32 in [64, 256]");
    static_assert(kBlockM == 64 || kBlockM == 128, "kBlockM: 64 or 128");
    static_assert(kBlockN == 64 || kBlockN == 96 || kBlockN == 128,
                  "kBlockN: 64 (query split), 96 (swapped key split) or 128 (key or query split)");

    using Scheduler = SingleTileScheduler</*kHeaviestFirst=*/false>;  // blocks: key blocks
    using Geometry = MaskGeometry<kMasked, int>;  // x, y arrive clamped: 32-bit sums do not overflow

    static constexpr int NumMmaWG = 2;
    static constexpr int NumMmaThreads = NumMmaWG * 128;
    // The key split where its registers allow it (one head dim; dK + dV + Sᵀ + dPᵀ within 240 registers), else the
    // query split, whose block of keys may be 64 or 128 (the dQ adds into the workspace halve with 128).
    static constexpr bool kKeySplit = kBlockN == 128 && kHdimV == kHdim && kHdim + kBlockM <= 192;
    // The swapped key split (BN = 96, the third layout; consumer_swapped): S and dP in (query, key) orientation, each
    // warpgroup owning 48 keys, dKᵀ / dVᵀ (head dim x its keys) in registers. Its registers: dKᵀ + dVᵀ =
    // (kHdim + kHdimV) · 48 / 128 per thread, + 24 + 24 of S / dP, + 48 of the transient dQ; both head dims whole
    // 64-row M blocks of the dKᵀ / dVᵀ products (and the dQ product's N halves multiples of 8).
    static constexpr bool kSwapKV = kBlockN == 96;
    static_assert(!kSwapKV || (kBlockM == 64 && kHdim % 64 == 0 && kHdimV % 64 == 0 && kHdim + kHdimV <= 320),
                  "BN = 96 (swapped key split): BM = 64, head dims multiples of 64 with kHdim + kHdimV <= 320");
    static_assert(!kSwapKV || !kMods, "BN = 96 (swapped key split): plain instances only (catalogue plain_only)");
    static_assert(!kSwapKV || std::is_same_v<Element, cutlass::bfloat16_t> || std::is_same_v<Element, cutlass::half_t>);
    static constexpr int kWgN = kKeySplit ? 2 : 1;  // warpgroups along the key dim of Sᵀ (and of dK/dV)
    static constexpr int kWgQ = 2 / kWgN;           // warpgroups along the query dim of Sᵀ (head dim of dK/dV)
    static constexpr int kWgM_dQ = kBlockM / 64;    // warpgroups along the query dim of dQ
    static constexpr bool kDqViaSmem = kKeySplit || kSwapKV;  // query split: no shared memory left for a dQ tile

    // ---- tiled MMAs ----
    // (keys, queries, d) per warpgroup; the same MMA serves dPᵀ = V·dOᵀ, whose reduction runs over kHdimV instead
    using TileSdP = Shape<_64, Int<kBlockM / kWgQ>, Int<kHdim>>;
    using TiledMmaSdP = decltype(make_tiled_mma(
        GMMA::ss_op_selector<Element, Element, float, TileSdP, GMMA::Major::K, GMMA::Major::K>(),
        Layout<Shape<Int<kWgN>, Int<kWgQ>, _1>>{}));
    using TileKV = Shape<_64, Int<kHdim / kWgQ>, Int<kBlockM>>;  // (keys, d, queries) per warpgroup
    using MmaKVOp = std::conditional_t<
        kKeySplit, decltype(GMMA::rs_op_selector<Element, Element, float, TileKV, GMMA::Major::K, GMMA::Major::MN>()),
        decltype(GMMA::ss_op_selector<Element, Element, float, TileKV, GMMA::Major::K, GMMA::Major::MN>())>;
    using TiledMmadKV = decltype(make_tiled_mma(MmaKVOp{}, Layout<Shape<Int<kWgN>, Int<kWgQ>, _1>>{}));
    // dV += Pᵀ·dO: the dK product's MMA when the head dims are equal, else one with N over kHdimV (query split only)
    using TileV = Shape<_64, Int<kHdimV / kWgQ>, Int<kBlockM>>;
    using TiledMmadV = std::conditional_t<
        kHdimV == kHdim, TiledMmadKV,
        decltype(make_tiled_mma(
            GMMA::ss_op_selector<Element, Element, float, TileV, GMMA::Major::K, GMMA::Major::MN>(),
            Layout<Shape<Int<kWgN>, Int<kWgQ>, _1>>{}))>;
    using TileQ = Shape<_64, Int<kHdim * kWgM_dQ / 2>, Int<kBlockN>>;  // (queries, d, keys) per warpgroup
    // A = dS: MN-major (queries contiguous) where the consumers store dSᵀ, K-major (keys contiguous) where they store
    // dS (the swapped key split); B = K, MN-major (its (d, keys) view)
    static constexpr GMMA::Major kMajorDS = kSwapKV ? GMMA::Major::K : GMMA::Major::MN;
    using TiledMmadQ = decltype(make_tiled_mma(
        GMMA::ss_op_selector<Element, Element, float, TileQ, kMajorDS, GMMA::Major::MN>(),
        Layout<Shape<Int<kWgM_dQ>, Int<2 / kWgM_dQ>, _1>>{}));
    // The swapped key split's products (warpgroups along the keys, 48 each: m64n48k16, named here because CuTe's
    // ss_op_selector offers N = 48 only with its extended shapes enabled, and picks n16 otherwise):
    //   S = Q·Kᵀ, dP = dO·Vᵀ: (queries, keys, d), both operands K-major;
    //   dVᵀ += dOᵀ·P, dKᵀ += Qᵀ·dS: (d, keys, queries), A (Qᵀ / dOᵀ views of the stages) and B (P / dS, keys
    //   contiguous) MN-major; one 64-row M block of the head dim per wgmma, kHdim / 64 (kHdimV / 64) of them.
    template <GMMA::Major kA, GMMA::Major kB>
    using MmaN48 = std::conditional_t<std::is_same_v<Element, cutlass::bfloat16_t>,
                                      SM90::GMMA::MMA_64x48x16_F32BF16BF16_SS<kA, kB>,
                                      SM90::GMMA::MMA_64x48x16_F32F16F16_SS<kA, kB>>;
    using TiledMmaSdPq = decltype(make_tiled_mma(MmaN48<GMMA::Major::K, GMMA::Major::K>{}, Layout<Shape<_1, _2, _1>>{}));
    using TiledMmadKVt = decltype(make_tiled_mma(MmaN48<GMMA::Major::MN, GMMA::Major::MN>{}, Layout<Shape<_1, _2, _1>>{}));
    static constexpr int kDqFrag = kBlockM * kHdim / NumMmaThreads;  // dQ floats per consumer thread
    static_assert(kDqFrag % 4 == 0);

    // ---- shared memory ----
    static constexpr int kSmemLimit = 232448;
    static constexpr int kQBytes = kBlockM * kHdim * int(sizeof(Element));
    static constexpr int kDOBytes = kBlockM * kHdimV * int(sizeof(Element));
    static constexpr int kKBytes = kBlockN * kHdim * int(sizeof(Element));
    static constexpr int kVBytes = kBlockN * kHdimV * int(sizeof(Element));
    static constexpr int kPdSBytes = 2 * kBlockN * kBlockM * int(sizeof(Element));  // dS(ᵀ), double-buffered
    // Pᵀ / P in shared memory: none at the key split (registers), one buffer at the swapped key split (each
    // warpgroup reads back only its own keys, after its own last product on them), two at the query split
    static constexpr int kPBytes = kKeySplit ? 0 : kSwapKV ? kPdSBytes / 2 : kPdSBytes;
    static constexpr int kDqSmemBytes = kDqViaSmem ? kBlockM * kHdim * 4 : 0;
    static constexpr int kFixedBytes =
        kKBytes + kVBytes + kPdSBytes + kPBytes + kDqSmemBytes + 2048 /* rows, barriers, slack */;
    static constexpr int kStagesQ = 2;
    static constexpr int kStagesDO = (kFixedBytes + 2 * kQBytes + 2 * kDOBytes <= kSmemLimit) ? 2 : 1;
    static_assert(kFixedBytes + kStagesQ * kQBytes + kStagesDO * kDOBytes <= kSmemLimit,
                  "tile too large for shared memory");

    // 8 rows x 128 bytes with the 128B swizzle where the head dim allows it, else 8 x 64 bytes with the 64B swizzle:
    // the head dim must be a multiple of 64 elements, and under the query split so must each warpgroup's half of it
    // (the N extent of its MN-major Qᵀ / dOᵀ operand): head dim 96, and 192 (halves of 96), take the 64B swizzle.
    // At the swapped key split the only MN-major operand split between the warpgroups is Kᵀ, dQ's B (halves of
    // kHdim): K takes its own swizzle (64B at (192, 128)), Q, dO and V the 128B one (their MN-major views, Qᵀ / dOᵀ,
    // are whole 64-row M blocks of the dKᵀ / dVᵀ products), as FlashAttention-3 lays them out for head dim 192.
    static constexpr bool kSw128 = kHdim % 64 == 0 && kHdimV % 64 == 0 &&
                                   (kKeySplit || kSwapKV || ((kHdim / kWgQ) % 64 == 0 && (kHdimV / kWgQ) % 64 == 0));
    static constexpr bool kSw128K = kSwapKV ? kSw128 && (kHdim / 2) % 64 == 0 : kSw128;
    template <bool kWide>
    using SmemAtomOf =
        std::conditional_t<kWide, GMMA::Layout_K_SW128_Atom<Element>, GMMA::Layout_K_SW64_Atom<Element>>;
    using SmemAtom = SmemAtomOf<kSw128>;
    using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, make_shape(Int<kBlockM>{}, Int<kHdim>{}, Int<kStagesQ>{})));
    using SmemLayoutDO = decltype(tile_to_shape(SmemAtom{}, make_shape(Int<kBlockM>{}, Int<kHdimV>{}, Int<kStagesDO>{})));
    // (d, queries) views of Q / dO, the B operand (MN-major) of dK / dV
    using SmemLayoutQt = decltype(composition(
        SmemLayoutQ{}, make_layout(make_shape(Int<kHdim>{}, Int<kBlockM>{}, Int<kStagesQ>{}),
                                   make_stride(Int<kBlockM>{}, _1{}, Int<kBlockM * kHdim>{}))));
    using SmemLayoutDOt = decltype(composition(
        SmemLayoutDO{}, make_layout(make_shape(Int<kHdimV>{}, Int<kBlockM>{}, Int<kStagesDO>{}),
                                    make_stride(Int<kBlockM>{}, _1{}, Int<kBlockM * kHdimV>{}))));
    using SmemLayoutK = decltype(tile_to_shape(SmemAtomOf<kSw128K>{}, make_shape(Int<kBlockN>{}, Int<kHdim>{})));
    using SmemLayoutV = decltype(tile_to_shape(SmemAtom{}, make_shape(Int<kBlockN>{}, Int<kHdimV>{})));
    using SmemLayoutKt = decltype(composition(
        SmemLayoutK{}, make_layout(make_shape(Int<kHdim>{}, Int<kBlockN>{}), make_stride(Int<kBlockN>{}, _1{}))));
    // Pᵀ / dSᵀ: (keys, queries, 2) with queries contiguous; dS: its (queries, keys, 2) view for the dQ product.
    using SmemLayoutPdStKeys = decltype(tile_to_shape(SmemAtom{}, make_shape(Int<kBlockN>{}, Int<kBlockM>{}, _2{})));
    // The swapped key split stores P / dS from (query, key) accumulators: (queries, keys, stages) with keys
    // contiguous, 32B-swizzled: rows of 16 keys, so that each warpgroup's 48 keys are whole swizzle atoms of the
    // MN-major B operand of dVᵀ / dKᵀ (its (keys, queries) view); dS is dQ's K-major A operand as it lies.
    template <int kStages>
    using SmemLayoutPdSQueries = decltype(tile_to_shape(GMMA::Layout_K_SW32_Atom<Element>{},
                                                        make_shape(Int<kBlockM>{}, Int<kBlockN>{}, Int<kStages>{})));
    template <class Rows, class Cols, int kStages, class L>  // the (cols, rows, stages) view of a (rows, cols, stages) L
    using Transposed = decltype(composition(
        L{}, make_layout(make_shape(Cols{}, Rows{}, Int<kStages>{}),
                         make_stride(Rows{}, _1{}, Int<Rows::value * Cols::value>{}))));
    using SmemLayoutPdSt =
        std::conditional_t<kSwapKV, Transposed<Int<kBlockM>, Int<kBlockN>, 2, SmemLayoutPdSQueries<2>>,
                           SmemLayoutPdStKeys>;
    using SmemLayoutPdS =
        std::conditional_t<kSwapKV, SmemLayoutPdSQueries<2>,
                           Transposed<Int<kBlockN>, Int<kBlockM>, 2, SmemLayoutPdStKeys>>;
    // P of the swapped key split, one buffer: (queries, keys, 1) and its (keys, queries, 1) view
    using SmemLayoutPq = SmemLayoutPdSQueries<1>;
    using SmemLayoutPqt = Transposed<Int<kBlockM>, Int<kBlockN>, 1, SmemLayoutPq>;

    using PipelineQ = cutlass::PipelineTmaAsync<kStagesQ>;
    using PipelineDO = cutlass::PipelineTmaAsync<kStagesDO>;
    using StateQ = typename PipelineQ::PipelineState;
    using StateDO = typename PipelineDO::PipelineState;

    template <class T, int N, int Align>
    using SmemArray = std::conditional_t<(N > 0), cute::array_aligned<T, (N > 0 ? N : 1), Align>, cute::array<T, 0>>;

    struct SharedStoragePlain {
        cute::array_aligned<Element, cosize_v<SmemLayoutK>, 1024> smem_k;
        cute::array_aligned<Element, cosize_v<SmemLayoutV>, 1024> smem_v;
        cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> smem_q;
        cute::array_aligned<Element, cosize_v<SmemLayoutDO>, 1024> smem_do;
        cute::array_aligned<Element, cosize_v<std::conditional_t<kSwapKV, SmemLayoutPdS, SmemLayoutPdSt>>, 1024> smem_ds;
        SmemArray<Element, kPBytes / int(sizeof(Element)), 1024> smem_p;
        SmemArray<float, kDqSmemBytes / 4, 128> smem_dq;
        alignas(128) float smem_lse[kStagesQ][kBlockM];
        alignas(128) float smem_dsum[kStagesDO][kBlockM];
        alignas(16) typename PipelineQ::SharedStorage pipe_q;
        alignas(16) typename PipelineDO::SharedStorage pipe_do;
        alignas(16) uint64_t bar_kv;
    };
    // Modifier instances: the elementwise-bias ring (hopper_bias_stage.hpp, loaded by TMA), kBlockM / 64 slots of 64
    // query rows x kBlockN keys per stage that both consumer warpgroups read, as many stages (up to 2) as fit beside
    // the buffers above (the storage's real size, alignment included; none: the consumers read the bias from global
    // memory). d64 / d96 / d192: 2; d128: 1 (a second 16 KB stage would fit, at exactly the limit: kBiasL1Leave);
    // d256: none.
    template <int kStages>
    using BiasOf = BiasStage<kBlockN, kBlockM / 64, kStages, NumMmaThreads>;
    template <int kStages>
    struct SharedStorageModsOf : SharedStoragePlain {
        typename BiasOf<kStages>::Storage bias;
    };
    template <int kStages, int kLeave = 0>
    static constexpr bool kBiasFits = int(sizeof(SharedStorageModsOf<kStages>)) + kLeave <= kSmemLimit;
    // (a fixed variant: only the staged-bias ones, whose calls stage it by construction)
    static constexpr bool kStageBias = kMods && BiasOf<0>::kWholeBoxes && (kGenericMods || kVarBias == 3);
    static constexpr int kBiasStages = !kStageBias ? 0 : kBiasFits<2, kBiasL1Leave> ? 2 : kBiasFits<1> ? 1 : 0;
    using Bias = BiasOf<kBiasStages>;
    using SharedStorage =
        std::conditional_t<(kBiasStages > 0), SharedStorageModsOf<kBiasStages>, SharedStoragePlain>;
    static constexpr int SharedStorageSize = int(sizeof(SharedStorage));
    static_assert(SharedStorageSize <= kSmemLimit);
    // The epilogue stages dK, then dV, in the Q and dO stages, which lie back to back.
    static_assert(offsetof(SharedStoragePlain, smem_do) ==
                  offsetof(SharedStoragePlain, smem_q) + sizeof(SharedStoragePlain::smem_q));
    using Epilogue = BwdEpilogue<Element, kBlockN>;
    static_assert(Epilogue::template kStageElems<kHdim> <= cosize_v<SmemLayoutQ> + cosize_v<SmemLayoutDO> &&
                  Epilogue::template kStageElems<kHdimV> <= cosize_v<SmemLayoutQ> + cosize_v<SmemLayoutDO>);

    // ---- TMA ----
    template <class SLayout>
    using TmaFor = decltype(make_tma_copy(
        SM90_TMA_LOAD{},
        make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), BwdGmemShape{}, BwdGmemStride{}),
        SLayout{}));
    using SmemLayoutQ1 = decltype(SmemLayoutQ{}(_, _, _0{}));
    using SmemLayoutDO1 = decltype(SmemLayoutDO{}(_, _, _0{}));
    using TmaQ = TmaFor<SmemLayoutQ1>;
    using TmaDO = TmaFor<SmemLayoutDO1>;
    using TmaK = TmaFor<SmemLayoutK>;
    using TmaV = TmaFor<SmemLayoutV>;

    static constexpr int MaxThreadsPerBlock = 128 + NumMmaThreads;
    static constexpr int MinBlocksPerMultiprocessor = 1;
    static constexpr uint32_t kLoadRegs = 24;
    static constexpr uint32_t kMmaRegs = 240;

    // Named barriers (CUTLASS adds its reserved offset).
    static constexpr uint32_t kBarDS = 0;       // 256 consumers: dSᵀ (and Pᵀ) of both warpgroups in smem
    static constexpr uint32_t kBarDqFull = 1;   // + wg: 128 consumers arrive, writer warp syncs
    static constexpr uint32_t kBarDqEmpty = 3;  // + wg: writer warp arrives, 128 consumers sync
    static constexpr uint32_t kBarP = 5;        // + wg (swapped key split): the warpgroup's P slice in smem
    // Query split, deterministic mode (dq_turn_keeper): 256 consumers + the keeper warp on each
    static constexpr uint32_t kBarDqTurn = 1;   // keeper arrives (the tile's turn has come), consumers sync
    static constexpr uint32_t kBarDqAdded = 2;  // consumers arrive (their adds are issued), keeper syncs
    static_assert(kDqViaSmem || (kBarDqTurn != kBarDS && kBarDqAdded != kBarDS));

    // kMods: the call's modifiers and dbias first; kSplit: the split's fields (bwd::BwdSplitParams); plain: nothing
    struct Params : BwdModParams<kMods>, bwd::BwdSplitParams<kSplit> {
        TmaQ tma_q;
        TmaDO tma_do;
        TmaK tma_k;
        TmaV tma_v;
        int batch, nhead_q, nhead_k, group;
        // As the TMA descriptors see the tensors: group mode: the packed row counts, in one batch (tma_batch 1).
        int seqlen_q, seqlen_k, tma_batch, hdim, hdim_v;
        int mask_x, mask_y;  // batch mode (clamped on the host)
        const int32_t* seqstart_q;  // group mode: [batch + 1] row offsets into the packed tensors
        const int32_t* seqstart_k;
        int mask_type, window_left, window_right;  // group mode: each sequence's mask is made on the device
        float scale, scale_log2;
        float const* lse2;  // workspace
        float const* dsum;
        float* dq_acc;
        int64_t sq_pad;
        int m_tiles;
        int32_t* dq_turn;    // workspace: turn counters [b][hq][m_tiles] (deterministic mode)
        bool deterministic;  // dQ tiles added in a fixed order of key blocks
        int det_group;       // deterministic query split: (kv head, batch) pairs interleaved per group of the 1-D
                             // grid (Scheduler::work_interleaved); 0: the 3-D grid
        int key_blocks;      // the grid's key blocks per (kv head, batch)
        Element* dk;
        int64_t dk_row, dk_head, dk_batch;
        Element* dv;
        int64_t dv_row, dv_head, dv_batch;
    };

    using Sequence = HopperSequence;
    CUTLASS_DEVICE static Sequence sequence(Params const& params, int b) {
        if constexpr (kGroup) {
            return packed_sequence<kMasked>(params.seqstart_q, params.seqstart_k, b, params.mask_type,
                                            params.window_left, params.window_right);
        } else {
            return Sequence{0, 0, params.seqlen_q, params.seqlen_k, MaskCoord{params.mask_y, params.mask_x}};
        }
    }

    // ------------------------------------------------------------------------------------------------------------
    CUTLASS_DEVICE void operator()(Params const& params, char* smem) {
#if defined(CUTLASS_ARCH_MMA_SM90A_ENABLED)
        const auto work = params.det_group > 0
                              ? Scheduler::work_interleaved(params.key_blocks, grid_heads(params), params.det_group)
                              : Scheduler::work(/*reverse=*/params.deterministic);
        // the grid's head: the kv head, or at the split kv head x splits + the CTA's share (sp) of its query heads
        const int n_block = work.block, b = work.batch;
        const int hk = kSplit ? work.head / split_count(params) : work.head;
        const int sp = kSplit ? work.head - hk * split_count(params) : 0;
        const Sequence seq = sequence(params, b);
        if (n_block * kBlockN >= seq.sk) return;  // group mode: past this sequence's last key (the whole CTA)

        auto& st = *reinterpret_cast<SharedStorage*>(smem);
        const int warp_idx = cutlass::canonical_warp_idx_sync();
        const int wg_idx = cutlass::canonical_warp_group_idx();
        const int warp_in_wg = warp_idx % 4;
        const int lane_predicate = cute::elect_one_sync();

        if (warp_idx == 0 && lane_predicate) {
            cute::prefetch_tma_descriptor(params.tma_q.get_tma_descriptor());
            cute::prefetch_tma_descriptor(params.tma_do.get_tma_descriptor());
            cute::prefetch_tma_descriptor(params.tma_k.get_tma_descriptor());
            cute::prefetch_tma_descriptor(params.tma_v.get_tma_descriptor());
            cutlass::arch::ClusterTransactionBarrier::init(&st.bar_kv, 1);
            if constexpr (kBiasStages > 0) {
                Bias::init(st.bias);
                if (bias_stageable(params.mods)) cute::prefetch_tma_descriptor(&params.bias_map);
            }
        }

        const bool producer_warp = (wg_idx == 0 && warp_in_wg == 0);
        typename PipelineQ::Params pq;
        pq.transaction_bytes = kQBytes + kBlockM * 4;
        pq.is_leader = producer_warp && lane_predicate;
        pq.num_consumers = NumMmaThreads;
        typename PipelineDO::Params pdo;
        pdo.transaction_bytes = kDOBytes + kBlockM * 4;
        pdo.is_leader = producer_warp && lane_predicate;
        pdo.num_consumers = NumMmaThreads;
        if (producer_warp) {
            pq.role = PipelineQ::ThreadCategory::Producer;
            pdo.role = PipelineDO::ThreadCategory::Producer;
        } else if (wg_idx > 0) {
            pq.role = PipelineQ::ThreadCategory::Consumer;
            pdo.role = PipelineDO::ThreadCategory::Consumer;
        }
        PipelineQ pipe_q(st.pipe_q, pq, Shape<_1, _1, _1>{});
        PipelineDO pipe_do(st.pipe_do, pdo, Shape<_1, _1, _1>{});
        cutlass::arch::fence_barrier_init();
        __syncthreads();

        const Geometry geom = geometry(seq);
        const TileRange range = query_range(geom, n_block);
        const int n_m = range.empty() ? 0 : range.end - range.begin;
        const int n_iters = n_m * cta_heads(params);

        if (wg_idx == 0) {
            cutlass::arch::warpgroup_reg_dealloc<kLoadRegs>();
            if (warp_in_wg == 0) {
                producer(params, st, pipe_q, pipe_do, seq, n_block, hk, sp, b, range.begin, n_m, n_iters);
            } else if (warp_in_wg == 1) {
                if constexpr (kDqViaSmem) {
                    dq_writer(params, st, geom, n_block, hk, sp, b, range.begin, n_m, n_iters);
                } else {
                    if (params.deterministic)
                        dq_turn_keeper(params, geom, n_block, hk, sp, b, range.begin, n_m, n_iters);
                }
            } else if (warp_in_wg == 2) {
                if constexpr (kBiasStages > 0)
                    bias_loader(params, st, seq, n_block, hk, sp, b, range.begin, n_m, n_iters);
            }
        } else {
            cutlass::arch::warpgroup_reg_alloc<kMmaRegs>();
            if constexpr (kSwapKV) {
                consumer_swapped(params, st, pipe_q, pipe_do, seq, n_block, hk, sp, b, range.begin, n_m, n_iters,
                                 wg_idx - 1);
            } else {
                consumer(params, st, pipe_q, pipe_do, seq, n_block, hk, sp, b, range.begin, n_m, n_iters, wg_idx - 1);
            }
        }
#endif
    }

    // x, y clamped (x in [-sq, sk], y in [-sk, sq]): on the host in batch mode, in sequence() in group mode.
    CUTLASS_DEVICE static Geometry geometry(Sequence const& seq) {
        return Geometry::from_coord(seq.mask, seq.sq, seq.sk);
    }

    // The query heads of a CTA: its kv head's group (hk x group on), or at the split share sp of it (split_heads each).
    // The split's fields are read only by the split kernel (kSplit), so the unsplit kernels' code stays as it was.
    CUTLASS_DEVICE static int split_count(Params const& params) {
        if constexpr (kSplit) return params.splits; else return 1;
    }
    CUTLASS_DEVICE static int cta_heads(Params const& params) {
        if constexpr (kSplit) return params.split_heads; else return params.group;
    }
    CUTLASS_DEVICE static int first_head(Params const& params, int hk, int sp) {
        if constexpr (kSplit) return hk * params.group + sp * params.split_heads; else return hk * params.group;
    }
    CUTLASS_DEVICE static int grid_heads(Params const& params) {  // the grid's heads (Scheduler's pairs)
        if constexpr (kSplit) return params.nhead_k * params.splits; else return params.nhead_k;
    }

    // The query tiles that key block n (< the sequence's key blocks) visits.
    CUTLASS_DEVICE static TileRange query_range(Geometry const& geom, int n) {
        return bwd::key_block_query_tiles<kBlockM, kBlockN>(geom, n);
    }

    // Deterministic mode: key block n's turn at each query tile it visits, tile after tile. The key blocks whose
    // ranges hold tile m are one run [lo, hi] (a range's begin grows with the key block, and the blocks that no query
    // sees come last) taking turns from hi down, so n's turn is hi - n; hi grows with m, so one running hi serves a
    // query head's ascending tiles (a few integer steps per tile, off the tensor cores' path).
    struct DqTurns {
        Geometry const& geom;
        int n, blocks, hi;
        CUTLASS_DEVICE DqTurns(Geometry const& g, int n_block)
            : geom(g), n(n_block), blocks((g.sk + kBlockN - 1) / kBlockN), hi(n_block) {}
        CUTLASS_DEVICE void restart() { hi = n; }  // the next query head: its tiles start over
        CUTLASS_DEVICE int turn(int m) {
            while (hi + 1 < blocks) {
                const TileRange r = query_range(geom, hi + 1);
                if (r.empty() || r.begin > m) break;
                ++hi;
            }
            return hi - n;
        }
    };
    CUTLASS_DEVICE static int32_t* turn_counter(Params const& params, int b, int h, int m) {
        return params.dq_turn + (int64_t(b) * params.nhead_q + h) * params.m_tiles + m;
    }

    // ------------------------------------------------------------------------------------------------------------
    CUTLASS_DEVICE void producer(Params const& params, SharedStorage& st, PipelineQ& pipe_q, PipelineDO& pipe_do,
                                 Sequence const& seq, int n_block, int hk, int sp, int b, int m_begin, int n_m,
                                 int n_iters) {
        if (n_iters == 0) return;
        if (!cute::elect_one_sync()) return;

        // (rows, d, head, batch) as TMA sees them; this sequence starts at row q0 / k0 of batch tb.
        const int tb = kGroup ? 0 : b;
        auto qshape = make_shape(params.seqlen_q, params.hdim, params.nhead_q, params.tma_batch);
        auto doshape = make_shape(params.seqlen_q, params.hdim_v, params.nhead_q, params.tma_batch);
        auto kshape = make_shape(params.seqlen_k, params.hdim, params.nhead_k, params.tma_batch);
        auto vshape = make_shape(params.seqlen_k, params.hdim_v, params.nhead_k, params.tma_batch);
        Tensor mQ = domain_offset(make_coord(seq.q0, _0{}, _0{}, _0{}), params.tma_q.get_tma_tensor(qshape));
        Tensor mDO = domain_offset(make_coord(seq.q0, _0{}, _0{}, _0{}), params.tma_do.get_tma_tensor(doshape));
        Tensor mK = domain_offset(make_coord(seq.k0, _0{}, _0{}, _0{}), params.tma_k.get_tma_tensor(kshape));
        Tensor mV = domain_offset(make_coord(seq.k0, _0{}, _0{}, _0{}), params.tma_v.get_tma_tensor(vshape));

        Tensor sQ = make_tensor(make_smem_ptr(st.smem_q.data()), SmemLayoutQ{});
        Tensor sDO = make_tensor(make_smem_ptr(st.smem_do.data()), SmemLayoutDO{});
        Tensor sK = make_tensor(make_smem_ptr(st.smem_k.data()), SmemLayoutK{});
        Tensor sV = make_tensor(make_smem_ptr(st.smem_v.data()), SmemLayoutV{});

        // K, V: one barrier, both tiles
        {
            Tensor gK = local_tile(mK(_, _, hk, tb), Shape<Int<kBlockN>, Int<kHdim>>{}, make_coord(n_block, _0{}));
            Tensor gV = local_tile(mV(_, _, hk, tb), Shape<Int<kBlockN>, Int<kHdimV>>{}, make_coord(n_block, _0{}));
            Tensor sK1 = make_tensor(sK.data(), make_layout(sK.layout(), Layout<_1>{}));
            Tensor sV1 = make_tensor(sV.data(), make_layout(sV.layout(), Layout<_1>{}));
            Tensor gK1 = make_tensor(gK.data(), make_layout(gK.layout(), Layout<_1>{}));
            Tensor gV1 = make_tensor(gV.data(), make_layout(gV.layout(), Layout<_1>{}));
            auto [tKg, tKs] = tma_partition(params.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK1), group_modes<0, 2>(gK1));
            auto [tVg, tVs] = tma_partition(params.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV1), group_modes<0, 2>(gV1));
            cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&st.bar_kv, kKBytes + kVBytes);
            copy(params.tma_k.with(st.bar_kv), tKg, tKs);
            copy(params.tma_v.with(st.bar_kv), tVg, tVs);
        }

        using TileQD = Shape<Int<kBlockM>, Int<kHdim>>;
        using TileDOD = Shape<Int<kBlockM>, Int<kHdimV>>;
        StateQ wq = cutlass::make_producer_start_state<PipelineQ>();
        StateDO wdo = cutlass::make_producer_start_state<PipelineDO>();
        int h_in = 0;
        int m = m_begin;
        CUTLASS_PRAGMA_NO_UNROLL
        for (int it = 0; it < n_iters; ++it) {
            const int h = first_head(params, hk, sp) + h_in;
            const int64_t row_ws = (int64_t(b) * params.nhead_q + h) * params.sq_pad + int64_t(m) * kBlockM;
            {
                Tensor gQ = local_tile(mQ(_, _, h, tb), TileQD{}, make_coord(m, _0{}));
                Tensor gQ1 = make_tensor(gQ.data(), make_layout(gQ.layout(), Layout<_1>{}));
                auto [tQg, tQs] = tma_partition(params.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ1));
                pipe_q.producer_acquire(wq);
                uint64_t* bar = pipe_q.producer_get_barrier(wq);
                copy(params.tma_q.with(*bar), tQg, tQs(_, wq.index()));
                bwd::bulk_load(&st.smem_lse[wq.index()][0], params.lse2 + row_ws, kBlockM * 4, bar);
                ++wq;
            }
            {
                Tensor gDO = local_tile(mDO(_, _, h, tb), TileDOD{}, make_coord(m, _0{}));
                Tensor gDO1 = make_tensor(gDO.data(), make_layout(gDO.layout(), Layout<_1>{}));
                auto [tDg, tDs] = tma_partition(params.tma_do, _0{}, Layout<_1>{}, group_modes<0, 2>(sDO), group_modes<0, 2>(gDO1));
                pipe_do.producer_acquire(wdo);
                uint64_t* bar = pipe_do.producer_get_barrier(wdo);
                copy(params.tma_do.with(*bar), tDg, tDs(_, wdo.index()));
                bwd::bulk_load(&st.smem_dsum[wdo.index()][0], params.dsum + row_ws, kBlockM * 4, bar);
                ++wdo;
            }
            if (++m == m_begin + n_m) {
                m = m_begin;
                ++h_in;
            }
        }
    }

    // ------------------------------------------------------------------------------------------------------------
    // Whether the call's elementwise bias comes staged from the bias warp's ring: a stageable layout (bias_stageable,
    // hopper_bias_stage.hpp: the whole call's, so the bias warp and the consumers of every CTA agree), whose tensor
    // map the launcher made (or refused the call).
    CUTLASS_DEVICE static bool bias_staged(Params const& params) {
        if constexpr (kBiasStages > 0)
            return kFixedVar || (per_score_mods(params.mods) && bias_stageable(params.mods));
        else
            return false;
    }

    // The bias warp (warp 2 of the producer warpgroup): the bias tile (the query tile's rows x this key block) of
    // every iteration into the ring by TMA, in the producer's order (query heads of the kv group, their query tiles).
    CUTLASS_DEVICE void bias_loader(Params const& params, SharedStorage& st, Sequence const& seq, int n_block, int hk,
                                    int sp, int b, int m_begin, int n_m, int n_iters) {
        if (!bias_staged(params)) return;
        int h_in = 0;
        int m = m_begin;
        for (int it = 0; it < n_iters; ++it) {
            Bias::template load<kGroup>(st.bias, &params.bias_map, params.mods, b, first_head(params, hk, sp) + h_in, it,
                                        m * kBlockM, n_block * kBlockN, seq.sq, seq.sk);
            if (++m == m_begin + n_m) {
                m = m_begin;
                ++h_in;
            }
        }
    }

    // ------------------------------------------------------------------------------------------------------------
    CUTLASS_DEVICE void dq_writer(Params const& params, SharedStorage& st, Geometry const& geom, int n_block, int hk,
                                  int sp, int b, int m_begin, int n_m, int n_iters) {
        using cutlass::arch::NamedBarrier;
        const bool leader = cute::elect_one_sync();
        constexpr uint32_t kWgBytes = uint32_t(kDqFrag) * 128u * 4u;
        DqTurns turns(geom, n_block);
        int h_in = 0;
        int m = m_begin;
        CUTLASS_PRAGMA_NO_UNROLL
        for (int it = 0; it < n_iters; ++it) {
            const int h = first_head(params, hk, sp) + h_in;
            float* tile = params.dq_acc +
                          ((int64_t(b) * params.nhead_q + h) * params.m_tiles + m) * int64_t(kBlockM * kHdim);
            // deterministic: wait for this key block's turn while the consumers still compute the tile
            if (params.deterministic && leader) bwd::turn_wait(turn_counter(params, b, h, m), turns.turn(m));
            CUTLASS_PRAGMA_UNROLL
            for (int w = 0; w < NumMmaWG; ++w) {
                NamedBarrier::sync(128 + 32, kBarDqFull + w);
                if (leader) {
                    bwd::bulk_reduce_add_f32(tile + w * kDqFrag * 128, st.smem_dq.data() + w * kDqFrag * 128, kWgBytes);
                    bwd::bulk_commit();
                }
            }
            if (leader) {
                if (params.deterministic) {
                    bwd::bulk_wait<0>();  // the adds are complete (not only read) before the turn passes on
                    bwd::turn_pass(turn_counter(params, b, h, m));
                } else {
                    bwd::bulk_wait_read<0>();
                }
            }
            __syncwarp();
            if (it + 1 < n_iters) {
                CUTLASS_PRAGMA_UNROLL
                for (int w = 0; w < NumMmaWG; ++w) NamedBarrier::arrive(128 + 32, kBarDqEmpty + w);
            }
            if (++m == m_begin + n_m) {
                m = m_begin;
                ++h_in;
                turns.restart();
            }
        }
        if (leader) bwd::bulk_wait<0>();
    }

    // ------------------------------------------------------------------------------------------------------------
    // Query split, deterministic mode: the dQ adds stay with the consumers (16-byte fp32 reductions straight from
    // their registers: no shared memory is left for a dQ tile), the turns go to this warp (warp 1 of the producer
    // warpgroup), so that no consumer thread waits for a turn to come round or for its adds to complete. Per tile:
    // wait for this key block's turn (acquire), let the consumers add (kBarDqTurn), wait until every consumer has
    // issued its adds (kBarDqAdded), then pass the turn on (turn_pass: a release at gpu scope, whose fence waits
    // until the adds that the barrier ordered before it are performed: the consumers' reductions, as in the
    // bar.sync + one thread's release pattern of cooperative groups' grid sync). The consumers meanwhile compute the
    // next tile; they wait only when its turn has not come by the time its dQ is ready.
    CUTLASS_DEVICE void dq_turn_keeper(Params const& params, Geometry const& geom, int n_block, int hk, int sp, int b,
                                       int m_begin, int n_m, int n_iters) {
        using cutlass::arch::NamedBarrier;
        const bool leader = cute::elect_one_sync();
        DqTurns turns(geom, n_block);
        int h_in = 0;
        int m = m_begin;
        CUTLASS_PRAGMA_NO_UNROLL
        for (int it = 0; it < n_iters; ++it) {
            int32_t* counter = turn_counter(params, b, first_head(params, hk, sp) + h_in, m);
            if (leader) bwd::turn_wait(counter, turns.turn(m));
            __syncwarp();
            NamedBarrier::arrive(NumMmaThreads + 32, kBarDqTurn);
            NamedBarrier::sync(NumMmaThreads + 32, kBarDqAdded);
            if (leader) bwd::turn_pass(counter);
            __syncwarp();
            if (++m == m_begin + n_m) {
                m = m_begin;
                ++h_in;
                turns.restart();
            }
        }
    }

    // ------------------------------------------------------------------------------------------------------------
    // A consumer warpgroup's dQ tile (its kDqFrag floats per thread, fragment order) into the shared tile, once the
    // dQ writer warp has emptied it; the writer adds it into the workspace (dq_writer). t: the thread in the
    // warpgroup.
    template <class TensorDq>
    CUTLASS_DEVICE static void dq_to_smem(SharedStorage& st, TensorDq const& acc_dQ, int wg, int t) {
        using cutlass::arch::NamedBarrier;
        NamedBarrier::sync(128 + 32, kBarDqEmpty + wg);
        float4* dst = reinterpret_cast<float4*>(st.smem_dq.data() + wg * kDqFrag * 128) + t;
        CUTLASS_PRAGMA_UNROLL
        for (int v = 0; v < kDqFrag / 4; ++v) {
            dst[v * 128] = make_float4(acc_dQ(4 * v), acc_dQ(4 * v + 1), acc_dQ(4 * v + 2), acc_dQ(4 * v + 3));
        }
        cutlass::arch::fence_view_async_shared();
        NamedBarrier::arrive(128 + 32, kBarDqFull + wg);
    }

    // ------------------------------------------------------------------------------------------------------------
    // A fixed ALiBi variant (BwdModVar): the query head's slope. Batch mode: the consumers load it once per query
    // head and hold it across its tiles (kHoldSlope; the generic kernel loads it per tile, in row_mods). Group mode
    // loads it per tile (an L1 hit): there the sequence's lengths hold registers across the loop already, and the
    // held slope tipped the d128 causal consumers into spilling (4 / 8 bytes, 2 LDL per tile).
    static constexpr bool kHoldSlope = kVarBias == 2 && !kGroup;
    CUTLASS_DEVICE static float alibi_slope(Params const& params, int b, int h) {
        if constexpr (kVarBias == 2) {
            ScoreMods const& m = params.mods;
            const int64_t off = int64_t(b) * m.bias_batch_stride + int64_t(h) * m.bias_head_stride;
            return static_cast<float const*>(m.bias)[off];
        } else {
            return 0.f;
        }
    }

    // A fixed variant's modifiers on one part of Sᵀ (raw q·k -> logits in place, dcap the soft-cap's derivative, as
    // apply_score_mods_t), the variant's tile function called directly: its RowMods from the parameters and the
    // slope (no branch); a staged bias from the bias warp's slot (kBlockM = 64: one per tile), in group mode from
    // global memory where the slot reaches past the sequence (Bias::staged_slot).
    template <class TensorS, class TensorC, class Dcap>
    CUTLASS_DEVICE void fixed_score_mods(Params const& params, SharedStorage& st, Sequence const& seq, TensorS& acc_S,
                                         TensorC const& cS, float slope, int b, int h, int part, bool last_part,
                                         int it, int r0, int n0, Dcap& dcap) {
        static_assert(kFixedVar);
        if constexpr (kVarCap || kVarBias != 0) {
            ScoreMods const& m = params.mods;
            RowMods r{};
            r.scale = m.scale;
            r.softcap = m.softcap;
            r.softcap_arg = m.softcap_arg;
            r.slope = kHoldSlope ? slope : alibi_slope(params, b, h);
            r.seqlen_q = seq.sq;
            r.seqlen_k = seq.sk;
            if constexpr (kVarBias == 3) {
                static_assert(kBlockM == 64 && kBiasStages > 0, "a staged bias: one slot of 64 rows per tile");
                char const* tile = Bias::acquire(st.bias, 0, it);  // (a later part: at once)
                if (Bias::template staged_slot<kGroup>(r0, n0, seq.sq, seq.sk)) {
                    // the thread's coordinates from %tid.x read here (volatile), as in the generic kernel: made
                    // before the loop, the shared-memory address would hold a register across it
                    unsigned tid_now;
                    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid_now));
                    TiledMmaSdP mma_sdp;
                    Tensor cS_now = mma_sdp.get_thread_slice(int(tid_now) - 128).partition_C(
                        make_identity_tensor(Shape<Int<kBlockN>, Int<kBlockM>>{}))(_, part, _);
                    detail::score_mods_tile_t<kVarCap, 3, Element, Bias>(acc_S, cS_now, r, 0, 0, dcap, tile);
                } else {
                    r.bias = static_cast<char const*>(m.bias) +
                             (int64_t(b) * m.bias_batch_stride + int64_t(h) * m.bias_head_stride) * 2;
                    r.bias_row_bytes = m.bias_row_stride * 2;
                    detail::score_mods_tile_t<kVarCap, 1, Element>(acc_S, cS, r, r0, n0, dcap);
                }
                if (last_part) Bias::release(st.bias, 0, it);
            } else {
                detail::score_mods_tile_t<kVarCap, kVarBias, float>(acc_S, cS, r, r0, n0, dcap);
            }
        }
    }

    // ------------------------------------------------------------------------------------------------------------
    CUTLASS_DEVICE void consumer(Params const& params, SharedStorage& st, PipelineQ& pipe_q, PipelineDO& pipe_do,
                                 Sequence const& seq, int n_block, int hk, int sp, int b, int m_begin, int n_m,
                                 int n_iters, int wg) {
        using cutlass::arch::NamedBarrier;
        using namespace cutlass::fmha::collective;

        const int tid = int(threadIdx.x) - 128;  // [0, 256)
        const int sk = seq.sk;
        const int xr = seq.mask.x;
        const int yr = seq.mask.y;
        const Geometry geom = geometry(seq);
        // Modifier instances with a per-score modifier: logits in place of q·k, so Pᵀ's scale is 1 (log2 e in exp2
        // units); without one (a sink alone) Sᵀ stays q·k with the plain scale, as in the plain kernel
        bool logits = kVarCap || kVarBias != 0;
        if constexpr (kGenericMods) logits = per_score_mods(params.mods);
        // Dropout (the generic modifier kernel; hopper_dropout.hpp): the forward's random bytes of each Sᵀ tile,
        // regenerated
        bool dropping = false;
        if constexpr (kGenericMods) dropping = params.mods.dropout.on;
        const float scale_log2 = logits ? 1.4426950408889634f : params.scale_log2;
        // The block's first key. No-mask instances read it again per tile and for the epilogue (Scheduler::block_now)
        // instead of holding it through the loop: with the run-time reversal of deterministic mode n_block is a select that ptxas does not
        // recompute the way it recomputes a plain %ctaid.x, and that one live register tipped the key split's consumers
        // (at the edge of 240 registers) into spilling every tile (d128: 28 STL + 37 LDL per tile, a 168-byte stack;
        // before the deterministic mode, and with this: 17 LDL, no STL, 136 bytes). Masked instances hold it: there
        // the re-read turns the per-element mask into branches (+105 instructions per tile) and saves little (d128
        // causal: 4 LDL + 4 STL per tile held, 7 + 1 re-read). The query split holds it too: its consumers have
        // registers to spare (no stack either way), and its deterministic grid may be the 1-D interleaved one.
        const int n0_held = n_block * kBlockN;
        const auto key0 = [&params, n0_held] {
            if constexpr (kMasked || !kKeySplit) {
                return n0_held;
            } else {
                return Scheduler::block_now(/*reverse=*/params.deterministic) * kBlockN;
            }
        };

        TiledMmaSdP mma_sdp;
        TiledMmadKV mma_dkv;
        TiledMmadV mma_dv;
        TiledMmadQ mma_dq;
        auto thr_sdp = mma_sdp.get_thread_slice(tid);
        auto thr_dkv = mma_dkv.get_thread_slice(tid);
        auto thr_dv = mma_dv.get_thread_slice(tid);
        auto thr_dq = mma_dq.get_thread_slice(tid);

        Tensor sQ = make_tensor(make_smem_ptr(st.smem_q.data()), SmemLayoutQ{});
        Tensor sQt = make_tensor(make_smem_ptr(st.smem_q.data()), SmemLayoutQt{});
        Tensor sDO = make_tensor(make_smem_ptr(st.smem_do.data()), SmemLayoutDO{});
        Tensor sDOt = make_tensor(make_smem_ptr(st.smem_do.data()), SmemLayoutDOt{});
        Tensor sK = make_tensor(make_smem_ptr(st.smem_k.data()), SmemLayoutK{});
        Tensor sKt = make_tensor(make_smem_ptr(st.smem_k.data()), SmemLayoutKt{});
        Tensor sV = make_tensor(make_smem_ptr(st.smem_v.data()), SmemLayoutV{});
        Tensor sDSt = make_tensor(make_smem_ptr(st.smem_ds.data()), SmemLayoutPdSt{});
        Tensor sDS = make_tensor(make_smem_ptr(st.smem_ds.data()), SmemLayoutPdS{});

        // Sᵀ and dPᵀ go in parts of kPartN keys, one 64-key MMA atom per warpgroup: the key split has one part; a
        // query split of 128 keys runs two, one after the other, so that only one part's accumulators are live
        // beside its 128 x (kHdim + kHdimV) / 2 of dK and dV (both parts at once: 224 registers of accumulators, and
        // ptxas serialised every wgmma of the kernel).
        constexpr int kPartN = 64 * kWgN;
        constexpr int kParts = kBlockN / kPartN;
        using PartTile = Shape<Int<kPartN>, Int<kBlockM>>;
        Tensor tSrK = thr_sdp.partition_fragment_A(sK);    // (MMA, M, K)
        Tensor tSrQ = thr_sdp.partition_fragment_B(sQ);    // (MMA, N, K, stages)
        Tensor tdPrV = thr_sdp.partition_fragment_A(sV);
        Tensor tdPrDO = thr_sdp.partition_fragment_B(sDO);
        Tensor tdVrDO = thr_dv.partition_fragment_B(sDOt);   // (MMA, N, K, stages)
        Tensor tdKrQ = thr_dkv.partition_fragment_B(sQt);
        Tensor tdQrDS = thr_dq.partition_fragment_A(sDS);    // (MMA, M, K, 2)
        Tensor tdQrK = thr_dq.partition_fragment_B(sKt);

        Tensor acc_dK = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHdim>>{});
        Tensor acc_dV = partition_fragment_C(mma_dv, Shape<Int<kBlockN>, Int<kHdimV>>{});
        clear(acc_dK);
        clear(acc_dV);

        // (key, query) coordinate of each Sᵀ accumulator element, (MMA, part, N): part j's are cS_all(_, j, _)
        Tensor cS_all = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kBlockM>>{}));
        static_assert(decltype(size<1>(cS_all))::value == kParts);
        constexpr int kSFrag = decltype(size(cS_all))::value / kParts;  // one part's

        if (n_iters > 0) {
            if constexpr (kDqViaSmem) {
                if (tid % 128 < 32) NamedBarrier::arrive(128 + 32, kBarDqEmpty + wg);  // the dQ tile starts empty
            }
            cutlass::arch::ClusterBarrier::wait(&st.bar_kv, 0);
        }

        StateQ rq;
        StateDO rdo;
        int h_in = 0;
        int m = m_begin;
        int ds_stage = 0;
        float alibi = kHoldSlope ? alibi_slope(params, b, first_head(params, hk, sp)) : 0.f;  // (kHoldSlope)

        CUTLASS_PRAGMA_NO_UNROLL
        for (int it = 0; it < n_iters; ++it) {
            const int h = first_head(params, hk, sp) + h_in;
            const int r0 = m * kBlockM;
            // Rows past sq count as rows here: their LSE is +inf in the workspace, so their P is 0 anyway.
            const int n0 = key0();
            const bool need_mask = !geom.template tile_full<kBlockN>(r0, r0 + kBlockM - 1, n0);

            // The A operands of dV / dK: registers in the key split (its one part), shared memory in the query split.
            auto a_layout = [&] {  // key split: the A-operand view of the accumulator registers; else plain C layout
                using AccLayout = decltype(partition_fragment_C(mma_sdp, PartTile{}).layout());
                if constexpr (kKeySplit) {
                    return convert_c_layout_to_a_layout(AccLayout{}, shape<1>(typename TiledMmadKV::LayoutA_TV{}));
                } else {
                    return AccLayout{};
                }
            }();
            Tensor rP = make_tensor<Element>(a_layout);
            Tensor rdS = make_tensor<Element>(a_layout);
            static_assert(decltype(size(rP))::value == kSFrag);

            CUTLASS_PRAGMA_UNROLL
            for (int part = 0; part < kParts; ++part) {
                Tensor cS = cS_all(_, part, _);  // coordinates in the whole (kBlockN, kBlockM) tile
                Tensor acc_S = partition_fragment_C(mma_sdp, PartTile{});
                Tensor acc_dP = partition_fragment_C(mma_sdp, PartTile{});
                // The A operand of Sᵀ / dPᵀ: this part's keys of K or V in shared memory (one part: all of them)
                auto part_a = [&](auto const& s, auto const& whole) -> decltype(auto) {
                    if constexpr (kParts == 1) {
                        return (whole);
                    } else {
                        return thr_sdp.partition_fragment_A(
                            local_tile(s, Shape<Int<kPartN>, Int<decltype(size<1>(s))::value>>{}, make_coord(part, _0{})));
                    }
                };

                // The Q / dO stages, opaque to the compiler from the second part on (unmasked instances): their GMMA
                // descriptors (two registers per 16-column k-block) are made again for each part instead of living
                // across part 0's math. ptxas, (192, 128) b64x128: non-causal 83 -> 39 local loads / stores in the
                // loop (216 -> 112 bytes of spill stores); the causal instance went 40 -> 50, so it holds them.
                int q_stage = rq.index(), do_stage = rdo.index();
                if constexpr (kParts > 1 && !kMasked) {
                    if (part > 0) asm volatile("" : "+r"(q_stage), "+r"(do_stage));
                }

                // ---- Sᵀ = K Qᵀ, dPᵀ = V dOᵀ ----
                if (part == 0) pipe_q.consumer_wait(rq);
                warpgroup_fence_operand(acc_S);
                warpgroup_arrive();
                gemm_zero_acc(mma_sdp, part_a(sK, tSrK), tSrQ(_, _, _, q_stage), acc_S);
                warpgroup_commit_batch();
                if (part == 0) pipe_do.consumer_wait(rdo);
                warpgroup_fence_operand(acc_dP);
                warpgroup_arrive();
                gemm_zero_acc(mma_sdp, part_a(sV, tdPrV), tdPrDO(_, _, _, do_stage), acc_dP);
                warpgroup_commit_batch();
                [[maybe_unused]] uint2 rnd[1][kGenericMods ? kSFrag / 8 : 1];  // drawn while the two products run
                if constexpr (kGenericMods) {
                    if (dropping) drop_bytes_t(rnd, cS, params.mods.dropout, uint32_t(b * params.nhead_q + h), n0, r0);
                }

                // ---- Pᵀ ----
                warpgroup_wait<1>();
                warpgroup_fence_operand(acc_S);
                // Modifier instances: logits (a fixed variant: its tile function, no branch); dcap keeps the
                // soft-cap's derivative (packed fp16) for dSᵀ
                [[maybe_unused]] uint32_t dcap[kGenericMods || kVarCap ? kSFrag / 2 : 1];
                [[maybe_unused]] bool cap = false;
                if constexpr (kFixedVar) {
                    fixed_score_mods(params, st, seq, acc_S, cS, alibi, b, h, part, part == kParts - 1, it, r0, n0,
                                     dcap);
                } else if constexpr (kMods) {
                    if (logits) {
                        const RowMods rm = row_mods(params.mods, b, h, seq.sq, sk);
                        bool done = false;  // the bias warp's tile applied (else: from global memory below)
                        if constexpr (kBiasStages > 0) {
                            if (bias_staged(params)) {  // the bias warp's tile: the stage's slots back to back
                                char const* tile = nullptr;
                                CUTLASS_PRAGMA_UNROLL
                                for (int k = 0; k < kBlockM / 64; ++k) {
                                    char const* slot = Bias::acquire(st.bias, k, it);  // (a later part: at once)
                                    if (k == 0) tile = slot;
                                }
                                // group mode: a slot reaching past the sequence is left empty (Bias::staged_slot),
                                // its tile read from global memory below (one call site of that path)
                                if (Bias::template staged_slot<kGroup>(r0 + kBlockM - 64, n0, seq.sq, sk)) {
                                    // The thread's coordinates again from %tid.x read here (volatile): made once
                                    // before the loop, the shared-memory address would hold a register across it
                                    // (and spill more).
                                    unsigned tid_now;
                                    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid_now));
                                    Tensor cS_now = mma_sdp.get_thread_slice(int(tid_now) - 128).partition_C(
                                        make_identity_tensor(Shape<Int<kBlockN>, Int<kBlockM>>{}))(_, part, _);
                                    cap = apply_score_mods_t_staged<Element, Bias>(acc_S, cS_now, rm, dcap, tile);
                                    done = true;
                                }
                                if (part == kParts - 1) {
                                    CUTLASS_PRAGMA_UNROLL
                                    for (int k = 0; k < kBlockM / 64; ++k) Bias::release(st.bias, k, it);
                                }
                            }
                        }
                        if (!done) cap = apply_score_mods_t<Element>(acc_S, cS, rm, r0, n0, dcap);
                    }
                }
                // the mask block: the plain kernel and the fixed variants (in the generic kernel it spilled)
                recompute_pt<kMasked, /*kMaskBlock=*/!kGenericMods>(acc_S, cS, &st.smem_lse[rq.index()][0],
                                                                    scale_log2, need_mask, n0, r0, sk, xr, yr);
                if constexpr (kGenericMods) {
                    if (dropping) flag_dropped_t(acc_S, rnd, params.mods.dropout);  // dropped Pᵀ negated
                }

                // ---- 16-bit Pᵀ: the A operand of dV (registers, key split) or its shared-memory copy (query split) ----
                if (dropping)
                    pack_kept<Element>(acc_S, rP);
                else
                    detail::pack_fragment<Element>(acc_S, rP);
                if constexpr (kKeySplit) {
                    // dV += Pᵀ dO right away (registers x smem; only this warpgroup's keys): it runs under the dSᵀ math,
                    // and issuing it here keeps the softmax above ahead of the dPᵀ wait in the instruction stream.
                    warpgroup_fence_operand(rP);
                    warpgroup_fence_operand(acc_dV);
                    warpgroup_arrive();
                    mma_dkv.accumulate_ = GMMA::ScaleOut::One;
                    cute::gemm(mma_dkv, rP, tdVrDO(_, _, _, rdo.index()), acc_dV);
                    warpgroup_commit_batch();
                } else {
                    Tensor sPt = make_tensor(make_smem_ptr(st.smem_p.data()), SmemLayoutPdSt{});
                    store_fragment_stsm(mma_sdp, tid, make_tensor(rP.data(), acc_S.layout()),
                                        local_tile(sPt(_, _, ds_stage), PartTile{}, make_coord(part, _0{})));
                }

                // A fixed soft-cap variant: Pᵀ ∘ (1 − tanh²) in place, its 16-bit copy being made, so that dSᵀ
                // below comes with the derivative in and dcap dies before the dPᵀ wait (applied to dSᵀ after
                // softmax_grad_t, as the generic kernel does, d128 causal spilled 16 bytes)
                if constexpr (kVarCap) apply_dcap_t(acc_S, dcap);

                // ---- dSᵀ = Pᵀ (dPᵀ - D) ----
                if constexpr (kKeySplit) {
                    warpgroup_wait<1>();  // dPᵀ done, dV may run
                } else {
                    warpgroup_wait<0>();
                }
                warpgroup_fence_operand(acc_dP);
                [[maybe_unused]] float rp = 1.f;  // dropout: 1 / (1 − p)
                if constexpr (kGenericMods) rp = params.mods.dropout.rp;
                if (dropping)
                    softmax_grad_dropout_t(acc_S, acc_dP, cS, &st.smem_dsum[rdo.index()][0], rp);
                else
                    softmax_grad_t(acc_S, acc_dP, cS, &st.smem_dsum[rdo.index()][0]);
                [[maybe_unused]] char* dbias_pairs_to = nullptr;  // dbias stored from the packed dS below
                [[maybe_unused]] bool full = false;
                if constexpr (kGenericMods) {  // dbias = dSᵀ (logit units), then the soft-cap's derivative
                    const ScoreMods& mods = params.mods;
                    const int64_t elem = mods.bias_fp32 ? 4 : 2;
                    char* dbias = params.dbias == nullptr
                                      ? nullptr
                                      : params.dbias + (int64_t(b) * params.dbias_batch + int64_t(h) * params.dbias_head) * elem;
                    full = r0 + kBlockM <= seq.sq && n0 + kBlockN <= sk;
                    if (mods.bias_fp32)
                        finish_ds_t<float>(acc_dP, cS, dbias, params.dbias_row * elem, seq.sq, sk, r0, n0, cap, dcap);
                    else if (finish_ds_t<Element>(acc_dP, cS, dbias, params.dbias_row * elem, seq.sq, sk, r0, n0, cap,
                                                  dcap))
                        dbias_pairs_to = dbias;
                }
                detail::pack_fragment<Element>(acc_dP, rdS);
                if constexpr (kGenericMods) {
                    if (dbias_pairs_to != nullptr)
                        store_dbias_pairs_t(reinterpret_cast<uint32_t const*>(raw_pointer_cast(rdS.data())), cS,
                                            dbias_pairs_to, params.dbias_row * 2, seq.sq, sk, r0, n0, full);
                }
                store_fragment_stsm(mma_sdp, tid, make_tensor(rdS.data(), acc_dP.layout()),
                                    local_tile(sDSt(_, _, ds_stage), PartTile{}, make_coord(part, _0{})));
            }  // parts

            Tensor acc_dQ = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHdim>>{});
            static_assert(decltype(size(acc_dQ))::value == kDqFrag);

            if constexpr (kKeySplit) {
                cutlass::arch::fence_view_async_shared();
                NamedBarrier::sync(NumMmaThreads, kBarDS);

                // dQ = dS K (all keys of the block)
                warpgroup_fence_operand(acc_dQ);
                warpgroup_arrive();
                gemm_zero_acc(mma_dq, tdQrDS(_, _, _, ds_stage), tdQrK, acc_dQ);
                warpgroup_commit_batch();
                // dK += dSᵀ Q
                warpgroup_fence_operand(rdS);
                warpgroup_fence_operand(acc_dK);
                warpgroup_arrive();
                mma_dkv.accumulate_ = GMMA::ScaleOut::One;
                cute::gemm(mma_dkv, rdS, tdKrQ(_, _, _, rq.index()), acc_dK);
                warpgroup_commit_batch();

                warpgroup_wait<1>();  // dV and dQ done
                warpgroup_fence_operand(rP);
                warpgroup_fence_operand(acc_dV);
                warpgroup_fence_operand(acc_dQ);
                pipe_do.consumer_release(rdo);
            } else {
                cutlass::arch::fence_view_async_shared();
                NamedBarrier::sync(NumMmaThreads, kBarDS);

                Tensor sPt = make_tensor(make_smem_ptr(st.smem_p.data()), SmemLayoutPdSt{});
                Tensor tdVrP = thr_dv.partition_fragment_A(sPt);     // (MMA, M, K, 2)
                Tensor tdKrDS = thr_dkv.partition_fragment_A(sDSt);  // (MMA, M, K, 2)

                warpgroup_fence_operand(acc_dQ);
                warpgroup_arrive();
                gemm_zero_acc(mma_dq, tdQrDS(_, _, _, ds_stage), tdQrK, acc_dQ);
                warpgroup_commit_batch();
                warpgroup_fence_operand(acc_dV);
                warpgroup_arrive();
                mma_dv.accumulate_ = GMMA::ScaleOut::One;
                cute::gemm(mma_dv, tdVrP(_, _, _, ds_stage), tdVrDO(_, _, _, rdo.index()), acc_dV);
                warpgroup_commit_batch();
                warpgroup_fence_operand(acc_dK);
                warpgroup_arrive();
                mma_dkv.accumulate_ = GMMA::ScaleOut::One;
                cute::gemm(mma_dkv, tdKrDS(_, _, _, ds_stage), tdKrQ(_, _, _, rq.index()), acc_dK);
                warpgroup_commit_batch();

                warpgroup_wait<2>();  // dQ done
                warpgroup_fence_operand(acc_dQ);
            }

            // ---- dQ tile into the workspace accumulator ----
            {
                const int t = tid % 128;
                if constexpr (kDqViaSmem) {
                    dq_to_smem(st, acc_dQ, wg, t);
                } else {
                    float* tile = params.dq_acc +
                                  ((int64_t(b) * params.nhead_q + h) * params.m_tiles + m) * int64_t(kBlockM * kHdim);
                    float* dst = tile + (wg * kDqFrag * 128 + t * 4);
                    // deterministic: add in this key block's turn, which the keeper warp waits for and passes on
                    if (params.deterministic) NamedBarrier::sync(NumMmaThreads + 32, kBarDqTurn);
                    CUTLASS_PRAGMA_UNROLL
                    for (int v = 0; v < kDqFrag / 4; ++v) {
                        bwd::red_add_f32x4(dst + v * 512, make_float4(acc_dQ(4 * v), acc_dQ(4 * v + 1),
                                                                      acc_dQ(4 * v + 2), acc_dQ(4 * v + 3)));
                    }
                    if (params.deterministic) NamedBarrier::arrive(NumMmaThreads + 32, kBarDqAdded);
                }
            }

            warpgroup_wait<0>();
            warpgroup_fence_operand(rdS);  // (key split) the register A operand of dK stays live until here
            warpgroup_fence_operand(acc_dK);
            warpgroup_fence_operand(acc_dV);
            if constexpr (!kKeySplit) pipe_do.consumer_release(rdo);
            pipe_q.consumer_release(rq);
            ++rq;
            ++rdo;
            ds_stage ^= 1;
            if (++m == m_begin + n_m) {
                m = m_begin;
                ++h_in;
                if constexpr (kHoldSlope) {
                    if (it + 1 < n_iters) alibi = alibi_slope(params, b, first_head(params, hk, sp) + h_in);
                }
            }
        }

        if constexpr (kSplit) {  // the partial sums, unscaled, to this CTA's slot
            store_partial(params, sp, hk, b, n_block, acc_dK, acc_dV, tid);
            return;
        }
        // ---- dK (scaled), dV: registers -> shared memory -> global ----
        // Every consumer is past its last product, so the Q and dO stages (adjacent) are free to stage them in.
        NamedBarrier::sync(NumMmaThreads, kBarDS);
        const int64_t dk_seq = kGroup ? int64_t(seq.k0) * params.dk_row : int64_t(b) * params.dk_batch;
        const int64_t dv_seq = kGroup ? int64_t(seq.k0) * params.dv_row : int64_t(b) * params.dv_batch;
        const Epilogue epi{key0(), sk, st.smem_q.data(), tid, NumMmaThreads, kBarDS};
        epi.template store<kHdim>(params.dk + dk_seq + hk * params.dk_head, params.dk_row, params.hdim, params.scale,
                                  acc_dK, thr_dkv);
        // (dropout: the kept probabilities' 1 / (1 − p), once for every query tile)
        float dv_scale = 1.f;
        if constexpr (kGenericMods) dv_scale = dropping ? params.mods.dropout.rp : 1.f;
        epi.template store<kHdimV>(params.dv + dv_seq + hk * params.dv_head, params.dv_row, params.hdim_v, dv_scale,
                                   acc_dV, thr_dv);
    }

    // ------------------------------------------------------------------------------------------------------------
    // The split's epilogue (kSplit): a consumer thread's dK and dV accumulators (tid in [0, 256); every layout gives
    // each thread kBlockN x head dim / 256 of them) as they are, fp32 and unscaled, into the CTA's slot (bwd::dkv_slot)
    // in fragment order: float4 v of thread tid at v x 256 + tid, dK's then dV's, so that each store instruction
    // writes 4 KB contiguous. No shared memory, no barrier. reduce_dkv_kernel adds the slots of the splits in order,
    // scales and writes dK / dV through the same epilogue (BwdEpilogue) and partitions.
    static constexpr int kSlotFloats = kBlockN * (kHdim + kHdimV);
    template <class TensorK, class TensorV>
    CUTLASS_DEVICE static void store_partial(Params const& params, int sp, int hk, int b, int n_block,
                                             TensorK const& acc_dK, TensorV const& acc_dV, int tid) {
        if constexpr (kSplit) {
            constexpr int FK = decltype(size(acc_dK))::value, FV = decltype(size(acc_dV))::value;
            static_assert(FK * NumMmaThreads == kBlockN * kHdim && FV * NumMmaThreads == kBlockN * kHdimV &&
                          FK % 4 == 0 && FV % 4 == 0);
            float4* dst = reinterpret_cast<float4*>(bwd::dkv_slot<kSlotFloats>(
                              params.dkv_part, sp, b, hk, n_block, params.batch, params.nhead_k, params.key_blocks)) +
                          tid;
            CUTLASS_PRAGMA_UNROLL
            for (int v = 0; v < FK / 4; ++v)
                dst[v * NumMmaThreads] = make_float4(acc_dK(4 * v), acc_dK(4 * v + 1), acc_dK(4 * v + 2), acc_dK(4 * v + 3));
            dst += FK / 4 * NumMmaThreads;
            CUTLASS_PRAGMA_UNROLL
            for (int v = 0; v < FV / 4; ++v)
                dst[v * NumMmaThreads] = make_float4(acc_dV(4 * v), acc_dV(4 * v + 1), acc_dV(4 * v + 2), acc_dV(4 * v + 3));
        }
    }

    // ------------------------------------------------------------------------------------------------------------
    // The swapped key split (kSwapKV: BN = 96, BM = 64; FlashAttention-3's layout for head dim 192): per query tile
    //   S = Q·Kᵀ, dP = dO·Vᵀ      (64 queries x the warpgroup's 48 keys, SS, not transposed)
    //   P, dS = P ∘ (dP − D)      (LSE / D per row; the forward's element mask, ForwardMask::apply)
    //   P, dS -> shared memory    (queries x keys, keys contiguous: each warpgroup its own 48 keys)
    //   dVᵀ += dOᵀ·P              (head dim x own keys; A: the dO stage's (d, queries) view; after a warpgroup-local
    //                              barrier on its P slice, issued before dS is computed)
    //   dQ = dS·K                 (all 96 keys: one 256-thread barrier; N halves of the head dim per warpgroup)
    //   dKᵀ += Qᵀ·dS              (head dim x own keys)
    // dKᵀ / dVᵀ live in registers for the CTA's life and leave transposed (BwdEpilogue::store_t); dQ goes through the
    // shared fp32 tile and the dQ writer warp (deterministic turns included), as at the key split.
    CUTLASS_DEVICE void consumer_swapped(Params const& params, SharedStorage& st, PipelineQ& pipe_q,
                                         PipelineDO& pipe_do, Sequence const& seq, int n_block, int hk, int sp,
                                         int b, int m_begin, int n_m, int n_iters, int wg) {
        using cutlass::arch::NamedBarrier;
        using namespace cutlass::fmha::collective;
        static_assert(kSwapKV);

        const int tid = int(threadIdx.x) - 128;  // [0, 256)
        const ForwardMask<kMasked, kBlockM, kBlockN> mask(seq.mask, seq.sq, seq.sk);
        const int n0 = n_block * kBlockN;

        TiledMmaSdPq mma_sdp;
        TiledMmadKVt mma_dkv;
        TiledMmadQ mma_dq;
        auto thr_sdp = mma_sdp.get_thread_slice(tid);
        auto thr_dkv = mma_dkv.get_thread_slice(tid);
        auto thr_dq = mma_dq.get_thread_slice(tid);

        Tensor sQ = make_tensor(make_smem_ptr(st.smem_q.data()), SmemLayoutQ{});
        Tensor sQt = make_tensor(make_smem_ptr(st.smem_q.data()), SmemLayoutQt{});
        Tensor sDO = make_tensor(make_smem_ptr(st.smem_do.data()), SmemLayoutDO{});
        Tensor sDOt = make_tensor(make_smem_ptr(st.smem_do.data()), SmemLayoutDOt{});
        Tensor sK = make_tensor(make_smem_ptr(st.smem_k.data()), SmemLayoutK{});
        Tensor sKt = make_tensor(make_smem_ptr(st.smem_k.data()), SmemLayoutKt{});
        Tensor sV = make_tensor(make_smem_ptr(st.smem_v.data()), SmemLayoutV{});
        Tensor sP = make_tensor(make_smem_ptr(st.smem_p.data()), SmemLayoutPq{});     // (queries, keys, 1)
        Tensor sPt = make_tensor(make_smem_ptr(st.smem_p.data()), SmemLayoutPqt{});   // (keys, queries, 1)
        Tensor sDS = make_tensor(make_smem_ptr(st.smem_ds.data()), SmemLayoutPdS{});  // (queries, keys, 2)
        Tensor sDSt = make_tensor(make_smem_ptr(st.smem_ds.data()), SmemLayoutPdSt{});

        Tensor tSrQ = thr_sdp.partition_fragment_A(sQ);      // (MMA, M, K, stages)
        Tensor tSrK = thr_sdp.partition_fragment_B(sK);      // (MMA, N, K): this warpgroup's keys
        Tensor tdPrDO = thr_sdp.partition_fragment_A(sDO);
        Tensor tdPrV = thr_sdp.partition_fragment_B(sV);
        Tensor tdVrDO = thr_dkv.partition_fragment_A(sDOt);  // (MMA, kHdimV / 64, K, stages)
        Tensor tdVrP = thr_dkv.partition_fragment_B(sPt);    // (MMA, N, K, 1)
        Tensor tdKrQ = thr_dkv.partition_fragment_A(sQt);    // (MMA, kHdim / 64, K, stages)
        Tensor tdKrDS = thr_dkv.partition_fragment_B(sDSt);  // (MMA, N, K, 2)
        Tensor tdQrDS = thr_dq.partition_fragment_A(sDS);    // (MMA, M, K, 2)
        Tensor tdQrK = thr_dq.partition_fragment_B(sKt);

        Tensor acc_dK = partition_fragment_C(mma_dkv, Shape<Int<kHdim>, Int<kBlockN>>{});   // dKᵀ
        Tensor acc_dV = partition_fragment_C(mma_dkv, Shape<Int<kHdimV>, Int<kBlockN>>{});  // dVᵀ
        clear(acc_dK);
        clear(acc_dV);

        // (query, key) coordinates of this thread's S elements in the tile, as the accumulator and as rows x keys
        using TileS = Shape<Int<kBlockM>, Int<kBlockN>>;
        Tensor cS = thr_sdp.partition_C(make_identity_tensor(TileS{}));
        Tensor c_mn = make_tensor(cS.data(), layout_acc_mn(mma_sdp, cS.layout()));

        if (n_iters > 0) {
            if (tid % 128 < 32) NamedBarrier::arrive(128 + 32, kBarDqEmpty + wg);  // the dQ tile starts empty
            cutlass::arch::ClusterBarrier::wait(&st.bar_kv, 0);
        }

        StateQ rq;
        StateDO rdo;
        int m = m_begin;  // the query tile; the query heads of the kv group follow one another (the producer's order)
        int ds_stage = 0;

        CUTLASS_PRAGMA_NO_UNROLL
        for (int it = 0; it < n_iters; ++it) {
            const int r0 = m * kBlockM;
            // Rows past sq count as rows here: their LSE is +inf in the workspace, so their P is 0 anyway.
            const bool need_mask = !mask.geom.template tile_full<kBlockN>(r0, r0 + kBlockM - 1, n0);

            // ---- S = Q Kᵀ, dP = dO Vᵀ ----
            Tensor acc_S = partition_fragment_C(mma_sdp, TileS{});
            Tensor acc_dP = partition_fragment_C(mma_sdp, TileS{});
            pipe_q.consumer_wait(rq);
            warpgroup_fence_operand(acc_S);
            warpgroup_arrive();
            gemm_zero_acc(mma_sdp, tSrQ(_, _, _, rq.index()), tSrK, acc_S);
            warpgroup_commit_batch();
            pipe_do.consumer_wait(rdo);
            warpgroup_fence_operand(acc_dP);
            warpgroup_arrive();
            gemm_zero_acc(mma_sdp, tdPrDO(_, _, _, rdo.index()), tdPrV, acc_dP);
            warpgroup_commit_batch();

            // ---- P ----
            warpgroup_wait<1>();
            warpgroup_fence_operand(acc_S);
            Tensor p_mn = make_tensor(acc_S.data(), layout_acc_mn(mma_sdp, acc_S.layout()));
            if (need_mask) mask.apply(p_mn, c_mn, r0, n_block);
            recompute_p(p_mn, c_mn, &st.smem_lse[rq.index()][0], params.scale_log2);
            // One P buffer: the last reader of this warpgroup's slice, the previous tile's dVᵀ product, is done in
            // every warp of the warpgroup: each waited for it (warpgroup_wait<1> below) before the 128-thread sync
            // of dq_to_smem, which they all passed before getting here.
            {
                Tensor rP = make_tensor<Element>(acc_S.layout());
                detail::pack_fragment<Element>(acc_S, rP);
                store_fragment_stsm(mma_sdp, tid, rP, sP(_, _, 0));
            }
            // this warpgroup's P slice, read by its own dVᵀ product only: a warpgroup-local barrier
            cutlass::arch::fence_view_async_shared();
            NamedBarrier::sync(128, kBarP + wg);

            // ---- dVᵀ += dOᵀ P (runs under the dS math) ----
            warpgroup_fence_operand(acc_dV);
            warpgroup_arrive();
            mma_dkv.accumulate_ = GMMA::ScaleOut::One;
            cute::gemm(mma_dkv, tdVrDO(_, _, _, rdo.index()), tdVrP(_, _, _, 0), acc_dV);
            warpgroup_commit_batch();

            // ---- dS = P (dP - D) ----
            warpgroup_wait<1>();  // dP done, dVᵀ may run
            warpgroup_fence_operand(acc_dP);
            Tensor ds_mn = make_tensor(acc_dP.data(), layout_acc_mn(mma_sdp, acc_dP.layout()));
            softmax_grad(p_mn, ds_mn, c_mn, &st.smem_dsum[rdo.index()][0]);
            {
                Tensor rdS = make_tensor<Element>(acc_dP.layout());
                detail::pack_fragment<Element>(acc_dP, rdS);
                store_fragment_stsm(mma_sdp, tid, rdS, sDS(_, _, ds_stage));
            }
            cutlass::arch::fence_view_async_shared();
            NamedBarrier::sync(NumMmaThreads, kBarDS);  // both warpgroups' dS: the dQ product needs all keys

            // ---- dQ = dS K, dKᵀ += Qᵀ dS ----
            Tensor acc_dQ = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHdim>>{});
            static_assert(decltype(size(acc_dQ))::value == kDqFrag);
            warpgroup_fence_operand(acc_dQ);
            warpgroup_arrive();
            gemm_zero_acc(mma_dq, tdQrDS(_, _, _, ds_stage), tdQrK, acc_dQ);
            warpgroup_commit_batch();
            warpgroup_fence_operand(acc_dK);
            warpgroup_arrive();
            mma_dkv.accumulate_ = GMMA::ScaleOut::One;
            cute::gemm(mma_dkv, tdKrQ(_, _, _, rq.index()), tdKrDS(_, _, _, ds_stage), acc_dK);
            warpgroup_commit_batch();

            warpgroup_wait<1>();  // dVᵀ and dQ done: the dO stage and this warpgroup's P slice are free
            warpgroup_fence_operand(acc_dV);
            warpgroup_fence_operand(acc_dQ);
            pipe_do.consumer_release(rdo);
            dq_to_smem(st, acc_dQ, wg, tid % 128);

            warpgroup_wait<0>();
            warpgroup_fence_operand(acc_dK);
            pipe_q.consumer_release(rq);
            ++rq;
            ++rdo;
            ds_stage ^= 1;
            if (++m == m_begin + n_m) m = m_begin;
        }

        if constexpr (kSplit) {  // the partial sums (dKᵀ / dVᵀ fragments), unscaled, to this CTA's slot
            store_partial(params, sp, hk, b, n_block, acc_dK, acc_dV, tid);
            return;
        }
        // ---- dK (scaled), dV: transposed, registers -> shared memory -> global ----
        // Every consumer is past its last product, so the Q and dO stages (adjacent) are free to stage them in.
        NamedBarrier::sync(NumMmaThreads, kBarDS);
        const int64_t dk_seq = kGroup ? int64_t(seq.k0) * params.dk_row : int64_t(b) * params.dk_batch;
        const int64_t dv_seq = kGroup ? int64_t(seq.k0) * params.dv_row : int64_t(b) * params.dv_batch;
        const Epilogue epi{n0, seq.sk, st.smem_q.data(), tid, NumMmaThreads, kBarDS};
        epi.template store_t<kHdim>(params.dk + dk_seq + hk * params.dk_head, params.dk_row, params.hdim,
                                    params.scale, acc_dK, thr_dkv);
        epi.template store_t<kHdimV>(params.dv + dv_seq + hk * params.dv_head, params.dv_row, params.hdim_v, 1.f,
                                     acc_dV, thr_dkv);
    }
};

// The kernel types (distinct names, so that the plain one keeps its symbol): plain and modifier instances, the
// latter one per modifier variant (BwdModVar) that the instance builds.
template <class Element, int kHdim, int kHdimV, bool kGroup, bool kMasked, int kBlockM, int kBlockN>
struct HopperBwdKernelImpl : HopperBwdKernelBody<Element, kHdim, kHdimV, kGroup, kMasked, kBlockM, kBlockN, false> {};
template <class Element, int kHdim, int kHdimV, bool kGroup, bool kMasked, int kBlockM, int kBlockN, int kModVar>
struct HopperBwdKernelModsImpl
    : HopperBwdKernelBody<Element, kHdim, kHdimV, kGroup, kMasked, kBlockM, kBlockN, true, kModVar> {};
// The GQA split's kernel (kSplit) of a plain or a modifier instance: the generic kernel's (bwd_gqa_split.h).
template <class Element, int kHdim, int kHdimV, bool kGroup, bool kMasked, int kBlockM, int kBlockN, bool kMods>
struct HopperBwdKernelSplitImpl
    : HopperBwdKernelBody<Element, kHdim, kHdimV, kGroup, kMasked, kBlockM, kBlockN, kMods, BwdModVar::kGeneric,
                          true> {};

}  // namespace mhakit::hopper
