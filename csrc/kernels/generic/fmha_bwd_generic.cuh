// mhakit generic family: backward flash attention for sm_80 and newer (FlashAttention-2 style, mma.sync).
//
// Stages (all launched by BwdKernel::run on the caller's stream, scratch in the caller's workspace):
//   1. bwd_dot_kernel        D = rowsum(dO o O) and LSE*log2(e) per (head, query row); zeroes the fp32 dQ
//                            accumulator when dQ is accumulated with atomics.
//   2. bwd_main_kernel       one CTA per (key block of kBlockN keys, kv head, head split, sequence). K and V stay in
//                            shared memory; the CTA walks the query blocks (kBlockM rows) that can see its keys, for
//                            every query head it owns (GQA: a group's heads are summed in registers), and per block
//                              S^T = K Q^T, dP^T = V dO^T               (warps split the keys, then the queries)
//                              P^T = exp2(S^T*scale*log2e - LSE2), dS^T = P^T o (dP^T - D)   (fp32, masked)
//                              dV += P^T dO, dK += dS^T Q               (fp32 accumulators in registers)
//                              dQ += dS K                               (reduction mode only: fp32 red.add into
//                                                                        the workspace accumulator)
//                            P^T / dS^T feed dV / dK straight from registers when each warp owns whole key rows,
//                            else through shared memory; dS^T always goes through shared memory for dQ.
//                            At the end dK (times scale) and dV are written in the element type, or, when the query
//                            heads of a group are split over several CTAs, as fp32 partials to the workspace.
//   3. bwd_dq_convert_kernel dQ = scale * accumulator (non-deterministic mode, d <= 64), or
//      bwd_dq_kernel         deterministic mode, and every mode from d128 on (where it measured faster than the
//                            reductions): dQ computed without atomics by a second pass parallel over query blocks
//                            (recomputes S and dP: about 7/5 of the FLOPs, bitwise reproducible);
//      bwd_dkv_reduce_kernel sum of the per-split dK/dV partials in split order (GQA/MQA when split).
//   4. bwd_dsink_kernel      d sink per query head (attention sinks), a fixed-order sum over the rows.
// Score modifiers (soft-cap, bias / ALiBi): the modifier instances ("_mods", kMods) compile the main and dQ kernels
// with them, one branch per tile picking the modifier kind; a sink needs only stage 4, in either kind of instance.
// P is recomputed from the modified logits, dS goes through the soft-cap's derivative before dK / dQ, dbias receives
// dS of the logits (the dot stage zeroes it first, so that elements no CTA visits read 0). Dropout (modifier instances)
// regenerates the forward's random bytes per tile (generic_dropout.cuh): dV takes P ∘ keep / (1 − p), and dS =
// P ∘ (dP ∘ keep / (1 − p) − D).
// Every stage is deterministic except the fp32 dQ reductions (non-deterministic mode, d <= 64 buckets only).
//
// Loads: cp.async 16-byte chunks (zero-filled past sequence ends and past the real head dims) when the tensor's base
// pointer and strides are 16-byte aligned, else element-wise (per tensor, a uniform runtime branch), as the forward.
// Masks: CK's generic (y, x) coordinate per sequence (make_mask_coord); a key block visits only the query blocks
// whose rows can see one of its keys, and only tiles that straddle a mask edge or a sequence end are masked element
// by element. Rows whose LSE is -inf (they saw no key in the forward) contribute nothing.
//
// Tiles (kBlockM x kBlockN, warps) of the catalogue — all fit the 99 KB opt-in shared memory of sm_86/sm_89:
//   d32: 64x128x8, d64: 64x128x8, d128: 64x64x4, d192/128: 32x64x8, d256: 32x32x4 (measured on one H200 against
//   32x128x8, 64x64x8, 32x64x4 at d128, 64x64x4 and 128x64x8 at d64, 128x128x8 at d32). The dQ pass uses 4 warps
//   and 64 or 128 query rows (the catalogue's dq_row_tiles).
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include <atomic>

#include "../../include/mha_common.h"
#include "../common/bwd_params.h"
#include "../common/mask.h"
#include "../common/mask_geometry.h"
#include "../common/mma_fragment.cuh"
#include "../common/smem_opt_in.h"
#include "../common/tile_scheduler.h"
#include "fmha_bwd_common.cuh"
#include "generic_dropout.cuh"
#include "generic_ptx.cuh"
#include "generic_tile_io.cuh"

namespace mhakit::generic {

namespace bwd_detail {

#if defined(__CUDACC__)
using generic::detail::drop_byte;
using generic::detail::drop_key;
using generic::detail::DropKey;
using generic::detail::dropout_bytes;
#endif

constexpr int cmin(int a, int b) { return a < b ? a : b; }

// The catalogue's traits (dtype, head-dim buckets, mode, mask class), tile (kBlockM query rows per step, kBlockN keys
// per CTA, kNumWarps warps) and tuning knobs (codegen/catalogue/cuda.toml, [bwd.generic], where each is explained):
//   kKeysPerWarp   key rows per warp in S^T / dP^T / dK / dV;
//   kDqRowTiles    16-row tiles per warp of the dQ pass (its CTA is 4 warps x 16 * kDqRowTiles query rows);
//   kDqBlockN      keys per step of the dQ pass;
//   kDqPass        1: dQ by the separate pass in non-deterministic mode too, 0: fp32 reductions from the main kernel.
template <mhakit_dtype kDtype_, int kHdimQ_, int kHdimV_, bool kGroupMode_, bool kMasked_, int kBlockM_,
          int kBlockN_, int kNumWarps_, int kKeysPerWarp_, int kDqRowTiles_, int kDqBlockN_, int kDqPass_>
struct BwdConfig {
    static constexpr mhakit_dtype kDtype = kDtype_;
    static constexpr int kHdimQ = kHdimQ_, kHdimV = kHdimV_;
    static constexpr bool kGroupMode = kGroupMode_, kMasked = kMasked_;
    static constexpr int kBM = kBlockM_, kBN = kBlockN_, kNumWarps = kNumWarps_;
    static constexpr int kThreads = kNumWarps * 32;

