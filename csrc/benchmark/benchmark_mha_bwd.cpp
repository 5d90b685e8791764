// mhakit — benchmark_mha_bwd: times mhakit::mha_bwd and checks its gradients against the host reference.
//
// Command line and output line follow aiter's op_tests/cpp/mha/benchmark_mha_bwd (`-key=value`, `-?` for help), so
// existing scripts keep working for everything mhakit supports; aiter arguments mhakit does not implement (bias,
// dropout, the asm v3 switches, ...) are accepted only at their default value and rejected by name otherwise.
//
// Flow: fill q, k, v, dO (-init, -seed); run the forward through the library (mhakit::mha_fwd with LSE) to get O and
// LSE on the device, as aiter runs its own forward; ask mhakit::mha_bwd_workspace_size for the scratch size and
// allocate it; fill dQ, dK, dV and the workspace with 0xFF (NaN) so that anything the kernels forget shows; time
// mhakit::mha_bwd (-warmup, -repeat). With -v=1 the gradients of the timed runs are compared with the host reference
// (csrc/reference/host_attention_bwd.hpp), which recomputes the forward in fp32 itself and takes D = rowsum(dO ∘ O)
// from the device O (the O the backward kernels read); the device O and LSE are also checked against the
// recomputed forward with the forward's tolerances. With -deterministic=1 and -v=1 the backward runs once more (on
// re-poisoned outputs and workspace) and dQ, dK, dV must be bitwise identical to the first results.
//
// Layouts as aiter's: -iperm picks b·h·s·d (1) or b·s·h·d (0) for q, k, v and dQ, dK, dV; -operm for O and dO.
// dK / dV have h_k heads (GQA gradients are summed over each kv head's query heads).
//
// Host code only: links against libmha_bwd.so, libmha_fwd.so and the CUDA runtime. Build (repository root, one line):
//   g++ -std=c++17 -O3 -Icsrc -Icsrc/include -I$CUDA_HOME/include csrc/benchmark/benchmark_mha_bwd.cpp
//       -o benchmark_mha_bwd -L<dir of the libraries> -lmha_bwd -lmha_fwd -L$CUDA_HOME/lib64 -lcudart -ldl
//       -pthread -Wl,-rpath,'$ORIGIN'
//
// Exit status: 0 success; 1 validation failed (gradients, forward, or determinism) or the library refused the
// arguments (not supported / invalid); 2 bad command line (sizes whose buffers cannot fit in host memory
// included); 3 no CUDA device/driver, or a CUDA runtime error.
#include "mha_bwd.h"
#include "mha_fwd.h"


#include <stdint.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iomanip>
#include <iostream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "../reference/bench_cli.hpp"
#include "bench_device.hpp"
#include "../reference/host_attention.hpp"
#include "../reference/host_attention_bwd.hpp"

