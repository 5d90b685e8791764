// mhakit hopper family — the elementwise-bias staging of the "_mods" instances: a ring of bias tiles in shared memory
// that a second warp of the producer warpgroup (the bias warp) fills while the TMA warp loads K and V (forward) or Q
// and dO (backward), and that the consumer warpgroups read in their S fragment's layout instead of loading the bias
// from global memory right after the Q·Kᵀ wgmma.
//
// Shape: kSlots slots per stage, each 64 query rows x kBlockN keys of one tile in the data type (16-bit). Each slot has
// its own pair of mbarriers, so a warpgroup's next tile is loaded as soon as that warpgroup is done with its current
// one (the ping-pong partner's pace does not matter): "full" completes when the bias warp's 32 lanes have arrived and
// their copies have landed, "empty" when the slot's kReaders threads have read it. Tile t of a CTA's visit goes to
// stage t % kStages with parity (t / kStages) & 1, so neither side keeps ring state in registers.
//
// The loader and slot layout: TMA, for both directions. The launcher encodes a tensor map of the bias (make_bias_map:
// dims keys, query rows, heads, batch; a broadcast dim, stride 0, gets extent 1 and coordinate 0) and one lane of the
// bias warp loads a slot as kBlockN / 64 boxes of 64 keys x 64 rows (128 bytes x 64, 8 KB) with 128-byte swizzle:
// chunk c (16 bytes) of row r of a box lies at r·128 + 16·(c ^ (r % 8)). The forward's readers take one pair of
// consecutive keys per thread (8 rows x the same 16-byte chunk per warp: 32 distinct banks, hopper_score_mod.hpp); the
// backward's read the transposed Sᵀ tile (a thread's pairs are consecutive queries of one key) with ldmatrix .trans:
// each 8 x 8 matrix is 8 consecutive query rows of one 16-byte key chunk, which the swizzle spreads over the 8 chunk
// positions of a 128-byte row, so each matrix's 8 row reads fall on 32 distinct banks too. The slot's full barrier
// takes the lane's arrive with expect_tx of the slot's bytes (the other 31 lanes arrive plainly). Batch mode: the
// map's extents are s_q and s_k, and TMA zero-fills the rows and keys past them. Group mode: one map serves sequences
// of different lengths, so its extents only bound the coordinates, and a box reaching past its sequence's s_q or s_k
// would read rows or keys outside the sequence's block (past the end of a tightly packed bias): such a slot (a
// sequence's last row block or key tile, staged_slot) is left empty, its full barrier's phase completed by the 32
// lanes' plain arrivals, and its readers take that tile's bias from global memory as an unstaged call does. (The
// backward loaded its ring by cp.async from the 32 lanes, padded rows, until TMA replaced it: PERFORMANCE.md, "The
// Hopper backward's staged bias loaded by TMA".)
//
// What is staged (bias_stageable, the one statement of the rule, for both directions' launchers):
// a 16-bit elementwise bias whose pointer is 16-byte aligned and whose row, head and batch strides are multiples of 16
// bytes (zero: broadcast) below 2^40, the row stride not zero. Any other bias (fp32, unaligned rows such as a
// contiguous odd s_k, a row-broadcast one) keeps the consumers' direct global loads (apply_score_mods). The stage count
// is what the instance's shared memory leaves after its other buffers (fmha_hopper_kernel.hpp,
// fmha_bwd_hopper_kernel.hpp), 1 or 2, a second only with kBiasL1Leave bytes left (forward d96: 2, d128 / d256: 1;
// backward d64 / d96 / d192: 2, d128: 1; none where it does not fit, backward d256).
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda.h>

#include "cute/arch/copy_sm90_desc.hpp"
#include "cute/arch/copy_sm90_tma.hpp"
#include "cute/tensor.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/cuda_host_adapter.hpp"
#include "cutlass/cutlass.h"

#include "kernels/common/score_mod.h"

