// mhakit generic family, backward pass: pieces shared by the stages of fmha_bwd_generic.cuh.
//
//   - BwdSeq / bwd_seq():    per-sequence lengths and element offsets of the nine tensors (batch or group mode),
//                            computed the way seq_info() in fwd_params.h does it for the forward's four;
//   - BwdWorkspace:          the carve-up of the caller's scratch memory (host arithmetic, no CUDA call);
//   - warp-level GEMMs:      mma.sync m16n8k16 on fragments loaded by ldmatrix from shared-memory tiles stored either
//                            way round (so one routine serves S^T = K Q^T, dV += P^T dO, dQ = dS K, ...);
//   - small kernels:         D = rowsum(dO o O) (+ LSE in log2 units, + zeroing the fp32 dQ accumulator and dbias),
//                            dQ accumulator -> dQ (scale, dtype, strides), and the fixed-order sum of per-split fp32
//                            dK/dV partials for GQA/MQA, d sink per query head.
// The PTX wrappers (ldmatrix, mma, cp.async) come from generic_ptx.cuh, the tile I/O from generic_tile_io.cuh.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "../../include/mha_common.h"
#include "../common/bwd_params.h"
#include "../common/mask.h"
#include "../common/mask_geometry.h"
#include "generic_ptx.cuh"
#include "generic_score_mod.cuh"
#include "generic_tile_io.cuh"

