// The score modifiers every kernel family that serves them applies, and the host references mirror: logits soft-cap,
// elementwise bias, ALiBi, attention sinks (csrc/include/mha_fwd.h says what they mean). One place states the
// arithmetic; the kernels call it per element, the host references per row.
//
// With a soft-cap, a bias or dropout (ScoreMods::per_element: the modifier instances, "_mods") a kernel works in logit
// units: L = modified(scale·q·k) replaces q·k before the mask and the softmax, whose scale is then 1; dropout
// (dropout.h) then drops probabilities after the softmax. A sink alone changes only the softmax's start (and the
// backward's d sink), so such calls keep the plain per-element path.
#pragma once

#include <stdint.h>

#include <type_traits>

#include <cmath>

#include "../../include/mha_common.h"
#include "dropout.h"
#include "mask.h"  // MHAKIT_HOST_DEVICE

namespace mhakit {

struct ScoreMods {
    uint32_t kinds;       // the modifiers set, as mhakit_score_mod bits (the runtime matches them with an instance's)
    bool any;             // any modifier set
    bool per_element;     // soft-cap or bias / ALiBi: the kernels take the logit path below (a sink alone does not)
    float scale;          // the softmax scale (q·k -> logit)
    float softcap;        // > 0: L = softcap · tanh(scale·q·k / softcap)
    float softcap_arg;    // scale / softcap: q·k -> the tanh argument
    int bias_type;        // mhakit_bias_type
    bool bias_fp32;       // elementwise: fp32 values (else the data type, 16-bit)
    const void* bias;     // elementwise values or ALiBi slopes
    int64_t bias_row_stride, bias_head_stride, bias_batch_stride;  // elements
    const float* sink;    // [nhead_q] sink logits, or nullptr
    Dropout dropout;      // dropout.on: drop probabilities after the softmax (dropout.h)
};

// The Dropout of an argument struct's dropout fields (p_drop, drop_seed / drop_offset and their device pointers; the
// same names in mhakit_fwd_args and mhakit_bwd_args); the forward's randval store is set by its runtime.
template <class Args>
inline Dropout dropout_of(const Args& a) {
    Dropout d{};
    d.on = a.p_drop > 0.f;
    if (!d.on) return d;
    d.keep_max = dropout_keep_max(a.p_drop);
    d.rp = 1.f / (1.f - a.p_drop);
    d.seed = a.drop_seed, d.offset = a.drop_offset;
    d.seed_ptr = a.drop_seed_ptr, d.offset_ptr = a.drop_offset_ptr;
    return d;
}

// The ScoreMods of an argument struct's modifier fields (mhakit_fwd_args or mhakit_bwd_args: the same names), for
// the runtime (device pointers) and the host references (host pointers) alike; the validator has checked them.
template <class Args>
inline ScoreMods score_mods_of(const Args& a, float scale) {
    ScoreMods m{};
    m.scale = scale;
    m.softcap = a.logits_soft_cap > 0.f ? a.logits_soft_cap : 0.f;
    m.softcap_arg = m.softcap > 0.f ? scale / m.softcap : 0.f;
    m.bias_type = a.bias_ptr != nullptr ? a.bias_type : 0;
    m.bias_fp32 = m.bias_type == 2 || (m.bias_type == 1 && a.bias_fp32 != 0);  // ALiBi slopes are fp32
    m.bias = m.bias_type != 0 ? a.bias_ptr : nullptr;
    m.bias_row_stride = a.stride_bias, m.bias_head_stride = a.nhead_stride_bias;
    m.bias_batch_stride = a.batch_stride_bias;
    m.sink = a.sink_ptr;
    m.dropout = dropout_of(a);
    m.per_element = m.softcap > 0.f || m.bias != nullptr || m.dropout.on;
    m.any = m.per_element || m.sink != nullptr;
    m.kinds = (m.softcap > 0.f ? MHAKIT_MOD_SOFTCAP : 0u) | (m.bias_type == 1 ? MHAKIT_MOD_BIAS : 0u) |
              (m.bias_type == 2 ? MHAKIT_MOD_ALIBI : 0u) | (m.sink != nullptr ? MHAKIT_MOD_SINK : 0u) |
              (m.dropout.on ? MHAKIT_MOD_DROPOUT : 0u);
    return m;
}

// The ALiBi term of query i and key j of a sequence of seqlen_q queries and seqlen_k keys (bottom-right aligned).
MHAKIT_HOST_DEVICE float alibi_term(float slope, int i, int j, int seqlen_q, int seqlen_k) {
    const int d = i + (seqlen_k - seqlen_q) - j;
    return -slope * static_cast<float>(d < 0 ? -d : d);
}

// What the modifiers need of one (sequence b, query head h): the sequence's lengths, its ALiBi slope, and the start
// of its elementwise-bias block. Positions i, j count from the sequence's start.
struct RowMods {
    float scale, softcap, softcap_arg;
    int bias_type;
    bool bias_fp32;
    const char* bias;  // (b, h, 0, 0) of the elementwise bias, in bytes
    int64_t bias_row_bytes;
    float slope;
    int seqlen_q, seqlen_k;
};

MHAKIT_HOST_DEVICE RowMods row_mods(const ScoreMods& m, int b, int h, int seqlen_q, int seqlen_k) {
    RowMods r;
    r.scale = m.scale;
    r.softcap = m.softcap;
    r.softcap_arg = m.softcap_arg;
    r.bias_type = m.bias_type;
    r.bias_fp32 = m.bias_fp32;
    r.seqlen_q = seqlen_q;
    r.seqlen_k = seqlen_k;
    r.slope = 0.f;
    r.bias = nullptr;
    r.bias_row_bytes = 0;
    const int64_t off = static_cast<int64_t>(b) * m.bias_batch_stride + static_cast<int64_t>(h) * m.bias_head_stride;
    if (m.bias_type == 2) r.slope = static_cast<const float*>(m.bias)[off];
    if (m.bias_type == 1) {
        const int64_t elem = m.bias_fp32 ? 4 : 2;
        r.bias = static_cast<const char*>(m.bias) + off * elem;
        r.bias_row_bytes = m.bias_row_stride * elem;
    }
    return r;
}

// tanh on the device as 1 − 2 / (e^(2x) + 1) from ex2.approx and rcp.approx (absolute error about 1e-7, against
// about 5e-4 relative of tanh.approx.f32, which a cap of 30-50 can turn into logit errors of 1e-2): the generic
// kernels' soft-cap. The Hopper kernels take approx_tanh (below), half the MUFU work.
MHAKIT_HOST_DEVICE float fast_tanh(float x) {
#if defined(__CUDA_ARCH__)
    float e, r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(x * 2.8853900817779268f));  // 2·log2(e)
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(e + 1.f));                  // rcp(inf) = 0
    return fmaf(-2.f, r, 1.f);
