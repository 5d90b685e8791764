// mhakit — benchmark_mha_fwd: times mhakit::mha_fwd and checks it against the host reference.
//
// Command line and output line follow aiter's op_tests/cpp/mha/benchmark_mha_fwd (`-key=value`, `-?` for help), so
// existing scripts keep working for everything mhakit supports; aiter arguments mhakit does not implement yet are
// accepted only at their default value and rejected by name otherwise.
//
// Host code only: links against libmha_fwd.so and the CUDA runtime. Build (from the repository root, one line):
//   g++ -std=c++17 -O3 -Icsrc -Icsrc/include -I$CUDA_HOME/include csrc/benchmark/benchmark_mha_fwd.cpp
//       -o benchmark_mha_fwd -L<dir of libmha_fwd.so> -lmha_fwd -L$CUDA_HOME/lib64 -lcudart -pthread
//       -Wl,-rpath,'$ORIGIN'
//
// Exit status: 0 success; 1 validation failed or the library refused the arguments (not supported / invalid);
// 2 bad command line (sizes whose buffers cannot fit in host memory included); 3 no CUDA device/driver, or a CUDA
// runtime error.
#include "mha_fwd.h"


#include <stdint.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iomanip>
#include <iostream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "../reference/bench_cli.hpp"
#include "bench_device.hpp"
#include "../reference/host_attention.hpp"
#include "bench_splitkv.hpp"

namespace {

using mhakit::bench::DeviceBuffer;
using mhakit::bench::kExitFail;
using mhakit::bench::kExitUsage;
using mhakit::bench::list_str;
using mhakit::bench::status_name;
using mhakit::bench::usage_error;

const char* const kProg = "benchmark_mha_fwd";

void register_args(mhakit::bench::ArgParser& ap) {
    ap.add("v", "1", "0: no validation, 1: CPU validation");
    mhakit::bench::add_shape_args(ap);
    ap.add("scale_s", "0", "scale factor of S. 0 means equal to 1/sqrt(hdim)")
        .add("iperm", "1", "permute input\nif true, will be b*h*s*d, else b*s*h*d")
        .add("operm", "1", "permute output")
        .add("prec", "fp16",
             "data type. fp16/bf16; fp8 (= fp8bf16: e4m3 q/k/v, bf16 o) or fp8fp16 (fp16 o): Hopper, batch mode")
        .add("qscale", "n",
             "fp8 quantization of q/k/v. n or 0: values as drawn (descale factors 1)\n"
             "pt or 1: per-tensor, each tensor scaled to e4m3's range and its descale factor passed");
    mhakit::bench::add_mask_arg(ap);
    ap.add("lse", "0", "0 not store lse, 1 store lse")
        .add("kname", "0", "if set to 1 will print kernel name")
        .add("workspace", "1",
             "1: pass the workspace mha_fwd_workspace_size asks for (one buffer, used by every call)\n"
             "0: pass none (fp8 is then refused; a persistent instance runs one CTA per tile)")
        .add("init", "uf",
             "init method. ui or 0, uniform random int, ni, normalized random int\n"
             "uf or 1, uniform random float, nf, normalized random float, tf or 2, trig float\n"
             "ufq, uf:q or 3, uniform random float over fp8 e4m3's full range [-448, 448)");
    mhakit::bench::add_seed_arg(ap);
    ap.add("num_splits", "1",
           "split-KV: parts each (batch, kv head)'s keys are cut into; 0: the library's heuristic\n"
           "anything but 1 (or a kv-cache argument below) runs mha_fwd_splitkv")
        .add("page_block_size", "0", "paged kv-cache: rows per page (any size >= 1); 0: contiguous cache")
        .add("cache_batch_idx", "0", "1: a contiguous kv-cache with a shuffled batch index map (not with paging)")
        .add("s_knew", "0", "new k/v rows per batch appended into the kv-cache before attending");
    mhakit::bench::add_timing_args(ap);
    mhakit::bench::add_score_mod_args(ap);
    mhakit::bench::add_dropout_args(ap, /*with_randval=*/true);

    using mhakit::bench::bool_equal_to;
    using mhakit::bench::int_at_most;
    using mhakit::bench::int_equal_to;
    using mhakit::bench::one_of;
    ap.add_unsupported("s_kpad", "-1", "-1", int_at_most(-1))
        .add_unsupported("s_qpad", "-1", "-1", int_at_most(-1))
        .add_unsupported("rotary_dim", "0", "0", int_at_most(0))
        .add_unsupported("rotary_interleaved", "1", "1", bool_equal_to(true))
        .add_unsupported("squant", "auto", "auto or 0", one_of({"auto", "0"}))
        .add_unsupported("vlayout", "r", "r", one_of({"r"}))
        .add_unsupported("fwd_v3", "0", "0", bool_equal_to(false))
        .add_unsupported("is_v3_check", "0", "0", bool_equal_to(false))
        .add_unsupported("v3_bf16_cvt", "1", "1", int_equal_to(1))
        .add_unsupported("timer", "gpu", "gpu", one_of({"gpu"}));
}

}  // namespace

