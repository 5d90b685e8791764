// mhakit generic family — tile I/O shared by the forward, the backward and their row kernels: 16-byte chunks of 8
// elements between global and shared memory, by cp.async (zero-filled past the valid rows / columns) when the tensor
// is 16-byte aligned, else by element-wise accesses (a uniform runtime branch per tensor), and the alignment test that
// picks between them. Head dims need not be multiples of 8: the last chunk of a row may hold fewer than 8 real
// elements; it is read with a shorter cp.async source (the rest zero-filled) or element by element, and written
// element by element, so no access leaves the row's real columns.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "generic_ptx.cuh"

namespace mhakit::generic::detail {

// True when the base pointer and every stride (elements of 2 bytes) allow 16-byte vector access.
inline bool aligned16(const void* ptr, int64_t s0, int64_t s1, int64_t s2) {
    return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0 && (s0 & 7) == 0 && (s1 & 7) == 0 && (s2 & 7) == 0;
}

#if defined(__CUDACC__)

// f(r, c) for every (row, 16-byte chunk) of a kRows x kChunks tile that thread tid owns: the threads walk the
// tile's chunks row-major, kThreads apart.
template <int kRows, int kChunks, int kThreads, class F>
__device__ __forceinline__ void for_each_chunk(int tid, F&& f) {
    constexpr int kTotal = kRows * kChunks;
#pragma unroll
    for (int it = 0; it < (kTotal + kThreads - 1) / kThreads; ++it) {
        const int idx = tid + it * kThreads;
        if ((kTotal % kThreads) != 0 && idx >= kTotal) break;
        f(idx / kChunks, idx % kChunks);
    }
}

// A chunk is described by `rem`, the real elements of its row from the chunk's first column on (cols_valid - c * 8):
// rem >= 8 is a whole chunk, 0 < rem < 8 a partial one (the row's last), rem <= 0 none. rem is deliberately not
// clamped to [0, 8]: with the clamped count n, the test n == 8 was compiled (nvcc 13.0, sm_90a) into a branch on the
// predicate output of the min that clamps it, and on the H200 partial chunks then took the whole-chunk path (16-byte
// stores past the row, 8-element loads past it). Tests on rem itself compile to plain comparisons.

// cp.async source bytes of a chunk: 16 when whole, 2 * rem when partial, 0 when empty (zero-fill, nothing read).
__device__ __forceinline__ int chunk_bytes(int rem) { return rem >= 8 ? 16 : (rem > 0 ? 2 * rem : 0); }

// The chunk at src (see rem above), element by element, zeros past the row, packed as 16 bytes. A whole chunk (every
// chunk of a head dim that is a multiple of 8) takes eight unpredicated loads.
__device__ __forceinline__ uint4 load_elems(const uint16_t* src, int rem) {
    uint32_t w[4] = {0u, 0u, 0u, 0u};
    if (rem >= 8) {
#pragma unroll
        for (int e = 0; e < 4; ++e)
            w[e] = static_cast<uint32_t>(src[2 * e]) | (static_cast<uint32_t>(src[2 * e + 1]) << 16);
    } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const uint32_t lo = 2 * e < rem ? src[2 * e] : 0u, hi = 2 * e + 1 < rem ? src[2 * e + 1] : 0u;
            w[e] = lo | (hi << 16);
        }
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}

// The real elements of a packed chunk (see rem above) to dst, element by element.
__device__ __forceinline__ void store_elems(uint16_t* dst, uint4 v, int rem) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int e = 0; e < 8; ++e)
        if (e < rem) dst[e] = static_cast<uint16_t>(w[e >> 1] >> (16 * (e & 1)));
}

// One 16-byte chunk (see rem above): cp.async of its real bytes, the rest zero-filled (the whole chunk when
// rem <= 0: nothing is read then), or element-wise loads for unaligned tensors.
__device__ __forceinline__ void load_chunk(uint32_t dst, const uint16_t* src, const uint16_t* fallback, int rem,
                                           bool aligned) {
    if (aligned)
        ptx::cp_async_16(dst, rem > 0 ? src : fallback, chunk_bytes(rem));
    else
        ptx::st_shared_v4(dst, load_elems(src, rem));
}

