// mhakit hopper family — the epilogues. The forward's, for one consumer warpgroup (64 query rows): the fp32
// natural-log LSE, and O staged through a shared-memory tile (the warpgroup's own Q buffer, idle by then, or a buffer
// of its own) so that global memory sees whole 16-byte stores, predicated on the real seqlen_q and head dim, or
// (persistent tiles with a swizzled buffer of their own) one TMA store that clips to them. The backward's: dK / dV
// (and, in the light convert kernel, dQ) through StagedRows, a padded shared-memory tile written out in row chunks.
#pragma once

#include <cstdint>

#include "cute/arch/copy_sm90_tma.hpp"
#include "cute/tensor.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/cutlass.h"

#include "hopper_tile_io.hpp"
#include "hopper_types.hpp"

namespace mhakit::hopper {

// A tile of kRows x kCols 16-bit elements on its way from MMA fragments to global memory: put in place in shared
// memory (rows padded by 16 bytes, so that the 8 rows of one fragment store fall in different banks), then written
// out in whole 16-byte row chunks. (Storing the fragments' 4-byte pairs straight to global memory half-fills every
// 32-byte sector written.)
template <class Element, int kRows, int kCols>
struct StagedRows {
    static constexpr int kPitch = kCols + 8;  // elements per shared-memory row
    static constexpr int kElems = kRows * kPitch;
    static_assert(kCols % 8 == 0 && (kPitch * int(sizeof(Element))) % 16 == 0);
    Element* smem;  // kElems elements, 16-byte aligned

    // The pair of elements (r, c), (r, c + 1), packed (detail::pack2).
    CUTLASS_DEVICE void put(int r, int c, uint32_t pair) const {
        *reinterpret_cast<uint32_t*>(smem + r * kPitch + c) = pair;
    }
    // One element (r, c) (a transposed fragment, whose pairs lie in two rows).
    CUTLASS_DEVICE void put1(int r, int c, Element v) const { smem[r * kPitch + c] = v; }
    // Rows [0, rows) and columns [0, cols) (cols a multiple of 8) to dst, row stride in elements; thread tid of the
    // nthreads that share the work. The caller synchronises between the puts and this.
    CUTLASS_DEVICE void store(Element* dst, int64_t row_stride, int rows, int cols, int tid, int nthreads) const {
        constexpr int kChunks = kCols / 8;
        CUTLASS_PRAGMA_UNROLL
        for (int i = tid; i < kRows * kChunks; i += nthreads) {
            const int r = i / kChunks;
            const int col = (i % kChunks) * 8;
            if (r < rows && col < cols) {
                *reinterpret_cast<uint4*>(dst + int64_t(r) * row_stride + col) =
                    *reinterpret_cast<uint4 const*>(smem + r * kPitch + col);
            }
        }
    }
};

template <class Element, int kHdim>
struct FwdEpilogue {
    // Rows [row0, row0 + 64) of one (batch, head): lse points at row 0, o at (row 0, column 0). Rows outside
    // [0, seqlen_q) are not written (row0 < 0: a warpgroup of a query block's lead, ForwardMask::block_row0).
    float* lse;
    Element* o;
    int64_t o_row;
    int seqlen_q, hdim_v, row0;

    // The thread holding column 0 of a row writes its LSE.
    template <int R, class TensorC>
    CUTLASS_DEVICE void store_lse(float const (&row_lse)[R], TensorC const& c_mn) const {
        if (lse == nullptr || int(cute::get<1>(c_mn(0, 0))) != 0) return;
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < R; ++i) {
            const int row = row0 + int(cute::get<0>(c_mn(i, 0)));
            if (unsigned(row) < unsigned(seqlen_q)) lse[row] = row_lse[i];
        }
    }

