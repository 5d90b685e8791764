// One CK-tile backward configuration as an mhakit instance: three CK kernels launched in order on the caller's
// stream (dot(dO,O) -> D; dQ/dK/dV with dQ accumulated in fp32; convert-dQ), their scratch memory in the caller's
// workspace, and the run-time guard (which problems CK's dispatch would send to this configuration).
// The kernel types themselves are assembled in the generated instance (templates/instance_ck_bwd.cpp.j2).
#pragma once

#include <utility>

#include "fmha_bwd.hpp"  // CK's example host header: fmha_bwd_args, FmhaBwdTypeConfig, *_create_kargs_and_grids
#include "kernels/ck/ck_common.hpp"
#include "kernels/common/bwd_params.h"

namespace mhakit::ck {

struct BwdGuard {
    int dpad, dvpad;    // CK's head-dim padding: 0 = none (head dim a multiple of bhdq/bhdv), 8 = multiples of 8
    int bhdq, bhdv;     // the tile's head dims
    int bn0;            // block tile along seqlen_k (also the dQ split size in deterministic mode)
    int seqlen_k_max;   // > 0: serves seqlen_k <= seqlen_k_max only
    bool deterministic;
};

// Workspace layout: D (fp32, indexed like LSE: CK reads LSE and D with the same strides), then the fp32 dQ
// accumulator [split][batch][head][row][hdim_q] (group mode: [split][head][row of the packed sequences][hdim_q]).
struct BwdWorkspace {
    static constexpr size_t kAlign = 256;
    int64_t d_elems, rows, splits, split_elems;
    size_t d_bytes, total_bytes;

    BwdWorkspace(const BwdParams& p, int bn0, bool deterministic) {
        const bool group = p.seqstart_q != nullptr;
        // rows of one head: batch mode seqlen_q per sequence; group mode every packed row (bounded by batch x max)
        rows = group ? int64_t(p.batch) * p.max_seqlen_q : p.seqlen_q;
        d_elems = group ? int64_t(p.nhead_q - 1) * p.lse_head_stride + rows
                        : int64_t(p.batch - 1) * p.lse_batch_stride + int64_t(p.nhead_q - 1) * p.lse_head_stride + rows;
        splits = deterministic ? (int64_t(p.max_seqlen_k) + bn0 - 1) / bn0 : 1;
        if (splits < 1) splits = 1;
        split_elems = (group ? 1 : int64_t(p.batch)) * p.nhead_q * rows * p.hdim_q;
        d_bytes = (size_t(d_elems) * sizeof(float) + kAlign - 1) / kAlign * kAlign;
        total_bytes = d_bytes + size_t(splits * split_elems) * sizeof(float);
    }
};

template <class DotKernel, class DqDkDvKernel, class ConvertKernel, class ArchTag, BwdGuard G>
struct BwdInstance {
    static bool supports(const BwdParams& p) {
        const bool group = p.seqstart_q != nullptr;
        if (p.deterministic != G.deterministic) return false;
        if (!mask_expressible(p.mask_type, p.window_left, p.window_right)) return false;
        constexpr int kDMultiple = G.dpad == 0 ? G.bhdq : G.dpad;  // unpadded: the tile's head dim
        constexpr int kDvMultiple = G.dvpad == 0 ? G.bhdv : G.dvpad;
        if (p.hdim_q % kDMultiple != 0 || p.hdim_v % kDvMultiple != 0) return false;
        if (G.seqlen_k_max > 0 && (group ? p.max_seqlen_k : p.seqlen_k) > G.seqlen_k_max) return false;
        const BwdWorkspace ws(p, G.bn0, G.deterministic);
        return fits_index({p.q_row_stride, p.k_row_stride, p.v_row_stride, p.o_row_stride, p.do_row_stride,
                           p.dq_row_stride, p.dk_row_stride, p.dv_row_stride, p.q_head_stride, p.k_head_stride,
                           p.v_head_stride, p.o_head_stride, p.do_head_stride, p.dq_head_stride, p.dk_head_stride,
                           p.dv_head_stride, p.lse_head_stride, p.q_batch_stride, p.k_batch_stride, p.v_batch_stride,
                           p.o_batch_stride, p.do_batch_stride, p.dq_batch_stride, p.dk_batch_stride,
                           p.dv_batch_stride, p.lse_batch_stride, ws.d_elems, ws.split_elems});
    }

    static size_t workspace_bytes(const BwdParams& p) { return BwdWorkspace(p, G.bn0, G.deterministic).total_bytes; }

