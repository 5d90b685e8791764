// mhakit hopper family — the forward's elementwise-bias staging (the "_mods" instances): a ring of bias tiles in
// shared memory that a second warp of the producer warpgroup (the bias warp) fills with cp.async while the TMA warp
// loads K and V, and that the consumer warpgroups read in their S fragment's layout instead of loading the bias from
// global memory right after the Q·Kᵀ wgmma.
//
// Shape: one slot per consumer warpgroup and stage, holding that warpgroup's 64 query rows x kBlockN keys of one key
// tile, in the data type (16-bit), each row padded by 16 bytes (pitch = 2·kBlockN + 16): a warp's read of one pair
// per thread (8 rows x 16 contiguous bytes, hopper_score_mod.hpp) then falls on 32 distinct banks. Each slot has its
// own pair of mbarriers, so a warpgroup's next tile is loaded as soon as that warpgroup is done with its current one
// (the ping-pong partner's pace does not matter): "full" completes when the bias warp's 32 lanes' copies have landed
// (cp.async.mbarrier.arrive.noinc, one arrival per lane), "empty" when the warpgroup's 128 threads have read it.
// Tile t of a CTA's visit (t = n − visit.begin) goes to stage t % kStages with parity (t / kStages) & 1, so neither
// side keeps ring state in registers.
//
// What is staged: a 16-bit bias whose (b, h) block starts 16-byte aligned and whose row stride is a multiple of 16
// bytes (bias_rows()); rows past the sequence's s_q and keys past its s_k are zero-filled (src-size < 16), so a
// partial key tile reads 0 there (the mask hides those keys anyway). Any other bias (fp32, unaligned rows such as a
// contiguous odd s_k) keeps the consumers' direct global loads (apply_score_mods). The stage count is what the
// instance's shared memory leaves after the Q buffer and the K/V ring (fmha_hopper_kernel.hpp), 1 or 2.
#pragma once

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/cutlass.h"

#include "kernels/common/score_mod.h"

namespace mhakit::hopper {

// The (b, h) block of a 16-bit elementwise bias that can be staged (row stride in bytes), or a null base.
struct BiasRows {
    char const* base;
    int64_t row_bytes;
};
CUTLASS_DEVICE BiasRows bias_rows(ScoreMods const& m, int b, int h) {
    if (m.bias_type != 1 || m.bias_fp32) return BiasRows{nullptr, 0};
    char const* base = static_cast<char const*>(m.bias) +
                       (int64_t(b) * m.bias_batch_stride + int64_t(h) * m.bias_head_stride) * 2;
    const int64_t row_bytes = m.bias_row_stride * 2;
    if (((reinterpret_cast<uintptr_t>(base) | uintptr_t(row_bytes)) & 15u) != 0) return BiasRows{nullptr, 0};
    return BiasRows{base, row_bytes};
}

// kSlots slots of 64 bias rows x kBlockN keys per stage, each read by kReaders consumer threads: the forward has one
// slot per consumer warpgroup (its 64 query rows, 128 readers), the backward one slot that both consumer warpgroups
// read (the CTA's 64 query rows of the tile against its kBlockN keys, 256 readers).
template <int kBlockN, int kSlots, int kStages_, int kReaders>
struct BiasStage {
    static constexpr int kStages = kStages_;
    static constexpr int kChunks = kBlockN * 2 / 16;  // 16-byte chunks of a row
    static constexpr int kPitch = kBlockN * 2 + 16;   // bytes per row in shared memory
    static constexpr int kSlotBytes = 64 * kPitch;
    static constexpr int kStageBytes = kSlots * kSlotBytes;
    static_assert(kBlockN % 8 == 0, "whole 16-byte chunks per row");

    struct Storage {
        alignas(128) char data[kStages > 0 ? kStages * kStageBytes : 1];
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

    // The bias warp (all 32 lanes), tile t of the CTA's visit: slot k gets the bias rows row0 + 64k .. + 63 (counted
    // from the sequence's start) of keys key0 .. key0 + kBlockN - 1, rows >= sq and keys >= sk zero-filled, once the
    // slot's readers have released tile t - kStages. Lane l copies chunk l % kChunks of rows l / kChunks +
    // kRowsPerPass·p (lanes past kRowsPerPass·kChunks idle), one 16-byte cp.async each, in a loop kept rolled: the
    // producer warpgroup runs on 24 registers. finish() once after the last tile.
    static constexpr int kRowsPerPass = 32 / kChunks;
    static_assert(kChunks <= 32 && 64 % kRowsPerPass == 0, "a pass covers whole rows");
    CUTLASS_DEVICE static void load(Storage& s, BiasRows const& rows, int t, int row0, int key0, int sq, int sk) {
        const int lane = int(threadIdx.x % 32);
        const int c = lane % kChunks, r = lane / kChunks;
        const bool active = lane < kRowsPerPass * kChunks;
        const int keys = sk - (key0 + 8 * c);  // keys of this lane's chunk inside the sequence, if < 8
        const int chunk_bytes = !active ? 0 : keys >= 8 ? 16 : keys > 0 ? 2 * keys : 0;
        CUTLASS_PRAGMA_NO_UNROLL
        for (int k = 0; k < kSlots; ++k) {
            const int i = slot_index(k, t);
            cutlass::arch::ClusterBarrier::wait(&s.empty[i], parity(t) ^ 1u);
            if (active) {
                const int row = row0 + k * 64 + r;
                char const* src = rows.base + int64_t(row) * rows.row_bytes + 2 * (key0 + 8 * c);
                uint32_t dst = cute::cast_smem_ptr_to_uint(s.data + i * kSlotBytes) + r * kPitch + 16 * c;
                int left = sq - row;  // rows of the sequence from this lane's row on
#pragma unroll 1
                for (int p = 0; p < 64 / kRowsPerPass; ++p) {
                    const int bytes = left > 0 ? chunk_bytes : 0;
                    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst),
                                 "l"(bytes != 0 ? src : rows.base), "r"(bytes)
                                 : "memory");
                    src += kRowsPerPass * rows.row_bytes;
                    dst += kRowsPerPass * kPitch;
                    left -= kRowsPerPass;
                }
            }
            cutlass::arch::cpasync_barrier_arrive_noinc(&s.full[i]);
        }
    }
    CUTLASS_DEVICE static void finish() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }  // no copy outlives its warp

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
