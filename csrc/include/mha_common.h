// mhakit — types shared by the forward and backward APIs.
//
// Everything here is plain C so that one struct layout serves both the C++ API (namespace mhakit) and the
// extern "C" entry points used by FFI callers (ctypes, cffi, Rust, ...). No STL types and no exceptions cross
// the library boundary.
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Element type of q, k, v, o (and of the gradients in the backward pass). LSE is always fp32.
//   FP8_BF16 / FP8_FP16 (forward only, mhakit_mha_fwd): q, k, v in fp8 e4m3 (OCP e4m3fn: 1 sign, 4 exponent, 3
//   mantissa bits, max 448, no infinities) with per-tensor fp32 descale factors (mha_fwd.h), o in bf16 / fp16, as
//   aiter's "fp8bf16" names it. The output type is part of the value so that a zero-initialised struct never picks one
//   silently.
typedef enum mhakit_dtype {
    MHAKIT_DTYPE_FP16 = 0,
    MHAKIT_DTYPE_BF16 = 1,
    MHAKIT_DTYPE_FP8_BF16 = 2,
    MHAKIT_DTYPE_FP8_FP16 = 3,
} mhakit_dtype;

// Mask kinds, numbered as CK / aiter number them so that existing scripts keep their meaning.
//   NONE          no mask (keys past seqlen_k are never visible, of course).
//   TOP_LEFT      window anchored at the top-left corner:     i - left <= j <= i + right.
//   BOTTOM_RIGHT  window anchored at the bottom-right corner: i + (sk - sq) - left <= j <= i + (sk - sq) + right.
//                 For both: left < 0 means unbounded to the left, right < 0 unbounded to the right;
//                 (left, right) = (-1, 0) is causal.
//   GENERIC       CK's raw generic coordinate: window_size_left = y, window_size_right = x, and row i sees
//                 keys j with i - y + 1 <= j < min(i + x, sk).
typedef enum mhakit_mask_type {
    MHAKIT_MASK_NONE = 0,
    MHAKIT_MASK_TOP_LEFT = 1,
    MHAKIT_MASK_BOTTOM_RIGHT = 2,
    MHAKIT_MASK_GENERIC = 3,
} mhakit_mask_type;

// Bias kinds (bias_type of the argument structs), numbered as CK / aiter number them.
//   NONE         no bias.
//   ELEMENTWISE  bias_ptr holds one value per (sequence b, query head h, query i, key j), at
//                b·batch_stride_bias + h·nhead_stride_bias + i·stride_bias + j (a zero stride broadcasts: [1|b, 1|h,
//                s_q, s_k]); fp32 (bias_fp32 = 1) or the data type. i and j count from each sequence's start in group
//                mode too.
//   ALIBI        bias_ptr holds fp32 slopes, slope(b, h) at b·batch_stride_bias + h·nhead_stride_bias ([h]: batch
//                stride 0; [b, h]: batch stride nhead_q), and the bias is -slope·|i + s_k - s_q - j| (bottom-right
//                aligned like FlashAttention's, per sequence in group mode, whatever the mask).
typedef enum mhakit_bias_type {
    MHAKIT_BIAS_NONE = 0,
    MHAKIT_BIAS_ELEMENTWISE = 1,
    MHAKIT_BIAS_ALIBI = 2,
} mhakit_bias_type;

// The score-modifier kinds a call can use, as bits (the catalogue's score_mods names, upper-cased: a family's
// `score_mods` lists which of them its plain and its modifier ("_mods") instances serve; the runtime compares a call's
// kinds, ScoreMods::kinds, with an instance's; the Python front end asks its JIT for a library by the same bits).
typedef enum mhakit_score_mod {
    MHAKIT_MOD_SOFTCAP = 1,   // logits_soft_cap > 0
    MHAKIT_MOD_BIAS = 2,      // bias_type ELEMENTWISE
    MHAKIT_MOD_ALIBI = 4,     // bias_type ALIBI
    MHAKIT_MOD_SINK = 8,      // sink_ptr
    MHAKIT_MOD_DROPOUT = 16,  // p_drop > 0
} mhakit_score_mod;

// Return codes of mha_fwd / mha_bwd. A non-negative value is the kernel time in ms (0 when not timing).
enum {
    MHAKIT_ERROR_UNSUPPORTED = -1,   // arguments are valid, but no built kernel serves these traits (a rebuild with
                                     // other instances, or for this GPU's arch, would)
    MHAKIT_ERROR_INVALID_ARGS = -2,  // arguments are inconsistent or out of range; nothing was launched
    MHAKIT_ERROR_CUDA = -3,          // no CUDA device/driver is available, or the CUDA runtime reported an error
                                     // during launch or timing
};

// Limits of every call, forward and backward (beyond them a call returns MHAKIT_ERROR_INVALID_ARGS and says which):
//   batch                  0 .. MHAKIT_MAX_BATCH      (the kernels give each sequence a row of a CUDA grid dimension)
//   nhead_q                1 .. MHAKIT_MAX_NHEAD      (likewise each query head); nhead_k divides nhead_q
//   hdim_q, hdim_v         1 .. MHAKIT_MAX_HDIM on CUDA (ROCm: multiples of 8); the backend's catalogue [head_dims]
//   seqlen_*, max_seqlen_* 0 .. INT32_MAX; group-mode offsets (seqstart_*) are int32, so a batch's total is too
//   strides                >= 0, in elements; the head dimension is contiguous (stride 1)
//   pointers               aligned to their element: 2 bytes for fp16/bf16 tensors (fp8: q, k, v any byte, o 2), 4 for
//                          LSE (fp32), seqstart (int32) and fp8 descale factors, MHAKIT_WORKSPACE_ALIGNMENT for a
//                          workspace
// Faster kernel families add run-time guards of their own (16-byte alignment, ...); a call they refuse runs on the
// generic family, never fails because of them.
enum {
    MHAKIT_MAX_BATCH = 65535,
    MHAKIT_MAX_NHEAD = 65535,
    MHAKIT_MAX_HDIM = 256,
    MHAKIT_WORKSPACE_ALIGNMENT = 256,
    MHAKIT_MAX_SPLITS = 128,  // split-KV: the most parts one (batch, kv head) is cut into
};

// How to run: which stream, and whether to time. Mirrors ck_tile::stream_config as aiter uses it.
typedef struct mhakit_stream_config {
    void* stream;        // cudaStream_t; NULL is the legacy default stream
    int time_kernel;     // non-zero: run warmup + repeat times and return the mean time per call in ms
    int log_level;       // > 0: print the name of the chosen kernel instance to stdout
    int warmup;          // untimed runs before timing (used only when time_kernel)
    int repeat;          // timed runs (used only when time_kernel); values < 1 are treated as 1
    int gpu_timer;       // non-zero: CUDA events; zero: host clock around a synchronised loop
} mhakit_stream_config;

// One sentence describing the last failure on the calling thread ("" when the last call succeeded).
const char* mhakit_last_error(void);

#ifdef __cplusplus
}  // extern "C"

namespace mhakit {
using stream_config = ::mhakit_stream_config;
inline const char* last_error() { return ::mhakit_last_error(); }
}  // namespace mhakit
#endif