namespace {

using mhakit::bench::DeviceBuffer;
using mhakit::bench::kExitFail;
using mhakit::bench::kExitUsage;
using mhakit::bench::list_str;
using mhakit::bench::status_name;
using mhakit::bench::usage_error;

const char* const kProg = "benchmark_mha_bwd";

void register_args(mhakit::bench::ArgParser& ap) {
    ap.add("v", "1", "0: no validation, 1: CPU validation (and, with -deterministic=1, a bitwise rerun check)");
    mhakit::bench::add_shape_args(ap);
    ap.add("scale", "0", "scale factor. 0 means equal to 1/sqrt(hdim)")
        .add("iperm", "1", "permute input (q, k, v and dq, dk, dv)\nif true, will be b*h*s*d, else b*s*h*d")
        .add("operm", "1", "permute output (o and do)")
        .add("prec", "fp16", "data type. fp16/bf16");
    mhakit::bench::add_mask_arg(ap);
    ap.add("deterministic", "0",
           "1: ask for bitwise reproducible dq/dk/dv (mha_bwd_args.deterministic)\n"
           "with -v=1 the backward then runs twice and the results must be bitwise equal")
        .add("kname", "0", "if set to 1 will print kernel name")
        .add("dbias", "0", "1: output the bias gradient (elementwise bias only), b*h*s*s, checked against the reference")
        .add("init", "1",
             "init method of q, k, v, do. 0: random int in [-2, 2], 1: random float in [-1, 1), 2: trig float\n"
             "(the forward's ui, ni, uf, nf, tf are accepted too)");
    mhakit::bench::add_seed_arg(ap);
    mhakit::bench::add_timing_args(ap);
    mhakit::bench::add_score_mod_args(ap);  // with -sink=1 the backward checks d sink too
    mhakit::bench::add_dropout_args(ap, /*with_randval=*/false);
    ap.set_epilog(
        "output: <ms> is the mean time of one mha_bwd call (every backward stage, not the forward);\n"
        "  TFlops = FLOPs / 1e9 / ms with FLOPs = 2.5 x the forward's (FlashAttention convention):\n"
        "  sum over sequences and query heads of 2.5 * 2*s*s_k*(d + d_v) (= 10*s*s_k*d when d == d_v),\n"
        "  halved when any mask is set; GB/s = bytes / 1e6 / ms with bytes = q, k, v, o, do, dq, dk, dv (2 bytes per\n"
        "  element, counted per query head as aiter does) and lse (4 bytes) once.\n"
        "validation (-v=1): dq, dk, dv against an fp32 host reference that recomputes the forward (D = rowsum(do*o)\n"
        "  with the device o), |out - ref| <= atol + rtol*|ref| with rtol = atol = 1e-2 (bf16 with d > 128 and\n"
        "  d_v > 128: 3.2e-2); the forward's o and lse with the forward's tolerances; with -deterministic=1 a second\n"
        "  run must give bitwise identical dq, dk, dv.\n");

    using mhakit::bench::bool_equal_to;
    using mhakit::bench::int_at_most;
    using mhakit::bench::int_equal_to;
    using mhakit::bench::one_of;
    ap.add_unsupported("s_kpad", "-1", "-1", int_at_most(-1))
        .add_unsupported("s_qpad", "-1", "-1", int_at_most(-1))
        .add_unsupported("bwd_v3", "0", "0", int_equal_to(0))
        .add_unsupported("v3_atomic_fp32", "1", "1", bool_equal_to(true))
        .add_unsupported("v3_bf16_cvt", "1", "1", int_equal_to(1))
        .add_unsupported("v3_api_check", "0", "0", bool_equal_to(false))
        .add_unsupported("timer", "gpu", "gpu", one_of({"gpu"}));
}

// Host copy of a device tensor of 16-bit elements.
std::vector<uint16_t> download16(const DeviceBuffer& buf, size_t elems) {
    std::vector<uint16_t> h(elems);
    if (elems > 0) MHAKIT_CHECK_CUDA(mhakit::dev::copy_to_host(h.data(), buf.get(), elems * 2));
    return h;
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
    float scale;
    bool i_perm, o_perm, deterministic;
    if (!ap.get_float("scale", &scale, &err) || !ap.get_bool("iperm", &i_perm, &err) ||
        !ap.get_bool("operm", &o_perm, &err) || !ap.get_bool("deterministic", &deterministic, &err))
        usage_error(err);
    if (!(scale >= 0.0f) || !std::isfinite(scale)) usage_error("-scale must be a finite number >= 0 (0: 1/sqrt(d))");

    const std::string prec = ap.str("prec");
    mhakit_dtype dtype;
    if (prec == "fp16") dtype = MHAKIT_DTYPE_FP16;
    else if (prec == "bf16") dtype = MHAKIT_DTYPE_BF16;
    else if (prec == "fp8" || prec == "bf8" || prec == "fp8bf16" || prec == "fp8fp32" || prec == "fp32")
        usage_error("-prec=" + prec + " is not supported by mhakit yet (fp16 or bf16)");
    else usage_error("invalid -prec=" + prec + " (fp16 or bf16)");

    bench::MaskSpec mask;
    if (!bench::parse_mask(ap.str("mask"), &mask, &err)) usage_error(err);
    bench::InitMethod init;
    if (!bench::parse_init_bwd(ap.str("init"), &init, &err)) usage_error(err);
    bench::ScoreModInputs mods;
    bool want_dbias = false;
    if (!mods.parse(ap, &err) || !ap.get_bool("dbias", &want_dbias, &err)) usage_error(err);
    if (want_dbias && mods.bias.type != MHAKIT_BIAS_ELEMENTWISE) usage_error("-dbias=1 needs -bias=e (elementwise)");
    bench::DropoutInputs drop;
    if (!drop.parse(ap, /*with_randval=*/false, &err)) usage_error(err);

    common.draw_seed(kProg);
    const uint32_t seed = common.seed;

    std::vector<int> seqlen_qs, seqlen_ks;
    if (!bench::decode_seqlens(group, batch, ap.str("s"), ap.str("s_k"), seed, &seqlen_qs, &seqlen_ks, &err))
        usage_error(err);
    const std::vector<int32_t> seqstart_q = bench::to_seqstarts(seqlen_qs);
    const std::vector<int32_t> seqstart_k = bench::to_seqstarts(seqlen_ks);

    if (scale == 0.0f) scale = 1.0f / std::sqrt(float(hdim_q));

    // ---------------------------------------------------------------- sizes, FLOPs, bytes
    // FLOPs: 2.5 x the forward's, FlashAttention convention (forward = 2*sq*sk*(d + dv) per head, halved for any mask).
    // Bytes: as aiter counts them, q, k, v, o, do, dq, dk, dv (per query head) and lse once.
    int max_seqlen_q = 0, max_seqlen_k = 0;
    double flop = 0, num_byte = 0;
    const double esz = 2.0;  // fp16 / bf16
    for (int b = 0; b < batch; ++b) {
        const double sq = seqlen_qs[size_t(b)], sk = seqlen_ks[size_t(b)];
        max_seqlen_q = std::max(max_seqlen_q, seqlen_qs[size_t(b)]);
        max_seqlen_k = std::max(max_seqlen_k, seqlen_ks[size_t(b)]);
        flop += 2.5 * double(nhead) * 2.0 * sq * sk * double(hdim_q + hdim_v);
        num_byte += double(nhead) * (esz * sq * hdim_q + esz * sk * hdim_q + esz * sk * hdim_v + esz * sq * hdim_v +
                                     esz * sq * hdim_v + esz * sq * hdim_q + esz * sk * hdim_q + esz * sk * hdim_v +
                                     4.0 * sq);
    }
    if (mask.type != MHAKIT_MASK_NONE) flop *= 0.5;

    const int64_t shape_batch = group ? 1 : batch;
    const int64_t shape_sq = group ? int64_t(seqstart_q.back()) : int64_t(seqlen_qs[0]);
    const int64_t shape_sk = group ? int64_t(seqstart_k.back()) : int64_t(seqlen_ks[0]);

    // Element counts checked before anything is allocated; then the host memory they need, then the device.
    const bench::TensorCounts counts =
        bench::checked_counts(batch, shape_batch, nhead, nhead_k, shape_sq, shape_sk, hdim_q, hdim_v);
    const size_t q_elems = counts.q, k_elems = counts.k, v_elems = counts.v, o_elems = counts.o,
                 lse_elems = counts.lse;
    // inputs (q, k, v, do); with -v=1 also the outputs' copies (2 bytes) and the fp32 references of dq, dk, dv, o
    // and lse
    const double data = double(q_elems + k_elems + v_elems + o_elems);
    bench::require_host_memory(2.0 * data + (do_validation ? 2.0 * data + 4.0 * data + 8.0 * double(lse_elems) : 0.0));
    bench::require_device();

    // ---------------------------------------------------------------- host inputs
    std::vector<uint16_t> q_host(q_elems), k_host(k_elems), v_host(v_elems), do_host(o_elems);
    {
        std::mt19937 seeder(seed);
        const uint32_t sq_seed = static_cast<uint32_t>(seeder());
        const uint32_t sk_seed = static_cast<uint32_t>(seeder());
        const uint32_t sv_seed = static_cast<uint32_t>(seeder());
        const uint32_t sdo_seed = static_cast<uint32_t>(seeder());
        bench::fill_tensor(q_host, init, dtype, sq_seed);
        bench::fill_tensor(k_host, init, dtype, sk_seed);
        bench::fill_tensor(v_host, init, dtype, sv_seed);
        bench::fill_tensor(do_host, init, dtype, sdo_seed);
    }
    mods.make(batch, nhead, max_seqlen_q, max_seqlen_k, dtype, seed);
    const size_t dbias_elems = want_dbias ? size_t(mods.bias_elems) : 0;
    // Dropout: with -v=1 the forward stores its random bytes, which must equal the host's Philox (dropout.h) and feed
    // the host reference of the backward.
    drop.make(group, shape_batch, nhead, shape_sq, max_seqlen_k);
    const bool store_randval = drop.on() && do_validation;
    std::vector<uint8_t> rv_host(store_randval ? size_t(drop.rv_elems) : 0);
    if (store_randval)
        host::fill_randval(rv_host.data(), drop.rv_row, drop.rv_head, drop.rv_batch, group, seqstart_q.data(),
                           seqstart_k.data(), batch, nhead, seqlen_qs[0], seqlen_ks[0], drop.seed, drop.offset);

    // ---------------------------------------------------------------- device buffers
    DeviceBuffer q_dev(q_elems * 2), k_dev(k_elems * 2), v_dev(v_elems * 2), o_dev(o_elems * 2), do_dev(o_elems * 2);
    DeviceBuffer lse_dev(lse_elems * sizeof(float));
    DeviceBuffer dq_dev(q_elems * 2), dk_dev(k_elems * 2), dv_dev(v_elems * 2);
    DeviceBuffer seqstart_q_dev(group ? seqstart_q.size() * sizeof(int32_t) : 0);
    DeviceBuffer seqstart_k_dev(group ? seqstart_k.size() * sizeof(int32_t) : 0);
    q_dev.upload(q_host.data());
    k_dev.upload(k_host.data());
    v_dev.upload(v_host.data());
    do_dev.upload(do_host.data());
    DeviceBuffer bias_dev(mods.bias_bytes()), sink_dev(mods.sinks.size() * sizeof(float));
    DeviceBuffer dbias_dev(dbias_elems * 2), dsink_dev(mods.sinks.size() * sizeof(float));
    DeviceBuffer randval_dev(store_randval ? size_t(drop.rv_elems) : 0);
    DeviceBuffer drop_seed_dev(drop.prefs ? sizeof(uint64_t) : 0), drop_offset_dev(drop.prefs ? sizeof(uint64_t) : 0);
    if (drop.prefs) {
        drop_seed_dev.upload(&drop.seed);
        drop_offset_dev.upload(&drop.offset);
    }
    if (store_randval) randval_dev.poison();
    if (mods.bias_bytes()) bias_dev.upload(mods.host_bias());
    if (mods.sink) sink_dev.upload(mods.sinks.data());
    if (group) {
        seqstart_q_dev.upload(seqstart_q.data());
        seqstart_k_dev.upload(seqstart_k.data());
    }
    o_dev.poison();
    lse_dev.poison();
    MHAKIT_CHECK_CUDA(mhakit::dev::device_synchronize());

    // ---------------------------------------------------------------- arguments for the library (aiter's strides)
    mhakit::mha_bwd_args args{};
    args.data_type = dtype;
    args.is_group_mode = group ? 1 : 0;
    args.deterministic = deterministic ? 1 : 0;
    args.q_ptr = q_dev.get();
    args.k_ptr = k_dev.get();
    args.v_ptr = v_dev.get();
    args.o_ptr = o_dev.get();
    args.lse_ptr = lse_dev.get();
    args.do_ptr = do_dev.get();
    args.dq_ptr = dq_dev.get();
    args.dk_ptr = dk_dev.get();
    args.dv_ptr = dv_dev.get();
    args.workspace_ptr = nullptr;
    args.workspace_bytes = 0;
    args.seqstart_q_ptr = group ? static_cast<const int32_t*>(seqstart_q_dev.get()) : nullptr;
    args.seqstart_k_ptr = group ? static_cast<const int32_t*>(seqstart_k_dev.get()) : nullptr;
    args.seqlen_q = int(shape_sq);  // group mode: the packed row counts (TMA bounds of the Hopper kernels)
    args.seqlen_k = int(shape_sk);
    args.batch = batch;
    args.max_seqlen_q = max_seqlen_q;
    args.max_seqlen_k = max_seqlen_k;
    args.hdim_q = hdim_q;
    args.hdim_v = hdim_v;
    args.nhead_q = nhead;
    args.nhead_k = nhead_k;
    args.scale = scale;
    // q, k, v and dq, dk, dv: -iperm; o and do: -operm
    args.stride_q = args.stride_dq = i_perm ? hdim_q : int64_t(nhead) * hdim_q;
    args.stride_k = args.stride_dk = i_perm ? hdim_q : int64_t(nhead_k) * hdim_q;
    args.stride_v = args.stride_dv = i_perm ? hdim_v : int64_t(nhead_k) * hdim_v;
    args.stride_o = args.stride_do = o_perm ? hdim_v : int64_t(nhead) * hdim_v;
    args.nhead_stride_q = args.nhead_stride_dq = i_perm ? shape_sq * hdim_q : hdim_q;
    args.nhead_stride_k = args.nhead_stride_dk = i_perm ? shape_sk * hdim_q : hdim_q;
    args.nhead_stride_v = args.nhead_stride_dv = i_perm ? shape_sk * hdim_v : hdim_v;
    args.nhead_stride_o = args.nhead_stride_do = o_perm ? shape_sq * hdim_v : hdim_v;
    args.nhead_stride_lse = shape_sq;
    args.batch_stride_q = args.batch_stride_dq = int64_t(nhead) * shape_sq * hdim_q;
    args.batch_stride_k = args.batch_stride_dk = int64_t(nhead_k) * shape_sk * hdim_q;
    args.batch_stride_v = args.batch_stride_dv = int64_t(nhead_k) * shape_sk * hdim_v;
    args.batch_stride_o = args.batch_stride_do = int64_t(nhead) * shape_sq * hdim_v;
    args.batch_stride_lse = int64_t(nhead) * shape_sq;
    args.mask_type = mask.type;
    args.window_size_left = mask.left;
    args.window_size_right = mask.right;
    mods.fill(args, bias_dev.get(), static_cast<const float*>(sink_dev.get()));
    const int64_t plane = int64_t(max_seqlen_q) * max_seqlen_k;
    if (want_dbias) {  // [b, h, max_s_q, max_s_k] in the bias's type
        args.dbias_ptr = dbias_dev.get();
        args.stride_dbias = max_seqlen_k;
        args.nhead_stride_dbias = plane;
        args.batch_stride_dbias = int64_t(nhead) * plane;
    }
    if (mods.sink) args.dsink_ptr = static_cast<float*>(dsink_dev.get());
    drop.fill(args, static_cast<const uint64_t*>(drop_seed_dev.get()), static_cast<const uint64_t*>(drop_offset_dev.get()));

    // the forward that produces O and LSE: same geometry, pointers, mask and dropout (host_attention_bwd.hpp's
    // fwd_args_of), storing its random bytes when validating
    mhakit::mha_fwd_args fargs = host::fwd_args_of(args);
    if (store_randval) {
        fargs.randval_ptr = randval_dev.get();
        fargs.stride_randval = drop.rv_row, fargs.nhead_stride_randval = drop.rv_head;
        fargs.batch_stride_randval = drop.rv_batch;
    }

    // ---------------------------------------------------------------- the line, as aiter prints it
    const auto layout_str = [](bool permute) { return std::string(permute ? "bhsd" : "bshd"); };
    const std::string io_layout = i_perm == o_perm ? layout_str(i_perm) : layout_str(i_perm) + "-" + layout_str(o_perm);
    std::ostringstream head;
    head << "[" << prec << "|" << (group ? "group" : "batch") << "|" << io_layout << "] b:" << batch << ", h:" << nhead
         << "/" << nhead_k << ", s:" << seqlen_qs[0] << "/" << seqlen_ks[0] << ", d:" << hdim_q << "/" << hdim_v
         << ", scale:" << scale << ", bias:" << mods.str() << ", dbias:" << (want_dbias ? 1 : 0)
         << ", p_drop:" << drop.str() << ", s_randval:" << (store_randval ? 1 : 0) << ", deterministic:" << (deterministic ? 1 : 0) << ", mask:" << mask.str();
    if (mods.soft_cap > 0.f) head << ", logits_soft_cap:" << mods.soft_cap;
    if (mods.sink) head << ", sink:1";
    // Any kernel names the library prints (-kname=1) come before the line; the line is printed in one piece.
    const auto fail_line = [&](const char* what, float rc, const char* why) {
        std::cout << head.str() << ", not supported yet" << std::endl;
        std::fprintf(stderr, "%s: %s returned %d (%s): %s\n", kProg, what, int(rc), status_name(rc), why);
        return kExitFail;
    };

    // ---------------------------------------------------------------- forward (O, LSE) through the library
    mhakit::stream_config sc_once{};
    sc_once.stream = nullptr;
    sc_once.time_kernel = 0;
    sc_once.log_level = kname;
    sc_once.warmup = 0;
    sc_once.repeat = 1;
    sc_once.gpu_timer = 1;
    {
        const float rc = mhakit::mha_fwd(fargs, sc_once);
        if (rc < 0.0f) return fail_line("mha_fwd (producing O and LSE)", rc, mhakit::last_error());
        MHAKIT_CHECK_CUDA(mhakit::dev::last_error());
        MHAKIT_CHECK_CUDA(mhakit::dev::device_synchronize());
    }

    // ---------------------------------------------------------------- workspace
    const size_t ws_bytes = mhakit::mha_bwd_workspace_size(args);
    if (ws_bytes == 0 && mhakit::last_error()[0] != '\0') {
        std::cout << head.str() << ", not supported yet" << std::endl;
        std::fprintf(stderr, "%s: mha_bwd_workspace_size failed: %s\n", kProg, mhakit::last_error());
        return kExitFail;
    }
    DeviceBuffer ws_dev(ws_bytes);
    args.workspace_ptr = ws_bytes > 0 ? ws_dev.get() : nullptr;
    args.workspace_bytes = ws_bytes;

    // ---------------------------------------------------------------- timed backward
    const auto poison_outputs = [&]() {
        dq_dev.poison();
        dk_dev.poison();
        dv_dev.poison();
        if (ws_bytes > 0) ws_dev.poison();
        if (dbias_elems) dbias_dev.poison();
        if (mods.sink) dsink_dev.poison();
        MHAKIT_CHECK_CUDA(mhakit::dev::device_synchronize());
    };
    poison_outputs();

    mhakit::stream_config sc{};
    sc.stream = nullptr;
    sc.time_kernel = 1;
    sc.log_level = kname;
    sc.warmup = warmup;
    sc.repeat = repeat;
    sc.gpu_timer = 1;
    const float ave_time = mhakit::mha_bwd(args, sc);
    if (ave_time < 0.0f) return fail_line("mha_bwd", ave_time, mhakit::last_error());
    MHAKIT_CHECK_CUDA(mhakit::dev::last_error());
    MHAKIT_CHECK_CUDA(mhakit::dev::device_synchronize());

    const double tflops = flop / 1.0e9 / double(ave_time);
    const double gb_per_sec = num_byte / 1.0e6 / double(ave_time);
    std::cout << head.str() << std::fixed << ", " << std::setprecision(3) << ave_time << " ms, " << std::setprecision(2)
              << tflops << " TFlops, " << std::setprecision(2) << gb_per_sec << " GB/s" << std::flush;

    if (do_validation == 0) {
        std::cout << std::endl;
        return 0;
    }

    // ---------------------------------------------------------------- validation against the host reference
    const std::vector<uint16_t> dq_out = download16(dq_dev, q_elems);
    const std::vector<uint16_t> dk_out = download16(dk_dev, k_elems);
    const std::vector<uint16_t> dv_out = download16(dv_dev, v_elems);
    const std::vector<uint16_t> o_out = download16(o_dev, o_elems);
    std::vector<float> lse_out(lse_elems);
    lse_dev.download(lse_out.data());

    // Determinism: run once more on poisoned outputs and workspace; every logical element must match bitwise.
    size_t det_diff[3] = {0, 0, 0};
    std::string det_first[3];
    bool det_ok = true;
    if (deterministic) {
        poison_outputs();
        mhakit::stream_config sc2 = sc_once;
        sc2.log_level = 0;
        const float rc = mhakit::mha_bwd(args, sc2);
        if (rc < 0.0f) {
            std::cout << ", valid:n" << std::endl;
            std::fprintf(stderr, "%s: second (determinism) mha_bwd returned %d (%s): %s\n", kProg, int(rc),
                         status_name(rc), mhakit::last_error());
            return kExitFail;
        }
        MHAKIT_CHECK_CUDA(mhakit::dev::last_error());
        MHAKIT_CHECK_CUDA(mhakit::dev::device_synchronize());
        const std::vector<uint16_t> dq2 = download16(dq_dev, q_elems);
        const std::vector<uint16_t> dk2 = download16(dk_dev, k_elems);
        const std::vector<uint16_t> dv2 = download16(dv_dev, v_elems);
        mhakit::mha_bwd_args hargs_det = args;
        hargs_det.seqstart_q_ptr = group ? seqstart_q.data() : nullptr;
        hargs_det.seqstart_k_ptr = group ? seqstart_k.data() : nullptr;
        det_diff[0] = host::count_bitwise_diff(hargs_det, host::BwdTensor::DQ, dq_out.data(), dq2.data(), &det_first[0]);
        det_diff[1] = host::count_bitwise_diff(hargs_det, host::BwdTensor::DK, dk_out.data(), dk2.data(), &det_first[1]);
        det_diff[2] = host::count_bitwise_diff(hargs_det, host::BwdTensor::DV, dv_out.data(), dv2.data(), &det_first[2]);
        det_ok = det_diff[0] == 0 && det_diff[1] == 0 && det_diff[2] == 0;
    }

    mhakit::mha_bwd_args hargs = args;  // same geometry, host pointers
    hargs.q_ptr = q_host.data();
    hargs.k_ptr = k_host.data();
    hargs.v_ptr = v_host.data();
    hargs.o_ptr = o_out.data();  // D from the device O (what the backward kernels read)
    hargs.lse_ptr = nullptr;
    hargs.do_ptr = do_host.data();
    hargs.dq_ptr = hargs.dk_ptr = hargs.dv_ptr = nullptr;
    hargs.workspace_ptr = nullptr;
    hargs.workspace_bytes = 0;
    hargs.seqstart_q_ptr = group ? seqstart_q.data() : nullptr;
    hargs.seqstart_k_ptr = group ? seqstart_k.data() : nullptr;
    mods.fill(hargs, mods.host_bias(), mods.sinks.data());
    hargs.dbias_ptr = nullptr;
    hargs.dsink_ptr = nullptr;
    hargs.drop_seed_ptr = hargs.drop_offset_ptr = nullptr;
    bool randval_ok = true;
    host::HostRandval rv{rv_host.data(), drop.rv_row, drop.rv_head, drop.rv_batch};
    if (store_randval) {
        std::vector<uint8_t> rv_out(size_t(drop.rv_elems));
        randval_dev.download(rv_out.data());
        randval_ok = host::compare_randval(rv_out.data(), rv_host.data(), drop.rv_row, drop.rv_head, drop.rv_batch,
                                           group, seqstart_q.data(), seqlen_qs.data(), seqlen_ks.data(), batch, nhead,
                                           mask.type, mask.left, mask.right, stderr) == 0;
    }

    std::vector<float> dq_ref(q_elems, 0.0f), dk_ref(k_elems, 0.0f), dv_ref(v_elems, 0.0f);
    std::vector<float> o_ref(o_elems, 0.0f), lse_ref(lse_elems, 0.0f);
    std::vector<float> dbias_ref(dbias_elems, 0.0f), dsink_ref(mods.sinks.size(), 0.0f);
    host::BwdRefOptions ropt;
    ropt.d_from_o = true;
    host::reference_mha_bwd(hargs, dq_ref.data(), dk_ref.data(), dv_ref.data(), o_ref.data(), lse_ref.data(), ropt,
                            dbias_elems ? dbias_ref.data() : nullptr, mods.sink ? dsink_ref.data() : nullptr,
                            store_randval ? &rv : nullptr);
    // The modifiers' gradients: dbias over each sequence's [s_q, s_k] block, d sink per head.
    bool mods_ok = true;
    if (dbias_elems) {
        const std::vector<uint16_t> dbias_out = download16(dbias_dev, dbias_elems);
        std::vector<float> out, ref;
        for (int b = 0; b < batch; ++b)
            for (int h = 0; h < nhead; ++h)
                for (int i = 0; i < seqlen_qs[size_t(b)]; ++i)
                    for (int j = 0; j < seqlen_ks[size_t(b)]; ++j) {
                        const size_t e = size_t(b * args.batch_stride_dbias + h * plane + int64_t(i) * max_seqlen_k + j);
                        out.push_back(host::to_float(dbias_out[e], dtype));
                        ref.push_back(host::round_to(dbias_ref[e], dtype));
                    }
        const double t = host::bwd_tolerance(dtype, hdim_q, hdim_v);
        mods_ok = host::check_err("dbias", out.data(), ref.data(), out.size(), t, t, false, stderr).ok && mods_ok;
    }
    if (mods.sink) {
        std::vector<float> dsink_out(mods.sinks.size());
        dsink_dev.download(dsink_out.data());
        // a sum over every row of a head: relative tolerance of the row terms, absolute of their count
        const double t = host::bwd_tolerance(dtype, hdim_q, hdim_v);
        mods_ok = host::check_err("dsink", dsink_out.data(), dsink_ref.data(), dsink_out.size(), t, t, false, stderr).ok &&
                  mods_ok;
    }

    // Check silently first so that the one-line summary stays on one line; report the details after it.
    const double tol = host::bwd_tolerance(dtype, hdim_q, hdim_v);
    const auto run_bwd_check = [&](FILE* log) {
        return host::check_bwd(hargs, dq_out.data(), dk_out.data(), dv_out.data(), dq_ref.data(), dk_ref.data(),
                               dv_ref.data(), tol, tol, /*round_ref=*/true, log, /*max_report=*/8);
    };
    const mhakit::mha_fwd_args hfargs = host::fwd_args_of(hargs);
    const double ftol = dtype == MHAKIT_DTYPE_BF16 ? 1e-2 : 1e-3;
    const auto run_fwd_check = [&](FILE* log) {
        return host::check_fwd(hfargs, o_out.data(), o_ref.data(), lse_out.data(), lse_ref.data(), ftol, ftol,
                               /*round_ref_o=*/true, log, /*max_report=*/8);
    };
    const host::BwdCheckResult chk = run_bwd_check(nullptr);
    const host::FwdCheckResult fchk = run_fwd_check(nullptr);
    const bool ok = chk.ok && fchk.ok && det_ok && mods_ok && randval_ok;
    std::cout << ", valid:" << (ok ? "y" : "n") << std::endl;
    if (!chk.ok) {
        run_bwd_check(stderr);
        std::fprintf(stderr, "%s mismatch (rtol=atol=%g)\n", !chk.dq.ok ? "dQ" : !chk.dk.ok ? "dK" : "dV", tol);
    }
    if (!fchk.ok) {
        run_fwd_check(stderr);
        std::fprintf(stderr, "forward %s (from mha_fwd, input of the backward) mismatch (rtol=atol=%g)\n",
                     fchk.o.ok ? "LSE" : "O", ftol);
    }
    if (!det_ok) {
        const char* names[3] = {"dQ", "dK", "dV"};
        for (int t = 0; t < 3; ++t)
            if (det_diff[t] > 0)
                std::fprintf(stderr, "deterministic: %s differs between two runs in %zu elements (first at %s)\n",
                             names[t], det_diff[t], det_first[t].c_str());
    }
    if (!ok) {
        std::fprintf(stderr, "\tseqlen_q: %s\n\tseqlen_k: %s\n", list_str(seqlen_qs).c_str(), list_str(seqlen_ks).c_str());
        if (group)
            std::fprintf(stderr, "\tseqstart_q: %s\n\tseqstart_k: %s\n", list_str(seqstart_q).c_str(),
                         list_str(seqstart_k).c_str());
    }
    return ok ? 0 : kExitFail;
}

int main(int argc, char** argv) {
    mhakit::bench::g_program = kProg;
    return mhakit::bench::run_main([&] { return run(argc, argv); });
}