    static constexpr int kSQ = kHdimQ + 8;  // shared row stride (elements) of Q and K tiles (16-byte padding)
    static constexpr int kSV = kHdimV + 8;  // ... of V and dO tiles
    static constexpr int kSP = kBM + 8;     // ... of the P^T / dS^T tiles ([key][query])

    // S^T / dP^T (keys x queries): kWK warps along the keys, kWQ along the queries.
    static constexpr int kWK = cmin(kNumWarps, kBN / kKeysPerWarp_);
    static constexpr int kWQ = kNumWarps / kWK;
    static constexpr int kSdpRows = kBN / kWK, kSdpCols = kBM / kWQ;
    static constexpr int kSdpMT = kSdpRows / 16, kSdpNT = kSdpCols / 8;
    // dK / dV (keys x head dim): the same kWK warps along the keys (same rows as S^T), kWQ along the columns.
    static constexpr int kKCols = kHdimQ / kWQ, kVCols = kHdimV / kWQ;
    static constexpr int kKNT = kKCols / 8, kVNT = kVCols / 8;
    // P^T / dS^T stay in registers for dV / dK when every warp owns whole key rows.
    static constexpr bool kPInRegs = kWQ == 1;
    // dQ (queries x hdim_q): kDqWM warps along the queries, kDqWC along the columns.
    static constexpr int kDqWM = cmin(kNumWarps, kBM / 16);
    static constexpr int kDqWC = kNumWarps / kDqWM;
    static constexpr int kDqRows = kBM / kDqWM, kDqCols = kHdimQ / kDqWC;
    static constexpr int kDqMT = kDqRows / 16, kDqNT = kDqCols / 8;

    static_assert(kHdimQ % 16 == 0 && kHdimV % 16 == 0, "head-dim buckets are multiples of 16");
    static_assert(kBM % 16 == 0 && kBN % 16 == 0, "tiles are multiples of 16");
    static_assert(kNumWarps % kWK == 0 && kBN % (16 * kWK) == 0, "key rows split evenly over the warps");
    static_assert(kBM % kWQ == 0 && kSdpCols % 16 == 0, "each warp needs a multiple of 16 query columns");
    static_assert(kHdimQ % kWQ == 0 && kKCols % 16 == 0 && kVCols % 16 == 0 && kHdimV % kWQ == 0,
                  "dK/dV columns split in multiples of 16");
    static_assert(kNumWarps % kDqWM == 0 && kDqRows % 16 == 0, "dQ rows split in multiples of 16");
    static_assert(kHdimQ % kDqWC == 0 && kDqCols % 16 == 0, "dQ columns split in multiples of 16");

    static constexpr int kElemsK = kBN * kSQ, kElemsV = kBN * kSV, kElemsQ = kBM * kSQ, kElemsDO = kBM * kSV;
    static constexpr int kElemsP = kBN * kSP;
    static constexpr int smem_bytes(int q_buffers) {
        return (kElemsK + kElemsV + kElemsQ * q_buffers + kElemsDO + kElemsP * (kPInRegs ? 1 : 2)) * 2 +
               q_buffers * 2 * kBM * 4;
    }
    // Q (with its LSE2 / D rows) is double-buffered when that fits the 99 KB budget: the next block's Q then streams
    // in during the whole iteration; dO always streams in once dV is done.
    static constexpr int kQBuf = smem_bytes(2) <= 101376 ? 2 : 1;
    static constexpr int kSmemBytes = smem_bytes(kQBuf);

    // Registers of the accumulators that live across the loop; ask for two CTAs per SM (at most 128 registers per
    // thread for eight warps) only when they are few enough not to spill.
    static constexpr int kAccRegs = kSdpMT * (kKCols + kVCols) / 2 + kSdpMT * kSdpCols;
    static constexpr int kMinBlocks = (kNumWarps <= 4 || (kAccRegs <= 96 && kHdimQ + kHdimV <= 256)) ? 2 : 1;

