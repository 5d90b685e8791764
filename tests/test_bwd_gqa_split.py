"""The Hopper backward's GQA split (csrc/kernels/hopper/bwd_gqa_split.h: how many CTAs share a kv group's query
heads), compiled with the system C++ compiler and asked about grids of every size: the count divides the group, is 1
without GQA or an SM count, keeps the split grid within kSplitWaves waves, never exceeds the workspace's bound on any
device of up to kSplitMaxSms SMs (nor on a larger one, whose count the rule clamps), and where it splits the call is
no longer in its time model than unsplit; the measured rows get their counts (H200, 132 SMs: b1 h16 h_k2 s4096 d128
splits in 2, h_k1 in 4, b4 h32 h_k8 and MHA stay whole). The compile-marked test checks BwdKernel's use of it with
nvcc (fmha_bwd_hopper.cuh): the workspace grows by the bound's slots only where a call may split, its split count is
the rule's, and an MHA call's workspace is what it was."""
from __future__ import annotations

import subprocess

import pytest

from host_check import build_cpp, run_host_check


PROGRAM = r'''
#include <cstdio>
#include <initializer_list>
#include "kernels/hopper/bwd_gqa_split.h"
using namespace mhakit::hopper::bwd;
int main() {
    for (int sms : {0, 1, 16, 78, 114, 132, 144})
        for (long long ctas : {1LL, 2LL, 8LL, 16LL, 32LL, 33LL, 64LL, 65LL, 100LL, 128LL, 131LL, 132LL, 264LL, 1024LL})
            for (int group : {1, 2, 3, 4, 6, 8, 12, 16, 64})
                for (long long m : {1LL, 2LL, 8LL, 64LL})
                    std::printf("%d %lld %d %lld %d %d\n", sms, ctas, group, m, gqa_splits(ctas, group, m, sms),
                                gqa_split_bound(ctas, group));
    // masks that leave key blocks fewer query tiles: key block n of `blocks` visits m - n * m / blocks (a causal
    // square), or m - (n % 2) * (m / 2) (a band: every other block half the tiles)
    for (int sms : {0, 16, 78, 132, 144})
        for (long long pairs : {1LL, 2LL, 3LL, 8LL})
            for (long long blocks : {1LL, 8LL, 16LL, 32LL, 33LL, 64LL})
                for (int group : {1, 2, 4, 6, 8, 16})
                    for (long long m : {2LL, 16LL, 64LL})
                        for (int shape = 0; shape < 2; ++shape) {
                            long long visits = 0, longest = 0;
                            for (long long n = 0; n < blocks; ++n) {
                                const long long t = shape == 0 ? m - n * m / blocks : m - (n % 2) * (m / 2);
                                visits += t, longest = t > longest ? t : longest;
                            }
                            std::printf("U %d %lld %lld %d %lld %lld %d\n", sms, pairs, blocks, group, longest,
                                        visits, gqa_splits(pairs * blocks, group, longest, sms, blocks, visits));
                        }
    return 0;
}
'''

CTA_TILES, MAX_SMS, WAVES = 2, 132, 2  # bwd_gqa_split.h's constants


