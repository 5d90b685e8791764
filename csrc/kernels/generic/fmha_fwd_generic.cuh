// mhakit generic family: forward flash attention for sm_80 and newer (FlashAttention-2 style).
//
// One CTA computes kBlockM query rows of one (sequence, query head); its kNumWarps warps split those rows, each warp
// owning kBlockM / kNumWarps rows (a multiple of 16). Per key tile of kBlockN keys:
//   S = Q·Kᵀ      mma.sync m16n8k16 (fp16/bf16 in, fp32 out); Q and K fragments come from shared memory by ldmatrix
//                 (Q is kept in registers for the whole CTA when the register budget allows it);
//   modifiers     soft-cap, bias / ALiBi (generic_score_mod.cuh) turn q·k into logits in the modifier instances
//                 (kMods, "_mods" in the instance name: an instance is compiled either plain or with them; the
//                 softmax then runs with scale 1; one branch per tile picks the variant); a sink joins each row's
//                 denominator in the epilogue (both kinds of instance); dropout (generic_dropout.cuh, modifier
//                 instances) zeroes dropped probabilities after the softmax's row sums and scales the kept ones;
//   mask          only on tiles that straddle the sequence end or a row's window edge (per-row key bounds);
//   softmax       online, fp32, exp2 with scale·log2(e) folded into one FMA; rows that see nothing stay at -inf
//                 without producing NaN;
//   O += P·V      P stays in registers (the S accumulator layout is the A-fragment layout), V by ldmatrix.trans.
// Loads are cp.async (16 bytes, zero-filled past the sequence end and past the real head dim) when every base
// pointer and stride of a tensor is 16-byte aligned, else element-wise loads into the same shared-memory tiles
// (a uniform runtime branch). K for the next tile streams in during P·V, V during Q·Kᵀ.
// The epilogue stages O through shared memory (reusing the Q tile) and stores whole 16-byte chunks when aligned.
//
// Shared memory rows are padded by 16 bytes, so the eight row addresses of every ldmatrix hit distinct banks.
//
// Tiles (kBlockM x kBlockN, warps) measured best on one H200 (bf16, b=1, h=16, s=4096; all fit the 99 KB opt-in
// shared memory of sm_86/sm_89 too): d32 128x128x4, d64 128x128x4, d128 128x64x4, d192/128 64x64x4,
// d256 64x64x4 (101,376 B). Four-warp CTAs with two CTAs per SM beat eight-warp CTAs (one CTA per SM) everywhere.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include <atomic>

#include "../../include/mha_common.h"
#include "../common/fwd_params.h"
#include "../common/mask.h"
#include "../common/mask_geometry.h"
#include "../common/mma_fragment.cuh"
#include "../common/smem_opt_in.h"
#include "../common/tile_scheduler.h"
#include "generic_dropout.cuh"
#include "generic_epilogue.cuh"
#include "generic_ptx.cuh"
#include "generic_score_mod.cuh"
#include "generic_softmax.cuh"
#include "generic_tile_io.cuh"

namespace mhakit::generic {

namespace detail {

template <mhakit_dtype kDtype_, int kHdimQ_, int kHdimV_, bool kGroupMode_, bool kMasked_, int kBlockM_,
          int kBlockN_, int kNumWarps_>
struct FwdConfig {
    static constexpr mhakit_dtype kDtype = kDtype_;
    static constexpr int kHdimQ = kHdimQ_, kHdimV = kHdimV_;
    static constexpr bool kGroupMode = kGroupMode_, kMasked = kMasked_;
    static constexpr int kBlockM = kBlockM_, kBlockN = kBlockN_, kNumWarps = kNumWarps_;

    static constexpr int kThreads = kNumWarps * 32;
    static constexpr int kWarpM = kBlockM / kNumWarps;  // rows per warp
    static constexpr int kMT = kWarpM / 16;              // 16-row mma tiles per warp
    static constexpr int kNT = kBlockN / 8;              // 8-key column tiles of S
    static constexpr int kKQ = kHdimQ / 16;              // k steps of Q·Kᵀ
    static constexpr int kKV = kBlockN / 16;             // k steps of P·V
    static constexpr int kOT = kHdimV / 8;               // 8-column tiles of O
    static constexpr int kSQ = kHdimQ + 8;               // shared row stride (elements) of Q and K tiles
    static constexpr int kSV = kHdimV + 8;               // ... of V and the O staging tile