    // dQ pass: 4 warps x (16 * kDqkMT) query rows, kDqkBN keys per step; K double-buffered when it fits.
    static constexpr int kDqkWarps = 4, kDqkThreads = 128, kDqkMT = kDqRowTiles_, kDqkBM = 64 * kDqRowTiles_;
    static constexpr int kDqkBN = kDqBlockN_;
    static_assert(kDqkBN % 16 == 0, "dQ pass key block is a multiple of 16");
    static constexpr int dqk_smem_bytes(int k_buffers) {
        return (kDqkBM * (kSQ + kSV) + kDqkBN * (kSQ * k_buffers + kSV)) * 2;
    }
    static constexpr int kDqkKBuf = dqk_smem_bytes(2) <= 101376 ? 2 : 1;
    static constexpr int kDqkSmemBytes = dqk_smem_bytes(kDqkKBuf);
    // Use the dQ pass in non-deterministic mode too (instead of fp32 reductions) where it measured faster: from d128
    // on, where the reduction traffic ((s_k / kBlockN) * s_q * d floats per head) costs more than recomputing S, dP.
    static constexpr bool kPreferDqPass = kDqPass_ != 0;
    static constexpr int kKeysPerWarp = kKeysPerWarp_;
};

// Block order: the main kernel walks key blocks in order (grid.y: kv head x head split); the dQ pass walks query
// blocks, the heaviest (last, under a causal mask) first.
using MainScheduler = SingleTileScheduler</*kHeaviestFirst=*/false>;
template <class Cfg>
using DqScheduler = SingleTileScheduler</*kHeaviestFirst=*/Cfg::kMasked>;

// ------------------------------------------------------------------------------------------------------------------
// Stage 2: the main kernel.
// ------------------------------------------------------------------------------------------------------------------
// kMods: the modifier instance's kernel (calls with ScoreMods::per_element); the plain kernel has none of that code.
template <class Cfg, bool kMods>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocks)
    bwd_main_kernel(const BwdParams p, const BwdWs ws, const int flags) {
    constexpr int kBM = Cfg::kBM, kBN = Cfg::kBN, kThreads = Cfg::kThreads;
    constexpr int kSQ = Cfg::kSQ, kSV = Cfg::kSV, kSP = Cfg::kSP;
    constexpr int kSdpMT = Cfg::kSdpMT, kSdpNT = Cfg::kSdpNT, kSdpRows = Cfg::kSdpRows, kSdpCols = Cfg::kSdpCols;
    constexpr int kKNT = Cfg::kKNT, kVNT = Cfg::kVNT, kKCols = Cfg::kKCols, kVCols = Cfg::kVCols;
    constexpr int kDqMT = Cfg::kDqMT, kDqNT = Cfg::kDqNT, kDqRows = Cfg::kDqRows, kDqCols = Cfg::kDqCols;
    constexpr bool kMasked = Cfg::kMasked, kPInRegs = Cfg::kPInRegs;
    constexpr mhakit_dtype kDtype = Cfg::kDtype;
    using Mma = ptx::Mma<kDtype>;

    constexpr int kQBuf = Cfg::kQBuf;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    uint16_t* sK = reinterpret_cast<uint16_t*>(smem_raw);
    uint16_t* sV = sK + Cfg::kElemsK;
    uint16_t* sQbase = sV + Cfg::kElemsV;                        // kQBuf Q tiles
    uint16_t* sdO = sQbase + kQBuf * Cfg::kElemsQ;
    uint16_t* sdS = sdO + Cfg::kElemsDO;                         // dS^T [key][query]
    uint16_t* sP = sdS + Cfg::kElemsP;                           // P^T  [key][query] (only when !kPInRegs)
    float* sLseBase = reinterpret_cast<float*>(sP + (kPInRegs ? 0 : Cfg::kElemsP));  // [kQBuf][kBM]
    float* sDsumBase = sLseBase + kQBuf * kBM;                                        // [kQBuf][kBM]

    const auto work = MainScheduler::work();
    const int n_block = work.block;
    const int split = work.head % ws.n_splits, hk = work.head / ws.n_splits;
    const int b = work.batch;
    const BwdSeq si = bwd_seq(p, b);
    const int sq = si.seqlen_q, sk = si.seqlen_k;
    const int n0 = n_block * kBN;
    if (n0 >= sk) return;  // whole CTA: past this sequence's keys
    const int keys_valid = min(kBN, sk - n0);
    const int group = p.nhead_q / p.nhead_k;
    const int h_begin = hk * group + split * ws.heads_per_split;
    const int h_end = min(h_begin + ws.heads_per_split, (hk + 1) * group);
    const int n_heads = max(h_end - h_begin, 0);

    // Query blocks whose rows can see a key of [n0, n0 + keys_valid).
    const auto geom = MaskGeometry<kMasked>::make(p.mask_type, p.window_left, p.window_right, sq, sk);
    const TileRange mrange = geom.key_block_query_tiles(n_block, kBM, kBN);
    const int m_begin = mrange.begin, m_end = mrange.empty() ? mrange.begin : mrange.end;
    const int nm = m_end - m_begin;
    const int n_iter = nm * n_heads;

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    const MmaFragLane fl{g, t4};  // the m16n8 fragment coordinates of this lane (mma_fragment.cuh)
    const int wk = warp % Cfg::kWK, wq = warp / Cfg::kWK;        // S^T / dK / dV layout
    const int dm = warp % Cfg::kDqWM, dc = warp / Cfg::kDqWM;    // dQ layout

    const bool alQ = flags & kAlQ, alK = flags & kAlK, alV = flags & kAlV, alDO = flags & kAlDO;
    const int q_chunks_load = ((p.hdim_q + 15) >> 4) << 1;
    const int v_chunks_load = ((p.hdim_v + 15) >> 4) << 1;
    const int ksq = (p.hdim_q + 15) >> 4, ksv = (p.hdim_v + 15) >> 4;
    auto np_limit = [](int hd, int col0, int cols) {
        int v = (hd - col0 + 15) >> 4;
        v = v < 0 ? 0 : v;
        return v > cols / 16 ? cols / 16 : v;
    };
    const int dk_np = np_limit(p.hdim_q, wq * kKCols, kKCols);
    const int dv_np = np_limit(p.hdim_v, wq * kVCols, kVCols);
    const int dq_np = np_limit(p.hdim_q, dc * kDqCols, kDqCols);
    const bool compute_dq = ws.dq != nullptr;

    const uint16_t* gK =
        static_cast<const uint16_t*>(p.k) + si.k + hk * p.k_head_stride + static_cast<int64_t>(n0) * p.k_row_stride;
    const uint16_t* gV =
        static_cast<const uint16_t*>(p.v) + si.v + hk * p.v_head_stride + static_cast<int64_t>(n0) * p.v_row_stride;

    // Q with its LSE2 / D rows, and dO, of iteration it (query head h_begin + it / nm, query block
    // m_begin + it % nm). LSE2 / D of rows past the sequence end are zero-filled: those rows have Q = dO = 0, so
    // their P = 1 multiplies zeros only.
    auto load_q = [&](int it, int buf) {
        const int h = h_begin + it / nm;
        const int m0 = (m_begin + it % nm) * kBM;
        const int rows = min(kBM, sq - m0);
        const uint16_t* gQ = static_cast<const uint16_t*>(p.q) + si.q + h * p.q_head_stride +
                             static_cast<int64_t>(m0) * p.q_row_stride;
        load_tile<kBM, Cfg::kHdimQ / 8, kSQ, kThreads>(sQbase + buf * Cfg::kElemsQ, gQ,
                                                                       p.q_row_stride, rows, q_chunks_load,
                                                                       p.hdim_q, alQ, tid);
        const int64_t row0 = static_cast<int64_t>(h) * ws.rows_q + si.row_q0 + m0;
        for (int r = tid; r < 2 * kBM; r += kThreads) {
            const int rr = r < kBM ? r : r - kBM;
            const float* src = (r < kBM ? ws.lse2 : ws.dsum) + row0 + rr;
            float* dst = (r < kBM ? sLseBase : sDsumBase) + buf * kBM + rr;
            const bool valid = rr < rows;
            cp_async_4(ptx::smem_addr(dst), valid ? src : ws.lse2, valid ? 4 : 0);
        }
    };
    auto load_do = [&](int it) {
        const int h = h_begin + it / nm;
        const int m0 = (m_begin + it % nm) * kBM;
        const int rows = min(kBM, sq - m0);
        const uint16_t* gdO = static_cast<const uint16_t*>(p.dout) + si.dout + h * p.do_head_stride +
                              static_cast<int64_t>(m0) * p.do_row_stride;
        load_tile<kBM, Cfg::kHdimV / 8, kSV, kThreads>(sdO, gdO, p.do_row_stride, rows,
                                                                       v_chunks_load, p.hdim_v, alDO, tid);
    };

    load_tile<kBN, Cfg::kHdimQ / 8, kSQ, kThreads>(sK, gK, p.k_row_stride, keys_valid, q_chunks_load,
                                                                   p.hdim_q, alK, tid);
    load_tile<kBN, Cfg::kHdimV / 8, kSV, kThreads>(sV, gV, p.v_row_stride, keys_valid, v_chunks_load,
                                                                   p.hdim_v, alV, tid);
    if (n_iter > 0) {
        load_q(0, 0);
        load_do(0);
    }
    ptx::cp_async_commit();

    float acc_dk[kSdpMT][kKNT][4], acc_dv[kSdpMT][kVNT][4];
    zero_acc(acc_dk);
    zero_acc(acc_dv);
    const float scale_log2 = p.scale_log2;
    [[maybe_unused]] DropKey drop_key_v{};
    if constexpr (kMods)
        if (p.mods.dropout.on) drop_key_v = drop_key(p.mods.dropout);

    for (int it = 0; it < n_iter; ++it) {
        const int h = h_begin + it / nm;
        const int m0 = (m_begin + it % nm) * kBM;
        const int buf = kQBuf == 2 ? (it & 1) : 0;
        const uint16_t* sQ = sQbase + buf * Cfg::kElemsQ;
        const float* sLse = sLseBase + buf * kBM;
        const float* sDsum = sDsumBase + buf * kBM;
        ptx::cp_async_wait<0>();
        __syncthreads();  // Q, dO, LSE2, D landed; every warp is done with the previous iteration
        if (kQBuf == 2 && it + 1 < n_iter) load_q(it + 1, buf ^ 1);
        ptx::cp_async_commit();

        // ---- S^T = K Q^T and dP^T = V dO^T ----
        float st[kSdpMT][kSdpNT][4], dpt[kSdpMT][kSdpNT][4];
        zero_acc(st);
        zero_acc(dpt);
        gemm_ss<kDtype, kSdpMT, kSdpNT, Cfg::kHdimQ / 16, false, false, kSQ, kSQ>(
            st, sK + wk * kSdpRows * kSQ, sQ + wq * kSdpCols * kSQ, ksq, kSdpNT / 2);
        gemm_ss<kDtype, kSdpMT, kSdpNT, Cfg::kHdimV / 16, false, false, kSV, kSV>(
            dpt, sV + wk * kSdpRows * kSV, sdO + wq * kSdpCols * kSV, ksv, kSdpNT / 2);

        // ---- P^T, dS^T (fp32); with score modifiers P comes from the logits, dS^T (for dK, dQ) goes through the
        // soft-cap's derivative, and dbias receives dS^T of the logits ----
        const bool need_mask = !geom.template tile_full<kBN>(m0, min(m0 + kBM, sq) - 1, n0);
        RowMods rmods;
        char* dbias = nullptr;
        [[maybe_unused]] uint2 rnd[kMods ? kSdpMT : 1][kMods ? kSdpNT / 2 : 1];
        if constexpr (kMods) {
            rmods = row_mods(p.mods, b, h, sq, sk);
            if (p.dbias != nullptr) dbias = dbias_block(p, b, h);
            if (p.mods.dropout.on)  // keys are the fragment's rows here (S^T)
                dropout_bytes<true>(rnd, drop_key_v, static_cast<uint32_t>(b * p.nhead_q + h), n0 + wk * kSdpRows,
                                    m0 + wq * kSdpCols);
        }
        auto p_ds = [&](auto cap, auto bias) {
            [[maybe_unused]] constexpr bool kCap = decltype(cap)::value;  // read by the kMods kernel only
            [[maybe_unused]] constexpr int kBias = decltype(bias)::value;
#pragma unroll
            for (int mt = 0; mt < kSdpMT; ++mt)
#pragma unroll
                for (int nt = 0; nt < kSdpNT; ++nt) {
                    const int ql = fl.col_pair(wq * kSdpCols, nt);  // Sᵀ: fragment columns are queries
                    const float2 lse2 = *reinterpret_cast<const float2*>(sLse + ql);
                    const float2 dsum = *reinterpret_cast<const float2*>(sDsum + ql);
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const float l = (e & 1) ? lse2.y : lse2.x, d = (e & 1) ? dsum.y : dsum.x;
                        const int j = fl.row(n0 + wk * kSdpRows, mt, e);  // Sᵀ: fragment rows are keys
                        const int i = m0 + ql + (e & 1);
                        [[maybe_unused]] float dcap = 1.f;
                        float pv;
                        if constexpr (kMods)
                            pv = ptx::ex2(logit_at<kDtype, kCap, kBias>(rmods, st[mt][nt][e], i, j, &dcap) * kLog2e - l);
                        else
                            pv = ptx::ex2(fmaf(st[mt][nt][e], scale_log2, -l));
                        if (need_mask && !geom.visible(i, j)) pv = 0.f;
                        st[mt][nt][e] = pv;
                        float dpv = dpt[mt][nt][e];
                        if constexpr (kMods) {
                            if (p.mods.dropout.on) {
                                const bool keep = drop_byte<true>(rnd[mt][nt / 2], nt, e) <=
                                                  static_cast<uint32_t>(p.mods.dropout.keep_max);
                                st[mt][nt][e] = keep ? pv * p.mods.dropout.rp : 0.f;
                                dpv = keep ? dpv * p.mods.dropout.rp : 0.f;
                            }
                        }
                        const float ds = pv * (dpv - d);
                        if constexpr (kMods) {
                            if (dbias != nullptr && i < sq && j < sk) store_dbias<kDtype>(p, dbias, i, j, ds);
                            dpt[mt][nt][e] = ds * dcap;
                        } else {
                            dpt[mt][nt][e] = ds;
                        }
                    }
                }
        };
        with_mods<kMods>(rmods, p_ds);

        // ---- dV += P^T dO; then dO of the next block streams in during dK += dS^T Q and dQ ----
        if constexpr (kPInRegs) {
            uint32_t pf[kSdpMT][kSdpNT / 2][4], dsf[kSdpMT][kSdpNT / 2][4];
            acc_to_a<kDtype, kSdpMT, kSdpNT>(pf, st);
            acc_to_a<kDtype, kSdpMT, kSdpNT>(dsf, dpt);
            if (compute_dq) acc_to_smem<kDtype, kSdpMT, kSdpNT, kSP>(sdS, dpt, wk * kSdpRows, wq * kSdpCols, 1.f);
            gemm_rs<kDtype, kSdpMT, kVNT, kBM / 16, true, kSV>(acc_dv, pf, sdO, dv_np);
            __syncthreads();  // every warp is done with dO; dS^T is complete
            if (it + 1 < n_iter) load_do(it + 1);
            ptx::cp_async_commit();
            gemm_rs<kDtype, kSdpMT, kKNT, kBM / 16, true, kSQ>(acc_dk, dsf, sQ, dk_np);
        } else {
            acc_to_smem<kDtype, kSdpMT, kSdpNT, kSP>(sP, st, wk * kSdpRows, wq * kSdpCols, 1.f);
            acc_to_smem<kDtype, kSdpMT, kSdpNT, kSP>(sdS, dpt, wk * kSdpRows, wq * kSdpCols, 1.f);
            __syncthreads();  // P^T, dS^T complete
            gemm_ss<kDtype, kSdpMT, kVNT, kBM / 16, false, true, kSP, kSV>(acc_dv, sP + wk * kSdpRows * kSP,
                                                                           sdO + wq * kVCols, kBM / 16, dv_np);
            __syncthreads();  // every warp is done with dO
            if (it + 1 < n_iter) load_do(it + 1);
            ptx::cp_async_commit();
            gemm_ss<kDtype, kSdpMT, kKNT, kBM / 16, false, true, kSP, kSQ>(acc_dk, sdS + wk * kSdpRows * kSP,
                                                                           sQ + wq * kKCols, kBM / 16, dk_np);
        }
        if (kQBuf == 1) {
            __syncthreads();  // every warp is done with Q, LSE2, D
            if (it + 1 < n_iter) load_q(it + 1, 0);
            ptx::cp_async_commit();
        }

        // ---- dQ += dS K (fp32 reductions into the workspace accumulator) ----
        if (compute_dq) {
            float acc_dq[kDqMT][kDqNT][4];
            zero_acc(acc_dq);
            gemm_ss<kDtype, kDqMT, kDqNT, kBN / 16, true, true, kSP, kSQ>(acc_dq, sdS + dm * kDqRows,
                                                                         sK + dc * kDqCols, (keys_valid + 15) >> 4,
                                                                         dq_np);
            float* gdq = ws.dq + (static_cast<int64_t>(h) * ws.rows_q + si.row_q0 + m0) * ws.ld_q;
#pragma unroll
            for (int mt = 0; mt < kDqMT; ++mt)
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    const int ql = dm * kDqRows + mt * 16 + g + 8 * hf;
                    if (m0 + ql >= sq) continue;
#pragma unroll
                    for (int nt = 0; nt < kDqNT; ++nt) {
                        const int x = dc * kDqCols + nt * 8 + 2 * t4;
                        if (x < p.hdim_q)
                            red_add2(gdq + static_cast<int64_t>(ql) * ws.ld_q + x, acc_dq[mt][nt][2 * hf],
                                     acc_dq[mt][nt][2 * hf + 1]);
                    }
                }
        }
    }

    // ---- epilogue: dK (times scale) and dV ----
    const float scale = p.scale;
    if (ws.n_splits == 1) {
        ptx::cp_async_wait<0>();
        __syncthreads();  // every warp is done with K and V
        acc_to_smem<kDtype, kSdpMT, kKNT, kSQ>(sK, acc_dk, wk * kSdpRows, wq * kKCols, scale);
        acc_to_smem<kDtype, kSdpMT, kVNT, kSV>(sV, acc_dv, wk * kSdpRows, wq * kVCols, 1.f);
        __syncthreads();
        uint16_t* gdK = static_cast<uint16_t*>(p.dk) + si.dk + hk * p.dk_head_stride +
                        static_cast<int64_t>(n0) * p.dk_row_stride;
        uint16_t* gdV = static_cast<uint16_t*>(p.dv) + si.dv + hk * p.dv_head_stride +
                        static_cast<int64_t>(n0) * p.dv_row_stride;
        store_tile<kBN, Cfg::kHdimQ / 8, kSQ, kThreads>(sK, gdK, p.dk_row_stride, keys_valid, p.hdim_q,
                                                       flags & kAlDK, tid);
        store_tile<kBN, Cfg::kHdimV / 8, kSV, kThreads>(sV, gdV, p.dv_row_stride, keys_valid, p.hdim_v,
                                                       flags & kAlDV, tid);
    } else {
        const int64_t row0 =
            (static_cast<int64_t>(split) * p.nhead_k + hk) * ws.rows_k + si.row_k0 + n0;
        float* pk = ws.pk + row0 * ws.ld_q;
        float* pv = ws.pv + row0 * ws.ld_v;
#pragma unroll
        for (int mt = 0; mt < kSdpMT; ++mt)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int kl = wk * kSdpRows + mt * 16 + g + 8 * hf;
                if (kl >= keys_valid) continue;
#pragma unroll
                for (int nt = 0; nt < kKNT; ++nt) {
                    const int x = wq * kKCols + nt * 8 + 2 * t4;
                    if (x < p.hdim_q)
                        *reinterpret_cast<float2*>(pk + static_cast<int64_t>(kl) * ws.ld_q + x) =
                            make_float2(acc_dk[mt][nt][2 * hf] * scale, acc_dk[mt][nt][2 * hf + 1] * scale);
                }
#pragma unroll
                for (int nt = 0; nt < kVNT; ++nt) {
                    const int x = wq * kVCols + nt * 8 + 2 * t4;
                    if (x < p.hdim_v)
                        *reinterpret_cast<float2*>(pv + static_cast<int64_t>(kl) * ws.ld_v + x) =
                            make_float2(acc_dv[mt][nt][2 * hf], acc_dv[mt][nt][2 * hf + 1]);
                }
            }
    }
}

