// mhakit hopper family — the device kernel: one producer warp (TMA loads through the CUTLASS 88 collective) and
// NumMmaWG consumer warpgroups of 64 query rows each, with
//   * intra-warpgroup overlap: the softmax of tile n runs while the P·V wgmma of tile n-1 is in flight;
//   * inter-warpgroup ping-pong: named barriers make the consumer warpgroups take turns issuing their wgmmas, so
//     one warpgroup's softmax overlaps the other's tensor-core work;
//   * an epilogue that stages O through the warpgroup's own (by then idle) Q buffer in shared memory and writes it
//     with 16-byte stores predicated on the real seqlen_q and head dim, plus the fp32 natural-log LSE.
//
// Types, tiled MMAs, TMA descriptors, smem layouts and the TMA load helpers (CollectiveLoadTma) come from
// examples/88_hopper_fmha/collective/fmha_collective_tma_warpspecialized.hpp (included as a library from the
// nvidia-cutlass wheel); the producer loop (which starts at the window's first key tile), the consumer mainloop,
// mask, softmax and epilogue here are our own. The collective's Fusion parameter is never called by this kernel.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cute/tensor.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/arch/reg_reconfig.h"
#include "cutlass/cutlass.h"
#include "cutlass/numeric_types.h"
#include "cutlass/pipeline/pipeline.hpp"

#include "88_hopper_fmha/collective/fmha_collective_tma_warpspecialized.hpp"

#include "fmha_hopper_mask.hpp"

namespace mhakit::hopper {

using namespace cute;

// (row, 1, (batch, (heads_per_group, nhead_k))) element strides of Q and of K / V. For K and V the heads_per_group
// stride is a static 0, which is how query head h reads kv head h / heads_per_group (GQA / MQA) with no index
// arithmetic; CuTe drops static-0 modes from the TMA descriptor.
using HopperStrideQ = cute::tuple<int64_t, cute::_1, cute::tuple<int64_t, cute::tuple<int64_t, int64_t>>>;
using HopperStrideKV = cute::tuple<int64_t, cute::_1, cute::tuple<int64_t, cute::tuple<cute::_0, int64_t>>>;

namespace detail {

CUTLASS_DEVICE float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

template <class Element>
CUTLASS_DEVICE uint32_t pack2(float a, float b) {
    if constexpr (std::is_same_v<Element, cutlass::bfloat16_t>) {
        __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
        return reinterpret_cast<uint32_t const&>(v);
    } else {
        __half2 v = __floats2half2_rn(a, b);
        return reinterpret_cast<uint32_t const&>(v);
    }
}

}  // namespace detail

template <class Element_, int kHdim, bool kMasked, int kBlockM, int kBlockN>
struct HopperFwdKernelImpl {
    using Element = Element_;
    static_assert(kBlockM == 128 || kBlockM == 192, "kBlockM: 128 or 192 (one consumer warpgroup per 64 rows)");
    static_assert(kBlockN % 16 == 0 && kBlockN >= 16 && kBlockN <= 256, "kBlockN: a multiple of 16, at most 256");
    static_assert(kHdim == 64 || kHdim == 128 || kHdim == 256, "head-dim buckets: 64, 128, 256");

    static constexpr int NumMmaWG = kBlockM / 64;
    static constexpr int kSmemLimit = 232448;  // sm_90 opt-in maximum of dynamic shared memory per block
    static constexpr int kQBytes = kBlockM * kHdim * int(sizeof(Element));
    static constexpr int kStageBytes = kBlockN * kHdim * int(sizeof(Element));
    static constexpr int kFitStages = (kSmemLimit - 1024 - kQBytes) / kStageBytes;
    static constexpr int kStages = kFitStages < 5 ? kFitStages : 5;  // K and V tiles alternate in one ring
    static_assert(kStages >= 2, "tile too large for shared memory");

    using TileShape = Shape<Int<kBlockM>, Int<kBlockN>, Int<kHdim>>;
    using Fusion = MaskPolicy<kMasked>;
    using Mainloop = cutlass::fmha::collective::FmhaMainloopTmaWarpSpecialized<
        Element, float, float, TileShape, HopperStrideQ, HopperStrideKV, HopperStrideKV, Fusion,
        cutlass::fmha::kernel::Option<cutlass::fmha::kernel::Tag::kNumMmaWarpGroups, Int<NumMmaWG>>,
        cutlass::fmha::kernel::Option<cutlass::fmha::kernel::Tag::kStagesKV, Int<kStages>>>;