    static_assert(kHdimQ % 16 == 0 && kHdimV % 16 == 0, "head-dim buckets are multiples of 16");
    static_assert(kBlockN % 16 == 0, "kBlockN must be a multiple of 16");
    static_assert(kBlockM % kNumWarps == 0 && kWarpM % 16 == 0, "each warp owns a multiple of 16 rows");

    // Registers per thread for the O and S accumulators and for Q fragments held across the key loop.
    static constexpr int kRegsO = kMT * kOT * 4, kRegsS = kMT * kNT * 4, kRegsQ = kMT * kKQ * 4;
    static constexpr bool kQInRegs = kRegsO + kRegsS + kRegsQ <= 160;

    static constexpr int kElemsQO = (kBlockM * kSQ > kBlockM * kSV) ? kBlockM * kSQ : kBlockM * kSV;
    static constexpr int kElemsK = kBlockN * kSQ;
    static constexpr int kElemsV = kBlockN * kSV;
    static constexpr int kSmemBytes = (kElemsQO + kElemsK + kElemsV) * 2;
};

// S += Q·Kᵀ for one key tile. Steps run k-major (kk outer, key pair np inner) so that consecutive mma write
// different accumulators; the K fragment of the next step (and the Q fragment of the next kk) is loaded one step
// ahead. kFull: the real hdim_q fills the bucket (no step is skipped, no branch in the unrolled loop).
template <class Cfg, bool kFull, class QFrag>
__device__ __forceinline__ void gemm_qk(float (&s)[Cfg::kMT][Cfg::kNT][4], const QFrag& q_frag, uint32_t sQ_a,
                                        uint32_t sK_b, int hdim_q) {
    constexpr int kMT = Cfg::kMT, kNP = Cfg::kNT / 2, kKQ = Cfg::kKQ, kSQ = Cfg::kSQ;
    using Mma = ptx::Mma<Cfg::kDtype>;
    const int kq = kFull ? kKQ : (hdim_q + 15) >> 4;
    uint32_t a[2][kMT][4];
    uint32_t bk[2][4];
    auto load_a = [&](int buf, int kk) {
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
            if constexpr (Cfg::kQInRegs) {
#pragma unroll
                for (int e = 0; e < 4; ++e) a[buf][mt][e] = q_frag[mt][kk][e];
            } else {
                ptx::ldmatrix_x4(a[buf][mt], sQ_a + (mt * 16 * kSQ + kk * 16) * 2);
            }
        }
    };
    load_a(0, 0);
    ptx::ldmatrix_x4(bk[0], sK_b);
    // Nested loops (each short) rather than one flattened loop: the compiler must unroll them completely so that
    // every fragment index is a constant and the accumulators stay in registers.
#pragma unroll
    for (int kk = 0; kk < kKQ; ++kk) {
        if (!kFull && kk >= kq) break;
#pragma unroll
        for (int np = 0; np < kNP; ++np) {
            const int st = kk * kNP + np;
            const int kk1 = (np + 1 < kNP) ? kk : kk + 1, np1 = (np + 1 < kNP) ? np + 1 : 0;
            if (kk1 < kKQ && (kFull || kk1 < kq)) {
                if (np1 == 0) load_a(kk1 & 1, kk1);
                ptx::ldmatrix_x4(bk[(st + 1) & 1], sK_b + (np1 * 16 * kSQ + kk1 * 16) * 2);
            }
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt) {
                Mma::mma(s[mt][2 * np], a[kk & 1][mt], bk[st & 1][0], bk[st & 1][1]);
                Mma::mma(s[mt][2 * np + 1], a[kk & 1][mt], bk[st & 1][2], bk[st & 1][3]);
            }
        }
    }
}

