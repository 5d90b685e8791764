// mhakit decode_tma family, wgmma consumers (sm_90a): the split-KV forward for calls with many packed rows per kv
// head (s_q x heads per kv head; the catalogue's min_rows on the tile says from how many the runtime takes it).
//
// Why: at s_q = 16 with GQA 32/8 or 64/8 a kv head's tile holds 64 or 128 packed rows, and streaming K + V at
// 3.5 TB/s then needs 225-450 TFLOP/s of tensor math next to the softmax: more than mma.sync sustains (issue 10).
// Hopper's warpgroup MMA (wgmma: 64 rows per warpgroup, B from shared memory, asynchronous) does it.
//
// What is shared with the mma.sync kernel (fmha_fwd_splitkv_tma.cuh): the producer warp and its TMA ring
// (produce_blocks: K and V blocks as 64-column boxes with the 128-byte swizzle, the cache-end block by cp.async, the
// paging, L2 promotion), the work decomposition (splitkv_work, split_keys: packed rows, key split), the mask pieces
// (row_bounds, mask_s), the online softmax, P's packing, the epilogue (finish_tile: stage_own_rows, write_result: O /
// LSE or the fp32 partials), the append and combine kernels, the run-time guard and the split heuristic (over this
// kernel's shared memory and row chunks).
//
// The consumers: kWarpgroups warpgroups, warpgroup g owns packed rows [64 g, 64 g + 64) of the CTA's chunk of
// 64 kWarpgroups rows, each warp 16 of them (warp w: rows [16 w, 16 w + 16), as the row split of the mma.sync kernel,
// whose warp-level pieces therefore apply unchanged: a wgmma accumulator's 16 rows per warp are laid out as mma.sync
// m16n8's D fragments, n8 tile j in registers 4 j .. 4 j + 3). Each K / V byte is read once per CTA, whatever the
// number of warpgroups: two warpgroups in one CTA (128 rows, GQA 64/8 x s_q 16) instead of a row split into two CTAs
// that would each stream the kv head's cache.
// Per key block of kBlockN = 64 keys (one ring slot):
//   S = Q·Kᵀ   wgmma m64n64k16, A = Q from registers (loaded once from global memory as A fragments), B = K from the
//              slot: keys x head dim, 128-byte rows, i.e. GMMA's K-major SW128 layout (8-row groups 1024 bytes apart;
//              k step kk at byte 32 (kk % 4) of box kk / 4). Every k step of the bucket runs (no run-time trip
//              count: a wgmma under a branch made ptxas inject warpgroup.arrive around each), so every column past
//              the head dim must hold zeros: Q's fragments are zero there, TMA zero-fills a box's columns past the
//              head dim, and the boxes TMA never loads (a bucket one box wider than the head dim) are zeroed in
//              every slot once at the kernel's start (no load writes them later; the cp.async tail writes zeros);
//   mask (causal / window / cache end per packed row, as the mma.sync kernel), online softmax, P to 16-bit A
//   fragments in registers;
//   O += P·V   wgmma m64n{d_v}k16, A = P from registers, B = V from the slot: keys x head dim is MN-major for this
//              product (N = head dim contiguous), SW128: 64-column boxes kBoxBytes apart (LBO), 8-key groups 1024
//              bytes apart (SBO), k step kk 16 rows = 2048 bytes further; wgmma's transpose bit takes it as is.
//   wgmma.wait_group 0, then each warp releases the slot (one arrival per consumer warp on its empty barrier).
// Two loops over the blocks (the tile's `overlap`): one block at a time as above, or software-pipelined: S of block i
// and P(i - 1)·V issued together, block i's softmax while the latter runs, O rescaled once it is complete, slot i - 1
// released then (held until block i has arrived: one slot fewer in flight, for math that overlaps).
// Q from registers rather than a swizzled shared tile: Q is read once per CTA either way, and the 16 KB (32 KB) a
// shared Q tile would take is a third ring slot at two CTAs per SM. The cache-end block, written by the producer's
// lanes with cp.async (generic proxy), is fenced into the async proxy before its slot is signalled full
// (produce_blocks<..., kAsyncReaders = true>).
#pragma once

#include <utility>

#include "cute/arch/mma_sm90_gmma.hpp"
#include "fmha_fwd_splitkv_tma.cuh"

