// mhakit hopper family — backward FMHA on sm_90a (TMA + wgmma + warp specialization), batch and group mode.
//
//   template <mhakit_dtype kDtype, int kHdim, int kHdimV, bool kGroup, bool kMasked, int kBlockM, int kBlockN,
//             bool kMods>
//   struct mhakit::hopper::BwdKernel {
//       static bool supports(const BwdParams& p);           // runtime guard, pure host arithmetic
//       static size_t workspace_bytes(const BwdParams& p);  // pure host arithmetic
//       static cudaError_t run(const BwdParams& p, cudaStream_t stream);  // 3 launches, no allocation, no sync
//   };
//
// Stages (all on `stream`): (1) preprocess — D = rowsum(dO∘O), LSE·log2e, zero the fp32 dQ accumulator;
// (2) main kernel — one CTA per (key block, kv head, batch) recomputes P and accumulates dK, dV in registers and dQ
// into the workspace (fmha_bwd_hopper_kernel.hpp); (3) convert — dQ = scale·accumulator into dq's dtype/strides.
// GQA split (bwd_gqa_split.h; splits(p) > 1 where the unsplit grid leaves SMs idle): (2) runs s CTAs per (key block,
// kv head, batch), each over group / s query heads, writing fp32 dK / dV partial sums to workspace slots (the generic
// kernel's split twin, SplitImpl: a "_mods" call of a fixed variant runs the generic kernel when it splits), and
// (4) reduce_dkv adds the slots in a fixed order and writes dK, dV (deterministic: no atomics).
//
// Serves: fp16 / bf16 (kDtype; BwdParams carries no dtype, so the dispatcher must match it); hdim_q <= kHdim and
// hdim_v <= kHdimV, multiples of 8 (buckets: multiples of 32 in [64, 256]; the catalogue builds 64, 96, 128, 192,
// 256 with kHdimV = kHdim, and (192, 128); unequal buckets take the query split; smaller head dims are
// zero-padded by TMA; 96 and 192 use 64B-swizzled tiles: 192's query-split half, 96, is a canonical MN-major GMMA
// operand only with that swizzle).
// Batch mode (kGroup = false): any seqlen_q, seqlen_k >= 1. Group mode (kGroup = true): sequences of any lengths,
// empty ones included, packed along the rows; the TMA descriptors see the packed tensors as one batch of total_q /
// total_k rows, which the caller must give (0 sends the call to the generic family).
// GQA / MQA (nhead_q % nhead_k == 0; the CTA of a kv head loops over its query heads). Deterministic or not, at run
// time (p.deterministic): dQ tiles are accumulated by fp32 reductions, in arbitrary order or, when deterministic, in
// a fixed order of key blocks (turn counters in the workspace; see the main kernel). Masks: kMasked = false serves mask_type 0; kMasked = true serves mask_type
// 1, 2, 3 (causal top-left / bottom-right, sliding windows, CK's generic (y, x)); query tiles that see no key of a
// block are skipped, keys that no query sees get dK = dV = 0.
// Score modifiers (kMods, the "_mods" instances; the runtime gives them exactly the calls that set a soft-cap, a bias /
// ALiBi, a sink or dropout: catalogue score_mods; a masked one serves unmasked calls too): soft-cap, elementwise bias
// (+ dbias: every element of the sequences' blocks written, zeros where no query sees the key), ALiBi, sinks (+ d
// sink, a fixed-order sum: deterministic) and dropout (the forward's random bytes regenerated per Sᵀ tile,
// hopper_dropout.hpp), with mha_bwd.h's semantics. Deterministic mode works with them unchanged (each dbias element
// has one writer). run() launches the main kernel of the call's modifier variant (BwdModVar: builds, FixedVariants).
// Layout: q, k, v, o, do, dq, dk, dv 16-byte aligned with every row / head / batch stride a multiple of 8 elements
// (16 bytes); lse any fp32 strides.
//
// Tiles (kBlockM x kBlockN), measured on H200 (bf16, 16k tokens, .scratch/hopper_bwd): 64 x 128 for hdim 64 and 128
// (key split: each of the two consumer warpgroups owns 64 keys; hdim 96 likewise, with 64B-swizzled tiles), 64 x 64
// for hdim 256 (query split, dQ by vector atomics). 128 x 128 at hdim 64 was 1-11% slower, 64 x 64 at hdim 128 20-30% slower. Other legal values:
// kBlockM in {64, 128}, kBlockN in {64, 96, 128}; 128 is the key split where kHdim == kHdimV and kHdim + kBlockM <= 192,
// else a query split of 128 keys (in shared memory for (192, 128) at kBlockM = 64: the b64x128 candidate); 96 is the
// swapped key split (kBlockM = 64, head dims multiples of 64, kHdim + kHdimV <= 320, plain instances: the (192, 128)
// b64x96 tile of every plain call).
//
// Workspace: (2 + kHdim) · 4 bytes per padded query row (rows padded to a multiple of kBlockM) and 4 bytes per query
// tile, times batch·nhead_q (group mode: max_seqlen_q rows per sequence); with GQA, where a device may split the call,
// the split's fp32 dK / dV slots: kBlockN · (kHdim + kHdimV) · 4 bytes per CTA of the largest split's grid
// (bwd::gqa_split_bound; at most 2 x 132 CTAs' worth).
//
// Build: nvcc -std=c++17 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -O3
//        -I$CUTLASS/include -I$CUTLASS/tools/util/include -I$CUTLASS/examples -I<repo>/csrc -I<repo>/csrc/include
//        -I$CUDA_HOME/include/cccl (nvcc 13)
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

