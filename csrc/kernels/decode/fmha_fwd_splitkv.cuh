// mhakit decode family: split-KV forward attention against a (paged) KV cache, for sm_80 and newer.
//
// Work: one CTA per (kv head, key split, packed row chunk, batch), the kv head varying fastest in launch order (CTAs
// running together read neighbouring bytes of each cache row). Packed GQA: the CTA's query tile holds the rows of
// every query head of its kv head (group = nhead_q / nhead_k) for every query row (cache_rows.cuh, packed_row), so
// each K/V byte is read once per group, not once per query head. Two ways to spread a tile over the warps:
//   key split (tiles of up to block_m rows: decode's few rows): warp w takes keys [w·16, (w+1)·16) of every block of
//     kBlockN keys and keeps its own online softmax over all the tile's rows; at the end the warps' partial results
//     meet in shared memory (combine_warps);
//   row split (more rows than block_m: s_q x group beyond it): warp w owns 16 rows and walks every key of a block,
//     so that a tile of warps x 16 rows reads each block once (the key split would need more row chunks, each
//     reading the keys again).
// The split's rows then go to O / LSE directly (one split) or, as fp32 partials, to o_acc / lse_acc for the combine
// kernel (splitkv_combine.cuh).
//
// Per block of kBlockN keys, per warp (the generic family's mma.sync pieces over a warp-sized view, WarpView):
//   S = Q·Kᵀ (gemm_qk), element mask only on blocks that are not full for every row of the tile (MaskGeometry of
//   the bottom-right / window / generic mask over seqlen_q queries and the batch's cache length + new rows),
//   online softmax (OnlineSoftmax; O is rescaled only when some row's max moved), O += P·V (gemm_pv).
// Loads: a kStages-deep cp.async ring of K and V blocks (kStages - 1 blocks in flight while one is computed);
// cache rows come through the block table when paged (one lookup per block when a page holds whole blocks, read one
// block ahead of the loads that use it);
// rows past the cache end and columns past the real head dim are zero-filled. Aligned caches take BlockLoader (each
// thread one chunk column, a fixed row walk: a few instructions per 16-byte copy); unaligned ones take element-wise
// loads into the same tiles (generic_tile_io.cuh).
//
// Tiles (catalogue [splitkv.decode]): block_m = query rows per CTA of the key split (16 · row tiles), block_n = keys
// per block, warps, stages. A tile of at most 16 rows (MQA/GQA decode with seqlen_q · group <= 16) runs a one-row-
// tile kernel of the same instance, so that small groups do not pay for padded rows.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include <atomic>

#include "../../include/mha_common.h"
#include "../common/mask.h"
#include "../common/mask_geometry.h"
#include "../common/smem_opt_in.h"
#include "../common/splitkv_params.h"
#include "../generic/fmha_fwd_generic.cuh"
#include "../generic/generic_ptx.cuh"
#include "../generic/generic_softmax.cuh"
#include "../generic/generic_tile_io.cuh"
#include "cache_rows.cuh"
#include "kv_append.cuh"
#include "split_heuristic.h"
#include "splitkv_combine.cuh"

namespace mhakit::decode {

namespace detail {

using generic::detail::aligned16;
using generic::detail::load_chunk;
namespace ptx = generic::ptx;

template <mhakit_dtype kDtype_, int kHdimQ_, int kHdimV_, int kRowTiles_, int kWarps_, int kKeysPerWarp_,
          int kStages_>
struct SplitkvConfig {
    static constexpr mhakit_dtype kDtype = kDtype_;
    static constexpr int kHdimQ = kHdimQ_, kHdimV = kHdimV_;
    static constexpr int kRowTiles = kRowTiles_, kWarps = kWarps_, kKeysPerWarp = kKeysPerWarp_;
    static constexpr int kStages = kStages_;
    static constexpr int kThreads = kWarps * 32;
    static constexpr int kBlockM = 16 * kRowTiles;        // packed query rows per CTA (the larger kernel)
    static constexpr int kBlockN = kWarps * kKeysPerWarp;  // keys per pipeline stage
    static constexpr int kSQ = kHdimQ + 8, kSV = kHdimV + 8;  // padded shared row strides (elements)
    static_assert(kHdimQ % 16 == 0 && kHdimV % 16 == 0, "head-dim buckets are multiples of 16");
    static_assert(kKeysPerWarp % 16 == 0, "a warp takes keys in steps of 16");
    static_assert(kStages >= 2, "the cp.async ring needs two stages at least");

    // Rows of a CTA's query tile: kMT row tiles (key split), or kMT row tiles per warp (row split).
    template <int kMT, bool kRowSplit>
    static constexpr int tile_rows() { return kRowSplit ? kWarps * 16 * kMT : 16 * kMT; }

