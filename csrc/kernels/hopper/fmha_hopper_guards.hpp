// Host-side checks and mask set-up that the Hopper forward and backward wrappers share.
#pragma once

#include <cstdint>
#include <utility>

#include <cuda_runtime.h>

#include "kernels/common/mask.h"
#include "kernels/common/smem_opt_in.h"

namespace mhakit::hopper {

// The generic mask coordinate (row i sees keys i - y + 1 <= j < min(i + x, sk)) of a batch-mode problem, clamped
// (clamp_mask_coord) so that the kernels' 32-bit sums of lengths and coordinates stay in range. Params: FwdParams or
// BwdParams. Group mode makes the same coordinate per sequence on the device.
template <class Params>
MaskCoord clamped_mask_coord(const Params& p) {
    return make_clamped_mask_coord(p.mask_type, p.window_left, p.window_right, p.seqlen_q, p.seqlen_k);
}

// A stride that TMA sees must be positive and below 2^40 bytes (and a multiple of 16 bytes: the family's
// align_bytes guard in the catalogue, checked by the runtime before supports()); the stride of a mode of extent 1 is
// never used, so anything goes there.
template <class Element>
bool tma_stride_ok(int64_t stride, int64_t extent) {
    if (extent <= 1) return true;
    return stride > 0 && stride * int64_t(sizeof(Element)) < (int64_t(1) << 40);
}

// The main kernel of a "_mods" instance's call, for the forward and backward wrappers alike (FwdKernel, BwdKernel:
// Launcher::Impl the generic kernel, Launcher::ImplOf<v> the fixed kernel of modifier variant v, Launcher::builds(v)
// whether the instance has it): f(KernelTag<K>{}) with K the fixed kernel of the variant `var` among kVars that the
// instance builds, else the generic one. The one place that picks a main kernel by variant.
template <class K>
struct KernelTag {
    using type = K;
};
template <class Launcher, class F, int... kVars>
cudaError_t with_main_kernel(int var, F&& f, std::integer_sequence<int, kVars...>) {
    cudaError_t err = cudaSuccess;
    auto fixed = [&](auto v) {
        constexpr int kVar = decltype(v)::value;
        if constexpr (Launcher::builds(kVar)) {
            if (var == kVar) {
                err = f(KernelTag<typename Launcher::template ImplOf<kVar>>{});
                return true;
            }
        }
        return false;
    };
    if (!(fixed(std::integral_constant<int, kVars>{}) || ...)) err = f(KernelTag<typename Launcher::Impl>{});
    return err;
}

}  // namespace mhakit::hopper