    using TileShapeQK = typename Mainloop::TileShapeQK;  // (64, kBlockN, kHdim)
    using TileShapePV = typename Mainloop::TileShapePV;  // (64, kHdim, kBlockN)
    using TiledMmaQK = typename Mainloop::TiledMmaQK;
    using TiledMmaPV = typename Mainloop::TiledMmaPV;
    using SmemLayoutQ = typename Mainloop::SmemLayoutQ;
    using SmemLayoutK = typename Mainloop::SmemLayoutK;
    using SmemLayoutV = typename Mainloop::SmemLayoutV;
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

    // Named barriers (ids above CUTLASS' reserved ones): [0, NumMmaWG) ping-pong, [NumMmaWG, 2 NumMmaWG) epilogue.
    static constexpr uint32_t kBarSched = 0;
    static constexpr uint32_t kBarEpi = NumMmaWG;

    struct SharedStorage {
        typename Mainloop::SharedStorage mainloop;
        alignas(16) typename PipelineKV::SharedStorage pipe_kv;
        alignas(16) typename PipelineQ::SharedStorage pipe_q;
    };
    static constexpr int SharedStorageSize = int(sizeof(SharedStorage));
    static_assert(SharedStorageSize <= kSmemLimit);

    struct Params {
        HopperProblemShape problem;  // (b, (g, hk), sq, sk, d, x, y)
        typename Mainloop::Params mainloop;
        Element* o;
        int64_t o_row, o_head, o_batch;
        float* lse;
        int64_t lse_head, lse_batch;
    };

    CUTLASS_DEVICE void operator()(Params const& params, char* smem) {
#if defined(CUTLASS_ARCH_MMA_SM90A_ENABLED)
        auto& storage = *reinterpret_cast<SharedStorage*>(smem);
        const int warp_idx = cutlass::canonical_warp_idx_sync();
        const int wg_idx = cutlass::canonical_warp_group_idx();
        const int warp_in_wg = warp_idx % 4;
        const int lane_predicate = cute::elect_one_sync();

        if (warp_idx == 0 && lane_predicate) Mainloop::prefetch_tma_descriptors(params.mainloop);

        const bool producer_warp = (wg_idx == 0 && warp_in_wg == 0);

        typename PipelineQ::Params pq;
        pq.transaction_bytes = Mainloop::kOuterLoadBytes;
        pq.is_leader = producer_warp && lane_predicate;
        pq.num_consumers = 128;
        typename PipelineKV::Params pkv;
        pkv.transaction_bytes = Mainloop::kInnerLoadBytes;
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
        __syncthreads();

        // Masked kernels: the heaviest query blocks (largest m) first, so the tail of the grid is short.
        const int m_block = kMasked ? int(gridDim.x - 1 - blockIdx.x) : int(blockIdx.x);
        auto blk = make_coord(m_block, _0{}, make_coord(int(blockIdx.y), int(blockIdx.z)));

        const KeyTileRange tiles = Fusion::template key_tiles<kBlockM, kBlockN>(m_block, params.problem);

        if (wg_idx == 0) {
            cutlass::arch::warpgroup_reg_dealloc<kLoadRegs>();
            if (warp_in_wg == 0) producer(params, storage, pipe_q, pipe_kv, blk, tiles);
        } else {
            cutlass::arch::warpgroup_reg_alloc<kMmaRegs>();
            consumer(params, storage, pipe_q, pipe_kv, blk, tiles, wg_idx - 1);
        }
#endif
    }

    struct TileIter {
        int i;
        CUTLASS_DEVICE int operator*() const { return i; }
        CUTLASS_DEVICE TileIter& operator++() {
            ++i;
            return *this;
        }
    };