// Rows [0, kRows) x 16-byte chunks [0, chunks_load) of a tile: global (row stride in elements) -> shared (kStride).
// Columns at or past cols_valid (any count, not only multiples of 8) and rows at or past rows_valid are zero-filled.
template <int kRows, int kChunks, int kStride, int kThreads>
__device__ __forceinline__ void load_tile(uint16_t* smem, const uint16_t* gbase, int64_t row_stride, int rows_valid,
                                          int chunks_load, int cols_valid, bool aligned, int tid) {
    if constexpr (kThreads % kChunks == 0) {
        // Every thread owns one chunk column and walks down the rows: addresses are one add per row step.
        constexpr int kRowStep = kThreads / kChunks;
        constexpr int kIters = (kRows + kRowStep - 1) / kRowStep;
        const int c = tid % kChunks, r0 = tid / kChunks;
        if (c >= chunks_load) return;
        const int c_rem = cols_valid - c * 8, c_bytes = chunk_bytes(c_rem);
        const uint16_t* src = gbase + r0 * row_stride + c * 8;
        const int64_t src_step = kRowStep * row_stride;
        const uint32_t dst = ptx::smem_addr(smem + r0 * kStride + c * 8);
        if (aligned) {
#pragma unroll
            for (int it = 0; it < kIters; ++it) {
                const int r = r0 + it * kRowStep;
                if ((kRows % kRowStep) != 0 && r >= kRows) break;
                const bool valid = c_rem > 0 && r < rows_valid;
                ptx::cp_async_16(dst + it * kRowStep * kStride * 2, valid ? src + it * src_step : gbase,
                                 valid ? c_bytes : 0);
            }
        } else {
#pragma unroll
            for (int it = 0; it < kIters; ++it) {
                const int r = r0 + it * kRowStep;
                if ((kRows % kRowStep) != 0 && r >= kRows) break;
                load_chunk(dst + it * kRowStep * kStride * 2, src + it * src_step, gbase, r < rows_valid ? c_rem : 0,
                           false);
            }
        }
    } else {
        for_each_chunk<kRows, kChunks, kThreads>(tid, [&](int r, int c) {
            if (c >= chunks_load) return;
            const int rem = r < rows_valid ? cols_valid - c * 8 : 0;
            load_chunk(ptx::smem_addr(smem + r * kStride + c * 8), gbase + r * row_stride + c * 8, gbase, rem, aligned);
        });
    }
}

// The chunk at src (see rem above; zeros past the row): one 16-byte load when the tensor is aligned and the chunk
// whole, else element-wise.
__device__ __forceinline__ uint4 load8(const uint16_t* src, int rem, bool aligned) {
    if (aligned && rem >= 8) return *reinterpret_cast<const uint4*>(src);
    return load_elems(src, rem);
}

// The real elements of a chunk (see rem above) to dst: one 16-byte store when aligned and whole, else element-wise.
__device__ __forceinline__ void store8(uint16_t* dst, uint4 v, int rem, bool aligned) {
    if (aligned && rem >= 8)
        *reinterpret_cast<uint4*>(dst) = v;
    else
        store_elems(dst, v, rem);
}

// Shared-memory tile (row stride kStride elements) -> global rows [0, rows_valid) x columns [0, cols_valid).
template <int kRows, int kChunks, int kStride, int kThreads>
__device__ __forceinline__ void store_tile(const uint16_t* smem, uint16_t* gbase, int64_t row_stride, int rows_valid,
                                           int cols_valid, bool aligned, int tid) {
    for_each_chunk<kRows, kChunks, kThreads>(tid, [&](int r, int c) {
        const int rem = cols_valid - c * 8;
        if (r >= rows_valid || rem <= 0) return;
        const uint4 v = ptx::ld_shared_v4(ptx::smem_addr(smem + r * kStride + c * 8));
        store8(gbase + r * row_stride + c * 8, v, rem, aligned);
    });
}

// 4 bytes global -> shared through L1; src_bytes = 0 writes zeros and reads nothing.
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

#endif  // __CUDACC__

}  // namespace mhakit::generic::detail