namespace mhakit::decode {

namespace wgmma_detail {

using namespace tma_detail;
namespace GMMA = cute::SM90::GMMA;

template <mhakit_dtype kDtype_, int kHdimQ_, int kHdimV_, int kWarpgroups_, int kBlockN_, int kStages_,
          int kCtasPerSm_, bool kOverlap_>
struct WgmmaConfig {
    // The consumer loop: software-pipelined (S of block i and P·V of block i - 1 in flight together, the softmax
    // beside the latter; slot i - 1 is held until block i has arrived) or one block at a time (each slot released as
    // soon as its P·V is done): the catalogue tile's `overlap`.
    static constexpr bool kOverlap = kOverlap_;
    static_assert(!(kOverlap && kWarpgroups_ == 2),
                  "the pipelined loop with two warpgroups failed on the H200 (2026-11-24: no result, a memcheck error)");
    static constexpr mhakit_dtype kDtype = kDtype_;
    static constexpr int kHdimQ = kHdimQ_, kHdimV = kHdimV_, kWarpgroups = kWarpgroups_, kStages = kStages_;
    static constexpr int kPrefetch = 0;  // produce_blocks' L2 prefetch: none
    static constexpr int kCtasPerSm = kCtasPerSm_;
    static constexpr int kWarps = 4 * kWarpgroups;     // consumer warps
    static constexpr int kConsumers = kWarps * 32;
    static constexpr int kThreads = kConsumers + 32;  // + the producer warp
    static constexpr int kRows = 64 * kWarpgroups;     // packed rows per CTA
    static constexpr int kBlockN = kBlockN_;
    static_assert(kWarpgroups == 1 || kWarpgroups == 2, "one or two consumer warpgroups");
    static_assert(kBlockN == 64, "S = Q·Kᵀ as one m64n64 wgmma per k step");
    static_assert(kHdimQ % kBoxCols == 0 && (kHdimV == 64 || kHdimV == 128), "head-dim buckets: 64-column boxes");
    static_assert(kStages >= 2 && kCtasPerSm >= 0 && kCtasPerSm <= 8, "a ring of two slots at least");
    static constexpr int kBoxesK = kHdimQ / kBoxCols, kBoxesV = kHdimV / kBoxCols;
    static constexpr int kBoxBytes = kBlockN * kRowBytes;  // 8 KB: every box keeps the swizzle's 1024-byte phase
    static constexpr int kKBytes = kBoxesK * kBoxBytes, kVBytes = kBoxesV * kBoxBytes;
    static constexpr int kSlotBytes = kKBytes + kVBytes;

