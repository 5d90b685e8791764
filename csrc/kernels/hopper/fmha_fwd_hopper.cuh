// mhakit hopper family — forward FMHA on sm_90a (wgmma + TMA + warp specialization), batch and group mode.
//
//   template <mhakit_dtype kDtype, int kHdim, int kHdimV, bool kGroup, bool kMasked, int kBlockM, int kBlockN,
//             bool kMods>
//   struct mhakit::hopper::FwdKernel {
//       static bool supports(const FwdParams& p);                       // runtime guard, launches nothing
//       static cudaError_t run(const FwdParams& p, cudaStream_t stream); // asynchronous, no allocation, no sync
//   };
//
// Serves: fp16 / bf16 (chosen by kDtype; FwdParams carries no dtype, so the dispatcher must match it); hdim_q <=
// kHdim and hdim_v <= kHdimV, multiples of 8 (kHdim a multiple of 32 in [64, 256], kHdimV one in [64, kHdim]: the
// catalogue builds 64, 96, 128, 192 and 256 with kHdimV = kHdim, and (192, 128); smaller head dims are zero-padded
// by TMA); GQA / MQA (nhead_q % nhead_k == 0); LSE (fp32, natural log) when p.lse.
// Batch mode (kGroup = false): any seqlen_q, seqlen_k >= 1. Group mode (kGroup = true): sequences of any lengths
// (empty ones included) packed along the rows; the TMA descriptors see the packed tensors as one batch of total_q /
// total_k rows, which the caller must give (FwdParams::total_q / total_k; 0 = unknown and the call goes to the
// generic family), and each CTA offsets its tiles by its sequence's seqstart (hopper_tile_io.hpp).
// Masks: kMasked = false serves mask_type 0; kMasked = true serves mask_type 1, 2, 3 (with kMods 0 too): causal
// top-left / bottom-right, sliding windows (t:l,r / b:l,r) and CK's generic (y, x). Key tiles outside a block's
// window are skipped, not just masked.
// Layout: any element strides whose byte values are multiples of 16 (TMA), 16-byte aligned q/k/v/o pointers.
// Score modifiers (kMods, the "_mods" instances; the runtime gives them exactly the calls that set a soft-cap, a bias /
// ALiBi, a sink or dropout: catalogue score_mods): soft-cap, elementwise bias (fp32 or 16-bit, any strides, broadcast
// by zero strides), ALiBi ([h] or [b, h] slopes), sinks and dropout (the generic family's random bytes,
// hopper_dropout.hpp; the optional randval store by a kernel of its own before the attention kernel, every score
// inside the sequences: kernels/common/dropout_randval.cuh), with the generic family's semantics
// (kernels/common/score_mod.h; mha_fwd.h).
// fp8 (kDtype FP8_BF16 / FP8_FP16: e4m3 q/k/v, bf16 / fp16 o; hopper_fp8.hpp): batch mode, seqlen_k >= 0; run()
// first transposes V into p.workspace (workspace_bytes(p)), then launches the attention kernel; without keys it
// only writes O = 0 and LSE = -inf.
//
// Persistent (kPersistent, catalogue `persistent`; batch-mode plain instances): with a workspace of kCounterBytes
// (the tile counter, tagged with the call's p.counter_epoch: the caller never zeroes it) and p.num_sms, the grid is
// one CTA per multiprocessor walking the work tiles (DynamicPersistentScheduler); without one the same kernel runs
// one CTA per tile, as the other instances do. workspace_bytes() asks for the counter; the runtime lets a 16-bit call
// without a workspace through (registry.h: workspace_optional). fp8 ones need the workspace anyway: the counter,
// then V transposed from kVtOffset on.
//
// Tiles: kBlockM = 64 * (number of consumer warpgroups) in {128, 192}; kBlockN a multiple of 16 <= 256.
// Measured on H200 (bf16/fp16, 16k tokens, .scratch/hopper): hdim 64: 192x128 (128x128 is ~10% better only for
// causal s <= 1k); hdim 128: 128x128; hdim 256: 128x64. 128x176 (hdim 128) and 128x80 (hdim 256) were 25-35% slower,
// but measured before fmha_hopper_kernel.hpp enabled CuTe's extended wgmma shapes: their Q·Kᵀ then ran as wgmmas of
// N = 16 (so did the 112 / 80 keys of the 192 buckets' notes in the catalogue); worth measuring again.
//
// Build: nvcc -std=c++17 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -O3
//        -I$CUTLASS/include -I$CUTLASS/tools/util/include -I$CUTLASS/examples -I<repo>/csrc -I<repo>/csrc/include
//        -I$CUDA_HOME/include/cccl (nvcc 13)
// ($CUTLASS = the nvidia-cutlass 4.2.0.0 wheel's cutlass_library/source).
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

