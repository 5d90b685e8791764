// mhakit — host (CPU) reference for attention, and the pass/fail rule used by the benchmarks.
//
// Header-only, plain C++17, no CUDA headers. Pieces, from low to high level:
//   * fp16 / bf16 <-> float conversion on raw 16-bit patterns (round to nearest even, NaN/Inf/subnormals kept);
//   * parallel_for: a tiny thread fan-out (threads: MHAKIT_REF_THREADS env, else all hardware threads);
//   * attention_rows_fp32: softmax(scale·q·kᵀ, masked)·v for some query rows of one (sequence, head), fp32;
//     it can also hand back the probabilities P, which the backward reference needs;
//   * reference_mha_fwd: the whole forward pass, driven by the same mhakit_fwd_args the library takes, but with
//     host pointers (so every layout the library accepts is accepted here too);
//   * gather_tokens + check_err: pull the logical elements out of a strided buffer and compare them with CK's rule
//     |out - ref| <= atol + rtol·|ref| (non-finite values fail, except that ref = ±inf matches the same inf
//     when allow_infinity_ref is set — that is how LSE = -inf of empty rows is checked).
//
// Semantics (see csrc/include/mha_fwd.h): the mask is evaluated per sequence with make_mask_coord() from
// csrc/kernels/common/mask.h; GQA maps query head h to kv head h / (nhead_q / nhead_k); LSE is the natural log of the
// sum of exp(scale·s) over the visible keys; a row that sees no key gets O = 0 and LSE = -inf. The score modifiers
// (soft-cap, bias / ALiBi, sink) come from csrc/kernels/common/score_mod.h, as the kernels apply them.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "../include/mha_fwd.h"
#include "../kernels/common/mask.h"
#include "../kernels/common/score_mod.h"

namespace mhakit {
namespace host {

// ------------------------------------------------------------------------------------------------------------------
// fp16 / bf16 <-> float (16-bit patterns stored in uint16_t)
// ------------------------------------------------------------------------------------------------------------------

inline uint32_t float_bits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof(u));
    return u;
}

inline float bits_float(uint32_t u) {
    float f;
    std::memcpy(&f, &u, sizeof(f));
    return f;
}