namespace mhakit::generic::bwd_detail {

using generic::detail::aligned16;
#if defined(__CUDACC__)
using generic::detail::cp_async_4;
using generic::detail::kLog2e;
using generic::detail::logit_at;
using generic::detail::with_mods;
using generic::detail::to_float;
using generic::detail::load8;
using generic::detail::load_tile;
using generic::detail::store8;
using generic::detail::store_tile;
#endif

// ------------------------------------------------------------------------------------------------------------------
// Sequences and workspace
// ------------------------------------------------------------------------------------------------------------------

struct BwdSeq {
    int seqlen_q, seqlen_k;
    int64_t row_q0, row_k0;  // first row of this sequence in the workspace arrays (b*s in batch mode, seqstart in group)
    int64_t q, k, v, o, dout, dq, dk, dv;  // element offsets of (this sequence, head 0, row 0)
    int64_t lse;
};

#if defined(__CUDACC__)
__device__ __forceinline__ BwdSeq bwd_seq(const BwdParams& p, int b) {
    BwdSeq s;
    if (p.seqstart_q != nullptr) {
        const int q0 = p.seqstart_q[b], k0 = p.seqstart_k[b];
        s.seqlen_q = p.seqstart_q[b + 1] - q0;
        s.seqlen_k = p.seqstart_k[b + 1] - k0;
        s.row_q0 = q0;
        s.row_k0 = k0;
        s.q = q0 * p.q_row_stride;
        s.k = k0 * p.k_row_stride;
        s.v = k0 * p.v_row_stride;
        s.o = q0 * p.o_row_stride;
        s.dout = q0 * p.do_row_stride;
        s.dq = q0 * p.dq_row_stride;
        s.dk = k0 * p.dk_row_stride;
        s.dv = k0 * p.dv_row_stride;
        s.lse = q0;
    } else {
        s.seqlen_q = p.seqlen_q;
        s.seqlen_k = p.seqlen_k;
        s.row_q0 = static_cast<int64_t>(b) * p.seqlen_q;
        s.row_k0 = static_cast<int64_t>(b) * p.seqlen_k;
        s.q = b * p.q_batch_stride;
        s.k = b * p.k_batch_stride;
        s.v = b * p.v_batch_stride;
        s.o = b * p.o_batch_stride;
        s.dout = b * p.do_batch_stride;
        s.dq = b * p.dq_batch_stride;
        s.dk = b * p.dk_batch_stride;
        s.dv = b * p.dv_batch_stride;
        s.lse = b * p.lse_batch_stride;
    }
    return s;
}
#endif

// Pointers into the workspace, passed to every kernel by value. Arrays indexed by "row" use the workspace row of a
// query (row_q0 + i) or key (row_k0 + j); rows_q / rows_k bound them (batch * max_seqlen).
struct BwdWs {
    float* dsum;  // [nhead_q][rows_q]            D = rowsum(dO o O)
    float* lse2;  // [nhead_q][rows_q]            LSE * log2(e); +inf for rows that saw no key (P = 0 there)
    float* dq;    // [nhead_q][rows_q][ld_q]      fp32 dQ accumulator (atomic mode only), unscaled; else nullptr
    float* pk;    // [n_splits][nhead_k][rows_k][ld_q]  fp32 dK partials (n_splits > 1 only), scaled
    float* pv;    // [n_splits][nhead_k][rows_k][ld_v]  fp32 dV partials (n_splits > 1 only)
    int64_t rows_q, rows_k;
    int ld_q, ld_v;       // row lengths of those fp32 arrays: ws_cols(hdim_q), ws_cols(hdim_v)
    int n_splits;         // CTAs that share one (key block, kv head): the query heads of a group are split among them
    int heads_per_split;  // query heads summed by one CTA
    int block_m, block_n; // the main kernel's tiles (its query tiles, key blocks): bwd_dot_kernel zeroes the dbias
                          // elements of the (query tile, key block) pairs it does not visit
};

// The main kernel runs one CTA per (key block, kv head, head split, sequence). With GQA/MQA the query heads of a group
// are split among n_splits CTAs only as far as needed to fill the GPU (about two CTAs per SM of a 132-SM part); the
// split count depends on the problem only, so workspace_bytes() and run() agree without asking the device.
constexpr int kTargetCtas = 264;

struct WsPlan {
    size_t off_dsum, off_lse2, off_dq, off_pk, off_pv, total;
    int64_t rows_q, rows_k;
    int n_splits, heads_per_split;
};

inline size_t round_up_256(size_t x) { return (x + 255) & ~size_t(255); }

// Row length (floats) of an fp32 workspace array over a head dim: rounded up to whole 8-column chunks, so that the
// row kernels read whole 32-byte chunks and the main kernel's column pairs (float2, red.v2) stay inside the row and
// 8-byte aligned for every head dim, odd ones included. Columns past the head dim are never copied out.
inline int ws_cols(int hdim) { return hdim > 0 ? (hdim + 7) & ~7 : 0; }

// atomic_dq: dQ accumulated by fp32 reductions in the workspace (else computed by the separate dQ pass).
inline WsPlan plan_workspace(const BwdParams& p, int block_n, bool group_mode, bool atomic_dq) {
    WsPlan w{};
    const int64_t max_sq = group_mode ? p.max_seqlen_q : p.seqlen_q;
    const int64_t max_sk = group_mode ? p.max_seqlen_k : p.seqlen_k;
    const int64_t batch = p.batch > 0 ? p.batch : 0;
    w.rows_q = batch * (max_sq > 0 ? max_sq : 0);
    w.rows_k = batch * (max_sk > 0 ? max_sk : 0);
    const int64_t hq = p.nhead_q > 0 ? p.nhead_q : 0;
    const int64_t hk = p.nhead_k > 0 ? p.nhead_k : 1;
    const int group = (p.nhead_k > 0 && p.nhead_q >= p.nhead_k) ? p.nhead_q / p.nhead_k : 1;
    int n_splits = 1;
    if (group > 1 && max_sk > 0 && batch > 0) {
        const int64_t base = ((max_sk + block_n - 1) / block_n) * hk * batch;
        int64_t want = (kTargetCtas + base - 1) / base;
        if (want > group) want = group;
        if (want < 1) want = 1;
        n_splits = static_cast<int>(want);
    }
    w.heads_per_split = (group + n_splits - 1) / n_splits;
    w.n_splits = (group + w.heads_per_split - 1) / w.heads_per_split;  // no empty split
    size_t off = 0;
    const size_t vec_q = static_cast<size_t>(hq * w.rows_q) * sizeof(float);
    w.off_dsum = off;
    off = round_up_256(off + vec_q);
    w.off_lse2 = off;
    off = round_up_256(off + vec_q);
    w.off_dq = off;
    if (atomic_dq) off = round_up_256(off + vec_q * static_cast<size_t>(ws_cols(p.hdim_q)));
    w.off_pk = off;
    if (w.n_splits > 1) {
        const size_t part = static_cast<size_t>(w.n_splits) * static_cast<size_t>(hk * w.rows_k) * sizeof(float);
        off = round_up_256(off + part * static_cast<size_t>(ws_cols(p.hdim_q)));
        w.off_pv = off;
        off = round_up_256(off + part * static_cast<size_t>(ws_cols(p.hdim_v)));
    } else {
        w.off_pv = off;
    }
    w.total = off;
    return w;
}

inline BwdWs make_ws(const BwdParams& p, const WsPlan& w, bool atomic_dq, int block_m, int block_n) {
    BwdWs ws{};
    char* base = static_cast<char*>(p.workspace);
    const bool any = base != nullptr && w.total > 0;
    ws.dsum = any ? reinterpret_cast<float*>(base + w.off_dsum) : nullptr;
    ws.lse2 = any ? reinterpret_cast<float*>(base + w.off_lse2) : nullptr;
    ws.dq = (any && atomic_dq) ? reinterpret_cast<float*>(base + w.off_dq) : nullptr;
    ws.pk = (any && w.n_splits > 1) ? reinterpret_cast<float*>(base + w.off_pk) : nullptr;
    ws.pv = (any && w.n_splits > 1) ? reinterpret_cast<float*>(base + w.off_pv) : nullptr;
    ws.rows_q = w.rows_q;
    ws.rows_k = w.rows_k;
    ws.ld_q = ws_cols(p.hdim_q);
    ws.ld_v = ws_cols(p.hdim_v);
    ws.n_splits = w.n_splits;
    ws.heads_per_split = w.heads_per_split;
    ws.block_m = block_m;
    ws.block_n = block_n;
    return ws;
}

// Alignment flags: bit set when every base pointer / stride of the tensor allows 16-byte vector access.
enum : int {
    kAlQ = 1,
    kAlK = 2,
    kAlV = 4,
    kAlO = 8,
    kAlDO = 16,
    kAlDQ = 32,
    kAlDK = 64,
    kAlDV = 128,
};

inline int alignment_flags(const BwdParams& p, bool group_mode) {
    auto bs = [&](int64_t s) { return group_mode ? int64_t(0) : s; };
    int f = 0;
    if (aligned16(p.q, p.q_row_stride, p.q_head_stride, bs(p.q_batch_stride))) f |= kAlQ;
    if (aligned16(p.k, p.k_row_stride, p.k_head_stride, bs(p.k_batch_stride))) f |= kAlK;
    if (aligned16(p.v, p.v_row_stride, p.v_head_stride, bs(p.v_batch_stride))) f |= kAlV;
    if (aligned16(p.o, p.o_row_stride, p.o_head_stride, bs(p.o_batch_stride))) f |= kAlO;
    if (aligned16(p.dout, p.do_row_stride, p.do_head_stride, bs(p.do_batch_stride))) f |= kAlDO;
    if (aligned16(p.dq, p.dq_row_stride, p.dq_head_stride, bs(p.dq_batch_stride))) f |= kAlDQ;
    if (aligned16(p.dk, p.dk_row_stride, p.dk_head_stride, bs(p.dk_batch_stride))) f |= kAlDK;
    if (aligned16(p.dv, p.dv_row_stride, p.dv_head_stride, bs(p.dv_batch_stride))) f |= kAlDV;
    return f;
}

#if defined(__CUDACC__)

// ------------------------------------------------------------------------------------------------------------------
// Reductions
// ------------------------------------------------------------------------------------------------------------------

// dst[0..1] += (a, b) in global memory, fp32, relaxed (sm_90: one vector reduction).
__device__ __forceinline__ void red_add2(float* dst, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(dst), "f"(a), "f"(b) : "memory");
#else
    atomicAdd(dst, a);
    atomicAdd(dst + 1, b);
#endif
}