#else
    return std::tanh(x);
#endif
}

// tanh on the device as the hardware's tanh.approx.f32: one MUFU operation (fast_tanh takes two), max relative error
// 2^-10.987 (PTX ISA). The Hopper kernels' soft-cap, forward and backward alike (the backward recomputes the forward's
// P with it). A soft-capped logit cap·tanh(x) is then off by at most cap·|tanh x|·2^-10.987 <= 4.9e-4·|logit|, and
// never more than 4.9e-4·cap (docs/PERFORMANCE.md weighs that against the 16-bit rounding of P).
MHAKIT_HOST_DEVICE float approx_tanh(float x) {
#if defined(__CUDA_ARCH__)
    float t;
    asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(x));
    return t;
#else
    return std::tanh(x);
#endif
}

// The logit of query i and key j from the raw q·k (both inside the sequence), for a soft-cap (kSoftcap) and a bias
// kind (kBias, mhakit_bias_type) known at compile time: the kernels dispatch once per tile to the variant the call
// needs, so the per-element code has no branches. *dcap (when given) receives the derivative of the soft-capped
// logit with respect to scale·q·k (1 − tanh², or 1 without a soft-cap), which the backward multiplies dS by.
// bias16 converts a 16-bit bias element of the data type to float. kApproxTanh: the soft-cap's tanh is approx_tanh
// (the Hopper kernels), else fast_tanh.
template <bool kSoftcap, int kBias, class Bias16, bool kApproxTanh = false>
MHAKIT_HOST_DEVICE float modified_logit_t(const RowMods& r, float qk, int i, int j, Bias16 bias16, float* dcap) {
    float l;
    if constexpr (kSoftcap) {
        const float x = qk * r.softcap_arg;
        const float t = kApproxTanh ? approx_tanh(x) : fast_tanh(x);
        l = r.softcap * t;
        if (dcap) *dcap = 1.f - t * t;
    } else {
        l = qk * r.scale;
        if (dcap) *dcap = 1.f;
    }
    if constexpr (kBias == 2) {
        l += alibi_term(r.slope, i, j, r.seqlen_q, r.seqlen_k);
    } else if constexpr (kBias == 1) {
        const char* row = r.bias + static_cast<int64_t>(i) * r.bias_row_bytes;
        l += r.bias_fp32 ? reinterpret_cast<const float*>(row)[j] : bias16(reinterpret_cast<const uint16_t*>(row)[j]);
    }
    return l;
}

// Calls f(std::integral_constant<bool, soft-cap>{}, std::integral_constant<int, bias kind>{}) for r's modifiers.
template <class F>
MHAKIT_HOST_DEVICE void with_mod_kind(const RowMods& r, F&& f) {
    using T = std::integral_constant<bool, true>;
    using N = std::integral_constant<bool, false>;
    using B0 = std::integral_constant<int, 0>;
    using B1 = std::integral_constant<int, 1>;
    using B2 = std::integral_constant<int, 2>;
    if (r.softcap > 0.f) {
        if (r.bias_type == 2) f(T{}, B2{});
        else if (r.bias_type == 1) f(T{}, B1{});
        else f(T{}, B0{});
    } else {
        if (r.bias_type == 2) f(N{}, B2{});
        else if (r.bias_type == 1) f(N{}, B1{});
        else f(N{}, B0{});
    }
}

// The same with the modifiers known at run time (the host references).
template <class Bias16>
MHAKIT_HOST_DEVICE float modified_logit(const RowMods& r, float qk, int i, int j, Bias16 bias16, float* dcap = nullptr) {
    float l = 0.f;
    with_mod_kind(r, [&](auto cap, auto bias) {
        l = modified_logit_t<decltype(cap)::value, decltype(bias)::value>(r, qk, i, j, bias16, dcap);
    });
    return l;
}

// The sink logit of query head h from the call's sink logits (null: none), or -inf without one (exp(-inf) adds
// nothing to the denominator). The ScoreMods form is for kernels that carry the modifiers; the Hopper plain kernels
// carry only the sink pointer.
MHAKIT_HOST_DEVICE float sink_logit(const float* sink, int h) {
    return sink != nullptr ? sink[h] : -__builtin_huge_valf();
}
MHAKIT_HOST_DEVICE float sink_logit(const ScoreMods& m, int h) { return sink_logit(m.sink, h); }

}  // namespace mhakit
