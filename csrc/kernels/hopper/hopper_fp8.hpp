// mhakit hopper family — the pieces of the fp8 (e4m3) forward that the 16-bit one does not need.
//
// The fp8 wgmma takes both shared-memory operands K-major. Q·Kᵀ is fine as the tensors come (both contiguous over the
// head dim), but P·V reduces over keys, so its B operand must be V transposed, contiguous over keys. And P, which
// the P·V wgmma takes from registers as its A operand, does not sit in the S accumulator's registers the way the
// 8-bit A operand wants it: per 16 keys, the accumulator gives lane quad-index t the keys {2t, 2t+1, 2t+8, 2t+9} of
// its two rows, while the A operand wants keys 4t .. 4t+3 in one register. Rather than trade bytes between lanes
// (CUTLASS' Hopper example) or permute V's columns in shared memory (FlashAttention-3), we let the key order differ
// between the two: P is packed into the A registers as the thread holds it, so A's key slot 4t + i (within each
// aligned group of 16) carries key vt_key_of_slot(4t + i) = 2t + (i & 1) + 8·(i >> 1), and the transposed V, which we
// write ourselves before the attention kernel runs (transpose_v_fp8), puts that same key's values in slot 4t + i.
// P·V sums over keys, so the product is unchanged.
//
//   vt_key_of_slot      the key a slot carries (both sides of the contract)
//   pack_p_fp8          S/P accumulator (fp32, rows x keys) -> the A operand registers of P·V (e4m3)
//   VtLayout            the transposed V in the workspace: [batch][nhead_k][hdim_v][keys rounded up to 16]
//   transpose_v_fp8     V (any 16-byte aligned strides) -> VtLayout, slots permuted, zero past the last key
//   fill_no_keys        O = 0 and LSE = -inf for calls without keys (no TMA descriptor can have a zero extent)
#pragma once

#include <cmath>
#include <cstdint>

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"

namespace mhakit::hopper {

// Slot s (0 .. 15) of an aligned group of 16 keys carries key vt_key_of_slot(s) of that group. A bijection of 0 .. 15:
// s = 4t + 2a + b  <->  key 2t + b + 8a  (t = 0..3, a, b = 0..1).
CUTLASS_HOST_DEVICE constexpr int vt_key_of_slot(int s) { return 2 * (s >> 2) + (s & 1) + 8 * ((s >> 1) & 1); }

namespace detail {
CUTLASS_DEVICE uint32_t e4m3x4(float a, float b, float c, float d) {
    // __nv_cvt_float2_to_fp8x2 puts .x in the low byte: bytes (a, b, c, d) from low to high.
    const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
    const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3);
    return lo | (hi << 16);
}
}  // namespace detail

// The A operand tensor of the fp8 P·V wgmma for kBlockN keys: per 32-key k-block, the 16 values of the SM90 8-bit
// register A layout (value (v, r, h) = row g + 8r, slot 4t + v + 16h of lane 4g + t), compact, so that register j of
// k-block kb holds values 4j .. 4j + 3 (a0 .. a3 of the instruction).
template <class Element, int kBlockN>
CUTLASS_DEVICE auto make_p_operand_fp8() {
    using namespace cute;
    static_assert(kBlockN % 32 == 0, "fp8 P·V: kBlockN a multiple of 32 (the wgmma's k step)");
    return make_tensor<Element>(Layout<Shape<Shape<_4, _2, _2>, _1, Int<kBlockN / 32>>>{});
}