int run(int argc, char** argv) {
    namespace host = mhakit::host;
    namespace bench = mhakit::bench;

    // ---------------------------------------------------------------- arguments
    bench::ArgParser ap;
    register_args(ap);
    std::string err;
    const int pr = ap.parse(argc, argv, &err);
    if (pr > 0) return 0;
    if (pr < 0) usage_error(err);

    bench::CommonArgs common;
    if (!common.parse(ap, &err)) usage_error(err);
    const int do_validation = common.do_validation, batch = common.batch, nhead = common.nhead,
              nhead_k = common.nhead_k, hdim_q = common.hdim_q, hdim_v = common.hdim_v, kname = common.kname,
              warmup = common.warmup, repeat = common.repeat;
    const bool group = common.group;
    float scale_s;
    bool i_perm, o_perm, lse, pass_workspace;
    if (!ap.get_float("scale_s", &scale_s, &err) || !ap.get_bool("iperm", &i_perm, &err) ||
        !ap.get_bool("operm", &o_perm, &err) || !ap.get_bool("lse", &lse, &err) ||
        !ap.get_bool("workspace", &pass_workspace, &err))
        usage_error(err);

    const std::string prec = ap.str("prec");
    mhakit_dtype dtype;
    if (prec == "fp16") dtype = MHAKIT_DTYPE_FP16;
    else if (prec == "bf16") dtype = MHAKIT_DTYPE_BF16;
    else if (prec == "fp8" || prec == "fp8bf16") dtype = MHAKIT_DTYPE_FP8_BF16;
    else if (prec == "fp8fp16") dtype = MHAKIT_DTYPE_FP8_FP16;
    else if (prec == "bf8" || prec == "fp8fp32" || prec == "fp32")
        usage_error("-prec=" + prec + " is not supported by mhakit yet (fp16, bf16, fp8 / fp8bf16, fp8fp16)");
    else usage_error("invalid -prec=" + prec + " (fp16, bf16, fp8 / fp8bf16, fp8fp16)");
    const bool fp8 = mhakit::host::is_fp8(dtype);
    const std::string qscale_arg = ap.str("qscale");
    bool per_tensor = false;
    if (qscale_arg == "pt" || qscale_arg == "1") per_tensor = true;
    else if (qscale_arg != "n" && qscale_arg != "0") usage_error("invalid -qscale=" + qscale_arg + " (n|0 or pt|1)");
    if (per_tensor && !fp8) usage_error("-qscale=" + qscale_arg + " needs -prec=fp8 (descale factors are for fp8 data)");

    bench::MaskSpec mask;
    if (!bench::parse_mask(ap.str("mask"), &mask, &err)) usage_error(err);
    bench::InitMethod init;
    if (!bench::parse_init(ap.str("init"), &init, &err)) usage_error(err);
    bench::ScoreModInputs mods;
    if (!mods.parse(ap, &err)) usage_error(err);
    bench::DropoutInputs drop;
    if (!drop.parse(ap, /*with_randval=*/true, &err)) usage_error(err);

    common.draw_seed(kProg);
    const uint32_t seed = common.seed;

    int num_splits, page_block_size, s_knew;
    bool cache_batch_idx;
    if (!ap.get_int("num_splits", &num_splits, &err) || !ap.get_int("page_block_size", &page_block_size, &err) ||
        !ap.get_bool("cache_batch_idx", &cache_batch_idx, &err) || !ap.get_int("s_knew", &s_knew, &err))
        usage_error(err);
    if (num_splits != 1 || page_block_size != 0 || cache_batch_idx || s_knew != 0) {  // aiter: mha_fwd_splitkv
        if (drop.on()) usage_error("-p_drop does not go with the kv-cache arguments (mha_fwd_splitkv has no dropout)");
        if (fp8) usage_error("-prec=" + prec + " does not go with the kv-cache arguments (mha_fwd_splitkv: fp16, bf16)");
        if (group) usage_error("-num_splits, -page_block_size, -cache_batch_idx and -s_knew need -mode=0 (batch)");
        if (num_splits < 0 || num_splits > MHAKIT_MAX_SPLITS)
            usage_error("-num_splits must be in [0, " + std::to_string(MHAKIT_MAX_SPLITS) + "]");
        if (page_block_size < 0) usage_error("-page_block_size must be >= 0");
        if (page_block_size > 0 && cache_batch_idx) usage_error("-cache_batch_idx does not go with -page_block_size");
        if (s_knew < 0) usage_error("-s_knew must be >= 0");
        bench::SplitkvRun r{};
        r.dtype = dtype, r.prec = prec, r.batch = batch, r.nhead = nhead, r.nhead_k = nhead_k;
        r.hdim_q = hdim_q, r.hdim_v = hdim_v, r.s_knew = s_knew, r.num_splits = num_splits;
        r.page_block_size = page_block_size, r.cache_batch_idx = cache_batch_idx, r.lse = lse;
        r.validate = do_validation == 1;
        if (!bench::parse_int(ap.str("s"), &r.seqlen_q) || r.seqlen_q < 0)
            usage_error("-s must be one query length >= 0 with the kv-cache arguments");
        if (!bench::parse_cache_lens(ap.str("s_k"), batch, r.seqlen_q, &r.cache_lens, &err)) usage_error(err);
        r.scale_s = scale_s == 0.0f ? 1.0f / std::sqrt(float(hdim_q)) : scale_s;
        r.mask = mask, r.init = init, r.seed = seed, r.kname = kname, r.warmup = warmup, r.repeat = repeat;
        return bench::run_splitkv(r);
    }

    std::vector<int> seqlen_qs, seqlen_ks;
    if (!bench::decode_seqlens(group, batch, ap.str("s"), ap.str("s_k"), seed, &seqlen_qs, &seqlen_ks, &err))
        usage_error(err);
    const std::vector<int32_t> seqstart_q = bench::to_seqstarts(seqlen_qs);
    const std::vector<int32_t> seqstart_k = bench::to_seqstarts(seqlen_ks);

    if (scale_s == 0.0f) scale_s = 1.0f / std::sqrt(float(hdim_q));

    // ---------------------------------------------------------------- sizes, FLOPs, bytes (as aiter counts them)
    int max_seqlen_q = 0;
    double flop = 0, num_byte = 0;
    const double esz = fp8 ? 1.0 : 2.0;  // q, k, v
    const double esz_o = 2.0;             // o: fp16 / bf16 in every dtype
    for (int b = 0; b < batch; ++b) {
        const double sq = seqlen_qs[size_t(b)], sk = seqlen_ks[size_t(b)];
        max_seqlen_q = std::max(max_seqlen_q, seqlen_qs[size_t(b)]);
        flop += double(nhead) * (2.0 * sq * sk * hdim_q + 2.0 * sq * hdim_v * sk);
        num_byte += double(nhead) * (esz * sq * hdim_q + esz * sk * hdim_q + esz * hdim_v * sk + esz_o * sq * hdim_v);
    }
    if (mask.type != MHAKIT_MASK_NONE) flop *= 0.5;

    int max_seqlen_k = 0;
    for (int b = 0; b < batch; ++b) max_seqlen_k = std::max(max_seqlen_k, seqlen_ks[size_t(b)]);
    const int64_t shape_batch = group ? 1 : batch;
    const int64_t shape_sq = group ? int64_t(seqstart_q.back()) : int64_t(seqlen_qs[0]);
    const int64_t shape_sk = group ? int64_t(seqstart_k.back()) : int64_t(seqlen_ks[0]);

    // Element counts checked before anything is allocated; then the host memory they need, then the device.
    const bench::TensorCounts counts =
        bench::checked_counts(batch, shape_batch, nhead, nhead_k, shape_sq, shape_sk, hdim_q, hdim_v);
    const size_t q_elems = counts.q, k_elems = counts.k, v_elems = counts.v, o_elems = counts.o,
                 lse_elems = counts.lse;
    // inputs; with -v=1 also the output copies (o: 2 bytes, lse: 4) and the reference (o and lse: 4 bytes each)
    bench::require_host_memory(esz * double(q_elems + k_elems + v_elems) +
                               (do_validation ? 6.0 * double(o_elems) + (lse ? 8.0 * double(lse_elems) : 0.0) : 0.0));
    bench::require_device();

    // ---------------------------------------------------------------- host inputs
    // (fp8: e4m3 bytes with one descale factor per tensor, q, k, v in that order)
    std::vector<uint16_t> q_host(fp8 ? 0 : q_elems), k_host(fp8 ? 0 : k_elems), v_host(fp8 ? 0 : v_elems);
    std::vector<uint8_t> q8_host(fp8 ? q_elems : 0), k8_host(fp8 ? k_elems : 0), v8_host(fp8 ? v_elems : 0);
    float descales[3] = {1.0f, 1.0f, 1.0f};
    {
        std::mt19937 seeder(seed);
        const uint32_t sq_seed = static_cast<uint32_t>(seeder());
        const uint32_t sk_seed = static_cast<uint32_t>(seeder());
        const uint32_t sv_seed = static_cast<uint32_t>(seeder());
        if (fp8) {
            descales[0] = bench::fill_tensor_fp8(q8_host, init, sq_seed, per_tensor);
            descales[1] = bench::fill_tensor_fp8(k8_host, init, sk_seed, per_tensor);
            descales[2] = bench::fill_tensor_fp8(v8_host, init, sv_seed, per_tensor);
        } else {
            bench::fill_tensor(q_host, init, dtype, sq_seed);
            bench::fill_tensor(k_host, init, dtype, sk_seed);
            bench::fill_tensor(v_host, init, dtype, sv_seed);
        }
    }
    const void* q_src = fp8 ? static_cast<const void*>(q8_host.data()) : q_host.data();
    const void* k_src = fp8 ? static_cast<const void*>(k8_host.data()) : k_host.data();
    const void* v_src = fp8 ? static_cast<const void*>(v8_host.data()) : v_host.data();
    mods.make(batch, nhead, max_seqlen_q, max_seqlen_k, dtype, seed);
    drop.make(group, shape_batch, nhead, shape_sq, max_seqlen_k);
    // The random bytes of the run, by the host's Philox (dropout.h): what the reference drops with, and what the
    // library's store (-s_randval=1) must equal.
    std::vector<uint8_t> rv_host(drop.on() && do_validation ? size_t(drop.rv_elems) : 0);
    if (!rv_host.empty())
        host::fill_randval(rv_host.data(), drop.rv_row, drop.rv_head, drop.rv_batch, group, seqstart_q.data(),
                           seqstart_k.data(), batch, nhead, seqlen_qs[0], seqlen_ks[0], drop.seed, drop.offset);

    // ---------------------------------------------------------------- device buffers
    const size_t in_bytes = fp8 ? 1 : 2;
    DeviceBuffer q_dev(q_elems * in_bytes), k_dev(k_elems * in_bytes), v_dev(v_elems * in_bytes), o_dev(o_elems * 2);
    DeviceBuffer descale_dev(fp8 ? sizeof(descales) : 0);
    if (fp8) descale_dev.upload(descales);
    DeviceBuffer lse_dev(lse ? lse_elems * sizeof(float) : 0);
    DeviceBuffer seqstart_q_dev(group ? seqstart_q.size() * sizeof(int32_t) : 0);
    DeviceBuffer seqstart_k_dev(group ? seqstart_k.size() * sizeof(int32_t) : 0);
    DeviceBuffer bias_dev(mods.bias_bytes()), sink_dev(mods.sinks.size() * sizeof(float));
    DeviceBuffer randval_dev(drop.store ? size_t(drop.rv_elems) : 0);
    DeviceBuffer drop_seed_dev(drop.prefs ? sizeof(uint64_t) : 0), drop_offset_dev(drop.prefs ? sizeof(uint64_t) : 0);
    if (drop.prefs) {
        drop_seed_dev.upload(&drop.seed);
        drop_offset_dev.upload(&drop.offset);
    }
    if (drop.store) randval_dev.poison();
    q_dev.upload(q_src);
    k_dev.upload(k_src);
    v_dev.upload(v_src);
    if (mods.bias_bytes()) bias_dev.upload(mods.host_bias());
    if (mods.sink) sink_dev.upload(mods.sinks.data());
    if (group) {
        seqstart_q_dev.upload(seqstart_q.data());
        seqstart_k_dev.upload(seqstart_k.data());
    }
    o_dev.poison();
    if (lse) lse_dev.poison();
    MHAKIT_CHECK_CUDA(mhakit::dev::device_synchronize());

    // ---------------------------------------------------------------- arguments for the library (aiter's strides)
    mhakit::mha_fwd_args args{};
    args.data_type = dtype;
    args.is_group_mode = group ? 1 : 0;
    args.has_lse = lse ? 1 : 0;
    args.q_ptr = q_dev.get();
    args.k_ptr = k_dev.get();
    args.v_ptr = v_dev.get();
    args.o_ptr = o_dev.get();
    args.lse_ptr = lse ? lse_dev.get() : nullptr;
    args.seqstart_q_ptr = group ? static_cast<const int32_t*>(seqstart_q_dev.get()) : nullptr;
    args.seqstart_k_ptr = group ? static_cast<const int32_t*>(seqstart_k_dev.get()) : nullptr;
    args.seqlen_q = int(shape_sq);  // group mode: the packed row counts (TMA bounds of the Hopper kernels)
    args.seqlen_k = int(shape_sk);
    args.batch = batch;
    args.max_seqlen_q = max_seqlen_q;
    args.hdim_q = hdim_q;
    args.hdim_v = hdim_v;
    args.nhead_q = nhead;
    args.nhead_k = nhead_k;
    args.scale_s = scale_s;
    args.stride_q = i_perm ? hdim_q : int64_t(nhead) * hdim_q;
    args.stride_k = i_perm ? hdim_q : int64_t(nhead_k) * hdim_q;
    args.stride_v = i_perm ? hdim_v : int64_t(nhead_k) * hdim_v;
    args.stride_o = o_perm ? hdim_v : int64_t(nhead) * hdim_v;
    args.nhead_stride_q = i_perm ? shape_sq * hdim_q : hdim_q;
    args.nhead_stride_k = i_perm ? shape_sk * hdim_q : hdim_q;
    args.nhead_stride_v = i_perm ? shape_sk * hdim_v : hdim_v;
    args.nhead_stride_o = o_perm ? shape_sq * hdim_v : hdim_v;
    args.nhead_stride_lse = shape_sq;
    args.batch_stride_q = int64_t(nhead) * shape_sq * hdim_q;
    args.batch_stride_k = int64_t(nhead_k) * shape_sk * hdim_q;
    args.batch_stride_v = int64_t(nhead_k) * shape_sk * hdim_v;
    args.batch_stride_o = int64_t(nhead) * shape_sq * hdim_v;
    args.batch_stride_lse = int64_t(nhead) * shape_sq;
    args.mask_type = mask.type;
    args.window_size_left = mask.left;
    args.window_size_right = mask.right;
    mods.fill(args, bias_dev.get(), static_cast<const float*>(sink_dev.get()));
    drop.fill(args, static_cast<const uint64_t*>(drop_seed_dev.get()), static_cast<const uint64_t*>(drop_offset_dev.get()));
    if (drop.store) {
        args.randval_ptr = randval_dev.get();
        args.stride_randval = drop.rv_row, args.nhead_stride_randval = drop.rv_head;
        args.batch_stride_randval = drop.rv_batch;
    }
    if (fp8) {
        const float* d = static_cast<const float*>(descale_dev.get());
        args.q_descale_ptr = d, args.k_descale_ptr = d + 1, args.v_descale_ptr = d + 2;
    }
    // The library's scratch (fp8: V transposed; a persistent instance: its tile counter, which each call tags anew,
    // so the warm-up, timed and validated calls reuse it as allocated); a refusal leaves it 0 and mha_fwd below says
    // why.
    DeviceBuffer workspace_dev(pass_workspace ? mhakit::mha_fwd_workspace_size(args) : 0);
    args.workspace_ptr = pass_workspace ? workspace_dev.get() : nullptr;
    args.workspace_bytes = pass_workspace ? workspace_dev.bytes() : 0;

    mhakit::stream_config sc{};
    sc.stream = nullptr;
    sc.time_kernel = 1;
    sc.log_level = kname;
    sc.warmup = warmup;
    sc.repeat = repeat;
    sc.gpu_timer = 1;

    // ---------------------------------------------------------------- the line, as aiter prints it
    const auto layout_str = [](bool permute) { return std::string(permute ? "bhsd" : "bshd"); };
    const std::string io_layout = i_perm == o_perm ? layout_str(i_perm) : layout_str(i_perm) + "-" + layout_str(o_perm);
    std::cout << "[" << prec << "|" << (group ? "group" : "batch") << "|" << io_layout << "] b:" << batch
              << ", h:" << nhead << "/" << nhead_k << ", s:" << seqlen_qs[0] << "/" << seqlen_ks[0] << ", d:" << hdim_q
              << "/" << hdim_v << ", scale_s:" << scale_s << ", bias:" << mods.str() << ", p_drop:" << drop.str() << ", lse:" << lse
              << ", qscale:" << (per_tensor ? "pt" : "n") << ", mask:" << mask.str() << ", v:r";
    if (mods.soft_cap > 0.f) std::cout << ", logits_soft_cap:" << mods.soft_cap;
    if (mods.sink) std::cout << ", sink:1";
    std::cout << std::flush;

    const float ave_time = mhakit::mha_fwd(args, sc);
    if (ave_time < 0.0f) {
        std::cout << ", not supported yet" << std::endl;
        std::fprintf(stderr, "%s: mha_fwd returned %d (%s): %s\n", kProg, int(ave_time), status_name(ave_time),
                     mhakit::last_error());
        return kExitFail;
    }
    MHAKIT_CHECK_CUDA(mhakit::dev::last_error());
    MHAKIT_CHECK_CUDA(mhakit::dev::device_synchronize());

    const double tflops = flop / 1.0e9 / double(ave_time);
    const double gb_per_sec = num_byte / 1.0e6 / double(ave_time);
    std::cout << std::fixed << ", " << std::setprecision(3) << ave_time << " ms, " << std::setprecision(2) << tflops
              << " TFlops, " << std::setprecision(2) << gb_per_sec << " GB/s" << std::flush;

    if (do_validation == 0) {
        std::cout << std::endl;
        return 0;
    }

    // ---------------------------------------------------------------- validation against the host reference
    std::vector<uint16_t> o_out(o_elems);
    std::vector<float> lse_out(lse ? lse_elems : 0);
    o_dev.download(o_out.data());
    if (lse) lse_dev.download(lse_out.data());

    mhakit::mha_fwd_args hargs = args;  // same geometry, host pointers
    hargs.q_ptr = q_src;
    hargs.k_ptr = k_src;
    hargs.v_ptr = v_src;
    if (fp8) hargs.q_descale_ptr = &descales[0], hargs.k_descale_ptr = &descales[1], hargs.v_descale_ptr = &descales[2];
    hargs.o_ptr = nullptr;
    hargs.lse_ptr = nullptr;
    hargs.seqstart_q_ptr = group ? seqstart_q.data() : nullptr;
    hargs.seqstart_k_ptr = group ? seqstart_k.data() : nullptr;
    mods.fill(hargs, mods.host_bias(), mods.sinks.data());
    hargs.drop_seed_ptr = hargs.drop_offset_ptr = nullptr;  // the host values (the same numbers)
    bool randval_ok = true;
    if (drop.on()) {
        // With -s_randval=1 the library's bytes (of the scores its kernels visited: the visible ones) must be the
        // host's; the reference then drops with the stored bytes.
        if (drop.store) {
            std::vector<uint8_t> rv_out(size_t(drop.rv_elems));
            randval_dev.download(rv_out.data());
            randval_ok = host::compare_randval(rv_out.data(), rv_host.data(), drop.rv_row, drop.rv_head, drop.rv_batch,
                                               group, seqstart_q.data(), seqlen_qs.data(), seqlen_ks.data(), batch,
                                               nhead, mask.type, mask.left, mask.right, stderr) == 0;
        }
        hargs.randval_ptr = rv_host.data();
        hargs.stride_randval = drop.rv_row, hargs.nhead_stride_randval = drop.rv_head;
        hargs.batch_stride_randval = drop.rv_batch;
    }

    std::vector<float> o_ref(o_elems, 0.0f), lse_ref(lse ? lse_elems : 0, 0.0f);
    host::reference_mha_fwd(hargs, o_ref.data(), lse ? lse_ref.data() : nullptr);

    double rtol = dtype == MHAKIT_DTYPE_BF16 ? 1e-2 : 1e-3;
    double atol = dtype == MHAKIT_DTYPE_BF16 ? 1e-2 : 1e-3;
    if (fp8) {
        // P is rounded to e4m3 (3 mantissa bits: at most 2^-4 relative per probability >= 2^-6, 2^-10 absolute below)
        // for the P·V product: O's error is about a probability-weighted mean of those, 2^-4·max|v| at worst and in
        // practice a few times smaller (docs/PERFORMANCE.md); the reference is pure fp32 on the decoded inputs.
        float vmax = 0.0f;
        for (uint8_t b : v8_host) vmax = std::max(vmax, std::fabs(host::e4m3_to_float(b)));
        rtol = 2e-2;
        atol = std::max(1e-2, 0.0625 * double(vmax) * double(descales[2]));
    }
    // Check silently first so that the one-line summary stays on one line; report the details after it.
    const auto run_check = [&](FILE* log) {
        return host::check_fwd(hargs, o_out.data(), o_ref.data(), lse ? lse_out.data() : nullptr,
                               lse ? lse_ref.data() : nullptr, rtol, atol, /*round_ref_o=*/true, log, /*max_report=*/8);
    };
    host::FwdCheckResult chk = run_check(nullptr);
    if (!randval_ok) chk.ok = false;
    if (fp8) std::cout << ", max_err:" << std::setprecision(4) << chk.o.max_abs_err;
    std::cout << ", valid:" << (chk.ok ? "y" : "n") << std::endl;
    if (!chk.ok) {
        run_check(stderr);
        std::fprintf(stderr, "%s mismatch: seqlen_q: %s\n\tseqlen_k: %s\n",
                     !randval_ok ? "RANDVAL" : chk.o.ok ? "LSE" : "OUT",
                     list_str(seqlen_qs).c_str(), list_str(seqlen_ks).c_str());
        if (group)
            std::fprintf(stderr, "\tseqstart_q: %s\n\tseqstart_k: %s\n", list_str(seqstart_q).c_str(),
                         list_str(seqstart_k).c_str());
    }
    return chk.ok ? 0 : kExitFail;
}

int main(int argc, char** argv) {
    mhakit::bench::g_program = kProg;
    return mhakit::bench::run_main([&] { return run(argc, argv); });
}