#include <cuda_runtime.h>

#include "cutlass/device_kernel.h"

#include "kernels/common/bwd_params.h"
#include "kernels/common/mask.h"
#include "mha_common.h"

#include "bwd_gqa_split.h"
#include "fmha_bwd_hopper_aux.hpp"
#include "fmha_bwd_hopper_common.hpp"
#include "fmha_bwd_hopper_kernel.hpp"
#include "fmha_hopper_guards.hpp"
#include "hopper_types.hpp"

namespace mhakit::hopper {

template <mhakit_dtype kDtype, int kHdim, int kHdimV, bool kGroup, bool kMasked, int kBlockM, int kBlockN, bool kMods>
struct BwdKernel {
    using Element = typename DtypeOf<kDtype>::type;
    // The main kernel of modifier variant kVar (BwdModVar; a plain instance has the one kernel)
    template <int kVar>
    using ImplOf = std::conditional_t<
        kMods, HopperBwdKernelModsImpl<Element, kHdim, kHdimV, kGroup, kMasked, kBlockM, kBlockN, kVar>,
        HopperBwdKernelImpl<Element, kHdim, kHdimV, kGroup, kMasked, kBlockM, kBlockN>>;
    // The generic kernel: the one of a plain instance, and of every "_mods" call without a fixed variant built here.
    // Its tiles, workspace and dQ fragment order are every variant's (the light kernels take them from it).
    using Impl = ImplOf<BwdModVar::kGeneric>;
    // The GQA split's main kernel: the generic kernel's twin (kSplit), for every call that splits (splits(p) > 1).
    using SplitImpl = HopperBwdKernelSplitImpl<Element, kHdim, kHdimV, kGroup, kMasked, kBlockM, kBlockN, kMods>;

    // The fixed variants (BwdModVar) that a "_mods" instance may build besides the generic kernel (builds: which it
    // does), each a main kernel of its own: soft-cap, ALiBi, both, a staged bias with and without a soft-cap. Each
    // adds about 1.5 s of nvcc time to the instance (d128 causal, five: -cubin 21 -> 29 s, the object 36 -> 43 s,
    // one job on a 2-core machine). No kernel for a sink alone (kFixed with no flag): the catalogue sends those calls
    // to the plain instances (score_mods.plain), so a "_mods" instance sees one only in a build without them, and
    // runs it on the generic kernel.
    using FixedVariants = std::integer_sequence<int, BwdModVar::kFixed | BwdModVar::kCap,
                                                BwdModVar::kFixed | BwdModVar::kAlibi,
                                                BwdModVar::kFixed | BwdModVar::kCap | BwdModVar::kAlibi,
                                                BwdModVar::kFixed | BwdModVar::kBias,
                                                BwdModVar::kFixed | BwdModVar::kCap | BwdModVar::kBias>;
    // A staged bias needs the bias ring (none at d256: those calls keep the generic kernel's global loads); with a
    // soft-cap too only at d64, where ptxas keeps it in registers (d128: 8-44 bytes of spill stores, against the
    // generic kernel's 56-100, for a rare pair).
    static constexpr bool builds(int var) {
        if (!kMods || var == BwdModVar::kFixed) return false;
        if (var & BwdModVar::kBias)
            return Impl::kBiasStages > 0 && kBlockM == 64 && (!(var & BwdModVar::kCap) || kHdim <= 64);
        return true;
    }