#include <cuda_runtime.h>

#include "cutlass/device_kernel.h"

#include "kernels/common/dropout_randval.cuh"
#include "kernels/common/fwd_params.h"
#include "kernels/common/mask.h"
#include "mha_common.h"

#include "fmha_hopper_guards.hpp"
#include "fmha_hopper_kernel.hpp"
#include "hopper_fp8.hpp"
#include "hopper_types.hpp"

namespace mhakit::hopper {

template <mhakit_dtype kDtype, int kHdim, int kHdimV, bool kGroup, bool kMasked, int kBlockM, int kBlockN, bool kMods,
          bool kPersistent = false, int kMaxStages = 5>
struct FwdKernel {
    using Element = typename DtypeOf<kDtype>::type;
    using ElementOut = typename DtypeOf<kDtype>::out;
    static_assert(kMaxStages == 5 || kPersistent, "catalogue `stages`: persistent tiles only");
    using Impl = std::conditional_t<
        kMods, HopperFwdKernelModsImpl<Element, ElementOut, kHdim, kHdimV, kGroup, kMasked, kBlockM, kBlockN>,
        std::conditional_t<kPersistent,
                           HopperFwdKernelPersistentImpl<Element, ElementOut, kHdim, kHdimV, kGroup, kMasked, kBlockM,
                                                         kBlockN, kMaxStages>,
                           HopperFwdKernelImpl<Element, ElementOut, kHdim, kHdimV, kGroup, kMasked, kBlockM, kBlockN>>>;
    // The main kernel of modifier variant kVar (FwdModVar): Impl for kGeneric (and in a plain instance), else the
    // "_mods" instance's fixed variant.
    template <int kVar>
    using ImplOf = std::conditional_t<
        !kMods || kVar == FwdModVar::kGeneric, Impl,
        HopperFwdKernelModsVarImpl<Element, ElementOut, kHdim, kHdimV, kGroup, kMasked, kBlockM, kBlockN,
                                   (kMods ? kVar : FwdModVar::kGeneric)>>;
    // The fixed variants (FwdModVar) a "_mods" instance builds besides the generic kernel, each a main kernel of its
    // own: soft-cap alone and ALiBi alone. Everything else keeps the generic kernel: a staged bias (its fixed kernel
    // had as many instructions per tile as the generic one's path, SASS in FwdModVar's comment), pairs of modifiers,
    // dropout, fp32 / unaligned biases, a sink alone (the catalogue sends those calls to the plain instances). They
    // add nvcc time to each "_mods" instance (d128 batch masked, FwdModVar's comment).
    using FixedVariants =
        std::integer_sequence<int, FwdModVar::kFixed | FwdModVar::kCap, FwdModVar::kFixed | FwdModVar::kAlibi>;
    static constexpr bool builds(int var) {
        if (!kMods) return false;
        return var == (FwdModVar::kFixed | FwdModVar::kCap) || var == (FwdModVar::kFixed | FwdModVar::kAlibi);
    }
    static constexpr int kCounterBytes = 8;  // persistent: the tile counter (epoch, count) at the workspace's start
    static constexpr bool kFp8 = Impl::kFp8;
    // fp8: where the transposed V starts in the workspace (persistent: after the counter, at the alignment every
    // workspace has)
    static constexpr size_t kVtOffset = kPersistent ? size_t(MHAKIT_WORKSPACE_ALIGNMENT) : 0;
    static_assert(kVtOffset == 0 || kVtOffset >= size_t(kCounterBytes), "V transposed after the tile counter");