// ------------------------------------------------------------------------------------------------------------------
// Warp-level GEMMs. acc[MT][NT][4] (+)= A (MT*16 x K) * B (K x NT*8), K = 16 * kKS, fp32 accumulators laid out as
// mma.sync m16n8k16's D fragments (row g / g+8, columns 2*t4, 2*t4+1 of each 8-column tile).
//   A stored [m][k] (kATrans = false) or [k][m] (kATrans = true) in shared memory, row stride kAS elements;
//   B stored [n][k] (kBTrans = false) or [k][n] (kBTrans = true), row stride kBS elements.
// a_tile / b_tile point at element (0, 0) of this warp's A / B sub-tiles. Steps kk >= ks_valid and column pairs
// np >= np_valid (16 columns each) are skipped.
// ------------------------------------------------------------------------------------------------------------------

// Row addresses of an ldmatrix.x4 whose four matrices are (rows 0-7, cols 0-7), (rows 8-15, cols 0-7),
// (rows 0-7, cols 8-15), (rows 8-15, cols 8-15) of a 16x16 block ("row pattern"), or (rows 0-7, cols 0-7),
// (rows 0-7, cols 8-15), (rows 8-15, cols 0-7), (rows 8-15, cols 8-15) ("column pattern").
template <int kStride>
__device__ __forceinline__ int lane_off_rowpat(int lane) {
    return (lane & 15) * kStride + ((lane >> 4) << 3);
}
template <int kStride>
__device__ __forceinline__ int lane_off_colpat(int lane) {
    return ((lane & 7) + ((lane >> 4) << 3)) * kStride + (((lane >> 3) & 1) << 3);
}