// IEEE binary16 -> float (exact).
inline float fp16_to_float(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1Fu;
    const uint32_t man = h & 0x3FFu;
    if (exp == 0x1Fu) return bits_float(sign | 0x7F800000u | (man << 13));  // inf, or NaN with its payload
    if (exp == 0) {
        // zero or subnormal: man · 2^-24 (exact in float)
        const float v = float(man) * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    return bits_float(sign | ((exp + 112u) << 23) | (man << 13));
}

// float -> IEEE binary16, round to nearest, ties to even; overflow gives ±inf, NaN stays a (quiet) NaN.
inline uint16_t float_to_fp16(float f) {
    const uint32_t x = float_bits(f);
    const uint16_t sign = uint16_t((x >> 16) & 0x8000u);
    const uint32_t ax = x & 0x7FFFFFFFu;
    if (ax >= 0x7F800000u) {                                                          // inf or NaN
        if (ax > 0x7F800000u) return uint16_t(sign | 0x7E00u | ((ax >> 13) & 0x3FFu));  // quiet NaN
        return uint16_t(sign | 0x7C00u);
    }
    if (ax >= 0x477FF000u) return uint16_t(sign | 0x7C00u);  // >= 65520 rounds to inf
    if (ax >= 0x38800000u) {                                 // normal half (>= 2^-14)
        uint32_t h = ((((ax >> 23) - 112u) << 10) | ((ax >> 13) & 0x3FFu));
        const uint32_t rest = ax & 0x1FFFu;
        if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // a carry into the exponent is correct
        return uint16_t(sign | h);
    }
    // subnormal half (or zero): value = m · 2^(e-150) with the implicit bit; half mantissa = m >> (126 - e)
    const uint32_t e = ax >> 23;
    if (e == 0) return sign;  // float subnormals are far below half's smallest subnormal
    const uint32_t m = (ax & 0x7FFFFFu) | 0x800000u;
    const uint32_t shift = 126u - e;  // >= 14 here
    if (shift > 24u) return sign;     // below half of the smallest subnormal
    uint32_t q = m >> shift;
    const uint32_t rest = m & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    if (rest > half || (rest == half && (q & 1u))) ++q;  // may round up into the smallest normal: still correct
    return uint16_t(sign | q);
}

inline float bf16_to_float(uint16_t b) { return bits_float(uint32_t(b) << 16); }

// float -> bfloat16, round to nearest, ties to even; NaN stays a (quiet) NaN.
inline uint16_t float_to_bf16(float f) {
    uint32_t x = float_bits(f);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((x >> 16) | 0x0040u);
    x += 0x7FFFu + ((x >> 16) & 1u);
    return uint16_t(x >> 16);
}

// ------------------------------------------------------------------------------------------------------------------
// fp8 e4m3 (OCP e4m3fn: bias 7, no infinities, 0x7F / 0xFF NaN, max 448) <-> float
// ------------------------------------------------------------------------------------------------------------------

inline bool is_fp8(mhakit_dtype t) { return t == MHAKIT_DTYPE_FP8_BF16 || t == MHAKIT_DTYPE_FP8_FP16; }
// The element type of o (and of every 16-bit tensor): the dtype itself, or an fp8 dtype's output type.
inline mhakit_dtype output_dtype(mhakit_dtype t) {
    return t == MHAKIT_DTYPE_FP8_BF16 ? MHAKIT_DTYPE_BF16 : t == MHAKIT_DTYPE_FP8_FP16 ? MHAKIT_DTYPE_FP16 : t;
}

constexpr float kE4m3Max = 448.0f;

inline float e4m3_to_float(uint8_t b) {
    const int e = (b >> 3) & 0xF, m = b & 0x7;
    float v;
    if (e == 0xF && m == 0x7) v = std::numeric_limits<float>::quiet_NaN();
    else if (e == 0) v = std::ldexp(float(m), -9);  // subnormal: m · 2^-9
    else v = std::ldexp(1.0f + float(m) / 8.0f, e - 7);
    return (b & 0x80) ? -v : v;
}

// float -> e4m3, round to nearest, ties to even, saturating to ±448 (as cvt.rn.satfinite does); NaN -> 0x7F.
inline uint8_t float_to_e4m3(float f) {
    if (std::isnan(f)) return 0x7F;
    const uint8_t sign = std::signbit(f) ? 0x80 : 0x00;
    const float a = std::fabs(f);
    if (a >= kE4m3Max) return uint8_t(sign | 0x7E);
    if (a < 0.015625f) return uint8_t(sign | uint8_t(std::nearbyint(a * 512.0f)));  // subnormal; 8 is 2^-6: exact
    int ex;
    std::frexp(a, &ex);  // a = fr · 2^ex, fr in [0.5, 1)
    int e = ex - 1;      // a = mant · 2^e, mant in [1, 2)
    int q = int(std::nearbyint((std::ldexp(a, -e) - 1.0f) * 8.0f));
    if (q == 8) q = 0, ++e;
    if (e + 7 > 15 || (e + 7 == 15 && q == 7)) return uint8_t(sign | 0x7E);  // past 448 after rounding: saturate
    return uint8_t(sign | ((e + 7) << 3) | q);
}

// 16-bit values of a dtype (an fp8 dtype: its 16-bit output type).
inline float to_float(uint16_t v, mhakit_dtype t) {
    return output_dtype(t) == MHAKIT_DTYPE_BF16 ? bf16_to_float(v) : fp16_to_float(v);
}
inline uint16_t from_float(float f, mhakit_dtype t) {
    return output_dtype(t) == MHAKIT_DTYPE_BF16 ? float_to_bf16(f) : float_to_fp16(f);
}
inline float round_to(float f, mhakit_dtype t) { return to_float(from_float(f, t), t); }
inline const char* dtype_name(mhakit_dtype t) {
    return t == MHAKIT_DTYPE_FP8_BF16 ? "fp8bf16" : t == MHAKIT_DTYPE_FP8_FP16 ? "fp8fp16"
                                      : t == MHAKIT_DTYPE_BF16                 ? "bf16"
                                                                               : "fp16";
}

// Element k of an input tensor (q, k, v) as fp32: 16-bit bits, or (fp8) e4m3 bits times the tensor's descale factor.
struct HostInput {
    const void* base;
    mhakit_dtype dt;
    float descale;  // fp8 only
    float operator()(int64_t k) const {
        if (is_fp8(dt)) return e4m3_to_float(static_cast<const uint8_t*>(base)[k]) * descale;
        return to_float(static_cast<const uint16_t*>(base)[k], dt);
    }
};

// ------------------------------------------------------------------------------------------------------------------
// parallel_for
// ------------------------------------------------------------------------------------------------------------------

inline int default_threads() {
    if (const char* e = std::getenv("MHAKIT_REF_THREADS")) {
        const int n = std::atoi(e);
        if (n > 0) return n;
    }
    const unsigned hc = std::thread::hardware_concurrency();
    return hc > 0 ? int(hc) : 1;
}

// Calls f(i) for i in [0, n), spread over up to `threads` threads (0: default_threads()). f must be thread-safe.
template <class F>
void parallel_for(int64_t n, F&& f, int threads = 0) {
    if (n <= 0) return;
    int nt = threads > 0 ? threads : default_threads();
    if (int64_t(nt) > n) nt = int(n);
    if (nt <= 1) {
        for (int64_t i = 0; i < n; ++i) f(i);
        return;
    }
    std::atomic<int64_t> next{0};
    auto worker = [&]() {
        for (;;) {
            const int64_t i = next.fetch_add(1, std::memory_order_relaxed);
            if (i >= n) break;
            f(i);
        }
    };
    std::vector<std::thread> pool;
    pool.reserve(size_t(nt - 1));
    for (int t = 0; t < nt - 1; ++t) pool.emplace_back(worker);
    worker();
    for (auto& th : pool) th.join();
}

// ------------------------------------------------------------------------------------------------------------------
// Core: some query rows of one (sequence, head), fp32
// ------------------------------------------------------------------------------------------------------------------

// Visible key range [begin, end) of row i under mask coordinate mc (empty when end <= begin).
inline void visible_keys(MaskCoord mc, int i, int seqlen_k, int* begin, int* end) {
    int b = mask_key_begin(mc, i);
    int e = mask_key_end(mc, i, seqlen_k);
    if (b < 0) b = 0;
    if (e > seqlen_k) e = seqlen_k;
    *begin = b;
    *end = e;
}

// The score modifiers of one (sequence, head) as the host reference applies them (score_mod.h's arithmetic, with
// std::tanh): the logit function, the elementwise bias's data type, and the sink logit (-inf: none).
struct HostRowMods {
    RowMods r;
    mhakit_dtype dt;
    float sink;
    float logit(float qk, int i, int j, float* dcap = nullptr) const {
        return modified_logit(r, qk, i, j, [&](uint16_t v) { return to_float(v, dt); }, dcap);
    }
};

inline HostRowMods host_row_mods(const ScoreMods& m, mhakit_dtype dt, int b, int h, int seqlen_q, int seqlen_k) {
    return HostRowMods{row_mods(m, b, h, seqlen_q, seqlen_k), dt, sink_logit(m, h)};
}

// Dropout of one (sequence, head) as the references apply it: the random bytes (uint8, row i of the sequence at
// rv + i·ld, as the forward stores them in randval_ptr), kept when <= keep_max and then scaled by rp.
struct HostDropout {
    const uint8_t* rv;
    int64_t ld;
    int keep_max;
    float rp;
    float apply(float p, int i, int j) const { return rv[int64_t(i) * ld + j] <= keep_max ? p * rp : 0.0f; }
};

// A randval tensor (uint8, host): (b, h, i, j) at b·batch + h·head + i·row + j, or in group mode
// h·head + (seqstart_q[b] + i)·row + j (mha_fwd.h).
struct HostRandval {
    const uint8_t* data;
    int64_t row, head, batch;
    const uint8_t* block(bool group_mode, const int32_t* seqstart_q, int b, int h) const {
        return data + int64_t(h) * head + (group_mode ? int64_t(seqstart_q[b]) * row : int64_t(b) * batch);
    }
};

// Fills a randval tensor with the random bytes of (seed, offset) (dropout.h's Philox, the kernels' numbers): what the
// benchmarks validate against when the library is not asked to store them, and compare with when it is.
inline void fill_randval(uint8_t* rv, int64_t row, int64_t head, int64_t batch, bool group_mode,
                         const int32_t* seqstart_q, const int32_t* seqstart_k, int nbatch, int nhead, int seqlen_q,
                         int seqlen_k, uint64_t seed, uint64_t offset) {
    for (int b = 0; b < nbatch; ++b) {
        const int nq = group_mode ? seqstart_q[b + 1] - seqstart_q[b] : seqlen_q;
        const int nk = group_mode ? seqstart_k[b + 1] - seqstart_k[b] : seqlen_k;
        parallel_for(
            int64_t(nhead) * nq,
            [&](int64_t item) {
                const int h = int(item / nq), i = int(item % nq);
                uint8_t* r = rv + int64_t(h) * head +
                             (group_mode ? int64_t(seqstart_q[b]) * row : int64_t(b) * batch) + int64_t(i) * row;
                for (int j = 0; j < nk; ++j)
                    r[j] = uint8_t(dropout_byte(seed, offset, uint32_t(b * nhead + h), i, j));
            },
            0);
    }
}

// The library's stored random bytes (copied to the host) against the host's rv (fill_randval) over the visible
// scores of every (sequence, head) (what the kernels visit): up to 8 mismatches reported to log (if any); the stored
// bytes then replace the host's there. Returns the number of mismatches.
inline size_t compare_randval(const uint8_t* stored, uint8_t* rv, int64_t row, int64_t head, int64_t batch,
                              bool group_mode, const int32_t* seqstart_q, const int* seqlen_q, const int* seqlen_k,
                              int nbatch, int nhead, int mask_type, int left, int right, FILE* log) {
    size_t bad = 0;
    for (int b = 0; b < nbatch; ++b) {
        const MaskCoord mc = make_mask_coord(mask_type, left, right, seqlen_q[b], seqlen_k[b]);
        for (int h = 0; h < nhead; ++h)
            for (int i = 0; i < seqlen_q[b]; ++i) {
                int jb, je;
                visible_keys(mc, i, seqlen_k[b], &jb, &je);
                const int64_t r = int64_t(h) * head + (group_mode ? int64_t(seqstart_q[b]) * row : int64_t(b) * batch) +
                                  int64_t(i) * row;
                for (int j = jb; j < je; ++j) {
                    if (stored[r + j] != rv[r + j] && bad++ < 8 && log != nullptr)
                        std::fprintf(log, "randval mismatch b=%d h=%d i=%d j=%d: %u (host %u)\n", b, h, i, j,
                                     unsigned(stored[r + j]), unsigned(rv[r + j]));
                    rv[r + j] = stored[r + j];
                }
            }
    }
    return bad;
}

// Rows i in [row_begin, row_end) of one (sequence, head); r = i - row_begin is the local row. Inputs, all fp32:
//   q  : query row i at q + r·ldq (hdim_q values)
//   kt : K transposed: element (d, j) at kt[d·ldkt + j], d < hdim_q, j < seqlen_k
//   v  : key row j at v + j·ldv (hdim_v values)
// Outputs (row i of the sequence is local row r; the mask uses the absolute i):
//   o[r·ldo + 0 .. hdim_v)         = Σ_j P(i,j)·v_j              (zeros when the row sees no key)
//   lse[r] (if lse != nullptr)     = m + log Σ_j exp(S(i,j) - m)  (-inf when the row sees no key)
//   p[r·ldp + j] (if p != nullptr) = P(i,j), 0 for masked j
// where S = scale·q·kᵀ restricted to the visible keys, or, with score modifiers (mods), the modified logits, the
// sink adding exp(sink) to the denominator (a row without keys then gets LSE = sink); dcap[r·ldp + j] (optional)
// receives the soft-cap's derivative of each visible logit. When round_p is set, P is rounded to p_dtype before the
// P·V product (CK's reference does this); the LSE is not affected. scratch must hold seqlen_k floats.
inline void attention_rows_fp32(const float* q, int64_t ldq, const float* kt, int64_t ldkt, const float* v, int64_t ldv,
                                int seqlen_k, int hdim_q, int hdim_v, float scale, MaskCoord mc, int row_begin,
                                int row_end, float* o, int64_t ldo, float* lse, float* p, int64_t ldp, float* scratch,
                                bool round_p = false, mhakit_dtype p_dtype = MHAKIT_DTYPE_FP16,
                                const HostRowMods* mods = nullptr, float* dcap = nullptr,
                                const HostDropout* drop = nullptr) {
    const float neg_inf = -std::numeric_limits<float>::infinity();
    const float sink = mods != nullptr ? mods->sink : neg_inf;
    for (int i = row_begin; i < row_end; ++i) {
        const int64_t r = i - row_begin;
        float* orow = o + r * ldo;
        float* prow = p != nullptr ? p + r * ldp : nullptr;
        float* crow = dcap != nullptr ? dcap + r * ldp : nullptr;
        int jb, je;
        visible_keys(mc, i, seqlen_k, &jb, &je);
        if (prow != nullptr) std::fill(prow, prow + seqlen_k, 0.0f);
        if (crow != nullptr) std::fill(crow, crow + seqlen_k, 1.0f);
        if (je <= jb) {
            std::fill(orow, orow + hdim_v, 0.0f);
            if (lse != nullptr) lse[r] = sink;
            continue;
        }
        const int n = je - jb;
        float* s = scratch;  // s[0..n) <-> keys jb..je
        std::fill(s, s + n, 0.0f);
        const float* qrow = q + r * ldq;
        for (int d = 0; d < hdim_q; ++d) {
            const float qd = qrow[d];
            const float* krow = kt + int64_t(d) * ldkt + jb;
            for (int j = 0; j < n; ++j) s[j] += qd * krow[j];
        }
        float m = sink;
        for (int j = 0; j < n; ++j) {
            s[j] = mods != nullptr ? mods->logit(s[j], i, jb + j, crow != nullptr ? crow + jb + j : nullptr)
                                   : s[j] * scale;
            m = std::max(m, s[j]);
        }
        float sum = sink == neg_inf ? 0.0f : std::exp(sink - m);
        for (int j = 0; j < n; ++j) {
            s[j] = std::exp(s[j] - m);
            sum += s[j];
        }
        const float inv = 1.0f / sum;
        if (lse != nullptr) lse[r] = m + std::log(sum);
        std::fill(orow, orow + hdim_v, 0.0f);
        for (int j = 0; j < n; ++j) {
            float pj = s[j] * inv;
            if (round_p) pj = round_to(pj, p_dtype);
            if (prow != nullptr) prow[jb + j] = pj;  // undropped (the backward reference drops it itself)
            if (drop != nullptr) pj = drop->apply(pj, i, jb + j);
            const float* vrow = v + int64_t(jb + j) * ldv;
            for (int d = 0; d < hdim_v; ++d) orow[d] += pj * vrow[d];
        }
    }
}

// ------------------------------------------------------------------------------------------------------------------
// Sequences (host mirror of seq_info() in csrc/kernels/common/fwd_params.h)
// ------------------------------------------------------------------------------------------------------------------

struct HostSeq {
    int seqlen_q, seqlen_k;
    int64_t q_off, k_off, v_off, o_off;  // element offsets of (this sequence, head 0, token 0)
    int64_t lse_off;                     // element offset of (this sequence, head 0, token 0) in LSE
};

// a.seqstart_q_ptr / a.seqstart_k_ptr must point to HOST arrays in group mode.
inline HostSeq host_seq(const mhakit_fwd_args& a, int b) {
    HostSeq s;
    if (a.is_group_mode) {
        const int32_t q0 = a.seqstart_q_ptr[b], k0 = a.seqstart_k_ptr[b];
        s.seqlen_q = a.seqstart_q_ptr[b + 1] - q0;
        s.seqlen_k = a.seqstart_k_ptr[b + 1] - k0;
        s.q_off = int64_t(q0) * a.stride_q;
        s.k_off = int64_t(k0) * a.stride_k;
        s.v_off = int64_t(k0) * a.stride_v;
        s.o_off = int64_t(q0) * a.stride_o;
        s.lse_off = q0;
    } else {
        s.seqlen_q = a.seqlen_q;
        s.seqlen_k = a.seqlen_k;
        s.q_off = int64_t(b) * a.batch_stride_q;
        s.k_off = int64_t(b) * a.batch_stride_k;
        s.v_off = int64_t(b) * a.batch_stride_v;
        s.o_off = int64_t(b) * a.batch_stride_o;
        s.lse_off = int64_t(b) * a.batch_stride_lse;
    }
    return s;
}

// ------------------------------------------------------------------------------------------------------------------
// Whole forward pass
// ------------------------------------------------------------------------------------------------------------------

struct FwdRefOptions {
    bool round_p = false;  // round P to the data type before P·V, as CK's reference does (default: pure fp32)
    int threads = 0;       // 0: default_threads()
    int row_block = 32;    // query rows per work item
};

// Host reference of mhakit_mha_fwd. `a` is the argument struct the library takes, except that q_ptr, k_ptr, v_ptr
// (raw fp16/bf16 bits per a.data_type, or e4m3 bytes with q/k/v_descale_ptr pointing at HOST floats: the inputs are
// then decoded times their descale factors, and P is not rounded) and, in group mode, seqstart_q_ptr /
// seqstart_k_ptr point to HOST memory;
// o_ptr / lse_ptr / has_lse are ignored; with dropout (p_drop > 0) randval_ptr must point to the HOST random bytes
// (laid out as mha_fwd.h says: the library's store, or fill_randval's). Results are written in fp32:
//   o_ref   laid out exactly like the library's O (a.stride_o, a.nhead_stride_o, a.batch_stride_o),
//   lse_ref (optional) laid out like the library's LSE (a.nhead_stride_lse, a.batch_stride_lse; group: [h, token]).
// Only the logical elements are written. The mask is evaluated per sequence.
inline void reference_mha_fwd(const mhakit_fwd_args& a, float* o_ref, float* lse_ref, const FwdRefOptions& opt = {}) {
    const mhakit_dtype dt = a.data_type;
    const bool fp8 = is_fp8(dt);
    const HostInput qb{a.q_ptr, dt, fp8 ? *a.q_descale_ptr : 1.0f};
    const HostInput kb{a.k_ptr, dt, fp8 ? *a.k_descale_ptr : 1.0f};
    const HostInput vb{a.v_ptr, dt, fp8 ? *a.v_descale_ptr : 1.0f};
    const int dq = a.hdim_q, dv = a.hdim_v;
    const int group = a.nhead_q / a.nhead_k;
    const int rb = opt.row_block > 0 ? opt.row_block : 32;
    const ScoreMods mods = score_mods_of(a, a.scale_s);
    const HostRandval rv{static_cast<const uint8_t*>(a.randval_ptr), a.stride_randval, a.nhead_stride_randval,
                         a.batch_stride_randval};

    std::vector<float> kt, vf;
    for (int b = 0; b < a.batch; ++b) {
        const HostSeq sq = host_seq(a, b);
        const int nq = sq.seqlen_q, nk = sq.seqlen_k;
        if (nq <= 0) continue;
        const MaskCoord mc = make_mask_coord(a.mask_type, a.window_size_left, a.window_size_right, nq, nk);
        for (int hk = 0; hk < a.nhead_k; ++hk) {
            // K transposed and V of this (sequence, kv head), as fp32
            kt.assign(size_t(dq) * size_t(nk > 0 ? nk : 0), 0.0f);
            vf.assign(size_t(nk > 0 ? nk : 0) * size_t(dv), 0.0f);
            parallel_for(
                nk,
                [&](int64_t j) {
                    const int64_t krow = sq.k_off + int64_t(hk) * a.nhead_stride_k + j * a.stride_k;
                    const int64_t vrow = sq.v_off + int64_t(hk) * a.nhead_stride_v + j * a.stride_v;
                    for (int d = 0; d < dq; ++d) kt[size_t(d) * size_t(nk) + size_t(j)] = kb(krow + d);
                    for (int d = 0; d < dv; ++d) vf[size_t(j) * size_t(dv) + size_t(d)] = vb(vrow + d);
                },
                nk >= 4096 ? opt.threads : 1);

            const int nblk = (nq + rb - 1) / rb;
            parallel_for(
                int64_t(group) * nblk,
                [&](int64_t item) {
                    const int h = hk * group + int(item / nblk);
                    const int r0 = int(item % nblk) * rb;
                    const int r1 = std::min(nq, r0 + rb);
                    const int rows = r1 - r0;
                    std::vector<float> qf(size_t(rows) * size_t(dq));
                    std::vector<float> of(size_t(rows) * size_t(dv));
                    std::vector<float> lf(static_cast<size_t>(rows));
                    std::vector<float> scratch(static_cast<size_t>(nk > 0 ? nk : 1));
                    for (int r = 0; r < rows; ++r) {
                        const int64_t qrow = sq.q_off + int64_t(h) * a.nhead_stride_q + int64_t(r0 + r) * a.stride_q;
                        for (int d = 0; d < dq; ++d) qf[size_t(r) * size_t(dq) + size_t(d)] = qb(qrow + d);
                    }
                    const HostRowMods hm = host_row_mods(mods, dt, b, h, nq, nk);
                    const HostDropout hd{mods.dropout.on ? rv.block(a.is_group_mode != 0, a.seqstart_q_ptr, b, h)
                                                         : nullptr,
                                         a.stride_randval, mods.dropout.keep_max, mods.dropout.rp};
                    attention_rows_fp32(qf.data(), dq, kt.data(), nk, vf.data(), dv, nk, dq, dv, a.scale_s, mc, r0, r1,
                                        of.data(), dv, lf.data(), nullptr, 0, scratch.data(), opt.round_p && !fp8, dt,
                                        mods.any ? &hm : nullptr, nullptr, mods.dropout.on ? &hd : nullptr);
                    for (int r = 0; r < rows; ++r) {
                        float* orow = o_ref + sq.o_off + int64_t(h) * a.nhead_stride_o + int64_t(r0 + r) * a.stride_o;
                        std::copy(of.begin() + ptrdiff_t(r) * dv, of.begin() + ptrdiff_t(r + 1) * dv, orow);
                        if (lse_ref != nullptr) lse_ref[sq.lse_off + int64_t(h) * a.nhead_stride_lse + r0 + r] = lf[size_t(r)];
                    }
                },
                opt.threads);
        }
    }
}

// ------------------------------------------------------------------------------------------------------------------
// Strided -> dense, and the comparison rule
// ------------------------------------------------------------------------------------------------------------------

// One sequence of a token tensor: `len` tokens starting at element offset `base` (head 0, token 0).
struct SeqRange {
    int len;
    int64_t base;
};

// Dense copy, ordered (sequence, head, token, dim), of the logical elements of a strided token tensor:
// element (b, h, i, d) lives at get(seqs[b].base + h·head_stride + i·row_stride + d).
template <class Get>
std::vector<float> gather_tokens(const std::vector<SeqRange>& seqs, int nhead, int dim, int64_t row_stride,
                                 int64_t head_stride, Get&& get) {
    size_t total = 0;
    for (const auto& s : seqs) total += size_t(s.len > 0 ? s.len : 0) * size_t(nhead) * size_t(dim);
    std::vector<float> out;
    out.reserve(total);
    for (const auto& s : seqs)
        for (int h = 0; h < nhead; ++h)
            for (int i = 0; i < s.len; ++i)
                for (int d = 0; d < dim; ++d) out.push_back(get(s.base + int64_t(h) * head_stride + int64_t(i) * row_stride + d));
    return out;
}

// Inverse of the gather order: dense index -> "b=.. h=.. i=.. d=.." (d omitted when dim == 1), for error reports.
inline std::string describe_token_index(const std::vector<SeqRange>& seqs, int nhead, int dim, size_t idx) {
    for (size_t b = 0; b < seqs.size(); ++b) {
        const size_t n = size_t(seqs[b].len > 0 ? seqs[b].len : 0) * size_t(nhead) * size_t(dim);
        if (idx < n) {
            const size_t per_head = size_t(seqs[b].len) * size_t(dim);
            const size_t h = idx / per_head, rem = idx % per_head;
            char buf[96];
            if (dim == 1)
                std::snprintf(buf, sizeof(buf), "b=%zu h=%zu i=%zu", b, h, rem);
            else
                std::snprintf(buf, sizeof(buf), "b=%zu h=%zu i=%zu d=%zu", b, h, rem / size_t(dim), rem % size_t(dim));
            return buf;
        }
        idx -= n;
    }
    return "out of range";
}

struct CheckResult {
    bool ok = true;
    size_t checked = 0;
    size_t bad = 0;
    size_t first_bad = 0;     // valid when bad > 0
    double max_abs_err = 0;   // over finite pairs
    double max_rel_err = 0;   // |out-ref| / |ref| over finite pairs with ref != 0
};

// CK's check_err: element k passes iff |out[k] - ref[k]| <= atol + rtol·|ref[k]| with both finite; with
// allow_infinity_ref, ref = ±inf passes iff out is the same infinity. Prints up to max_report mismatches and a
// summary line to `log` (nullptr: silent) when something fails; `describe(k)` names element k in the report.
inline CheckResult check_err(const char* name, const float* out, const float* ref, size_t n, double rtol, double atol,
                             bool allow_infinity_ref = false, FILE* log = stderr, int max_report = 8,
                             const std::function<std::string(size_t)>& describe = nullptr) {
    CheckResult r;
    r.checked = n;
    for (size_t k = 0; k < n; ++k) {
        const float o = out[k], e = ref[k];
        bool pass;
        if (allow_infinity_ref && std::isinf(e)) {
            pass = std::isinf(o) && (std::signbit(o) == std::signbit(e));
        } else if (!std::isfinite(o) || !std::isfinite(e)) {
            pass = false;
        } else {
            const double err = std::fabs(double(o) - double(e));
            r.max_abs_err = std::max(r.max_abs_err, err);
            if (e != 0.0f) r.max_rel_err = std::max(r.max_rel_err, err / std::fabs(double(e)));
            pass = err <= atol + rtol * std::fabs(double(e));
        }
        if (!pass) {
            if (r.bad == 0) r.first_bad = k;
            if (log != nullptr && r.bad < size_t(max_report)) {
                const std::string where = describe ? describe(k) : std::to_string(k);
                std::fprintf(log, "%s mismatch [%s]: out=%.8g ref=%.8g |diff|=%.3g (tol %.3g)\n", name, where.c_str(),
                             double(o), double(e), std::fabs(double(o) - double(e)), atol + rtol * std::fabs(double(e)));
            }
            ++r.bad;
        }
    }
    r.ok = (r.bad == 0);
    if (!r.ok && log != nullptr)
        std::fprintf(log, "%s: %zu of %zu elements out of tolerance (rtol=%g, atol=%g), max |diff| %.4g, max rel %.4g\n",
                     name, r.bad, r.checked, rtol, atol, r.max_abs_err, r.max_rel_err);
    return r;
}

// ------------------------------------------------------------------------------------------------------------------
// Forward convenience: compare device results (copied to the host, same layout) with reference_mha_fwd's output
// ------------------------------------------------------------------------------------------------------------------

inline std::vector<SeqRange> fwd_seq_ranges_o(const mhakit_fwd_args& a) {
    std::vector<SeqRange> v;
    for (int b = 0; b < a.batch; ++b) {
        const HostSeq s = host_seq(a, b);
        v.push_back({s.seqlen_q, s.o_off});
    }
    return v;
}

inline std::vector<SeqRange> fwd_seq_ranges_lse(const mhakit_fwd_args& a) {
    std::vector<SeqRange> v;
    for (int b = 0; b < a.batch; ++b) {
        const HostSeq s = host_seq(a, b);
        v.push_back({s.seqlen_q, s.lse_off});
    }
    return v;
}

struct FwdCheckResult {
    bool ok = true;
    CheckResult o, lse;
};

// o_out: host copy of the library's O (raw fp16/bf16 bits, a's layout); o_ref: reference_mha_fwd's fp32 O.
// lse_out / lse_ref: host copies of LSE (fp32, a's layout), both nullptr to skip. a's seqstart pointers: host.
// The reference O is rounded to a.data_type before comparing (as CK compares in the output type) unless
// round_ref_o is false. LSE is compared with allow_infinity_ref (rows without keys must give -inf).
inline FwdCheckResult check_fwd(const mhakit_fwd_args& a, const uint16_t* o_out, const float* o_ref, const float* lse_out,
                                const float* lse_ref, double rtol, double atol, bool round_ref_o = true,
                                FILE* log = stderr, int max_report = 8) {
    FwdCheckResult res;
    const mhakit_dtype dt = a.data_type;
    const auto so = fwd_seq_ranges_o(a);
    const std::vector<float> out = gather_tokens(so, a.nhead_q, a.hdim_v, a.stride_o, a.nhead_stride_o,
                                                 [&](int64_t k) { return to_float(o_out[k], dt); });
    const std::vector<float> ref = gather_tokens(so, a.nhead_q, a.hdim_v, a.stride_o, a.nhead_stride_o, [&](int64_t k) {
        return round_ref_o ? round_to(o_ref[k], dt) : o_ref[k];
    });
    const int nh = a.nhead_q, dv = a.hdim_v;
    res.o = check_err("O", out.data(), ref.data(), out.size(), rtol, atol, false, log, max_report,
                      [&](size_t k) { return describe_token_index(so, nh, dv, k); });
    res.ok = res.o.ok;
    if (lse_out != nullptr && lse_ref != nullptr) {
        const auto sl = fwd_seq_ranges_lse(a);
        const std::vector<float> lo = gather_tokens(sl, a.nhead_q, 1, 1, a.nhead_stride_lse, [&](int64_t k) { return lse_out[k]; });
        const std::vector<float> lr = gather_tokens(sl, a.nhead_q, 1, 1, a.nhead_stride_lse, [&](int64_t k) { return lse_ref[k]; });
        res.lse = check_err("LSE", lo.data(), lr.data(), lo.size(), rtol, atol, true, log, max_report,
                            [&](size_t k) { return describe_token_index(sl, nh, 1, k); });
        res.ok = res.ok && res.lse.ok;
    }
    return res;
}

}  // namespace host
}  // namespace mhakit
