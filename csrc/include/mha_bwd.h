// mhakit — fused multi-head attention, backward pass.
//
// Given the forward's Q, K, V, O and LSE and the incoming gradient dO, computes
//   P = exp(scale·Q·Kᵀ − LSE) (masked), dV = Pᵀ·dO, dP = dO·Vᵀ, D = rowsum(dO ∘ O), dS = P ∘ (dP − D),
//   dQ = scale·dS·K, dK = scale·dSᵀ·Q.
// Shapes, modes (batch / group), GQA/MQA, head dims (d ≠ d_v allowed) and masks mean exactly what they mean in
// mha_fwd.h; every tensor has its own element strides, so dQ/dK/dV may use layouts different from Q/K/V. With GQA,
// dK/dV of a key head are the sums over the query heads that read it. LSE is the forward's (fp32, natural log,
// indexed like the forward's: [b, h, s_q] by batch_stride_lse / nhead_stride_lse, or [h, total_q] in group mode).
//
// Score modifiers (logits_soft_cap, bias_type / bias_ptr, sink_ptr) mean what they mean in mha_fwd.h and must be
// the forward's: dS is then the gradient of the modified logits (dQ and dK go on through the soft-cap's derivative
// cap·tanh' = 1 − tanh²). With an elementwise bias, dbias_ptr (optional) receives dS itself, one element per
// (sequence, query head, query, key) at b·batch_stride_dbias + h·nhead_stride_dbias + i·stride_dbias + j, in the
// bias's element type; every element of the sequences' [s_q, s_k] blocks is written. With a sink, dsink_ptr
// (optional, [nhead_q] fp32) receives d sink[h] = −Σ_(b,i) exp(sink[h] − LSE_bhi)·D_bhi, D = rowsum(dO ∘ O)
// (written, not accumulated).
// Dropout (p_drop, drop_seed / drop_offset or their device pointers) must be the forward's: the backward regenerates
// its random bytes, so dV = (P ∘ keep / (1 − p))ᵀ·dO and dS = P ∘ (dP ∘ keep / (1 − p) − D), D = rowsum(dO ∘ O).
//
// Scratch memory is the caller's: mhakit_mha_bwd_workspace_size() says how many bytes the chosen kernel needs for
// these arguments (fp32 dQ accumulation, the dot(dO, O) vector, fp32 dK/dV partials for GQA, per-split buffers in
// deterministic mode); pass at least that much as workspace_ptr / workspace_bytes. The library allocates nothing.
// `deterministic` asks for bitwise-identical results run to run (dQ is reduced in a fixed order, at some cost).
#pragma once

#include <stddef.h>

#include "mha_common.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mhakit_bwd_args {
    mhakit_dtype data_type;  // q, k, v, o, do, dq, dk, dv element type
    int is_group_mode;       // 0: batch mode, 1: group mode (see mha_fwd.h)
    int deterministic;       // non-zero: bitwise reproducible dQ/dK/dV

    const void* q_ptr;
    const void* k_ptr;
    const void* v_ptr;
    const void* o_ptr;
    const void* lse_ptr;  // const float*, the forward's LSE
    const void* do_ptr;
    void* dq_ptr;
    void* dk_ptr;
    void* dv_ptr;

    void* workspace_ptr;     // device scratch of at least mhakit_mha_bwd_workspace_size() bytes (NULL if that is 0)
    size_t workspace_bytes;  // its size

    const int32_t* seqstart_q_ptr;  // group mode only: device array [batch + 1]
    const int32_t* seqstart_k_ptr;  // group mode only: device array [batch + 1]

    int seqlen_q;      // batch mode; group mode: rows of the packed q / o / do / dq (0: not given; see mha_fwd.h)
    int seqlen_k;      // batch mode; group mode: rows of the packed k / v / dk / dv (0: not given)
    int batch;
    int max_seqlen_q;  // group mode: >= every sequence's query length
    int max_seqlen_k;  // group mode: >= every sequence's key length
    int hdim_q;
    int hdim_v;
    int nhead_q;
    int nhead_k;

    float scale;  // the forward's softmax scale, finite and > 0

    // Element strides: between tokens, between heads, between sequences (batch mode only).
    int64_t stride_q, stride_k, stride_v, stride_o, stride_do, stride_dq, stride_dk, stride_dv;
    int64_t nhead_stride_q, nhead_stride_k, nhead_stride_v, nhead_stride_o, nhead_stride_do;
    int64_t nhead_stride_dq, nhead_stride_dk, nhead_stride_dv, nhead_stride_lse;
    int64_t batch_stride_q, batch_stride_k, batch_stride_v, batch_stride_o, batch_stride_do;
    int64_t batch_stride_dq, batch_stride_dk, batch_stride_dv, batch_stride_lse;

    int mask_type;  // mhakit_mask_type, with the forward's window semantics
    int window_size_left;
    int window_size_right;

    // Score modifiers: the forward's (see mha_fwd.h), and their gradients (see above); all off when zero / NULL.
    float logits_soft_cap;
    int bias_type;
    int bias_fp32;
    const void* bias_ptr;
    int64_t stride_bias, nhead_stride_bias, batch_stride_bias;
    const float* sink_ptr;
    void* dbias_ptr;  // elementwise bias only: dS in the bias's element type, or NULL
    int64_t stride_dbias, nhead_stride_dbias, batch_stride_dbias;
    float* dsink_ptr;  // with sink_ptr only: [nhead_q] fp32, or NULL

    // Dropout: the forward's (mha_fwd.h); off when p_drop is 0.
    float p_drop;
    uint64_t drop_seed, drop_offset;
    const uint64_t* drop_seed_ptr;
    const uint64_t* drop_offset_ptr;
} mhakit_bwd_args;

// Bytes of workspace mhakit_mha_bwd needs for these arguments (may be 0). On invalid or unsupported arguments it
// returns 0 and sets last_error; check mhakit_last_error()[0] to tell "needs none" from "failed".
size_t mhakit_mha_bwd_workspace_size(const mhakit_bwd_args* args);

// Runs the backward pass. Return value and errors as mhakit_mha_fwd; MHAKIT_ERROR_INVALID_ARGS also when the
// workspace is missing or too small (nothing is launched then).
float mhakit_mha_bwd(const mhakit_bwd_args* args, const mhakit_stream_config* config);

// Name of the kernel instance mhakit_mha_bwd would choose, or NULL with last_error set. Launches nothing.
const char* mhakit_mha_bwd_kernel_name(const mhakit_bwd_args* args);

#ifdef __cplusplus
}  // extern "C"

namespace mhakit {
using mha_bwd_args = ::mhakit_bwd_args;
inline float mha_bwd(const mha_bwd_args& args, const stream_config& config) { return ::mhakit_mha_bwd(&args, &config); }
inline size_t mha_bwd_workspace_size(const mha_bwd_args& args) { return ::mhakit_mha_bwd_workspace_size(&args); }
inline const char* mha_bwd_kernel_name(const mha_bwd_args& args) { return ::mhakit_mha_bwd_kernel_name(&args); }
}  // namespace mhakit
#endif
