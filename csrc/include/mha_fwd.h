// mhakit — fused multi-head attention, forward pass.
//
//   O = softmax(L + mask) · V                     (per batch, per query head; fp32 accumulation)
//   LSE[i] = log Σ_j exp(L_ij)                    (natural log, over the keys row i may see)
// with the logits L_ij = scale_s · q_i·k_j, modified in this order when the score modifiers are set:
//   soft-cap   L = cap · tanh(L / cap)                (logits_soft_cap = cap > 0)
//   bias       L += bias_ij or the ALiBi term         (bias_type, mha_common.h)
//   sink       the softmax denominator gains exp(sink[h]) (sink_ptr; gpt-oss' attention sinks): LSE includes it,
//              and a row that sees no key gets O = 0 and LSE = sink[h]
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
#pragma once

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
} mhakit_fwd_args;

// Runs the forward pass. Returns the mean kernel time in ms when stream_config.time_kernel is set, 0 otherwise,
// or a negative MHAKIT_ERROR_* code (then mhakit_last_error() says what was wrong and nothing was launched,
// except for MHAKIT_ERROR_CUDA).
float mhakit_mha_fwd(const mhakit_fwd_args* args, const mhakit_stream_config* config);

// Name of the kernel instance mhakit_mha_fwd would choose for these arguments, or NULL (with last_error set)
// when the arguments are invalid or unsupported. Launches nothing.
const char* mhakit_mha_fwd_kernel_name(const mhakit_fwd_args* args);

#ifdef __cplusplus
}  // extern "C"

namespace mhakit {
using mha_fwd_args = ::mhakit_fwd_args;
inline float mha_fwd(const mha_fwd_args& args, const stream_config& config) { return ::mhakit_mha_fwd(&args, &config); }
inline const char* mha_fwd_kernel_name(const mha_fwd_args& args) { return ::mhakit_mha_fwd_kernel_name(&args); }
}  // namespace mhakit
#endif