    static constexpr int kAlignElems = 16 / int(sizeof(Element));

    // The run-time guard beyond what the runtime already checked: the validator (head dims, heads, mask type), the
    // instance's traits (dtype, mode, head-dim buckets) and the family's static guards from the catalogue (16-byte
    // alignment, head dims multiples of 8).
    static bool supports(const FwdParams& p) {
        if (p.batch < 1 || p.batch > 65535 || p.nhead_q > 65535) return false;  // grid
        if (kGroup != (p.seqstart_q != nullptr)) return false;
        if (kGroup ? (p.total_q < 1 || p.total_k < 1 || p.max_seqlen_q < 1)
                   : (p.seqlen_q < 1 || p.seqlen_k < (kFp8 ? 0 : 1)))  // fp8 writes the no-key result itself
            return false;
        if (kFp8 && (p.descale_q == nullptr || p.descale_k == nullptr || p.descale_v == nullptr)) return false;
        // A masked modifier instance serves unmasked calls too (the mask coordinate of mask_type 0 is the whole
        // rectangle), as the generic family's do: the profiles and the JIT build only the masked ones.
        if (kMasked ? (p.mask_type == 0 && !kMods) : p.mask_type != 0) return false;
        const auto ok = [](int64_t stride, int64_t extent) { return tma_stride_ok<Element>(stride, extent); };
        // K and V are not read by an fp8 call without keys (run() writes its result directly): any strides.
        const bool reads_kv = !kFp8 || p.seqlen_k > 0;
        const auto kv_ok = [&](int64_t stride, int64_t extent) { return !reads_kv || ok(stride, extent); };
        // rows: TMA needs the row stride even when a tensor has one row; require it always.
        if (!ok(p.q_row_stride, 2) || !kv_ok(p.k_row_stride, 2) || !kv_ok(p.v_row_stride, 2) || !ok(p.o_row_stride, 2))
            return false;
        if (!ok(p.q_head_stride, p.nhead_q) || !ok(p.o_head_stride, p.nhead_q) ||
            !kv_ok(p.k_head_stride, p.nhead_k) || !kv_ok(p.v_head_stride, p.nhead_k))
            return false;
        if (kGroup) return true;  // one batch of packed rows: no batch stride
        if (!ok(p.q_batch_stride, p.batch) || !kv_ok(p.k_batch_stride, p.batch) ||
            !kv_ok(p.v_batch_stride, p.batch) || !ok(p.o_batch_stride, p.batch))
            return false;
        return true;
    }

    // Persistent: the tile counter; fp8: V transposed (hopper_fp8.hpp: VtLayout), after the counter (kVtOffset), none
    // for a call without keys (run() launches no attention kernel then).
    static size_t workspace_bytes(const FwdParams& p) {
        if constexpr (kFp8)
            return p.seqlen_k < 1 ? 0 : kVtOffset + VtLayout::bytes(p.batch, p.nhead_k, p.hdim_v, p.seqlen_k);
        return kPersistent ? kCounterBytes : 0;
    }
    static void* vt_ptr(const FwdParams& p) { return static_cast<char*>(p.workspace) + kVtOffset; }

