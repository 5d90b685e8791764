// The forward pass as every kernel family sees it: plain pointers, element strides, sizes, and a mask already
// checked by the runtime (csrc/runtime/mha_fwd.cpp). Kernels never validate; the runtime never launches invalid input.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "mask.h"
#include "score_mod.h"

namespace mhakit {

struct FwdParams {
    const void* q;
    const void* k;
    const void* v;
    void* o;
    float* lse;  // nullptr: do not store LSE

    int64_t q_row_stride, q_head_stride, q_batch_stride;  // elements
    int64_t k_row_stride, k_head_stride, k_batch_stride;
    int64_t v_row_stride, v_head_stride, v_batch_stride;
    int64_t o_row_stride, o_head_stride, o_batch_stride;
    int64_t lse_head_stride, lse_batch_stride;  // lse_batch_stride unused in group mode

    // Group mode when non-null: sequence b owns rows [seqstart[b], seqstart[b+1]) of the packed tensors, and the
    // LSE of its row i is lse[h * lse_head_stride + seqstart_q[b] + i]. Batch strides are then ignored.
    const int32_t* seqstart_q;
    const int32_t* seqstart_k;

    int batch;
    int nhead_q;
    int nhead_k;    // nhead_q % nhead_k == 0; query head h reads kv head h / (nhead_q / nhead_k)
    int hdim_q;     // real head dims (<= the instance's compiled bucket; any value the catalogue's [head_dims] accepts)
    int hdim_v;
    int seqlen_q;   // batch mode
    int seqlen_k;   // batch mode
    int max_seqlen_q;  // batch mode: == seqlen_q; group mode: bound used to size the grid
    int total_q;       // group mode: rows of the packed q / o (the caller's seqlen_q), 0 when not given
    int total_k;       // group mode: rows of the packed k / v (the caller's seqlen_k), 0 when not given

    float scale;       // softmax scale applied to q·k
    float scale_log2;  // scale * log2(e), for exp2-based softmax

    int mask_type;     // mhakit_mask_type; turn into per-sequence (y, x) with make_mask_coord()
    int window_left;
    int window_right;

    ScoreMods mods;    // soft-cap, bias / ALiBi, sink (score_mod.h); mods.any == false: none of them

    // fp8 instances only (mha_fwd.h): device fp32 descale factors of q, k, v, and the caller's workspace (V transposed).
    const float* descale_q;
    const float* descale_k;
    const float* descale_v;
    void* workspace;
    size_t workspace_bytes;
    // Persistent Hopper instances (catalogue `persistent`): the current device's multiprocessors, read by the runtime
    // when such an instance got a workspace for its tile counter (0 otherwise: the one-tile grid).
    int num_sms = 0;
    // ... and the call's tag of that counter (nonzero, a new one per call: DynamicPersistentScheduler).
    unsigned counter_epoch = 0;
};

// Lengths and row offsets of one sequence, in either mode.
struct SeqInfo {
    int seqlen_q, seqlen_k;
    int64_t q_offset, k_offset, v_offset, o_offset;  // element offsets of (this sequence, head 0, row 0)
    int64_t lse_offset;                              // element offset of (this sequence, head 0, row 0) in lse
};

#if defined(__CUDACC__) || defined(__HIPCC__)
__device__ __forceinline__ SeqInfo seq_info(const FwdParams& p, int b) {
    SeqInfo s;
    if (p.seqstart_q != nullptr) {
        const int q0 = p.seqstart_q[b], k0 = p.seqstart_k[b];
        s.seqlen_q = p.seqstart_q[b + 1] - q0;
        s.seqlen_k = p.seqstart_k[b + 1] - k0;
        s.q_offset = q0 * p.q_row_stride;
        s.k_offset = k0 * p.k_row_stride;
        s.v_offset = k0 * p.v_row_stride;
        s.o_offset = q0 * p.o_row_stride;
        s.lse_offset = q0;
    } else {
        s.seqlen_q = p.seqlen_q;
        s.seqlen_k = p.seqlen_k;
        s.q_offset = b * p.q_batch_stride;
        s.k_offset = b * p.k_batch_stride;
        s.v_offset = b * p.v_batch_stride;
        s.o_offset = b * p.o_batch_stride;
        s.lse_offset = b * p.lse_batch_stride;
    }
    return s;
}
#endif

}  // namespace mhakit
