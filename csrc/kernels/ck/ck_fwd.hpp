// One CK-tile forward kernel as an mhakit instance: its run-time guard (which problems this instance serves, as CK's
// own dispatch decides: padding, tile fit, LSE) and its launch from FwdParams.
// The kernel type itself is assembled in the generated instance (templates/instance_ck_fwd.cpp.j2).
#pragma once

#include <utility>

#include "fmha_fwd.hpp"  // CK's example host header: fmha_fwd_args, FmhaFwdTypeConfig, fmha_fwd_create_kargs_and_grids
#include "kernels/ck/ck_common.hpp"
#include "kernels/common/fwd_params.h"

namespace mhakit::ck {

// Which of CK's run-time checks apply (CK's FmhaFwdApiTrait scheck/skcheck/dcheck per pipeline).
enum class FwdChecks { QrAsync, Qr, Trload };

// The instance's compile-time facts the guard reads (all catalogue data, rendered by the template).
struct FwdGuard {
    FwdChecks checks;
    bool spad, skpad, dpad, dvpad;  // CK's padding flags
    int bm0, bn0;                   // block tile along seqlen_q / seqlen_k
    int hdim_align;                 // head-dim multiple an unpadded head dim needs (CK's K0_MAX_SUBMAX_MAP)
    int seqtune;                    // > 0: serves seqlen_q <= seqtune only
    bool store_lse;
};

template <class Kernel, class ArchTag, FwdGuard G>
struct FwdInstance {
    static bool supports(const FwdParams& p) {
        const bool group = p.seqstart_q != nullptr;
        if ((p.lse != nullptr) != G.store_lse) return false;
        if (!mask_expressible(p.mask_type, p.window_left, p.window_right)) return false;
        if (!fits_index({p.q_row_stride, p.k_row_stride, p.v_row_stride, p.o_row_stride, p.q_head_stride,
                         p.k_head_stride, p.v_head_stride, p.o_head_stride, p.lse_head_stride, p.q_batch_stride,
                         p.k_batch_stride, p.v_batch_stride, p.o_batch_stride, p.lse_batch_stride}))
            return false;
        const int seqlen_q = group ? p.max_seqlen_q : p.seqlen_q;
        if (G.seqtune > 0 && seqlen_q > G.seqtune) return false;
        const bool k_tiles_whole = !group && p.seqlen_k != 0 && p.seqlen_k % G.bn0 == 0;
        switch (G.checks) {
            case FwdChecks::QrAsync:  // seqlen_q and head dims always padded (head dims in multiples of 8)
                if (p.hdim_q % 8 != 0 || p.hdim_v % 8 != 0) return false;
                return G.skpad ? !k_tiles_whole : k_tiles_whole;
            case FwdChecks::Qr:
                if (!G.spad && (group || p.seqlen_q % G.bm0 != 0)) return false;
                if (!G.skpad && !k_tiles_whole) return false;
                [[fallthrough]];
            case FwdChecks::Trload:  // seqlen handled by the pipeline itself
                if (!G.dpad && p.hdim_q % G.hdim_align != 0) return false;
                if (!G.dvpad && p.hdim_v % G.hdim_align != 0) return false;
                return true;
        }
        return false;
    }

    static dev::Error run(const FwdParams& p, dev::Stream stream) {
        fmha_fwd_args a{};
        a.q_ptr = p.q, a.k_ptr = p.k, a.v_ptr = p.v, a.o_ptr = p.o;
        a.bias_ptr = nullptr, a.rand_val_ptr = nullptr;
        a.lse_ptr = p.lse;
        if (p.seqstart_q != nullptr) a.seqstart_q_ptr = p.seqstart_q, a.seqstart_k_ptr = p.seqstart_k;
        a.seqlen_q = p.seqlen_q, a.seqlen_k = p.seqlen_k, a.batch = p.batch, a.max_seqlen_q = p.max_seqlen_q;
        a.hdim_q = p.hdim_q, a.hdim_v = p.hdim_v, a.nhead_q = p.nhead_q, a.nhead_k = p.nhead_k;
        a.scale_s = p.scale, a.scale_p = 1.f, a.scale_o = 1.f, a.logits_soft_cap = 0.f;
        a.stride_q = p.q_row_stride, a.stride_k = p.k_row_stride, a.stride_v = p.v_row_stride, a.stride_o = p.o_row_stride;
        a.nhead_stride_q = p.q_head_stride, a.nhead_stride_k = p.k_head_stride, a.nhead_stride_v = p.v_head_stride;
        a.nhead_stride_o = p.o_head_stride, a.nhead_stride_lse = p.lse_head_stride;
        a.batch_stride_q = p.q_batch_stride, a.batch_stride_k = p.k_batch_stride, a.batch_stride_v = p.v_batch_stride;
        a.batch_stride_o = p.o_batch_stride, a.batch_stride_lse = p.lse_batch_stride;
        const CkMask m = ck_mask(p.mask_type, p.window_left, p.window_right);
        a.mask_type = m.type, a.window_size_left = m.left, a.window_size_right = m.right;
        a.min_seqlen_q = 0, a.p_drop = 0.f, a.s_randval = false;
        a.drop_seed_offset = std::make_pair(uint64_t{0}, uint64_t{0});
        auto [kargs, grids] = fmha_fwd_create_kargs_and_grids<Kernel>(a);
        return launch<Kernel, ArchTag>(kargs, grids, stream);
    }
};

}  // namespace mhakit::ck
