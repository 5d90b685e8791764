// The backward API: validate, build kernel parameters, choose an instance, check the caller's workspace, launch.
// Same order and contract as the forward (mha_fwd.cpp): no CUDA call before validation and instance choice.
#include <cstdint>
#include <cstdio>

#include "kernels/common/bwd_params.h"
#include "mha_bwd.h"
#include "runtime/api_common.h"
#include "runtime/device.h"

#define MHAKIT_EXPORT extern "C" __attribute__((visibility("default")))

namespace mhakit {
namespace {

constexpr int E = MHAKIT_ERROR_INVALID_ARGS;

float validate(const mhakit_bwd_args& a) {
    if (float rc = check_dtype(a.data_type, false, "backward")) return rc;
    if (float rc = check_scale(a.scale, "scale")) return rc;
    if (a.batch < 0) return fail(E, "batch must be >= 0 (got %d)", a.batch);
    if (float rc = check_heads(a.nhead_q, a.nhead_k)) return rc;
    if (float rc = check_head_dims(a.hdim_q, a.hdim_v, kBwdHeadDims)) return rc;
    if (a.is_group_mode) {
        if (a.seqstart_q_ptr == nullptr || a.seqstart_k_ptr == nullptr)
            return fail(E, "group mode needs seqstart_q_ptr and seqstart_k_ptr (device arrays of batch+1 offsets)");
        if (a.max_seqlen_q < 0 || a.max_seqlen_k < 0)
            return fail(E, "max_seqlen_q and max_seqlen_k must be >= 0 in group mode (got %d and %d)", a.max_seqlen_q,
                        a.max_seqlen_k);
    } else if (a.seqlen_q < 0 || a.seqlen_k < 0) {
        return fail(E, "seqlen_q and seqlen_k must be >= 0 (got %d and %d)", a.seqlen_q, a.seqlen_k);
    }
    const bool queries_possible = a.is_group_mode || a.seqlen_q > 0;
    const bool keys_possible = a.is_group_mode || a.seqlen_k > 0;
    if (queries_possible && (!a.q_ptr || !a.o_ptr || !a.lse_ptr || !a.do_ptr || !a.dq_ptr))
        return fail(E, "q_ptr, o_ptr, lse_ptr, do_ptr and dq_ptr must not be NULL (they may be NULL only in batch "
                       "mode with seqlen_q == 0)");
    if (keys_possible && (!a.k_ptr || !a.v_ptr || !a.dk_ptr || !a.dv_ptr))
        return fail(E, "k_ptr, v_ptr, dk_ptr and dv_ptr must not be NULL (they may be NULL only in batch mode with "
                       "seqlen_k == 0)");
    if (float rc = check_grid(a.batch, a.nhead_q)) return rc;
    if (float rc = check_alignment({{"q_ptr", a.q_ptr}, {"k_ptr", a.k_ptr}, {"v_ptr", a.v_ptr}, {"o_ptr", a.o_ptr},
                                    {"do_ptr", a.do_ptr}, {"dq_ptr", a.dq_ptr}, {"dk_ptr", a.dk_ptr},
                                    {"dv_ptr", a.dv_ptr}},
                                   2, "fp16/bf16 data"))
        return rc;
    if (float rc = check_alignment({{"lse_ptr", a.lse_ptr}}, 4, "the fp32 LSE")) return rc;
    if (a.is_group_mode)
        if (float rc = check_alignment({{"seqstart_q_ptr", a.seqstart_q_ptr}, {"seqstart_k_ptr", a.seqstart_k_ptr}},
                                       4, "int32 offsets"))
            return rc;
    // The kernels vectorise their scratch; cudaMalloc returns this alignment.
    if (float rc = check_alignment({{"workspace_ptr", a.workspace_ptr}}, MHAKIT_WORKSPACE_ALIGNMENT, "the workspace"))
        return rc;
    if (float rc = check_nonnegative_strides(
            {a.stride_q, a.stride_k, a.stride_v, a.stride_o, a.stride_do, a.stride_dq, a.stride_dk, a.stride_dv,
             a.nhead_stride_q, a.nhead_stride_k, a.nhead_stride_v, a.nhead_stride_o, a.nhead_stride_do,
             a.nhead_stride_dq, a.nhead_stride_dk, a.nhead_stride_dv, a.nhead_stride_lse, a.batch_stride_q,
             a.batch_stride_k, a.batch_stride_v, a.batch_stride_o, a.batch_stride_do, a.batch_stride_dq,
             a.batch_stride_dk, a.batch_stride_dv, a.batch_stride_lse}))
        return rc;
    if (float rc = check_mask_type(a.mask_type)) return rc;
    if (float rc = check_score_mods(mod_args(a))) return rc;
    if (float rc = check_dropout(drop_args(a))) return rc;
    if (a.dbias_ptr != nullptr) {
        if (a.bias_type != MHAKIT_BIAS_ELEMENTWISE)
            return fail(E, "dbias_ptr is given but bias_type is not elementwise (1): only an elementwise bias has a "
                           "gradient");
        if (float rc = check_nonnegative_strides({a.stride_dbias, a.nhead_stride_dbias, a.batch_stride_dbias}))
            return rc;
        if (float rc = check_alignment({{"dbias_ptr", a.dbias_ptr}}, a.bias_fp32 ? 4 : 2, "dbias"))
            return rc;
        if ((a.nhead_q > 1 && a.nhead_stride_dbias == 0) || (a.batch > 1 && a.batch_stride_dbias == 0))
            return fail(E, "dbias needs its own element per sequence and query head: nhead_stride_dbias and "
                           "batch_stride_dbias must be > 0 when there are several (got %lld and %lld)",
                        (long long)a.nhead_stride_dbias, (long long)a.batch_stride_dbias);
    }
    if (a.dsink_ptr != nullptr) {
        if (a.sink_ptr == nullptr) return fail(E, "dsink_ptr is given but sink_ptr is NULL: there is no sink");
        if (float rc = check_alignment({{"dsink_ptr", a.dsink_ptr}}, 4, "the fp32 sink gradient")) return rc;
    }
    return 0.f;
}

BwdParams to_params(const mhakit_bwd_args& a) {
    BwdParams p{};
    p.q = a.q_ptr, p.k = a.k_ptr, p.v = a.v_ptr, p.o = a.o_ptr;
    p.lse = static_cast<const float*>(a.lse_ptr);
    p.dout = a.do_ptr;
    p.dq = a.dq_ptr, p.dk = a.dk_ptr, p.dv = a.dv_ptr;
    p.workspace = a.workspace_ptr;
    p.workspace_bytes = a.workspace_ptr ? a.workspace_bytes : 0;
    set_shared_params(p, a, a.scale);
    p.do_row_stride = a.stride_do, p.do_head_stride = a.nhead_stride_do, p.do_batch_stride = a.batch_stride_do;
    p.dq_row_stride = a.stride_dq, p.dq_head_stride = a.nhead_stride_dq, p.dq_batch_stride = a.batch_stride_dq;
    p.dk_row_stride = a.stride_dk, p.dk_head_stride = a.nhead_stride_dk, p.dk_batch_stride = a.batch_stride_dk;
    p.dv_row_stride = a.stride_dv, p.dv_head_stride = a.nhead_stride_dv, p.dv_batch_stride = a.batch_stride_dv;
    p.max_seqlen_k = a.is_group_mode ? a.max_seqlen_k : a.seqlen_k;
    p.deterministic = a.deterministic != 0;
    p.mods = score_mods_of(a, a.scale);
    p.dbias = a.bias_type == MHAKIT_BIAS_ELEMENTWISE ? a.dbias_ptr : nullptr;
    p.dbias_row_stride = a.stride_dbias, p.dbias_head_stride = a.nhead_stride_dbias;
    p.dbias_batch_stride = a.batch_stride_dbias;
    p.dsink = a.sink_ptr != nullptr ? a.dsink_ptr : nullptr;
    return p;
}

// Nothing to compute or write: no sequence, or no query and no key anywhere. (Keys without queries still need
// dK = dV = 0, and queries without keys dQ = 0: the kernels write those.)
bool is_empty(const BwdParams& p) { return p.batch == 0 || (p.max_seqlen_q == 0 && p.max_seqlen_k == 0); }


// Validates the arguments into *p and chooses the instance for them. Returns 0, or a negative code with
// last_error set (*inst is then nullptr).
float prepare(const mhakit_bwd_args* args, BwdParams* p, const BwdInstance** inst) {
    *inst = nullptr;
    if (args == nullptr) return fail(MHAKIT_ERROR_INVALID_ARGS, "args must not be NULL");
    if (float rc = validate(*args)) return rc;
    *p = to_params(*args);
    *inst = choose_instance(kBwdInstances, kNumBwdInstances, *p, args->data_type);
    if (*inst == nullptr) return unsupported("backward", *p, args->data_type, kBwdBuiltArch, kNumBwdInstances);
    return 0.f;
}

}  // namespace
}  // namespace mhakit