    static constexpr int kAlignElems = 16 / int(sizeof(Element));

    static bool ok_tensor(const void*, int64_t row, int64_t head, int64_t batch, int nhead, int nbatch) {
        return tma_stride_ok<Element>(row, 2) && tma_stride_ok<Element>(head, nhead) &&
               tma_stride_ok<Element>(batch, nbatch);
    }

    // The run-time guard beyond what the runtime already checked: the validator (head dims, heads, mask type,
    // pointers), the instance's traits (dtype, mode, head-dim bucket) and the family's static guards from the
    // catalogue (16-byte alignment, head dims multiples of 8).
    // Rows (and batches) as the TMA descriptors see them: group mode: the packed row counts, in one batch.
    static int tma_rows_q(const BwdParams& p) { return kGroup ? p.total_q : p.seqlen_q; }
    static int tma_rows_k(const BwdParams& p) { return kGroup ? p.total_k : p.seqlen_k; }
    static int tma_batch(const BwdParams& p) { return kGroup ? 1 : p.batch; }
    // Query rows per sequence that the workspace and the light kernels' grids cover.
    static int rows_q(const BwdParams& p) { return kGroup ? p.max_seqlen_q : p.seqlen_q; }
    // Key blocks per (kv head, batch): the main kernel's CTAs per pair.
    static int key_blocks(const BwdParams& p) { return ((kGroup ? p.max_seqlen_k : p.seqlen_k) + kBlockN - 1) / kBlockN; }
    // Deterministic mode at the query split: how many (kv head, batch) pairs interleave their key blocks in the
    // launch order (Scheduler::work_interleaved; 0: the 3-D grid, as every other call). As many as a wave of CTAs
    // (one per multiprocessor) holds pairs in the plain reversed order, ceil(SMs / key blocks): the same pairs, so the
    // same Q, dO and dQ tiles, are in flight, but CTAs that start as others finish belong to different pairs, whose
    // dQ turns do not wait on each other. The turns' order is that of the key blocks whatever this gives.
    // splits: the GQA split's (the grid's heads are nhead_k x splits).
    static int det_group(const BwdParams& p, int splits) {
        if (!p.deterministic || Impl::kDqViaSmem || p.num_sms < 1) return 0;
        const int64_t blocks = key_blocks(p);
        const int64_t pairs = int64_t(p.nhead_k) * splits * p.batch;
        if (blocks < 1 || blocks * pairs > int64_t(INT32_MAX)) return 0;
        return int(std::min<int64_t>(pairs, (p.num_sms + blocks - 1) / blocks));
    }

    // The GQA split (bwd_gqa_split.h): how many CTAs share a kv group's query heads on this call's device (p.num_sms,
    // read by the runtime for every GQA call), and the most any device may take (the workspace's slots).
    static int64_t unsplit_ctas(const BwdParams& p) { return int64_t(key_blocks(p)) * p.nhead_k * p.batch; }
    static int group_of(const BwdParams& p) { return p.nhead_k > 0 ? p.nhead_q / p.nhead_k : 1; }
    static int splits(const BwdParams& p) {
        const int64_t m_tiles = (int64_t(rows_q(p)) + kBlockM - 1) / kBlockM;
        if (!kMasked || p.mask_type == 0 || bwd::gqa_split_cap(unsplit_ctas(p), group_of(p), p.num_sms) < 2)
            return bwd::gqa_splits(unsplit_ctas(p), group_of(p), m_tiles, p.num_sms);
        // A masked call that may split: the query tiles each key block visits (the main loop's rule), on the
        // largest sequence of the call (batch mode: every one). At most one key block per SM here (a split of 2
        // must fit two waves).
        const int sq = rows_q(p), sk = kGroup ? p.max_seqlen_k : p.seqlen_k;
        const auto geom = MaskGeometry<true, int>::make(p.mask_type, p.window_left, p.window_right, sq, sk);
        int64_t longest = 0, visits = 0;
        for (int n = 0; n < key_blocks(p); ++n) {
            const TileRange r = bwd::key_block_query_tiles<kBlockM, kBlockN>(geom, n);
            const int64_t tiles = r.empty() ? 0 : r.end - r.begin;
            visits += tiles, longest = tiles > longest ? tiles : longest;
        }
        return bwd::gqa_splits(unsplit_ctas(p), group_of(p), longest, p.num_sms, key_blocks(p), visits);
    }
    static int split_bound(const BwdParams& p) { return bwd::gqa_split_bound(unsplit_ctas(p), group_of(p)); }

