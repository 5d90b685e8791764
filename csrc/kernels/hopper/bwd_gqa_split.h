// mhakit hopper family, backward pass — how many CTAs share a kv group's query heads (the GQA split). Pure host
// arithmetic (no CUDA), so that the CPU tests ask it directly (tests/test_bwd_gqa_split.py).
//
// Unsplit, the main kernel runs one CTA per (key block, kv head, batch), each looping over the group's query heads.
// With GQA / MQA and few kv heads that grid leaves SMs idle (H200, b1 h16 h_k2 s4096 d128: 64 CTAs on 132 SMs, 1.08 ms
// against 0.585 ms for h_k = 16). Split s > 1: s CTAs per (key block, kv head, batch), each taking group / s of the
// query heads (s divides the group), each writing its dK / dV partial sums in fp32 to a workspace slot, which
// reduce_dkv_kernel (fmha_bwd_hopper_aux.hpp) adds in the order of the slots (deterministic, no atomics).
//
// The model (as the decode family's, kernels/decode/split_heuristic.h): the main kernel's CTAs need one SM each
// (240-register consumers), so `sms` CTAs run at a time, in waves; a CTA's time is its query heads x the query tiles
// its key block visits plus a fixed cost (its start, K and V, the epilogue or the partial sums' write and their
// reduction) of kSplitCtaTiles tiles. s is the divisor of the group of least time among those whose grid fits
// kSplitWaves waves, ties going to fewer CTAs (s = 1 keeps today's kernel).
// - Every key block visiting every query tile (no mask, or a mask that cuts no key block short): the call takes
//   waves(s) x (group / s x m_tiles + kSplitCtaTiles). So a grid of a wave or more stays whole (b4 h32 h_k8 s4096:
//   1024 CTAs), b1 h16 h_k2 s4096 (64 CTAs) takes s = 2 (128 CTAs, one wave of four heads each: 258 against 514),
//   b1 h16 h_k1 s = 4.
// - A mask that leaves key blocks fewer tiles (causal: key block n of a square call visits m_tiles - n x BN / BM):
//   CTAs of unequal length, where the SMs that finish short ones start the rest, so the call takes the larger of its
//   longest CTA and its total work over the SMs (a greedy schedule's lower bound; a non-deterministic grid launches
//   key block 0, a causal call's longest, first). d128 (64 x 128 tiles) b1 h16 h_k2 s4096 causal: s = 2 is bound
//   by its longest CTA (4 heads x 64 tiles + 2: 258), s = 4 by the total (about 132), so it takes 4 where the
//   unmasked call takes 2.
//
// The workspace holds the slots of the largest candidate on the largest device (gqa_split_bound: at most
// kSplitWaves x kSplitMaxSms CTAs' partial sums, 34 MB at d128), which bounds the split of every device (the launch
// clamps the device's SM count to kSplitMaxSms): the workspace query reads no device.
#pragma once

namespace mhakit::hopper::bwd {

constexpr int kSplitCtaTiles = 2;  // a CTA's fixed cost, in query tiles (not measured apart, as the decode's)
constexpr int kSplitMaxSms = 132;  // the most SMs of an sm_90a part (H100 SXM, H200, GH200)
constexpr int kSplitWaves = 2;     // a split grid holds at most this many waves of CTAs

// The largest split of `group` (a divisor) whose grid of ctas x s CTAs fits kSplitWaves waves of `sms` CTAs.
inline int gqa_split_cap(long long ctas, int group, int sms) {
    if (ctas < 1 || group < 2 || sms < 1) return 1;
    int cap = 1;
    for (int s = 2; s <= group; ++s)
        if (group % s == 0 && ctas * s <= (long long)kSplitWaves * sms) cap = s;
    return cap;
}

// The split count: ctas = key blocks x kv heads x batch (the unsplit grid), group = query heads per kv head,
// m_tiles = the query tiles of a head that the longest key block visits, sms = the device's multiprocessors (<= 0:
// unknown, no split); blocks = key blocks per (kv head, batch) and visits = the query tiles they visit together
// (0, 0, or blocks x m_tiles: every key block visits m_tiles).
inline int gqa_splits(long long ctas, int group, long long m_tiles, int sms, long long blocks = 0,
                      long long visits = 0) {
    if (m_tiles < 1 || sms < 1) return 1;
    const int slots = sms < kSplitMaxSms ? sms : kSplitMaxSms;
    const int cap = gqa_split_cap(ctas, group, slots);
    const bool uneven = blocks > 0 && visits < blocks * m_tiles;
    int best = 1;
    long long best_cost = 0;
    for (int s = 1; s <= cap; ++s) {
        if (group % s != 0) continue;
        const long long longest = (group / s) * m_tiles + kSplitCtaTiles;
        long long cost = (ctas * s + slots - 1) / slots * longest;
        if (uneven) {  // (ctas / blocks) pairs, each s CTAs per key block: group x visits + s x blocks fixed costs
            const long long total = ctas / blocks * (group * visits + s * blocks * kSplitCtaTiles);
            const long long spread = (total + slots - 1) / slots;
            cost = longest > spread ? longest : spread;
        }
        if (s == 1 || cost < best_cost) best = s, best_cost = cost;
    }
    return best;
}

// The most gqa_splits gives these arguments on any device: the workspace's slots.
inline int gqa_split_bound(long long ctas, int group) { return gqa_split_cap(ctas, group, kSplitMaxSms); }

}  // namespace mhakit::hopper::bwd