// A fragment (16 x 16) of storage [m][k]: row pattern, no transpose. Of storage [k][m]: column pattern, transposed.
// B fragment pair (16 k x 16 n) of storage [n][k]: column pattern, no transpose (regs 0,1 = n-tile 0; 2,3 = n-tile 1).
// Of storage [k][n]: row pattern, transposed.
template <mhakit_dtype kDtype, int kMT, int kNT, int kKS, bool kATrans, bool kBTrans, int kAS, int kBS>
__device__ __forceinline__ void gemm_ss(float (&acc)[kMT][kNT][4], const uint16_t* a_tile, const uint16_t* b_tile,
                                        int ks_valid, int np_valid) {
    static_assert(kNT % 2 == 0, "B is loaded 16 columns at a time");
    using Mma = ptx::Mma<kDtype>;
    constexpr int kNP = kNT / 2;
    const int lane = threadIdx.x & 31;
    const uint32_t a0 =
        ptx::smem_addr(a_tile + (kATrans ? lane_off_colpat<kAS>(lane) : lane_off_rowpat<kAS>(lane)));
    const uint32_t b0 =
        ptx::smem_addr(b_tile + (kBTrans ? lane_off_rowpat<kBS>(lane) : lane_off_colpat<kBS>(lane)));
    auto load_b = [&](uint32_t(&r)[4], int np, int kk) {
        const uint32_t addr = b0 + 2u * static_cast<uint32_t>(kBTrans ? (kk * 16 * kBS + np * 16)
                                                                      : (np * 16 * kBS + kk * 16));
        if (kBTrans)
            ptx::ldmatrix_x4_trans(r, addr);
        else
            ptx::ldmatrix_x4(r, addr);
    };
#pragma unroll
    for (int kk = 0; kk < kKS; ++kk) {
        if (kk >= ks_valid) break;
        uint32_t a[kMT][4];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
            const uint32_t addr = a0 + 2u * static_cast<uint32_t>(kATrans ? (kk * 16 * kAS + mt * 16)
                                                                          : (mt * 16 * kAS + kk * 16));
            if (kATrans)
                ptx::ldmatrix_x4_trans(a[mt], addr);
            else
                ptx::ldmatrix_x4(a[mt], addr);
        }
        uint32_t b[2][4];
        load_b(b[0], 0, kk);
#pragma unroll
        for (int np = 0; np < kNP; ++np) {
            if (np >= np_valid) break;
            if (np + 1 < kNP && np + 1 < np_valid) load_b(b[(np + 1) & 1], np + 1, kk);
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt) {
                Mma::mma(acc[mt][2 * np], a[mt], b[np & 1][0], b[np & 1][1]);
                Mma::mma(acc[mt][2 * np + 1], a[mt], b[np & 1][2], b[np & 1][3]);
            }
        }
    }
}

