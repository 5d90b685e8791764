#include "runtime/api_common.h"

#include <cmath>

namespace mhakit {
namespace {
constexpr int kMaxHdim = 256;
constexpr int kWindowBound = 1 << 29;
constexpr int E = MHAKIT_ERROR_INVALID_ARGS;
}  // namespace

const char* dtype_name(int dtype) {
    return dtype == MHAKIT_DTYPE_FP16 ? "fp16" : dtype == MHAKIT_DTYPE_BF16 ? "bf16" : "?";
}

float check_dtype(int dtype) {
    if (dtype == MHAKIT_DTYPE_FP16 || dtype == MHAKIT_DTYPE_BF16) return 0.f;
    return fail(E, "data_type %d is not supported: use MHAKIT_DTYPE_FP16 (0) or MHAKIT_DTYPE_BF16 (1)", dtype);
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

float check_head_dims(int hdim_q, int hdim_v) {
    for (int d : {hdim_q, hdim_v})
        if (d < 8 || d % 8 != 0 || d > kMaxHdim)
            return fail(E, "hdim_q and hdim_v must be multiples of 8 in [8, %d] (got %d and %d)", kMaxHdim, hdim_q,
                        hdim_v);
    return 0.f;
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

int clamp_window(int w) { return w < -kWindowBound ? -kWindowBound : (w > kWindowBound ? kWindowBound : w); }

float device_failure(dev::Error err, const char* what) {
    return fail(MHAKIT_ERROR_CUDA, "%s error in %s: %s", dev::kName, what, dev::error_string(err));
}

}  // namespace mhakit