    // Shared memory of a kernel: the Q tile and the K/V ring; after the key loop the same bytes hold the partial O
    // (fp32) and row statistics of every warp (key split) or of the tile (row split).
    template <int kMT, bool kRowSplit>
    static constexpr int smem_bytes() {
        constexpr int rows = tile_rows<kMT, kRowSplit>();
        constexpr int pipe = (rows * kSQ + kStages * kBlockN * (kSQ + kSV)) * 2;
        constexpr int combine = (kRowSplit ? 1 : kWarps) * rows * (kHdimV + 2) * 4;
        return pipe > combine ? pipe : combine;
    }
};

// What the generic family's warp-level pieces (gemm_qk, gemm_pv, mask_s, pack_p) read of a config: one warp's share
// of a block (key split: kKeysPerWarp keys against all kMT row tiles of the CTA; row split: every key of the block
// against the warp's own kMT row tiles).
template <class Cfg, int kMT_, bool kRowSplit>
struct WarpView {
    static constexpr mhakit_dtype kDtype = Cfg::kDtype;
    static constexpr int kMT = kMT_;
    static constexpr int kKeys = kRowSplit ? Cfg::kBlockN : Cfg::kKeysPerWarp;
    static constexpr int kNT = kKeys / 8;
    static constexpr int kKQ = Cfg::kHdimQ / 16;
    static constexpr int kKV = kKeys / 16;
    static constexpr int kOT = Cfg::kHdimV / 8;
    static constexpr int kSQ = Cfg::kSQ, kSV = Cfg::kSV;
    static constexpr bool kQInRegs = false;  // Q fragments come from shared memory on every block
    static constexpr bool kMasked = true;    // row bounds are always applied where a block is not full
};

enum : int { kAlignQ = 1, kAlignK = 2, kAlignV = 4 };

// Rows [0, kRows) x 16-byte chunks [0, chunks_load) of a tile whose row r starts at row_ptr(r) (valid for
// r < rows_valid; other rows and columns at or past cols_valid are zero-filled). `any` is a valid global address.
template <int kRows, int kChunks, int kStride, int kThreads, class RowPtr>
__device__ __forceinline__ void load_rows(uint16_t* smem, RowPtr&& row_ptr, const uint16_t* any, int rows_valid,
                                          int chunks_load, int cols_valid, bool aligned, int tid) {
    static_assert(kThreads % kChunks == 0 || kChunks % kThreads == 0, "threads walk whole rows");
    constexpr int kRowStep = kThreads >= kChunks ? kThreads / kChunks : 1;
    constexpr int kChunkStep = kThreads >= kChunks ? kChunks : kThreads;
    const int c0 = tid % kChunkStep, r0 = tid / kChunkStep;
#pragma unroll
    for (int r = r0; r < kRows; r += kRowStep) {
        const bool row_ok = r < rows_valid;
        const uint16_t* src_row = row_ok ? row_ptr(r) : any;
#pragma unroll
        for (int c = c0; c < kChunks; c += kChunkStep) {
            if (c >= chunks_load) break;
            const int rem = row_ok ? cols_valid - c * 8 : 0;
            load_chunk(ptx::smem_addr(smem + r * kStride + c * 8), src_row + c * 8, any, rem, aligned);
        }
    }
}

// The K / V block loads of the main loop, aligned tensors only (16-byte cp.async): thread tid owns one 16-byte chunk
// column c = tid % kChunks and the rows r0 = tid / kChunks, r0 + kRowStep, ... of a kRows-row block, so that the
// per-block work is one address computation and then one add per row (compile-time trip count, unrolled); which
// bytes of its column are real (whole, partial, none) is fixed per call and computed once. The general loader
// above (load_rows) walks rows of a run-time start and decides per chunk: it served every block before and cost
// about 60 integer instructions per 16-byte copy (profiled on the H200), so it now loads only Q and unaligned data.
template <int kRows, int kChunks, int kStride, int kThreads>
struct BlockLoader {
    static_assert(kThreads % kChunks == 0, "a thread owns one chunk column");
    static constexpr int kRowStep = kThreads / kChunks;
    static_assert(kRows % kRowStep == 0, "every thread walks the same number of rows");
    static constexpr int kIters = kRows / kRowStep;

    int r0;          // first row of this thread
    int col;         // element offset of the chunk column in a row
    int bytes;       // cp.async source bytes of the chunk (16 whole, 2..14 partial, 0 none: zero-filled)
    bool active;     // the column is loaded at all (c < chunks_load; later columns are never read)
    uint32_t dst0;   // shared-memory byte offset of (r0, c) within a tile

    __device__ __forceinline__ BlockLoader(int tid, int chunks_load, int cols_valid) {
        const int c = tid % kChunks;
        r0 = tid / kChunks;
        col = c * 8;
        bytes = generic::detail::chunk_bytes(cols_valid - col);
        active = c < chunks_load;
        dst0 = uint32_t(r0 * kStride + col) * 2u;
    }

    // Rows [0, valid) of a run (row r at run + r·row_stride) into the tile at smem_tile; rows past valid zero-filled.
    template <bool kFull>
    __device__ __forceinline__ void run(uint32_t smem_tile, const uint16_t* run, int64_t row_stride, int valid,
                                        const uint16_t* any) const {
        if (!active) return;
        const bool real = bytes > 0;  // a column past the head dim reads nothing: its source stays at `any`
        const uint16_t* src = real ? run + r0 * row_stride + col : any;
        const int64_t step = real ? kRowStep * row_stride : 0;
#pragma unroll
        for (int it = 0; it < kIters; ++it) {
            const uint32_t dst = smem_tile + dst0 + uint32_t(it * kRowStep * kStride * 2);
            if (kFull) {
                ptx::cp_async_16(dst, src + it * step, bytes);
            } else {
                const bool ok = r0 + it * kRowStep < valid;
                ptx::cp_async_16(dst, ok ? src + it * step : any, ok ? bytes : 0);
            }
        }
    }