    // The workspace of a call (one rule for workspace_bytes and the launch): the split's slots where it may split.
    static bwd::WorkspaceLayout layout(const BwdParams& p) {
        const int bound = split_bound(p);
        const size_t dkv = bound > 1 ? size_t(bound) * size_t(unsplit_ctas(p)) * size_t(Impl::kSlotFloats) : 0;
        return bwd::WorkspaceLayout(p.batch, p.nhead_q, rows_q(p), kBlockM, kHdim, dkv);
    }

    static bool supports(const BwdParams& p) {
        if (p.batch < 1 || p.batch > 65535 || p.nhead_q > 65535) return false;  // grid
        if (kGroup != (p.seqstart_q != nullptr)) return false;
        if (tma_rows_q(p) < 1 || tma_rows_k(p) < 1 || rows_q(p) < 1) return false;
        if (kGroup && p.max_seqlen_k < 1) return false;
        if (int64_t(tma_rows_q(p)) + kBlockM > int64_t(INT32_MAX)) return false;
        if ((int64_t(tma_rows_k(p)) + kBlockN - 1) / kBlockN > int64_t(INT32_MAX)) return false;
        // A masked modifier instance serves unmasked calls too (as the forward's): the profiles build only those.
        if (kMasked ? (p.mask_type == 0 && !kMods) : p.mask_type != 0) return false;
        const int nb = tma_batch(p);
        if (!ok_tensor(p.q, p.q_row_stride, p.q_head_stride, p.q_batch_stride, p.nhead_q, nb)) return false;
        if (!ok_tensor(p.k, p.k_row_stride, p.k_head_stride, p.k_batch_stride, p.nhead_k, nb)) return false;
        if (!ok_tensor(p.v, p.v_row_stride, p.v_head_stride, p.v_batch_stride, p.nhead_k, nb)) return false;
        if (!ok_tensor(p.o, p.o_row_stride, p.o_head_stride, p.o_batch_stride, p.nhead_q, nb)) return false;
        if (!ok_tensor(p.dout, p.do_row_stride, p.do_head_stride, p.do_batch_stride, p.nhead_q, nb)) return false;
        if (!ok_tensor(p.dq, p.dq_row_stride, p.dq_head_stride, p.dq_batch_stride, p.nhead_q, nb)) return false;
        if (!ok_tensor(p.dk, p.dk_row_stride, p.dk_head_stride, p.dk_batch_stride, p.nhead_k, nb)) return false;
        if (!ok_tensor(p.dv, p.dv_row_stride, p.dv_head_stride, p.dv_batch_stride, p.nhead_k, nb)) return false;
        return true;
    }

    static size_t workspace_bytes(const BwdParams& p) {
        if (p.batch < 1 || p.nhead_q < 1 || rows_q(p) < 1) return 0;
        return layout(p).total;
    }