    // Shared memory: the ring (reused after the key loop for the fp32 O rows and row statistics of the tile), the
    // barriers; plus 1 KB to align the ring to the swizzle's 1024-byte pattern. A cap of kCtasPerSm CTAs per SM as in
    // the mma.sync kernel (TmaConfig::Smem).
    static constexpr int kRing = kStages * kSlotBytes;
    static constexpr int kCombine = kRows * (kHdimV + 2) * 4;
    static constexpr int kBarriers = ((kRing > kCombine ? kRing : kCombine) + 7) / 8 * 8;
    static constexpr int kBytes = kBarriers + 2 * kStages * 8;
    static constexpr int kCapped = kCtasPerSm > 0 ? (233472 / (kCtasPerSm + 1) - 1024 + 16) / 16 * 16 : 0;
    static constexpr int kDynamic = kBytes + 1024 > kCapped ? kBytes + 1024 : kCapped;
    static_assert(kDynamic <= 232448, "decode_tma wgmma tile needs more than 227 KB");
    // CTAs per SM and the register cap that keeps them resident (as TmaConfig::Smem::kMaxRegs).
    static constexpr int kPerSm = 233472 / (kDynamic + 1024) > 0 ? 233472 / (kDynamic + 1024) : 1;
    static constexpr int kMaxRegs =
        (65536 / (kPerSm * kThreads)) / 8 * 8 > 255 ? 255 : (65536 / (kPerSm * kThreads)) / 8 * 8;
};

// One warp's share for the generic warp-level pieces (mask_s, pack_p, OnlineSoftmax, finish_tile): 16 rows, every key
// of the block (kNT n8 tiles of S), every column of O (kOT n8 tiles).
template <class Cfg>
struct WgView {
    static constexpr mhakit_dtype kDtype = Cfg::kDtype;
    static constexpr int kMT = 1;
    static constexpr int kKeys = Cfg::kBlockN;
    static constexpr int kNT = kKeys / 8;
    static constexpr int kKQ = Cfg::kHdimQ / 16;
    static constexpr int kKV = kKeys / 16;
    static constexpr int kOT = Cfg::kHdimV / 8;
    static constexpr bool kQInRegs = true;
    static constexpr bool kMasked = true;
};

// The wgmma of a 64 x kN x 16 product with A (K-major) from registers and B from shared memory (kMajorB: K-major for
// Kᵀ, MN-major for V), fp32 accumulators.
template <mhakit_dtype kDtype, int kN, GMMA::Major kMajorB>
struct GmmaRS;
template <GMMA::Major kB>
struct GmmaRS<MHAKIT_DTYPE_BF16, 64, kB> : GMMA::MMA_64x64x16_F32BF16BF16_RS<GMMA::Major::K, kB> {};
template <GMMA::Major kB>
struct GmmaRS<MHAKIT_DTYPE_BF16, 128, kB> : GMMA::MMA_64x128x16_F32BF16BF16_RS<GMMA::Major::K, kB> {};
template <GMMA::Major kB>
struct GmmaRS<MHAKIT_DTYPE_FP16, 64, kB> : GMMA::MMA_64x64x16_F32F16F16_RS<GMMA::Major::K, kB> {};
template <GMMA::Major kB>
struct GmmaRS<MHAKIT_DTYPE_FP16, 128, kB> : GMMA::MMA_64x128x16_F32F16F16_RS<GMMA::Major::K, kB> {};

// acc (a warp's 16 rows: kNT n8 tiles x 4, the m16n8 D fragment order) += A · B by one wgmma (scale_d Zero: acc = A·B).
template <class Op, int kNT, size_t... I>
__device__ __forceinline__ void gmma_rs(float (&acc)[1][kNT][4], const uint32_t (&a)[4], uint64_t desc_b,
                                        GMMA::ScaleOut scale_d, std::index_sequence<I...>) {
    Op::fma(a[0], a[1], a[2], a[3], desc_b, acc[0][I / 4][I % 4]..., scale_d);
}
template <class Op, int kNT>
__device__ __forceinline__ void gmma_rs(float (&acc)[1][kNT][4], const uint32_t (&a)[4], uint64_t desc_b,
                                        GMMA::ScaleOut scale_d) {
    gmma_rs<Op>(acc, a, desc_b, scale_d, std::make_index_sequence<kNT * 4>{});
}

// Keeps the compiler from moving reads or writes of wgmma operands across the asynchronous window (cute's
// warpgroup_fence_operand on every register of an accumulator, float, or of an A fragment, uint32_t).
template <class T, int kN>
__device__ __forceinline__ void fence_operands(T (&regs)[1][kN][4]) {
#pragma unroll
    for (int n = 0; n < kN; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) cute::warpgroup_fence_operand(regs[0][n][e]);
}

// The online softmax of OnlineSoftmax<1>::update in two halves, so that the first can run while the previous
// block's P·V is still in flight: softmax_scores turns S (masked) into P and updates the rows' max and sum, and gives
// the factor alpha[hf] that O's rows must take; rescale_o applies it (skipped when every factor of the warp is 1, as
// update<kSkipUnitRescale = true> does). Rows that have seen no key keep max -inf without NaN (update's rule).
template <int kNT>
__device__ __forceinline__ void softmax_scores(generic::detail::OnlineSoftmax<1>& sm, float (&s)[1][kNT][4],
                                               float scale_log2, float (&alpha)[2]) {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        float mx = sm.row_max[0][hf];
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) mx = fmaxf(mx, fmaxf(s[0][nt][2 * hf], s[0][nt][2 * hf + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_scaled = (mx == -INFINITY) ? 0.f : mx * scale_log2;
        alpha[hf] = ptx::ex2(sm.row_max[0][hf] * scale_log2 - m_scaled);
        sm.row_max[0][hf] = mx;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
            const float p0 = ptx::ex2(fmaf(s[0][nt][2 * hf], scale_log2, -m_scaled));
            const float p1 = ptx::ex2(fmaf(s[0][nt][2 * hf + 1], scale_log2, -m_scaled));
            s[0][nt][2 * hf] = p0;
            s[0][nt][2 * hf + 1] = p1;
            sum += p0 + p1;
        }
        sm.row_sum[0][hf] = sm.row_sum[0][hf] * alpha[hf] + sum;
    }
}
template <int kOT>
__device__ __forceinline__ void rescale_o(float (&acc_o)[1][kOT][4], const float (&alpha)[2]) {
    if (!__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) return;
#pragma unroll
    for (int nt = 0; nt < kOT; ++nt) {
        acc_o[0][nt][0] *= alpha[0];
        acc_o[0][nt][1] *= alpha[0];
        acc_o[0][nt][2] *= alpha[1];
        acc_o[0][nt][3] *= alpha[1];
    }
}

// A shared-memory matrix descriptor with the 128-byte swizzle (layout type 1): start address, leading and stride
// byte offsets (each in 16-byte units), base offset 0 (every box starts on the swizzle's 1024-byte phase).
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr, uint32_t lbo_bytes, uint32_t sbo_bytes) {
    return uint64_t((addr & 0x3FFFFu) >> 4) | (uint64_t((lbo_bytes >> 4) & 0x3FFFu) << 16) |
           (uint64_t((sbo_bytes >> 4) & 0x3FFFu) << 32) | (uint64_t(1) << 62);
}

// The descriptors of k step kk (16 keys or 16 head-dim columns) in a slot. K (B of S = Q·Kᵀ, K-major): columns
// 16 kk .. + 16 are bytes 32 (kk % 4) of box kk / 4's rows; 8-row groups 1024 bytes apart (SBO), LBO unused (1).
// V (B of O = P·V, MN-major): keys 16 kk .. + 16 are rows 16 kk .., 8-key groups 1024 bytes apart (SBO), the
// 64-column boxes kBoxBytes apart (LBO).
template <int kBoxBytes>
__device__ __forceinline__ uint64_t k_desc(uint32_t slot_k, int kk) {
    return sw128_desc(slot_k + uint32_t((kk >> 2) * kBoxBytes + (kk & 3) * 32), 16u, 1024u);
}
template <int kBoxBytes>
__device__ __forceinline__ uint64_t v_desc(uint32_t slot_v, int kk) {
    return sw128_desc(slot_v + uint32_t(kk * 16 * kRowBytes), uint32_t(kBoxBytes), 1024u);
}

// This warp's 16 packed rows of Q (tile rows warp_row0 .. + 16, chunk rows row0 ..) as wgmma A fragments of every
// 16-column step kk: q[kk][0..3] = (row g, cols 2t, 2t + 1), (g + 8, 2t ..), (g, 2t + 8 ..), (g + 8, 2t + 8 ..)
// (g = lane / 4, t = lane % 4), zero past the tile's rows and past hdim_q (a multiple of 8: pairs never straddle).
// Rows are 16-byte aligned (the family's guard), so each pair is one 32-bit load.
template <class Cfg>
__device__ __forceinline__ void load_q_fragments(uint32_t (&q)[Cfg::kHdimQ / 16][4], const SplitkvParams& p, int b,
                                                 int hk, int group, int row0, int rows, int warp_row0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const uint16_t* q0 = static_cast<const uint16_t*>(p.q) + b * p.q_batch_stride;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const int r = warp_row0 + g + 8 * hf;
        const bool real = r < rows;
        const PackedRow pr = packed_row(row0 + (real ? r : 0), group, hk);
        const uint16_t* row = q0 + pr.head * p.q_head_stride + int64_t(pr.qi) * p.q_row_stride;
#pragma unroll
        for (int kk = 0; kk < Cfg::kHdimQ / 16; ++kk)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int c = 16 * kk + 8 * h + 2 * t;
                q[kk][hf + 2 * h] =
                    real && c < p.hdim_q ? __ldg(reinterpret_cast<const unsigned int*>(row + c)) : 0u;
            }
    }
}

