// The backward pass as every kernel family sees it (already validated by csrc/runtime/mha_bwd.cpp).
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "mask.h"
#include "score_mod.h"

namespace mhakit {

struct BwdParams {
    const void* q;
    const void* k;
    const void* v;
    const void* o;
    const float* lse;
    const void* dout;  // dO
    void* dq;
    void* dk;
    void* dv;

    void* workspace;         // >= the instance's workspace_bytes(p), 256-byte aligned; content undefined on entry
    size_t workspace_bytes;

    int64_t q_row_stride, q_head_stride, q_batch_stride;  // elements
    int64_t k_row_stride, k_head_stride, k_batch_stride;
    int64_t v_row_stride, v_head_stride, v_batch_stride;
    int64_t o_row_stride, o_head_stride, o_batch_stride;
    int64_t do_row_stride, do_head_stride, do_batch_stride;
    int64_t dq_row_stride, dq_head_stride, dq_batch_stride;
    int64_t dk_row_stride, dk_head_stride, dk_batch_stride;
    int64_t dv_row_stride, dv_head_stride, dv_batch_stride;
    int64_t lse_head_stride, lse_batch_stride;  // group mode: lse[h * lse_head_stride + seqstart_q[b] + i]

    const int32_t* seqstart_q;  // group mode when non-null (see FwdParams)
    const int32_t* seqstart_k;

    int batch;
    int nhead_q;
    int nhead_k;
    int hdim_q;
    int hdim_v;
    int seqlen_q;      // batch mode
    int seqlen_k;      // batch mode
    int max_seqlen_q;  // batch mode: == seqlen_q
    int max_seqlen_k;  // batch mode: == seqlen_k
    int total_q;       // group mode: rows of the packed q / o / do / dq (the caller's seqlen_q), 0 when not given
    int total_k;       // group mode: rows of the packed k / v / dk / dv (the caller's seqlen_k), 0 when not given

    float scale;
    float scale_log2;  // scale * log2(e)

    int mask_type;
    int window_left;
    int window_right;

    bool deterministic;
    int num_sms;  // multiprocessors of the current device: read by the runtime for deterministic and GQA calls (else 0)

    ScoreMods mods;  // the forward's modifiers (score_mod.h)
    void* dbias;     // elementwise bias: dS in the bias's element type ([b, h, s_q, s_k] by the strides below), or null
    int64_t dbias_row_stride, dbias_head_stride, dbias_batch_stride;
    float* dsink;    // [nhead_q] d sink, or null
};

}  // namespace mhakit