    // One warp: Q tiles of all consumer warpgroups, then K/V tiles n_begin .. n_end-1 (K_n and V_n alternate in
    // one ring, so the consumers' wait order is K0 V0 K1 V1 ...).
    template <class Blk>
    CUTLASS_DEVICE void producer(Params const& params, SharedStorage& storage, PipelineQ& pipe_q, PipelineKV& pipe_kv,
                                 Blk const& blk, KeyTileRange const& tiles) {
        using LoadQ = typename Mainloop::LoadQ;
        using LoadK = typename Mainloop::LoadK;
        using LoadV = typename Mainloop::LoadV;
        const int lane_predicate = cute::elect_one_sync();
        StateKV wkv = cutlass::make_producer_start_state<PipelineKV>();
        StateQ wq = cutlass::make_producer_start_state<PipelineQ>();

        LoadQ load_q{params.mainloop.tma_load_q, pipe_q, storage.mainloop.smem_q};
        auto st_q = load_q.init_state(_0{}, params.problem, TileShapeQK{}, blk, NumMmaWG);
        LoadK load_k{params.mainloop.tma_load_k, pipe_kv, storage.mainloop.smem_k};
        auto st_k = load_k.init_state(_0{}, params.problem, TileShapeQK{}, blk, 0);
        LoadV load_v{params.mainloop.tma_load_v, pipe_kv, storage.mainloop.smem_v};
        auto st_v = load_v.init_state(_0{}, params.problem, TileShapePV{}, blk, 0);

        TileIter q_it{0};
        int q_count = NumMmaWG;
        TileIter kv_it{tiles.n_begin};
        int kv_count = 2 * (tiles.n_end - tiles.n_begin);

        load_q.step(q_it, st_q, wq, lane_predicate, q_count);                     // Q of warpgroup 0
        load_k.template step<false>(kv_it, st_k, wkv, lane_predicate, kv_count);  // first K
        while (q_count > 0) load_q.step(q_it, st_q, wq, lane_predicate, q_count);
        load_v.template step<true>(kv_it, st_v, wkv, lane_predicate, kv_count);   // first V
        CUTLASS_PRAGMA_NO_UNROLL
        while (kv_count > 0) {
            load_k.template step<false>(kv_it, st_k, wkv, lane_predicate, kv_count);
            load_v.template step<true>(kv_it, st_v, wkv, lane_predicate, kv_count);
        }
    }

    template <class Blk>
    CUTLASS_DEVICE void consumer(Params const& params, SharedStorage& storage, PipelineQ& pipe_q, PipelineKV& pipe_kv,
                                 Blk const& blk, KeyTileRange const& tiles, int wg) {
        using cutlass::arch::NamedBarrier;
        using namespace cutlass::fmha::collective;

        const int tidx = int(threadIdx.x % 128);
        auto const& ps = params.problem;
        const int sq = get<2>(ps);
        const int sk = get<3>(ps);
        const int xr = get<5>(ps);
        const int yr = get<6>(ps);
        const int row0 = int(get<0>(blk)) * kBlockM + wg * 64;  // first query row of this warpgroup
        const float scale_log2 = params.mainloop.scale_softmax_log2;

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
        constexpr int C = decltype(size<1>(s_mn))::value;  // key columns held by this thread, per row
        static_assert(R == decltype(size<0>(o_mn))::value);

        // P as the A operand (registers) of the P·V wgmma.
        Tensor tOrP = make_fragment_like<Element>(
            convert_c_layout_to_a_layout(acc_s.layout(), shape<1>(typename TiledMmaPV::LayoutA_TV{})));
        static_assert(decltype(size(tOrP))::value == decltype(size(acc_s))::value);

        float row_max[R], row_sum[R], scale_o[R];
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < R; ++i) {
            row_max[i] = -INFINITY;
            row_sum[i] = 0.f;
            scale_o[i] = 1.f;
        }
        clear(acc_o);

        auto sched_sync = [&] {
            if constexpr (NumMmaWG > 1) NamedBarrier::sync(2 * 128, kBarSched + wg);
        };
        // The last warpgroup skips its final arrive: it opened the round with an extra one (below).
        auto sched_arrive = [&](bool last) {
            if constexpr (NumMmaWG > 1) {
                if (!(last && wg == NumMmaWG - 1)) NamedBarrier::arrive(2 * 128, kBarSched + (wg + 1) % NumMmaWG);
            }
        };
        if constexpr (NumMmaWG > 1) {
            if (wg == NumMmaWG - 1) NamedBarrier::arrive(2 * 128, kBarSched + 0);
        }