// The K and V boxes of every slot that hold no real column (a bucket one box wider than the head dim: the producer
// loads only boxes with real columns) set to zero, by all threads, once; then fenced into the async proxy, which
// wgmma reads through. A call whose head dims fill the bucket does nothing here.
template <class Cfg>
__device__ __forceinline__ void zero_unloaded_boxes(unsigned char* smem, const SplitkvParams& p, int tid) {
    const int boxes_k = (p.hdim_q + kBoxCols - 1) / kBoxCols, boxes_v = (p.hdim_v + kBoxCols - 1) / kBoxCols;
    if (boxes_k == Cfg::kBoxesK && boxes_v == Cfg::kBoxesV) return;
    constexpr int kChunks = Cfg::kBoxBytes / 16;  // 16-byte chunks per box
    for (int s = 0; s < Cfg::kStages; ++s) {
        unsigned char* slot = smem + s * Cfg::kSlotBytes;
        for (int x = boxes_k; x < Cfg::kBoxesK; ++x)
            for (int c = tid; c < kChunks; c += Cfg::kThreads)
                reinterpret_cast<uint4*>(slot + x * Cfg::kBoxBytes)[c] = make_uint4(0u, 0u, 0u, 0u);
        for (int x = boxes_v; x < Cfg::kBoxesV; ++x)
            for (int c = tid; c < kChunks; c += Cfg::kThreads)
                reinterpret_cast<uint4*>(slot + Cfg::kKBytes + x * Cfg::kBoxBytes)[c] = make_uint4(0u, 0u, 0u, 0u);
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads) __maxnreg__(Cfg::kMaxRegs)
    splitkv_wgmma_kernel(const __grid_constant__ CUtensorMap tma_k, const __grid_constant__ CUtensorMap tma_v,
                         const SplitkvParams p) {
    using W = WgView<Cfg>;
    using Barrier = cutlass::arch::ClusterTransactionBarrier;
    using OpS = GmmaRS<Cfg::kDtype, Cfg::kBlockN, GMMA::Major::K>;
    using OpO = GmmaRS<Cfg::kDtype, Cfg::kHdimV, GMMA::Major::MN>;
    constexpr int kBlockM = Cfg::kRows, kBlockN = Cfg::kBlockN, kStages = Cfg::kStages, kWarps = Cfg::kWarps;
    constexpr int kBoxBytes = Cfg::kBoxBytes;

    extern __shared__ unsigned char smem_raw[];
    unsigned char* smem = aligned_smem(smem_raw);
    uint64_t* full_bar = reinterpret_cast<uint64_t*>(smem + Cfg::kBarriers);
    uint64_t* empty_bar = full_bar + kStages;

    // As the mma.sync kernel: the combine may start as soon as every CTA has; nothing global is read before the
    // append kernel's writes are visible.
    trigger_dependents();
    wait_for_primary();

    const SplitkvWork work = splitkv_work(p, kBlockM);
    const int split = work.split, hk = work.hk, b = work.b, group = work.group;
    const int rows_total = work.rows_total, row0 = work.row0, rows = work.rows;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const SplitKeys keys = split_keys<kBlockN>(p, b, split, row0, rows, group);
    const int n_blocks = keys.n_blocks;

    init_ring<kStages, kWarps>(full_bar, empty_bar, tid);
    zero_unloaded_boxes<Cfg>(smem, p, tid);
    __syncthreads();

    // ---------------- producer warp ----------------
    if (warp == kWarps) {
        if (n_blocks == 0) return;
        produce_blocks<Cfg, kStages, /*kAsyncReaders=*/true>(smem, full_bar, empty_bar, tma_k, tma_v, p, keys, b, hk,
                                                             lane);
        return;
    }

    // ---------------- consumer warpgroups ----------------
    const int warp_row0 = warp * 16;
    int row_lo[1][2], row_hi[1][2];
    row_bounds<1>(row_lo, row_hi, keys.geom, row0 + warp_row0, rows_total, group);
    uint32_t q_frag[W::kKQ][4];
    load_q_fragments<Cfg>(q_frag, p, b, hk, group, row0, rows, warp_row0);

    const uint32_t ring = ptx::smem_addr(smem);
    float acc_o[1][W::kOT][4];
    zero_fragments(acc_o);
    generic::detail::OnlineSoftmax<1> softmax;
    float s[1][W::kNT][4];
    uint32_t p_frag[1][W::kKV][4];
    // S of block i: issued (not waited for) into s.
    auto issue_s = [&](int i) {
        const uint32_t slot = ring + uint32_t((i % kStages) * Cfg::kSlotBytes);
#pragma unroll
        for (int kk = 0; kk < W::kKQ; ++kk)
            gmma_rs<OpS>(s, q_frag[kk], k_desc<kBoxBytes>(slot, kk),
                         kk == 0 ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One);
        cute::warpgroup_commit_batch();
    };
    // O += P·V of block i (P in p_frag): issued, not waited for.
    auto issue_pv = [&](int i) {
        const uint32_t slot_v = ring + uint32_t((i % kStages) * Cfg::kSlotBytes + Cfg::kKBytes);
#pragma unroll
        for (int kk = 0; kk < W::kKV; ++kk)
            gmma_rs<OpO>(acc_o, p_frag[0][kk], v_desc<kBoxBytes>(slot_v, kk), GMMA::ScaleOut::One);
        cute::warpgroup_commit_batch();
    };
    auto wait_full = [&](int i) { Barrier::wait(&full_bar[i % kStages], (i / kStages) & 1); };
    auto release = [&](int i) {
        __syncwarp();  // every lane's wgmmas that read the slot are complete
        if (lane == 0) Barrier::arrive(&empty_bar[i % kStages]);
    };
    // S of block i (complete) masked, into P and the rows' new max and sum; alpha: the factor O must take.
    auto scores = [&](int i, float (&alpha)[2]) {
        const int blk = keys.blk_begin + i;
        if (!keys.full.contains(blk)) generic::detail::mask_s<W>(s, row_lo, row_hi, blk * kBlockN);
        softmax_scores(softmax, s, p.scale_log2, alpha);
    };

    if constexpr (Cfg::kOverlap) {
        // Software pipeline (one warpgroup's own overlap, as FlashAttention-3's): S(i) and P(i - 1)·V are issued
        // together, the softmax of block i runs while P(i - 1)·V is in flight, O takes block i's rescale only once
        // that product is complete (wait_group 0), and slot i - 1 is released then.
        if (n_blocks > 0) {
            wait_full(0);
            fence_operands(s);
            cute::warpgroup_arrive();
            issue_s(0);
            cute::warpgroup_wait<0>();
            fence_operands(s);
            float alpha[2];
            scores(0, alpha);  // O is zero: no rescale
            generic::detail::pack_p<W>(p_frag, s);
        }
        for (int i = 1; i < n_blocks; ++i) {
            wait_full(i);
            fence_operands(s);
            fence_operands(acc_o);
            fence_operands(p_frag);
            cute::warpgroup_arrive();
            issue_s(i);
            issue_pv(i - 1);
            cute::warpgroup_wait<1>();  // S(i) complete (groups complete in order); P(i - 1)·V may still run
            fence_operands(s);
            float alpha[2];
            scores(i, alpha);
            cute::warpgroup_wait<0>();  // P(i - 1)·V complete: O and P's registers and slot i - 1 are free
            fence_operands(acc_o);
            fence_operands(p_frag);
            release(i - 1);
            rescale_o(acc_o, alpha);
            generic::detail::pack_p<W>(p_frag, s);
        }
        if (n_blocks > 0) {
            fence_operands(acc_o);
            fence_operands(p_frag);
            cute::warpgroup_arrive();
            issue_pv(n_blocks - 1);
            cute::warpgroup_wait<0>();
            fence_operands(acc_o);
            release(n_blocks - 1);
        }
    } else {
        // One block at a time: S, softmax, P·V, release.
        for (int i = 0; i < n_blocks; ++i) {
            wait_full(i);
            fence_operands(s);
            cute::warpgroup_arrive();
            issue_s(i);
            cute::warpgroup_wait<0>();
            fence_operands(s);
            float alpha[2];
            scores(i, alpha);
            rescale_o(acc_o, alpha);
            generic::detail::pack_p<W>(p_frag, s);
            fence_operands(acc_o);
            fence_operands(p_frag);
            cute::warpgroup_arrive();
            issue_pv(i);
            cute::warpgroup_wait<0>();
            fence_operands(acc_o);
            release(i);
        }
    }

    // ---- the tile's rows (each owned by one warp) go out through shared memory (the ring is free) ----
    named_sync(kConsumerBarrier, Cfg::kConsumers);
    finish_tile<W, kWarps, /*kRowSplit=*/true, kBlockM, Cfg::kConsumers>(
        smem, acc_o, softmax, p, warp_row0, b, hk, split, row0, rows, group, tid,
        [] { named_sync(kConsumerBarrier, Cfg::kConsumers); });
}

}  // namespace wgmma_detail