MHAKIT_EXPORT size_t mhakit_mha_bwd_workspace_size(const mhakit_bwd_args* args) {
    using namespace mhakit;
    clear_error();
    BwdParams p;
    const BwdInstance* inst;
    if (prepare(args, &p, &inst) != 0.f || is_empty(p)) return 0;
    return workspace_needed(*inst, p);
}

MHAKIT_EXPORT float mhakit_mha_bwd(const mhakit_bwd_args* args, const mhakit_stream_config* config) {
    using namespace mhakit;
    clear_error();
    const mhakit_stream_config defaults{nullptr, 0, 0, 0, 1, 1};
    const mhakit_stream_config& sc = config ? *config : defaults;
    if (sc.time_kernel && sc.warmup < 0) return fail(MHAKIT_ERROR_INVALID_ARGS, "stream_config.warmup must be >= 0");
    BwdParams p;
    const BwdInstance* inst;
    const float rc = prepare(args, &p, &inst);
    if (rc == MHAKIT_ERROR_INVALID_ARGS) return rc;
    if (is_empty(p)) return clear_error(), 0.f;  // valid, nothing to compute: whatever is built does not matter
    if (rc != 0.f) return rc;
    if (float ws = check_workspace(*inst, p, "mhakit_mha_bwd_workspace_size")) return ws;
    if (float dev = check_device_arch(kBwdBuiltArch)) return dev;
    // The multiprocessor count (once per device, cached): the Hopper backward's deterministic query split orders its
    // CTAs by it, and its GQA split (bwd_gqa_split.h) chooses how many CTAs share a kv group by it.
    if (p.deterministic || p.nhead_q != p.nhead_k) {
        int smem_per_sm = 0;
        if (float dev = device_multiprocessors(&p.num_sms, &smem_per_sm)) return dev;
    }
    if (sc.log_level > 0) std::printf("[mhakit] mha_bwd -> %s\n", inst->name);
    return run_or_time(inst->name, sc, [&](dev::Stream stream) { return inst->run(p, stream); });
}

MHAKIT_EXPORT const char* mhakit_mha_bwd_kernel_name(const mhakit_bwd_args* args) {
    using namespace mhakit;
    clear_error();
    BwdParams p;
    const BwdInstance* inst;
    return prepare(args, &p, &inst) == 0.f ? inst->name : nullptr;
}
