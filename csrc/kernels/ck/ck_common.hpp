// What the CK-tile forward and backward instances share: how mhakit's validated parameters become CK-tile's
// (32-bit indices, the mask in CK's left/right window form) and the launch of one CK kernel on a stream.
//
// CK-tile's kernels take their arguments as CK's example host structs (example/ck_tile/01_fmha/fmha_{fwd,bwd}.hpp)
// and build their kernel arguments with that example's *_create_kargs_and_grids helpers; mhakit fills those structs
// from FwdParams/BwdParams (csrc/kernels/common), which csrc/runtime has already validated.
#pragma once

#include <stdint.h>

#include <initializer_list>
#include <limits>

#include "ck_tile/core.hpp"
#include "ck_tile/host/kernel_launch.hpp"
#include "mha_common.h"
#include "runtime/device_api.h"

namespace mhakit::ck {

// CK-tile indexes with 32-bit ints (ck_tile::index_t): every stride and extent handed to it must fit.
inline bool fits_index(std::initializer_list<int64_t> values) {
    for (int64_t v : values)
        if (v < 0 || v > std::numeric_limits<int32_t>::max()) return false;
    return true;
}

// CK-tile builds its mask from a left/right window and a corner (make_generic_attention_mask_from_lr_window), with
// the same (y, x) arithmetic as mhakit's mask.h. mhakit's GENERIC mask carries a raw (y, x); as a top-left window
// that is left = y - 1, right = x - 1, exact when both are >= 1 (a negative side would mean "unbounded" to CK).
struct CkMask {
    int type, left, right;
};

inline bool mask_expressible(int mask_type, int left, int right) {
    return mask_type != MHAKIT_MASK_GENERIC || (left >= 1 && right >= 1);
}

inline CkMask ck_mask(int mask_type, int left, int right) {
    switch (mask_type) {
        case MHAKIT_MASK_NONE: return {MHAKIT_MASK_NONE, -1, -1};
        case MHAKIT_MASK_GENERIC: return {MHAKIT_MASK_TOP_LEFT, left - 1, right - 1};
        default: return {mask_type, left, right};  // top-left / bottom-right: same numbering and meaning as CK's
    }
}

// Launches kernel `Kernel` with CK's grid and arguments on `stream`; returns the launch's error.
template <class Kernel, class ArchTag, class Kargs>
dev::Error launch(const Kargs& kargs, dim3 grids, dev::Stream stream) {
    ck_tile::make_kernel<Kernel::kBlockPerCu, ArchTag>(Kernel{}, grids, Kernel::BlockSize(), 0, kargs)(
        ck_tile::stream_config{stream});
    return dev::last_error();
}

}  // namespace mhakit::ck