    template <class K>  // the main kernel (Impl, a fixed variant's ImplOf, or SplitImpl with `splits` > 1)
    static typename K::Params make_params(const BwdParams& p, const bwd::WorkspaceLayout& ws, int splits) {
        using namespace cute;
        // Strides of size-1 modes are never used for addressing; give TMA a harmless aligned value.
        auto fix = [](int64_t s, int64_t extent) -> int64_t { return extent > 1 ? s : int64_t(kAlignElems); };
        const int nb = tma_batch(p);
        auto tma_for = [&](const void* ptr, int seqlen, int hdim, int nhead, int64_t row, int64_t head, int64_t batch,
                           auto slayout) {
            Tensor t = make_tensor(make_gmem_ptr(static_cast<Element const*>(ptr)),
                                   make_shape(seqlen, hdim, nhead, nb),
                                   make_stride(fix(row, seqlen), _1{}, fix(head, nhead), fix(batch, nb)));
            return make_tma_copy(SM90_TMA_LOAD{}, t, slayout);
        };
        const int sq = tma_rows_q(p), sk = tma_rows_k(p);
        const MaskCoord mc = kGroup ? MaskCoord{0, 0} : clamped_mask_coord(p);
        char* wsb = static_cast<char*>(p.workspace);

        typename K::Params params{};
        params.tma_q = tma_for(p.q, sq, p.hdim_q, p.nhead_q, p.q_row_stride, p.q_head_stride, p.q_batch_stride,
                               typename K::SmemLayoutQ1{});
        params.tma_do = tma_for(p.dout, sq, p.hdim_v, p.nhead_q, p.do_row_stride, p.do_head_stride,
                                p.do_batch_stride, typename K::SmemLayoutDO1{});
        params.tma_k = tma_for(p.k, sk, p.hdim_q, p.nhead_k, p.k_row_stride, p.k_head_stride, p.k_batch_stride,
                               typename K::SmemLayoutK{});
        params.tma_v = tma_for(p.v, sk, p.hdim_v, p.nhead_k, p.v_row_stride, p.v_head_stride, p.v_batch_stride,
                               typename K::SmemLayoutV{});
        params.batch = p.batch;
        params.nhead_q = p.nhead_q;
        params.nhead_k = p.nhead_k;
        params.group = p.nhead_q / p.nhead_k;
        params.seqlen_q = sq;
        params.seqlen_k = sk;
        params.tma_batch = nb;
        params.hdim = p.hdim_q;
        params.hdim_v = p.hdim_v;
        params.mask_x = mc.x;
        params.mask_y = mc.y;
        params.seqstart_q = p.seqstart_q;
        params.seqstart_k = p.seqstart_k;
        params.mask_type = p.mask_type;
        params.window_left = p.window_left;
        params.window_right = p.window_right;
        params.scale = p.scale;
        params.scale_log2 = p.scale_log2;
        params.lse2 = reinterpret_cast<float const*>(wsb + ws.lse_off);
        params.dsum = reinterpret_cast<float const*>(wsb + ws.dsum_off);
        params.dq_acc = reinterpret_cast<float*>(wsb + ws.dq_off);
        params.sq_pad = ws.sq_pad;
        params.m_tiles = int(ws.sq_pad / kBlockM);
        params.dq_turn = reinterpret_cast<int32_t*>(wsb + ws.sem_off);
        params.deterministic = p.deterministic;
        params.key_blocks = key_blocks(p);
        params.det_group = det_group(p, splits);
        params.dk = static_cast<Element*>(p.dk);
        params.dk_row = p.dk_row_stride;
        params.dk_head = p.dk_head_stride;
        params.dk_batch = p.dk_batch_stride;
        params.dv = static_cast<Element*>(p.dv);
        params.dv_row = p.dv_row_stride;
        params.dv_head = p.dv_head_stride;
        params.dv_batch = p.dv_batch_stride;
        if constexpr (K::kSplit) {
            params.splits = splits;
            params.split_heads = params.group / splits;
            params.dkv_part = reinterpret_cast<float*>(wsb + ws.dkv_off);
        }
        if constexpr (kMods) {
            params.mods = p.mods;
            params.dbias = static_cast<char*>(p.dbias);
            params.dbias_row = p.dbias_row_stride;
            params.dbias_head = p.dbias_head_stride;
            params.dbias_batch = p.dbias_batch_stride;
        }
        return params;
    }

    template <class K>  // each main kernel its own opt-in (their shared storage differs: the bias ring)
    static cudaError_t prepare_device() {
        static std::atomic<uint64_t> smem_opted_in{0};
        return opt_in_dynamic_smem(cutlass::device_kernel<K>, int(K::SharedStorageSize), smem_opted_in);
    }

    // f(KernelTag<K>{}) with K the main kernel of the call's modifier variant (bwd_mod_variant), or the generic one
    // where this instance builds no such variant (hopper::with_main_kernel).
    template <class F>
    static cudaError_t with_main_kernel(int var, F&& f) {
        return hopper::with_main_kernel<BwdKernel>(var, f, FixedVariants{});
    }

