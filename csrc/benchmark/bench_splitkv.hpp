// mhakit — benchmark_mha_fwd's split-KV (decode) path: mhakit::mha_fwd_splitkv against a contiguous or paged KV cache,
// timed and checked against the host reference. Taken, as aiter takes mha_fwd_splitkv, when -num_splits != 1,
// -page_block_size > 0, -cache_batch_idx=1 or -s_knew > 0.
//
// Layouts (FlashAttention's flash_attn_with_kvcache): q / o [b, s, h, d]; cache [b, cap, h_k, d] (contiguous; with
// -cache_batch_idx=1 one spare cache batch and a shuffled batch map) or [pages, page_block_size, h_k, d] (paged; pages
// shuffled, the block table's unused entries point at a page of NaNs); new k / v [b, s_knew, h_k, d]. -s_k is the
// cache length before appending, one value or one per batch ("-s_k=0,17,4096"). Cache rows past each batch's
// length are NaN before the call, so a kernel that reads them fails validation.
// The line's GB/s is K+V bytes read (every batch's cache length + new rows, each kv head once) per second.
#pragma once

#include <stdint.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iomanip>
#include <iostream>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "../reference/bench_cli.hpp"
#include "../reference/host_attention.hpp"
#include "bench_device.hpp"
#include "mha_fwd.h"

