// mhakit hopper family — the forward's TMA tile I/O: for one (batch, head) of the tensors TMA sees, the source
// (global, as TMA coordinates) and destination (shared memory) partitions of a CTA's Q, K and V tiles, for a sequence
// whose first row sits at row q_row0 / k_row0 of those tensors: 0 in batch mode (the batch is a TMA mode of its own),
// the packed offset seqstart[b] in group mode (the tensors are then one batch of all tokens, and a tile that runs
// past its sequence reads the next sequence's rows: the mask hides keys past seqlen_k, the epilogue never writes
// rows past seqlen_q, and TMA zero-fills past the packed tensor's end).
//
// A partition pair is what CollectiveLoadTma::step (CUTLASS example 88) copies: tile t of the source into stage s of
// the destination.
//
// The forward's O goes the other way (FwdTileIO::o): from a shared-memory tile to global memory, by a TMA store.
//
// store_fragment_stsm: 16-bit MMA fragments into a shared-memory tile with stmatrix (the backward's Pᵀ / dSᵀ, the
// forward's staged O).
#pragma once

#include "cute/arch/copy_sm90.hpp"
#include "cute/atom/copy_traits_sm90.hpp"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"

namespace mhakit::hopper {

template <class TileShapeQK, class TileShapePV>
struct FwdTileIO {
    // problem: (b, (g, hk), sq, sk, d, ...) as the TMA descriptors were made; bh: (batch, query head).
    // Q: (64, hdim) tiles down the query rows; a warpgroup whose first row is r reads tile r / 64.
    template <class Tma, class Problem, class BH, class Element, class SmemLayout>
    CUTLASS_DEVICE static auto q(Tma const& tma, Problem const& problem, BH const& bh, int q_row0, Element* smem,
                                 SmemLayout const& layout) {
        using namespace cute;
        return tiles(tma, make_shape(get<2>(problem), get<4>(problem), select<0, 1>(problem)), bh,
                     make_coord(q_row0, _0{}), select<0, 2>(TileShapeQK{}), make_coord(_, _0{}), smem, layout);
    }
    // K: (block_n, hdim) tiles down the keys.
    template <class Tma, class Problem, class BH, class Element, class SmemLayout>
    CUTLASS_DEVICE static auto k(Tma const& tma, Problem const& problem, BH const& bh, int k_row0, Element* smem,
                                 SmemLayout const& layout) {
        using namespace cute;
        return tiles(tma, make_shape(get<3>(problem), get<4>(problem), select<0, 1>(problem)), bh,
                     make_coord(k_row0, _0{}), select<1, 2>(TileShapeQK{}), make_coord(_, _0{}), smem, layout);
    }
    // V, seen transposed (hdim, keys): (hdim, block_n) tiles along the keys.
    template <class Tma, class Problem, class BH, class Element, class SmemLayout>
    CUTLASS_DEVICE static auto v(Tma const& tma, Problem const& problem, BH const& bh, int k_row0, Element* smem,
                                 SmemLayout const& layout) {
        using namespace cute;
        return tiles(tma, make_shape(get<4>(problem), get<3>(problem), select<0, 1>(problem)), bh,
                     make_coord(_0{}, k_row0), select<1, 2>(TileShapePV{}), make_coord(_0{}, _), smem, layout);
    }

    // O (the TMA store, HopperFwdKernelBody::kTmaStoreO): (64, hdim_v) tiles down the query rows as Q's, from a
    // shared-memory tile of a Q stage's layout; problem_o: the problem with O's head dim. (source, destination
    // tiles): tile t of the destination holds rows [64 t, 64 t + 64).
    template <class Tma, class Problem, class BH, class Element, class SmemLayout>
    CUTLASS_DEVICE static auto o(Tma const& tma, Problem const& problem_o, BH const& bh, Element* smem,
                                 SmemLayout const& layout) {
        using namespace cute;
        Tensor m = tma.get_tma_tensor(make_shape(get<2>(problem_o), get<4>(problem_o), select<0, 1>(problem_o)))(_, _, bh);
        Tensor g = local_tile(m, select<0, 2>(TileShapeQK{}), make_coord(_, _0{}));
        auto cta = tma.get_slice(_0{});
        return make_tuple(cta.partition_S(make_tensor(make_smem_ptr(smem), layout)), cta.partition_D(g));
    }

  private:
    // The (batch, head) slice of the TMA tensor of `shape`, shifted by `offset` rows, cut into `tile`s along the
    // mode that `coord` leaves open; partitioned for the CTA against the shared-memory stages.
    template <class Tma, class Shape, class BH, class Offset, class Tile, class Coord, class Element, class SmemLayout>
    CUTLASS_DEVICE static auto tiles(Tma const& tma, Shape const& shape, BH const& bh, Offset const& offset,
                                     Tile const& tile, Coord const& coord, Element* smem, SmemLayout const& layout) {
        using namespace cute;
        Tensor m = tma.get_tma_tensor(shape)(_, _, bh);
        Tensor g = local_tile(domain_offset(offset, m), tile, coord);
        auto cta = tma.get_slice(_0{});
        return make_tuple(cta.partition_S(g), cta.partition_D(make_tensor(make_smem_ptr(smem), layout)));
    }
};

// The 16-bit values of an MMA accumulator (r16: mma's C-fragment layout, already converted) into the shared-memory
// tile s (the MMA's C tile, 16-byte rows of 8 elements contiguous along N) with stmatrix, four 8 x 8 matrices per
// instruction. Assigning the elements through the swizzled tensor instead compiles to one 64-bit generic store per
// pair (CuTe swizzles the pointer through its integer value, so the shared state space is lost): 16 ST.E per tile
// and thread at the d64 backward's key split, against 4 STSM here. tid: the thread among mma's threads.
template <class TiledMma, class TensorR, class TensorS>
CUTLASS_DEVICE void store_fragment_stsm(TiledMma const& mma, int tid, TensorR const& r16, TensorS&& s) {
    using namespace cute;
    using Element = typename std::remove_cv_t<typename TensorR::value_type>;
    static_assert(sizeof(Element) == 2, "stmatrix moves 16-bit elements");
    auto copy = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma);
    auto thr = copy.get_thread_slice(tid);
    Tensor src = thr.retile_S(r16);
    Tensor dst = thr.partition_D(s);
    static_assert(decltype(size(src))::value == decltype(size(dst))::value);
    cute::copy(copy, src, dst);
}

}  // namespace mhakit::hopper