// ------------------------------------------------------------------------------------------------------------------
// Stage 3, dQ pass: dQ without atomics. One CTA per (query block, query head, sequence), 4 warps of 16 * kDqkMT
// rows; per key block S = Q K^T, dP = dO V^T, dS = P o (dP - D) in registers, dQ += dS K.
// ------------------------------------------------------------------------------------------------------------------
template <class Cfg, bool kMods>
__global__ void __launch_bounds__(Cfg::kDqkThreads, 2) bwd_dq_kernel(const BwdParams p, const BwdWs ws, const int flags) {
    constexpr int kBM = Cfg::kDqkBM, kBN = Cfg::kDqkBN, kThreads = Cfg::kDqkThreads;
    constexpr int kSQ = Cfg::kSQ, kSV = Cfg::kSV, kNT = kBN / 8, kQT = Cfg::kHdimQ / 8, kMT = Cfg::kDqkMT;
    constexpr bool kMasked = Cfg::kMasked;
    constexpr mhakit_dtype kDtype = Cfg::kDtype;

    constexpr int kKBuf = Cfg::kDqkKBuf;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    uint16_t* sQ = reinterpret_cast<uint16_t*>(smem_raw);
    uint16_t* sdO = sQ + kBM * kSQ;
    uint16_t* sV = sdO + kBM * kSV;
    uint16_t* sKbase = sV + kBN * kSV;  // kKBuf K tiles

    const auto work = DqScheduler<Cfg>::work();
    const int m_block = work.block, h = work.head, b = work.batch;
    const BwdSeq si = bwd_seq(p, b);
    const int sq = si.seqlen_q, sk = si.seqlen_k;
    const int m0 = m_block * kBM;
    if (m0 >= sq) return;
    const int rows_valid = min(kBM, sq - m0);
    const int hk = h / (p.nhead_q / p.nhead_k);

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    const MmaFragLane fl{g, t4};  // the m16n8 fragment coordinates of this lane (mma_fragment.cuh)
    const int row0 = warp * 16 * kMT;

    const auto geom = MaskGeometry<kMasked>::make(p.mask_type, p.window_left, p.window_right, sq, sk);
    const TileRange visit = geom.template key_tiles<kBN>(m0, m0 + rows_valid - 1);
    const int n_begin = visit.begin, n_end = visit.empty() ? visit.begin : visit.end;

    float lse2[kMT][2], dsum[kMT][2];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int r = row0 + mt * 16 + g + 8 * hf;
            lse2[mt][hf] = INFINITY;
            dsum[mt][hf] = 0.f;
            if (r < rows_valid) {
                const int64_t row = static_cast<int64_t>(h) * ws.rows_q + si.row_q0 + m0 + r;
                lse2[mt][hf] = ws.lse2[row];
                dsum[mt][hf] = ws.dsum[row];
            }
        }

    const bool alQ = flags & kAlQ, alK = flags & kAlK, alV = flags & kAlV, alDO = flags & kAlDO;
    const int q_chunks_load = ((p.hdim_q + 15) >> 4) << 1;
    const int v_chunks_load = ((p.hdim_v + 15) >> 4) << 1;
    const int ksq = (p.hdim_q + 15) >> 4, ksv = (p.hdim_v + 15) >> 4;
    const uint16_t* gK = static_cast<const uint16_t*>(p.k) + si.k + hk * p.k_head_stride;
    const uint16_t* gV = static_cast<const uint16_t*>(p.v) + si.v + hk * p.v_head_stride;

    float acc_dq[kMT][kQT][4];
    zero_acc(acc_dq);
    const float scale_log2 = p.scale_log2;
    RowMods rmods;
    [[maybe_unused]] DropKey drop_key_v{};
    if constexpr (kMods) {
        rmods = row_mods(p.mods, b, h, sq, sk);
        if (p.mods.dropout.on) drop_key_v = drop_key(p.mods.dropout);
    }

    if (n_begin < n_end) {
        const uint16_t* gQ = static_cast<const uint16_t*>(p.q) + si.q + h * p.q_head_stride +
                             static_cast<int64_t>(m0) * p.q_row_stride;
        const uint16_t* gdO = static_cast<const uint16_t*>(p.dout) + si.dout + h * p.do_head_stride +
                              static_cast<int64_t>(m0) * p.do_row_stride;
        load_tile<kBM, Cfg::kHdimQ / 8, kSQ, kThreads>(sQ, gQ, p.q_row_stride, rows_valid,
                                                                       q_chunks_load, p.hdim_q, alQ, tid);
        load_tile<kBM, Cfg::kHdimV / 8, kSV, kThreads>(sdO, gdO, p.do_row_stride, rows_valid,
                                                                       v_chunks_load, p.hdim_v, alDO, tid);
        const int n0 = n_begin * kBN;
        load_tile<kBN, Cfg::kHdimQ / 8, kSQ, kThreads>(
            sKbase, gK + static_cast<int64_t>(n0) * p.k_row_stride, p.k_row_stride, min(kBN, sk - n0),
            q_chunks_load, p.hdim_q, alK, tid);
        load_tile<kBN, Cfg::kHdimV / 8, kSV, kThreads>(
            sV, gV + static_cast<int64_t>(n0) * p.v_row_stride, p.v_row_stride, min(kBN, sk - n0), v_chunks_load,
            p.hdim_v, alV, tid);
        ptx::cp_async_commit();
    }

    for (int n_block = n_begin; n_block < n_end; ++n_block) {
        const int n0 = n_block * kBN;
        const int kb = kKBuf == 2 ? ((n_block - n_begin) & 1) : 0;
        const uint16_t* sK = sKbase + kb * kBN * kSQ;
        ptx::cp_async_wait<0>();
        __syncthreads();  // K, V (and Q, dO) landed; every warp is done with the previous block
        if (kKBuf == 2 && n_block + 1 < n_end) {
            const int n1 = n0 + kBN;
            load_tile<kBN, Cfg::kHdimQ / 8, kSQ, kThreads>(
                sKbase + (kb ^ 1) * kBN * kSQ, gK + static_cast<int64_t>(n1) * p.k_row_stride, p.k_row_stride,
                min(kBN, sk - n1), q_chunks_load, p.hdim_q, alK, tid);
        }
        ptx::cp_async_commit();

        float s[kMT][kNT][4], dp[kMT][kNT][4];
        zero_acc(s);
        zero_acc(dp);
        gemm_ss<kDtype, kMT, kNT, Cfg::kHdimQ / 16, false, false, kSQ, kSQ>(s, sQ + row0 * kSQ, sK, ksq, kNT / 2);
        gemm_ss<kDtype, kMT, kNT, Cfg::kHdimV / 16, false, false, kSV, kSV>(dp, sdO + row0 * kSV, sV, ksv,
                                                                             kNT / 2);

        __syncthreads();  // every warp is done with V
        if (n_block + 1 < n_end) {
            const int n1 = n0 + kBN;
            load_tile<kBN, Cfg::kHdimV / 8, kSV, kThreads>(
                sV, gV + static_cast<int64_t>(n1) * p.v_row_stride, p.v_row_stride, min(kBN, sk - n1),
                v_chunks_load, p.hdim_v, alV, tid);
        }
        ptx::cp_async_commit();

        const bool need_mask = !geom.template tile_full<kBN>(m0, m0 + rows_valid - 1, n0);
        [[maybe_unused]] uint2 rnd[kMods ? kMT : 1][kMods ? kNT / 2 : 1];
        if constexpr (kMods)
            if (p.mods.dropout.on)
                dropout_bytes<false>(rnd, drop_key_v, static_cast<uint32_t>(b * p.nhead_q + h), m0 + row0, n0);
        auto p_ds = [&](auto cap, auto bias) {
            [[maybe_unused]] constexpr bool kCap = decltype(cap)::value;  // read by the kMods kernel only
            [[maybe_unused]] constexpr int kBias = decltype(bias)::value;
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
                for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int hf = e >> 1;
                        const int j = fl.col(n0, nt, e);
                        const int i = fl.row(m0 + row0, mt, e);
                        [[maybe_unused]] float dcap = 1.f;
                        float pv;
                        if constexpr (kMods)
                            pv = ptx::ex2(logit_at<kDtype, kCap, kBias>(rmods, s[mt][nt][e], i, j, &dcap) * kLog2e -
                                          lse2[mt][hf]);
                        else
                            pv = ptx::ex2(fmaf(s[mt][nt][e], scale_log2, -lse2[mt][hf]));
                        if (need_mask && !geom.visible(i, j)) pv = 0.f;
                        float dpv = dp[mt][nt][e];
                        if constexpr (kMods) {
                            if (p.mods.dropout.on)
                                dpv = drop_byte<false>(rnd[mt][nt / 2], nt, e) <=
                                              static_cast<uint32_t>(p.mods.dropout.keep_max)
                                          ? dpv * p.mods.dropout.rp
                                          : 0.f;
                        }
                        s[mt][nt][e] = pv * (dpv - dsum[mt][hf]) * dcap;
                    }
        };
        with_mods<kMods>(rmods, p_ds);
        uint32_t dsf[kMT][kNT / 2][4];
        acc_to_a<kDtype, kMT, kNT>(dsf, s);
        gemm_rs<kDtype, kMT, kQT, kBN / 16, true, kSQ>(acc_dq, dsf, sK, ksq);

        if (kKBuf == 1) {
            __syncthreads();  // every warp is done with K
            if (n_block + 1 < n_end) {
                const int n1 = n0 + kBN;
                load_tile<kBN, Cfg::kHdimQ / 8, kSQ, kThreads>(
                    sKbase, gK + static_cast<int64_t>(n1) * p.k_row_stride, p.k_row_stride, min(kBN, sk - n1),
                    q_chunks_load, p.hdim_q, alK, tid);
            }
            ptx::cp_async_commit();
        }
    }

    // ---- epilogue: dQ = scale * acc, staged through shared memory (the Q tile) ----
    ptx::cp_async_wait<0>();
    __syncthreads();
    acc_to_smem<kDtype, kMT, kQT, kSQ>(sQ, acc_dq, row0, 0, p.scale);
    __syncthreads();
    uint16_t* gdQ = static_cast<uint16_t*>(p.dq) + si.dq + h * p.dq_head_stride +
                    static_cast<int64_t>(m0) * p.dq_row_stride;
    store_tile<kBM, Cfg::kHdimQ / 8, kSQ, kThreads>(sQ, gdQ, p.dq_row_stride, rows_valid, p.hdim_q,
                                                   flags & kAlDQ, tid);
}

}  // namespace bwd_detail

