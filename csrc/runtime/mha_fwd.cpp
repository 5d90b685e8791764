// The forward API: validate the arguments, turn them into kernel parameters, choose an instance, launch, time.
//
// Order matters and is the contract of mha_fwd.h: validation and instance choice touch no CUDA API (so they run,
// and are tested, on machines without a GPU); nothing is launched unless both succeed.
#include <atomic>
#include <cstdio>

#include "kernels/common/fwd_params.h"
#include "mha_fwd.h"
#include "runtime/api_common.h"
#include "runtime/device.h"

#define MHAKIT_EXPORT extern "C" __attribute__((visibility("default")))

namespace mhakit {
namespace {

constexpr int E = MHAKIT_ERROR_INVALID_ARGS;

// A new nonzero tag per call for a persistent instance's tile counter (kernels/common/tile_scheduler.h: a word left
// with another tag, whatever the workspace held, is claimed afresh, so callers never zero it).
unsigned next_counter_epoch() {
    static std::atomic<unsigned> epoch{0};
    unsigned e = epoch.fetch_add(1, std::memory_order_relaxed) + 1;
    while (e == 0) e = epoch.fetch_add(1, std::memory_order_relaxed) + 1;
    return e;
}

// Returns 0 when the arguments are consistent, else MHAKIT_ERROR_INVALID_ARGS with last_error set.
// The fp8 forward's own conditions (mha_fwd.h): descale factors, batch mode, no score modifiers or dropout.
float validate_fp8(const mhakit_fwd_args& a) {
    const bool any_descale = a.q_descale_ptr != nullptr || a.k_descale_ptr != nullptr || a.v_descale_ptr != nullptr;
    if (!is_fp8(a.data_type)) {
        if (any_descale)
            return fail(E, "q/k/v_descale_ptr are given but data_type is %s: descale factors are for fp8 data only",
                        dtype_name(a.data_type));
        return 0.f;
    }
    if (a.q_descale_ptr == nullptr || a.k_descale_ptr == nullptr || a.v_descale_ptr == nullptr)
        return fail(E, "fp8 data needs q_descale_ptr, k_descale_ptr and v_descale_ptr (device fp32 scalars; 1.0 for "
                       "unscaled data)");
    if (float rc = check_alignment({{"q_descale_ptr", a.q_descale_ptr}, {"k_descale_ptr", a.k_descale_ptr},
                                    {"v_descale_ptr", a.v_descale_ptr}},
                                   4, "fp32 descale factors"))
        return rc;
    if (a.is_group_mode) return fail(E, "fp8 runs in batch mode only (no fp8 group-mode kernel yet)");
    if (a.logits_soft_cap != 0.f || a.bias_type != MHAKIT_BIAS_NONE || a.sink_ptr != nullptr)
        return fail(E, "fp8 takes no score modifiers (soft-cap, bias / ALiBi, sink): use fp16 or bf16 for them");
    if (a.p_drop != 0.f) return fail(E, "fp8 takes no dropout: use fp16 or bf16 for it");
    return 0.f;
}

float validate(const mhakit_fwd_args& a) {
    if (float rc = check_dtype(a.data_type, true, "forward")) return rc;
    if (float rc = check_scale(a.scale_s, "scale_s")) return rc;
    if (a.batch < 0) return fail(E, "batch must be >= 0 (got %d)", a.batch);
    if (float rc = check_heads(a.nhead_q, a.nhead_k)) return rc;
    if (float rc = check_head_dims(a.hdim_q, a.hdim_v, kFwdHeadDims)) return rc;
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
    if (float rc = check_grid(a.batch, a.nhead_q)) return rc;
    if (float rc = check_alignment({{"q_ptr", a.q_ptr}, {"k_ptr", a.k_ptr}, {"v_ptr", a.v_ptr}},
                                   size_t(input_bytes(a.data_type)), "fp16/bf16 data"))
        return rc;
    if (float rc = check_alignment({{"o_ptr", a.o_ptr}}, kOutputBytes, "fp16/bf16 output")) return rc;
    if (float rc = check_alignment({{"workspace_ptr", a.workspace_ptr}}, MHAKIT_WORKSPACE_ALIGNMENT, "the workspace"))
        return rc;
    if (float rc = check_alignment({{"lse_ptr", a.has_lse ? a.lse_ptr : nullptr}}, 4, "the fp32 LSE")) return rc;
    if (a.is_group_mode)
        if (float rc = check_alignment({{"seqstart_q_ptr", a.seqstart_q_ptr}, {"seqstart_k_ptr", a.seqstart_k_ptr}},
                                       4, "int32 offsets"))
            return rc;
    if (float rc = check_nonnegative_strides({a.stride_q, a.stride_k, a.stride_v, a.stride_o, a.nhead_stride_q,
                                              a.nhead_stride_k, a.nhead_stride_v, a.nhead_stride_o,
                                              a.nhead_stride_lse, a.batch_stride_q, a.batch_stride_k,
                                              a.batch_stride_v, a.batch_stride_o, a.batch_stride_lse}))
        return rc;
    if (float rc = check_mask_type(a.mask_type)) return rc;
    if (float rc = check_score_mods(mod_args(a))) return rc;
    if (float rc = check_dropout(drop_args(a))) return rc;
    if (float rc = validate_fp8(a)) return rc;
    if (a.randval_ptr != nullptr) {
        if (a.p_drop == 0.f) return fail(E, "randval_ptr is given but p_drop is 0: there is no dropout to record");
        if (float rc = check_nonnegative_strides({a.stride_randval, a.nhead_stride_randval, a.batch_stride_randval}))
            return rc;
    }
    return 0.f;
}

FwdParams to_params(const mhakit_fwd_args& a) {
    FwdParams p{};
    p.q = a.q_ptr;
    p.k = a.k_ptr;
    p.v = a.v_ptr;
    p.o = a.o_ptr;
    p.lse = a.has_lse ? static_cast<float*>(a.lse_ptr) : nullptr;
    set_shared_params(p, a, a.scale_s);
    p.mods = score_mods_of(a, a.scale_s);
    if (p.mods.dropout.on && a.randval_ptr != nullptr) {
        p.mods.dropout.randval = static_cast<uint8_t*>(a.randval_ptr);
        p.mods.dropout.randval_row = a.stride_randval, p.mods.dropout.randval_head = a.nhead_stride_randval;
        p.mods.dropout.randval_batch = a.batch_stride_randval;
    }
    p.descale_q = a.q_descale_ptr;
    p.descale_k = a.k_descale_ptr;
    p.descale_v = a.v_descale_ptr;
    p.workspace = a.workspace_ptr;
    p.workspace_bytes = a.workspace_ptr ? a.workspace_bytes : 0;
    return p;
}

const FwdInstance* choose(const FwdParams& p, int dtype) {
    return choose_instance(kFwdInstances, kNumFwdInstances, p, dtype);
}


// No instance serves the call: the general sentence, or for fp8 what an fp8 call needs besides a built instance.
float no_instance(const FwdParams& p, int dtype) {
    if (!is_fp8(dtype)) return unsupported("forward", p, dtype, kFwdBuiltArch, kNumFwdInstances);
    return fail(MHAKIT_ERROR_UNSUPPORTED,
                "no fp8 forward kernel built into this library serves dtype=%s hdim_q=%d hdim_v=%d mask_type=%d: fp8 "
                "runs on the hopper family only (sm_90a; this library is built for %s), with head dims multiples of "
                "8 and every base pointer and stride 16-byte aligned, from a build that includes fp8 instances "
                "(compile.py --list)",
                dtype_name(dtype), p.hdim_q, p.hdim_v, p.mask_type, kFwdBuiltArch.name);
}

// Validates the arguments into *p and chooses the instance for them. Returns 0, or a negative code with
// last_error set (*inst is then nullptr).
float prepare(const mhakit_fwd_args* args, FwdParams* p, const FwdInstance** inst) {
    *inst = nullptr;
    if (args == nullptr) return fail(MHAKIT_ERROR_INVALID_ARGS, "args must not be NULL");
    if (float rc = validate(*args)) return rc;
    *p = to_params(*args);
    *inst = choose(*p, args->data_type);
    return *inst == nullptr ? no_instance(*p, args->data_type) : 0.f;
}

bool is_empty(const FwdParams& p) { return p.batch == 0 || p.max_seqlen_q == 0; }  // no query row anywhere

}  // namespace
}  // namespace mhakit

