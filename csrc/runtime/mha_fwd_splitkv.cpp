// The split-KV (decode) forward API: validate, turn the arguments into kernel parameters, choose an instance,
// resolve the split count, launch (append, attend, combine), time.
//
// As for mha_fwd: validation and instance choice touch no device API; nothing is launched unless both succeed. The
// split heuristic (num_splits = 0) reads the device's SM count, cached per device.
#include <climits>
#include <cstdio>

#include "kernels/common/splitkv_params.h"
#include "mha_fwd.h"
#include "runtime/api_common.h"
#include "runtime/device.h"

#define MHAKIT_EXPORT extern "C" __attribute__((visibility("default")))

namespace mhakit {
namespace {

constexpr int E = MHAKIT_ERROR_INVALID_ARGS;

float validate(const mhakit_fwd_splitkv_args& a) {
    if (float rc = check_dtype(a.data_type, false, "split-KV forward")) return rc;
    if (float rc = check_scale(a.scale_s, "scale_s")) return rc;
    if (a.batch < 0) return fail(E, "batch must be >= 0 (got %d)", a.batch);
    if (float rc = check_heads(a.nhead_q, a.nhead_k)) return rc;
    if (float rc = check_head_dims(a.hdim_q, a.hdim_v, kFwdHeadDims)) return rc;
    if (a.seqlen_q < 0 || a.seqlen_knew < 0 || a.max_seqlen_k < 0)
        return fail(E, "seqlen_q, seqlen_knew and max_seqlen_k must be >= 0 (got %d, %d and %d)", a.seqlen_q,
                    a.seqlen_knew, a.max_seqlen_k);
    if (int64_t(a.max_seqlen_k) + a.seqlen_knew > INT_MAX)
        return fail(E, "max_seqlen_k + seqlen_knew (%lld) must fit in int32",
                    (long long)(int64_t(a.max_seqlen_k) + a.seqlen_knew));
    if (int64_t(a.nhead_q / a.nhead_k) * a.seqlen_q > INT_MAX)
        return fail(E, "seqlen_q x (nhead_q / nhead_k) (%lld query rows per kv head) must fit in int32",
                    (long long)(int64_t(a.nhead_q / a.nhead_k) * a.seqlen_q));
    if (a.num_splits < 0 || a.num_splits > MHAKIT_MAX_SPLITS)
        return fail(E, "num_splits must be 0 (heuristic) or in [1, %d] (got %d)", MHAKIT_MAX_SPLITS, a.num_splits);
    if (a.q_ptr == nullptr || a.o_ptr == nullptr || a.k_cache_ptr == nullptr || a.v_cache_ptr == nullptr)
        return fail(E, "q_ptr, o_ptr, k_cache_ptr and v_cache_ptr must not be NULL");
    if (a.seqlen_k_ptr == nullptr)
        return fail(E, "seqlen_k_ptr must not be NULL: it is the device array [batch] of cache lengths");
    if (a.has_lse && a.lse_ptr == nullptr) return fail(E, "has_lse is set but lse_ptr is NULL");
    if (a.seqlen_knew > 0 && (a.k_new_ptr == nullptr || a.v_new_ptr == nullptr))
        return fail(E, "seqlen_knew is %d but k_new_ptr or v_new_ptr is NULL", a.seqlen_knew);
    if (a.block_table_ptr != nullptr) {
        if (a.page_block_size < 1)
            return fail(E, "a paged cache (block_table_ptr set) needs page_block_size >= 1 (got %d)",
                        a.page_block_size);
        if (a.cache_batch_idx_ptr != nullptr)
            return fail(E, "cache_batch_idx_ptr works with contiguous caches only: a paged cache maps batches to "
                           "pages through block_table_ptr");
    } else if (a.page_block_size != 0) {
        return fail(E, "page_block_size is %d but block_table_ptr is NULL (a contiguous cache takes 0)",
                    a.page_block_size);
    }
    if (float rc = check_grid(a.batch, a.nhead_q)) return rc;
    if (float rc = check_alignment({{"q_ptr", a.q_ptr}, {"k_cache_ptr", a.k_cache_ptr}, {"v_cache_ptr", a.v_cache_ptr},
                                    {"k_new_ptr", a.k_new_ptr}, {"v_new_ptr", a.v_new_ptr}, {"o_ptr", a.o_ptr}},
                                   2, "fp16/bf16 data"))
        return rc;
    if (float rc = check_alignment({{"lse_ptr", a.has_lse ? a.lse_ptr : nullptr},
                                    {"lse_acc_ptr", a.lse_acc_ptr},
                                    {"o_acc_ptr", a.o_acc_ptr}},
                                   4, "fp32 data"))
        return rc;
    if (float rc = check_alignment({{"seqlen_k_ptr", a.seqlen_k_ptr},
                                    {"block_table_ptr", a.block_table_ptr},
                                    {"cache_batch_idx_ptr", a.cache_batch_idx_ptr}},
                                   4, "int32 arrays"))
        return rc;
    if (float rc = check_nonnegative_strides(
            {a.stride_q, a.stride_k, a.stride_v, a.stride_knew, a.stride_vnew, a.stride_o, a.nhead_stride_q,
             a.nhead_stride_k, a.nhead_stride_v, a.nhead_stride_knew, a.nhead_stride_vnew, a.nhead_stride_o,
             a.nhead_stride_lse, a.batch_stride_q, a.batch_stride_k, a.batch_stride_v, a.batch_stride_knew,
             a.batch_stride_vnew, a.batch_stride_o, a.batch_stride_lse, a.batch_stride_block_table}))
        return rc;
    return check_mask_type(a.mask_type);
}

SplitkvParams to_params(const mhakit_fwd_splitkv_args& a) {
    SplitkvParams p{};
    p.q = a.q_ptr;
    p.k_cache = a.k_cache_ptr;
    p.v_cache = a.v_cache_ptr;
    p.k_new = a.seqlen_knew > 0 ? a.k_new_ptr : nullptr;
    p.v_new = a.seqlen_knew > 0 ? a.v_new_ptr : nullptr;
    p.o = a.o_ptr;
    p.lse = a.has_lse ? static_cast<float*>(a.lse_ptr) : nullptr;
    p.lse_acc = static_cast<float*>(a.lse_acc_ptr);
    p.o_acc = static_cast<float*>(a.o_acc_ptr);
    p.seqlen_k = a.seqlen_k_ptr;
    p.block_table = a.block_table_ptr;
    p.cache_batch_idx = a.cache_batch_idx_ptr;
    p.block_table_batch_stride = a.batch_stride_block_table;
    p.page_block_size = a.block_table_ptr != nullptr ? a.page_block_size : 0;
    p.q_row_stride = a.stride_q, p.q_head_stride = a.nhead_stride_q, p.q_batch_stride = a.batch_stride_q;
    p.k_row_stride = a.stride_k, p.k_head_stride = a.nhead_stride_k, p.k_batch_stride = a.batch_stride_k;
    p.v_row_stride = a.stride_v, p.v_head_stride = a.nhead_stride_v, p.v_batch_stride = a.batch_stride_v;
    p.knew_row_stride = a.stride_knew, p.knew_head_stride = a.nhead_stride_knew;
    p.knew_batch_stride = a.batch_stride_knew;
    p.vnew_row_stride = a.stride_vnew, p.vnew_head_stride = a.nhead_stride_vnew;
    p.vnew_batch_stride = a.batch_stride_vnew;
    p.o_row_stride = a.stride_o, p.o_head_stride = a.nhead_stride_o, p.o_batch_stride = a.batch_stride_o;
    p.lse_head_stride = a.nhead_stride_lse, p.lse_batch_stride = a.batch_stride_lse;
    p.batch = a.batch;
    p.nhead_q = a.nhead_q;
    p.nhead_k = a.nhead_k;
    p.hdim_q = a.hdim_q;
    p.hdim_v = a.hdim_v;
    p.seqlen_q = a.seqlen_q;
    p.seqlen_new = a.seqlen_knew;
    p.max_seqlen_k = a.max_seqlen_k;
    p.scale = a.scale_s;
    p.scale_log2 = a.scale_s * 1.4426950408889634f;
    p.mask_type = a.mask_type;
    p.window_left = clamp_window(a.window_size_left);
    p.window_right = clamp_window(a.window_size_right);
    p.num_splits = a.num_splits;
    return p;
}

// The family's static guards (catalogue data, carried by the dispatch table) against one call.
bool splitkv_guards_hold(const SplitkvInstance& inst, const SplitkvParams& p) {
    if (inst.equal_head_dims && p.hdim_q != p.hdim_v) return false;
    if (p.hdim_q % inst.head_dim_multiple != 0 || p.hdim_v % inst.head_dim_multiple != 0) return false;
    return tensors_aligned(p, input_bytes(inst.dtype), inst.align_bytes);
}

// How an instance's tile suits the call's packed rows per kv head (catalogue `min_rows`): its min_rows when the call
// has at least that many rows (the largest threshold met wins), 0 for a tile without one, -1 for a tile whose
// threshold the call is below (it still serves the call where nothing else of its bucket was built).
long rows_fit(const SplitkvInstance& inst, const SplitkvParams& p) {
    if (inst.min_rows == 0) return 0;
    const long long rows = (long long)(p.nhead_q / p.nhead_k) * p.seqlen_q;
    return rows >= inst.min_rows ? inst.min_rows : -1;
}

// The instance of the highest priority (then the tightest head-dim bucket, then the tile whose min_rows the call's
// packed rows meet: rows_fit) whose dtype and guards fit the call.
const SplitkvInstance* choose(const SplitkvParams& p, int dtype) {
    const SplitkvInstance* best = nullptr;
    long best_score = 0;
    for (int i = 0; i < kNumSplitkvInstances; ++i) {
        const SplitkvInstance& inst = kSplitkvInstances[i];
        if (inst.dtype != dtype || p.hdim_q > inst.hdim_q || p.hdim_v > inst.hdim_v) continue;
        if (!splitkv_guards_hold(inst, p)) continue;
        if (!inst.supports(p)) continue;
        const long padding = (inst.hdim_q - p.hdim_q) + (inst.hdim_v - p.hdim_v);
        const long score = (inst.priority * 100000L - padding) * 100000L + rows_fit(inst, p);
        if (best == nullptr || score > best_score) best = &inst, best_score = score;
    }
    return best;
}

float unsupported_splitkv(const SplitkvParams& p, int dtype) {
    return fail(MHAKIT_ERROR_UNSUPPORTED,
                "no split-KV kernel built into this library serves dtype=%s hdim_q=%d hdim_v=%d (library built for %s "
                "with %d split-KV instances; rebuild with a profile that includes them, see compile.py --list)",
                dtype_name(dtype), p.hdim_q, p.hdim_v, kFwdBuiltArch.name, kNumSplitkvInstances);
}

// Validated parameters and the chosen instance (launches nothing, touches no device).
float prepare(const mhakit_fwd_splitkv_args* args, SplitkvParams* p, const SplitkvInstance** inst) {
    if (args == nullptr) return fail(E, "args must not be NULL");
    if (float rc = validate(*args)) return rc;
    *p = to_params(*args);
    *inst = choose(*p, args->data_type);
    if (*inst == nullptr) return unsupported_splitkv(*p, args->data_type);
    return 0.f;
}

// num_splits = 0 becomes the instance's heuristic for the current device (its SM count and shared memory).
float resolve_splits(SplitkvParams* p, const SplitkvInstance& inst) {
    if (p->num_splits > 0) return 0.f;
    if (float rc = check_device_arch(kFwdBuiltArch)) return rc;
    int smem_per_sm = 0;
    if (float rc = device_multiprocessors(&p->num_sms, &smem_per_sm)) return rc;
    p->num_splits = inst.num_splits(*p, smem_per_sm);
    return 0.f;
}

void acc_bytes(const SplitkvParams& p, size_t* lse_acc, size_t* o_acc) {
    const size_t rows = p.num_splits > 1 ? size_t(p.num_splits) * p.batch * p.nhead_q * p.seqlen_q : 0;
    *lse_acc = rows * sizeof(float);
    *o_acc = rows * p.hdim_v * sizeof(float);
}

}  // namespace
}  // namespace mhakit

