// mhakit decode family — appending new keys and values into the cache before attending (flash_attn_with_kvcache's
// k / v arguments): new row t of batch b goes to cache row seqlen_k[b] + t, through the same contiguous / paged row
// map the attention kernel reads with. One CTA per (new row, kv head, batch); element-wise copies (a few rows per call).
// decode_tma launches its split kernel as a programmatic dependent of this one (dependent_launch.h), which every CTA
// here triggers at its start (a no-op where nothing depends on it, and below sm_90).
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "../common/dependent_launch.h"
#include "../common/splitkv_params.h"
#include "cache_rows.cuh"

namespace mhakit::decode::detail {

#if defined(__CUDACC__)

template <class Elem>  // 16-bit elements (a template so that every instance's copy of this header links as one)
__global__ void __launch_bounds__(128) append_kv_kernel(const SplitkvParams p) {
    trigger_dependents();
    const int t = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
    const int j = cache_len(p, b) + t;
    Elem* k_dst = cache_rows<false, Elem>(p, b, hk).row(j);
    Elem* v_dst = cache_rows<true, Elem>(p, b, hk).row(j);
    const Elem* k_src = static_cast<const Elem*>(p.k_new) + b * p.knew_batch_stride + t * p.knew_row_stride +
                            hk * p.knew_head_stride;
    const Elem* v_src = static_cast<const Elem*>(p.v_new) + b * p.vnew_batch_stride + t * p.vnew_row_stride +
                            hk * p.vnew_head_stride;
    for (int c = threadIdx.x; c < p.hdim_q; c += blockDim.x) k_dst[c] = k_src[c];
    for (int c = threadIdx.x; c < p.hdim_v; c += blockDim.x) v_dst[c] = v_src[c];
}

#endif  // __CUDACC__

// Launches the append (nothing when there are no new rows).
inline cudaError_t append_kv(const SplitkvParams& p, cudaStream_t stream) {
#if defined(__CUDACC__)
    if (p.seqlen_new <= 0 || p.batch <= 0) return cudaSuccess;
    append_kv_kernel<uint16_t><<<dim3(p.seqlen_new, p.nhead_k, p.batch), 128, 0, stream>>>(p);
    return cudaGetLastError();
#else
    return cudaErrorNotSupported;
#endif
}

}  // namespace mhakit::decode::detail