    static dev::Error run(const BwdParams& p, dev::Stream stream) {
        const bool group = p.seqstart_q != nullptr;
        const BwdWorkspace ws(p, G.bn0, G.deterministic);
        char* scratch = static_cast<char*>(p.workspace);
        void* dq_acc = scratch + ws.d_bytes;
        // dQ is accumulated (atomically, or per key block): start from zero.
        if (dev::Error e = dev::memset_async(dq_acc, 0, ws.total_bytes - ws.d_bytes, stream); e != dev::kSuccess)
            return e;

        fmha_bwd_args a{};
        a.q_ptr = p.q, a.k_ptr = p.k, a.v_ptr = p.v, a.o_ptr = p.o, a.lse_ptr = p.lse, a.do_ptr = p.dout;
        a.bias_ptr = nullptr, a.rand_val_ptr = nullptr, a.dbias_ptr = nullptr;
        a.d_ptr = scratch, a.dq_acc_ptr = dq_acc;
        a.dq_ptr = p.dq, a.dk_ptr = p.dk, a.dv_ptr = p.dv;
        if (group) a.seqstart_q_ptr = p.seqstart_q, a.seqstart_k_ptr = p.seqstart_k;
        a.seqlen_q = p.seqlen_q, a.seqlen_k = p.seqlen_k, a.batch = p.batch;
        a.max_seqlen_q = p.max_seqlen_q, a.max_seqlen_k = p.max_seqlen_k;
        a.hdim_q = p.hdim_q, a.hdim_v = p.hdim_v, a.nhead_q = p.nhead_q, a.nhead_k = p.nhead_k, a.scale = p.scale;
        a.stride_q = p.q_row_stride, a.stride_k = p.k_row_stride, a.stride_v = p.v_row_stride;
        a.stride_o = p.o_row_stride, a.stride_do = p.do_row_stride, a.stride_dq = p.dq_row_stride;
        a.stride_dk = p.dk_row_stride, a.stride_dv = p.dv_row_stride, a.stride_dq_acc = p.hdim_q;
        a.nhead_stride_q = p.q_head_stride, a.nhead_stride_k = p.k_head_stride, a.nhead_stride_v = p.v_head_stride;
        a.nhead_stride_o = p.o_head_stride, a.nhead_stride_do = p.do_head_stride;
        a.nhead_stride_dq = p.dq_head_stride, a.nhead_stride_dk = p.dk_head_stride;
        a.nhead_stride_dv = p.dv_head_stride, a.nhead_stride_lsed = p.lse_head_stride;
        a.nhead_stride_dq_acc = ws.rows * p.hdim_q;
        a.batch_stride_q = p.q_batch_stride, a.batch_stride_k = p.k_batch_stride, a.batch_stride_v = p.v_batch_stride;
        a.batch_stride_o = p.o_batch_stride, a.batch_stride_do = p.do_batch_stride;
        a.batch_stride_dq = p.dq_batch_stride, a.batch_stride_dk = p.dk_batch_stride;
        a.batch_stride_dv = p.dv_batch_stride, a.batch_stride_lsed = p.lse_batch_stride;
        a.batch_stride_dq_acc = int64_t(p.nhead_q) * ws.rows * p.hdim_q;
        a.split_stride_dq_acc = ws.split_elems;
        const CkMask m = ck_mask(p.mask_type, p.window_left, p.window_right);
        a.mask_type = m.type, a.window_size_left = m.left, a.window_size_right = m.right;
        a.p_drop = 0.f, a.p_undrop = 1.f;
        a.drop_seed_offset = std::make_pair(uint64_t{0}, uint64_t{0});

        {
            auto [kargs, grids] = fmha_bwd_dot_do_o_create_kargs_and_grids<DotKernel>(a);
            if (dev::Error e = launch<DotKernel, ArchTag>(kargs, grids, stream); e != dev::kSuccess) return e;
        }
        {
            auto [kargs, grids] = fmha_bwd_dq_dk_dv_create_kargs_and_grids<DqDkDvKernel>(a);
            if (dev::Error e = launch<DqDkDvKernel, ArchTag>(kargs, grids, stream); e != dev::kSuccess) return e;
        }
        auto [kargs, grids] = fmha_bwd_convert_dq_create_kargs_and_grids<ConvertKernel>(a);
        return launch<ConvertKernel, ArchTag>(kargs, grids, stream);
    }
};

}  // namespace mhakit::ck