        // Row i keeps keys lo <= j < hi: lo = i - y + 1, hi = min(i + x, sk) (unmasked kernels: only j < sk).
        auto need_mask = [&](int n) { return n < tiles.full_lo || n >= tiles.full_hi; };
        auto apply_mask = [&](int n) {
            const int key0 = n * kBlockN;
            CUTLASS_PRAGMA_UNROLL
            for (int i = 0; i < R; ++i) {
                const int row = row0 + int(get<0>(c_mn(i, 0)));
                int hi = sk;
                int lo = 0;
                if constexpr (kMasked) {
                    const int l = row + xr;
                    hi = l < sk ? l : sk;
                    lo = row - yr + 1;
                }
                hi -= key0;
                lo -= key0;
                CUTLASS_PRAGMA_UNROLL
                for (int j = 0; j < C; ++j) {
                    const int col = int(get<1>(c_mn(i, j)));
                    if (col >= hi || (kMasked && col < lo)) s_mn(i, j) = -INFINITY;
                }
            }
        };

        // Online softmax on the fresh scores in acc_s: P overwrites S; scale_o gets the rescale factor of O.
        auto softmax = [&](auto is_first) {
            CUTLASS_PRAGMA_UNROLL
            for (int i = 0; i < R; ++i) {
                float mx = row_max[i];
                CUTLASS_PRAGMA_UNROLL
                for (int j = 0; j < C; ++j) mx = fmaxf(mx, s_mn(i, j));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                const float m_ref = (mx == -INFINITY) ? 0.f : mx;  // rows with nothing visible yet: no NaN
                const float neg = -m_ref * scale_log2;
                if constexpr (!decltype(is_first)::value) {
                    scale_o[i] = detail::exp2_approx((row_max[i] - m_ref) * scale_log2);
                }
                row_max[i] = mx;
                float sum = 0.f;
                CUTLASS_PRAGMA_UNROLL
                for (int j = 0; j < C; ++j) {
                    const float pj = detail::exp2_approx(fmaf(s_mn(i, j), scale_log2, neg));
                    s_mn(i, j) = pj;
                    sum += pj;
                }
                if constexpr (decltype(is_first)::value) {
                    row_sum[i] = sum;
                } else {
                    row_sum[i] = fmaf(row_sum[i], scale_o[i], sum);
                }
            }
        };

        auto convert_p = [&] {
            float const* src = raw_pointer_cast(acc_s.data());
            uint32_t* dst = reinterpret_cast<uint32_t*>(raw_pointer_cast(tOrP.data()));
            CUTLASS_PRAGMA_UNROLL
            for (int k = 0; k < decltype(size(acc_s))::value / 2; ++k) {
                dst[k] = detail::pack2<Element>(src[2 * k], src[2 * k + 1]);
            }
        };

        StateQ rq;
        rq.advance(wg);  // warpgroup w owns Q stage w
        StateKV rkv;     // K0, V0, K1, V1, ... alternate in the ring

        pipe_q.consumer_wait(rq);

        // ---- first tile: S = Q K^T, softmax ----
        {
            sched_sync();
            pipe_kv.consumer_wait(rkv);
            warpgroup_fence_operand(acc_s);
            warpgroup_arrive();
            gemm_zero_acc(mma_qk, tSrQ(_, _, _, rq.index()), tSrK(_, _, _, rkv.index()), acc_s);
            warpgroup_commit_batch();
            sched_arrive(tiles.n_end - tiles.n_begin == 1);
            warpgroup_wait<0>();
            warpgroup_fence_operand(acc_s);
            pipe_kv.consumer_release(rkv);
            ++rkv;  // -> V0
            if (need_mask(tiles.n_begin)) apply_mask(tiles.n_begin);
            softmax(cute::true_type{});
            convert_p();
        }