    // Paged, pages smaller than the block: the page of each of this thread's rows of the block at n0 (rows past
    // valid get page 0, never read), read one block ahead of the loads that use them.
    template <class T>
    __device__ __forceinline__ void read_pages(int (&page)[kIters], const CacheRows<T>& c, int n0, int valid) const {
#pragma unroll
        for (int it = 0; it < kIters; ++it) {
            const int r = r0 + it * kRowStep;
            page[it] = r < valid ? __ldg(c.pages + c.page_slot(n0 + r)) : 0;
        }
    }

    // Rows [0, valid) of the block at n0 of a paged cache, this thread's rows in the pages read_pages gave.
    template <class T>
    __device__ __forceinline__ void paged(uint32_t smem_tile, const CacheRows<T>& c, const int (&page)[kIters], int n0,
                                          int valid, const uint16_t* any) const {
        if (!active) return;
#pragma unroll
        for (int it = 0; it < kIters; ++it) {
            const int r = r0 + it * kRowStep;
            const bool ok = r < valid && bytes > 0;
            ptx::cp_async_16(smem_tile + dst0 + uint32_t(it * kRowStep * kStride * 2),
                             ok ? c.row_in_page(page[it], n0 + r) + col : any, ok ? bytes : 0);
        }
    }

    // Rows [0, valid) where row r starts at row_ptr(r) (a paged cache whose pages are smaller than the block).
    template <class RowPtr>
    __device__ __forceinline__ void rows(uint32_t smem_tile, RowPtr&& row_ptr, int valid, const uint16_t* any) const {
        if (!active) return;
#pragma unroll
        for (int it = 0; it < kIters; ++it) {
            const int r = r0 + it * kRowStep;
            const bool ok = r < valid && bytes > 0;
            ptx::cp_async_16(smem_tile + dst0 + uint32_t(it * kRowStep * kStride * 2), ok ? row_ptr(r) + col : any,
                             ok ? bytes : 0);
        }
    }
};

// Every element of a warp's mma accumulator fragments [row tiles][column tiles][4] to 0.
template <int kM, int kN>
__device__ __forceinline__ void zero_fragments(float (&acc)[kM][kN][4]) {
#pragma unroll
    for (int m = 0; m < kM; ++m)
#pragma unroll
        for (int n = 0; n < kN; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[m][n][e] = 0.f;
}

// Row (mt, hf)'s sum over the keys this warp saw (the four threads of a row hold a quarter each).
template <int kMT>
__device__ __forceinline__ float row_sum_of(const generic::detail::OnlineSoftmax<kMT>& sm, int mt, int hf) {
    float l = sm.row_sum[mt][hf];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    return l;
}

// This thread's columns of O row (mt, hf), times f, into dst (the row in shared memory; columns below hdim_v).
template <class W>
__device__ __forceinline__ void store_row(float* dst, const float (&acc_o)[W::kMT][W::kOT][4], int mt, int hf, float f,
                                          int hdim_v) {
    const int t4 = threadIdx.x & 3;
#pragma unroll
    for (int nt = 0; nt < W::kOT; ++nt) {
        if (nt * 8 >= hdim_v) break;
        dst[nt * 8 + 2 * t4] = acc_o[mt][nt][2 * hf] * f;
        dst[nt * 8 + 2 * t4 + 1] = acc_o[mt][nt][2 * hf + 1] * f;
    }
}

// The max and sum of row r over kParts partial results (s_m / s_l [part][row], rows of a part kRows apart): the
// largest max, and every part's sum rescaled to it (0 when no part saw a key).
template <int kParts, int kRows>
__device__ __forceinline__ void merged_row(const float* s_m, const float* s_l, int r, float scale_log2, float* m_all,
                                           float* l_all) {
    float m = -INFINITY, l = 0.f;
#pragma unroll
    for (int w = 0; w < kParts; ++w) m = fmaxf(m, s_m[w * kRows + r]);
    if (m != -INFINITY)
#pragma unroll
        for (int w = 0; w < kParts; ++w) l += s_l[w * kRows + r] * ptx::ex2((s_m[w * kRows + r] - m) * scale_log2);
    *m_all = m;
    *l_all = l;
}

// After the key loop (key split): every warp's (max, sum, O) of the same rows into one result per row, in shared
// memory. Writes the per-warp O (scaled to the common max and divided by the common sum) to s_o[warp][row][col] and
// the rows' maxima and sums to s_m / s_l [warp][row]; the caller sums s_o over warps. Warps 0 .. kWarps - 1 take
// part; `sync` is their barrier (the CTA's, or a named one where a producer warp does not take part).
template <class W, int kWarps, class Sync>
__device__ __forceinline__ void combine_warps(float* s_o, float* s_m, float* s_l,
                                              const float (&acc_o)[W::kMT][W::kOT][4],
                                              const generic::detail::OnlineSoftmax<W::kMT>& sm, float scale_log2,
                                              int hdim_v, Sync&& sync) {
    constexpr int kRows = 16 * W::kMT;
    const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, t4 = threadIdx.x & 3;
#pragma unroll
    for (int mt = 0; mt < W::kMT; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const float l = row_sum_of(sm, mt, hf);
            if (t4 == 0) {
                const int r = mt * 16 + g + 8 * hf;
                s_m[warp * kRows + r] = sm.row_max[mt][hf];
                s_l[warp * kRows + r] = l;
            }
        }
    sync();
#pragma unroll
    for (int mt = 0; mt < W::kMT; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int r = mt * 16 + g + 8 * hf;
            float m_all, l_all;
            merged_row<kWarps, kRows>(s_m, s_l, r, scale_log2, &m_all, &l_all);
            const float mine = sm.row_max[mt][hf];
            const float f = (l_all > 0.f && mine != -INFINITY) ? ptx::ex2((mine - m_all) * scale_log2) / l_all : 0.f;
            store_row<W>(s_o + (warp * kRows + r) * W::kOT * 8, acc_o, mt, hf, f, hdim_v);
        }
}

// Row split: every row belongs to one warp, so its result is final: O divided by the row's sum into s_o[row][col],
// the row's max and sum into s_m / s_l [row] (rows warp_row0 .. + 16 kMT of the tile).
template <class W>
__device__ __forceinline__ void stage_own_rows(float* s_o, float* s_m, float* s_l, const float (&acc_o)[W::kMT][W::kOT][4],
                                               const generic::detail::OnlineSoftmax<W::kMT>& sm, int warp_row0,
                                               int hdim_v) {
    const int g = (threadIdx.x & 31) >> 2, t4 = threadIdx.x & 3;
#pragma unroll
    for (int mt = 0; mt < W::kMT; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const float l = row_sum_of(sm, mt, hf);
            const int r = warp_row0 + mt * 16 + g + 8 * hf;
            if (t4 == 0) {
                s_m[r] = sm.row_max[mt][hf];
                s_l[r] = l;
            }
            store_row<W>(s_o + r * W::kOT * 8, acc_o, mt, hf, l > 0.f ? 1.f / l : 0.f, hdim_v);
        }
}

// Launch order of the CTAs: the kv head fastest, then the split, then the row chunk (x), the batch (z). A CTA's
// tile holds packed rows [row0, row0 + rows) of the kv head's rows_total = group x seqlen_q (tiles of block_m rows).
struct SplitkvWork {
    int hk, split, b;
    int group, rows_total, row0, rows;
};
__device__ __forceinline__ SplitkvWork splitkv_work(const SplitkvParams& p, int block_m) {
    SplitkvWork w;
    w.hk = int(blockIdx.x % unsigned(p.nhead_k));
    const int rest = int(blockIdx.x / unsigned(p.nhead_k));
    w.split = rest % p.num_splits;
    w.b = blockIdx.z;
    w.group = p.nhead_q / p.nhead_k;
    w.rows_total = w.group * p.seqlen_q;
    w.row0 = (rest / p.num_splits) * block_m;
    w.rows = min(block_m, w.rows_total - w.row0);
    return w;
}

// The key blocks of kBlockN keys that one CTA walks: the blocks some row of its tile (packed rows [row0, row0 + rows)
// of batch b) sees, cut into num_splits parts of equal size, this CTA's part; `full` holds the blocks every row of
// the tile sees whole (no element mask; a block past the cache end is never full).
struct SplitKeys {
    int sk;         // keys of the batch: cache rows + new rows
    MaskGeometry<true> geom;
    TileRange full;
    int blk_begin;  // first block of the part
    int n_blocks;   // blocks in the part (0: an empty part)
};
template <int kBlockN>
__device__ __forceinline__ SplitKeys split_keys(const SplitkvParams& p, int b, int split, int row0, int rows,
                                                int group) {
    const int sk = cache_len(p, b) + p.seqlen_new;
    const auto geom = MaskGeometry<true>::make(p.mask_type, p.window_left, p.window_right, p.seqlen_q, sk);
    const int qi_first = row0 / group, qi_last = (row0 + rows - 1) / group;
    const TileRange visit = geom.template key_tiles<kBlockN>(qi_first, qi_last);
    const int n_visit = visit.empty() ? 0 : visit.end - visit.begin;
    const int per_split = (n_visit + p.num_splits - 1) / p.num_splits;
    const int blk_begin = visit.begin + split * per_split;
    const int n_blocks = max(0, min(visit.begin + n_visit, blk_begin + per_split) - blk_begin);
    return SplitKeys{sk, geom, geom.template full_key_tiles<kBlockN>(qi_first, qi_last), blk_begin, n_blocks};
}

// The keys [row_lo, row_hi) that each of this thread's fragment rows (mt, hf) sees: rows of a warp that start at
// packed row warp_row (padded rows past rows_total see nothing).
template <int kMT>
__device__ __forceinline__ void row_bounds(int (&row_lo)[kMT][2], int (&row_hi)[kMT][2], const MaskGeometry<true>& geom,
                                           int warp_row, int rows_total, int group) {
    const int g = (threadIdx.x & 31) >> 2;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int r = warp_row + mt * 16 + g + 8 * hf;
            const bool real = r < rows_total;
            const int qi = real ? r / group : 0;
            row_lo[mt][hf] = real ? int(geom.key_begin(qi)) : 0;
            row_hi[mt][hf] = real ? int(geom.key_end(qi)) : 0;  // padded rows see nothing
        }
}

// The tile's result, after the warps' partial results met in shared memory (s_o [kParts][kBlockM][kHdimV], s_m / s_l
// [kParts][kBlockM]): O and LSE of each packed row (one split), or its fp32 partials in o_acc / lse_acc for the
// combine kernel. Threads 0 .. kThreads - 1 take part (tid: this thread's index among them).
template <mhakit_dtype kDtype, int kParts, int kBlockM, int kHdimV, int kThreads>
__device__ __forceinline__ void write_result(const float* s_o, const float* s_m, const float* s_l,
                                             const SplitkvParams& p, int b, int hk, int split, int row0, int rows,
                                             int group, int tid) {
    const bool direct = p.num_splits == 1;
    for (int idx = tid; idx < rows * p.hdim_v; idx += kThreads) {
        const int r = idx / p.hdim_v, c = idx - r * p.hdim_v;
        float v = 0.f;
#pragma unroll
        for (int w = 0; w < kParts; ++w) v += s_o[(w * kBlockM + r) * kHdimV + c];
        const PackedRow pr = packed_row(row0 + r, group, hk);
        if (direct)
            static_cast<uint16_t*>(p.o)[b * p.o_batch_stride + pr.head * p.o_head_stride +
                                        int64_t(pr.qi) * p.o_row_stride + c] = to_elem<kDtype>(v);
        else
            p.o_acc[acc_row(p, split, b, pr.head, pr.qi) * p.hdim_v + c] = v;
    }
    if (direct && p.lse == nullptr) return;
    for (int r = tid; r < rows; r += kThreads) {
        float m_all, l_all;
        merged_row<kParts, kBlockM>(s_m, s_l, r, p.scale_log2, &m_all, &l_all);
        const float lse = l_all > 0.f ? m_all * p.scale + logf(l_all) : -INFINITY;
        const PackedRow pr = packed_row(row0 + r, group, hk);
        if (direct)
            p.lse[b * p.lse_batch_stride + pr.head * p.lse_head_stride + pr.qi] = lse;
        else
            p.lse_acc[acc_row(p, split, b, pr.head, pr.qi)] = lse;
    }
}

// After the key loop: the tile's partial results (this warp's acc_o and softmax) meet in shared memory at smem, which
// the caller has made free (fp32 s_o [kParts][kBlockM][kHdimV], then s_m and s_l [kParts][kBlockM]; kParts: one per
// warp in the key split, one in the row split, whose rows each belong to one warp), and go out (write_result).
// Threads 0 .. kThreads - 1 take part; `sync` is their barrier.
template <class W, int kWarps, bool kRowSplit, int kBlockM, int kThreads, class Sync>
__device__ __forceinline__ void finish_tile(unsigned char* smem, const float (&acc_o)[W::kMT][W::kOT][4],
                                            const generic::detail::OnlineSoftmax<W::kMT>& softmax,
                                            const SplitkvParams& p, int warp_row0, int b, int hk, int split, int row0,
                                            int rows, int group, int tid, Sync&& sync) {
    constexpr int kParts = kRowSplit ? 1 : kWarps, kHdimV = W::kOT * 8;
    float* s_o = reinterpret_cast<float*>(smem);  // [kParts][kBlockM][kHdimV]
    float* s_m = s_o + kParts * kBlockM * kHdimV;  // [kParts][kBlockM]
    float* s_l = s_m + kParts * kBlockM;
    if constexpr (kRowSplit)
        stage_own_rows<W>(s_o, s_m, s_l, acc_o, softmax, warp_row0, p.hdim_v);
    else
        combine_warps<W, kWarps>(s_o, s_m, s_l, acc_o, softmax, p.scale_log2, p.hdim_v, sync);
    sync();
    write_result<W::kDtype, kParts, kBlockM, kHdimV, kThreads>(s_o, s_m, s_l, p, b, hk, split, row0, rows, group, tid);
}

template <class Cfg, int kMT, bool kRowSplit>
__global__ void __launch_bounds__(Cfg::kThreads) splitkv_kernel(const SplitkvParams p, const int align_flags) {
    using W = WarpView<Cfg, kMT, kRowSplit>;
    constexpr int kBlockM = Cfg::template tile_rows<kMT, kRowSplit>();
    constexpr int kBlockN = Cfg::kBlockN, kStages = Cfg::kStages, kThreads = Cfg::kThreads;
    constexpr int kSQ = Cfg::kSQ, kSV = Cfg::kSV, kWarps = Cfg::kWarps;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    uint16_t* sQ = reinterpret_cast<uint16_t*>(smem_raw);
    uint16_t* sK = sQ + kBlockM * kSQ;                // kStages x kBlockN x kSQ
    uint16_t* sV = sK + kStages * kBlockN * kSQ;      // kStages x kBlockN x kSV

    const SplitkvWork work = splitkv_work(p, kBlockM);
    const int split = work.split, hk = work.hk, b = work.b, group = work.group;
    const int rows_total = work.rows_total, row0 = work.row0, rows = work.rows;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int warp_row0 = kRowSplit ? warp * 16 * kMT : 0;             // the warp's first row of the tile
    const int warp_key0 = kRowSplit ? 0 : warp * Cfg::kKeysPerWarp;    // the warp's first key of a block

    // ---- the keys this CTA walks: the blocks some row of the tile sees, cut into num_splits parts ----
    const SplitKeys keys = split_keys<kBlockN>(p, b, split, row0, rows, group);
    const int sk = keys.sk, blk_begin = keys.blk_begin, n_blocks = keys.n_blocks;
    const TileRange full = keys.full;

    int row_lo[kMT][2], row_hi[kMT][2];
    row_bounds<kMT>(row_lo, row_hi, keys.geom, row0 + warp_row0, rows_total, group);

    const bool alQ = align_flags & kAlignQ, alK = align_flags & kAlignK, alV = align_flags & kAlignV;
    const int q_chunks = ((p.hdim_q + 15) >> 4) << 1, v_chunks = ((p.hdim_v + 15) >> 4) << 1;
    const CacheRows<const uint16_t> kc = cache_rows<false, const uint16_t>(p, b, hk);
    const CacheRows<const uint16_t> vc = cache_rows<true, const uint16_t>(p, b, hk);
    const uint16_t* q0 = static_cast<const uint16_t*>(p.q) + b * p.q_batch_stride;

    // Who loads which rows of a block (aligned caches). Key split: every warp loads the kKeysPerWarp keys it alone
    // computes on, so that a warp waits for its own loads only (a __syncwarp, no CTA barrier per block: the warps
    // drift apart and their loads stop arriving in bursts). Row split: every warp reads every key, so the CTA loads
    // the block together and waits for it at a CTA barrier.
    constexpr bool kWarpLoads = !kRowSplit;
    constexpr int kLoadRows = kWarpLoads ? Cfg::kKeysPerWarp : kBlockN;
    constexpr int kLoadThreads = kWarpLoads ? 32 : kThreads;
    const int load_row0 = kWarpLoads ? warp_key0 : 0;  // first row of a block that this thread's group loads
    using KLoader = BlockLoader<kLoadRows, Cfg::kHdimQ / 8, kSQ, kLoadThreads>;
    using VLoader = BlockLoader<kLoadRows, Cfg::kHdimV / 8, kSV, kLoadThreads>;
    const KLoader k_ld(kWarpLoads ? lane : tid, q_chunks, p.hdim_q);
    const VLoader v_ld(kWarpLoads ? lane : tid, v_chunks, p.hdim_v);
    const uint32_t sK_smem = ptx::smem_addr(sK + load_row0 * kSQ), sV_smem = ptx::smem_addr(sV + load_row0 * kSV);
    const bool lean = alK && alV;
    // Paged caches: the block table is read one key block ahead (pages[] holds the next block's pages), so that
    // the lookup's latency overlaps a block of math instead of sitting between the wait and the next loads. A page
    // that holds whole blocks needs one slot per block (pages[0]); smaller pages one per row this thread loads.
    constexpr bool kSharedWalk = KLoader::kRowStep == VLoader::kRowStep;  // K and V rows of a thread coincide
    const bool paged = kc.pages != nullptr;
    const bool page_run = paged && kc.page_size % kBlockN == 0;
    int pages[KLoader::kIters] = {};
    auto read_pages = [&](int i) {
        if (!paged || !lean) return;
        const int n0 = (blk_begin + i) * kBlockN;
        if (page_run)
            pages[0] = __ldg(kc.pages + kc.page_slot(n0));
        else
            k_ld.read_pages(pages, kc, n0 + load_row0, min(kLoadRows, sk - n0 - load_row0));
    };

    auto load_block = [&](int i) {  // the split's i-th key block into stage i % kStages
        const int n0 = (blk_begin + i) * kBlockN, valid = min(kBlockN, sk - n0);
        const int st = i % kStages;
        if (lean) {
            // this thread's group: rows [load_row0, load_row0 + kLoadRows) of the block (none real when g_valid <= 0)
            const int g0 = n0 + load_row0, g_valid = min(kLoadRows, sk - g0);
            const uint32_t dK = sK_smem + uint32_t(st * kBlockN * kSQ * 2), dV = sV_smem + uint32_t(st * kBlockN * kSV * 2);
            if (!paged || page_run) {  // one run of rows: contiguous, or one page
                const uint16_t* k_run = paged ? kc.row_in_page(pages[0], n0) + load_row0 * kc.row_stride
                                              : kc.base + int64_t(g0) * kc.row_stride;
                const uint16_t* v_run = paged ? vc.row_in_page(pages[0], n0) + load_row0 * vc.row_stride
                                              : vc.base + int64_t(g0) * vc.row_stride;
                if (g_valid == kLoadRows) {
                    k_ld.template run<true>(dK, k_run, kc.row_stride, g_valid, kc.base);
                    v_ld.template run<true>(dV, v_run, vc.row_stride, g_valid, vc.base);
                } else {
                    k_ld.template run<false>(dK, k_run, kc.row_stride, g_valid, kc.base);
                    v_ld.template run<false>(dV, v_run, vc.row_stride, g_valid, vc.base);
                }
            } else {
                k_ld.paged(dK, kc, pages, g0, g_valid, kc.base);
                if constexpr (kSharedWalk)
                    v_ld.paged(dV, vc, pages, g0, g_valid, vc.base);
                else
                    v_ld.rows(dV, [&](int r) { return vc.row(g0 + r); }, g_valid, vc.base);
            }
            return;
        }
        const uint16_t* k_run = kc.run_of_rows(n0, kBlockN);  // one page (or contiguous): no per-row lookup
        const uint16_t* v_run = vc.run_of_rows(n0, kBlockN);
        uint16_t* dK = sK + st * kBlockN * kSQ;
        uint16_t* dV = sV + st * kBlockN * kSV;
        if (k_run != nullptr) {
            load_rows<kBlockN, Cfg::kHdimQ / 8, kSQ, kThreads>(
                dK, [&](int r) { return k_run + r * kc.row_stride; }, kc.base, valid, q_chunks, p.hdim_q, alK, tid);
            load_rows<kBlockN, Cfg::kHdimV / 8, kSV, kThreads>(
                dV, [&](int r) { return v_run + r * vc.row_stride; }, vc.base, valid, v_chunks, p.hdim_v, alV, tid);
        } else {
            load_rows<kBlockN, Cfg::kHdimQ / 8, kSQ, kThreads>(
                dK, [&](int r) { return kc.row(n0 + r); }, kc.base, valid, q_chunks, p.hdim_q, alK, tid);
            load_rows<kBlockN, Cfg::kHdimV / 8, kSV, kThreads>(
                dV, [&](int r) { return vc.row(n0 + r); }, vc.base, valid, v_chunks, p.hdim_v, alV, tid);
        }
    };

    float acc_o[kMT][W::kOT][4];
    zero_fragments(acc_o);
    generic::detail::OnlineSoftmax<kMT> softmax;

    if (n_blocks > 0) {
        load_rows<kBlockM, Cfg::kHdimQ / 8, kSQ, kThreads>(
            sQ,
            [&](int r) {
                const PackedRow pr = packed_row(row0 + r, group, hk);
                return q0 + pr.head * p.q_head_stride + int64_t(pr.qi) * p.q_row_stride;
            },
            q0, rows, q_chunks, p.hdim_q, alQ, tid);
#pragma unroll
        for (int i = 0; i < kStages - 1; ++i) {
            if (i < n_blocks) {
                read_pages(i);
                load_block(i);
            }
            ptx::cp_async_commit();
        }
        if (kStages - 1 < n_blocks) read_pages(kStages - 1);
    }

    // ldmatrix lane offsets (elements), as in the generic forward, from the warp's first row and first key.
    const int a_off = (warp_row0 + (lane & 15)) * kSQ + ((lane >> 4) << 3);
    const int k_off = (warp_key0 + (lane & 7) + ((lane >> 4) << 3)) * kSQ + (((lane >> 3) & 1) << 3);
    const int v_off = (warp_key0 + (lane & 7) + (((lane >> 3) & 1) << 3)) * kSV + ((lane >> 4) << 3);
    const uint32_t sQ_a = ptx::smem_addr(sQ + a_off);
    const bool q_full = p.hdim_q > Cfg::kHdimQ - 16, v_full = p.hdim_v > Cfg::kHdimV - 16;
    const uint32_t unused_q_frag[1][1][4] = {};

    const bool warp_sync = kWarpLoads && lean;  // the warps' K/V rows are their own: a warp barrier suffices
    for (int i = 0; i < n_blocks; ++i) {
        ptx::cp_async_wait<kStages - 2>();
        // Block i landed for every thread that loaded it, and they are done with block i - 1's stage. The first
        // block also brings the Q tile, which the whole CTA loaded: a CTA barrier then.
        if (warp_sync && i > 0)
            __syncwarp();
        else
            __syncthreads();
        if (i + kStages - 1 < n_blocks) {
            load_block(i + kStages - 1);
            if (i + kStages < n_blocks) read_pages(i + kStages);
        }
        ptx::cp_async_commit();

        const int st = i % kStages, blk = blk_begin + i;
        const uint32_t sK_b = ptx::smem_addr(sK + st * kBlockN * kSQ + k_off);
        const uint32_t sV_b = ptx::smem_addr(sV + st * kBlockN * kSV + v_off);
        float s[kMT][W::kNT][4];
        zero_fragments(s);
        if (q_full)
            generic::detail::gemm_qk<W, true>(s, unused_q_frag, sQ_a, sK_b, p.hdim_q);
        else
            generic::detail::gemm_qk<W, false>(s, unused_q_frag, sQ_a, sK_b, p.hdim_q);
        if (!full.contains(blk)) generic::detail::mask_s<W>(s, row_lo, row_hi, blk * kBlockN + warp_key0);
        softmax.template update<true>(s, acc_o, p.scale_log2);
        uint32_t p_frag[kMT][W::kKV][4];
        generic::detail::pack_p<W>(p_frag, s);
        if (v_full)
            generic::detail::gemm_pv<W, true>(acc_o, p_frag, sV_b, p.hdim_v);
        else
            generic::detail::gemm_pv<W, false>(acc_o, p_frag, sV_b, p.hdim_v);
    }

    // ---- the warps' partial results meet in shared memory (the Q / K / V bytes are free now) ----
    ptx::cp_async_wait<0>();
    __syncthreads();
    finish_tile<W, kWarps, kRowSplit, kBlockM, kThreads>(smem_raw, acc_o, softmax, p, warp_row0, b, hk, split, row0,
                                                         rows, group, tid, [] { __syncthreads(); });
}

}  // namespace detail

template <mhakit_dtype kDtype, int kHdimQ, int kHdimV, int kBlockM, int kBlockN, int kWarps, int kStages>
struct SplitkvKernel {
    static_assert(kBlockM % 16 == 0 && kBlockN % (16 * kWarps) == 0, "tile: 16-row tiles, 16-key warp steps");
    using Cfg = detail::SplitkvConfig<kDtype, kHdimQ, kHdimV, kBlockM / 16, kWarps, kBlockN / kWarps, kStages>;
    // 99 KB: the smallest opt-in shared memory per block of the sm_80+ parts the family is built for.
    static_assert(Cfg::template smem_bytes<Cfg::kRowTiles, false>() <= 101376, "decode tile needs more than 99 KB");
    static_assert(Cfg::template smem_bytes<1, true>() <= 101376, "decode row-split tile needs more than 99 KB");