    static cudaError_t run(const BwdParams& p, cudaStream_t stream) {
        if (const int s = splits(p); s > 1) return run_with<SplitImpl>(p, stream, s);
        const int var = kMods ? bwd_mod_variant(p.mods, p.dbias != nullptr) : BwdModVar::kGeneric;
        return with_main_kernel(var, [&](auto tag) { return run_with<typename decltype(tag)::type>(p, stream, 1); });
    }

    template <class K>  // K: the main kernel; splits: the GQA split's (1: unsplit, K is not SplitImpl)
    static cudaError_t run_with(const BwdParams& p, cudaStream_t stream, int splits) {
        const bwd::WorkspaceLayout ws = layout(p);
        if (p.workspace == nullptr || p.workspace_bytes < ws.total) return cudaErrorInvalidValue;
        if (K::kSplit != (splits > 1) || splits > split_bound(p)) return cudaErrorInvalidValue;
        cudaError_t err = prepare_device<K>();
        if (err != cudaSuccess) return err;
        char* wsb = static_cast<char*>(p.workspace);
        const int m_tiles = int(ws.sq_pad / kBlockM);
        const dim3 grid_q = bwd::RowTileScheduler::grid(m_tiles, p.nhead_q, p.batch);

        std::conditional_t<kMods, bwd::PreprocessModsParams, bwd::PreprocessParams> pp;
        pp.o = p.o;
        pp.dout = p.dout;
        pp.lse = p.lse;
        pp.o_row = p.o_row_stride;
        pp.o_head = p.o_head_stride;
        pp.o_batch = p.o_batch_stride;
        pp.do_row = p.do_row_stride;
        pp.do_head = p.do_head_stride;
        pp.do_batch = p.do_batch_stride;
        pp.lse_head = p.lse_head_stride;
        pp.lse_batch = p.lse_batch_stride;
        pp.seqstart_q = p.seqstart_q;
        pp.lse2 = reinterpret_cast<float*>(wsb + ws.lse_off);
        pp.dsum = reinterpret_cast<float*>(wsb + ws.dsum_off);
        pp.dq_acc = reinterpret_cast<float*>(wsb + ws.dq_off);
        pp.dq_turn = reinterpret_cast<int32_t*>(wsb + ws.sem_off);
        pp.sq_pad = ws.sq_pad;
        pp.m_tiles = m_tiles;
        pp.nhead_q = p.nhead_q;
        pp.seqlen_q = p.seqlen_q;
        pp.hdim_v = p.hdim_v;
        if constexpr (kMods) {
            pp.dbias = static_cast<char*>(p.dbias);
            pp.dbias_row = p.dbias_row_stride;
            pp.dbias_head = p.dbias_head_stride;
            pp.dbias_batch = p.dbias_batch_stride;
            pp.dbias_fp32 = p.mods.bias_fp32;
            pp.seqstart_k = p.seqstart_k;
            pp.seqlen_k = p.seqlen_k;
            pp.mask_type = p.mask_type;
            pp.window_left = p.window_left;
            pp.window_right = p.window_right;
            const MaskCoord mc = kGroup ? MaskCoord{0, 0} : clamped_mask_coord(p);  // make_params' coordinate
            pp.mask_y = mc.y;
            pp.mask_x = mc.x;
            bwd::preprocess_mods_kernel<Element, kHdim, kHdimV, kBlockM, kBlockN, kMasked><<<grid_q, 256, 0, stream>>>(pp);
        } else {
            bwd::preprocess_kernel<Element, kHdim, kHdimV, kBlockM><<<grid_q, 256, 0, stream>>>(pp);
        }
        err = cudaGetLastError();
        if (err != cudaSuccess) return err;
        // d sink (plain instances too: a sink alone changes no score, only the LSE the main kernel is given)
        if (p.dsink != nullptr && p.mods.sink != nullptr) {
            bwd::DsinkParams dp;
            dp.sink = p.mods.sink;
            dp.dsink = p.dsink;
            dp.lse2 = pp.lse2;
            dp.dsum = pp.dsum;
            dp.seqstart_q = p.seqstart_q;
            dp.sq_pad = ws.sq_pad;
            dp.batch = p.batch;
            dp.nhead_q = p.nhead_q;
            dp.seqlen_q = p.seqlen_q;
            bwd::dsink_kernel<256><<<p.nhead_q, 256, 0, stream>>>(dp);
            err = cudaGetLastError();
            if (err != cudaSuccess) return err;
        }

        typename K::Params params = make_params<K>(p, ws, splits);
        if constexpr (K::kBiasStages > 0) {
            // A staged elementwise bias (the instances with a bias ring): its tensor map (hopper_bias_stage.hpp), as
            // the forward's launcher makes it. Batch mode: extents s_q, s_k (TMA zero-fills past them); group mode:
            // the packed totals, bounds of every sequence's lengths, the boxes staying inside their sequences
            // (BiasStage::staged_slot). The kernel stages every bias_stageable bias (the rule is TMA's requirements,
            // and a kernel-side flag read from the parameters cost the d128 consumers 8 bytes more of spill loads),
            // so a map the driver would refuse is an error here, not a silent fallback.
            if (bias_stageable(p.mods) &&
                !make_bias_map<Element>(&params.bias_map, p.mods, p.batch, p.nhead_q, tma_rows_q(p), tma_rows_k(p)))
                return cudaErrorInvalidValue;
        }
        const dim3 grid = params.det_group > 0
                              ? K::Scheduler::grid_interleaved(params.key_blocks, p.nhead_k * splits, p.batch)
                              : K::Scheduler::grid(params.key_blocks, p.nhead_k * splits, p.batch);
        cutlass::device_kernel<K><<<grid, K::MaxThreadsPerBlock, K::SharedStorageSize, stream>>>(params);
        err = cudaGetLastError();
        if (err != cudaSuccess) return err;

        bwd::ConvertParams cp;
        cp.dq_acc = reinterpret_cast<float const*>(wsb + ws.dq_off);
        cp.dq = p.dq;
        cp.dq_row = p.dq_row_stride;
        cp.dq_head = p.dq_head_stride;
        cp.dq_batch = p.dq_batch_stride;
        cp.seqstart_q = p.seqstart_q;
        cp.m_tiles = m_tiles;
        cp.nhead_q = p.nhead_q;
        cp.seqlen_q = p.seqlen_q;
        cp.hdim = p.hdim_q;
        cp.scale = p.scale;
        bwd::convert_dq_kernel<Impl><<<grid_q, 256, 0, stream>>>(cp);
        err = cudaGetLastError();
        if constexpr (K::kSplit) {
            if (err == cudaSuccess) err = reduce_dkv(p, ws, splits, stream);
        }
        return err;
    }

