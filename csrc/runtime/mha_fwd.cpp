// The forward API: validate the arguments, turn them into kernel parameters, choose an instance, launch, time.
//
// Order matters and is the contract of mha_fwd.h: validation and instance choice touch no CUDA API (so they run,
// and are tested, on machines without a GPU); nothing is launched unless both succeed.
#include <cuda_runtime.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <vector>

#include "kernels/common/fwd_params.h"
#include "mha_fwd.h"
#include "runtime/device.h"
#include "runtime/error.h"
#include "runtime/fwd_registry.h"

#define MHAKIT_EXPORT extern "C" __attribute__((visibility("default")))

namespace mhakit {
namespace {

constexpr int kMaxHdim = 256;
// Window sizes beyond any sequence length select the same keys as this bound; clamping keeps the kernels' mask
// arithmetic (sums of lengths and window sizes) inside int32.
constexpr int kWindowBound = 1 << 29;

int clamp_window(int w) { return w < -kWindowBound ? -kWindowBound : (w > kWindowBound ? kWindowBound : w); }

const char* dtype_name(int dtype) { return dtype == MHAKIT_DTYPE_FP16 ? "fp16" : dtype == MHAKIT_DTYPE_BF16 ? "bf16" : "?"; }

// Returns 0 when the arguments are consistent, else MHAKIT_ERROR_INVALID_ARGS with last_error set.
float validate(const mhakit_fwd_args& a) {
    const int E = MHAKIT_ERROR_INVALID_ARGS;
    if (a.data_type != MHAKIT_DTYPE_FP16 && a.data_type != MHAKIT_DTYPE_BF16)
        return fail(E, "data_type %d is not supported: use MHAKIT_DTYPE_FP16 (0) or MHAKIT_DTYPE_BF16 (1)", a.data_type);
    if (!(std::isfinite(a.scale_s) && a.scale_s > 0.f))
        return fail(E, "scale_s must be finite and > 0 (got %g); 1/sqrt(hdim_q) is the usual choice", a.scale_s);
    if (a.batch < 0) return fail(E, "batch must be >= 0 (got %d)", a.batch);
    if (a.nhead_q < 1 || a.nhead_k < 1)
        return fail(E, "nhead_q and nhead_k must be >= 1 (got %d and %d)", a.nhead_q, a.nhead_k);
    if (a.nhead_q % a.nhead_k != 0)
        return fail(E, "nhead_q (%d) must be a multiple of nhead_k (%d) for GQA/MQA", a.nhead_q, a.nhead_k);
    for (int d : {a.hdim_q, a.hdim_v})
        if (d < 8 || d % 8 != 0 || d > kMaxHdim)
            return fail(E, "hdim_q and hdim_v must be multiples of 8 in [8, %d] (got %d and %d)", kMaxHdim, a.hdim_q, a.hdim_v);
    if (a.is_group_mode) {
        if (a.seqstart_q_ptr == nullptr || a.seqstart_k_ptr == nullptr)
            return fail(E, "group mode needs seqstart_q_ptr and seqstart_k_ptr (device arrays of batch+1 offsets)");
        if (a.max_seqlen_q < 0) return fail(E, "max_seqlen_q must be >= 0 in group mode (got %d)", a.max_seqlen_q);
    } else if (a.seqlen_q < 0 || a.seqlen_k < 0) {
        return fail(E, "seqlen_q and seqlen_k must be >= 0 (got %d and %d)", a.seqlen_q, a.seqlen_k);
    }
    if (a.q_ptr == nullptr || a.o_ptr == nullptr) return fail(E, "q_ptr and o_ptr must not be NULL");
    const bool keys_possible = a.is_group_mode || a.seqlen_k > 0;
    if (keys_possible && (a.k_ptr == nullptr || a.v_ptr == nullptr))
        return fail(E, "k_ptr and v_ptr must not be NULL (they may be NULL only in batch mode with seqlen_k == 0)");
    if (a.has_lse && a.lse_ptr == nullptr) return fail(E, "has_lse is set but lse_ptr is NULL");
    const int64_t strides[] = {a.stride_q, a.stride_k, a.stride_v, a.stride_o, a.nhead_stride_q, a.nhead_stride_k,
                               a.nhead_stride_v, a.nhead_stride_o, a.nhead_stride_lse, a.batch_stride_q,
                               a.batch_stride_k, a.batch_stride_v, a.batch_stride_o, a.batch_stride_lse};
    for (int64_t s : strides)
        if (s < 0) return fail(E, "strides must be >= 0 (got %lld); the head dimension is always contiguous", (long long)s);
    if (a.mask_type < MHAKIT_MASK_NONE || a.mask_type > MHAKIT_MASK_GENERIC)
        return fail(E, "mask_type %d is unknown: 0 none, 1 top-left, 2 bottom-right, 3 generic", a.mask_type);
    return 0.f;
}

FwdParams to_params(const mhakit_fwd_args& a) {
    FwdParams p{};
    p.q = a.q_ptr;
    p.k = a.k_ptr;
    p.v = a.v_ptr;
    p.o = a.o_ptr;
    p.lse = a.has_lse ? static_cast<float*>(a.lse_ptr) : nullptr;
    p.q_row_stride = a.stride_q, p.q_head_stride = a.nhead_stride_q, p.q_batch_stride = a.batch_stride_q;
    p.k_row_stride = a.stride_k, p.k_head_stride = a.nhead_stride_k, p.k_batch_stride = a.batch_stride_k;
    p.v_row_stride = a.stride_v, p.v_head_stride = a.nhead_stride_v, p.v_batch_stride = a.batch_stride_v;
    p.o_row_stride = a.stride_o, p.o_head_stride = a.nhead_stride_o, p.o_batch_stride = a.batch_stride_o;
    p.lse_head_stride = a.nhead_stride_lse, p.lse_batch_stride = a.batch_stride_lse;
    if (a.is_group_mode) {
        p.seqstart_q = a.seqstart_q_ptr;
        p.seqstart_k = a.seqstart_k_ptr;
    }
    p.batch = a.batch;
    p.nhead_q = a.nhead_q;
    p.nhead_k = a.nhead_k;
    p.hdim_q = a.hdim_q;
    p.hdim_v = a.hdim_v;
    p.seqlen_q = a.is_group_mode ? 0 : a.seqlen_q;
    p.seqlen_k = a.is_group_mode ? 0 : a.seqlen_k;
    p.max_seqlen_q = a.is_group_mode ? a.max_seqlen_q : a.seqlen_q;
    p.scale = a.scale_s;
    p.scale_log2 = a.scale_s * 1.4426950408889634f;
    p.mask_type = a.mask_type;
    p.window_left = clamp_window(a.window_size_left);
    p.window_right = clamp_window(a.window_size_right);
    return p;
}

// Nothing to compute: no sequence, or no query row anywhere.
bool is_empty(const FwdParams& p) { return p.batch == 0 || p.max_seqlen_q == 0; }

// Among the instances whose traits and run-time guards hold, the best one: the highest family priority, then the
// tightest head-dim bucket, then an unmasked instance over a masked one for unmasked problems. Every candidate is
// scored, so a coarse bucket or a slower family listed first can never shadow a better instance.
const FwdInstance* choose_instance(const FwdParams& p, int dtype) {
    const bool group_mode = p.seqstart_q != nullptr;
    const bool needs_mask = p.mask_type != MHAKIT_MASK_NONE;
    const FwdInstance* best = nullptr;
    long best_score = 0;
    for (int i = 0; i < kNumFwdInstances; ++i) {
        const FwdInstance& inst = kFwdInstances[i];
        if (inst.dtype != dtype || inst.group_mode != group_mode) continue;
        if (p.hdim_q > inst.hdim_q || p.hdim_v > inst.hdim_v) continue;
        if (needs_mask && !inst.masked) continue;
        if (!inst.supports(p)) continue;
        const long padding = (inst.hdim_q - p.hdim_q) + (inst.hdim_v - p.hdim_v);
        const long score = inst.priority * 100000L - padding * 10L - (inst.masked && !needs_mask ? 1 : 0);
        if (best == nullptr || score > best_score) best = &inst, best_score = score;
    }
    return best;
}

float unsupported(const FwdParams& p, int dtype) {
    const char* mode = p.seqstart_q ? "group" : "batch";
    return fail(MHAKIT_ERROR_UNSUPPORTED,
                "no forward kernel built into this library serves dtype=%s hdim_q=%d hdim_v=%d mode=%s mask_type=%d "
                "(library built for %s with %d instances; rebuild with a profile that includes them, see compile.py --list)",
                dtype_name(dtype), p.hdim_q, p.hdim_v, mode, p.mask_type, kFwdBuiltArch, kNumFwdInstances);
}

float launch_error(cudaError_t err, const char* name) {
    return fail(MHAKIT_ERROR_CUDA, "CUDA error in %s: %s", name, cudaGetErrorString(err));
}

// Runs the instance once, or times it per stream_config. Returns ms (>= 0) or MHAKIT_ERROR_CUDA.
float launch(const FwdInstance& inst, const FwdParams& p, const mhakit_stream_config& sc) {
    cudaStream_t stream = static_cast<cudaStream_t>(sc.stream);
    if (!sc.time_kernel) {
        cudaError_t err = inst.run(p, stream);
        return err == cudaSuccess ? 0.f : launch_error(err, inst.name);
    }
    for (int i = 0; i < sc.warmup; ++i)
        if (cudaError_t err = inst.run(p, stream); err != cudaSuccess) return launch_error(err, inst.name);
    const int repeat = sc.repeat < 1 ? 1 : sc.repeat;
    if (sc.gpu_timer) {
        cudaEvent_t start, stop;
        if (cudaEventCreate(&start) != cudaSuccess || cudaEventCreate(&stop) != cudaSuccess)
            return launch_error(cudaGetLastError(), "cudaEventCreate");
        cudaError_t err = cudaEventRecord(start, stream);
        for (int i = 0; i < repeat && err == cudaSuccess; ++i) err = inst.run(p, stream);
        if (err == cudaSuccess) err = cudaEventRecord(stop, stream);
        if (err == cudaSuccess) err = cudaEventSynchronize(stop);
        float ms = 0.f;
        if (err == cudaSuccess) err = cudaEventElapsedTime(&ms, start, stop);
        cudaEventDestroy(start);
        cudaEventDestroy(stop);
        return err == cudaSuccess ? ms / repeat : launch_error(err, inst.name);
    }
    cudaError_t err = cudaStreamSynchronize(stream);
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < repeat && err == cudaSuccess; ++i) err = inst.run(p, stream);
    if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
    const auto t1 = std::chrono::steady_clock::now();
    if (err != cudaSuccess) return launch_error(err, inst.name);
    return std::chrono::duration<float, std::milli>(t1 - t0).count() / repeat;
}

}  // namespace
}  // namespace mhakit