namespace mhakit::bench {

struct SplitkvRun {
    mhakit_dtype dtype;
    std::string prec;
    int batch, nhead, nhead_k, hdim_q, hdim_v;
    int seqlen_q, s_knew, num_splits, page_block_size;
    bool cache_batch_idx, lse, validate;
    std::vector<int> cache_lens;  // per batch, before appending
    float scale_s;
    MaskSpec mask;
    InitMethod init;
    uint32_t seed;
    int kname, warmup, repeat;
};

// Parses -s_k for the decode path: one length for every batch, or one per batch.
inline bool parse_cache_lens(const std::string& s_k, int batch, int seqlen_q, std::vector<int>* out, std::string* err) {
    const std::vector<std::string> fields = split_commas(s_k);
    if (fields.size() != 1 && int(fields.size()) != batch) {
        *err = "-s_k takes one cache length or one per batch (" + std::to_string(batch) + ")";
        return false;
    }
    out->clear();
    for (const std::string& f : fields) {
        int v;
        if (!parse_int(f, &v) || v < -1) {
            *err = "invalid -s_k=" + s_k + " (cache lengths >= 0; -1: equal to -s)";
            return false;
        }
        out->push_back(v < 0 ? seqlen_q : v);
    }
    if (fields.size() == 1) out->assign(size_t(batch), out->front());
    return true;
}

inline int run_splitkv(const SplitkvRun& r) {
    namespace host = mhakit::host;
    const int B = r.batch, H = r.nhead, HK = r.nhead_k, D = r.hdim_q, DV = r.hdim_v, SQ = r.seqlen_q, SN = r.s_knew;
    const bool paged = r.page_block_size > 0;
    std::vector<int> total(static_cast<size_t>(B));  // keys attended per batch: cache + new
    int64_t sum_total = 0;
    int cap = 1;
    for (int b = 0; b < B; ++b) {
        total[size_t(b)] = r.cache_lens[size_t(b)] + SN;
        sum_total += total[size_t(b)];
        cap = std::max(cap, total[size_t(b)]);
    }
    std::mt19937 gen(r.seed);
    // ---- cache geometry: pages (shuffled) or contiguous batches (optionally shuffled through cache_batch_idx)
    const int P = paged ? r.page_block_size : cap;
    std::vector<int> pages_of(static_cast<size_t>(B));
    int max_blocks = 1, num_pages = 0;
    for (int b = 0; b < B; ++b) {
        pages_of[size_t(b)] = paged ? (total[size_t(b)] + P - 1) / P : 1;
        max_blocks = std::max(max_blocks, pages_of[size_t(b)]);
        num_pages += pages_of[size_t(b)];
    }
    const int spare = num_pages;  // paged: a page of NaNs that unused block-table entries name
    const int cache_batches = paged ? num_pages + 1 : B + (r.cache_batch_idx ? 1 : 0);
    std::vector<int32_t> block_table(paged ? size_t(B) * max_blocks : 0, spare), batch_idx(static_cast<size_t>(B));
    if (paged) {
        std::vector<int32_t> ids(static_cast<size_t>(num_pages));
        std::iota(ids.begin(), ids.end(), 0);
        std::shuffle(ids.begin(), ids.end(), gen);
        size_t next = 0;
        for (int b = 0; b < B; ++b)
            for (int i = 0; i < pages_of[size_t(b)]; ++i) block_table[size_t(b) * max_blocks + i] = ids[next++];
    } else {
        std::vector<int32_t> ids(static_cast<size_t>(cache_batches));
        std::iota(ids.begin(), ids.end(), 0);
        if (r.cache_batch_idx) std::shuffle(ids.begin(), ids.end(), gen);
        std::copy(ids.begin(), ids.begin() + B, batch_idx.begin());
    }
    const int64_t cache_rows = int64_t(cache_batches) * P;  // rows of h_k heads
    g_sizes = "-b=" + std::to_string(B) + " -h=" + std::to_string(H) + "/" + std::to_string(HK) + " -d=" +
              std::to_string(D) + "/" + std::to_string(DV);
    require_host_memory(2.0 * double(cache_rows) * HK * (D + DV) * (r.validate ? 2.0 : 1.0) +
                        (r.validate ? 4.0 * double(sum_total) * HK * (D + DV) : 0.0) + 8.0 * double(B) * SQ * H * DV);
    require_device();

    // ---- logical keys / values per batch (cache rows then new rows), the device cache and the new rows
    std::vector<std::vector<uint16_t>> klog(static_cast<size_t>(B)), vlog(static_cast<size_t>(B));
    std::vector<uint16_t> q_host(size_t(B) * SQ * H * D);
    fill_tensor(q_host, r.init, r.dtype, static_cast<uint32_t>(gen()));
    const uint16_t nan16 = 0xFFFF;
    std::vector<uint16_t> kc(size_t(cache_rows) * HK * D, nan16), vc(size_t(cache_rows) * HK * DV, nan16);
    std::vector<uint16_t> kn(size_t(B) * SN * HK * D), vn(size_t(B) * SN * HK * DV);
    auto cache_row = [&](int b, int j) -> int64_t {  // row index (of h_k heads) of key j of batch b
        if (paged) return int64_t(block_table[size_t(b) * max_blocks + j / P]) * P + j % P;
        return int64_t(batch_idx[size_t(b)]) * P + j;
    };
    if (!r.validate) {  // timing only: random caches and new rows, no logical copies
        fill_tensor(kc, r.init, r.dtype, static_cast<uint32_t>(gen()));
        fill_tensor(vc, r.init, r.dtype, static_cast<uint32_t>(gen()));
        fill_tensor(kn, r.init, r.dtype, static_cast<uint32_t>(gen()));
        fill_tensor(vn, r.init, r.dtype, static_cast<uint32_t>(gen()));
    }
    for (int b = 0; b < B && r.validate; ++b) {
        const int L = total[size_t(b)], C = r.cache_lens[size_t(b)];
        klog[size_t(b)].resize(size_t(L) * HK * D);
        vlog[size_t(b)].resize(size_t(L) * HK * DV);
        fill_tensor(klog[size_t(b)], r.init, r.dtype, static_cast<uint32_t>(gen()));
        fill_tensor(vlog[size_t(b)], r.init, r.dtype, static_cast<uint32_t>(gen()));
        for (int j = 0; j < L; ++j) {
            uint16_t* kdst = j < C ? &kc[size_t(cache_row(b, j)) * HK * D] : &kn[(size_t(b) * SN + (j - C)) * HK * D];
            uint16_t* vdst = j < C ? &vc[size_t(cache_row(b, j)) * HK * DV] : &vn[(size_t(b) * SN + (j - C)) * HK * DV];
            std::copy_n(&klog[size_t(b)][size_t(j) * HK * D], size_t(HK) * D, kdst);
            std::copy_n(&vlog[size_t(b)][size_t(j) * HK * DV], size_t(HK) * DV, vdst);
        }
    }

    DeviceBuffer q_dev(q_host.size() * 2), kc_dev(kc.size() * 2), vc_dev(vc.size() * 2), kn_dev(kn.size() * 2),
        vn_dev(vn.size() * 2), o_dev(size_t(B) * SQ * H * DV * 2), lse_dev(r.lse ? size_t(B) * SQ * H * 4 : 0),
        seqlen_dev(size_t(B) * 4), bt_dev(block_table.size() * 4), idx_dev(size_t(B) * 4);
    q_dev.upload(q_host.data());
    kc_dev.upload(kc.data());
    vc_dev.upload(vc.data());
    kn_dev.upload(kn.data());
    vn_dev.upload(vn.data());
    std::vector<int32_t> seqlens(r.cache_lens.begin(), r.cache_lens.end());
    seqlen_dev.upload(seqlens.data());
    bt_dev.upload(block_table.data());
    idx_dev.upload(batch_idx.data());
    o_dev.poison();
    if (r.lse) lse_dev.poison();

    mhakit::mha_fwd_splitkv_args a{};
    a.data_type = r.dtype;
    a.has_lse = r.lse ? 1 : 0;
    a.q_ptr = q_dev.get();
    a.k_cache_ptr = kc_dev.get();
    a.v_cache_ptr = vc_dev.get();
    a.k_new_ptr = SN > 0 ? kn_dev.get() : nullptr;
    a.v_new_ptr = SN > 0 ? vn_dev.get() : nullptr;
    a.o_ptr = o_dev.get();
    a.lse_ptr = r.lse ? lse_dev.get() : nullptr;
    a.seqlen_k_ptr = static_cast<const int32_t*>(seqlen_dev.get());
    a.block_table_ptr = paged ? static_cast<const int32_t*>(bt_dev.get()) : nullptr;
    a.cache_batch_idx_ptr = (!paged && r.cache_batch_idx) ? static_cast<const int32_t*>(idx_dev.get()) : nullptr;
    a.seqlen_q = SQ;
    a.seqlen_knew = SN;
    a.max_seqlen_k = *std::max_element(r.cache_lens.begin(), r.cache_lens.end());
    a.batch = B;
    a.hdim_q = D;
    a.hdim_v = DV;
    a.nhead_q = H;
    a.nhead_k = HK;
    a.page_block_size = paged ? P : 0;
    a.num_splits = r.num_splits;
    a.scale_s = r.scale_s;
    a.stride_q = int64_t(H) * D, a.nhead_stride_q = D, a.batch_stride_q = int64_t(SQ) * H * D;
    a.stride_o = int64_t(H) * DV, a.nhead_stride_o = DV, a.batch_stride_o = int64_t(SQ) * H * DV;
    a.stride_k = int64_t(HK) * D, a.nhead_stride_k = D, a.batch_stride_k = int64_t(P) * HK * D;
    a.stride_v = int64_t(HK) * DV, a.nhead_stride_v = DV, a.batch_stride_v = int64_t(P) * HK * DV;
    a.stride_knew = int64_t(HK) * D, a.nhead_stride_knew = D, a.batch_stride_knew = int64_t(SN) * HK * D;
    a.stride_vnew = int64_t(HK) * DV, a.nhead_stride_vnew = DV, a.batch_stride_vnew = int64_t(SN) * HK * DV;
    a.nhead_stride_lse = int64_t(B) * SQ, a.batch_stride_lse = SQ;  // [h, b·s]: the reference's group-mode LSE
    a.batch_stride_block_table = max_blocks;
    a.mask_type = r.mask.type;
    a.window_size_left = r.mask.left;
    a.window_size_right = r.mask.right;

    size_t lse_acc_bytes = 0, o_acc_bytes = 0;
    int splits = 0;
    const float qrc = mhakit::mha_fwd_splitkv_acc_size(a, &lse_acc_bytes, &o_acc_bytes, &splits);
    std::cout << "[" << r.prec << "|batch|bshd] b:" << B << ", h:" << H << "/" << HK << ", s:" << SQ << "/"
              << (std::equal(r.cache_lens.begin() + 1, r.cache_lens.end(), r.cache_lens.begin())
                      ? std::to_string(r.cache_lens.front())
                      : list_str(r.cache_lens)) << ", d:" << D << "/" << DV
              << ", scale_s:" << r.scale_s << ", bias:n, p_drop:0, lse:" << r.lse << ", qscale:n, mask:" << r.mask.str()
              << ", v:r, num_splits:" << (qrc < 0 ? r.num_splits : splits) << ", page_block_size:" << (paged ? P : 0)
              << ", cache_batch_idx:" << (r.cache_batch_idx ? 1 : 0) << ", s_knew:" << SN << std::flush;
    if (qrc < 0) {
        std::cout << ", not supported yet" << std::endl;
        std::fprintf(stderr, "%s: mha_fwd_splitkv_acc_size returned %d (%s): %s\n", g_program, int(qrc),
                     status_name(qrc), mhakit::last_error());
        return kExitFail;
    }
    DeviceBuffer lse_acc_dev(lse_acc_bytes), o_acc_dev(o_acc_bytes);
    a.lse_acc_ptr = lse_acc_bytes ? lse_acc_dev.get() : nullptr;
    a.o_acc_ptr = o_acc_bytes ? o_acc_dev.get() : nullptr;
    MHAKIT_CHECK_CUDA(mhakit::dev::device_synchronize());

    mhakit::stream_config sc{nullptr, 1, r.kname, r.warmup, r.repeat, 1};
    const float ms = mhakit::mha_fwd_splitkv(a, sc);
    if (ms < 0.0f) {
        std::cout << ", not supported yet" << std::endl;
        std::fprintf(stderr, "%s: mha_fwd_splitkv returned %d (%s): %s\n", g_program, int(ms), status_name(ms),
                     mhakit::last_error());
        return kExitFail;
    }
    MHAKIT_CHECK_CUDA(mhakit::dev::last_error());
    MHAKIT_CHECK_CUDA(mhakit::dev::device_synchronize());
    double flop = 0;
    for (int b = 0; b < B; ++b) flop += double(H) * SQ * total[size_t(b)] * 2.0 * (D + DV);
    if (r.mask.type != MHAKIT_MASK_NONE) flop *= 0.5;
    const double kv_bytes = 2.0 * double(sum_total) * HK * (D + DV);
    std::cout << std::fixed << ", " << std::setprecision(3) << ms << " ms, " << std::setprecision(2)
              << flop / 1.0e9 / ms << " TFlops, " << kv_bytes / 1.0e6 / ms << " GB/s" << std::flush;
    if (!r.validate) {
        std::cout << std::endl;
        return 0;
    }

    // ---- reference: the same problem in group mode over the logical (appended) keys
    std::vector<uint16_t> kp(size_t(sum_total) * HK * D), vp(size_t(sum_total) * HK * DV);
    std::vector<int32_t> seqstart_q(static_cast<size_t>(B) + 1), seqstart_k(static_cast<size_t>(B) + 1);
    for (int b = 0; b < B; ++b) {
        seqstart_q[size_t(b) + 1] = seqstart_q[size_t(b)] + SQ;
        seqstart_k[size_t(b) + 1] = seqstart_k[size_t(b)] + total[size_t(b)];
        std::copy(klog[size_t(b)].begin(), klog[size_t(b)].end(), kp.begin() + int64_t(seqstart_k[size_t(b)]) * HK * D);
        std::copy(vlog[size_t(b)].begin(), vlog[size_t(b)].end(), vp.begin() + int64_t(seqstart_k[size_t(b)]) * HK * DV);
    }
    mhakit::mha_fwd_args h{};
    h.data_type = r.dtype;
    h.is_group_mode = 1;
    h.q_ptr = q_host.data();
    h.k_ptr = kp.data();
    h.v_ptr = vp.data();
    h.seqstart_q_ptr = seqstart_q.data();
    h.seqstart_k_ptr = seqstart_k.data();
    h.seqlen_q = B * SQ;
    h.seqlen_k = int(sum_total);
    h.batch = B;
    h.max_seqlen_q = SQ;
    h.hdim_q = D, h.hdim_v = DV, h.nhead_q = H, h.nhead_k = HK;
    h.scale_s = r.scale_s;
    h.stride_q = a.stride_q, h.nhead_stride_q = D;
    h.stride_k = a.stride_k, h.nhead_stride_k = D;
    h.stride_v = a.stride_v, h.nhead_stride_v = DV;
    h.stride_o = a.stride_o, h.nhead_stride_o = DV;
    h.nhead_stride_lse = int64_t(B) * SQ;
    h.mask_type = r.mask.type, h.window_size_left = r.mask.left, h.window_size_right = r.mask.right;
    std::vector<float> o_ref(size_t(B) * SQ * H * DV, 0.f), lse_ref(r.lse ? size_t(B) * SQ * H : 0, 0.f);
    host::reference_mha_fwd(h, o_ref.data(), r.lse ? lse_ref.data() : nullptr);
    std::vector<uint16_t> o_out(o_ref.size());
    std::vector<float> lse_out(lse_ref.size());
    o_dev.download(o_out.data());
    if (r.lse) lse_dev.download(lse_out.data());
    const double tol = r.dtype == MHAKIT_DTYPE_BF16 ? 1e-2 : 1e-3;
    const auto check = [&](FILE* log) {
        return host::check_fwd(h, o_out.data(), o_ref.data(), r.lse ? lse_out.data() : nullptr,
                               r.lse ? lse_ref.data() : nullptr, tol, tol, true, log, 8);
    };
    bool ok = check(nullptr).ok;
    // the appended rows must be in the cache afterwards
    bool appended = true;
    if (SN > 0) {
        std::vector<uint16_t> kc_out(kc.size()), vc_out(vc.size());
        kc_dev.download(kc_out.data());
        vc_dev.download(vc_out.data());
        for (int b = 0; b < B && appended; ++b)
            for (int j = r.cache_lens[size_t(b)]; j < total[size_t(b)]; ++j) {
                const int64_t row = cache_row(b, j);
                appended = appended &&
                           std::equal(kc_out.begin() + row * HK * D, kc_out.begin() + (row + 1) * HK * D,
                                      klog[size_t(b)].begin() + int64_t(j) * HK * D) &&
                           std::equal(vc_out.begin() + row * HK * DV, vc_out.begin() + (row + 1) * HK * DV,
                                      vlog[size_t(b)].begin() + int64_t(j) * HK * DV);
            }
    }
    std::cout << ", valid:" << (ok && appended ? "y" : "n") << std::endl;
    if (!ok) check(stderr);
    if (!appended) std::fprintf(stderr, "%s: the new k/v rows are not where the cache should hold them\n", g_program);
    if (!ok || !appended)
        std::fprintf(stderr, "mismatch: seqlen_q: %d, cache lengths: %s, s_knew: %d\n", SQ,
                     list_str(r.cache_lens).c_str(), SN);
    return ok && appended ? 0 : kExitFail;
}

}  // namespace mhakit::bench
