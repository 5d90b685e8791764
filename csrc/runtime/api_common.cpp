#include "runtime/api_common.h"

#include <cmath>

namespace mhakit {
namespace {
constexpr int kWindowBound = 1 << 29;
constexpr int E = MHAKIT_ERROR_INVALID_ARGS;
}  // namespace

const char* dtype_name(int dtype) {
    switch (dtype) {
        case MHAKIT_DTYPE_FP16: return "fp16";
        case MHAKIT_DTYPE_BF16: return "bf16";
        case MHAKIT_DTYPE_FP8_BF16: return "fp8bf16";
        case MHAKIT_DTYPE_FP8_FP16: return "fp8fp16";
        default: return "?";
    }
}

float check_dtype(int dtype, bool fp8_ok, const char* api) {
    if (dtype == MHAKIT_DTYPE_FP16 || dtype == MHAKIT_DTYPE_BF16 || (fp8_ok && is_fp8(dtype))) return 0.f;
    if (is_fp8(dtype))
        return fail(E, "data_type %s is not supported by the %s: fp8 is forward-only (mha_fwd); use fp16 or bf16",
                    dtype_name(dtype), api);
    return fail(E, "data_type %d is not supported: use MHAKIT_DTYPE_FP16 (0), MHAKIT_DTYPE_BF16 (1)%s", dtype,
                fp8_ok ? ", MHAKIT_DTYPE_FP8_BF16 (2) or MHAKIT_DTYPE_FP8_FP16 (3)" : "");
}

float check_scale(float scale, const char* name) {
    if (std::isfinite(scale) && scale > 0.f) return 0.f;
    return fail(E, "%s must be finite and > 0 (got %g); 1/sqrt(hdim_q) is the usual choice", name, scale);
}

float check_heads(int nhead_q, int nhead_k) {
    if (nhead_q < 1 || nhead_k < 1)
        return fail(E, "nhead_q and nhead_k must be >= 1 (got %d and %d)", nhead_q, nhead_k);
    if (nhead_q % nhead_k != 0)
        return fail(E, "nhead_q (%d) must be a multiple of nhead_k (%d) for GQA/MQA", nhead_q, nhead_k);
    return 0.f;
}

float check_head_dims(int hdim_q, int hdim_v, const HeadDimRule& rule) {
    for (int d : {hdim_q, hdim_v}) {
        if (d >= rule.multiple && d % rule.multiple == 0 && d <= rule.max) continue;
        if (rule.multiple == 1)
            return fail(E, "hdim_q and hdim_v must be in [1, %d] (got %d and %d)", rule.max, hdim_q, hdim_v);
        return fail(E, "hdim_q and hdim_v must be multiples of %d in [%d, %d] (got %d and %d)", rule.multiple,
                    rule.multiple, rule.max, hdim_q, hdim_v);
    }
    return 0.f;
}

float check_grid(int batch, int nhead_q) {
    if (batch > MHAKIT_MAX_BATCH)
        return fail(E, "batch (%d) is above the limit of %d sequences per call (one CUDA grid dimension); split the "
                       "batch over several calls", batch, MHAKIT_MAX_BATCH);
    if (nhead_q > MHAKIT_MAX_NHEAD)
        return fail(E, "nhead_q (%d) is above the limit of %d query heads per call (one CUDA grid dimension); "
                       "split the heads over several calls", nhead_q, MHAKIT_MAX_NHEAD);
    return 0.f;
}

float check_alignment(std::initializer_list<NamedPointer> pointers, size_t alignment, const char* what) {
    for (const NamedPointer& p : pointers)
        if (reinterpret_cast<uintptr_t>(p.ptr) % alignment != 0)
            return fail(E, "%s (%p) is misaligned: %s must be %zu-byte aligned", p.name, p.ptr, what, alignment);
    return 0.f;
}

namespace {
// A base pointer and the strides (elements) of the modes that address memory: the row stride always (TMA needs
// it even for one row), the head and batch strides where their extent exceeds 1.
bool tensor_aligned(const void* ptr, int64_t row, int64_t head, int nhead, int64_t batch, int nbatch, int64_t elem,
                    int64_t bytes) {
    if (reinterpret_cast<uintptr_t>(ptr) % uint64_t(bytes) != 0) return false;
    if ((row * elem) % bytes != 0) return false;
    if (nhead > 1 && (head * elem) % bytes != 0) return false;
    if (nbatch > 1 && (batch * elem) % bytes != 0) return false;
    return true;
}
}  // namespace

bool tensors_aligned(const FwdParams& p, int elem_bytes, int bytes) {
    const int nb = p.seqstart_q != nullptr ? 1 : p.batch;  // group mode: batch strides are not used
    const int o_bytes = kOutputBytes;                      // o is 16-bit whatever q, k, v are
    return tensor_aligned(p.q, p.q_row_stride, p.q_head_stride, p.nhead_q, p.q_batch_stride, nb, elem_bytes, bytes) &&
           tensor_aligned(p.k, p.k_row_stride, p.k_head_stride, p.nhead_k, p.k_batch_stride, nb, elem_bytes, bytes) &&
           tensor_aligned(p.v, p.v_row_stride, p.v_head_stride, p.nhead_k, p.v_batch_stride, nb, elem_bytes, bytes) &&
           tensor_aligned(p.o, p.o_row_stride, p.o_head_stride, p.nhead_q, p.o_batch_stride, nb, o_bytes, bytes);
}

bool tensors_aligned(const BwdParams& p, int elem_bytes, int bytes) {
    const int nb = p.seqstart_q != nullptr ? 1 : p.batch;
    const int hq = p.nhead_q, hk = p.nhead_k;
    const int64_t e = elem_bytes;
    return tensor_aligned(p.q, p.q_row_stride, p.q_head_stride, hq, p.q_batch_stride, nb, e, bytes) &&
           tensor_aligned(p.k, p.k_row_stride, p.k_head_stride, hk, p.k_batch_stride, nb, e, bytes) &&
           tensor_aligned(p.v, p.v_row_stride, p.v_head_stride, hk, p.v_batch_stride, nb, e, bytes) &&
           tensor_aligned(p.o, p.o_row_stride, p.o_head_stride, hq, p.o_batch_stride, nb, e, bytes) &&
           tensor_aligned(p.dout, p.do_row_stride, p.do_head_stride, hq, p.do_batch_stride, nb, e, bytes) &&
           tensor_aligned(p.dq, p.dq_row_stride, p.dq_head_stride, hq, p.dq_batch_stride, nb, e, bytes) &&
           tensor_aligned(p.dk, p.dk_row_stride, p.dk_head_stride, hk, p.dk_batch_stride, nb, e, bytes) &&
           tensor_aligned(p.dv, p.dv_row_stride, p.dv_head_stride, hk, p.dv_batch_stride, nb, e, bytes);
}

// Split-KV: q, o, the caches and the new rows. A cache's outer stride (batch, or page when paged) counts wherever it
// can be stepped: several batches, a paged cache, or cache_batch_idx (which may name any cache batch).
bool tensors_aligned(const SplitkvParams& p, int elem_bytes, int bytes) {
    const int nb = p.batch, hq = p.nhead_q, hk = p.nhead_k;
    const int n_cache = (p.block_table != nullptr || p.cache_batch_idx != nullptr) ? 2 : nb;
    const int64_t e = elem_bytes;
    const bool appended = p.seqlen_new > 0;
    return tensor_aligned(p.q, p.q_row_stride, p.q_head_stride, hq, p.q_batch_stride, nb, e, bytes) &&
           tensor_aligned(p.o, p.o_row_stride, p.o_head_stride, hq, p.o_batch_stride, nb, e, bytes) &&
           tensor_aligned(p.k_cache, p.k_row_stride, p.k_head_stride, hk, p.k_batch_stride, n_cache, e, bytes) &&
           tensor_aligned(p.v_cache, p.v_row_stride, p.v_head_stride, hk, p.v_batch_stride, n_cache, e, bytes) &&
           (!appended ||
            (tensor_aligned(p.k_new, p.knew_row_stride, p.knew_head_stride, hk, p.knew_batch_stride, nb, e, bytes) &&
             tensor_aligned(p.v_new, p.vnew_row_stride, p.vnew_head_stride, hk, p.vnew_batch_stride, nb, e, bytes)));
}

float check_nonnegative_strides(std::initializer_list<int64_t> strides) {
    for (int64_t s : strides)
        if (s < 0)
            return fail(E, "strides must be >= 0 (got %lld); the head dimension is always contiguous", (long long)s);
    return 0.f;
}

float check_mask_type(int mask_type) {
    if (mask_type >= MHAKIT_MASK_NONE && mask_type <= MHAKIT_MASK_GENERIC) return 0.f;
    return fail(E, "mask_type %d is unknown: 0 none, 1 top-left, 2 bottom-right, 3 generic", mask_type);
}

float check_score_mods(const ModArgs& m) {
    if (!(m.logits_soft_cap >= 0.f) || !std::isfinite(m.logits_soft_cap))
        return fail(E, "logits_soft_cap must be finite and >= 0 (got %g; 0 turns the soft-cap off)", m.logits_soft_cap);
    if (m.bias_type < MHAKIT_BIAS_NONE || m.bias_type > MHAKIT_BIAS_ALIBI)
        return fail(E, "bias_type %d is unknown: 0 none, 1 elementwise, 2 alibi", m.bias_type);
    if (m.bias_type != MHAKIT_BIAS_NONE && m.bias_ptr == nullptr)
        return fail(E, "bias_type %d needs bias_ptr (%s)", m.bias_type,
                    m.bias_type == MHAKIT_BIAS_ALIBI ? "fp32 ALiBi slopes" : "the elementwise bias");
    if (m.bias_type == MHAKIT_BIAS_ELEMENTWISE && m.bias_fp32 != 0 && m.bias_fp32 != 1)
        return fail(E, "bias_fp32 must be 0 (bias of the data type) or 1 (fp32 bias) (got %d)", m.bias_fp32);
    if (m.bias_type != MHAKIT_BIAS_NONE) {
        if (float rc = check_nonnegative_strides({m.stride_bias, m.nhead_stride_bias, m.batch_stride_bias})) return rc;
        const bool fp32 = m.bias_type == MHAKIT_BIAS_ALIBI || m.bias_fp32;
        if (float rc = check_alignment({{"bias_ptr", m.bias_ptr}}, fp32 ? 4 : 2, fp32 ? "fp32 bias" : "fp16/bf16 bias"))
            return rc;
    }
    return check_alignment({{"sink_ptr", m.sink_ptr}}, 4, "the fp32 sink logits");
}

float check_dropout(const DropArgs& d) {
    if (!(d.p_drop >= 0.f && d.p_drop < 1.f))
        return fail(E, "p_drop must be in [0, 1) (got %g; 0 turns dropout off)", d.p_drop);
    if ((d.seed_ptr == nullptr) != (d.offset_ptr == nullptr))
        return fail(E, "drop_seed_ptr and drop_offset_ptr must be given together (device seed and offset) or both be "
                       "NULL (host drop_seed / drop_offset)");
    return check_alignment({{"drop_seed_ptr", d.seed_ptr}, {"drop_offset_ptr", d.offset_ptr}}, 8,
                           "the uint64 dropout seed and offset");
}

int clamp_window(int w) { return w < -kWindowBound ? -kWindowBound : (w > kWindowBound ? kWindowBound : w); }

float device_failure(dev::Error err, const char* what) {
    return fail(MHAKIT_ERROR_CUDA, "%s error in %s: %s", dev::kName, what, dev::error_string(err));
}

}  // namespace mhakit