namespace bwd_detail {

// Everything BwdKernel offers, for one fully specified configuration (the catalogue's traits plus tuning knobs).
// kMods: the modifier instance ("_mods"), serving exactly the calls with ScoreMods::per_element.
template <class Cfg_, bool kMods>
struct BwdKernelImpl {
    using Cfg = Cfg_;
    static constexpr mhakit_dtype kDtype = Cfg::kDtype;
    static constexpr int kHdimQ = Cfg::kHdimQ, kHdimV = Cfg::kHdimV, kBlockN = Cfg::kBN;
    static constexpr bool kGroupMode = Cfg::kGroupMode, kMasked = Cfg::kMasked;
    static constexpr int kSmemBytes = Cfg::kSmemBytes;
    static constexpr int kDqSmemBytes = Cfg::kDqkSmemBytes;
    static constexpr int kThreads = Cfg::kThreads;
    // 99 KB: the smallest opt-in shared memory per block of the sm_80+ parts the family is built for (sm_86/sm_89/
    // sm_120), so supports() need not ask the device.
    static_assert(kSmemBytes <= 101376, "generic backward tile needs more shared memory than sm_86/sm_89 offer");
    static_assert(kDqSmemBytes <= 101376, "generic backward dQ tile needs more shared memory than sm_86/sm_89 offer");

