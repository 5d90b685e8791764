// mhakit — fused multi-head attention, forward pass.
//
//   O = softmax(L + mask) · V                     (per batch, per query head; fp32 accumulation)
//   LSE[i] = log Σ_j exp(L_ij)                    (natural log, over the keys row i may see)
// with the logits L_ij = scale_s · q_i·k_j, modified in this order when the score modifiers are set:
//   soft-cap   L = cap · tanh(L / cap)                (logits_soft_cap = cap > 0)
//   bias       L += bias_ij or the ALiBi term         (bias_type, mha_common.h)
//   sink       the softmax denominator gains exp(sink[h]) (sink_ptr; gpt-oss' attention sinks): LSE includes it,
//              and a row that sees no key gets O = 0 and LSE = sink[h]
// and, after the softmax, dropout (p_drop > 0; FlashAttention's semantics): each probability P_ij is kept when its
// random byte (Philox4x32-10 keyed by drop_seed, counted from drop_offset, one byte per (b, h, i, j):
// csrc/kernels/common/dropout.h) is <= floor((1 − p_drop)·255), and kept ones are scaled by 1 / (1 − p_drop):
// O = (P ∘ keep / (1 − p_drop))·V, while the LSE stays that of the undropped softmax. drop_seed_ptr /
// drop_offset_ptr (both or neither) give the seed and offset in device memory instead (uint64, read by the kernels
// when they run: CUDA-graph friendly; aiter's drop_prefs). randval_ptr (optional, for tests) receives the random
// bytes (uint8) of at least every score the kernels visit (the generic family: those; the Hopper family: every score
// inside the sequences, i < s_q, j < s_k), (b, h, i, j) at b·batch_stride_randval + h·nhead_stride_randval +
// i·stride_randval + j (group mode: h·nhead_stride_randval + (seqstart_q[b] + i)·stride_randval + j); others are
// left as they were. The backward, given the same p_drop, seed and offset, regenerates the same bytes.
//
// Layout is described entirely by element strides, so b·s·h·d, b·h·s·d, packed b·s·3·h·d and any other strided
// view work without copies. Head dimension is always contiguous (stride 1).
//
// Batch mode: batch sequences of seqlen_q queries and seqlen_k keys each; element (b, h, i, :) of Q lives at
//   q_ptr + b·batch_stride_q + h·nhead_stride_q + i·stride_q.
// Group mode (variable lengths): sequences are packed along the token dimension. seqstart_q_ptr / seqstart_k_ptr
//   are device arrays of batch+1 cumulative offsets (int32); sequence b has seqstart[b+1] - seqstart[b] tokens and
//   its token i lives at row seqstart[b] + i, i.e. q_ptr + h·nhead_stride_q + (seqstart_q[b] + i)·stride_q.
//   batch_stride_* are ignored, and max_seqlen_q must be >= every sequence's query length (it sizes the launch).
//   seqlen_q / seqlen_k give the packed tensors' row counts (seqstart_q[batch] / seqstart_k[batch], as CK's own
//   example passes them): the bound that TMA-based kernels need; 0 when unknown, and such calls run on kernels that
//   need no bound. A value smaller than the real row count gives wrong results, a larger one reads past the tensors.
//   LSE in group mode is indexed [h, seqstart_q[b] + i].
// GQA / MQA: nhead_q must be a multiple of nhead_k; query head h reads key/value head h / (nhead_q / nhead_k).
// Rows that see no key at all (seqlen_k = 0, or a window that excludes every key) get O = 0 and LSE = -inf.
//
// fp8 (data_type MHAKIT_DTYPE_FP8_BF16 or _FP8_FP16; aiter's qscale "pt"): q, k, v hold e4m3 values whose real
// values are q·dq, k·dk, v·dv, with dq = *q_descale_ptr, dk = *k_descale_ptr, dv = *v_descale_ptr (device fp32
// scalars, all three required: pass 1.0 for unscaled data). The logits are L = scale_s·dq·dk·q·k, the LSE is theirs,
// and O = softmax(L + mask)·v·dv in bf16 / fp16. P is rounded to e4m3 for the P·V product (as FlashAttention-3 and
// aiter do; the row sums stay fp32). Forward only, batch mode, no score modifiers or dropout, on the hopper family
// (sm_90a): every stride and base pointer 16-byte aligned, head dims multiples of 8. V is transposed into the
// caller's workspace (mhakit_mha_fwd_workspace_size bytes) by the call itself, so V keeps the layout of every other
// dtype.
#pragma once