// acc_s: the S/P accumulator of one warpgroup (fp32, the SM90 C layout: value index v + 2r + 4j is row g + 8r, key
// 2t + v + 8j); p: make_p_operand_fp8. Register w = r + 2h + 4kb of p (row g + 8r, slots 4t .. 4t + 3 of the
// 16-key group 2kb + h) gets the thread's values c0, c0 + 1, c0 + 4, c0 + 5 with c0 = 2r + 8h + 16kb: keys 2t, 2t + 1,
// 2t + 8, 2t + 9 of that group, which vt_key_of_slot assigns to those slots.
template <class TensorS, class TensorP>
CUTLASS_DEVICE void pack_p_fp8(TensorS const& acc_s, TensorP& p) {
    using namespace cute;
    constexpr int kValues = decltype(size(acc_s))::value;
    static_assert(decltype(size(p))::value == kValues && kValues % 16 == 0);
    float const* s = raw_pointer_cast(acc_s.data());
    uint32_t* d = reinterpret_cast<uint32_t*>(raw_pointer_cast(p.data()));
    CUTLASS_PRAGMA_UNROLL
    for (int w = 0; w < kValues / 4; ++w) {
        const int c0 = 2 * (w & 1) + 8 * ((w >> 1) & 1) + 16 * (w >> 2);
        d[w] = detail::e4m3x4(s[c0], s[c0 + 1], s[c0 + 4], s[c0 + 5]);
    }
}

// The transposed V in the caller's workspace: element (b, hk, d, slot) at ((b·nhead_k + hk)·hdim_v + d)·keys + slot,
// keys = seqlen_k rounded up to 16 (whole slot groups; every slot written, zero where its key is past seqlen_k).
struct VtLayout {
    int64_t keys;  // the key extent TMA sees: seqlen_k rounded up to 16 (slot keys_real .. keys - 1 may hold real keys)
    int64_t d_stride, head_stride, batch_stride;  // elements (bytes)

    CUTLASS_HOST_DEVICE static VtLayout of(int batch, int nhead_k, int hdim_v, int seqlen_k) {
        (void)batch;
        const int64_t keys = (int64_t(seqlen_k) + 15) / 16 * 16;
        return VtLayout{keys, keys, keys * hdim_v, keys * hdim_v * nhead_k};
    }
    static size_t bytes(int batch, int nhead_k, int hdim_v, int seqlen_k) {
        return size_t(of(batch, nhead_k, hdim_v, seqlen_k).batch_stride) * size_t(batch);
    }
};

struct TransposeVArgs {
    const uint8_t* v;  // element (b, key, hk, d) at b·v_batch + key·v_row + hk·v_head + d; base and strides 16-byte
    int64_t v_row, v_head, v_batch;  // multiples (the family's align_bytes guard)
    uint8_t* vt;                     // VtLayout
    VtLayout layout;
    int seqlen_k, hdim_v, nhead_k;
};

// One CTA of 256 threads: 64 slots x 64 columns of one (b, hk). grid: (slot blocks x column blocks, nhead_k, batch).
// (A template, as every kernel of this header-only family, so that each instance's object may hold a copy.)
constexpr int kVtTileKeys = 64, kVtTileCols = 64, kVtThreads = 256;
template <int kThreads = kVtThreads>
__global__ void __launch_bounds__(kThreads) transpose_v_fp8(TransposeVArgs a) {
    static_assert(kThreads == 4 * kVtTileKeys && kThreads == 4 * kVtTileCols, "one 16-byte chunk per thread");
    __shared__ alignas(16) uint8_t tile[kVtTileKeys][kVtTileCols + 16];  // keys x columns, 16-byte row padding
    const int key_blocks = int((a.layout.keys + kVtTileKeys - 1) / kVtTileKeys);
    const int k0 = int(blockIdx.x % key_blocks) * kVtTileKeys;
    const int c0 = int(blockIdx.x / key_blocks) * kVtTileCols;
    const int hk = blockIdx.y, b = blockIdx.z;
    const int t = threadIdx.x;
    {  // 64 keys x 4 chunks of 16 columns: one 16-byte load per thread (zero past the keys and the head dim)
        const int r = t >> 2, c = (t & 3) * 16;
        const int key = k0 + r, col = c0 + c;
        uint4 val = make_uint4(0, 0, 0, 0);
        if (key < a.seqlen_k && col < a.hdim_v) {
            const uint8_t* src = a.v + int64_t(b) * a.v_batch + int64_t(hk) * a.v_head + int64_t(key) * a.v_row + col;
            if (col + 16 <= a.hdim_v) {
                val = *reinterpret_cast<const uint4*>(src);
            } else {  // the row's last, partial chunk (head dims that are multiples of 8, not 16): 8 bytes
                const uint2 half = *reinterpret_cast<const uint2*>(src);
                val = make_uint4(half.x, half.y, 0, 0);
            }
        }
        *reinterpret_cast<uint4*>(&tile[r][c]) = val;
    }
    __syncthreads();
    {  // 64 columns x 4 slot groups: one 16-byte store of 16 slots per thread, each slot from its key's row
        const int col = c0 + (t >> 2), g = t & 3;
        const int64_t slot0 = int64_t(k0) + 16 * g;
        if (col < a.hdim_v && slot0 < a.layout.keys) {
            uint32_t w[4] = {0, 0, 0, 0};  // slot s in byte s % 4 of word s / 4 (little endian, as the uint4 stores)
#pragma unroll
            for (int s = 0; s < 16; ++s) w[s / 4] |= uint32_t(tile[16 * g + vt_key_of_slot(s)][t >> 2]) << (8 * (s % 4));
            uint8_t* dst = a.vt + int64_t(b) * a.layout.batch_stride + int64_t(hk) * a.layout.head_stride +
                           int64_t(col) * a.layout.d_stride + slot0;
            *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
        }
    }
}

