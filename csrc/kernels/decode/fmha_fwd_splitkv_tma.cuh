// mhakit decode_tma family (sm_90a): the split-KV forward of the decode family with its K/V loads done by TMA.
//
// Why: the decode family's loads (cp.async, one 16-byte copy per instruction with its address arithmetic) made it
// issue-bound on the H200 (ncu: 91 % of the instructions in the K/V loads). Here one producer warp moves a whole K or
// V block with a few TMA instructions into an mbarrier-tracked ring, and the consumer warps only compute.
//
// Work and arithmetic are the decode family's (fmha_fwd_splitkv.cuh): one CTA per (kv head, key split, row chunk,
// batch); its query tile packs the query heads of the kv head x seqlen_q rows (cache_rows.cuh, packed_row). Up to
// block_m rows, the key split (a call with <= 16 rows runs a one-row-tile kernel of the same instance): consumer warp
// w takes keys [16w, 16w + 16) of every block of block_n = 16 x warps keys with its own online softmax (S = Q·Kᵀ,
// mask, P, O += P·V by mma.sync), and the warps' partial results meet in shared memory at the end (combine_warps).
// More rows, the row split: warp w owns rows [16w, 16w + 16) of a chunk of warps x 16 rows and walks every key of a
// block (stage_own_rows at the end); the ring has one slot fewer there (its Q tile is larger). Results go out as the
// decode family writes them (write_result: O / LSE, or the fp32 partials for splitkv_combine.cuh). The split
// heuristic, the append kernel and the combine kernel are the decode family's; the combine runs as a programmatic
// dependent of this kernel (common/dependent_launch.h: every CTA triggers its dependents at its start, the combine
// waits for this grid's results before reading them), so that a split call has no launch gap between the two.
//
// Warps: consumers 0 .. warps - 1, the producer warp last. Ring: `stages` slots, each a K block and a V block of
// block_n rows, stored as 64-column boxes (128 bytes a row) with TMA's 128-byte swizzle (16-byte chunk c of row r at
// chunk c ^ (r % 8)), so that the consumers' ldmatrix reads of 8 rows at one column hit 8 different bank groups.
// Barriers per slot: full (1 arrival + the TMA bytes: the producer's arrive_and_expect_tx) and empty (one arrival per
// consumer warp once it has read the slot). Block i of the CTA uses slot i % stages for the (i / stages)-th time u:
// consumers wait for phase u of full, the producer for phase u - 1 of empty before refilling (u >= 1).
//
// Loads: the cache is a 4-D TMA tensor (head dim, row, kv head, cache batch or page) with the caller's strides in
// bytes. Only whole blocks inside [0, cache length + new rows) go through TMA, so no box ever reaches past a batch's
// rows (the API does not say how many rows a contiguous cache holds, so the row and batch extents given to TMA are
// only bounds on the coordinates). The block that holds the cache end (the last block of the last split) is loaded by
// the producer warp's 32 lanes with cp.async into the same swizzled slot, rows past the end zero-filled (caches may
// hold NaN there), and signalled through the same full barrier by one plain arrival. Paged caches: a page holds whole
// blocks (page_block_size a multiple of block_n: the run-time guard), so a block is one box per 64 columns; the
// producer reads the block table 32 blocks at a time (a lane per block) and passes each page on by a shuffle.
// L2 prefetch (the tile's prefetch = P > 0): before it waits for block i's slot, the producer prefetches whole block
// i + P into L2 (one cp.async.bulk.prefetch.tensor per box; blocks of the first ring fill are loaded at once and not
// prefetched), so that P more blocks per CTA are on their way than the ring holds; paged, the prefetched blocks'
// pages come from a second 32-block window of the block table.
//
// What the instance refuses (supports(), then the decode family serves the call): pages that do not hold whole
// blocks, strides TMA cannot take. The static guards (catalogue): 16-byte aligned tensors, head dims multiples of 8.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <atomic>

#include "cute/arch/copy_sm90_desc.hpp"
#include "cute/arch/copy_sm90_tma.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/cuda_host_adapter.hpp"
#include "fmha_fwd_splitkv.cuh"

