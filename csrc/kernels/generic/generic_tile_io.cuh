// mhakit generic family — tile I/O shared by the forward, the backward and their row kernels: 16-byte chunks between
// global and shared memory, by cp.async (zero-filled past the valid rows / columns) when the tensor is 16-byte
// aligned, else by element-wise accesses (a uniform runtime branch per tensor), and the alignment test that picks
// between them.
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

// One 16-byte chunk: cp.async (zero-filled when !valid) or element-wise loads for unaligned tensors.
__device__ __forceinline__ void load_chunk(uint32_t dst, const uint16_t* src, const uint16_t* fallback, bool valid,
                                           bool aligned) {
    if (aligned) {
        ptx::cp_async_16(dst, valid ? src : fallback, valid ? 16 : 0);
    } else {
        uint32_t w[4] = {0u, 0u, 0u, 0u};
        if (valid) {
#pragma unroll
            for (int e = 0; e < 4; ++e)
                w[e] = static_cast<uint32_t>(src[2 * e]) | (static_cast<uint32_t>(src[2 * e + 1]) << 16);
        }
        ptx::st_shared_v4(dst, make_uint4(w[0], w[1], w[2], w[3]));
    }
}

// Rows [0, kRows) x 16-byte chunks [0, chunks_load) of a tile: global (row stride in elements) -> shared (kStride).
// Chunks at or past chunks_valid and rows at or past rows_valid are zero-filled.
template <int kRows, int kChunks, int kStride, int kThreads>
__device__ __forceinline__ void load_tile(uint16_t* smem, const uint16_t* gbase, int64_t row_stride, int rows_valid,
                                          int chunks_load, int chunks_valid, bool aligned, int tid) {
    if constexpr (kThreads % kChunks == 0) {
        // Every thread owns one chunk column and walks down the rows: addresses are one add per row step.
        constexpr int kRowStep = kThreads / kChunks;
        constexpr int kIters = (kRows + kRowStep - 1) / kRowStep;
        const int c = tid % kChunks, r0 = tid / kChunks;
        if (c >= chunks_load) return;
        const bool c_valid = c < chunks_valid;
        const uint16_t* src = gbase + r0 * row_stride + c * 8;
        const int64_t src_step = kRowStep * row_stride;
        const uint32_t dst = ptx::smem_addr(smem + r0 * kStride + c * 8);
        if (aligned) {
#pragma unroll
            for (int it = 0; it < kIters; ++it) {
                const int r = r0 + it * kRowStep;
                if ((kRows % kRowStep) != 0 && r >= kRows) break;
                const bool valid = c_valid && r < rows_valid;
                ptx::cp_async_16(dst + it * kRowStep * kStride * 2, valid ? src + it * src_step : gbase,
                                 valid ? 16 : 0);
            }
        } else {
#pragma unroll
            for (int it = 0; it < kIters; ++it) {
                const int r = r0 + it * kRowStep;
                if ((kRows % kRowStep) != 0 && r >= kRows) break;
                load_chunk(dst + it * kRowStep * kStride * 2, src + it * src_step, gbase, c_valid && r < rows_valid,
                           false);
            }
        }
    } else {
        for_each_chunk<kRows, kChunks, kThreads>(tid, [&](int r, int c) {
            if (c >= chunks_load) return;
            const bool valid = (r < rows_valid) && (c < chunks_valid);
            load_chunk(ptx::smem_addr(smem + r * kStride + c * 8), gbase + r * row_stride + c * 8, gbase, valid,
                       aligned);
        });
    }
}

// Eight elements (16 bytes) from global memory, vector load when aligned.
__device__ __forceinline__ uint4 load8(const uint16_t* src, bool aligned) {
    if (aligned) return *reinterpret_cast<const uint4*>(src);
    uint32_t w[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) w[e] = static_cast<uint32_t>(src[2 * e]) | (static_cast<uint32_t>(src[2 * e + 1]) << 16);
    return make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ void store8(uint16_t* dst, uint4 v, bool aligned) {
    if (aligned) {
        *reinterpret_cast<uint4*>(dst) = v;
    } else {
        const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            dst[2 * e] = static_cast<uint16_t>(w[e] & 0xffffu);
            dst[2 * e + 1] = static_cast<uint16_t>(w[e] >> 16);
        }
    }
}

// Shared-memory tile (row stride kStride elements) -> global rows [0, rows_valid) x chunks [0, chunks_valid).
template <int kRows, int kChunks, int kStride, int kThreads>
__device__ __forceinline__ void store_tile(const uint16_t* smem, uint16_t* gbase, int64_t row_stride, int rows_valid,
                                           int chunks_valid, bool aligned, int tid) {
    for_each_chunk<kRows, kChunks, kThreads>(tid, [&](int r, int c) {
        if (r >= rows_valid || c >= chunks_valid) return;
        const uint4 v = ptx::ld_shared_v4(ptx::smem_addr(smem + r * kStride + c * 8));
        store8(gbase + r * row_stride + c * 8, v, aligned);
    });
}

// 4 bytes global -> shared through L1; src_bytes = 0 writes zeros and reads nothing.
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

#endif  // __CUDACC__

}  // namespace mhakit::generic::detail
