// mhakit hopper family, backward pass — the two light kernels around the main one:
//   preprocess: per query row, D = rowsum(dO ∘ O) (fp32), LSE·log2(e) (+inf for padding rows and for rows whose
//               LSE is -inf, so that their P is exactly 0), and zeroing of the row tile's fp32 dQ accumulator and of
//               its turn counter;
//   convert:    dQ = scale · accumulator, from the main kernel's fragment order to the caller's dtype and strides.
// With the score modifiers (the "_mods" instances): preprocess_mods_kernel also zeroes the dbias tiles of its rows
// that the main kernel does not visit, and dsink_kernel sums d sink per query head over the workspace.
// With the GQA split (bwd_gqa_split.h): reduce_dkv_kernel adds the split CTAs' dK / dV partial sums and writes dK, dV
// (one CTA per (key block, kv head, batch), as the main kernel's unsplit grid).
// One CTA of 256 threads per (query tile, query head, batch) for both; the tile height is the main kernel's BM. In
// group mode (seqstart_q non-null) the tiles of a sequence start at its first packed row, and the CTAs of tiles past
// the sequence's end (the grid is sized by max_seqlen_q) return at once: the main kernel never touches those tiles.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"

#include "kernels/common/tile_scheduler.h"

#include "fmha_bwd_hopper_common.hpp"
#include "hopper_epilogue.hpp"  // StagedRows, BwdEpilogue
#include "hopper_types.hpp"     // detail::pack2, seq_rows

namespace mhakit::hopper::bwd {

// Both kernels: one CTA per (query tile, query head, batch), in tile order.
using RowTileScheduler = SingleTileScheduler</*kHeaviestFirst=*/false>;

struct PreprocessParams {
    void const* o;
    void const* dout;
    float const* lse;
    int64_t o_row, o_head, o_batch;
    int64_t do_row, do_head, do_batch;
    int64_t lse_head, lse_batch;
    const int32_t* seqstart_q;  // group mode, else nullptr
    float* lse2;
    float* dsum;
    float* dq_acc;
    int32_t* dq_turn;  // [b][hq][m_tiles]: the deterministic mode's turn counters
    int64_t sq_pad;
    int m_tiles;
    int nhead_q, seqlen_q, hdim_v;  // D = rowsum(dO∘O) runs over hdim_v
};

template <class Element>
CUTLASS_DEVICE float dot8(uint4 a, uint4 b) {
    float acc = 0.f;
    Element const* x = reinterpret_cast<Element const*>(&a);
    Element const* y = reinterpret_cast<Element const*>(&b);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < 8; ++i) acc = fmaf(float(x[i]), float(y[i]), acc);
    return acc;
}