    // acc_o (the P·V accumulator of mma_pv, one warpgroup's; tidx its thread) -> sO (64 x kHdim, swizzled; with
    // stmatrix, store_fragment_stsm) -> global. bar_id: a named barrier of this warpgroup's 128 threads.
    template <class TensorAcc, class TiledMma, class TensorSmem>
    CUTLASS_DEVICE void store_o(TensorAcc const& acc_o, TiledMma const& mma_pv, TensorSmem& sO, uint32_t bar_id,
                                int tidx) const {
        using namespace cute;
        Tensor o16 = make_tensor<Element>(acc_o.layout());
        detail::pack_fragment<Element>(acc_o, o16);
        store_fragment_stsm(mma_pv, tidx, o16, sO);
        cutlass::arch::NamedBarrier::sync(128, bar_id);

        constexpr int kChunks = kHdim / 8;  // 16-byte chunks per row
        CUTLASS_PRAGMA_UNROLL
        for (int c = tidx; c < 64 * kChunks; c += 128) {
            const int r = c / kChunks;
            const int col = (c % kChunks) * 8;
            const int row = row0 + r;
            if (unsigned(row) < unsigned(seqlen_q) && col < hdim_v) {
                const uint4 v = *reinterpret_cast<uint4 const*>(&sO(r, col));
                *reinterpret_cast<uint4*>(o + row * o_row + col) = v;
            }
        }
    }

    // The same O (its swizzled stage sO, (64, kHdimV)) written out by one TMA store (tma: its descriptor; src / dst:
    // FwdTileIO::o's partitions of sO and of this warpgroup's rows), which clips the rows past seqlen_q and the
    // columns past hdim_v. The store runs on after this returns. Thread 0 of the warpgroup, which issues it, must see
    // the previous one done reading sO (tma_store_drain) before any thread writes sO again: sO_free says the caller
    // had it wait before a barrier of the warpgroup since that store (the kernel: after the tile's first product,
    // before its second turn), else it waits here. tma_store_drain once more before the CTA exits.
    template <class TensorAcc, class TiledMma, class TensorSmem, class Tma, class TensorSrc, class TensorDst>
    CUTLASS_DEVICE void store_o_tma(TensorAcc const& acc_o, TiledMma const& mma_pv, TensorSmem& sO, Tma const& tma,
                                    TensorSrc const& src, TensorDst dst, bool sO_free, uint32_t bar_id,
                                    int tidx) const {
        using namespace cute;
        Tensor o16 = make_tensor<Element>(acc_o.layout());
        detail::pack_fragment<Element>(acc_o, o16);
        if (!sO_free) {
            tma_store_drain(tidx);
            cutlass::arch::NamedBarrier::sync(128, bar_id);
        }
        store_fragment_stsm(mma_pv, tidx, o16, sO);
        cutlass::arch::fence_view_async_shared();  // the stmatrix writes, visible to the TMA unit
        cutlass::arch::NamedBarrier::sync(128, bar_id);
        if (tidx == 0) {
            copy(tma, src, dst);
            tma_store_arrive();
        }
    }
    CUTLASS_DEVICE static void tma_store_drain(int tidx) {
        if (tidx == 0) cute::tma_store_wait<0>();
    }

    // The same O through a padded StagedRows tile of free shared memory, kCols columns at a time (fp8: the K/V ring,
    // the warpgroup's Q buffer being half the size of its 16-bit O, one pass; the persistent 192 tile: its own 128
    // columns, two passes); bar_id as above.
    template <class TensorAcc, class ThrMma, int kCols>
    CUTLASS_DEVICE void store_o_rows(TensorAcc const& acc_o, ThrMma const& thr_pv,
                                     StagedRows<Element, 64, kCols> const& tile, uint32_t bar_id, int tidx) const {
        using namespace cute;
        static_assert(kCols <= kHdim);
        Tensor c = thr_pv.partition_C(make_identity_tensor(Shape<_64, Int<kHdim>>{}));
        static_assert(decltype(size(c))::value == decltype(size(acc_o))::value);
        const int rows = row0 < 0 ? 0 : seqlen_q - row0 < 64 ? seqlen_q - row0 : 64;
        CUTLASS_PRAGMA_UNROLL
        for (int c0 = 0; c0 < kHdim; c0 += kCols) {
            if (c0 > 0) cutlass::arch::NamedBarrier::sync(128, bar_id);  // the previous pass's reads are done
            CUTLASS_PRAGMA_UNROLL
            for (int k = 0; k < decltype(size(acc_o))::value / 2; ++k) {
                const int col = get<1>(c(2 * k));
                if (kCols == kHdim || (col >= c0 && col < c0 + kCols))
                    tile.put(get<0>(c(2 * k)), col - c0, detail::pack2<Element>(acc_o(2 * k), acc_o(2 * k + 1)));
            }
            cutlass::arch::NamedBarrier::sync(128, bar_id);
            tile.store(o + int64_t(row0) * o_row + c0, o_row, rows, hdim_v - c0, tidx, 128);
        }
    }
};

}  // namespace mhakit::hopper

