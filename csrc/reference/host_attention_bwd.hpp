// mhakit — host (CPU) reference for the attention backward pass, and its pass/fail check.
//
// Header-only, plain C++17, no CUDA headers; builds on host_attention.hpp (conversions, parallel_for, the forward's
// row kernel attention_rows_fp32, gather_tokens, check_err).
//
// reference_mha_bwd() takes the same mhakit_bwd_args the library takes, with HOST pointers, and computes in fp32:
//   forward recompute  S = scale·Q·Kᵀ (masked per sequence), P = softmax(S) = exp(S − LSE), O = P·V, LSE
//   dP = dO·Vᵀ,  D = rowsum(dO ∘ O),  dS = P ∘ (dP − D)
//   dV = Pᵀ·dO,  dQ = scale·dS·K,  dK = scale·dSᵀ·Q
// GQA: dK / dV of kv head hk are summed over the query heads hk·G .. hk·G + G − 1 (G = nhead_q / nhead_k).
// Rows that see no key have P = 0 (so dQ = 0); keys that no row sees get dK = dV = 0; s_k = 0 leaves dQ = 0 and
// s_q = 0 gives dK = dV = 0. Every logical element of dQ / dK / dV is written (nothing else is touched).
//
// D comes from the reference's own fp32 O by default. With BwdRefOptions::d_from_o it is computed from the O the
// caller hands in through a.o_ptr (e.g. the device forward's fp16/bf16 O): that is the O the library's backward
// reads, so the reference then computes exactly what the kernel was asked to compute from its inputs.
//
// Work plan (memory stays bounded for long sequences): per (sequence, kv head, query head) the query rows are
// processed in chunks of at most max_block_elems / s_k rows; phase 1 (parallel over row blocks) recomputes P, dS and
// dQ for the chunk and keeps P and dS; phase 2 (parallel over key blocks, each key owned by one work item)
// accumulates dV and dK of the kv head in fp32. The summation order is fixed, so results are reproducible.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "../include/mha_bwd.h"
#include "../include/mha_fwd.h"
#include "../kernels/common/mask.h"
#include "host_attention.hpp"

