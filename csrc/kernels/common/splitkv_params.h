// The split-KV (decode) forward as every kernel family sees it: the runtime (csrc/runtime/mha_fwd_splitkv.cpp) has
// validated the call and resolved num_splits; kernels never validate.
#pragma once

#include <stdint.h>

#include "mask.h"

namespace mhakit {

struct SplitkvParams {
    const void* q;
    void* k_cache;
    void* v_cache;
    const void* k_new;  // nullptr when seqlen_new == 0
    const void* v_new;
    void* o;
    float* lse;         // nullptr: do not store LSE
    float* lse_acc;     // [num_splits][batch][nhead_q][seqlen_q] (used when num_splits > 1)
    float* o_acc;       // [num_splits][batch][nhead_q][seqlen_q][hdim_v]

    const int32_t* seqlen_k;         // [batch] cache rows before appending
    const int32_t* block_table;      // nullptr: contiguous cache
    const int32_t* cache_batch_idx;  // nullptr: identity (contiguous caches only)
    int64_t block_table_batch_stride;
    int page_block_size;             // >= 1 with a block table

    int64_t q_row_stride, q_head_stride, q_batch_stride;  // elements
    int64_t k_row_stride, k_head_stride, k_batch_stride;  // batch stride: between pages when paged
    int64_t v_row_stride, v_head_stride, v_batch_stride;
    int64_t knew_row_stride, knew_head_stride, knew_batch_stride;
    int64_t vnew_row_stride, vnew_head_stride, vnew_batch_stride;
    int64_t o_row_stride, o_head_stride, o_batch_stride;
    int64_t lse_head_stride, lse_batch_stride;

    int batch;
    int nhead_q;
    int nhead_k;
    int hdim_q;
    int hdim_v;
    int seqlen_q;
    int seqlen_new;
    int max_seqlen_k;  // bound of seqlen_k[b] (heuristic only; 0 when unknown)

    float scale;
    float scale_log2;

    int mask_type;
    int window_left;
    int window_right;

    int num_splits;  // 0 before the runtime resolves it; >= 1 at launch
    int num_sms;     // multiprocessors of the current device (read once per device by the runtime)
};

}  // namespace mhakit
