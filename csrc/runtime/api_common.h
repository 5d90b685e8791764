// What the forward and backward entry points share: argument checks, instance scoring, and the run/time loop.
// Every check returns 0 or a negative MHAKIT_ERROR_* code with last_error set (runtime/error.h).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <initializer_list>

#include "mha_common.h"
#include "runtime/error.h"
#include "runtime/device_api.h"
#include "runtime/registry.h"

namespace mhakit {

const char* dtype_name(int dtype);

// The fp8 forward types (e4m3 q, k, v; bf16 / fp16 o): mhakit_mha_fwd only.
inline bool is_fp8(int dtype) { return dtype == MHAKIT_DTYPE_FP8_BF16 || dtype == MHAKIT_DTYPE_FP8_FP16; }

// A known dtype, and one the entry point `api` ("forward", "backward", "split-KV forward") takes: fp8 only when
// fp8_ok.
float check_dtype(int dtype, bool fp8_ok, const char* api);
float check_scale(float scale, const char* name);
float check_heads(int nhead_q, int nhead_k);
float check_head_dims(int hdim_q, int hdim_v, const HeadDimRule& rule);
// batch and nhead_q within the CUDA grid (MHAKIT_MAX_BATCH, MHAKIT_MAX_NHEAD in mha_common.h).
float check_grid(int batch, int nhead_q);

// Every pointer a multiple of `alignment` bytes (NULL passes: whether a NULL is allowed is checked elsewhere);
// `what` names the data in the message ("fp16/bf16 data": "q_ptr (0x...1) is misaligned: fp16/bf16 data must be
// 2-byte aligned").
struct NamedPointer {
    const char* name;
    const void* ptr;
};
float check_alignment(std::initializer_list<NamedPointer> pointers, size_t alignment, const char* what);
float check_nonnegative_strides(std::initializer_list<int64_t> strides);
float check_mask_type(int mask_type);

// The score modifiers' fields (logits_soft_cap, bias_*, sink_ptr), the same in both argument structs.
struct ModArgs {
    float logits_soft_cap;
    int bias_type, bias_fp32;
    const void* bias_ptr;
    int64_t stride_bias, nhead_stride_bias, batch_stride_bias;
    const float* sink_ptr;
};
template <class Args>
ModArgs mod_args(const Args& a) {
    return {a.logits_soft_cap, a.bias_type,         a.bias_fp32,         a.bias_ptr,
            a.stride_bias,     a.nhead_stride_bias, a.batch_stride_bias, a.sink_ptr};
}
float check_score_mods(const ModArgs& m);  // the kernels' ScoreMods come from score_mods_of() (score_mod.h)

// The dropout fields (p_drop, drop_seed_ptr, drop_offset_ptr), the same in both argument structs.
struct DropArgs {
    float p_drop;
    const void* seed_ptr;
    const void* offset_ptr;
};
template <class Args>
DropArgs drop_args(const Args& a) {
    return {a.p_drop, a.drop_seed_ptr, a.drop_offset_ptr};
}
float check_dropout(const DropArgs& d);

// Window sizes beyond any sequence length select the same keys as this bound; clamping keeps the kernels' mask
// arithmetic (sums of lengths and window sizes) inside int32.
int clamp_window(int w);

// The fields FwdParams and BwdParams take from their argument structs alike: the q, k, v, o and LSE strides, the
// group-mode offsets, the sizes (group mode: lengths come from seqstart, and the arguments' seqlen_q / seqlen_k are
// the packed row counts), the scale and the mask.
template <class Params, class Args>
void set_shared_params(Params& p, const Args& a, float scale) {
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
    p.total_q = a.is_group_mode && a.seqlen_q > 0 ? a.seqlen_q : 0;
    p.total_k = a.is_group_mode && a.seqlen_k > 0 ? a.seqlen_k : 0;
    p.scale = scale;
    p.scale_log2 = scale * 1.4426950408889634f;
    p.mask_type = a.mask_type;
    p.window_left = clamp_window(a.window_size_left);
    p.window_right = clamp_window(a.window_size_right);
}

// Bytes per element of q, k, v (and, in the backward, of every tensor but the LSE) of a dtype; o is always 16-bit.
inline int input_bytes(int dtype) { return is_fp8(dtype) ? 1 : 2; }
constexpr int kOutputBytes = 2;

// The static guard align_bytes over every tensor a pass reads or writes (the LSE excepted: fp32, any strides).
bool tensors_aligned(const FwdParams& p, int elem_bytes, int bytes);
bool tensors_aligned(const BwdParams& p, int elem_bytes, int bytes);
bool tensors_aligned(const SplitkvParams& p, int elem_bytes, int bytes);

inline bool wants_deterministic(const FwdParams&) { return false; }  // the forward has nothing to choose
inline bool wants_deterministic(const BwdParams& p) { return p.deterministic; }

// The family's static guards (catalogue data, carried by the dispatch table) against one call.
template <class Params>
bool static_guards_hold(const KernelInstance<Params>& inst, const Params& p) {
    if (inst.equal_head_dims && p.hdim_q != p.hdim_v) return false;
    if (p.hdim_q % inst.head_dim_multiple != 0 || p.hdim_v % inst.head_dim_multiple != 0) return false;
    if (!inst.deterministic && wants_deterministic(p)) return false;
    // The call's score modifiers: all served by the instance, and a "_mods" instance only for calls that set one
    // beyond what the family's plain instances serve (those run on the plain kernel).
    if ((p.mods.kinds & ~inst.mod_kinds) != 0) return false;
    if (inst.mods && (p.mods.kinds & ~inst.plain_mod_kinds) == 0) return false;
    return tensors_aligned(p, input_bytes(inst.dtype), inst.align_bytes);
}

// How an instance's tile suits the call's query length (catalogue seqlen ranges, KernelInstance::seqlen_q_min /
// seqlen_q_max): 2 for a ranged tile whose range holds max_seqlen_q, 1 for the default tile, 0 for a ranged tile
// outside its range (it still serves the call, where nothing else of its kind was built).
template <class Params>
int tile_fit(const KernelInstance<Params>& inst, const Params& p) {
    if (inst.seqlen_q_max == 0) return 1;
    return p.max_seqlen_q >= inst.seqlen_q_min && p.max_seqlen_q <= inst.seqlen_q_max ? 2 : 0;
}

// Among the instances whose traits, static guards and run-time guards hold, the best one: the highest family
// priority, then the tightest head-dim bucket, then an unmasked instance over a masked one for unmasked problems,
// then the tile whose seqlen range holds the call's max_seqlen_q over the default tile (tile_fit).
// Every candidate is scored, so a coarse bucket or a slower family listed first can never shadow a better instance.
template <class Params>
const KernelInstance<Params>* choose_instance(const KernelInstance<Params>* table, int count, const Params& p,
                                              int dtype) {
    const bool group_mode = p.seqstart_q != nullptr;
    const bool needs_mask = p.mask_type != MHAKIT_MASK_NONE;
    const KernelInstance<Params>* best = nullptr;
    long best_score = 0;
    for (int i = 0; i < count; ++i) {
        const KernelInstance<Params>& inst = table[i];
        if (inst.dtype != dtype || inst.group_mode != group_mode) continue;
        if (p.hdim_q > inst.hdim_q || p.hdim_v > inst.hdim_v) continue;
        if (needs_mask && !inst.masked) continue;
        if (!static_guards_hold(inst, p)) continue;
        if (!inst.supports(p)) continue;
        const long padding = (inst.hdim_q - p.hdim_q) + (inst.hdim_v - p.hdim_v);
        const long score = (inst.priority * 100000L - padding * 10L - (inst.masked && !needs_mask ? 1 : 0)) * 4L +
                           tile_fit(inst, p);
        if (best == nullptr || score > best_score) best = &inst, best_score = score;
    }
    return best;
}

// MHAKIT_ERROR_UNSUPPORTED with a sentence naming the traits and what the library holds.
template <class Params>
float unsupported(const char* api, const Params& p, int dtype, const BuiltArch& arch, int count) {
    return fail(MHAKIT_ERROR_UNSUPPORTED,
                "no %s kernel built into this library serves dtype=%s hdim_q=%d hdim_v=%d mode=%s mask_type=%d%s "
                "(library built for %s with %d instances; rebuild with a profile that includes them, see "
                "compile.py --list)",
                api, dtype_name(dtype), p.hdim_q, p.hdim_v, p.seqstart_q ? "group" : "batch", p.mask_type,
                p.mods.per_element ? " with score modifiers (soft-cap, bias / ALiBi or dropout: a \"_mods\" instance)"
                : p.mods.any    ? " with an attention sink"
                                : "",
                arch.name, count);
}

// Scratch memory the chosen instance needs for a call (0 for instances without a workspace), and the caller's
// workspace checked against it: 0, or MHAKIT_ERROR_INVALID_ARGS naming the size query `query`.
template <class Params>
size_t workspace_needed(const KernelInstance<Params>& inst, const Params& p) {
    return inst.workspace_bytes ? inst.workspace_bytes(p) : 0;
}
template <class Params>
float check_workspace(const KernelInstance<Params>& inst, const Params& p, const char* query) {
    const size_t need = workspace_needed(inst, p);
    if (need <= p.workspace_bytes || (inst.workspace_optional && p.workspace_bytes == 0)) return 0.f;
    return fail(MHAKIT_ERROR_INVALID_ARGS,
                "the workspace is too small: %s needs %zu bytes for these arguments and got %zu (ask %s)", inst.name,
                need, p.workspace_bytes, query);
}

float device_failure(dev::Error err, const char* what);

// Runs `launch(stream)` once, or, when sc.time_kernel, warmup + repeat times and returns the mean ms per call.
// Returns ms (>= 0; 0 when not timing) or MHAKIT_ERROR_CUDA (the device runtime's error, on either vendor).
template <class Launch>
float run_or_time(const char* name, const mhakit_stream_config& sc, Launch&& launch) {
    dev::Stream stream = static_cast<dev::Stream>(sc.stream);
    if (!sc.time_kernel) {
        const dev::Error err = launch(stream);
        return err == dev::kSuccess ? 0.f : device_failure(err, name);
    }
    for (int i = 0; i < sc.warmup; ++i)
        if (dev::Error err = launch(stream); err != dev::kSuccess) return device_failure(err, name);
    const int repeat = sc.repeat < 1 ? 1 : sc.repeat;
    if (sc.gpu_timer) {
        dev::Event start = nullptr, stop = nullptr;
        dev::Error err = dev::event_create(&start);
        if (err == dev::kSuccess) err = dev::event_create(&stop);
        if (err == dev::kSuccess) err = dev::event_record(start, stream);
        for (int i = 0; i < repeat && err == dev::kSuccess; ++i) err = launch(stream);
        if (err == dev::kSuccess) err = dev::event_record(stop, stream);
        if (err == dev::kSuccess) err = dev::event_synchronize(stop);
        float ms = 0.f;
        if (err == dev::kSuccess) err = dev::event_elapsed_ms(&ms, start, stop);
        if (start) dev::event_destroy(start);
        if (stop) dev::event_destroy(stop);
        return err == dev::kSuccess ? ms / repeat : device_failure(err, name);
    }
    dev::Error err = dev::stream_synchronize(stream);
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < repeat && err == dev::kSuccess; ++i) err = launch(stream);
    if (err == dev::kSuccess) err = dev::stream_synchronize(stream);
    const auto t1 = std::chrono::steady_clock::now();
    if (err != dev::kSuccess) return device_failure(err, name);
    return std::chrono::duration<float, std::milli>(t1 - t0).count() / repeat;
}

}  // namespace mhakit