// Same with A already in registers as m16n8k16 A fragments: a[mt][kk] covers rows mt*16.., k columns kk*16...
template <mhakit_dtype kDtype, int kMT, int kNT, int kKS, bool kBTrans, int kBS>
__device__ __forceinline__ void gemm_rs(float (&acc)[kMT][kNT][4], const uint32_t (&a)[kMT][kKS][4],
                                        const uint16_t* b_tile, int np_valid) {
    static_assert(kNT % 2 == 0, "B is loaded 16 columns at a time");
    using Mma = ptx::Mma<kDtype>;
    constexpr int kNP = kNT / 2;
    const int lane = threadIdx.x & 31;
    const uint32_t b0 =
        ptx::smem_addr(b_tile + (kBTrans ? lane_off_rowpat<kBS>(lane) : lane_off_colpat<kBS>(lane)));
    auto load_b = [&](uint32_t(&r)[4], int np, int kk) {
        const uint32_t addr = b0 + 2u * static_cast<uint32_t>(kBTrans ? (kk * 16 * kBS + np * 16)
                                                                      : (np * 16 * kBS + kk * 16));
        if (kBTrans)
            ptx::ldmatrix_x4_trans(r, addr);
        else
            ptx::ldmatrix_x4(r, addr);
    };
    // Steps run k-major, each loading the B fragment of the next step before issuing its own mma.
    uint32_t b[2][4];
    load_b(b[0], 0, 0);
#pragma unroll
    for (int kk = 0; kk < kKS; ++kk) {
#pragma unroll
        for (int np = 0; np < kNP; ++np) {
            const int st = kk * kNP + np;
            const int kk1 = (np + 1 < kNP) ? kk : kk + 1, np1 = (np + 1 < kNP) ? np + 1 : 0;
            if (kk1 < kKS && np1 < np_valid) load_b(b[(st + 1) & 1], np1, kk1);
            if (np < np_valid) {
#pragma unroll
                for (int mt = 0; mt < kMT; ++mt) {
                    Mma::mma(acc[mt][2 * np], a[mt][kk], b[st & 1][0], b[st & 1][1]);
                    Mma::mma(acc[mt][2 * np + 1], a[mt][kk], b[st & 1][2], b[st & 1][3]);
                }
            }
        }
    }
}

template <int kMT, int kNT>
__device__ __forceinline__ void zero_acc(float (&acc)[kMT][kNT][4]) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;
}

// D fragments (16 x 8 tiles, fp32) -> A fragments (16 x 16, packed 16-bit) of the same rows.
template <mhakit_dtype kDtype, int kMT, int kNT>
__device__ __forceinline__ void acc_to_a(uint32_t (&a)[kMT][kNT / 2][4], const float (&acc)[kMT][kNT][4]) {
    using Mma = ptx::Mma<kDtype>;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int kk = 0; kk < kNT / 2; ++kk) {
            a[mt][kk][0] = Mma::pack(acc[mt][2 * kk][0], acc[mt][2 * kk][1]);
            a[mt][kk][1] = Mma::pack(acc[mt][2 * kk][2], acc[mt][2 * kk][3]);
            a[mt][kk][2] = Mma::pack(acc[mt][2 * kk + 1][0], acc[mt][2 * kk + 1][1]);
            a[mt][kk][3] = Mma::pack(acc[mt][2 * kk + 1][2], acc[mt][2 * kk + 1][3]);
        }
}