def cost(ctas, group, m, s, sms):
    slots = min(sms, MAX_SMS)
    return -(-ctas * s // slots) * (group // s * m + CTA_TILES)


def candidates(ctas, group, sms):
    """The splits the rule may take: divisors of the group whose grid fits the waves (1 always)."""
    return [d for d in range(1, group + 1) if group % d == 0 and (d == 1 or ctas * d <= WAVES * min(sms, MAX_SMS))]


def cost_uneven(pairs, blocks, group, longest, visits, s, sms):
    """Unequal CTAs: the larger of the longest CTA and the total work spread over the SMs."""
    slots = min(sms, MAX_SMS)
    total = pairs * (group * visits + s * blocks * CTA_TILES)
    return max(group // s * longest + CTA_TILES, -(-total // slots))


@pytest.fixture(scope="module")
def program_output(tmp_path_factory):
    exe = build_cpp(tmp_path_factory.mktemp("gqa_split"), "main", PROGRAM)
    return subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.splitlines()


@pytest.fixture(scope="module")
def answers(program_output):
    return {tuple(int(x) for x in line.split()[:4]): tuple(int(x) for x in line.split()[4:])
            for line in program_output if not line.startswith("U ")}


@pytest.fixture(scope="module")
def uneven_answers(program_output):
    return {tuple(int(x) for x in line.split()[1:7]): int(line.split()[7])
            for line in program_output if line.startswith("U ")}


def test_split_divides_the_group_and_stays_within_the_bound(answers):
    for (sms, ctas, group, m), (s, bound) in answers.items():
        assert s >= 1 and group % s == 0, (sms, ctas, group, m, s)
        assert s <= bound, (sms, ctas, group, m, s, bound)
        if s > 1:
            assert ctas * s <= WAVES * min(sms, MAX_SMS), (sms, ctas, group, m, s)
        if group == 1 or sms == 0:
            assert s == 1, (sms, ctas, group, m, s)
        # the bound: the largest divisor whose grid fits the waves of the largest device
        assert bound == max(d for d in range(1, group + 1)
                            if group % d == 0 and (d == 1 or ctas * d <= WAVES * MAX_SMS))


def test_split_is_the_least_time_in_the_model(answers):
    for (sms, ctas, group, m), (s, _) in answers.items():
        if sms == 0:
            continue
        cands = candidates(ctas, group, sms)
        best = min(cost(ctas, group, m, d, sms) for d in cands)
        assert cost(ctas, group, m, s, sms) == best, (sms, ctas, group, m, s)
        assert s == min(d for d in cands if cost(ctas, group, m, d, sms) == best)  # ties: fewer CTAs


def test_uneven_key_blocks_take_the_least_time_of_their_model(uneven_answers):
    """Masked calls whose key blocks visit unequal numbers of query tiles: the split divides the group, fits the
    waves, and is the least (ties: fewer CTAs) of max(longest CTA, total work / SMs)."""
    assert len(uneven_answers) > 1000
    for (sms, pairs, blocks, group, longest, visits), s in uneven_answers.items():
        ctas = pairs * blocks
        assert s >= 1 and group % s == 0, (sms, pairs, blocks, group, s)
        if sms == 0 or group == 1:
            assert s == 1
            continue
        cands = candidates(ctas, group, sms)
        if visits == blocks * longest:  # every block visits the same tiles: the wave model
            costs = {d: cost(ctas, group, longest, d, sms) for d in cands}
        else:
            costs = {d: cost_uneven(pairs, blocks, group, longest, visits, d, sms) for d in cands}
        best = min(costs.values())
        assert s == min(d for d in cands if costs[d] == best), (sms, pairs, blocks, group, longest, visits, s, costs)


def test_causal_rows_split_further(uneven_answers):
    # d128 (64 x 128 tiles) at s = 4096 causal: key block n of 32 visits 64 - 2n of the 64 query tiles (1056
    # together); b1 h16 h_k2 takes 4 where the unmasked call takes 2, h_k1 8 where it takes 4 (bwd_gqa_split.h)
    assert uneven_answers[(132, 2, 32, 8, 64, 1056)] == 4
    assert uneven_answers[(132, 1, 32, 16, 64, 1056)] == 8
    assert uneven_answers[(132, 8, 32, 4, 64, 1056)] == 1  # b1 h32 h_k8: 256 CTAs, already two waves


def test_measured_rows(answers):
    # H200 (132 SMs), d128 b64x128 (32 key blocks at s_k = 4096, 64 query tiles): b1 h16 h_k2 -> 2, h_k1 -> 4,
    # h_k4 (128 CTAs: one wave already) and MHA -> 1, b4 h32 h_k8 (1024 CTAs) -> 1
    assert answers[(132, 64, 8, 64)][0] == 2
    assert answers[(132, 32, 16, 64)][0] == 4
    assert answers[(132, 128, 4, 64)][0] == 1
    assert answers[(132, 1024, 4, 64)][0] == 1
    assert answers[(132, 32, 1, 64)][0] == 1
    # a larger device is clamped to the bound's 132 SMs
    assert answers[(144, 64, 8, 64)][0] == answers[(132, 64, 8, 64)][0]


HOST_PROGRAM = r"""
#include <cstdio>
#include "kernels/hopper/fmha_bwd_hopper.cuh"

using namespace mhakit;
using namespace mhakit::hopper;

template <class K>
void check_causal(int b, int hq, int hk, int s, int sms, int want_splits) {
    BwdParams p{};
    p.batch = b, p.nhead_q = hq, p.nhead_k = hk, p.hdim_q = K::Impl::kHdim, p.hdim_v = K::Impl::kHdimV;
    p.seqlen_q = p.max_seqlen_q = p.seqlen_k = p.max_seqlen_k = s, p.num_sms = sms;
    p.mask_type = 1, p.window_left = -1, p.window_right = 0;  // causal, top-left
    EXPECT(K::splits(p) == want_splits, "causal b%d h%d/%d s%d: splits %d, want %d", b, hq, hk, s, K::splits(p),
           want_splits);
    EXPECT(K::splits(p) <= K::split_bound(p), "causal b%d h%d/%d: splits above the bound", b, hq, hk);
}

template <class K>
void check(int b, int hq, int hk, int sq, int sk, int sms, int want_splits) {
    BwdParams p{};
    p.batch = b, p.nhead_q = hq, p.nhead_k = hk, p.hdim_q = K::Impl::kHdim, p.hdim_v = K::Impl::kHdimV;
    p.seqlen_q = p.max_seqlen_q = sq, p.seqlen_k = p.max_seqlen_k = sk, p.num_sms = sms;
    const int blocks = (sk + K::Impl::kBlockN - 1) / K::Impl::kBlockN;
    const int m_tiles = (sq + K::Impl::kBlockM - 1) / K::Impl::kBlockM;
    const long long ctas = (long long)blocks * hk * b;
    const int s = K::splits(p), bound = K::split_bound(p);
    EXPECT(s == bwd::gqa_splits(ctas, hq / hk, m_tiles, sms), "b%d h%d/%d s%d/%d: splits %d", b, hq, hk, sq, sk, s);
    if (want_splits > 0) EXPECT(s == want_splits, "b%d h%d/%d s%d/%d: splits %d, want %d", b, hq, hk, sq, sk, s,
                                want_splits);
    EXPECT(s <= bound, "b%d h%d/%d: splits %d > bound %d", b, hq, hk, s, bound);
    const bwd::WorkspaceLayout plain(b, hq, sq, K::Impl::kBlockM, K::Impl::kHdim);
    const size_t slots = bound > 1 ? size_t(bound) * ctas * K::Impl::kSlotFloats * 4 : 0;
    EXPECT(K::workspace_bytes(p) == bwd::WorkspaceLayout::align256(plain.total + slots),
           "b%d h%d/%d s%d/%d: workspace %zu, unsplit %zu + slots %zu", b, hq, hk, sq, sk, K::workspace_bytes(p),
           plain.total, slots);
    EXPECT(K::layout(p).dkv_off == plain.total && K::layout(p).dkv_off + slots <= K::workspace_bytes(p),
           "b%d h%d/%d: slots outside the workspace", b, hq, hk);
    if (hq == hk) EXPECT(K::workspace_bytes(p) == plain.total, "MHA b%d h%d: workspace changed", b, hq);
}

int main() {
    using D128 = BwdKernel<MHAKIT_DTYPE_BF16, 128, 128, false, true, 64, 128, false>;
    using D128m = BwdKernel<MHAKIT_DTYPE_BF16, 128, 128, false, true, 64, 128, true>;
    using D256 = BwdKernel<MHAKIT_DTYPE_BF16, 256, 256, false, true, 64, 64, false>;
    using D192 = BwdKernel<MHAKIT_DTYPE_BF16, 192, 128, false, true, 64, 96, false>;
    check<D128>(1, 16, 2, 4096, 4096, 132, 2);
    check<D128>(1, 16, 1, 4096, 4096, 132, 4);
    check<D128>(1, 16, 4, 4096, 4096, 132, 1);
    check<D128>(1, 16, 16, 4096, 4096, 132, 1);
    check<D128>(4, 32, 8, 4096, 4096, 132, 1);
    check<D128>(1, 16, 2, 4096, 4096, 0, 1);  // no SM count: unsplit
    check<D128m>(1, 8, 1, 300, 333, 132, 8);
    check<D256>(1, 16, 1, 4096, 4096, 132, 2);
    check<D256>(1, 16, 2, 4096, 4096, 132, 1);
    check<D192>(1, 8, 1, 1000, 1000, 132, 8);
    check<D192>(2, 12, 3, 777, 1500, 114, 0);
    check_causal<D128>(1, 16, 2, 4096, 132, 4);  // unmasked: 2
    check_causal<D128>(1, 16, 1, 4096, 132, 8);  // unmasked: 4
    check_causal<D128>(4, 32, 8, 4096, 132, 1);  // 1024 CTAs
    check_causal<D128m>(1, 16, 2, 4096, 0, 1);   // no SM count
    std::printf("checked %d failures %d\n", checked, failures);
    return failures != 0;
}
"""


@pytest.mark.compile
def test_backward_kernel_uses_the_split_rule(tmp_path):
    run_host_check(tmp_path, "bwd_gqa_split", HOST_PROGRAM, "sm_90a")