    // The kernel a call runs: one row tile (<= 16 packed rows), the key split's full tile (<= block_m rows), or the
    // row split (more rows: warps x 16 rows per CTA).
    enum class Shape { kOneTile, kKeySplit, kRowSplit };
    static Shape shape(const SplitkvParams& p) {
        const long long rows = (long long)(p.nhead_q / p.nhead_k) * p.seqlen_q;
        return rows <= 16 ? Shape::kOneTile : rows <= Cfg::kBlockM ? Shape::kKeySplit : Shape::kRowSplit;
    }
    static int tile_rows(const SplitkvParams& p) {
        switch (shape(p)) {
            case Shape::kOneTile: return Cfg::template tile_rows<1, false>();
            case Shape::kKeySplit: return Cfg::template tile_rows<Cfg::kRowTiles, false>();
            default: return Cfg::template tile_rows<1, true>();
        }
    }
    static int smem_bytes(const SplitkvParams& p) {
        switch (shape(p)) {
            case Shape::kOneTile: return Cfg::template smem_bytes<1, false>();
            case Shape::kKeySplit: return Cfg::template smem_bytes<Cfg::kRowTiles, false>();
            default: return Cfg::template smem_bytes<1, true>();
        }
    }
    static long long row_chunks(const SplitkvParams& p) {
        const long long rows = (long long)(p.nhead_q / p.nhead_k) * p.seqlen_q;
        return (rows + tile_rows(p) - 1) / tile_rows(p);
    }

