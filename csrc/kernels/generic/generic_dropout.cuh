// mhakit generic family — dropout on the fp32 S fragments of mma.sync m16n8k16 (csrc/kernels/common/dropout.h says
// which random byte belongs to which score). Two fragment layouts use it:
//   S   (the forward, the backward's dQ pass): fragment rows are queries, columns keys; a thread holds rows g, g + 8
//       and columns 2·t4, 2·t4 + 1 of each 16 x 8 tile;
//   S^T (the backward's main kernel): fragment rows are keys, columns queries.
// One Philox call serves a 16 x 16 block and a residue pair (dropout.h); in either layout its 16 bytes belong to
// two threads, lanes L and L ^ 4 (g and g ^ 1), eight each. So a pair of lanes splits the calls of its blocks: each
// computes every other call, keeps its own eight bytes and trades the other eight with one pair of shuffles.
// Modifier instances only ("_mods", kMods).
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "../common/dropout.h"

namespace mhakit::generic::detail {

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

// S layout: P (the softmax's probabilities, or their unnormalised exponentials) -> P ∘ keep, in place; the caller
// applies the 1 / (1 − p) of the kept ones to what it accumulates from them (the forward: O, once, at the end).
template <int kMT, int kNT>
__device__ __forceinline__ void apply_dropout(float (&s)[kMT][kNT][4], const uint2 (&rnd)[kMT][kNT / 2],
                                              const Dropout& d) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                if (drop_byte<false>(rnd[mt][nt / 2], nt, e) > static_cast<uint32_t>(d.keep_max)) s[mt][nt][e] = 0.f;
}

// S layout: the random bytes of the scores inside the sequence (rows < seqlen_q, keys < seqlen_k) into rv, the
// (b, h, row 0, key 0) of the randval tensor (row stride `ld`).
template <int kMT, int kNT>
__device__ __forceinline__ void store_randval(const uint2 (&rnd)[kMT][kNT / 2], uint8_t* rv, int64_t ld, int row0,
                                              int col0, int seqlen_q, int seqlen_k) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int i = row0 + mt * 16 + g + 8 * (e >> 1), j = col0 + nt * 8 + 2 * t4 + (e & 1);
                if (i < seqlen_q && j < seqlen_k)
                    rv[static_cast<int64_t>(i) * ld + j] = static_cast<uint8_t>(drop_byte<false>(rnd[mt][nt / 2], nt, e));
            }
}

#endif  // __CUDACC__

}  // namespace mhakit::generic::detail