// The preprocess of one (query tile, query head, batch) CTA.
template <class Element, int kHdim, int kHdimV, int kBlockM>
CUTLASS_DEVICE void preprocess_tile(PreprocessParams const& p) {
    // threads per row, 16 bytes each: the power of two that covers O's head dim (lanes past it read nothing)
    constexpr int T = kHdimV <= 64 ? 8 : (kHdimV <= 128 ? 16 : 32);
    constexpr int kRowsPerPass = 256 / T;
    static_assert(kBlockM % kRowsPerPass == 0);
    const auto work = RowTileScheduler::work();
    const int m = work.block, h = work.head, b = work.batch;
    const SeqRows seq = seq_rows(p.seqstart_q, b, p.seqlen_q);
    if (m * kBlockM >= seq.len) return;
    const int lt = int(threadIdx.x) % T;
    const int col = lt * 8;
    const int64_t ws_row0 = (int64_t(b) * p.nhead_q + h) * p.sq_pad + int64_t(m) * kBlockM;
    const bool group = p.seqstart_q != nullptr;
    Element const* o = static_cast<Element const*>(p.o) + (group ? seq.first * p.o_row : b * p.o_batch) + h * p.o_head;
    Element const* g =
        static_cast<Element const*>(p.dout) + (group ? seq.first * p.do_row : b * p.do_batch) + h * p.do_head;
    float const* lse = p.lse + (group ? int64_t(seq.first) : b * p.lse_batch) + h * p.lse_head;

    #pragma unroll 1
    for (int r = int(threadIdx.x) / T; r < kBlockM; r += kRowsPerPass) {
        const int row = m * kBlockM + r;
        float acc = 0.f;
        if (row < seq.len && col < p.hdim_v) {
            const uint4 a = *reinterpret_cast<uint4 const*>(o + int64_t(row) * p.o_row + col);
            const uint4 c = *reinterpret_cast<uint4 const*>(g + int64_t(row) * p.do_row + col);
            acc = dot8<Element>(a, c);
        }
        CUTLASS_PRAGMA_UNROLL
        for (int off = T / 2; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
        if (lt == 0) {
            float l2 = INFINITY;
            if (row < seq.len) {
                const float l = lse[row];
                l2 = (l == -INFINITY) ? INFINITY : l * 1.4426950408889634f;
            }
            p.lse2[ws_row0 + r] = l2;
            p.dsum[ws_row0 + r] = (row < seq.len) ? acc : 0.f;
        }
    }

    const int64_t tile = (int64_t(b) * p.nhead_q + h) * p.m_tiles + m;
    if (threadIdx.x == 0) p.dq_turn[tile] = 0;
    float4* z = reinterpret_cast<float4*>(p.dq_acc + tile * int64_t(kBlockM * kHdim));
    #pragma unroll 4
    for (int i = int(threadIdx.x); i < kBlockM * kHdim / 4; i += 256) z[i] = make_float4(0.f, 0.f, 0.f, 0.f);
}

template <class Element, int kHdim, int kHdimV, int kBlockM>
__global__ void __launch_bounds__(256) preprocess_kernel(PreprocessParams const p) {
    preprocess_tile<Element, kHdim, kHdimV, kBlockM>(p);
}

// The modifier instances' preprocess: the same, and zeroes the dbias elements of the tile's rows (when asked for)
// that the main kernel does not write: those of the key blocks whose query tiles (key_block_query_tiles, the main
// kernel's rule) leave this tile out (a causal or windowed mask's hidden blocks, keys no query sees). An unmasked
// call writes every element in the main kernel and zeroes nothing here.
struct PreprocessModsParams : PreprocessParams {
    char* dbias;  // element (0, 0, 0, 0) of dbias, or null
    int64_t dbias_row, dbias_head, dbias_batch;  // elements
    bool dbias_fp32;
    const int32_t* seqstart_k;  // group mode, else nullptr
    int seqlen_k;
    // the mask as the main kernel gets it: group mode, per sequence from these; batch mode, the host's clamped (y, x)
    int mask_type, window_left, window_right;
    int mask_y, mask_x;
};

// Zeroes bytes [0, len) at p (p and len 2-byte aligned) with the 32 lanes of a warp: 16-byte stores between a
// 2-byte head and tail.
CUTLASS_DEVICE void warp_zero_bytes(char* p, int64_t len, int lane) {
    const int64_t to16 = int64_t((16u - (reinterpret_cast<uintptr_t>(p) & 15u)) & 15u);
    const int64_t head = to16 < len ? to16 : len;
    const int64_t body = (len - head) & ~int64_t(15);
    for (int64_t i = 2 * lane; i < head; i += 64) *reinterpret_cast<uint16_t*>(p + i) = 0;
    for (int64_t i = 16 * lane; i < body; i += 512) *reinterpret_cast<uint4*>(p + head + i) = make_uint4(0, 0, 0, 0);
    for (int64_t i = head + body + 2 * lane; i < len; i += 64) *reinterpret_cast<uint16_t*>(p + i) = 0;
}

template <class Element, int kHdim, int kHdimV, int kBlockM, int kBlockN, bool kMasked>
__global__ void __launch_bounds__(256) preprocess_mods_kernel(PreprocessModsParams const p) {
    preprocess_tile<Element, kHdim, kHdimV, kBlockM>(p);
    if (p.dbias == nullptr) return;
    const auto work = RowTileScheduler::work();
    const int m = work.block, h = work.head, b = work.batch;
    const HopperSequence seq =
        p.seqstart_q != nullptr
            ? packed_sequence<kMasked>(p.seqstart_q, p.seqstart_k, b, p.mask_type, p.window_left, p.window_right)
            : HopperSequence{0, 0, p.seqlen_q, p.seqlen_k, MaskCoord{p.mask_y, p.mask_x}};
    const int r_end = seq.sq - m * kBlockM < kBlockM ? seq.sq - m * kBlockM : kBlockM;  // <= 0: past the sequence
    if (r_end <= 0) return;
    const auto geom = MaskGeometry<kMasked, int>::from_coord(seq.mask, seq.sq, seq.sk);
    const int64_t elem = p.dbias_fp32 ? 4 : 2;
    char* block = p.dbias + (int64_t(b) * p.dbias_batch + int64_t(h) * p.dbias_head) * elem +
                  int64_t(m * kBlockM) * p.dbias_row * elem;
    const int blocks = (seq.sk + kBlockN - 1) / kBlockN;
    int lo = 0;  // the first key of the run of unwritten blocks that block n would end
    for (int n = 0; n <= blocks; ++n) {
        if (n < blocks && !key_block_query_tiles<kBlockM, kBlockN>(geom, n).contains(m)) continue;
        const int hi = n * kBlockN < seq.sk ? n * kBlockN : seq.sk;  // keys [lo, hi) unwritten
        if (hi > lo) {
            for (int r = int(threadIdx.x) / 32; r < r_end; r += 8)  // a warp per row
                warp_zero_bytes(block + int64_t(r) * p.dbias_row * elem + lo * elem, (hi - lo) * elem,
                                int(threadIdx.x) % 32);
        }
        lo = (n + 1) * kBlockN;
    }
}

// d sink[h] = −Σ over the rows of every sequence of exp(sink[h] − LSE)·D (mha_bwd.h), one CTA per query head, from
// the workspace the preprocess filled (LSE·log2 e, D), in a fixed order: deterministic.
struct DsinkParams {
    float const* sink;
    float* dsink;
    float const* lse2;
    float const* dsum;
    const int32_t* seqstart_q;  // group mode, else nullptr
    int64_t sq_pad;
    int batch, nhead_q, seqlen_q;
};

template <int kThreads>  // 256 (a template: defined in every instance's translation unit)
__global__ void __launch_bounds__(kThreads) dsink_kernel(DsinkParams const p) {
    static_assert(kThreads == 256);
    const int h = int(blockIdx.x);
    const float sink2 = p.sink[h] * 1.4426950408889634f;
    float acc = 0.f;
    for (int b = 0; b < p.batch; ++b) {
        const SeqRows seq = seq_rows(p.seqstart_q, b, p.seqlen_q);
        const int64_t row0 = (int64_t(b) * p.nhead_q + h) * p.sq_pad;
        for (int i = int(threadIdx.x); i < seq.len; i += 256)
            acc -= exp2f(sink2 - p.lse2[row0 + i]) * p.dsum[row0 + i];
    }
    CUTLASS_PRAGMA_UNROLL
    for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    __shared__ float part[8];
    if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        float total = 0.f;
        for (int w = 0; w < 8; ++w) total += part[w];
        p.dsink[h] = total;
    }
}