#include <stddef.h>

#include "mha_common.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mhakit_fwd_args {
    mhakit_dtype data_type;  // q, k, v, o element type
    int is_group_mode;       // 0: batch mode, 1: group mode (see above)
    int has_lse;             // non-zero: write LSE (fp32) to lse_ptr

    const void* q_ptr;
    const void* k_ptr;
    const void* v_ptr;
    void* o_ptr;
    void* lse_ptr;  // float*, used only when has_lse

    const int32_t* seqstart_q_ptr;  // group mode only: device array [batch + 1]
    const int32_t* seqstart_k_ptr;  // group mode only: device array [batch + 1]

    int seqlen_q;      // batch mode; group mode: rows of the packed q (0: not given)
    int seqlen_k;      // batch mode; group mode: rows of the packed k and v (0: not given)
    int batch;
    int max_seqlen_q;  // group mode: upper bound of the per-sequence query lengths (batch mode: ignored)
    int hdim_q;        // head dim of q and k
    int hdim_v;        // head dim of v and o
    int nhead_q;
    int nhead_k;

    float scale_s;  // softmax scale, finite and > 0 (typically 1/sqrt(hdim_q))

    // Element strides. stride_*: between consecutive tokens; nhead_stride_*: between heads;
    // batch_stride_*: between sequences (batch mode only).
    int64_t stride_q, stride_k, stride_v, stride_o;
    int64_t nhead_stride_q, nhead_stride_k, nhead_stride_v, nhead_stride_o, nhead_stride_lse;
    int64_t batch_stride_q, batch_stride_k, batch_stride_v, batch_stride_o, batch_stride_lse;

    int mask_type;          // mhakit_mask_type
    int window_size_left;   // see mhakit_mask_type; ignored for MHAKIT_MASK_NONE
    int window_size_right;  // see mhakit_mask_type; ignored for MHAKIT_MASK_NONE

    // Score modifiers (see the top of this file); all off when zero / NULL.
    float logits_soft_cap;  // > 0: soft-cap of the logits; 0: off
    int bias_type;          // mhakit_bias_type
    int bias_fp32;          // elementwise bias: 1: fp32 values, 0: values of data_type
    const void* bias_ptr;   // elementwise values or ALiBi slopes (fp32), per bias_type; NULL when bias_type is NONE
    int64_t stride_bias, nhead_stride_bias, batch_stride_bias;  // elements (mhakit_bias_type says which apply)
    const float* sink_ptr;  // [nhead_q] fp32 sink logits, or NULL: no sink

    // Dropout (see the top of this file); off when p_drop is 0.
    float p_drop;                     // drop probability in [0, 1)
    uint64_t drop_seed, drop_offset;  // Philox key and stream offset, used when the pointers below are NULL
    const uint64_t* drop_seed_ptr;    // device uint64 seed and offset (both or neither), read at run time
    const uint64_t* drop_offset_ptr;
    void* randval_ptr;                // optional uint8 random bytes (tests), or NULL
    int64_t stride_randval, nhead_stride_randval, batch_stride_randval;  // elements

    // fp8 only (see the top of this file); NULL for the other dtypes.
    const float* q_descale_ptr;  // device fp32 scalar dq
    const float* k_descale_ptr;  // device fp32 scalar dk
    const float* v_descale_ptr;  // device fp32 scalar dv
    // Scratch memory is the caller's: mhakit_mha_fwd_workspace_size() says how many bytes the chosen kernel needs (fp8:
    // V transposed, after the tile counter in a persistent instance; a persistent fp16 / bf16 Hopper instance: 8, its
    // tile counter; 0 for the others). The library allocates nothing. A persistent 16-bit instance's counter is
    // optional (without a workspace the call runs one CTA per tile, slower on short sequences); a counter needs no
    // zeroing (each call tags it anew) and may hold other scratch between calls, but calls that can run at the same
    // time must not share it (one workspace per stream).
    void* workspace_ptr;     // device scratch of at least that many bytes, MHAKIT_WORKSPACE_ALIGNMENT-aligned (NULL if 0)
    size_t workspace_bytes;  // its size
} mhakit_fwd_args;