// D fragments -> shared memory [row][col] (16-bit, row stride kStride), optionally scaled; rows offset row0, columns
// offset col0 for this warp.
template <mhakit_dtype kDtype, int kMT, int kNT, int kStride>
__device__ __forceinline__ void acc_to_smem(uint16_t* smem, const float (&acc)[kMT][kNT][4], int row0, int col0,
                                            float mul) {
    using Mma = ptx::Mma<kDtype>;
    const int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int r = row0 + mt * 16 + g + 8 * hf, c = col0 + nt * 8 + 2 * t4;
                ptx::st_shared_b32(ptx::smem_addr(smem + r * kStride + c),
                                   Mma::pack(acc[mt][nt][2 * hf] * mul, acc[mt][nt][2 * hf + 1] * mul));
            }
}

// ------------------------------------------------------------------------------------------------------------------
// Score-modifier gradients: dbias elements (the bias's element type) and d sink
// ------------------------------------------------------------------------------------------------------------------

// Element (b, h, 0, 0) of dbias, in bytes.
__device__ __forceinline__ char* dbias_block(const BwdParams& p, int b, int h) {
    const int64_t elem = p.mods.bias_fp32 ? 4 : 2;
    return static_cast<char*>(p.dbias) +
           (static_cast<int64_t>(b) * p.dbias_batch_stride + static_cast<int64_t>(h) * p.dbias_head_stride) * elem;
}

template <mhakit_dtype kDtype>
__device__ __forceinline__ void store_dbias(const BwdParams& p, char* block, int i, int j, float v) {
    if (p.mods.bias_fp32) {
        reinterpret_cast<float*>(block + static_cast<int64_t>(i) * p.dbias_row_stride * 4)[j] = v;
    } else {
        reinterpret_cast<uint16_t*>(block + static_cast<int64_t>(i) * p.dbias_row_stride * 2)[j] =
            static_cast<uint16_t>(ptx::Mma<kDtype>::pack(v, 0.f) & 0xffffu);
    }
}

// Stage 4: d sink[h] = -sum over the rows of every sequence of exp(sink - LSE) * D, one CTA per query head, in a
// fixed order (deterministic). Rows without keys have LSE2 = +inf and add 0.
constexpr int kDsinkThreads = 256;

template <mhakit_dtype kDtype>
__global__ void __launch_bounds__(kDsinkThreads) bwd_dsink_kernel(const BwdParams p, const BwdWs ws) {
    const int h = blockIdx.x;
    const float sink2 = p.mods.sink[h] * 1.4426950408889634f;
    float acc = 0.f;
    for (int b = 0; b < p.batch; ++b) {
        const BwdSeq si = bwd_seq(p, b);
        const int64_t row0 = static_cast<int64_t>(h) * ws.rows_q + si.row_q0;
        for (int i = threadIdx.x; i < si.seqlen_q; i += kDsinkThreads)
            acc -= ptx::ex2(sink2 - ws.lse2[row0 + i]) * ws.dsum[row0 + i];
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    __shared__ float part[kDsinkThreads / 32];
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        float total = 0.f;
        for (int w = 0; w < kDsinkThreads / 32; ++w) total += part[w];
        p.dsink[h] = total;
    }
}