    // Run-time guard beyond the runtime's checks: the grid fits (x: kv heads x splits x row chunks).
    static bool supports(const SplitkvParams& p) {
        return p.batch <= 65535 && row_chunks(p) * MHAKIT_MAX_SPLITS * p.nhead_k < (1LL << 31);
    }

    // The split count for num_splits = 0 (split_heuristic.h), from the SM count and shared memory the runtime read.
    static int num_splits(const SplitkvParams& p, int smem_per_sm) {
        return heuristic_splits(p, row_chunks(p) * p.nhead_k * p.batch, Cfg::kBlockN,
                                ctas_per_sm_by_smem(smem_bytes(p), smem_per_sm));
    }

    template <int kMT, bool kRowSplit>
    static cudaError_t launch(const SplitkvParams& p, int flags, cudaStream_t stream) {
        auto kernel = detail::splitkv_kernel<Cfg, kMT, kRowSplit>;
        constexpr int smem = Cfg::template smem_bytes<kMT, kRowSplit>();
        static std::atomic<uint64_t> opted_in{0};
        if (cudaError_t err = opt_in_dynamic_smem(kernel, smem, opted_in); err != cudaSuccess) return err;
        const long long ctas = row_chunks(p) * p.num_splits * p.nhead_k;
        kernel<<<dim3(unsigned(ctas), 1, p.batch), Cfg::kThreads, smem, stream>>>(p, flags);
        return cudaGetLastError();
    }