namespace mhakit::decode {

namespace tma_detail {

using namespace detail;
namespace ptx = generic::ptx;

constexpr int kBoxCols = 64;     // 16-bit elements per TMA box row: 128 bytes, the 128-byte swizzle's span
constexpr int kRowBytes = 128;   // bytes of one row of a box in shared memory
constexpr int kConsumerBarrier = 1;  // named barrier of the consumer warps (0 is __syncthreads)

template <mhakit_dtype kDtype, int kHdimQ_, int kHdimV_, int kRowTiles, int kWarps_, int kStages_, int kPrefetch_,
          int kCtasPerSm_ = 0>
struct TmaConfig {
    // The decode family's config of the same tile: padded Q rows, WarpView, 16 keys per consumer warp.
    using Base = SplitkvConfig<kDtype, kHdimQ_, kHdimV_, kRowTiles, kWarps_, 16, kStages_>;
    static constexpr int kHdimQ = kHdimQ_, kHdimV = kHdimV_, kWarps = kWarps_, kStages = kStages_;
    static constexpr int kPrefetch = kPrefetch_;  // blocks the producer prefetches into L2 ahead of its loads
    static_assert(kPrefetch >= 0 && kPrefetch <= 32, "a prefetch distance within one block-table window");
    // At most this many CTAs per SM (0: as many as their shared memory lets fit): a cap on the bytes an SM keeps in
    // flight (CTAs x slots x slot bytes), applied by asking for enough shared memory that one CTA more cannot fit.
    static constexpr int kCtasPerSm = kCtasPerSm_;
    static_assert(kCtasPerSm >= 0 && kCtasPerSm <= 8, "a cap of CTAs per SM");
    static constexpr int kConsumers = kWarps * 32;
    static constexpr int kThreads = kConsumers + 32;  // + the producer warp
    static constexpr int kBlockN = Base::kBlockN;
    static constexpr int kSQ = Base::kSQ;
    static_assert(kHdimQ % kBoxCols == 0 && kHdimV % kBoxCols == 0, "head-dim buckets of whole 64-column boxes");
    static_assert(kBlockN <= 256, "a TMA box has at most 256 rows");
    static constexpr int kBoxesK = kHdimQ / kBoxCols, kBoxesV = kHdimV / kBoxCols;
    static constexpr int kBoxBytes = kBlockN * kRowBytes;  // a multiple of 1024: every box keeps the swizzle's phase
    static constexpr int kKBytes = kBoxesK * kBoxBytes, kVBytes = kBoxesV * kBoxBytes;
    static constexpr int kSlotBytes = kKBytes + kVBytes;