// O += P·V for one key tile (P in registers as A fragments). Steps: key chunk kk outer, dv pair np inner; the V
// fragment of the next step is loaded one step ahead. kFull: the real hdim_v fills the bucket.
template <class Cfg, bool kFull>
__device__ __forceinline__ void gemm_pv(float (&acc_o)[Cfg::kMT][Cfg::kOT][4],
                                        const uint32_t (&p_frag)[Cfg::kMT][Cfg::kKV][4], uint32_t sV_b, int hdim_v) {
    constexpr int kMT = Cfg::kMT, kNP = Cfg::kOT / 2, kKV = Cfg::kKV, kSV = Cfg::kSV;
    using Mma = ptx::Mma<Cfg::kDtype>;
    const int nv = kFull ? kNP : (hdim_v + 15) >> 4;
    uint32_t bv[2][4];
    ptx::ldmatrix_x4_trans(bv[0], sV_b);
#pragma unroll
    for (int kk = 0; kk < kKV; ++kk) {
#pragma unroll
        for (int np = 0; np < kNP; ++np) {
            const int st = kk * kNP + np;
            const int kk1 = (np + 1 < kNP) ? kk : kk + 1, np1 = (np + 1 < kNP) ? np + 1 : 0;
            if (kk1 < kKV && (kFull || np1 < nv))
                ptx::ldmatrix_x4_trans(bv[(st + 1) & 1], sV_b + (kk1 * 16 * kSV + np1 * 16) * 2);
            if (kFull || np < nv) {
#pragma unroll
                for (int mt = 0; mt < kMT; ++mt) {
                    Mma::mma(acc_o[mt][2 * np], p_frag[mt][kk], bv[st & 1][0], bv[st & 1][1]);
                    Mma::mma(acc_o[mt][2 * np + 1], p_frag[mt][kk], bv[st & 1][2], bv[st & 1][3]);
                }
            }
        }
    }
}

// Alignment flags passed to the kernel: bit i set when tensor i (q, k, v, o) allows 16-byte vector access.
enum : int { kAlignQ = 1, kAlignK = 2, kAlignV = 4, kAlignO = 8 };

template <class Cfg>
using FwdScheduler = SingleTileScheduler</*kHeaviestFirst=*/Cfg::kMasked>;  // masked: the heaviest blocks first