    template <class K = Impl>  // the main kernel (Impl or a fixed variant's ImplOf)
    static typename K::Params make_params(const FwdParams& p) {
        using namespace cute;
        const int group = p.nhead_q / p.nhead_k;
        // Strides of size-1 modes are never used for addressing; give TMA a harmless aligned value.
        auto fix = [](int64_t s, int64_t extent) -> int64_t { return extent > 1 ? s : int64_t(kAlignElems); };
        // Group mode: the packed tensors as one batch (the mask coordinate is then made per sequence on the device).
        const int batch = kGroup ? 1 : p.batch;
        const MaskCoord mc = kGroup ? MaskCoord{0, 0} : clamped_mask_coord(p);
        HopperProblemShape problem = make_tuple(batch, make_tuple(group, p.nhead_k), kGroup ? p.total_q : p.seqlen_q,
                                                kGroup ? p.total_k : p.seqlen_k, p.hdim_q, mc.x, mc.y);

        // Q's (and O's) strides as TMA sees them: (row, column, (batch, (g, hk))), the query heads split into the
        // group of a K/V head and the K/V head.
        auto query_stride = [&](int64_t row, int64_t head, int64_t batch_stride) -> HopperStrideQ {
            const int64_t h = fix(head, p.nhead_q);
            return make_stride(row, _1{},
                               make_stride(fix(batch_stride, batch),
                                           make_stride(group > 1 ? h : int64_t(kAlignElems),
                                                       p.nhead_k > 1 ? h * group : int64_t(kAlignElems))));
        };
        const HopperStrideQ dQ = query_stride(p.q_row_stride, p.q_head_stride, p.q_batch_stride);
        HopperStrideKV dK = make_stride(p.k_row_stride, _1{},
                                      make_stride(fix(p.k_batch_stride, batch),
                                                  make_stride(_0{}, fix(p.k_head_stride, p.nhead_k))));
        // V: as given, or (fp8) transposed in the workspace, its key extent rounded up to whole slot groups.
        const VtLayout vt = VtLayout::of(p.batch, p.nhead_k, p.hdim_v, p.seqlen_k);
        const void* v_ptr = kFp8 ? vt_ptr(p) : p.v;
        typename K::StrideV dV = [&] {
            if constexpr (kFp8) {
                return make_stride(_1{}, vt.d_stride,
                                   make_stride(fix(vt.batch_stride, batch), make_stride(_0{}, fix(vt.head_stride, p.nhead_k))));
            } else {
                return make_stride(p.v_row_stride, _1{},
                                   make_stride(fix(p.v_batch_stride, batch),
                                               make_stride(_0{}, fix(p.v_head_stride, p.nhead_k))));
            }
        }();

        typename K::Mainloop::Arguments margs{static_cast<Element const*>(p.q), dQ,
                                                 static_cast<Element const*>(p.k), dK,
                                                 static_cast<Element const*>(v_ptr), dV};
        typename K::Params params{};
        params.problem = problem;
        params.mainloop = K::Mainloop::to_underlying_arguments(problem, margs, nullptr);
        params.mainloop.scale_softmax = p.scale;  // the collective assumes 1/sqrt(d); we take the caller's scale
        params.mainloop.scale_softmax_log2 = p.scale_log2;
        params.mainloop.rp_dropout = 1.f;
        // V (and O) have their own head dim: the Q/K collective's V descriptor serves when it is the same.
        params.hdim_v = p.hdim_v;
        auto v_descriptor = [&] {
            HopperProblemShape problem_v = problem;
            get<4>(problem_v) = p.hdim_v;
            if constexpr (kFp8) get<3>(problem_v) = int(vt.keys);  // slots past seqlen_k carry real keys (hopper_fp8.hpp)
            typename K::MainloopV::Arguments vargs{static_cast<Element const*>(p.q), dQ,
                                                      static_cast<Element const*>(p.k), dK,
                                                      static_cast<Element const*>(v_ptr), dV};
            return K::MainloopV::to_underlying_arguments(problem_v, vargs, nullptr).tma_load_v;
        };
        if constexpr (K::kSplitDims || kFp8) {
            params.tma_load_v = v_descriptor();
        } else {
            params.tma_load_v = p.hdim_v == p.hdim_q ? params.mainloop.tma_load_v : v_descriptor();
        }
        params.o = static_cast<ElementOut*>(p.o);
        if constexpr (K::kTmaStoreO) {  // O's TMA store: Q's stride shape
            params.tma_store_o = K::TmaStoreO::make(
                static_cast<ElementOut*>(p.o), p.seqlen_q, p.hdim_v, batch, group, p.nhead_k,
                query_stride(p.o_row_stride, p.o_head_stride, p.o_batch_stride));
        }
        params.o_row = p.o_row_stride;
        params.o_head = p.o_head_stride;
        params.o_batch = p.o_batch_stride;
        params.lse = p.lse;
        params.lse_head = p.lse_head_stride;
        params.lse_batch = p.lse_batch_stride;
        params.seqstart_q = p.seqstart_q;
        params.seqstart_k = p.seqstart_k;
        params.mask_type = p.mask_type;
        params.window_left = p.window_left;
        params.window_right = p.window_right;
        if constexpr (kMods) {
            params.mods = p.mods;
            // A staged elementwise bias (the instances with a bias ring): its tensor map (hopper_bias_stage.hpp). Batch
            // mode: extents s_q, s_k (TMA zero-fills past them); group mode: bounds of every sequence's lengths
            // (max_seqlen_q, total_k), the boxes staying inside their sequences (BiasStage::staged_slot). A map the
            // driver refuses leaves the consumers' global loads.
            params.bias_staged = false;
            if constexpr (K::kBiasStages > 0) {
                if (bias_stageable(p.mods))
                    params.bias_staged = make_bias_map<Element>(&params.bias_map, p.mods, p.batch, p.nhead_q,
                                                                kGroup ? p.max_seqlen_q : p.seqlen_q,
                                                                kGroup ? p.total_k : p.seqlen_k);
            }
        } else {
            params.sink = p.mods.sink;  // a sink alone: the plain kernel's final normalisation
        }
        params.descale_q = p.descale_q;
        params.descale_k = p.descale_k;
        params.descale_v = p.descale_v;
        if constexpr (kPersistent || K::kOneTileOrder) {  // batch mode (else sched stays {}: the 3-D grid)
            // Sections of (head, batch) pairs whose K and V (the pair's K/V head: shared under GQA) fill about 24 MB
            // of the L2 (H100 / H200: 50 MB), so that the heaviest-first order of a section re-reads them from there.
            const int64_t kv_bytes = int64_t(p.seqlen_k) * (p.hdim_q + p.hdim_v) * int64_t(sizeof(Element));
            const int64_t kv_pairs = (int64_t(24) << 20) / (kv_bytes > 0 ? kv_bytes : 1);
            const int section = int(kv_pairs * group < (int64_t(1) << 30) ? kv_pairs * group : (int64_t(1) << 30));
            const int m_blocks = (p.max_seqlen_q + kBlockM - 1) / kBlockM;  // batch mode: max_seqlen_q == seqlen_q
            if constexpr (kPersistent) {
                const bool counted =
                    p.workspace_bytes >= size_t(kCounterBytes) && p.num_sms > 0 && p.counter_epoch != 0;
                auto* counter = counted ? static_cast<unsigned long long*>(p.workspace) : nullptr;
                params.sched = K::PersistentScheduler::params(m_blocks, p.nhead_q, p.batch, section, kMasked,
                                                                 counter, p.counter_epoch);
            } else {
                // One CTA per tile (Impl::kOneTileOrder: batch-mode 16-bit one-tile instances, plain d256 and the
                // two-warpgroup "_mods" tiles). A causal or window call whose L2 section holds more than one pair
                // runs a 1-D grid of the persistent kernels' order (heaviest query block first, the pairs a section
                // at a time), its last section taking the remainder (interleaved_tile's last_absorbs): pair after
                // pair, as the 3-D grid goes, the last pairs' heaviest blocks start at the end of the grid and run
                // alone. Measured on the H200 (d256 bf16 causal, docs/PERFORMANCE.md "One-tile grids of causal
                // calls"): +7 % at s = 4k, +2 % at 1k; d128 causal modifier calls 14-19 % faster ("Causal modifier
                // calls in the one-tile order").
                // Other calls (sched.total = 0) keep the 3-D grid, whose order a one-pair section would repeat; so do
                // group mode, fp8 and the d64 "_mods" tile (not kOneTileOrder).
                params.sched = K::PersistentScheduler::params(m_blocks, p.nhead_q, p.batch, section, true, nullptr, 0);
                if (p.mask_type == 0 || params.sched.section < 2 ||
                    int64_t(m_blocks) * p.nhead_q * p.batch > int64_t(INT32_MAX))
                    params.sched.total = 0;
            }
        }
        return params;
    }