// The wgmma instance of decode_tma: kWarpgroups consumer warpgroups of 64 packed rows each (the catalogue tile's
// `warpgroups`), block_n = 64 keys per slot, `stages` slots, an optional cap of CTAs per SM, the L2 promotion of the
// tensor maps (absent: the mma.sync kernel's 128), the consumer loop's software pipeline (`overlap`). Serves every
// call the mma.sync instance serves (its run-time guard is the same); the runtime gives it the calls with at least the
// tile's min_rows packed rows per kv head (catalogue).
template <mhakit_dtype kDtype, int kHdimQ, int kHdimV, int kWarpgroups, int kBlockN, int kStages, int kCtasPerSm,
          bool kOverlap, int kL2Promotion = 128>
struct SplitkvWgmmaKernel {
    static_assert(kL2Promotion == 0 || kL2Promotion == 64 || kL2Promotion == 128 || kL2Promotion == 256,
                  "an L2 promotion a tensor map has");
    using Cfg =
        wgmma_detail::WgmmaConfig<kDtype, kHdimQ, kHdimV, kWarpgroups, kBlockN, kStages, kCtasPerSm, kOverlap>;

    static long long packed_rows(const SplitkvParams& p) { return (long long)(p.nhead_q / p.nhead_k) * p.seqlen_q; }
    static long long row_chunks(const SplitkvParams& p) { return (packed_rows(p) + Cfg::kRows - 1) / Cfg::kRows; }