// (A template too, so that only the fp8 instances that call it emit the kernel.)
template <int kThreads = kVtThreads>
cudaError_t launch_transpose_v_fp8(const TransposeVArgs& a, int batch, cudaStream_t stream) {
    const int64_t key_blocks = (a.layout.keys + kVtTileKeys - 1) / kVtTileKeys;
    const int64_t col_blocks = (a.hdim_v + kVtTileCols - 1) / kVtTileCols;
    const dim3 grid(unsigned(key_blocks * col_blocks), unsigned(a.nhead_k), unsigned(batch));
    transpose_v_fp8<kThreads><<<grid, kThreads, 0, stream>>>(a);
    return cudaGetLastError();
}

// O = 0 (hdim_v columns of every row) and LSE = -inf, for a batch-mode call whose sequences have no key. A warp per
// row (8 rows per block of 32 x 8 threads); grid: (row blocks, nhead_q, batch).
template <class ElementOut>
__global__ void fill_no_keys(ElementOut* o, int64_t o_row, int64_t o_head, int64_t o_batch, float* lse,
                             int64_t lse_head, int64_t lse_batch, int seqlen_q, int hdim_v) {
    const int h = blockIdx.y, b = blockIdx.z;
    const int row = blockIdx.x * blockDim.y + threadIdx.y;
    if (row >= seqlen_q) return;
    ElementOut* dst = o + int64_t(b) * o_batch + int64_t(h) * o_head + int64_t(row) * o_row;
    for (int c = threadIdx.x; c < hdim_v; c += blockDim.x) dst[c] = ElementOut(0.f);
    if (lse != nullptr && threadIdx.x == 0) lse[int64_t(b) * lse_batch + int64_t(h) * lse_head + row] = -INFINITY;
}

template <class ElementOut>
cudaError_t launch_fill_no_keys(ElementOut* o, int64_t o_row, int64_t o_head, int64_t o_batch, float* lse,
                                int64_t lse_head, int64_t lse_batch, int batch, int nhead_q, int seqlen_q, int hdim_v,
                                cudaStream_t stream) {
    const dim3 block(32, 8);
    const dim3 grid(unsigned((seqlen_q + 7) / 8), unsigned(nhead_q), unsigned(batch));
    fill_no_keys<ElementOut><<<grid, block, 0, stream>>>(o, o_row, o_head, o_batch, lse, lse_head, lse_batch,
                                                         seqlen_q, hdim_v);
    return cudaGetLastError();
}

}  // namespace mhakit::hopper
