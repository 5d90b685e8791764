"""The Hopper forward's choice of main kernel per call (csrc/kernels/hopper: fwd_mod_variant in
fmha_hopper_kernel.hpp, FwdKernel::builds / main_kernel_variant in fmha_fwd_hopper.cuh): over a grid of modifier
sets, the variant is the generic kernel exactly where the call needs what only it does (dropout, an elementwise bias
that is not stageable), else kFixed with the call's soft-cap / ALiBi / staged-bias flags (a sink alone: no flag); each
"_mods" instance builds the soft-cap and the ALiBi variants alone (no plain instance builds any), so a call runs a
fixed kernel exactly when it sets one of those two and nothing else but a sink; the fixed kernels have no bias ring.
alibi_tile_sign (the fixed ALiBi kernel's folded tiles) gives a sign only where |d| keeps it over the whole tile.
Host code compiled by nvcc (the headers include CuTe and CUTLASS), run on the CPU."""
from __future__ import annotations

import pytest

from host_check import run_host_check

ARCH = "sm_90a"

PROGRAM = r"""
#include <cstdio>
#include "kernels/hopper/fmha_fwd_hopper.cuh"

using namespace mhakit;
using namespace mhakit::hopper;

alignas(16) static unsigned short bias_data[64];

int expected(float cap, int bias_type, bool fp32, bool aligned, bool dropout) {
    if (dropout) return FwdModVar::kGeneric;
    if (bias_type == 1 && (fp32 || !aligned)) return FwdModVar::kGeneric;
    return FwdModVar::kFixed | (cap > 0.f ? FwdModVar::kCap : 0) | (bias_type == 2 ? FwdModVar::kAlibi : 0) |
           (bias_type == 1 ? FwdModVar::kBias : 0);
}

// The kernel a call runs: a fixed one exactly for a soft-cap alone or ALiBi alone (a sink beside them allowed).
int launched(float cap, int bias_type, bool dropout) {
    if (dropout) return FwdModVar::kGeneric;
    if (cap > 0.f && bias_type == 0) return FwdModVar::kFixed | FwdModVar::kCap;
    if (cap == 0.f && bias_type == 2) return FwdModVar::kFixed | FwdModVar::kAlibi;
    return FwdModVar::kGeneric;
}

template <int kHdim, bool kGroup, bool kMasked, int kBlockM, int kBlockN>
void check_instance() {
    using K = FwdKernel<MHAKIT_DTYPE_BF16, kHdim, kHdim, kGroup, kMasked, kBlockM, kBlockN, true>;
    using P = FwdKernel<MHAKIT_DTYPE_BF16, kHdim, kHdim, kGroup, kMasked, kBlockM, kBlockN, false>;
    for (int var = 0; var < 16; ++var) {
        const bool want = var == (FwdModVar::kFixed | FwdModVar::kCap) || var == (FwdModVar::kFixed | FwdModVar::kAlibi);
        EXPECT(K::builds(var) == want, "d%d group %d masked %d: builds(%d) = %d", kHdim, int(kGroup), int(kMasked),
               var, int(K::builds(var)));
        EXPECT(!P::builds(var), "plain d%d builds(%d)", kHdim, var);
    }
    using Cap = typename K::template ImplOf<FwdModVar::kFixed | FwdModVar::kCap>;
    using Alibi = typename K::template ImplOf<FwdModVar::kFixed | FwdModVar::kAlibi>;
    EXPECT(Cap::kBiasStages == 0 && Alibi::kBiasStages == 0, "d%d: a fixed variant with a bias ring", kHdim);
    EXPECT((std::is_same_v<typename K::template ImplOf<FwdModVar::kGeneric>, typename K::Impl>),
           "d%d: ImplOf<kGeneric> is not Impl", kHdim);
    for (float cap : {0.f, 30.f})
        for (int bias_type : {0, 1, 2})
            for (bool fp32 : {false, true})
                for (bool aligned : {false, true})
                    for (bool dropout : {false, true})
                        for (bool sink : {false, true}) {
                            FwdParams p{};
                            ScoreMods& m = p.mods;
                            m.softcap = cap;
                            m.bias_type = bias_type;
                            m.bias_fp32 = bias_type == 2 || (bias_type == 1 && fp32);
                            m.bias = bias_type != 0 ? static_cast<const void*>(bias_data) : nullptr;
                            m.bias_row_stride = aligned ? 64 : 63;  // elements: 128 bytes, or rows unaligned
                            m.sink = sink ? reinterpret_cast<const float*>(bias_data) : nullptr;
                            m.dropout.on = dropout;
                            const int got = fwd_mod_variant(m);
                            const int want = expected(cap, bias_type, m.bias_fp32, aligned, dropout);
                            EXPECT(got == want, "cap %g bias %d fp32 %d aligned %d dropout %d sink %d: %d, want %d",
                                   cap, bias_type, int(m.bias_fp32), int(aligned), int(dropout), int(sink), got,
                                   want);
                            const int run = K::main_kernel_variant(p);
                            EXPECT(run == launched(cap, bias_type, dropout),
                                   "d%d: cap %g bias %d dropout %d sink %d runs %d", kHdim, cap, bias_type,
                                   int(dropout), int(sink), run);
                            EXPECT(P::main_kernel_variant(p) == FwdModVar::kGeneric, "plain d%d runs a variant",
                                   kHdim);
                        }
}

// alibi_tile_sign (the folded ALiBi tiles of the fixed ALiBi kernel): +1 only where every distance
// d = i + s_k - s_q - j of the 64 x 128 tile is >= 0, -1 only where every one is <= 0, and so the fold's
// sign * (dist0 - (j - j0)) equals |d| on every score of the tile; 0 where both signs occur.
void check_alibi_sign() {
    for (int sq : {1, 64, 300})
        for (int sk = 1; sk <= 520; ++sk)  // every s_k - s_q of the range: each tile corner's distance passes 0
            for (int row0 = 0; row0 < sq; row0 += 64)
                for (int key0 = 0; key0 < sk; key0 += 128) {
                    const int sign = alibi_tile_sign<64, 128>(sq, sk, row0, key0);
                    bool pos = false, neg = false, fold_ok = true;
                    for (int i = row0; i < row0 + 64; ++i)
                        for (int j = key0; j < key0 + 128; ++j) {
                            const int d = i + sk - sq - j;
                            pos |= d > 0, neg |= d < 0;
                            if (sign != 0 && sign * d != (d < 0 ? -d : d)) fold_ok = false;
                        }
                    EXPECT(fold_ok && (sign != 0 || (pos && neg)),
                           "alibi_tile_sign sq %d sk %d row0 %d key0 %d: %d (d > 0 %d, d < 0 %d)", sq, sk, row0, key0,
                           sign, int(pos), int(neg));
                }
}

int main() {
    check_alibi_sign();
    check_instance<64, false, true, 192, 128>();
    check_instance<128, false, true, 128, 128>();
    check_instance<128, true, true, 128, 128>();
    check_instance<128, false, false, 128, 128>();
    check_instance<256, false, true, 128, 64>();
    std::printf("checked %d failures %d\n", checked, failures);
    return failures != 0;
}
"""


@pytest.mark.compile
def test_variant_choice_and_the_variants_built(tmp_path):
    run_host_check(tmp_path, "fwd_mod_variant", PROGRAM, ARCH)