    template <class K = Impl>  // each main kernel its own opt-in (their shared storage differs: the bias ring)
    static cudaError_t prepare_device() {
        static std::atomic<uint64_t> smem_opted_in{0};
        return opt_in_dynamic_smem(cutlass::device_kernel<K>, int(K::SharedStorageSize), smem_opted_in);
    }

    // f(KernelTag<K>{}) with K the main kernel of the call's modifier variant (fwd_mod_variant), or the generic one
    // where this instance builds no such variant (hopper::with_main_kernel).
    template <class F>
    static cudaError_t with_main_kernel(int var, F&& f) {
        return hopper::with_main_kernel<FwdKernel>(var, f, FixedVariants{});
    }
    // The variant that run() launches for p (FwdModVar::kGeneric: the generic or plain kernel), for tests.
    static int main_kernel_variant(const FwdParams& p) {
        const int var = kMods ? fwd_mod_variant(p.mods) : FwdModVar::kGeneric;
        int got = FwdModVar::kGeneric;
        with_main_kernel(var, [&](auto tag) {
            using K = typename decltype(tag)::type;
            got = std::is_same_v<K, Impl> ? FwdModVar::kGeneric : var;
            return cudaSuccess;
        });
        return got;
    }

    static cudaError_t run(const FwdParams& p, cudaStream_t stream) {
        if constexpr (kFp8) {
            if (p.seqlen_k == 0)
                return launch_fill_no_keys(static_cast<ElementOut*>(p.o), p.o_row_stride, p.o_head_stride,
                                           p.o_batch_stride, p.lse, p.lse_head_stride, p.lse_batch_stride, p.batch,
                                           p.nhead_q, p.seqlen_q, p.hdim_v, stream);
            TransposeVArgs t{static_cast<const uint8_t*>(p.v), p.v_row_stride, p.v_head_stride, p.v_batch_stride,
                             static_cast<uint8_t*>(vt_ptr(p)), VtLayout::of(p.batch, p.nhead_k, p.hdim_v, p.seqlen_k),
                             p.seqlen_k, p.hdim_v, p.nhead_k};
            if (cudaError_t err = launch_transpose_v_fp8(t, p.batch, stream); err != cudaSuccess) return err;
        }
        if constexpr (kMods) {  // dropout's random bytes for tests (randval_ptr): a kernel of their own
            if (p.mods.dropout.on && p.mods.dropout.randval != nullptr) {
                const RandvalArgs r{p.mods.dropout, p.seqstart_q, p.seqstart_k, p.seqlen_q, p.seqlen_k, p.nhead_q};
                if (cudaError_t err = launch_randval(r, p.max_seqlen_q, p.batch, stream); err != cudaSuccess)
                    return err;
            }
        }
        const int var = kMods ? fwd_mod_variant(p.mods) : FwdModVar::kGeneric;
        return with_main_kernel(var, [&](auto tag) { return run_with<typename decltype(tag)::type>(p, stream); });
    }

    template <class K>  // K: the main kernel
    static cudaError_t run_with(const FwdParams& p, cudaStream_t stream) {
        cudaError_t err = prepare_device<K>();
        if (err != cudaSuccess) return err;
        const typename K::Params params = make_params<K>(p);
        const dim3 grid = kPersistent || params.sched.total > 0
                              ? K::PersistentScheduler::grid(params.sched, p.num_sms)  // one CTA per SM, or tile
                              : K::grid((p.max_seqlen_q + kBlockM - 1) / kBlockM, p.nhead_q, p.batch);
        const dim3 block(K::MaxThreadsPerBlock);
        cutlass::device_kernel<K><<<grid, block, K::SharedStorageSize, stream>>>(params);
        return cudaGetLastError();
    }
};

}  // namespace mhakit::hopper