    static bool supports(const SplitkvParams& p) { return tma_detail::tma_supports(p, row_chunks(p), kBlockN); }

    // The split count for num_splits = 0: the decode family's heuristic, waves of one CTA per SM (a TMA ring).
    static int num_splits(const SplitkvParams& p, int /*smem_per_sm*/) {
        return heuristic_splits(p, row_chunks(p) * p.nhead_k * p.batch, kBlockN, kTmaRingCtasPerSm);
    }

    static cudaError_t run(const SplitkvParams& p, cudaStream_t stream) {
        if (cudaError_t err = detail::append_kv(p, stream); err != cudaSuccess) return err;
        if (p.batch <= 0 || p.seqlen_q <= 0) return cudaSuccess;
        const bool after_append = p.seqlen_new > 0;  // append_kv launched a kernel
        alignas(64) CUtensorMap tma_k, tma_v;
        using tma_detail::encode_cache;
        if (encode_cache<kBlockN, kL2Promotion>(&tma_k, kDtype, p.k_cache, p.hdim_q, p.k_row_stride, p.k_head_stride,
                                                p.k_batch_stride, p) != CUDA_SUCCESS ||
            encode_cache<kBlockN, kL2Promotion>(&tma_v, kDtype, p.v_cache, p.hdim_v, p.v_row_stride, p.v_head_stride,
                                                p.v_batch_stride, p) != CUDA_SUCCESS)
            return cudaErrorInvalidValue;  // supports() admitted only what TMA takes: not expected
        auto kernel = wgmma_detail::splitkv_wgmma_kernel<Cfg>;
        constexpr int smem = Cfg::kDynamic;
        static std::atomic<uint64_t> opted_in{0};
        if (cudaError_t err = opt_in_dynamic_smem(kernel, smem, opted_in); err != cudaSuccess) return err;
        const dim3 grid(unsigned(row_chunks(p) * p.num_splits * p.nhead_k), 1, p.batch);
        cudaError_t err;
        if (after_append) {
            err = launch_dependent(kernel, grid, dim3(Cfg::kThreads), smem, stream, tma_k, tma_v, p);
        } else {
            kernel<<<grid, Cfg::kThreads, smem, stream>>>(tma_k, tma_v, p);
            err = cudaGetLastError();
        }
        if (err != cudaSuccess || p.num_splits == 1) return err;
        return detail::combine_splits<kDtype>(p, stream, /*dependent=*/true);
    }
};

}  // namespace mhakit::decode