namespace mhakit {
namespace host {

// ------------------------------------------------------------------------------------------------------------------
// Sequences (host mirror of the backward's per-sequence offsets; same rule as seq_info() in fwd_params.h)
// ------------------------------------------------------------------------------------------------------------------

struct HostSeqBwd {
    int seqlen_q, seqlen_k;
    // element offsets of (this sequence, head 0, token 0)
    int64_t q_off, k_off, v_off, o_off, do_off, dq_off, dk_off, dv_off;
    int64_t lse_off;
};

// a.seqstart_q_ptr / a.seqstart_k_ptr must point to HOST arrays in group mode.
inline HostSeqBwd host_seq(const mhakit_bwd_args& a, int b) {
    HostSeqBwd s;
    if (a.is_group_mode) {
        const int64_t q0 = a.seqstart_q_ptr[b], k0 = a.seqstart_k_ptr[b];
        s.seqlen_q = a.seqstart_q_ptr[b + 1] - a.seqstart_q_ptr[b];
        s.seqlen_k = a.seqstart_k_ptr[b + 1] - a.seqstart_k_ptr[b];
        s.q_off = q0 * a.stride_q;
        s.k_off = k0 * a.stride_k;
        s.v_off = k0 * a.stride_v;
        s.o_off = q0 * a.stride_o;
        s.do_off = q0 * a.stride_do;
        s.dq_off = q0 * a.stride_dq;
        s.dk_off = k0 * a.stride_dk;
        s.dv_off = k0 * a.stride_dv;
        s.lse_off = q0;
    } else {
        const int64_t bb = b;
        s.seqlen_q = a.seqlen_q;
        s.seqlen_k = a.seqlen_k;
        s.q_off = bb * a.batch_stride_q;
        s.k_off = bb * a.batch_stride_k;
        s.v_off = bb * a.batch_stride_v;
        s.o_off = bb * a.batch_stride_o;
        s.do_off = bb * a.batch_stride_do;
        s.dq_off = bb * a.batch_stride_dq;
        s.dk_off = bb * a.batch_stride_dk;
        s.dv_off = bb * a.batch_stride_dv;
        s.lse_off = bb * a.batch_stride_lse;
    }
    return s;
}

// The forward arguments that produce the O / LSE a backward call with these arguments expects (same pointers,
// geometry, mask, scale; has_lse = 1). Pointers are copied as they are (host or device alike).
inline mhakit_fwd_args fwd_args_of(const mhakit_bwd_args& a) {
    mhakit_fwd_args f{};
    f.data_type = a.data_type;
    f.is_group_mode = a.is_group_mode;
    f.has_lse = 1;
    f.q_ptr = a.q_ptr;
    f.k_ptr = a.k_ptr;
    f.v_ptr = a.v_ptr;
    f.o_ptr = const_cast<void*>(a.o_ptr);
    f.lse_ptr = const_cast<void*>(a.lse_ptr);
    f.seqstart_q_ptr = a.seqstart_q_ptr;
    f.seqstart_k_ptr = a.seqstart_k_ptr;
    f.seqlen_q = a.seqlen_q;
    f.seqlen_k = a.seqlen_k;
    f.batch = a.batch;
    f.max_seqlen_q = a.max_seqlen_q;
    f.hdim_q = a.hdim_q;
    f.hdim_v = a.hdim_v;
    f.nhead_q = a.nhead_q;
    f.nhead_k = a.nhead_k;
    f.scale_s = a.scale;
    f.stride_q = a.stride_q;
    f.stride_k = a.stride_k;
    f.stride_v = a.stride_v;
    f.stride_o = a.stride_o;
    f.nhead_stride_q = a.nhead_stride_q;
    f.nhead_stride_k = a.nhead_stride_k;
    f.nhead_stride_v = a.nhead_stride_v;
    f.nhead_stride_o = a.nhead_stride_o;
    f.nhead_stride_lse = a.nhead_stride_lse;
    f.batch_stride_q = a.batch_stride_q;
    f.batch_stride_k = a.batch_stride_k;
    f.batch_stride_v = a.batch_stride_v;
    f.batch_stride_o = a.batch_stride_o;
    f.batch_stride_lse = a.batch_stride_lse;
    f.mask_type = a.mask_type;
    f.window_size_left = a.window_size_left;
    f.window_size_right = a.window_size_right;
    f.logits_soft_cap = a.logits_soft_cap;
    f.bias_type = a.bias_type;
    f.bias_fp32 = a.bias_fp32;
    f.bias_ptr = a.bias_ptr;
    f.stride_bias = a.stride_bias;
    f.nhead_stride_bias = a.nhead_stride_bias;
    f.batch_stride_bias = a.batch_stride_bias;
    f.sink_ptr = a.sink_ptr;
    f.p_drop = a.p_drop;
    f.drop_seed = a.drop_seed, f.drop_offset = a.drop_offset;
    f.drop_seed_ptr = a.drop_seed_ptr, f.drop_offset_ptr = a.drop_offset_ptr;
    return f;
}

// ------------------------------------------------------------------------------------------------------------------
// Whole backward pass
// ------------------------------------------------------------------------------------------------------------------

struct BwdRefOptions {
    bool d_from_o = false;                // D = rowsum(dO ∘ O) with a.o_ptr's O (host, a.data_type) instead of the
                                          // reference's own fp32 O
    int threads = 0;                      // 0: default_threads()
    int row_block = 16;                   // query rows per phase-1 work item
    int key_block = 16;                   // keys per phase-2 work item
    size_t max_block_elems = size_t(1) << 22;  // rows x keys of P (and of dS) held at once
};

// Host reference of mhakit_mha_bwd. `a` is the argument struct the library takes, except that q_ptr, k_ptr, v_ptr,
// do_ptr (raw fp16/bf16 bits per a.data_type), o_ptr (only read with opt.d_from_o) and, in group mode,
// seqstart_q_ptr / seqstart_k_ptr point to HOST memory; lse_ptr, dq/dk/dv_ptr and the workspace are ignored.
// Results are written in fp32, each buffer laid out exactly like the library's tensor of the same name:
//   dq_ref  (a.stride_dq, a.nhead_stride_dq, a.batch_stride_dq), nhead_q heads
//   dk_ref  (a.stride_dk, a.nhead_stride_dk, a.batch_stride_dk), nhead_k heads
//   dv_ref  (a.stride_dv, a.nhead_stride_dv, a.batch_stride_dv), nhead_k heads
//   o_ref   (optional) the recomputed forward O, laid out like a's O
//   lse_ref (optional) the recomputed forward LSE, laid out like a's LSE ([h, token] in group mode)
// Only the logical elements are written.
//   dbias_ref (optional, elementwise bias) dS of the logits, laid out like a's dbias (a.stride_dbias, ...)
//   dsink_ref (optional, with a sink) [nhead_q]: −Σ_(b,i) exp(sink − LSE)·D
// With score modifiers (a's soft-cap, bias / ALiBi, sink; host pointers) P comes from the modified logits and dS goes
// through the soft-cap's derivative before dQ and dK. With dropout (a.p_drop > 0) randval holds the forward's random
// bytes (host, laid out as mha_fwd.h's randval_ptr): dV = (P ∘ keep / (1 − p))ᵀ·dO, dS = P ∘ (dP ∘ keep / (1 − p) − D).
inline void reference_mha_bwd(const mhakit_bwd_args& a, float* dq_ref, float* dk_ref, float* dv_ref,
                              float* o_ref = nullptr, float* lse_ref = nullptr, const BwdRefOptions& opt = {},
                              float* dbias_ref = nullptr, float* dsink_ref = nullptr,
                              const HostRandval* randval = nullptr) {
    const mhakit_dtype dt = a.data_type;
    const uint16_t* qb = static_cast<const uint16_t*>(a.q_ptr);
    const uint16_t* kb = static_cast<const uint16_t*>(a.k_ptr);
    const uint16_t* vb = static_cast<const uint16_t*>(a.v_ptr);
    const uint16_t* ob = static_cast<const uint16_t*>(a.o_ptr);
    const uint16_t* dob = static_cast<const uint16_t*>(a.do_ptr);
    const int dq = a.hdim_q, dv = a.hdim_v;
    const int group = a.nhead_q / a.nhead_k;
    const int rb = opt.row_block > 0 ? opt.row_block : 16;
    const int kblk = opt.key_block > 0 ? opt.key_block : 16;
    const float scale = a.scale;
    const ScoreMods mods = score_mods_of(a, scale);
    std::vector<double> dsink_acc(size_t(a.nhead_q), 0.0);
    std::vector<float> dsink_rows;

    std::vector<float> kt, kf, vt, vf, dk_acc, dv_acc, pbuf, dsbuf, qchunk, dochunk, capbuf;
    for (int b = 0; b < a.batch; ++b) {
        const HostSeqBwd sq = host_seq(a, b);
        const int nq = sq.seqlen_q > 0 ? sq.seqlen_q : 0;
        const int nk = sq.seqlen_k > 0 ? sq.seqlen_k : 0;
        const MaskCoord mc = make_mask_coord(a.mask_type, a.window_size_left, a.window_size_right, nq, nk);
        // rows per chunk: P and dS of the chunk are [chunk, nk]
        int chunk = nq;
        if (nk > 0) {
            const size_t lim = std::max<size_t>(size_t(rb), opt.max_block_elems / size_t(nk));
            if (size_t(chunk) > lim) chunk = int(lim);
        }
        if (chunk < 1) chunk = 1;

        for (int hk = 0; hk < a.nhead_k; ++hk) {
            // K (row-major and transposed) and V (row-major and transposed) of this (sequence, kv head), fp32
            kt.assign(size_t(dq) * size_t(nk), 0.0f);
            kf.assign(size_t(nk) * size_t(dq), 0.0f);
            vt.assign(size_t(dv) * size_t(nk), 0.0f);
            vf.assign(size_t(nk) * size_t(dv), 0.0f);
            parallel_for(
                nk,
                [&](int64_t j) {
                    const uint16_t* krow = kb + sq.k_off + int64_t(hk) * a.nhead_stride_k + j * a.stride_k;
                    const uint16_t* vrow = vb + sq.v_off + int64_t(hk) * a.nhead_stride_v + j * a.stride_v;
                    for (int d = 0; d < dq; ++d) {
                        const float x = to_float(krow[d], dt);
                        kt[size_t(d) * size_t(nk) + size_t(j)] = x;
                        kf[size_t(j) * size_t(dq) + size_t(d)] = x;
                    }
                    for (int d = 0; d < dv; ++d) {
                        const float x = to_float(vrow[d], dt);
                        vt[size_t(d) * size_t(nk) + size_t(j)] = x;
                        vf[size_t(j) * size_t(dv) + size_t(d)] = x;
                    }
                },
                nk >= 4096 ? opt.threads : 1);
            dk_acc.assign(size_t(nk) * size_t(dq), 0.0f);
            dv_acc.assign(size_t(nk) * size_t(dv), 0.0f);

            for (int g = 0; g < group && nk > 0; ++g) {
                const int h = hk * group + g;
                for (int c0 = 0; c0 < nq; c0 += chunk) {
                    const int c1 = std::min(nq, c0 + chunk);
                    const int crows = c1 - c0;
                    pbuf.assign(size_t(crows) * size_t(nk), 0.0f);
                    dsbuf.assign(size_t(crows) * size_t(nk), 0.0f);
                    capbuf.assign(mods.any ? size_t(crows) * size_t(nk) : 0, 1.0f);
                    dsink_rows.assign(size_t(crows), 0.0f);
                    const HostRowMods hm = host_row_mods(mods, dt, b, h, nq, nk);
                    const bool drop_on = mods.dropout.on && randval != nullptr;
                    const HostDropout hd{drop_on ? randval->block(a.is_group_mode != 0, a.seqstart_q_ptr, b, h) : nullptr,
                                         randval != nullptr ? randval->row : 0, mods.dropout.keep_max, mods.dropout.rp};
                    qchunk.assign(size_t(crows) * size_t(dq), 0.0f);
                    dochunk.assign(size_t(crows) * size_t(dv), 0.0f);

                    // ---- phase 1: rows -> P, dS (kept), dQ, O, LSE
                    const int nblk = (crows + rb - 1) / rb;
                    parallel_for(
                        nblk,
                        [&](int64_t item) {
                            const int r0 = c0 + int(item) * rb;  // absolute row in the sequence
                            const int r1 = std::min(c1, r0 + rb);
                            const int rows = r1 - r0;
                            const size_t lr0 = size_t(r0 - c0);  // row within the chunk
                            float* qf = qchunk.data() + lr0 * size_t(dq);
                            float* dof = dochunk.data() + lr0 * size_t(dv);
                            for (int r = 0; r < rows; ++r) {
                                const uint16_t* qrow =
                                    qb + sq.q_off + int64_t(h) * a.nhead_stride_q + int64_t(r0 + r) * a.stride_q;
                                const uint16_t* dorow =
                                    dob + sq.do_off + int64_t(h) * a.nhead_stride_do + int64_t(r0 + r) * a.stride_do;
                                for (int d = 0; d < dq; ++d) qf[size_t(r) * size_t(dq) + size_t(d)] = to_float(qrow[d], dt);
                                for (int d = 0; d < dv; ++d) dof[size_t(r) * size_t(dv) + size_t(d)] = to_float(dorow[d], dt);
                            }
                            std::vector<float> of(size_t(rows) * size_t(dv));
                            std::vector<float> lf(static_cast<size_t>(rows));
                            std::vector<float> scratch(static_cast<size_t>(nk));
                            std::vector<float> dqrow(static_cast<size_t>(dq));
                            float* prows = pbuf.data() + lr0 * size_t(nk);
                            float* caps = mods.any ? capbuf.data() + lr0 * size_t(nk) : nullptr;
                            attention_rows_fp32(qf, dq, kt.data(), nk, vf.data(), dv, nk, dq, dv, scale, mc, r0, r1,
                                                of.data(), dv, lf.data(), prows, nk, scratch.data(), false, dt,
                                                mods.any ? &hm : nullptr, caps, drop_on ? &hd : nullptr);
                            for (int r = 0; r < rows; ++r) {
                                const int i = r0 + r;
                                float* prow = prows + size_t(r) * size_t(nk);
                                float* dsrow = dsbuf.data() + (lr0 + size_t(r)) * size_t(nk);
                                const float* dorow = dof + size_t(r) * size_t(dv);
                                int jb, je;
                                visible_keys(mc, i, nk, &jb, &je);
                                std::fill(dqrow.begin(), dqrow.end(), 0.0f);
                                if (dbias_ref != nullptr) {
                                    float* dbrow = dbias_ref + int64_t(b) * a.batch_stride_dbias +
                                                   int64_t(h) * a.nhead_stride_dbias + int64_t(i) * a.stride_dbias;
                                    std::fill(dbrow, dbrow + nk, 0.0f);
                                }
                                if (je > jb) {
                                    // D = dO_i · O_i
                                    float D = 0.0f;
                                    if (opt.d_from_o) {
                                        const uint16_t* orow =
                                            ob + sq.o_off + int64_t(h) * a.nhead_stride_o + int64_t(i) * a.stride_o;
                                        for (int d = 0; d < dv; ++d) D += dorow[d] * to_float(orow[d], dt);
                                    } else {
                                        const float* orow = of.data() + size_t(r) * size_t(dv);
                                        for (int d = 0; d < dv; ++d) D += dorow[d] * orow[d];
                                    }
                                    // dP_ij = dO_i · V_j over the visible keys (in dsrow, then dS in place)
                                    const int n = je - jb;
                                    float* dp = dsrow + jb;
                                    for (int d = 0; d < dv; ++d) {
                                        const float x = dorow[d];
                                        const float* vcol = vt.data() + size_t(d) * size_t(nk) + size_t(jb);
                                        for (int j = 0; j < n; ++j) dp[j] += x * vcol[j];
                                    }
                                    if (drop_on) {  // dP of the kept scores (scaled); dV below takes the dropped P
                                        for (int j = 0; j < n; ++j) {
                                            dp[j] = prow[jb + j] * (hd.apply(dp[j], i, jb + j) - D);
                                            prow[jb + j] = hd.apply(prow[jb + j], i, jb + j);
                                        }
                                    } else {
                                        for (int j = 0; j < n; ++j) dp[j] = prow[jb + j] * (dp[j] - D);
                                    }
                                    if (dbias_ref != nullptr) {
                                        float* dbrow = dbias_ref + int64_t(b) * a.batch_stride_dbias +
                                                       int64_t(h) * a.nhead_stride_dbias + int64_t(i) * a.stride_dbias;
                                        for (int j = 0; j < n; ++j) dbrow[jb + j] = dp[j];
                                    }
                                    if (caps != nullptr)
                                        for (int j = 0; j < n; ++j) dp[j] *= caps[size_t(r) * size_t(nk) + size_t(jb + j)];
                                    if (mods.sink != nullptr)
                                        dsink_rows[lr0 + size_t(r)] = -std::exp(hm.sink - lf[size_t(r)]) * D;
                                    // dQ_i = scale · Σ_j dS_ij K_j
                                    for (int j = 0; j < n; ++j) {
                                        const float s = dp[j];
                                        const float* krow = kf.data() + size_t(jb + j) * size_t(dq);
                                        for (int d = 0; d < dq; ++d) dqrow[size_t(d)] += s * krow[d];
                                    }
                                }
                                float* dqo = dq_ref + sq.dq_off + int64_t(h) * a.nhead_stride_dq + int64_t(i) * a.stride_dq;
                                for (int d = 0; d < dq; ++d) dqo[d] = scale * dqrow[size_t(d)];
                                if (o_ref != nullptr) {
                                    float* oo = o_ref + sq.o_off + int64_t(h) * a.nhead_stride_o + int64_t(i) * a.stride_o;
                                    std::copy(of.begin() + ptrdiff_t(r) * dv, of.begin() + ptrdiff_t(r + 1) * dv, oo);
                                }
                                if (lse_ref != nullptr) lse_ref[sq.lse_off + int64_t(h) * a.nhead_stride_lse + i] = lf[size_t(r)];
                            }
                        },
                        opt.threads);

                    for (int r = 0; r < crows; ++r) dsink_acc[size_t(h)] += dsink_rows[size_t(r)];

                    // ---- phase 2: keys -> dV += Pᵀ·dO, dK += dSᵀ·Q (scale applied at the end)
                    const int nkb = (nk + kblk - 1) / kblk;
                    parallel_for(
                        nkb,
                        [&](int64_t item) {
                            const int j0 = int(item) * kblk;
                            const int j1 = std::min(nk, j0 + kblk);
                            for (int r = 0; r < crows; ++r) {
                                const float* prow = pbuf.data() + size_t(r) * size_t(nk);
                                const float* dsrow = dsbuf.data() + size_t(r) * size_t(nk);
                                const float* qf = qchunk.data() + size_t(r) * size_t(dq);
                                const float* dof = dochunk.data() + size_t(r) * size_t(dv);
                                for (int j = j0; j < j1; ++j) {
                                    const float p = prow[j], s = dsrow[j];
                                    if (p != 0.0f) {
                                        float* dvr = dv_acc.data() + size_t(j) * size_t(dv);
                                        for (int d = 0; d < dv; ++d) dvr[d] += p * dof[d];
                                    }
                                    if (s != 0.0f) {
                                        float* dkr = dk_acc.data() + size_t(j) * size_t(dq);
                                        for (int d = 0; d < dq; ++d) dkr[d] += s * qf[d];
                                    }
                                }
                            }
                        },
                        opt.threads);
                }
            }
            // rows of this kv group's query heads when there are no keys: dQ = 0 (and O = 0, LSE = -inf, or the
            // head's sink logit with a sink: exp(sink) is then the whole denominator)
            if (nk == 0) {
                for (int g = 0; g < group; ++g) {
                    const int h = hk * group + g;
                    for (int i = 0; i < nq; ++i) {
                        float* dqo = dq_ref + sq.dq_off + int64_t(h) * a.nhead_stride_dq + int64_t(i) * a.stride_dq;
                        std::fill(dqo, dqo + dq, 0.0f);
                        if (o_ref != nullptr) {
                            float* oo = o_ref + sq.o_off + int64_t(h) * a.nhead_stride_o + int64_t(i) * a.stride_o;
                            std::fill(oo, oo + dv, 0.0f);
                        }
                        if (lse_ref != nullptr) lse_ref[sq.lse_off + int64_t(h) * a.nhead_stride_lse + i] = sink_logit(mods, h);
                    }
                }
            }
            // rows without keys: d sink gets exp(sink - LSE)·D with D = 0 (O = 0), and dbias has no element
            // write dK (scaled) and dV of this kv head
            for (int j = 0; j < nk; ++j) {
                float* dko = dk_ref + sq.dk_off + int64_t(hk) * a.nhead_stride_dk + int64_t(j) * a.stride_dk;
                float* dvo = dv_ref + sq.dv_off + int64_t(hk) * a.nhead_stride_dv + int64_t(j) * a.stride_dv;
                const float* dkr = dk_acc.data() + size_t(j) * size_t(dq);
                const float* dvr = dv_acc.data() + size_t(j) * size_t(dv);
                for (int d = 0; d < dq; ++d) dko[d] = scale * dkr[d];
                for (int d = 0; d < dv; ++d) dvo[d] = dvr[d];
            }
        }
    }
    if (dsink_ref != nullptr)
        for (int h = 0; h < a.nhead_q; ++h) dsink_ref[h] = float(dsink_acc[size_t(h)]);
}

// ------------------------------------------------------------------------------------------------------------------
// Comparison: device gradients (copied to the host, same layout) against reference_mha_bwd's output
// ------------------------------------------------------------------------------------------------------------------

enum class BwdTensor { DQ, DK, DV };

// Per-sequence ranges of dQ, dK or dV (a's seqstart pointers: host).
inline std::vector<SeqRange> bwd_seq_ranges(const mhakit_bwd_args& a, BwdTensor t) {
    std::vector<SeqRange> v;
    for (int b = 0; b < a.batch; ++b) {
        const HostSeqBwd s = host_seq(a, b);
        switch (t) {
            case BwdTensor::DQ: v.push_back({s.seqlen_q, s.dq_off}); break;
            case BwdTensor::DK: v.push_back({s.seqlen_k, s.dk_off}); break;
            case BwdTensor::DV: v.push_back({s.seqlen_k, s.dv_off}); break;
        }
    }
    return v;
}

struct BwdCheckResult {
    bool ok = true;
    CheckResult dq, dk, dv;
};

// Tolerance of aiter's backward check: rtol = atol = 1e-2; bf16 with hdim_q > 128 and hdim_v > 128: 3.2e-2.
inline double bwd_tolerance(mhakit_dtype dt, int hdim_q, int hdim_v) {
    return (dt == MHAKIT_DTYPE_BF16 && hdim_q > 128 && hdim_v > 128) ? 3.2e-2 : 1e-2;
}

// dq_out / dk_out / dv_out: host copies of the library's gradients (raw fp16/bf16 bits, a's layouts);
// *_ref: reference_mha_bwd's fp32 results. The reference is rounded to a.data_type before comparing (as CK compares
// in the output type) unless round_ref is false.
inline BwdCheckResult check_bwd(const mhakit_bwd_args& a, const uint16_t* dq_out, const uint16_t* dk_out,
                                const uint16_t* dv_out, const float* dq_ref, const float* dk_ref, const float* dv_ref,
                                double rtol, double atol, bool round_ref = true, FILE* log = stderr,
                                int max_report = 8) {
    BwdCheckResult res;
    const mhakit_dtype dt = a.data_type;
    const auto one = [&](const char* name, BwdTensor t, int nhead, int dim, int64_t row_stride, int64_t head_stride,
                         const uint16_t* out, const float* ref) {
        const auto sr = bwd_seq_ranges(a, t);
        const std::vector<float> o =
            gather_tokens(sr, nhead, dim, row_stride, head_stride, [&](int64_t k) { return to_float(out[k], dt); });
        const std::vector<float> r = gather_tokens(sr, nhead, dim, row_stride, head_stride, [&](int64_t k) {
            return round_ref ? round_to(ref[k], dt) : ref[k];
        });
        return check_err(name, o.data(), r.data(), o.size(), rtol, atol, false, log, max_report,
                         [&](size_t k) { return describe_token_index(sr, nhead, dim, k); });
    };
    res.dq = one("dQ", BwdTensor::DQ, a.nhead_q, a.hdim_q, a.stride_dq, a.nhead_stride_dq, dq_out, dq_ref);
    res.dk = one("dK", BwdTensor::DK, a.nhead_k, a.hdim_q, a.stride_dk, a.nhead_stride_dk, dk_out, dk_ref);
    res.dv = one("dV", BwdTensor::DV, a.nhead_k, a.hdim_v, a.stride_dv, a.nhead_stride_dv, dv_out, dv_ref);
    res.ok = res.dq.ok && res.dk.ok && res.dv.ok;
    return res;
}

// Bitwise comparison of two host copies of the same gradient tensor (raw 16-bit values, a's layout), over the
// logical elements only. Returns the number of differing elements; *first (if given) names the first one.
inline size_t count_bitwise_diff(const mhakit_bwd_args& a, BwdTensor t, const uint16_t* x, const uint16_t* y,
                                 std::string* first = nullptr) {
    int nhead, dim;
    int64_t rs, hs;
    switch (t) {
        case BwdTensor::DQ: nhead = a.nhead_q; dim = a.hdim_q; rs = a.stride_dq; hs = a.nhead_stride_dq; break;
        case BwdTensor::DK: nhead = a.nhead_k; dim = a.hdim_q; rs = a.stride_dk; hs = a.nhead_stride_dk; break;
        default: nhead = a.nhead_k; dim = a.hdim_v; rs = a.stride_dv; hs = a.nhead_stride_dv; break;
    }
    const auto sr = bwd_seq_ranges(a, t);
    size_t n = 0, k = 0;
    for (const auto& s : sr)
        for (int h = 0; h < nhead; ++h)
            for (int i = 0; i < s.len; ++i)
                for (int d = 0; d < dim; ++d, ++k) {
                    const int64_t e = s.base + int64_t(h) * hs + int64_t(i) * rs + d;
                    if (x[e] != y[e]) {
                        if (n == 0 && first != nullptr) *first = describe_token_index(sr, nhead, dim, k);
                        ++n;
                    }
                }
    return n;
}

}  // namespace host
}  // namespace mhakit