// Row i of head h's dbias block: zeros on the keys of every key block whose query tiles leave row i's tile out
// (MaskGeometry::key_block_query_tiles, the main kernel's rule); the main kernel writes the others, every element of
// them inside the sequence (masked ones as 0). One warp: its lanes test 32 key blocks at a time, then zero each
// unvisited block's keys together.
template <mhakit_dtype kDtype>
__device__ __forceinline__ void zero_unvisited_dbias(const BwdParams& p, const BwdWs& ws, const BwdSeq& si, int b,
                                                     int h, int i, int lane) {
    const int sk = si.seqlen_k;
    const auto geom = MaskGeometry<true>::make(p.mask_type, p.window_left, p.window_right, si.seqlen_q, sk);
    const int m = i / ws.block_m, blocks = (sk + ws.block_n - 1) / ws.block_n;
    char* block = dbias_block(p, b, h);
    for (int c = 0; c < blocks; c += 32) {
        const int n = c + lane;
        unsigned zero = __ballot_sync(0xffffffffu,
                                      n < blocks && !geom.key_block_query_tiles(n, ws.block_m, ws.block_n).contains(m));
        while (zero != 0u) {
            const int n0 = (c + __ffs(zero) - 1) * ws.block_n;
            zero &= zero - 1u;
            const int n1 = min(n0 + ws.block_n, sk);
            for (int j = n0 + lane; j < n1; j += 32) store_dbias<kDtype>(p, block, i, j, 0.f);
        }
    }
}

// ------------------------------------------------------------------------------------------------------------------
// Stage 1: D = rowsum(dO o O), LSE in log2 units, zeroed dQ accumulator. One warp per (query row, head).
// ------------------------------------------------------------------------------------------------------------------
constexpr int kRowKernelWarps = 8;