        // ---- later tiles: S_n = Q K_n^T and O += P_{n-1} V_{n-1} in flight together ----
        CUTLASS_PRAGMA_NO_UNROLL
        for (int n = tiles.n_begin + 1; n < tiles.n_end; ++n) {
            StateKV rv = rkv;  // V_{n-1}
            ++rkv;             // K_n
            sched_sync();
            pipe_kv.consumer_wait(rkv);
            warpgroup_fence_operand(acc_s);
            warpgroup_arrive();
            gemm_zero_acc(mma_qk, tSrQ(_, _, _, rq.index()), tSrK(_, _, _, rkv.index()), acc_s);
            warpgroup_commit_batch();
            pipe_kv.consumer_wait(rv);
            warpgroup_fence_operand(acc_o);
            warpgroup_arrive();
            cute::gemm(mma_pv, tOrP, tOrV(_, _, _, rv.index()), acc_o);
            warpgroup_commit_batch();
            sched_arrive(n == tiles.n_end - 1);

            warpgroup_wait<1>();  // S_n ready; P_{n-1} V_{n-1} may still run
            warpgroup_fence_operand(acc_s);
            pipe_kv.consumer_release(rkv);
            if (need_mask(n)) apply_mask(n);
            softmax(cute::false_type{});

            warpgroup_wait<0>();
            warpgroup_fence_operand(acc_o);
            pipe_kv.consumer_release(rv);
            CUTLASS_PRAGMA_UNROLL
            for (int i = 0; i < R; ++i) {
                CUTLASS_PRAGMA_UNROLL
                for (int j = 0; j < decltype(size<1>(o_mn))::value; ++j) o_mn(i, j) *= scale_o[i];
            }
            convert_p();
            ++rkv;  // -> V_n
        }

        // ---- last P·V ----
        pipe_kv.consumer_wait(rkv);
        warpgroup_fence_operand(acc_o);
        warpgroup_arrive();
        cute::gemm(mma_pv, tOrP, tOrV(_, _, _, rkv.index()), acc_o);
        warpgroup_commit_batch();
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc_o);
        pipe_kv.consumer_release(rkv);

        // ---- normalise, LSE ----
        float lse[R];
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < R; ++i) {
            float s = row_sum[i];
            s += __shfl_xor_sync(0xffffffffu, s, 1);
            s += __shfl_xor_sync(0xffffffffu, s, 2);
            const bool any = s > 0.f;
            const float inv = any ? 1.f / s : 0.f;
            lse[i] = any ? row_max[i] * params.mainloop.scale_softmax + __logf(s) : -INFINITY;
            CUTLASS_PRAGMA_UNROLL
            for (int j = 0; j < decltype(size<1>(o_mn))::value; ++j) o_mn(i, j) *= inv;
        }

        const int b = int(get<2, 0>(blk));
        const int h = int(get<2, 1>(blk));
        if (params.lse != nullptr && int(get<1>(c_mn(0, 0))) == 0) {
            float* lse_base = params.lse + b * params.lse_batch + h * params.lse_head;
            CUTLASS_PRAGMA_UNROLL
            for (int i = 0; i < R; ++i) {
                const int row = row0 + int(get<0>(c_mn(i, 0)));
                if (row < sq) lse_base[row] = lse[i];
            }
        }

        // ---- O: registers -> this warpgroup's Q buffer (free now) -> 16-byte global stores ----
        Tensor sO = sQ(_, _, rq.index());  // (64, kHdim), swizzled
        Tensor tOsO = thr_pv.partition_C(sO);
        static_assert(decltype(size(tOsO))::value == decltype(size(acc_o))::value);
        {
            float const* src = raw_pointer_cast(acc_o.data());
            CUTLASS_PRAGMA_UNROLL
            for (int k = 0; k < decltype(size(acc_o))::value / 2; ++k) {
                *reinterpret_cast<uint32_t*>(&tOsO(2 * k)) = detail::pack2<Element>(src[2 * k], src[2 * k + 1]);
            }
        }
        NamedBarrier::sync(128, kBarEpi + wg);

        const int dv = get<4>(ps);
        Element* o_base = params.o + b * params.o_batch + h * params.o_head;
        constexpr int kChunks = kHdim / 8;  // 16-byte chunks per row
        CUTLASS_PRAGMA_UNROLL
        for (int c = tidx; c < 64 * kChunks; c += 128) {
            const int r = c / kChunks;
            const int col = (c % kChunks) * 8;
            const int row = row0 + r;
            if (row < sq && col < dv) {
                const uint4 v = *reinterpret_cast<uint4 const*>(&sO(r, col));
                *reinterpret_cast<uint4*>(o_base + row * params.o_row + col) = v;
            }
        }
    }
};

}  // namespace mhakit::hopper