struct ConvertParams {
    float const* dq_acc;
    void* dq;
    int64_t dq_row, dq_head, dq_batch;
    const int32_t* seqstart_q;  // group mode, else nullptr
    int m_tiles;
    int nhead_q, seqlen_q, hdim;
    float scale;
};

// Impl: HopperBwdKernelImpl (its TiledMmadQ and tile sizes define the fragment order). The accumulator tile is read
// with coalesced 16-byte loads in fragment order, scaled, converted and written out through StagedRows (storing the
// fragments' pairs straight to global memory took 154 us for 16k tokens x 16 heads of 128 on the H200, a third of the
// bandwidth).
template <class Impl>
__global__ void __launch_bounds__(256) convert_dq_kernel(ConvertParams const p) {
    using namespace cute;
    using Element = typename Impl::Element;
    constexpr int BM = Impl::kBlockM;
    constexpr int D = Impl::kHdim;
    constexpr int F = Impl::kDqFrag;
    using Tile = StagedRows<Element, BM, D>;
    __shared__ alignas(16) Element smem[Tile::kElems];

    const auto work = RowTileScheduler::work();
    const int m = work.block, h = work.head, b = work.batch;
    const SeqRows seq = seq_rows(p.seqstart_q, b, p.seqlen_q);
    if (m * BM >= seq.len) return;
    const int tid = int(threadIdx.x);
    const int wg = tid / 128;
    const int t = tid % 128;

    typename Impl::TiledMmadQ mma;
    auto thr = mma.get_thread_slice(tid);
    Tensor c = thr.partition_C(make_identity_tensor(Shape<Int<BM>, Int<D>>{}));
    static_assert(decltype(size(c))::value == F);

    float4 const* src = reinterpret_cast<float4 const*>(
                            p.dq_acc + ((int64_t(b) * p.nhead_q + h) * p.m_tiles + m) * int64_t(BM * D) +
                            wg * F * 128) +
                        t;
    float4 a[F / 4];
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < F / 4; ++v) a[v] = src[v * 128];
    const Tile tile{smem};
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < F / 4; ++v) {
        tile.put(get<0>(c(4 * v)), get<1>(c(4 * v)),
                 mhakit::hopper::detail::pack2<Element>(a[v].x * p.scale, a[v].y * p.scale));
        tile.put(get<0>(c(4 * v + 2)), get<1>(c(4 * v + 2)),
                 mhakit::hopper::detail::pack2<Element>(a[v].z * p.scale, a[v].w * p.scale));
    }
    __syncthreads();

    Element* dq = static_cast<Element*>(p.dq) + (p.seqstart_q != nullptr ? seq.first * p.dq_row : b * p.dq_batch) +
                  h * p.dq_head;
    const int rows = seq.len - m * BM < BM ? seq.len - m * BM : BM;
    tile.store(dq + int64_t(m * BM) * p.dq_row, p.dq_row, rows, p.hdim, tid, 256);
}

