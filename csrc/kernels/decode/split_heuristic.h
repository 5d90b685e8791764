// mhakit decode family — how many parts to cut each (batch, kv head)'s keys into when the caller leaves it to us
// (num_splits = 0). Pure host arithmetic over the GPU's SM count (read by the runtime, cached per device).
//
// Without splitting the grid has `ctas` CTAs, each walking `key_blocks` key blocks, in waves of the GPU's CTA slots
// (SMs x CTAs resident per SM). When the unsplit grid already keeps its waves 85 % busy, splitting only adds the
// combine pass (the rule before this one kept that threshold). Otherwise the split count s is the one of the
// least time in this model: the CTAs of a wave run side by side, each bound by the latency of the bytes it keeps in
// flight, so a wave takes as long as its longest part, and the call waves(s) x (blocks per part + a fixed cost per
// CTA: its start, the ring's fill and drain, the partial results, about kCtaBlocks blocks' time); ties go to fewer
// parts. Only counts that leave no part empty are tried (parts of ceil(key_blocks / s) blocks), never more parts
// than key blocks or MHAKIT_MAX_SPLITS. The wave width is the kernel's: CTAs per SM by shared memory for the generic
// kernel, one for the TMA-ring kernels (kTmaRingCtasPerSm below, with its measurements). Measured on the H200 with
// the generic kernel (bf16 d128, three CTAs per SM): b=64 32/8 s_k=4096 (512 CTAs in 396 slots, 1.3 waves) read
// 3.35 TB/s unsplit, 3.84 with three splits, which the model picks (4 waves of 22 + 2 against 2 of 64 + 2).
#pragma once

#include "../../include/mha_common.h"
#include "../common/splitkv_params.h"

namespace mhakit::decode {

constexpr int kCtaBlocks = 2;  // the fixed cost of a CTA, in key blocks (the model above; not measured apart)

inline int choose_num_splits(long long ctas, int key_blocks, int num_sms, int ctas_per_sm) {
    if (ctas <= 0 || key_blocks <= 1 || num_sms <= 0) return 1;
    const long long slots = (long long)num_sms * (ctas_per_sm > 0 ? ctas_per_sm : 1);
    const long long waves1 = (ctas + slots - 1) / slots;
    if (double(ctas) / double(waves1 * slots) >= 0.85) return 1;
    const int cap = key_blocks < MHAKIT_MAX_SPLITS ? key_blocks : MHAKIT_MAX_SPLITS;
    int best = 1;
    long long best_cost = waves1 * (key_blocks + kCtaBlocks);
    for (int s = 2; s <= cap; ++s) {
        const int per = (key_blocks + s - 1) / s;
        if ((key_blocks + per - 1) / per != s) continue;  // the last parts would be empty
        const long long cost = (ctas * s + slots - 1) / slots * (per + kCtaBlocks);
        if (cost < best_cost) best = s, best_cost = cost;
    }
    return best;
}

// The split count of a call whose kernel runs `ctas` CTAs over blocks of block_n keys, on a GPU of p.num_sms SMs, in
// waves of ctas_per_sm CTAs per SM.
inline int heuristic_splits(const SplitkvParams& p, long long ctas, int block_n, int ctas_per_sm) {
    const long long keys = (long long)p.max_seqlen_k + p.seqlen_new;
    const int key_blocks = int((keys + block_n - 1) / block_n);
    return choose_num_splits(ctas, key_blocks, p.num_sms, ctas_per_sm > 0 ? ctas_per_sm : 1);
}

// The CTAs of smem_bytes each that fit on an SM of smem_per_sm bytes (1 KB of it reserved per CTA): the wave width of
// the kernels whose loads are not TMA rings (the generic decode kernel), for which a second resident CTA adds loads in
// flight.
inline int ctas_per_sm_by_smem(int smem_bytes, int smem_per_sm) {
    const int per_sm = smem_per_sm / (smem_bytes + 1024);
    return per_sm > 0 ? per_sm : 1;
}

// The kernels that stream K / V through a TMA ring (decode_tma, its wgmma tiles) count waves at one CTA per SM: one
// CTA's ring already draws the SM's share of the memory bandwidth, so a second resident CTA only adds its fixed cost
// and the combine's partials. Measured on the H200 (bf16 d128, bench/bench_decode.py --num-splits N, TB/s): b=1 32/8
// s_k=32k s_q=1: 16 parts (128 CTAs) 3.22, 32 parts (256 CTAs, two per SM) 3.06; b=16 32/8 s_k=8k s_q=16: unsplit
// (128 CTAs) 3.90, 2 parts 3.46; b=8 64/8 s_k=64k s_q=1: 2 parts 4.45, 4 parts 4.36.
constexpr int kTmaRingCtasPerSm = 1;

}  // namespace mhakit::decode