MHAKIT_EXPORT float mhakit_mha_fwd_splitkv(const mhakit_fwd_splitkv_args* args, const mhakit_stream_config* config) {
    using namespace mhakit;
    clear_error();
    const mhakit_stream_config defaults{nullptr, 0, 0, 0, 1, 1};
    const mhakit_stream_config& sc = config ? *config : defaults;
    if (sc.time_kernel && sc.warmup < 0) return fail(E, "stream_config.warmup must be >= 0");
    if (args == nullptr) return fail(E, "args must not be NULL");
    if (float rc = validate(*args)) return rc;
    if (args->batch == 0 || (args->seqlen_q == 0 && args->seqlen_knew == 0)) return 0.f;  // nothing to do
    SplitkvParams p;
    const SplitkvInstance* inst = nullptr;
    if (float rc = prepare(args, &p, &inst)) return rc;
    if (float rc = check_device_arch(kFwdBuiltArch)) return rc;
    if (float rc = resolve_splits(&p, *inst)) return rc;
    if (p.num_splits > 1 && p.seqlen_q > 0 && (p.lse_acc == nullptr || p.o_acc == nullptr)) {
        size_t lse_b = 0, o_b = 0;
        acc_bytes(p, &lse_b, &o_b);
        return fail(E, "the call runs %d splits and needs lse_acc_ptr (%zu bytes) and o_acc_ptr (%zu bytes); "
                       "mhakit_mha_fwd_splitkv_acc_size says how much", p.num_splits, lse_b, o_b);
    }
    if (sc.log_level > 0) std::printf("[mhakit] mha_fwd_splitkv -> %s (num_splits %d)\n", inst->name, p.num_splits);
    return run_or_time(inst->name, sc, [&](dev::Stream stream) { return inst->run(p, stream); });
}

MHAKIT_EXPORT const char* mhakit_mha_fwd_splitkv_kernel_name(const mhakit_fwd_splitkv_args* args) {
    using namespace mhakit;
    clear_error();
    SplitkvParams p;
    const SplitkvInstance* inst = nullptr;
    if (prepare(args, &p, &inst) != 0.f) return nullptr;
    return inst->name;
}

MHAKIT_EXPORT float mhakit_mha_fwd_splitkv_acc_size(const mhakit_fwd_splitkv_args* args, size_t* lse_acc_bytes,
                                                    size_t* o_acc_bytes, int* num_splits) {
    using namespace mhakit;
    clear_error();
    if (lse_acc_bytes == nullptr || o_acc_bytes == nullptr || num_splits == nullptr)
        return fail(E, "lse_acc_bytes, o_acc_bytes and num_splits must not be NULL");
    SplitkvParams p;
    const SplitkvInstance* inst = nullptr;
    if (float rc = prepare(args, &p, &inst)) return rc;
    if (float rc = resolve_splits(&p, *inst)) return rc;
    acc_bytes(p, lse_acc_bytes, o_acc_bytes);
    *num_splits = p.num_splits;
    return 0.f;
}
