"""The Hopper backward's choice of main kernel per call (csrc/kernels/hopper: bwd_mod_variant in
fmha_bwd_hopper_kernel.hpp, BwdKernel::builds in fmha_bwd_hopper.cuh): over a grid of modifier sets, the variant is
the generic kernel exactly where the call needs what only it does (dropout, dbias, an elementwise bias that is not
staged), else kFixed with the call's soft-cap / ALiBi / staged-bias flags (a sink alone: no flag); and each "_mods"
instance of the default profile's kinds builds the fixed variants it should (none for a sink alone, which the plain
instances serve; a staged bias only with a bias ring, so not at d256; with a soft-cap only at d64), so that a call
maps to a kernel that exists. Host code compiled by nvcc
(the headers include CuTe and CUTLASS), run on the CPU."""
from __future__ import annotations

import pytest

from host_check import run_host_check

ARCH = "sm_90a"

PROGRAM = r"""
#include <cstdio>
#include "kernels/hopper/fmha_bwd_hopper.cuh"

using namespace mhakit;
using namespace mhakit::hopper;

alignas(16) static unsigned short bias_data[64];

int expected(float cap, int bias_type, bool fp32, bool aligned, bool dropout, bool dbias) {
    if (dropout || dbias) return BwdModVar::kGeneric;
    if (bias_type == 1 && (fp32 || !aligned)) return BwdModVar::kGeneric;
    return BwdModVar::kFixed | (cap > 0.f ? BwdModVar::kCap : 0) | (bias_type == 2 ? BwdModVar::kAlibi : 0) |
           (bias_type == 1 ? BwdModVar::kBias : 0);
}

void check_choice() {
    for (float cap : {0.f, 30.f})
        for (int bias_type : {0, 1, 2})
            for (bool fp32 : {false, true})
                for (bool aligned : {false, true})
                    for (bool dropout : {false, true})
                        for (bool dbias : {false, true})
                            for (bool sink : {false, true}) {
                                ScoreMods m{};
                                m.softcap = cap;
                                m.bias_type = bias_type;
                                m.bias_fp32 = bias_type == 2 || (bias_type == 1 && fp32);
                                m.bias = bias_type != 0 ? static_cast<const void*>(bias_data) : nullptr;
                                m.bias_row_stride = aligned ? 64 : 63;  // elements: 128 bytes, or rows unaligned
                                m.bias_head_stride = 0;
                                m.bias_batch_stride = 0;
                                m.sink = sink ? reinterpret_cast<const float*>(bias_data) : nullptr;
                                m.dropout.on = dropout;
                                const int got = bwd_mod_variant(m, dbias);
                                const int want = expected(cap, bias_type, m.bias_fp32, aligned, dropout, dbias);
                                EXPECT(got == want, "cap %g bias %d fp32 %d aligned %d dropout %d dbias %d sink %d: "
                                       "%d, want %d", cap, bias_type, int(m.bias_fp32), int(aligned), int(dropout),
                                       int(dbias), int(sink), got, want);
                            }
}

// builds(): every flag set but a staged bias always; a staged bias where the instance has a bias ring, with a
// soft-cap only at d64; no flag (a sink alone: the plain instances' calls) never; the plain instances none.
template <int kHdim, bool kGroup, bool kMasked, int kBlockN>
void check_builds() {
    using K = BwdKernel<MHAKIT_DTYPE_BF16, kHdim, kHdim, kGroup, kMasked, 64, kBlockN, true>;
    using P = BwdKernel<MHAKIT_DTYPE_BF16, kHdim, kHdim, kGroup, kMasked, 64, kBlockN, false>;
    const bool ring = K::Impl::kBiasStages > 0;
    EXPECT(ring == (kHdim != 256), "d%d: bias ring %d", kHdim, int(ring));
    for (int var = 1; var < 16; var += 2) {
        const bool staged = (var & BwdModVar::kBias) != 0, capped = (var & BwdModVar::kCap) != 0;
        if ((var & BwdModVar::kAlibi) && staged) continue;  // one bias kind per call
        const bool want = var == BwdModVar::kFixed ? false : staged ? ring && (!capped || kHdim == 64) : true;
        EXPECT(K::builds(var) == want, "d%d group %d masked %d: builds(%d) = %d", kHdim, int(kGroup), int(kMasked), var,
               int(K::builds(var)));
        EXPECT(!P::builds(var), "plain d%d builds(%d)", kHdim, var);
    }
}

int main() {
    check_choice();
    check_builds<64, false, true, 128>();
    check_builds<64, true, false, 128>();
    check_builds<128, false, true, 128>();
    check_builds<128, true, true, 128>();
    check_builds<128, false, false, 128>();
    check_builds<256, false, true, 64>();
    check_builds<256, true, true, 64>();
    std::printf("checked %d failures %d\n", checked, failures);
    return failures != 0;
}
"""


@pytest.mark.compile
def test_variant_choice_and_the_variants_built(tmp_path):
    run_host_check(tmp_path, "bwd_mod_variant", PROGRAM, ARCH)
