// Dropout's random numbers: Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011),
// keyed by the seed and counted from the offset, and which of its bytes belongs to which score. Shared by the
// kernels (dropout_lanes.cuh: which thread of an mma fragment holds which byte, for the generic and the Hopper
// families) and the host references, so all draw the same bytes; the NumPy reference (mhakit/reference.py,
// dropout_randval) mirrors it.
//
// The random byte of score (b, h, i, j) (query row i, key j, counted from the sequence's start; h the query head):
//   one Philox call per 16 x 16 block of scores and residue pair: I = i / 16, J = j / 16, a = (i / 2) % 4,
//   b' = (j / 2) % 4 give the counter
//       (J·4 + b', I·4 + a, lo32(offset), hi32(offset) + b·nhead_q + h)   and the key (lo32(seed), hi32(seed));
//   its 16 output bytes (little-endian words x0..x3) cover rows {16I + 8·ti + 2a + ei} x keys {16J + 8·tj + 2b' + ej}
//   (ti, ei, tj, ej in {0, 1}): byte ei·8 + ti·4 + tj·2 + ej. A score is kept when its byte <= keep_max =
//   floor((1 − p_drop)·255) (CK's and aiter's rule) and is then scaled by 1 / (1 − p_drop).
// Each byte depends on (seed, offset, b, h, i, j) only, never on a kernel's tiling, so the backward regenerates the
// forward's mask, and any two offsets (below 2^32 apart in the high word) give independent streams.
#pragma once

#include <stdint.h>

#include "mask.h"  // MHAKIT_HOST_DEVICE

namespace mhakit {

// The dropout of one call, as the kernels see it (the runtime fills it from the argument struct).
struct Dropout {
    bool on;             // p_drop > 0
    int keep_max;        // keep a score whose random byte is <= this (0 .. 255)
    float rp;            // 1 / (1 − p_drop): the scale of the kept probabilities
    uint64_t seed, offset;                     // host values, used when the pointers are null
    const uint64_t* seed_ptr;                  // device values (read by the kernels: CUDA-graph friendly)
    const uint64_t* offset_ptr;
    uint8_t* randval;                          // forward only: where to store the random bytes (tests), or null
    int64_t randval_row, randval_head, randval_batch;  // element strides (group mode: rows packed, batch unused)
};

// keep_max of a drop probability p in [0, 1).
MHAKIT_HOST_DEVICE int dropout_keep_max(float p_drop) {
    const float k = (1.f - p_drop) * 255.f;
    const int v = static_cast<int>(k);  // floor: k >= 0
    return v > 255 ? 255 : (v < 0 ? 0 : v);
}

// Philox4x32 with 10 rounds: the counter (c0..c3) under the key (k0, k1) -> four 32-bit words.
struct Philox4 {
    uint32_t x, y, z, w;
};

MHAKIT_HOST_DEVICE void philox_mulhilo(uint32_t a, uint32_t b, uint32_t* hi, uint32_t* lo) {
#if defined(__CUDA_ARCH__)
    *hi = __umulhi(a, b);
    *lo = a * b;
#else
    const uint64_t p = static_cast<uint64_t>(a) * b;
    *hi = static_cast<uint32_t>(p >> 32);
    *lo = static_cast<uint32_t>(p);
#endif
}

MHAKIT_HOST_DEVICE Philox4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1) {
    constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u, kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int round = 0; round < 10; ++round) {
        uint32_t hi0, lo0, hi1, lo1;
        philox_mulhilo(kM0, c0, &hi0, &lo0);
        philox_mulhilo(kM1, c2, &hi1, &lo1);
        const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c0 = n0, c1 = lo1, c2 = n2, c3 = lo0;
        k0 += kW0, k1 += kW1;
    }
    return Philox4{c0, c1, c2, c3};
}

// The Philox call of 16 x 16 block (I, J) and residue pair (a, b) of head index bh = b·nhead_q + h (see the top).
MHAKIT_HOST_DEVICE Philox4 dropout_call(uint64_t seed, uint64_t offset, uint32_t bh, int I, int J, int a, int b) {
    return philox4x32_10(static_cast<uint32_t>(J) * 4u + static_cast<uint32_t>(b),
                         static_cast<uint32_t>(I) * 4u + static_cast<uint32_t>(a), static_cast<uint32_t>(offset),
                         static_cast<uint32_t>(offset >> 32) + bh, static_cast<uint32_t>(seed),
                         static_cast<uint32_t>(seed >> 32));
}

// The random byte of score (i, j) of head index bh (host references; the kernels draw whole calls).
MHAKIT_HOST_DEVICE uint32_t dropout_byte(uint64_t seed, uint64_t offset, uint32_t bh, int i, int j) {
    const Philox4 x = dropout_call(seed, offset, bh, i >> 4, j >> 4, (i >> 1) & 3, (j >> 1) & 3);
    const int k = (i & 1) * 8 + ((i >> 3) & 1) * 4 + ((j >> 3) & 1) * 2 + (j & 1);
    const uint32_t word = k < 4 ? x.x : (k < 8 ? x.y : (k < 12 ? x.z : x.w));
    return (word >> (8 * (k & 3))) & 0xffu;
}

}  // namespace mhakit