    // Append (new k/v), attend (num_splits parts), combine (when split). No allocation, no synchronisation.
    static cudaError_t run(const SplitkvParams& p, cudaStream_t stream) {
        if (cudaError_t err = detail::append_kv(p, stream); err != cudaSuccess) return err;
        if (p.batch <= 0 || p.seqlen_q <= 0) return cudaSuccess;
        int flags = 0;
        if (detail::aligned16(p.q, p.q_row_stride, p.q_head_stride, p.q_batch_stride)) flags |= detail::kAlignQ;
        if (detail::aligned16(p.k_cache, p.k_row_stride, p.k_head_stride, p.k_batch_stride)) flags |= detail::kAlignK;
        if (detail::aligned16(p.v_cache, p.v_row_stride, p.v_head_stride, p.v_batch_stride)) flags |= detail::kAlignV;
        cudaError_t err;
        switch (shape(p)) {
            case Shape::kOneTile: err = launch<1, false>(p, flags, stream); break;
            case Shape::kKeySplit: err = launch<Cfg::kRowTiles, false>(p, flags, stream); break;
            default: err = launch<1, true>(p, flags, stream); break;
        }
        if (err != cudaSuccess || p.num_splits == 1) return err;
        return detail::combine_splits<kDtype>(p, stream);
    }
};

}  // namespace mhakit::decode
