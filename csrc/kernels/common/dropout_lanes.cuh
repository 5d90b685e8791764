// Dropout's random bytes on a warp's mma accumulator fragments: the m16n8 C layout that mma.sync (the generic
// family) and wgmma (the Hopper family: each warp of a warpgroup holds 16 rows of the 64-row accumulator in the same
// layout, 8 columns after 8) share. csrc/kernels/common/dropout.h says which random byte belongs to which score; this
// header says which thread holds it. Two fragment layouts use it:
//   S   (forwards, the generic backward's dQ pass): fragment rows are queries, columns keys; a thread holds rows
//       g, g + 8 and columns 2·t4, 2·t4 + 1 of each 16 x 8 tile (g = lane / 4, t4 = lane % 4);
//   S^T (the backwards' Sᵀ tiles): fragment rows are keys, columns queries.
// One Philox call serves a 16 x 16 block and a residue pair (dropout.h); in either layout its 16 bytes belong to
// two threads, lanes L and L ^ 4 (g and g ^ 1), eight each. So a pair of lanes splits the calls of its blocks: each
// computes every other call, keeps its own eight bytes and trades the other eight with one pair of shuffles.
// A fragment element (mt, nt, e) is the register 4·nt + e of the tile mt (e: bit 0 the column's parity, bit 1 the
// row half), the order of both instructions' accumulators.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "dropout.h"
#include "mma_fragment.cuh"

namespace mhakit {

#if defined(__CUDACC__)

// The call's seed and offset: from device memory when the caller gave pointers (read when the kernel runs).
struct DropKey {
    uint64_t seed, offset;
};

__device__ __forceinline__ DropKey drop_key(const Dropout& d) {
    return {d.seed_ptr != nullptr ? *d.seed_ptr : d.seed, d.offset_ptr != nullptr ? *d.offset_ptr : d.offset};
}

// The eight bytes of call x that the thread of the given parity (g & 1) holds, packed so that
//   S:   word ti = (row / 8) % 2, byte tj·2 + ej  (the thread's row parity ei picks call words 2ei, 2ei + 1);
//   S^T: word ei = query % 2, byte ti·2 + tj    (the thread's key parity ej picks every other byte).
template <bool kT>
__device__ __forceinline__ uint2 call_half(const Philox4& x, int parity) {
    if constexpr (!kT) {
        return parity ? make_uint2(x.z, x.w) : make_uint2(x.x, x.y);
    } else {
        const uint32_t sel = parity ? 0x7531u : 0x6420u;
        return make_uint2(__byte_perm(x.x, x.y, sel), __byte_perm(x.z, x.w, sel));
    }
}

// rnd[mt][np]: the thread's eight random bytes of the 16 x 16 block (mt, np) of a fragment grid of kMT 16-row
// tiles and 2·kNP 8-column tiles whose first row is row0 and first column col0 (both multiples of 16, counted from
// the sequence's start); bh = b·nhead_q + h. kT: the S^T layout (rows are keys).
template <bool kT, int kMT, int kNP>
__device__ __forceinline__ void dropout_bytes(uint2 (&rnd)[kMT][kNP], const DropKey& key, uint32_t bh, int row0,
                                              int col0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3, parity = g & 1;
    const int a = kT ? t4 : g >> 1;  // the query residue pair (i / 2) % 4
    const int b = kT ? g >> 1 : t4;  // the key residue pair (j / 2) % 4
    auto call = [&](int c) {
        const int mt = c / kNP, np = c % kNP;
        const int I = kT ? (col0 >> 4) + np : (row0 >> 4) + mt;
        const int J = kT ? (row0 >> 4) + mt : (col0 >> 4) + np;
        return dropout_call(key.seed, key.offset, bh, I, J, a, b);
    };
    constexpr int kN = kMT * kNP;
    if constexpr (kN % 2 == 0) {
#pragma unroll
        for (int u = 0; u < kN; u += 2) {
            const Philox4 x = call(u + parity);  // this lane's call of the pair u, u + 1
            const uint2 mine = call_half<kT>(x, parity), theirs = call_half<kT>(x, parity ^ 1);
            uint2 got;
            got.x = __shfl_xor_sync(0xffffffffu, theirs.x, 4);
            got.y = __shfl_xor_sync(0xffffffffu, theirs.y, 4);
            rnd[u / kNP][u % kNP] = parity ? got : mine;
            rnd[(u + 1) / kNP][(u + 1) % kNP] = parity ? mine : got;
        }
    } else {  // an odd number of calls: each lane computes them all
#pragma unroll
        for (int c = 0; c < kN; ++c) rnd[c / kNP][c % kNP] = call_half<kT>(call(c), parity);
    }
}

// The random byte of fragment element (mt, nt, e) from the thread's rnd (dropout_bytes, same layout).
template <bool kT>
__device__ __forceinline__ uint32_t drop_byte(const uint2& r, int nt, int e) {
    const uint32_t word = (kT ? (e & 1) : (e >> 1)) ? r.y : r.x;
    const int byte = (nt & 1) * 2 + (kT ? (e >> 1) : (e & 1));
    return (word >> (8 * byte)) & 0xffu;
}

// S layout: the random bytes of the scores inside the sequence (rows < seqlen_q, keys < seqlen_k) into rv, the
// (b, h, row 0, key 0) of the randval tensor (row stride `ld`).
template <int kMT, int kNT>
__device__ __forceinline__ void store_randval(const uint2 (&rnd)[kMT][kNT / 2], uint8_t* rv, int64_t ld, int row0,
                                              int col0, int seqlen_q, int seqlen_k) {
    const MmaFragLane fl = MmaFragLane::of_thread();
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int i = fl.row(row0, mt, e), j = fl.col(col0, nt, e);
                if (i < seqlen_q && j < seqlen_k)
                    rv[static_cast<int64_t>(i) * ld + j] = static_cast<uint8_t>(drop_byte<false>(rnd[mt][nt / 2], nt, e));
            }
}

// The drop flags of four random bytes: bit 7 of byte k set when byte k > keep_max (the score is dropped), the other
// bits meaningless. c4 = (255 − keep_max) in each byte (drop_flag_bias): byte k of w + c4 carries out of its bit 7
// exactly when w_k > keep_max, and that carry is the majority of the bytes' bit 7 and the carry into it, which the
// sum of their low seven bits gives without crossing into the next byte.
__device__ __forceinline__ uint32_t drop_flag_bias(int keep_max) {
    return static_cast<uint32_t>(255 - keep_max) * 0x01010101u;
}
__device__ __forceinline__ uint32_t drop_flags(uint32_t w, uint32_t c4) {
    const uint32_t s7 = (w & 0x7f7f7f7fu) + (c4 & 0x7f7f7f7fu);
    return (w & c4) | (w & s7) | (c4 & s7);
}

// All ones when byte k of the drop flags says "dropped", else 0: prmt with the sign-replicating selector (the msb of
// each selector nibble) spreads bit 7 of byte k over all four bytes. k must be a compile-time constant in [0, 4).
template <int k>
__device__ __forceinline__ uint32_t drop_mask(uint32_t flags) {
    static_assert(k >= 0 && k < 4);
    constexpr uint32_t sel = 0x8888u | (static_cast<uint32_t>(k) * 0x1111u);
    uint32_t m;
    asm("prmt.b32 %0, %1, 0, %2;" : "=r"(m) : "r"(flags), "n"(sel));
    return m;
}

#endif  // __CUDACC__

}  // namespace mhakit