template <mhakit_dtype kDtype>
__global__ void __launch_bounds__(kRowKernelWarps * 32) bwd_dot_kernel(const BwdParams p, const BwdWs ws, const int flags) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int i = blockIdx.x * kRowKernelWarps + warp, h = blockIdx.y, b = blockIdx.z;
    const BwdSeq si = bwd_seq(p, b);
    if (i >= si.seqlen_q) return;
    const uint16_t* o = static_cast<const uint16_t*>(p.o) + si.o + h * p.o_head_stride + i * p.o_row_stride;
    const uint16_t* dout =
        static_cast<const uint16_t*>(p.dout) + si.dout + h * p.do_head_stride + i * p.do_row_stride;
    const bool al_o = flags & kAlO, al_do = flags & kAlDO;
    float acc = 0.f;
    for (int c = lane; c < ((p.hdim_v + 7) >> 3); c += 32) {
        const int rem = p.hdim_v - c * 8;  // the last chunk may be partial: zeros past the head dim
        const uint4 a = load8(o + c * 8, rem, al_o), d = load8(dout + c * 8, rem, al_do);
        const uint32_t wa[4] = {a.x, a.y, a.z, a.w}, wd[4] = {d.x, d.y, d.z, d.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            acc = fmaf(to_float<kDtype>(static_cast<uint16_t>(wa[e] & 0xffffu)),
                       to_float<kDtype>(static_cast<uint16_t>(wd[e] & 0xffffu)), acc);
            acc = fmaf(to_float<kDtype>(static_cast<uint16_t>(wa[e] >> 16)),
                       to_float<kDtype>(static_cast<uint16_t>(wd[e] >> 16)), acc);
        }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    const int64_t row = static_cast<int64_t>(h) * ws.rows_q + si.row_q0 + i;
    if (lane == 0) {
        ws.dsum[row] = acc;
        const float lse = p.lse[si.lse + h * p.lse_head_stride + i];
        // A row that saw no key (LSE = -inf) must give P = 0 everywhere: exp2(s - (+inf)) = 0.
        ws.lse2[row] = (lse == -INFINITY) ? INFINITY : lse * 1.4426950408889634f;
    }
    if (ws.dq != nullptr) {
        float4* z = reinterpret_cast<float4*>(ws.dq + row * ws.ld_q);
        for (int c = lane; c < (ws.ld_q >> 2); c += 32) z[c] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    if (p.dbias != nullptr) zero_unvisited_dbias<kDtype>(p, ws, si, b, h, i, lane);
}

// ------------------------------------------------------------------------------------------------------------------
// Stage 3a: dQ = scale * accumulator, in the element type, with dQ's strides. One warp per (query row, head).
// ------------------------------------------------------------------------------------------------------------------
template <mhakit_dtype kDtype>
__global__ void __launch_bounds__(kRowKernelWarps * 32) bwd_dq_convert_kernel(const BwdParams p, const BwdWs ws,
                                                                            const int flags) {
    using Mma = ptx::Mma<kDtype>;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int i = blockIdx.x * kRowKernelWarps + warp, h = blockIdx.y, b = blockIdx.z;
    const BwdSeq si = bwd_seq(p, b);
    if (i >= si.seqlen_q) return;
    const float* src = ws.dq + (static_cast<int64_t>(h) * ws.rows_q + si.row_q0 + i) * ws.ld_q;
    uint16_t* dst = static_cast<uint16_t*>(p.dq) + si.dq + h * p.dq_head_stride + i * p.dq_row_stride;
    const bool al = flags & kAlDQ;
    const float scale = p.scale;
    for (int c = lane; c < (ws.ld_q >> 3); c += 32) {
        const float4 a = reinterpret_cast<const float4*>(src)[2 * c];
        const float4 bq = reinterpret_cast<const float4*>(src)[2 * c + 1];
        const uint4 v = make_uint4(Mma::pack(a.x * scale, a.y * scale), Mma::pack(a.z * scale, a.w * scale),
                                   Mma::pack(bq.x * scale, bq.y * scale), Mma::pack(bq.z * scale, bq.w * scale));
        store8(dst + c * 8, v, p.hdim_q - c * 8, al);
    }
}

// ------------------------------------------------------------------------------------------------------------------
// Stage 3b: dK / dV of each kv head = sum over the head splits of the fp32 partials, in split order (deterministic).
// One warp per (key row, kv head).
// ------------------------------------------------------------------------------------------------------------------
template <mhakit_dtype kDtype>
__global__ void __launch_bounds__(kRowKernelWarps * 32) bwd_dkv_reduce_kernel(const BwdParams p, const BwdWs ws,
                                                                            const int flags) {
    using Mma = ptx::Mma<kDtype>;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int j = blockIdx.x * kRowKernelWarps + warp, hk = blockIdx.y, b = blockIdx.z;
    const BwdSeq si = bwd_seq(p, b);
    if (j >= si.seqlen_k) return;
    const int64_t split_stride = static_cast<int64_t>(p.nhead_k) * ws.rows_k;
    const int64_t row = static_cast<int64_t>(hk) * ws.rows_k + si.row_k0 + j;
#pragma unroll
    for (int which = 0; which < 2; ++which) {
        const int hd = which == 0 ? p.hdim_q : p.hdim_v, ld = which == 0 ? ws.ld_q : ws.ld_v;
        const float* part = which == 0 ? ws.pk : ws.pv;
        uint16_t* dst = which == 0
                            ? static_cast<uint16_t*>(p.dk) + si.dk + hk * p.dk_head_stride + j * p.dk_row_stride
                            : static_cast<uint16_t*>(p.dv) + si.dv + hk * p.dv_head_stride + j * p.dv_row_stride;
        const bool al = flags & (which == 0 ? kAlDK : kAlDV);
        for (int c = lane; c < (ld >> 3); c += 32) {
            float s[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            for (int sp = 0; sp < ws.n_splits; ++sp) {
                const float4* src = reinterpret_cast<const float4*>(part + (sp * split_stride + row) * ld + c * 8);
                const float4 x = src[0], y = src[1];
                s[0] += x.x, s[1] += x.y, s[2] += x.z, s[3] += x.w;
                s[4] += y.x, s[5] += y.y, s[6] += y.z, s[7] += y.w;
            }
            store8(dst + c * 8,
                   make_uint4(Mma::pack(s[0], s[1]), Mma::pack(s[2], s[3]), Mma::pack(s[4], s[5]),
                              Mma::pack(s[6], s[7])),
                   hd - c * 8, al);
        }
    }
}

#endif  // __CUDACC__

}  // namespace mhakit::generic::bwd_detail