// Runs the forward pass. Returns the mean kernel time in ms when stream_config.time_kernel is set, 0 otherwise,
// or a negative MHAKIT_ERROR_* code (then mhakit_last_error() says what was wrong and nothing was launched,
// except for MHAKIT_ERROR_CUDA).
float mhakit_mha_fwd(const mhakit_fwd_args* args, const mhakit_stream_config* config);

// Name of the kernel instance mhakit_mha_fwd would choose for these arguments, or NULL (with last_error set)
// when the arguments are invalid or unsupported. Launches nothing.
const char* mhakit_mha_fwd_kernel_name(const mhakit_fwd_args* args);

// Bytes of workspace mhakit_mha_fwd needs for these arguments (fp8: V transposed, and a persistent instance's tile
// counter; a persistent fp16 / bf16 instance: its tile counter, see workspace_ptr; else 0). On invalid or
// unsupported arguments it returns 0 and last_error says why.
size_t mhakit_mha_fwd_workspace_size(const mhakit_fwd_args* args);

// ---------------------------------------------------------------------------------------------------------------
// Decode against a KV cache: split-KV forward (aiter's mha_fwd_splitkv, FlashAttention's flash_attn_with_kvcache).
//
// Per batch b, query head h (kv head h / (nhead_q / nhead_k)) and query row i < seqlen_q:
//   keys and values are rows 0 .. L_b - 1 of the cache, L_b = seqlen_k_ptr[b] + seqlen_knew; the optional new rows
//   (k_new / v_new, seqlen_knew of them per batch) are first written into the cache at rows seqlen_k_ptr[b] ..
//   L_b - 1, then attended to like every other row (seqlen_k_ptr itself is not changed).
//   The mask sees seqlen_q queries and L_b keys: MHAKIT_MASK_BOTTOM_RIGHT with (-1, 0) is FlashAttention's causal
//   (query row i sees keys j <= i + L_b - seqlen_q), and window sizes work as in mha_fwd.
// Cache row j of batch b, kv head hk lives at
//   contiguous cache (block_table_ptr == NULL):
//       k_cache_ptr + c·batch_stride_k + j·stride_k + hk·nhead_stride_k,  c = cache_batch_idx_ptr ? [b] : b;
//   paged cache (block_table_ptr != NULL; the cache is [num_pages, page_block_size, nhead_k, hdim]):
//       k_cache_ptr + page·batch_stride_k + (j % page_block_size)·stride_k + hk·nhead_stride_k,
//       page = block_table_ptr[b·batch_stride_block_table + j / page_block_size]
//   (batch_stride_k / _v are then the strides between pages). The caller guarantees that the cache holds every row
//   up to L_b - 1 (its capacity, or enough pages in the block table) and that seqlen_k_ptr[b] >= 0.
// Splits: the keys of each (batch, kv head) are cut into num_splits parts computed in parallel; each part writes its
//   normalised O and LSE in fp32 to o_acc_ptr / lse_acc_ptr (caller memory, dense
//   lse_acc[num_splits][batch][nhead_q][seqlen_q] and o_acc[num_splits][batch][nhead_q][seqlen_q][hdim_v]; sizes
//   from mhakit_mha_fwd_splitkv_acc_size), and a combine kernel writes O (and LSE). One split needs no accumulators.
//   num_splits = 0 lets the library choose from the GPU's SM count, batch, heads and max_seqlen_k.
// All query heads of one kv head (and all seqlen_q rows) share one tile, so each K/V byte is read once per group.
// Rows that see no key get O = 0 and LSE = -inf.
typedef struct mhakit_fwd_splitkv_args {
    mhakit_dtype data_type;  // q, k/v cache, new k/v, o element type
    int has_lse;             // non-zero: write LSE (fp32) to lse_ptr, [batch][nhead_q][seqlen_q] by the strides below

    const void* q_ptr;
    void* k_cache_ptr;       // written only where new keys are appended
    void* v_cache_ptr;
    const void* k_new_ptr;   // [batch, seqlen_knew, nhead_k, hdim_q] by its strides; NULL when seqlen_knew == 0
    const void* v_new_ptr;   // [batch, seqlen_knew, nhead_k, hdim_v]
    void* o_ptr;
    void* lse_ptr;           // float*, used only when has_lse
    void* lse_acc_ptr;       // float*, split accumulators (see above); may be NULL when one split is used
    void* o_acc_ptr;         // float*

    const int32_t* seqlen_k_ptr;         // device [batch]: cache rows already filled per batch (before appending)
    const int32_t* block_table_ptr;      // device [batch, max_blocks] page indices, or NULL for a contiguous cache
    const int32_t* cache_batch_idx_ptr;  // device [batch] cache batch of each batch, or NULL (identity); contiguous
                                         // caches only

    int seqlen_q;            // query rows per batch (decode: 1 .. a few)
    int seqlen_knew;         // new k/v rows per batch appended before attending (0: none)
    int max_seqlen_k;        // an upper bound of seqlen_k_ptr[b] (sizes the split heuristic only; 0 when unknown)
    int batch;
    int hdim_q;              // head dim of q and k
    int hdim_v;              // head dim of v and o
    int nhead_q;
    int nhead_k;
    int page_block_size;     // rows per page (>= 1) with block_table_ptr; 0 without
    int num_splits;          // 0: heuristic; 1 .. MHAKIT_MAX_SPLITS

    float scale_s;           // softmax scale, finite and > 0

    // Element strides (head dimension contiguous). stride_*: between tokens; nhead_stride_*: between heads;
    // batch_stride_*: between batches (k / v cache: between pages when paged).
    int64_t stride_q, stride_k, stride_v, stride_knew, stride_vnew, stride_o;
    int64_t nhead_stride_q, nhead_stride_k, nhead_stride_v, nhead_stride_knew, nhead_stride_vnew, nhead_stride_o,
        nhead_stride_lse;
    int64_t batch_stride_q, batch_stride_k, batch_stride_v, batch_stride_knew, batch_stride_vnew, batch_stride_o,
        batch_stride_lse;
    int64_t batch_stride_block_table;  // elements between the block-table rows of consecutive batches

    int mask_type;           // mhakit_mask_type, over seqlen_q queries and L_b keys (see above)
    int window_size_left;
    int window_size_right;
} mhakit_fwd_splitkv_args;