    // The split's dK / dV: the slots of the splits added in order, scaled as the main kernel's epilogue scales them.
    static cudaError_t reduce_dkv(const BwdParams& p, const bwd::WorkspaceLayout& ws, int splits, cudaStream_t stream) {
        constexpr int kSmem = bwd::reduce_dkv_smem_bytes<SplitImpl>();
        static std::atomic<uint64_t> smem_opted_in{0};
        cudaError_t err = opt_in_dynamic_smem(bwd::reduce_dkv_kernel<SplitImpl>, kSmem, smem_opted_in);
        if (err != cudaSuccess) return err;
        bwd::ReduceDkvParams rp;
        rp.dkv_part = reinterpret_cast<float const*>(static_cast<char*>(p.workspace) + ws.dkv_off);
        rp.dk = p.dk;
        rp.dv = p.dv;
        rp.dk_row = p.dk_row_stride;
        rp.dk_head = p.dk_head_stride;
        rp.dk_batch = p.dk_batch_stride;
        rp.dv_row = p.dv_row_stride;
        rp.dv_head = p.dv_head_stride;
        rp.dv_batch = p.dv_batch_stride;
        rp.seqstart_k = p.seqstart_k;
        rp.seqlen_k = p.seqlen_k;
        rp.batch = p.batch;
        rp.nhead_k = p.nhead_k;
        rp.key_blocks = key_blocks(p);
        rp.splits = splits;
        rp.hdim = p.hdim_q;
        rp.hdim_v = p.hdim_v;
        rp.dk_scale = p.scale;
        rp.dv_scale = kMods && p.mods.dropout.on ? p.mods.dropout.rp : 1.f;
        bwd::reduce_dkv_kernel<SplitImpl>
            <<<bwd::RowTileScheduler::grid(rp.key_blocks, p.nhead_k, p.batch), 256, kSmem, stream>>>(rp);
        return cudaGetLastError();
    }
};

}  // namespace mhakit::hopper