MHAKIT_EXPORT float mhakit_mha_fwd(const mhakit_fwd_args* args, const mhakit_stream_config* config) {
    using namespace mhakit;
    clear_error();
    const mhakit_stream_config defaults{nullptr, 0, 0, 0, 1, 1};
    const mhakit_stream_config& sc = config ? *config : defaults;
    if (sc.time_kernel && sc.warmup < 0) return fail(MHAKIT_ERROR_INVALID_ARGS, "stream_config.warmup must be >= 0");
    FwdParams p;
    const FwdInstance* inst;
    const float rc = prepare(args, &p, &inst);
    if (rc == MHAKIT_ERROR_INVALID_ARGS) return rc;
    if (is_empty(p)) return clear_error(), 0.f;  // valid, nothing to compute: whatever is built does not matter
    if (rc != 0.f) return rc;
    if (float ws = check_workspace(*inst, p, "mhakit_mha_fwd_workspace_size")) return ws;
    if (float dev = check_device_arch(kFwdBuiltArch)) return dev;
    if (inst->persistent && p.workspace_bytes > 0) {  // a persistent instance with its counter: its grid
        int smem_per_sm = 0;
        if (float dev = device_multiprocessors(&p.num_sms, &smem_per_sm)) return dev;
        p.counter_epoch = next_counter_epoch();
    }
    if (sc.log_level > 0) std::printf("[mhakit] mha_fwd -> %s\n", inst->name);
    return run_or_time(inst->name, sc, [&](dev::Stream stream) { return inst->run(p, stream); });
}

MHAKIT_EXPORT const char* mhakit_mha_fwd_kernel_name(const mhakit_fwd_args* args) {
    using namespace mhakit;
    clear_error();
    FwdParams p;
    const FwdInstance* inst;
    return prepare(args, &p, &inst) == 0.f ? inst->name : nullptr;
}

MHAKIT_EXPORT size_t mhakit_mha_fwd_workspace_size(const mhakit_fwd_args* args) {
    using namespace mhakit;
    clear_error();
    FwdParams p;
    const FwdInstance* inst;
    if (prepare(args, &p, &inst) != 0.f || is_empty(p)) return 0;
    return workspace_needed(*inst, p);
}
