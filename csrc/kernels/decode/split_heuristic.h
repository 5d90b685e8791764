// mhakit decode family — how many parts to cut each (batch, kv head)'s keys into when the caller leaves it to us
// (num_splits = 0). Pure host arithmetic over the GPU's SM count (read by the runtime, cached per device).
//
// Without splitting the grid has `ctas` CTAs, each walking `key_blocks` key blocks, in waves of the GPU's CTA slots
// (SMs x CTAs resident per SM); a wave that is only partly full leaves its idle slots' share of the memory bandwidth
// unused (the kernel is bound by the bytes it keeps in flight, so a third of the slots reads about a third of the
// bandwidth). When the unsplit grid already keeps its waves 85 % busy, splitting only adds the combine pass. Otherwise
// the split count is the smallest one whose waves are nearly as busy as the best count's, among the counts that leave
// no part empty (parts of equal size), never more parts than key blocks or MHAKIT_MAX_SPLITS. The 85 % rule replaced
// "never split a grid of 80 % of a wave or more", which left grids of 1-3 waves unsplit: on the H200 (b=64, 32/8,
// s_k=4096, bf16 d128: 512 CTAs in 396 slots, 1.3 waves) one split read 3.35 TB/s and three splits 3.84.
#pragma once

#include "../../include/mha_common.h"
#include "../common/splitkv_params.h"

namespace mhakit::decode {

inline int choose_num_splits(long long ctas, int key_blocks, int num_sms, int ctas_per_sm) {
    if (ctas <= 0 || key_blocks <= 1 || num_sms <= 0) return 1;
    const long long slots = (long long)num_sms * (ctas_per_sm > 0 ? ctas_per_sm : 1);
    const int cap = key_blocks < MHAKIT_MAX_SPLITS ? key_blocks : MHAKIT_MAX_SPLITS;
    // s parts of ceil(key_blocks / s) blocks each leave the last ones empty unless s is "even": the count the kernel
    // really runs is key_blocks over that part size, rounded up.
    auto even = [&](int s) {
        const int per = (key_blocks + s - 1) / s;
        return (key_blocks + per - 1) / per;
    };
    auto efficiency = [&](int s) {
        const double waves = double(ctas * s) / double(slots);
        const double whole = double((ctas * s + slots - 1) / slots);
        return waves / whole;
    };
    if (efficiency(1) >= 0.85) return 1;
    double best = 0.0;
    for (int s = 1; s <= cap; ++s)
        if (efficiency(even(s)) > best) best = efficiency(even(s));
    for (int s = 1; s <= cap; ++s)
        if (efficiency(even(s)) >= 0.9 * best) return even(s);
    return even(cap);
}

// The split count of a call whose kernel runs `ctas` CTAs of smem_bytes each over blocks of block_n keys, on a GPU
// of p.num_sms SMs with smem_per_sm bytes of shared memory each (1 KB of it reserved per CTA).
inline int heuristic_splits(const SplitkvParams& p, long long ctas, int block_n, int smem_bytes, int smem_per_sm) {
    const int per_sm = smem_per_sm / (smem_bytes + 1024);
    const long long keys = (long long)p.max_seqlen_k + p.seqlen_new;
    const int key_blocks = int((keys + block_n - 1) / block_n);
    return choose_num_splits(ctas, key_blocks, p.num_sms, per_sm > 0 ? per_sm : 1);
}

}  // namespace mhakit::decode
