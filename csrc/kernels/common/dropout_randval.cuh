// Dropout's randval store (tests: mha_fwd.h's randval_ptr, aiter's -s_randval=1) as a kernel of its own: the random
// byte of every score inside the sequences (i < s_q, j < s_k of each (b, h)), one dropout_byte per element, so that
// the attention kernel that uses the bytes carries no store code (in the Hopper forward's modifier instances that
// code alone made the d256 instance spill). The bytes depend on (seed, offset, b, h, i, j) only (dropout.h), so they
// are the ones the attention kernel draws. Its cost is of no concern (tests): each byte takes a Philox call.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "dropout_lanes.cuh"  // drop_key

namespace mhakit {

struct RandvalArgs {
    Dropout drop;                // on, seed / offset (or their device pointers), randval and its strides
    const int32_t* seqstart_q;   // group mode: [batch + 1] packed row offsets; batch mode: null
    const int32_t* seqstart_k;
    int seqlen_q, seqlen_k;      // batch mode
    int nhead_q;
};

#if defined(__CUDACC__)

// A CTA writes 16 rows of one (b, h): grid (ceil(max_seqlen_q / 16), nhead_q, batch). A template, so that each
// instance's object may hold a copy (and only the instances that call it emit it).
constexpr int kRandvalRows = 16, kRandvalThreads = 256;
template <int kThreads = kRandvalThreads>
__global__ void __launch_bounds__(kThreads) randval_kernel(RandvalArgs a) {
    const int b = int(blockIdx.z), h = int(blockIdx.y);
    int sq = a.seqlen_q, sk = a.seqlen_k;
    int64_t base = int64_t(b) * a.drop.randval_batch;
    if (a.seqstart_q != nullptr) {
        const int q0 = a.seqstart_q[b];
        sq = a.seqstart_q[b + 1] - q0;
        sk = a.seqstart_k[b + 1] - a.seqstart_k[b];
        base = int64_t(q0) * a.drop.randval_row;
    }
    const int i0 = int(blockIdx.x) * kRandvalRows;
    if (i0 >= sq || sk <= 0) return;
    const int rows = sq - i0 < kRandvalRows ? sq - i0 : kRandvalRows;
    const DropKey key = drop_key(a.drop);
    const uint32_t bh = uint32_t(b) * uint32_t(a.nhead_q) + uint32_t(h);
    uint8_t* rv = a.drop.randval + base + int64_t(h) * a.drop.randval_head;
    for (int64_t e = threadIdx.x; e < int64_t(rows) * sk; e += kThreads) {
        const int i = i0 + int(e / sk), j = int(e % sk);
        rv[int64_t(i) * a.drop.randval_row + j] = uint8_t(dropout_byte(key.seed, key.offset, bh, i, j));
    }
}

template <int kThreads = kRandvalThreads>
cudaError_t launch_randval(const RandvalArgs& a, int max_seqlen_q, int batch, cudaStream_t stream) {
    const dim3 grid(unsigned((max_seqlen_q + kRandvalRows - 1) / kRandvalRows), unsigned(a.nhead_q), unsigned(batch));
    randval_kernel<kThreads><<<grid, kThreads, 0, stream>>>(a);
    return cudaGetLastError();
}

#endif  // __CUDACC__

}  // namespace mhakit