MHAKIT_EXPORT float mhakit_mha_fwd(const mhakit_fwd_args* args, const mhakit_stream_config* config) {
    using namespace mhakit;
    clear_error();
    if (args == nullptr) return fail(MHAKIT_ERROR_INVALID_ARGS, "args must not be NULL");
    const mhakit_stream_config defaults{nullptr, 0, 0, 0, 1, 1};
    const mhakit_stream_config& sc = config ? *config : defaults;
    if (sc.time_kernel && sc.warmup < 0) return fail(MHAKIT_ERROR_INVALID_ARGS, "stream_config.warmup must be >= 0");
    if (float rc = validate(*args); rc != 0.f) return rc;
    const FwdParams p = to_params(*args);
    if (is_empty(p)) return 0.f;
    const FwdInstance* inst = choose_instance(p, args->data_type);
    if (inst == nullptr) return unsupported(p, args->data_type);
    if (float rc = check_device_arch(kFwdBuiltArch); rc != 0.f) return rc;
    if (sc.log_level > 0) std::printf("[mhakit] mha_fwd -> %s\n", inst->name);
    return launch(*inst, p, sc);
}

MHAKIT_EXPORT const char* mhakit_mha_fwd_kernel_name(const mhakit_fwd_args* args) {
    using namespace mhakit;
    clear_error();
    if (args == nullptr) return fail(MHAKIT_ERROR_INVALID_ARGS, "args must not be NULL"), nullptr;
    if (validate(*args) != 0.f) return nullptr;
    const FwdParams p = to_params(*args);
    const FwdInstance* inst = choose_instance(p, args->data_type);
    if (inst == nullptr) return unsupported(p, args->data_type), nullptr;
    return inst->name;
}