namespace mhakit::hopper {

// Whether an elementwise bias can be staged (the rule in the header comment): a stride in elements is staged as
// bytes, a multiple of 16 below 2^40 (0 broadcasts, except rows).
CUTLASS_HOST_DEVICE bool bias_stride_ok(int64_t elems) {
    return elems >= 0 && ((elems * 2) & 15) == 0 && elems * 2 < (int64_t(1) << 40);
}
CUTLASS_HOST_DEVICE bool bias_stageable(ScoreMods const& m) {
    return m.bias_type == 1 && !m.bias_fp32 && (reinterpret_cast<uintptr_t>(m.bias) & 15u) == 0 &&
           m.bias_row_stride > 0 && bias_stride_ok(m.bias_row_stride) && bias_stride_ok(m.bias_head_stride) &&
           bias_stride_ok(m.bias_batch_stride);
}

// The TMA boxes: 64 keys (128 bytes, the 128-byte swizzle's span) x 64 query rows.
constexpr int kBiasBoxKeys = 64;
constexpr int kBiasBoxRows = 64;

// A ring gets its second stage only where that leaves this much of the SM's shared memory to L1. Measured on the
// H200 (bf16 s=4k): the backward's d128 ring with two stages (232448 bytes, the limit) ran the bias call no faster
// than with one (0.808 vs 0.801 ms) and the instance's soft-cap and sink calls about 2 % slower; the forward's d256
// ring, one stage vs two, 0.217 vs 0.218 ms.
constexpr int kBiasL1Leave = 16384;

// The host's tensor map of a stageable bias (bias_stageable(m)) of 16-bit Element for boxes of kBiasBoxKeys x
// kBiasBoxRows x 1 x 1, 128-byte swizzle: dims (keys, query rows, query heads, batch); a mode of stride 0 (broadcast)
// gets extent 1 (the kernel passes coordinate 0 there: bias_coord) and a placeholder stride. rows / keys: the extents
// (batch mode: s_q and s_k, whose boxes TMA zero-fills past them; group mode: bounds of the coordinates).
template <class Element>
inline bool make_bias_map(cute::TmaDescriptor* map, ScoreMods const& m, int batch, int nhead_q, int64_t rows,
                          int64_t keys) {
    static_assert(sizeof(Element) == 2, "a 16-bit bias");
    const auto stride = [](int64_t elems) { return cuuint64_t(elems != 0 ? elems * 2 : 16); };
    const cuuint64_t dims[4] = {cuuint64_t(keys), cuuint64_t(rows),
                                cuuint64_t(m.bias_head_stride != 0 ? nhead_q : 1),
                                cuuint64_t(m.bias_batch_stride != 0 ? batch : 1)};
    const cuuint64_t strides[3] = {stride(m.bias_row_stride), stride(m.bias_head_stride), stride(m.bias_batch_stride)};
    const cuuint32_t box[4] = {cuuint32_t(kBiasBoxKeys), cuuint32_t(kBiasBoxRows), 1u, 1u};
    const cuuint32_t elem_strides[4] = {1u, 1u, 1u, 1u};
    constexpr bool kBf16 = std::is_same_v<Element, cutlass::bfloat16_t>;
    return CUTLASS_CUDA_DRIVER_WRAPPER_CALL(cuTensorMapEncodeTiled)(
               map, kBf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4u,
               const_cast<void*>(m.bias), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
               CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// The (head, batch) coordinates of sequence b, query head h in make_bias_map's map: 0 in a broadcast mode.
struct BiasCoord {
    int head, batch;
    CUTLASS_DEVICE static BiasCoord of(ScoreMods const& m, int b, int h) {
        return BiasCoord{m.bias_head_stride != 0 ? h : 0, m.bias_batch_stride != 0 ? b : 0};
    }
};

// kSlots slots of 64 bias rows x kBlockN keys per stage, each read by kReaders consumer threads: the forward has one
// slot per consumer warpgroup (its 64 query rows, 128 readers), the backward one slot that both consumer warpgroups
// read (the CTA's 64 query rows of the tile against its kBlockN keys, 256 readers). The layout: header comment. A
// kBlockN that is not whole 64-key boxes (the 96-key tiles of both directions) may name the type with any stage
// count, since the kernels size candidate rings before they decide to stage (its sizes are then rounded up and
// unused), but not load it (load's assertion).
template <int kBlockN, int kSlots_, int kStages_, int kReaders>
struct BiasStage {
    static constexpr int kSlots = kSlots_;
    static constexpr int kStages = kStages_;
    static constexpr int kBoxKeys = kBiasBoxKeys;
    static constexpr int kBoxBytes = kBiasBoxKeys * 2 * kBiasBoxRows;  // one box, 64 rows of 128 bytes
    static constexpr int kBoxes = (kBlockN + kBiasBoxKeys - 1) / kBiasBoxKeys;
    static constexpr int kPitch = kBiasBoxKeys * 2;  // bytes per row of a box
    static constexpr int kSlotBytes = kBoxes * kBoxBytes;
    static constexpr int kStageBytes = kSlots * kSlotBytes;
    static constexpr bool kWholeBoxes = kBlockN % kBiasBoxKeys == 0;

    struct Storage {
        alignas(1024) char data[kStages > 0 ? kStages * kStageBytes : 1];  // 1024: the swizzle atom
        alignas(8) uint64_t full[kStages > 0 ? kStages * kSlots : 1];
        uint64_t empty[kStages > 0 ? kStages * kSlots : 1];
    };

    CUTLASS_DEVICE static int stage(int t) { return t % kStages; }
    CUTLASS_DEVICE static uint32_t parity(int t) { return uint32_t(t / kStages) & 1u; }
    CUTLASS_DEVICE static int slot_index(int slot, int t) { return stage(t) * kSlots + slot; }

    // One thread, before the CTA's __syncthreads (with the pipelines' own initialisation).
    CUTLASS_DEVICE static void init(Storage& s) {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < kStages * kSlots; ++i) {
            cutlass::arch::ClusterBarrier::init(&s.full[i], 32);
            cutlass::arch::ClusterBarrier::init(&s.empty[i], kReaders);
        }
        cutlass::arch::fence_barrier_init();
    }

    // Whether the slot of rows row .. row + 63 and keys key0 .. key0 + kBlockN - 1 holds the bias (staged_slot),
    // for the bias warp and the slot's readers alike. Batch mode: always (TMA zero-fills past s_q and s_k). Group mode
    // (one map for sequences of different lengths, its extents only bounds): only a slot inside its sequence; the
    // bias warp leaves one that reaches past it (a sequence's last row block or key tile) empty, still completing its
    // full barrier's phase, and its readers take that tile's bias from global memory (apply_score_mods), as an
    // unstaged call does, after the acquire and with the release that keep the ring's phases in step.
    template <bool kGroup>
    CUTLASS_DEVICE static bool staged_slot(int row, int key0, int sq, int sk) {
        return !kGroup || (row + 64 <= sq && key0 + kBlockN <= sk);
    }

    // The loader, the bias warp (all 32 lanes), tile t: slot k (rows row0 + 64k .. + 63, keys key0 ..
    // key0 + kBlockN - 1) of sequence b, query head h, once released, by TMA from map (make_bias_map of the call's
    // modifiers m): lane 0 arrives with expect_tx of the slot's bytes and issues its kBoxes boxes, the other lanes
    // arrive (a slot that is not staged_slot: every lane arrives, nothing is loaded). The coordinates are made here
    // from the kernel parameters (constant memory), not kept in registers across the key loop: the producer warpgroup
    // runs on 24.
    template <bool kGroup>
    CUTLASS_DEVICE static void load(Storage& s, cute::TmaDescriptor const* map, ScoreMods const& m, int b, int h, int t,
                                    int row0, int key0, int sq, int sk) {
        static_assert(kWholeBoxes, "TMA: whole 64-key boxes per row");
        constexpr uint64_t kEvictFirst = uint64_t(cute::TMA::CacheHintSm90::EVICT_FIRST);  // each byte read once
        const BiasCoord crd = BiasCoord::of(m, b, h);
        const bool lane0 = threadIdx.x % 32 == 0;
        CUTLASS_PRAGMA_NO_UNROLL
        for (int k = 0; k < kSlots; ++k) {
            const int i = slot_index(k, t);
            const int row = row0 + k * 64;
            cutlass::arch::ClusterBarrier::wait(&s.empty[i], parity(t) ^ 1u);
            if (lane0 && staged_slot<kGroup>(row, key0, sq, sk)) {
                cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&s.full[i], uint32_t(kSlotBytes));
                CUTLASS_PRAGMA_UNROLL
                for (int x = 0; x < kBoxes; ++x)
                    cute::SM90_TMA_LOAD_4D::copy(map, &s.full[i], kEvictFirst, s.data + i * kSlotBytes + x * kBoxBytes,
                                                 key0 + x * kBiasBoxKeys, row, crd.head, crd.batch);
            } else {
                cutlass::arch::ClusterBarrier::arrive(&s.full[i]);
            }
        }
    }

    // A reader: tile t's slot once it has landed (the memory clobber keeps the reads after the wait), and its release
    // once the reader has read it (each of the slot's kReaders threads arrives).
    CUTLASS_DEVICE static char const* acquire(Storage& s, int slot, int t) {
        const int i = slot_index(slot, t);
        cutlass::arch::ClusterBarrier::wait(&s.full[i], parity(t));
        asm volatile("" ::: "memory");
        return s.data + i * kSlotBytes;
    }
    CUTLASS_DEVICE static void release(Storage& s, int slot, int t) {
        asm volatile("" ::: "memory");
        cutlass::arch::ClusterBarrier::arrive(&s.empty[slot_index(slot, t)]);
    }
};

}  // namespace mhakit::hopper