// ---- the GQA split's reduction -------------------------------------------------------------------------------

struct ReduceDkvParams {
    float const* dkv_part;  // the workspace's dkv region: [splits][b][hk][key_blocks] slots (dkv_slot)
    void* dk;
    void* dv;
    int64_t dk_row, dk_head, dk_batch;
    int64_t dv_row, dv_head, dv_batch;
    const int32_t* seqstart_k;  // group mode, else nullptr
    int seqlen_k;               // batch mode
    int batch, nhead_k, key_blocks, splits;
    int hdim, hdim_v;
    float dk_scale, dv_scale;  // the main kernel's epilogue scales: the softmax scale; dropout's 1 / (1 - p) or 1
};

// dK (or dV) of one key block: the slots' fragments added in the order of the splits (so the sum is the same bits
// on every run) into the accumulator the main kernel's epilogue would have held, then that epilogue (BwdEpilogue:
// scale, round, StagedRows, the sequence's keys only). Impl: the main kernel (its TiledMmas give the fragments'
// coordinates), kV: dV, at float offset `off` of each slot.
template <class Impl, bool kV, class Element>
CUTLASS_DEVICE void reduce_dkv_part(ReduceDkvParams const& p, float const* slot0, int64_t slot_stride, int off,
                                    BwdEpilogue<Element, Impl::kBlockN> const& epi, Element* dst, int64_t row_stride,
                                    int cols, float scale) {
    using namespace cute;
    constexpr int BN = Impl::kBlockN;
    constexpr int D = kV ? Impl::kHdimV : Impl::kHdim;
    const int tid = int(threadIdx.x);
    auto fill_store = [&](auto const& mma, auto shape, auto transposed) {
        auto thr = mma.get_thread_slice(tid);
        Tensor acc = partition_fragment_C(mma, shape);
        constexpr int F = decltype(size(acc))::value;
        static_assert(F * 256 == BN * D && F % 4 == 0);
        float4 const* src = reinterpret_cast<float4 const*>(slot0 + off) + tid;
        CUTLASS_PRAGMA_UNROLL
        for (int v = 0; v < F / 4; ++v) {
            const float4 a = src[v * 256];
            acc(4 * v) = a.x, acc(4 * v + 1) = a.y, acc(4 * v + 2) = a.z, acc(4 * v + 3) = a.w;
        }
        for (int sp = 1; sp < p.splits; ++sp) {
            float4 const* s = reinterpret_cast<float4 const*>(slot0 + sp * slot_stride + off) + tid;
            CUTLASS_PRAGMA_UNROLL
            for (int v = 0; v < F / 4; ++v) {
                const float4 a = s[v * 256];
                acc(4 * v) += a.x, acc(4 * v + 1) += a.y, acc(4 * v + 2) += a.z, acc(4 * v + 3) += a.w;
            }
        }
        if constexpr (decltype(transposed)::value)
            epi.template store_t<D>(dst, row_stride, cols, scale, acc, thr);
        else
            epi.template store<D>(dst, row_stride, cols, scale, acc, thr);
    };
    if constexpr (Impl::kSwapKV) {
        fill_store(typename Impl::TiledMmadKVt{}, Shape<Int<D>, Int<BN>>{}, std::true_type{});
    } else if constexpr (kV) {
        fill_store(typename Impl::TiledMmadV{}, Shape<Int<BN>, Int<D>>{}, std::false_type{});
    } else {
        fill_store(typename Impl::TiledMmadKV{}, Shape<Int<BN>, Int<D>>{}, std::false_type{});
    }
}