// P (the softmax's output over S) as m16n8k16 A fragments of the P·V product.
template <class Cfg>
__device__ __forceinline__ void pack_p(uint32_t (&p_frag)[Cfg::kMT][Cfg::kKV][4], const float (&s)[Cfg::kMT][Cfg::kNT][4]) {
    using Mma = ptx::Mma<Cfg::kDtype>;
#pragma unroll
    for (int mt = 0; mt < Cfg::kMT; ++mt)
#pragma unroll
        for (int kk = 0; kk < Cfg::kKV; ++kk) {
            p_frag[mt][kk][0] = Mma::pack(s[mt][2 * kk][0], s[mt][2 * kk][1]);
            p_frag[mt][kk][1] = Mma::pack(s[mt][2 * kk][2], s[mt][2 * kk][3]);
            p_frag[mt][kk][2] = Mma::pack(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
            p_frag[mt][kk][3] = Mma::pack(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
        }
}

// Keys a row does not see become -inf (rows (mt, hf) of this thread see [row_lo, row_hi)).
template <class Cfg>
__device__ __forceinline__ void mask_s(float (&s)[Cfg::kMT][Cfg::kNT][4], const int (&row_lo)[Cfg::kMT][2],
                                       const int (&row_hi)[Cfg::kMT][2], int n0) {
    const MmaFragLane fl = MmaFragLane::of_thread();
#pragma unroll
    for (int mt = 0; mt < Cfg::kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < Cfg::kNT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int j = fl.col(n0, nt, e);
                const int hf = e >> 1;
                if (j >= row_hi[mt][hf] || (Cfg::kMasked && j < row_lo[mt][hf])) s[mt][nt][e] = -INFINITY;
            }
}

// kMods: the modifier instance's kernel (calls with ScoreMods::per_element); the plain kernel has none of that code.
template <class Cfg, bool kMods>
__global__ void __launch_bounds__(Cfg::kThreads, 1) fwd_kernel(const FwdParams p, const int align_flags) {
    constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kMT = Cfg::kMT, kNT = Cfg::kNT;
    constexpr int kKQ = Cfg::kKQ, kKV = Cfg::kKV, kOT = Cfg::kOT, kSQ = Cfg::kSQ, kSV = Cfg::kSV;
    constexpr int kThreads = Cfg::kThreads;
    constexpr bool kMasked = Cfg::kMasked, kQInRegs = Cfg::kQInRegs;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    uint16_t* sQ = reinterpret_cast<uint16_t*>(smem_raw);  // Q tile, later the O staging tile
    uint16_t* sK = sQ + Cfg::kElemsQO;
    uint16_t* sV = sK + Cfg::kElemsK;

    const auto work = FwdScheduler<Cfg>::work();
    const int m_block = work.block, h = work.head, b = work.batch;
    const SeqInfo si = seq_info(p, b);
    const int sq = si.seqlen_q, sk = si.seqlen_k;
    const int m0 = m_block * kBlockM;
    if (m0 >= sq) return;  // whole CTA: past this sequence's queries (group mode) or nothing to do
    const int rows_valid = min(kBlockM, sq - m0);
    const int hk = h / (p.nhead_q / p.nhead_k);

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2;
    const int warp_row0 = warp * Cfg::kWarpM;

    const uint16_t* gQ = static_cast<const uint16_t*>(p.q) + si.q_offset + h * p.q_head_stride + m0 * p.q_row_stride;
    const uint16_t* gK = static_cast<const uint16_t*>(p.k) + si.k_offset + hk * p.k_head_stride;
    const uint16_t* gV = static_cast<const uint16_t*>(p.v) + si.v_offset + hk * p.v_head_stride;
    const bool alQ = align_flags & kAlignQ, alK = align_flags & kAlignK, alV = align_flags & kAlignV;
    const bool alO = align_flags & kAlignO;

    // Chunks of 8 elements that the mma loops read (rounded up to 16 columns); columns past the real head dims are
    // zero-filled, so they add nothing to Q·Kᵀ and P·V.
    const int q_chunks_load = ((p.hdim_q + 15) >> 4) << 1;
    const int v_chunks_load = ((p.hdim_v + 15) >> 4) << 1;
    const bool q_full = p.hdim_q > Cfg::kHdimQ - 16, v_full = p.hdim_v > Cfg::kHdimV - 16;

    // Key tiles the block visits, those that need no element mask, and the visible keys of this thread's rows
    // (row (mt, hf) is warp_row0 + mt*16 + g + 8*hf).
    const auto geom = MaskGeometry<kMasked>::make(p.mask_type, p.window_left, p.window_right, sq, sk);
    const TileRange visit = geom.template key_tiles<kBlockN>(m0, m0 + rows_valid - 1);
    const TileRange full = geom.template full_key_tiles<kBlockN>(m0, m0 + rows_valid - 1);
    int row_lo[kMT][2], row_hi[kMT][2];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int64_t i = m0 + warp_row0 + mt * 16 + g + 8 * hf;
            row_lo[mt][hf] = static_cast<int>(geom.key_begin(i));
            row_hi[mt][hf] = static_cast<int>(geom.key_end(i));
        }

    float acc_o[kMT][kOT][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kOT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_o[mt][nt][e] = 0.f;
    OnlineSoftmax<kMT> softmax;
    // Score modifiers: logits in place of q·k (softmax scale 1; the sink joins in the epilogue).
    RowMods rmods;
    if constexpr (kMods) rmods = row_mods(p.mods, b, h, sq, sk);
    const float softmax_scale = kMods ? 1.f : p.scale, softmax_scale_log2 = kMods ? kLog2e : p.scale_log2;
    // Dropout: the call's seed and offset, the query head's index, where the random bytes go (tests only).
    [[maybe_unused]] DropKey drop_key_v{};
    [[maybe_unused]] uint8_t* randval = nullptr;
    if constexpr (kMods) {
        const Dropout& d = p.mods.dropout;
        if (d.on) {
            drop_key_v = drop_key(d);
            if (d.randval != nullptr)
                randval = d.randval + h * d.randval_head +
                          (Cfg::kGroupMode ? p.seqstart_q[b] * d.randval_row : b * d.randval_batch);
        }
    }
    uint32_t q_frag[kQInRegs ? kMT : 1][kQInRegs ? kKQ : 1][4];

    if (!visit.empty()) {
        load_tile<kBlockM, Cfg::kHdimQ / 8, kSQ, kThreads>(sQ, gQ, p.q_row_stride, rows_valid, q_chunks_load,
                                                           p.hdim_q, alQ, tid);
        const int n0 = visit.begin * kBlockN;
        load_tile<kBlockN, Cfg::kHdimQ / 8, kSQ, kThreads>(sK, gK + n0 * p.k_row_stride, p.k_row_stride,
                                                           min(kBlockN, sk - n0), q_chunks_load, p.hdim_q, alK,
                                                           tid);
        ptx::cp_async_commit();
    }

    // ldmatrix lane offsets (elements). A (Q) fragment: row lane%16, column 8*(lane/16).
    const int a_off = (warp_row0 + (lane & 15)) * kSQ + ((lane >> 4) << 3);
    // B (K) fragment pair: key (lane%8) + 8*(lane/16), column 8*((lane/8)%2).
    const int k_off = ((lane & 7) + ((lane >> 4) << 3)) * kSQ + (((lane >> 3) & 1) << 3);
    // B (V, transposed) fragment pair: key (lane%8) + 8*((lane/8)%2), column 8*(lane/16).
    const int v_off = ((lane & 7) + (((lane >> 3) & 1) << 3)) * kSV + ((lane >> 4) << 3);
    const uint32_t sQ_a = ptx::smem_addr(sQ + a_off);
    const uint32_t sK_b = ptx::smem_addr(sK + k_off);
    const uint32_t sV_b = ptx::smem_addr(sV + v_off);

    for (int n_block = visit.begin; n_block < visit.end; ++n_block) {
        const int n0 = n_block * kBlockN;
        ptx::cp_async_wait<0>();
        __syncthreads();  // K (and Q) landed; every warp is done with the previous V
        load_tile<kBlockN, Cfg::kHdimV / 8, kSV, kThreads>(sV, gV + n0 * p.v_row_stride, p.v_row_stride,
                                                           min(kBlockN, sk - n0), v_chunks_load, p.hdim_v, alV,
                                                           tid);
        ptx::cp_async_commit();

        if constexpr (kQInRegs) {
            if (n_block == visit.begin) {
#pragma unroll
                for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
                    for (int kk = 0; kk < kKQ; ++kk)
                        if (kk * 16 < p.hdim_q)
                            ptx::ldmatrix_x4(q_frag[mt][kk], sQ_a + (mt * 16 * kSQ + kk * 16) * 2);
            }
        }

        // ---- S = Q Kᵀ, masked on tiles that straddle the sequence end or a window edge ----
        float s[kMT][kNT][4];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;
        if (q_full)
            gemm_qk<Cfg, true>(s, q_frag, sQ_a, sK_b, p.hdim_q);
        else
            gemm_qk<Cfg, false>(s, q_frag, sQ_a, sK_b, p.hdim_q);
        if constexpr (kMods) apply_score_mods<Cfg::kDtype, kMT, kNT>(s, rmods, m0 + warp_row0, n0);
        if (!full.contains(n_block)) mask_s<Cfg>(s, row_lo, row_hi, n0);

        // ---- online softmax, P as A fragments ----
        softmax.update(s, acc_o, softmax_scale_log2);  // the row sums (and the LSE) are of the undropped softmax
        if constexpr (kMods) {
            if (p.mods.dropout.on) {
                uint2 rnd[kMT][kNT / 2];
                dropout_bytes<false>(rnd, drop_key_v, static_cast<uint32_t>(b * p.nhead_q + h), m0 + warp_row0, n0);
                if (randval != nullptr)
                    store_randval<kMT, kNT>(rnd, randval, p.mods.dropout.randval_row, m0 + warp_row0, n0, sq, sk);
                apply_dropout<kMT, kNT>(s, rnd, p.mods.dropout);
            }
        }
        uint32_t p_frag[kMT][kKV][4];
        pack_p<Cfg>(p_frag, s);

        ptx::cp_async_wait<0>();
        __syncthreads();  // V landed; every warp is done with K
        if (n_block + 1 < visit.end) {
            const int n1 = n0 + kBlockN;
            load_tile<kBlockN, Cfg::kHdimQ / 8, kSQ, kThreads>(sK, gK + n1 * p.k_row_stride, p.k_row_stride,
                                                               min(kBlockN, sk - n1), q_chunks_load, p.hdim_q,
                                                               alK, tid);
            ptx::cp_async_commit();
        }

        // ---- O += P V ----
        if (v_full)
            gemm_pv<Cfg, true>(acc_o, p_frag, sV_b, p.hdim_v);
        else
            gemm_pv<Cfg, false>(acc_o, p_frag, sV_b, p.hdim_v);
    }

    // ---- epilogue: normalise, LSE, stage O in shared memory (the Q tile), store ----
    if constexpr (kMods) {
        if (p.mods.dropout.on)  // the kept probabilities' 1 / (1 − p), once for all key tiles
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
                for (int nt = 0; nt < kOT; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc_o[mt][nt][e] *= p.mods.dropout.rp;
    }
    __syncthreads();  // every warp is done reading Q / K / V
    float* lse = p.lse != nullptr ? p.lse + si.lse_offset + h * p.lse_head_stride + m0 : nullptr;
    stage_o_and_lse<Cfg::kDtype, kMT, kOT, kSV>(sQ, acc_o, softmax, softmax_scale, warp_row0, p.hdim_v, lse, rows_valid,
                                                sink_logit(p.mods, h));
    __syncthreads();
    uint16_t* gO = static_cast<uint16_t*>(p.o) + si.o_offset + h * p.o_head_stride + m0 * p.o_row_stride;
    store_tile<kBlockM, Cfg::kHdimV / 8, kSV, kThreads>(sQ, gO, p.o_row_stride, rows_valid, p.hdim_v, alO, tid);
}

}  // namespace detail

// kMods: the modifier instance ("_mods"): serves exactly the calls with ScoreMods::per_element (the runtime's
// static guard), the plain instance every other call.
template <mhakit_dtype kDtype, int kHdimQ, int kHdimV, bool kGroupMode, bool kMasked, int kBlockM, int kBlockN,
          int kNumWarps, bool kMods>
struct FwdKernel {
    using Cfg = detail::FwdConfig<kDtype, kHdimQ, kHdimV, kGroupMode, kMasked, kBlockM, kBlockN, kNumWarps>;
    static constexpr int kSmemBytes = Cfg::kSmemBytes;
    static constexpr int kThreads = Cfg::kThreads;
    // 99 KB is the smallest opt-in shared-memory limit per block of the sm_80+ parts (sm_86, sm_89, sm_120), so a
    // tile that fits it runs everywhere the family is built, and supports() need not ask the device.
    static_assert(kSmemBytes <= 101376, "generic tile needs more shared memory than sm_86/sm_89/sm_120 offer");

    // Run-time guard beyond what the runtime checked (the validator, the instance's traits: dtype, mode, mask class,
    // head-dim bucket): the grid fits. Pure host arithmetic: no CUDA call.
    static bool supports(const FwdParams& p) { return p.nhead_q <= 65535 && p.batch <= 65535; }

    // Launches on `stream`; never synchronises or allocates. Returns cudaGetLastError() after the launch
    // (cudaSuccess without a launch when there is nothing to compute).
    static cudaError_t run(const FwdParams& p, cudaStream_t stream) {
        const int max_sq = kGroupMode ? p.max_seqlen_q : p.seqlen_q;
        if (max_sq <= 0 || p.nhead_q <= 0 || p.batch <= 0) return cudaSuccess;
        auto kernel = detail::fwd_kernel<Cfg, kMods>;
        static std::atomic<uint64_t> smem_opted_in{0};
        if (cudaError_t err = opt_in_dynamic_smem(kernel, kSmemBytes, smem_opted_in); err != cudaSuccess) return err;
        int flags = 0;
        if (detail::aligned16(p.q, p.q_row_stride, p.q_head_stride, kGroupMode ? 0 : p.q_batch_stride))
            flags |= detail::kAlignQ;
        if (detail::aligned16(p.k, p.k_row_stride, p.k_head_stride, kGroupMode ? 0 : p.k_batch_stride))
            flags |= detail::kAlignK;
        if (detail::aligned16(p.v, p.v_row_stride, p.v_head_stride, kGroupMode ? 0 : p.v_batch_stride))
            flags |= detail::kAlignV;
        if (detail::aligned16(p.o, p.o_row_stride, p.o_head_stride, kGroupMode ? 0 : p.o_batch_stride))
            flags |= detail::kAlignO;
        const dim3 grid = detail::FwdScheduler<Cfg>::grid((max_sq + kBlockM - 1) / kBlockM, p.nhead_q, p.batch);
        kernel<<<grid, kThreads, kSmemBytes, stream>>>(p, flags);
        return cudaGetLastError();
    }
};

}  // namespace mhakit::generic