namespace mhakit::hopper {

// The backward's epilogue: a key block's dK (times scale) or dV accumulator (kBlockN keys x kCols, partitioned by
// thr; store_t: its transpose, kCols x kBlockN, the swapped key split's dKᵀ / dVᵀ) through StagedRows in free shared
// memory to global memory, predicated on the real keys and head dim.
template <class Element, int kBlockN>
struct BwdEpilogue {
    int n0, seqlen_k;  // the block's first key, the sequence's keys
    Element* stage;    // kStageElems<kCols> free elements of shared memory
    int tid, nthreads; // this thread among the nthreads threads that hold the accumulator
    uint32_t bar_id;   // a named barrier of those threads

    template <int kCols>
    static constexpr int kStageElems = StagedRows<Element, kBlockN, kCols>::kElems;

    // dst: (key 0 of the block's sequence, column 0) of this kv head.
    template <int kCols, class TensorAcc, class ThrMma>
    CUTLASS_DEVICE void store(Element* dst, int64_t row_stride, int cols, float scale, TensorAcc const& acc,
                              ThrMma const& thr) const {
        using namespace cute;
        const StagedRows<Element, kBlockN, kCols> tile{stage};
        Tensor c = thr.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kCols>>{}));
        static_assert(decltype(size(c))::value == decltype(size(acc))::value);
        CUTLASS_PRAGMA_UNROLL
        for (int k = 0; k < decltype(size(acc))::value / 2; ++k)
            tile.put(get<0>(c(2 * k)), get<1>(c(2 * k)),
                     detail::pack2<Element>(acc(2 * k) * scale, acc(2 * k + 1) * scale));
        write_out(tile, dst, row_stride, cols);
    }

    template <int kCols, class TensorAcc, class ThrMma>
    CUTLASS_DEVICE void store_t(Element* dst, int64_t row_stride, int cols, float scale, TensorAcc const& acc,
                                ThrMma const& thr) const {
        using namespace cute;
        const StagedRows<Element, kBlockN, kCols> tile{stage};
        Tensor c = thr.partition_C(make_identity_tensor(Shape<Int<kCols>, Int<kBlockN>>{}));  // (d, key)
        static_assert(decltype(size(c))::value == decltype(size(acc))::value);
        CUTLASS_PRAGMA_UNROLL
        for (int k = 0; k < decltype(size(acc))::value; ++k)
            tile.put1(get<1>(c(k)), get<0>(c(k)), static_cast<Element>(acc(k) * scale));
        write_out(tile, dst, row_stride, cols);
    }

  private:
    template <int kCols>
    CUTLASS_DEVICE void write_out(StagedRows<Element, kBlockN, kCols> const& tile, Element* dst, int64_t row_stride,
                                  int cols) const {
        cutlass::arch::NamedBarrier::sync(nthreads, bar_id);
        const int keys = seqlen_k - n0 < kBlockN ? seqlen_k - n0 : kBlockN;
        tile.store(dst + int64_t(n0) * row_stride, row_stride, keys, cols, tid, nthreads);
        cutlass::arch::NamedBarrier::sync(nthreads, bar_id);  // the stage is free again
    }
};

}  // namespace mhakit::hopper