// Shared memory of reduce_dkv_kernel: one StagedRows tile, dK's and then dV's (dynamic: above 48 KB for a query split
// of 128 keys at head dim 192).
template <class Impl>
constexpr int reduce_dkv_smem_bytes() {
    using Epi = BwdEpilogue<typename Impl::Element, Impl::kBlockN>;
    constexpr int k = Epi::template kStageElems<Impl::kHdim>, v = Epi::template kStageElems<Impl::kHdimV>;
    return (k > v ? k : v) * int(sizeof(typename Impl::Element));
}

// One CTA of 256 threads per (key block, kv head, batch); the key blocks past a sequence's keys return at once (group
// mode: the grid is sized by max_seqlen_k, as the main kernel's).
template <class Impl>
__global__ void __launch_bounds__(256) reduce_dkv_kernel(ReduceDkvParams const p) {
    using Element = typename Impl::Element;
    constexpr int BN = Impl::kBlockN;
    extern __shared__ __align__(16) char reduce_smem[];
    const auto work = RowTileScheduler::work();
    const int n = work.block, hk = work.head, b = work.batch;
    const SeqRows seq = seq_rows(p.seqstart_k, b, p.seqlen_k);
    if (n * BN >= seq.len) return;
    float* const part = const_cast<float*>(p.dkv_part);
    float const* slot0 = dkv_slot<Impl::kSlotFloats>(part, 0, b, hk, n, p.batch, p.nhead_k, p.key_blocks);
    // From one split's slot to the next: read off dkv_slot, the layout's one statement.
    const int64_t slot_stride =
        dkv_slot<Impl::kSlotFloats>(part, 1, b, hk, n, p.batch, p.nhead_k, p.key_blocks) - slot0;
    const bool group = p.seqstart_k != nullptr;
    const BwdEpilogue<Element, BN> epi{n * BN, seq.len, reinterpret_cast<Element*>(reduce_smem), int(threadIdx.x), 256,
                                       /*bar_id=*/0};
    Element* dk = static_cast<Element*>(p.dk) + (group ? seq.first * p.dk_row : b * p.dk_batch) + hk * p.dk_head;
    Element* dv = static_cast<Element*>(p.dv) + (group ? seq.first * p.dv_row : b * p.dv_batch) + hk * p.dv_head;
    reduce_dkv_part<Impl, false>(p, slot0, slot_stride, 0, epi, dk, p.dk_row, p.hdim, p.dk_scale);
    reduce_dkv_part<Impl, true>(p, slot0, slot_stride, BN * Impl::kHdim, epi, dv, p.dv_row, p.hdim_v, p.dv_scale);
}

}  // namespace mhakit::hopper::bwd