    // Shared memory of a kernel: key split with kMT row tiles, or row split (kWarps x 16 rows, one row tile per
    // warp, and one slot fewer than the tile's stages, at least two, so that as many CTAs fit an SM as with the key
    // split's smaller Q tile): the ring (reused after the key loop for the fp32 partial results), the Q tile, the
    // barriers; plus 1 KB to align the ring to the swizzle's 1024-byte pattern.
    template <int kMT, bool kRowSplit>
    struct Smem {
        static constexpr int kRows = kRowSplit ? kWarps * 16 : 16 * kMT;
        static constexpr int kSlots = kRowSplit && kStages > 2 ? kStages - 1 : kStages;
        static constexpr int kRing = kSlots * kSlotBytes;
        static constexpr int kCombine = (kRowSplit ? 1 : kWarps) * kRows * (kHdimV + 2) * 4;
        static constexpr int kQ = kRing > kCombine ? kRing : kCombine;  // byte offset of the Q tile
        static constexpr int kBarriers = (kQ + kRows * kSQ * 2 + 7) / 8 * 8;
        static constexpr int kBytes = kBarriers + 2 * kSlots * 8;
        // With a cap of kCtasPerSm CTAs per SM: a size (16-byte multiple) at which kCtasPerSm + 1 CTAs, each with its
        // 1 KB reserved, exceed an SM's 228 KB; the bytes past kBytes + 1024 are never touched.
        static constexpr int kCapped = kCtasPerSm > 0 ? (233472 / (kCtasPerSm + 1) - 1024 + 16) / 16 * 16 : 0;
        static constexpr int kDynamic = kBytes + 1024 > kCapped ? kBytes + 1024 : kCapped;
        // CTAs one SM holds (228 KB, 1 KB of it reserved per CTA), and the registers per thread that let them all
        // stay resident (64 K per SM, in units of 8): the kernel's register cap. (__launch_bounds__' minimum of
        // CTAs per SM gave ptxas a lower cap: 168 registers and spills at d128 with two row tiles.)
        static constexpr int kPerSm = 233472 / (kDynamic + 1024) > 0 ? 233472 / (kDynamic + 1024) : 1;
        static constexpr int kMaxRegs = (65536 / (kPerSm * kThreads)) / 8 * 8 > 255
                                            ? 255
                                            : (65536 / (kPerSm * kThreads)) / 8 * 8;
    };
};

__device__ __forceinline__ void named_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// S (kMT row tiles x the warp's W::kKeys keys, in groups of 16) = Q·Kᵀ: Q from its padded tile (sQ_a: this lane's
// ldmatrix address at column 0 of the warp's first row), K from a swizzled slot. k_lane: byte offset of this lane's
// K row in a box (for the first 16-key group; group np is 16 rows further); kx: its chunk XOR (see the kernel).
// kFull: the real hdim_q fills the bucket, else only its first ceil(hdim_q / 16) column steps.
template <class W, int kBoxBytes, bool kFull>
__device__ __forceinline__ void qk_swizzled(float (&s)[W::kMT][W::kNT][4], uint32_t sQ_a, uint32_t k_lane, int kx,
                                            int hdim_q) {
    using Mma = ptx::Mma<W::kDtype>;
    constexpr int kNP = W::kNT / 2;  // 16-key groups
    const int kq = kFull ? W::kKQ : (hdim_q + 15) >> 4;
#pragma unroll
    for (int kk = 0; kk < W::kKQ; ++kk) {
        if (!kFull && kk >= kq) break;
        uint32_t a[W::kMT][4];
#pragma unroll
        for (int mt = 0; mt < W::kMT; ++mt) ptx::ldmatrix_x4(a[mt], sQ_a + (mt * 16 * W::kSQ + kk * 16) * 2);
        const uint32_t k_col = (kk >> 2) * kBoxBytes + ((kx ^ ((kk & 3) << 1)) << 4);
#pragma unroll
        for (int np = 0; np < kNP; ++np) {
            uint32_t bk[4];
            ptx::ldmatrix_x4(bk, k_lane + np * 16 * kRowBytes + k_col);
#pragma unroll
            for (int mt = 0; mt < W::kMT; ++mt) {
                Mma::mma(s[mt][2 * np], a[mt], bk[0], bk[1]);
                Mma::mma(s[mt][2 * np + 1], a[mt], bk[2], bk[3]);
            }
        }
    }
}

// O += P·V over the warp's keys (16-key chunks kk), V from a swizzled slot (v_lane, vx: this lane's row offset in
// the first chunk and its chunk XOR; chunk kk is 16 rows further).
template <class W, int kBoxBytes, bool kFull>
__device__ __forceinline__ void pv_swizzled(float (&acc_o)[W::kMT][W::kOT][4],
                                            const uint32_t (&p_frag)[W::kMT][W::kKV][4], uint32_t v_lane, int vx,
                                            int hdim_v) {
    using Mma = ptx::Mma<W::kDtype>;
    constexpr int kNP = W::kOT / 2;
    const int nv = kFull ? kNP : (hdim_v + 15) >> 4;
#pragma unroll
    for (int kk = 0; kk < W::kKV; ++kk) {
#pragma unroll
        for (int np = 0; np < kNP; ++np) {
            if (!kFull && np >= nv) break;
            uint32_t bv[4];
            ptx::ldmatrix_x4_trans(bv, v_lane + kk * 16 * kRowBytes + (np >> 2) * kBoxBytes +
                                           ((vx ^ ((np & 3) << 1)) << 4));
#pragma unroll
            for (int mt = 0; mt < W::kMT; ++mt) {
                Mma::mma(acc_o[mt][2 * np], p_frag[mt][kk], bv[0], bv[1]);
                Mma::mma(acc_o[mt][2 * np + 1], p_frag[mt][kk], bv[2], bv[3]);
            }
        }
    }
}

// The block that holds the cache end, by the producer warp's lanes: rows [0, valid) of rows(r) (the row's first
// element) into kBoxes swizzled boxes at dst, zeros past `valid` rows and past `cols` columns. cp.async, waited for
// here: the caller signals the slot's full barrier afterwards.
template <int kBlockN, int kBoxes, class RowPtr>
__device__ __forceinline__ void load_tail(unsigned char* dst, RowPtr&& row_ptr, int valid, int cols,
                                          const uint16_t* any, int lane) {
    constexpr int kChunks = kBoxes * (kBoxCols / 8);  // 16-byte chunks per row
    static_assert((kBlockN * kChunks) % 32 == 0, "every lane copies the same number of chunks");
#pragma unroll 4
    for (int idx = lane; idx < kBlockN * kChunks; idx += 32) {
        const int r = idx / kChunks, c = idx - r * kChunks;
        const int bytes = r < valid ? generic::detail::chunk_bytes(cols - c * 8) : 0;
        const uint16_t* src = bytes > 0 ? row_ptr(r) + c * 8 : any;
        const uint32_t off = (c >> 3) * (kBlockN * kRowBytes) + r * kRowBytes + (((c & 7) ^ (r & 7)) << 4);
        ptx::cp_async_16(ptx::smem_addr(dst + off), src, bytes);
    }
    ptx::cp_async_commit();
    ptx::cp_async_wait<0>();
}

// The ring kernels' dynamic shared memory, 1024-byte aligned (the 128-byte swizzle's period).
__device__ __forceinline__ unsigned char* aligned_smem(unsigned char* raw) {
    return reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
}

// Thread 0 makes the ring's barriers: per slot, full (the producer's one arrival + the TMA bytes) and empty (one
// arrival per consumer warp). The caller synchronises the block before any use.
template <int kStages, int kWarps>
__device__ __forceinline__ void init_ring(uint64_t* full_bar, uint64_t* empty_bar, int tid) {
    if (tid != 0) return;
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
        cutlass::arch::ClusterTransactionBarrier::init(&full_bar[s], 1);
        cutlass::arch::ClusterTransactionBarrier::init(&empty_bar[s], kWarps);
    }
    cutlass::arch::fence_barrier_init();
}

// The producer warp's loop: blocks [keys.blk_begin, + keys.n_blocks) of batch b, kv head hk into the ring of kStages
// slots at smem (full / empty barriers per slot, see the file comment). Shared by the mma.sync consumers here and the
// wgmma consumers (fmha_fwd_splitkv_wgmma.cuh). kAsyncReaders: the consumers read the slots through the async proxy
// (wgmma), so the lanes that fill the cache-end block with cp.async (generic proxy writes) fence them into the async
// proxy before the slot is signalled full.
template <class Cfg, int kStages, bool kAsyncReaders>
__device__ __forceinline__ void produce_blocks(unsigned char* smem, uint64_t* full_bar, uint64_t* empty_bar,
                                               const CUtensorMap& tma_k, const CUtensorMap& tma_v,
                                               const SplitkvParams& p, const SplitKeys& keys, int b, int hk, int lane) {
    using Barrier = cutlass::arch::ClusterTransactionBarrier;
    constexpr int kBlockN = Cfg::kBlockN, kBoxBytes = Cfg::kBoxBytes;
    const int n_blocks = keys.n_blocks;
    if (lane == 0) {
        cute::prefetch_tma_descriptor(reinterpret_cast<const cute::TmaDescriptor*>(&tma_k));
        cute::prefetch_tma_descriptor(reinterpret_cast<const cute::TmaDescriptor*>(&tma_v));
    }
    const CacheRows<const uint16_t> kc = cache_rows<false, const uint16_t>(p, b, hk);
    const CacheRows<const uint16_t> vc = cache_rows<true, const uint16_t>(p, b, hk);
    const bool paged = kc.pages != nullptr;
    const int cache_b = (!paged && p.cache_batch_idx != nullptr) ? __ldg(p.cache_batch_idx + b) : b;
    // Boxes that hold real columns (a bucket wider than the head dim leaves the last ones unread) and their bytes.
    const int boxes_k = (p.hdim_q + kBoxCols - 1) / kBoxCols, boxes_v = (p.hdim_v + kBoxCols - 1) / kBoxCols;
    const uint32_t tx_bytes = uint32_t(boxes_k + boxes_v) * kBoxBytes;
    constexpr uint64_t kEvictFirst = uint64_t(cute::TMA::CacheHintSm90::EVICT_FIRST);  // each byte read once
    int lane_page = 0;  // paged: the page of block (i & ~31) + lane
    int lane_page_ahead = 0;  // paged, prefetching: the page of block ((i + kPrefetch) & ~31) + lane
    for (int i = 0; i < n_blocks; ++i) {
        const int n0 = (keys.blk_begin + i) * kBlockN;
        if (paged && (i & 31) == 0) {
            const int j = i + lane;
            lane_page = j < n_blocks ? __ldg(kc.pages + kc.page_slot((keys.blk_begin + j) * kBlockN)) : 0;
        }
        const int page = paged ? __shfl_sync(0xffffffffu, lane_page, i & 31) : 0;
        if constexpr (Cfg::kPrefetch > 0) {
            // L2 prefetch of block i + kPrefetch (a whole block past the ring's first fill), so that its bytes
            // are on their way kPrefetch loads before the slot for it frees.
            const int ahead = i + Cfg::kPrefetch;
            if (paged && (i == 0 || (ahead & 31) == 0)) {
                const int j = (ahead & ~31) + lane;
                lane_page_ahead =
                    j < n_blocks ? __ldg(kc.pages + kc.page_slot((keys.blk_begin + j) * kBlockN)) : 0;
            }
            const int page_ahead = paged ? __shfl_sync(0xffffffffu, lane_page_ahead, ahead & 31) : 0;
            const int a0 = (keys.blk_begin + ahead) * kBlockN;
            if (lane == 0 && ahead >= kStages && ahead < n_blocks && keys.sk - a0 >= kBlockN) {
                const int row = paged ? kc.in_page(a0) : a0;
                const int outer = paged ? page_ahead : cache_b;
                for (int x = 0; x < boxes_k; ++x)
                    cute::SM90_TMA_LOAD_4D::PREFETCH::copy(&tma_k, x * kBoxCols, row, hk, outer);
                for (int x = 0; x < boxes_v; ++x)
                    cute::SM90_TMA_LOAD_4D::PREFETCH::copy(&tma_v, x * kBoxCols, row, hk, outer);
            }
        }
        const int st = i % kStages, use = i / kStages;
        if (use > 0) Barrier::wait(&empty_bar[st], (use - 1) & 1);
        unsigned char* slot = smem + st * Cfg::kSlotBytes;
        const int valid = keys.sk - n0;
        if (valid >= kBlockN) {
            if (lane == 0) {
                Barrier::arrive_and_expect_tx(&full_bar[st], tx_bytes);
                const int row = paged ? kc.in_page(n0) : n0;
                const int outer = paged ? page : cache_b;
                for (int x = 0; x < boxes_k; ++x)
                    cute::SM90_TMA_LOAD_4D::copy(&tma_k, &full_bar[st], kEvictFirst, slot + x * kBoxBytes,
                                                 x * kBoxCols, row, hk, outer);
                for (int x = 0; x < boxes_v; ++x)
                    cute::SM90_TMA_LOAD_4D::copy(&tma_v, &full_bar[st], kEvictFirst,
                                                 slot + Cfg::kKBytes + x * kBoxBytes, x * kBoxCols, row, hk,
                                                 outer);
            }
        } else {
            const int v_rows = valid > 0 ? valid : 0;
            if (paged) {
                load_tail<kBlockN, Cfg::kBoxesK>(
                    slot, [&](int r) { return kc.row_in_page(page, n0 + r); }, v_rows, p.hdim_q, kc.base, lane);
                load_tail<kBlockN, Cfg::kBoxesV>(
                    slot + Cfg::kKBytes, [&](int r) { return vc.row_in_page(page, n0 + r); }, v_rows, p.hdim_v,
                    vc.base, lane);
            } else {
                load_tail<kBlockN, Cfg::kBoxesK>(
                    slot, [&](int r) { return kc.base + int64_t(n0 + r) * kc.row_stride; }, v_rows, p.hdim_q,
                    kc.base, lane);
                load_tail<kBlockN, Cfg::kBoxesV>(
                    slot + Cfg::kKBytes, [&](int r) { return vc.base + int64_t(n0 + r) * vc.row_stride; },
                    v_rows, p.hdim_v, vc.base, lane);
            }
            // wgmma reads the slot through the async proxy: each lane's completed copies are made visible to it.
            if constexpr (kAsyncReaders) asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            __syncwarp();  // every lane's copies are complete (each waited for its own)
            if (lane == 0) Barrier::arrive(&full_bar[st]);
        }
    }
}

template <class Cfg, int kMT, bool kRowSplit>
__global__ void __launch_bounds__(Cfg::kThreads) __maxnreg__((Cfg::template Smem<kMT, kRowSplit>::kMaxRegs))
    splitkv_tma_kernel(const __grid_constant__ CUtensorMap tma_k, const __grid_constant__ CUtensorMap tma_v,
                       const SplitkvParams p) {
    using Base = typename Cfg::Base;
    using W = WarpView<Base, kMT, kRowSplit>;
    using S = typename Cfg::template Smem<kMT, kRowSplit>;
    using Barrier = cutlass::arch::ClusterTransactionBarrier;
    constexpr int kBlockM = S::kRows, kBlockN = Cfg::kBlockN, kStages = S::kSlots, kWarps = Cfg::kWarps;
    constexpr int kSQ = Cfg::kSQ, kBoxBytes = Cfg::kBoxBytes;

    extern __shared__ unsigned char smem_raw[];
    unsigned char* smem = aligned_smem(smem_raw);
    uint16_t* sQ = reinterpret_cast<uint16_t*>(smem + S::kQ);
    uint64_t* full_bar = reinterpret_cast<uint64_t*>(smem + S::kBarriers);
    uint64_t* empty_bar = full_bar + kStages;

    // The combine kernel (a programmatic dependent, launched only when the call is split) may be scheduled as soon as
    // every CTA of this grid has started: it waits for this grid's results before reading them. This grid is itself
    // a programmatic dependent of the append kernel when the call appends rows: nothing global is read before the
    // append's writes are visible (a no-op otherwise).
    trigger_dependents();
    wait_for_primary();

    const SplitkvWork work = splitkv_work(p, kBlockM);
    const int split = work.split, hk = work.hk, b = work.b, group = work.group;
    const int rows_total = work.rows_total, row0 = work.row0, rows = work.rows;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const SplitKeys keys = split_keys<kBlockN>(p, b, split, row0, rows, group);
    const int n_blocks = keys.n_blocks;

    init_ring<kStages, kWarps>(full_bar, empty_bar, tid);
    __syncthreads();

    // ---------------- producer warp ----------------
    if (warp == kWarps) {
        if (n_blocks == 0) return;
        produce_blocks<Cfg, kStages, false>(smem, full_bar, empty_bar, tma_k, tma_v, p, keys, b, hk, lane);
        return;
    }

    // ---------------- consumer warps ----------------
    // Key split: warp w computes keys [16w, 16w + 16) of every block for all rows of the tile; row split: rows
    // [16w, 16w + 16) of the tile against every key of the block.
    const int warp_row0 = kRowSplit ? warp * 16 : 0, warp_key0 = kRowSplit ? 0 : warp * 16;
    int row_lo[kMT][2], row_hi[kMT][2];
    row_bounds<kMT>(row_lo, row_hi, keys.geom, row0 + warp_row0, rows_total, group);

    if (n_blocks > 0) {
        const uint16_t* q0 = static_cast<const uint16_t*>(p.q) + b * p.q_batch_stride;
        load_rows<kBlockM, Cfg::kHdimQ / 8, kSQ, Cfg::kConsumers>(
            sQ,
            [&](int r) {
                const PackedRow pr = packed_row(row0 + r, group, hk);
                return q0 + pr.head * p.q_head_stride + int64_t(pr.qi) * p.q_row_stride;
            },
            q0, rows, ((p.hdim_q + 15) >> 4) << 1, p.hdim_q, /*aligned=*/true, tid);
        ptx::cp_async_commit();
        ptx::cp_async_wait<0>();
    }
    named_sync(kConsumerBarrier, Cfg::kConsumers);  // the Q tile is complete

    // ldmatrix lane addresses. Q: padded rows, as in the decode family. K (B operand of Q·Kᵀ, not transposed):
    // matrices (keys 0-7 | 8-15) x (columns 0-7 | 8-15) of a 16-key group and 16-column step; lane l gives row
    // warp_key0 + l % 8 + 8 (l / 16) (+ 16 per group) at chunk 2 kk + (l / 8) % 2. V (transposed): rows warp_key0 +
    // l % 8 + 8 ((l / 8) % 2) (+ 16 per key chunk), chunk 2 np + l / 16. Every such row is 8-aligned plus l % 8, so
    // the swizzle XORs its chunk with l % 8 and the chunk index 2 step + bit becomes (bit ^ l % 8) ^ 2 (step % 4) in
    // box step / 4.
    const uint32_t sQ_a = ptx::smem_addr(sQ + (warp_row0 + (lane & 15)) * kSQ + ((lane >> 4) << 3));
    const uint32_t ring = ptx::smem_addr(smem);
    const uint32_t k_lane = uint32_t(warp_key0 + (lane & 7) + ((lane >> 4) << 3)) * kRowBytes;
    const uint32_t v_lane = uint32_t(warp_key0 + (lane & 7) + (((lane >> 3) & 1) << 3)) * kRowBytes;
    const int kx = ((lane >> 3) & 1) ^ (lane & 7), vx = (lane >> 4) ^ (lane & 7);
    const bool q_full = p.hdim_q > Cfg::kHdimQ - 16, v_full = p.hdim_v > Cfg::kHdimV - 16;

    float acc_o[kMT][W::kOT][4];
    zero_fragments(acc_o);
    generic::detail::OnlineSoftmax<kMT> softmax;
    for (int i = 0; i < n_blocks; ++i) {
        const int st = i % kStages, use = i / kStages, blk = keys.blk_begin + i;
        Barrier::wait(&full_bar[st], use & 1);
        const uint32_t slot = ring + uint32_t(st * Cfg::kSlotBytes);
        float s[kMT][W::kNT][4];
        zero_fragments(s);
        if (q_full)
            qk_swizzled<W, kBoxBytes, true>(s, sQ_a, slot + k_lane, kx, p.hdim_q);
        else
            qk_swizzled<W, kBoxBytes, false>(s, sQ_a, slot + k_lane, kx, p.hdim_q);
        if (!keys.full.contains(blk)) generic::detail::mask_s<W>(s, row_lo, row_hi, blk * kBlockN + warp_key0);
        softmax.template update<true>(s, acc_o, p.scale_log2);
        uint32_t p_frag[kMT][W::kKV][4];
        generic::detail::pack_p<W>(p_frag, s);
        if (v_full)
            pv_swizzled<W, kBoxBytes, true>(acc_o, p_frag, slot + Cfg::kKBytes + v_lane, vx, p.hdim_v);
        else
            pv_swizzled<W, kBoxBytes, false>(acc_o, p_frag, slot + Cfg::kKBytes + v_lane, vx, p.hdim_v);
        __syncwarp();  // every lane's reads of the slot are done
        if (lane == 0) Barrier::arrive(&empty_bar[st]);
    }

    // ---- the partial results meet in shared memory (the ring is free: every block was waited for) ----
    named_sync(kConsumerBarrier, Cfg::kConsumers);
    finish_tile<W, kWarps, kRowSplit, kBlockM, Cfg::kConsumers>(smem, acc_o, softmax, p, warp_row0, b, hk, split, row0,
                                                                rows, group, tid,
                                                                [] { named_sync(kConsumerBarrier, Cfg::kConsumers); });
}

// Bytes of a stride as TMA takes it: a mode of extent 1 is never stepped, so any legal stride (16) stands in.
inline uint64_t tma_stride(int64_t elems, bool used) { return used ? uint64_t(elems) * 2u : 16u; }

// A stride TMA can take: a positive multiple of 16 bytes below 2^40 (unused modes are replaced, see tma_stride).
inline bool tma_stride_ok(int64_t elems, bool used) {
    if (!used) return true;
    return elems > 0 && (elems * 2) % 16 == 0 && elems * 2 < (int64_t(1) << 40);
}

// Which modes of a cache tensor are stepped: heads when there are several; the outer mode (cache batch or page) when
// the cache is paged, has several batches, or is reached through cache_batch_idx.
struct CacheModes {
    bool head, outer;
};
inline CacheModes cache_modes(const SplitkvParams& p) {
    return CacheModes{p.nhead_k > 1, p.block_table != nullptr || p.batch > 1 || p.cache_batch_idx != nullptr};
}

// The run-time guard of a TMA ring of kBlockN-key blocks (decode_tma's mma.sync and wgmma kernels): the grid fits
// (x: kv heads x splits x row chunks, z: batches), pages hold whole blocks, TMA takes the cache strides.
inline bool tma_supports(const SplitkvParams& p, long long row_chunks, int block_n) {
    const CacheModes used = cache_modes(p);
    if (p.batch > 65535 || row_chunks * MHAKIT_MAX_SPLITS * p.nhead_k >= (1LL << 31)) return false;
    if (p.block_table != nullptr && p.page_block_size % block_n != 0) return false;
    return tma_stride_ok(p.k_row_stride, true) && tma_stride_ok(p.k_head_stride, used.head) &&
           tma_stride_ok(p.k_batch_stride, used.outer) && tma_stride_ok(p.v_row_stride, true) &&
           tma_stride_ok(p.v_head_stride, used.head) && tma_stride_ok(p.v_batch_stride, used.outer);
}

// The TMA descriptor of the K (or V) cache: (head dim, row, kv head, cache batch or page), boxes of 64 columns x
// kBlockN rows x 1 x 1, 128-byte swizzle. Rows: a page's rows when paged, else a bound on the row coordinate (only
// boxes within a batch's filled rows are ever loaded); the outer extent likewise bounds the coordinate.
// kL2Promotion: the bytes L2 fetches around each line a load misses (0, 64, 128 or 256).
template <int kBlockN, int kL2Promotion>
inline CUresult encode_cache(CUtensorMap* map, mhakit_dtype dtype, const void* base, int hdim, int64_t row_stride,
                             int64_t head_stride, int64_t outer_stride, const SplitkvParams& p) {
    const CacheModes used = cache_modes(p);
    const cuuint64_t bound = cuuint64_t(1) << 31;  // coordinates are int32
    const cuuint64_t dims[4] = {cuuint64_t(hdim), p.block_table != nullptr ? cuuint64_t(p.page_block_size) : bound,
                                cuuint64_t(p.nhead_k), bound};
    const cuuint64_t strides[3] = {tma_stride(row_stride, true), tma_stride(head_stride, used.head),
                                   tma_stride(outer_stride, used.outer)};
    const cuuint32_t box[4] = {cuuint32_t(kBoxCols), cuuint32_t(kBlockN), 1u, 1u};
    const cuuint32_t elem_strides[4] = {1u, 1u, 1u, 1u};
    return CUTLASS_CUDA_DRIVER_WRAPPER_CALL(cuTensorMapEncodeTiled)(
        map, dtype == MHAKIT_DTYPE_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4u,
        const_cast<void*>(base), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
        CU_TENSOR_MAP_SWIZZLE_128B,
        kL2Promotion == 256   ? CU_TENSOR_MAP_L2_PROMOTION_L2_256B
        : kL2Promotion == 128 ? CU_TENSOR_MAP_L2_PROMOTION_L2_128B
        : kL2Promotion == 64  ? CU_TENSOR_MAP_L2_PROMOTION_L2_64B
                              : CU_TENSOR_MAP_L2_PROMOTION_NONE,
        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

}  // namespace tma_detail

// kL2Promotion: the K / V tensor maps' L2 promotion in bytes. 128 streams faster than 256 (measured on the H200,
// 2026-11-24: +3-7 % of K + V read per second on issue 10's s_q = 1 rows; docs/PERFORMANCE.md, "decode_tma: the L2
// promotion"); the catalogue may name another value (l<bytes> in the instance name).
template <mhakit_dtype kDtype, int kHdimQ, int kHdimV, int kBlockM, int kBlockN, int kWarps, int kStages,
          int kPrefetch, int kCtasPerSm = 0, int kL2Promotion = 128>
struct SplitkvTmaKernel {
    static_assert(kBlockM % 16 == 0 && kBlockN == 16 * kWarps, "tile: 16-row tiles, 16 keys per consumer warp");
    static_assert(kL2Promotion == 0 || kL2Promotion == 64 || kL2Promotion == 128 || kL2Promotion == 256,
                  "an L2 promotion a tensor map has");
    using Cfg = tma_detail::TmaConfig<kDtype, kHdimQ, kHdimV, kBlockM / 16, kWarps, kStages, kPrefetch, kCtasPerSm>;
    template <int kMT, bool kRowSplit>
    using Smem = typename Cfg::template Smem<kMT, kRowSplit>;
    static_assert(Smem<kBlockM / 16, false>::kDynamic <= 232448 && Smem<1, true>::kDynamic <= 232448,
                  "decode_tma tile needs more than 227 KB");

    // The kernel a call runs, as in the decode family: one row tile (<= 16 packed rows), the key split's full tile
    // (<= block_m rows), or the row split (more rows: chunks of warps x 16 rows, each reading the keys once).
    enum class Shape { kOneTile, kKeySplit, kRowSplit };
    static long long packed_rows(const SplitkvParams& p) { return (long long)(p.nhead_q / p.nhead_k) * p.seqlen_q; }
    static Shape shape(const SplitkvParams& p) {
        const long long rows = packed_rows(p);
        return rows <= 16 ? Shape::kOneTile : rows <= kBlockM ? Shape::kKeySplit : Shape::kRowSplit;
    }
    static int tile_rows(const SplitkvParams& p) {
        switch (shape(p)) {
            case Shape::kOneTile: return Smem<1, false>::kRows;
            case Shape::kKeySplit: return Smem<kBlockM / 16, false>::kRows;
            default: return Smem<1, true>::kRows;
        }
    }
    static int smem_bytes(const SplitkvParams& p) {
        switch (shape(p)) {
            case Shape::kOneTile: return Smem<1, false>::kDynamic;
            case Shape::kKeySplit: return Smem<kBlockM / 16, false>::kDynamic;
            default: return Smem<1, true>::kDynamic;
        }
    }
    static long long row_chunks(const SplitkvParams& p) {
        return (packed_rows(p) + tile_rows(p) - 1) / tile_rows(p);
    }

    // Run-time guard beyond the runtime's checks and the static guards (16-byte alignment, head dims multiples of
    // 8): pages hold whole blocks, TMA takes the cache strides, the grid fits (x: kv heads x splits x row chunks).
    // Pure host arithmetic.
    static bool supports(const SplitkvParams& p) { return tma_detail::tma_supports(p, row_chunks(p), kBlockN); }

    // The split count for num_splits = 0: the decode family's heuristic, waves of one CTA per SM (a TMA ring).
    static int num_splits(const SplitkvParams& p, int /*smem_per_sm*/) {
        return heuristic_splits(p, row_chunks(p) * p.nhead_k * p.batch, kBlockN, kTmaRingCtasPerSm);
    }

    // after_append: launched as a programmatic dependent of the append kernel just launched.
    template <int kMT, bool kRowSplit>
    static cudaError_t launch(const SplitkvParams& p, const CUtensorMap& tma_k, const CUtensorMap& tma_v,
                              bool after_append, cudaStream_t stream) {
        auto kernel = tma_detail::splitkv_tma_kernel<Cfg, kMT, kRowSplit>;
        constexpr int smem = Smem<kMT, kRowSplit>::kDynamic;
        static std::atomic<uint64_t> opted_in{0};
        if (cudaError_t err = opt_in_dynamic_smem(kernel, smem, opted_in); err != cudaSuccess) return err;
        const long long ctas = row_chunks(p) * p.num_splits * p.nhead_k;
        const dim3 grid(unsigned(ctas), 1, p.batch);
        if (after_append) return launch_dependent(kernel, grid, dim3(Cfg::kThreads), smem, stream, tma_k, tma_v, p);
        kernel<<<grid, Cfg::kThreads, smem, stream>>>(tma_k, tma_v, p);
        return cudaGetLastError();
    }

    // Append (new k/v), attend (num_splits parts), combine (when split), each kernel after the first a programmatic
    // dependent of the one before. No allocation, no synchronisation.
    static cudaError_t run(const SplitkvParams& p, cudaStream_t stream) {
        if (cudaError_t err = detail::append_kv(p, stream); err != cudaSuccess) return err;
        if (p.batch <= 0 || p.seqlen_q <= 0) return cudaSuccess;
        const bool after_append = p.seqlen_new > 0;  // append_kv launched a kernel
        alignas(64) CUtensorMap tma_k, tma_v;
        using tma_detail::encode_cache;
        if (encode_cache<kBlockN, kL2Promotion>(&tma_k, kDtype, p.k_cache, p.hdim_q, p.k_row_stride, p.k_head_stride,
                                                p.k_batch_stride, p) != CUDA_SUCCESS ||
            encode_cache<kBlockN, kL2Promotion>(&tma_v, kDtype, p.v_cache, p.hdim_v, p.v_row_stride, p.v_head_stride,
                                                p.v_batch_stride, p) != CUDA_SUCCESS)
            return cudaErrorInvalidValue;  // supports() admitted only what TMA takes: not expected
        cudaError_t err;
        switch (shape(p)) {
            case Shape::kOneTile: err = launch<1, false>(p, tma_k, tma_v, after_append, stream); break;
            case Shape::kKeySplit: err = launch<kBlockM / 16, false>(p, tma_k, tma_v, after_append, stream); break;
            default: err = launch<1, true>(p, tma_k, tma_v, after_append, stream); break;
        }
        if (err != cudaSuccess || p.num_splits == 1) return err;
        return detail::combine_splits<kDtype>(p, stream, /*dependent=*/true);
    }
};

}  // namespace mhakit::decode