    // Run-time guard beyond what the runtime checked (the validator, the instance's traits: dtype, mode, mask class,
    // head-dim bucket): the grids fit. Pure host arithmetic.
    static bool supports(const BwdParams& p) { return p.nhead_q <= 65535 && p.batch <= 65535; }

    static size_t workspace_bytes(const BwdParams& p) {
        return bwd_detail::plan_workspace(p, kBlockN, kGroupMode, atomic_dq(p)).total;
    }

    // dQ by fp32 reductions from the main kernel (fast, not reproducible) or by the separate dQ pass.
    static bool atomic_dq(const BwdParams& p) { return !p.deterministic && !Cfg::kPreferDqPass; }

    // Launches every stage on `stream`; never synchronises or allocates.
    static cudaError_t run(const BwdParams& p, cudaStream_t stream) {
        using namespace bwd_detail;
        if (p.batch <= 0 || p.nhead_q <= 0) return cudaSuccess;
        const int max_sq = kGroupMode ? p.max_seqlen_q : p.seqlen_q;
        const int max_sk = kGroupMode ? p.max_seqlen_k : p.seqlen_k;
        const bool atomic = atomic_dq(p);
        const WsPlan plan = plan_workspace(p, kBlockN, kGroupMode, atomic);
        const BwdWs ws = make_ws(p, plan, atomic, Cfg::kBM, kBlockN);
        const int flags = alignment_flags(p, kGroupMode);
        cudaError_t err;
        const dim3 row_block(kRowKernelWarps * 32);

        if (max_sq > 0) {
            const dim3 grid((max_sq + kRowKernelWarps - 1) / kRowKernelWarps, p.nhead_q, p.batch);
            bwd_dot_kernel<kDtype><<<grid, row_block, 0, stream>>>(p, ws, flags);
            if ((err = cudaGetLastError()) != cudaSuccess) return err;
        }
        if (max_sk > 0) {
            static std::atomic<uint64_t> attr_main{0};
            auto kernel = bwd_main_kernel<Cfg, kMods>;
            if ((err = opt_in_dynamic_smem(kernel, kSmemBytes, attr_main)) != cudaSuccess) return err;
            const dim3 grid = MainScheduler::grid((max_sk + kBlockN - 1) / kBlockN, p.nhead_k * ws.n_splits, p.batch);
            kernel<<<grid, kThreads, kSmemBytes, stream>>>(p, ws, flags);
            if ((err = cudaGetLastError()) != cudaSuccess) return err;
        }
        if (max_sq > 0) {
            if (!atomic) {
                static std::atomic<uint64_t> attr_dq{0};
                auto kernel = bwd_dq_kernel<Cfg, kMods>;
                if ((err = opt_in_dynamic_smem(kernel, kDqSmemBytes, attr_dq)) != cudaSuccess) return err;
                const dim3 grid = DqScheduler<Cfg>::grid((max_sq + Cfg::kDqkBM - 1) / Cfg::kDqkBM, p.nhead_q, p.batch);
                kernel<<<grid, Cfg::kDqkThreads, kDqSmemBytes, stream>>>(p, ws, flags);
            } else {
                const dim3 grid((max_sq + kRowKernelWarps - 1) / kRowKernelWarps, p.nhead_q, p.batch);
                bwd_dq_convert_kernel<kDtype><<<grid, row_block, 0, stream>>>(p, ws, flags);
            }
            if ((err = cudaGetLastError()) != cudaSuccess) return err;
        }
        if (p.dsink != nullptr) {
            bwd_dsink_kernel<kDtype><<<p.nhead_q, kDsinkThreads, 0, stream>>>(p, ws);
            if ((err = cudaGetLastError()) != cudaSuccess) return err;
        }
        if (max_sk > 0 && ws.n_splits > 1) {
            const dim3 grid((max_sk + kRowKernelWarps - 1) / kRowKernelWarps, p.nhead_k, p.batch);
            bwd_dkv_reduce_kernel<kDtype><<<grid, row_block, 0, stream>>>(p, ws, flags);
            if ((err = cudaGetLastError()) != cudaSuccess) return err;
        }
        return cudaSuccess;
    }
};

}  // namespace bwd_detail

// The catalogue's template: traits, tile and tuning knobs (see BwdConfig).
template <mhakit_dtype kDtype, int kHdimQ, int kHdimV, bool kGroupMode, bool kMasked, int kBlockM, int kBlockN,
          int kNumWarps, int kKeysPerWarp, int kDqRowTiles, int kDqBlockN, int kDqPass, bool kMods>
struct BwdKernel
    : bwd_detail::BwdKernelImpl<bwd_detail::BwdConfig<kDtype, kHdimQ, kHdimV, kGroupMode, kMasked, kBlockM, kBlockN,
                                                      kNumWarps, kKeysPerWarp, kDqRowTiles, kDqBlockN, kDqPass>,
                                kMods> {};

}  // namespace mhakit::generic