// Appends (when seqlen_knew > 0) and attends. Returns the mean time in ms of all its kernels when timing, 0 otherwise,
// or a negative MHAKIT_ERROR_* code (nothing launched, except for MHAKIT_ERROR_CUDA).
float mhakit_mha_fwd_splitkv(const mhakit_fwd_splitkv_args* args, const mhakit_stream_config* config);

// Name of the split-KV instance the call would run, or NULL (with last_error set). Launches nothing.
const char* mhakit_mha_fwd_splitkv_kernel_name(const mhakit_fwd_splitkv_args* args);

// Bytes of lse_acc and o_acc the call needs (both 0 when it runs one split), and the split count it will use, for
// the current device (num_splits = 0 reads its SM count). Returns 0, or a negative MHAKIT_ERROR_* code.
float mhakit_mha_fwd_splitkv_acc_size(const mhakit_fwd_splitkv_args* args, size_t* lse_acc_bytes,
                                      size_t* o_acc_bytes, int* num_splits);

#ifdef __cplusplus
}  // extern "C"

namespace mhakit {
using mha_fwd_args = ::mhakit_fwd_args;
inline float mha_fwd(const mha_fwd_args& args, const stream_config& config) { return ::mhakit_mha_fwd(&args, &config); }
inline const char* mha_fwd_kernel_name(const mha_fwd_args& args) { return ::mhakit_mha_fwd_kernel_name(&args); }
inline size_t mha_fwd_workspace_size(const mha_fwd_args& args) { return ::mhakit_mha_fwd_workspace_size(&args); }
using mha_fwd_splitkv_args = ::mhakit_fwd_splitkv_args;
inline float mha_fwd_splitkv(const mha_fwd_splitkv_args& args, const stream_config& config) {
    return ::mhakit_mha_fwd_splitkv(&args, &config);
}
inline const char* mha_fwd_splitkv_kernel_name(const mha_fwd_splitkv_args& args) {
    return ::mhakit_mha_fwd_splitkv_kernel_name(&args);
}
inline float mha_fwd_splitkv_acc_size(const mha_fwd_splitkv_args& args, size_t* lse_acc_bytes, size_t* o_acc_bytes,
                                      int* num_splits) {
    return ::mhakit_mha_fwd_splitkv_acc_size(&args, lse_acc_bytes, o_acc_bytes, num_splits);
}
}  // namespace mhakit
#endif
