// Block order: which (tile, head, batch) a CTA works on. Every kernel of every family asks its scheduler instead of
// reading blockIdx, so that a persistent scheduler (a fixed grid of CTAs pulling work tiles) replaces this one
// without touching the kernels' bodies.
//
// Today: one work tile per CTA. `block` is the tile index along the dimension the kernel walks blocks of (query
// blocks in the forward and the dQ pass, key blocks in the backward's main pass); kHeaviestFirst reverses it, so
// that the blocks with the most work (the last query blocks of a causal mask) start first and the grid's tail is
// short. kBatchInY puts the batch on grid.y and the head on grid.z (the Hopper forward's order), else the reverse.
// work(reverse) chooses the order at run time (the Hopper backward reverses its key blocks in deterministic mode,
// where a CTA waits only for CTAs of higher key blocks: reversed, those have lower block indices and so were
// dispatched earlier, which is what keeps the waits free of deadlock). work_interleaved is that reversed order on a
// 1-D grid with the (head, batch) pairs taken a few at a time and their blocks interleaved (see there).
#pragma once

#include <cuda_runtime.h>

namespace mhakit {

// A work tile: query (or key) block, head, batch; what every scheduler hands a CTA.
struct WorkTile {
    int block, head, batch;
};

#if defined(__CUDACC__)
// Tile t of the heaviest-first interleaved order over blocks x pairs tiles (pairs: heads x batch, head fastest): the
// pairs go `group` at a time, and within a group tile after tile takes block blocks - 1 of each pair, then block
// blocks - 2 of each, .. The last group is what is left (smaller than `group`), or with `last_absorbs` the remainder
// joins the group before it, so that no group, the last included, is smaller than `group` (the forward's one-tile grid:
// the heaviest blocks of the grid's last pairs then start a group's worth of tiles before the end, not in the last
// few). Shared by SingleTileScheduler::work_interleaved (t: the CTA) and DynamicPersistentScheduler::decode (t: the
// fetched tile, a group: an L2 section).
__device__ __forceinline__ WorkTile interleaved_tile(int t, int blocks, int heads, int pairs, int group,
                                                     bool last_absorbs = false) {
    int g = t / (group * blocks);
    const int groups = pairs / group;
    const bool last = last_absorbs && groups > 0 && g >= groups - 1;
    if (last) g = groups - 1;
    const int first = g * group;
    const int size = last || pairs - first < group ? pairs - first : group;
    const int i = t - first * blocks;
    const int pair = first + i % size;
    WorkTile w;
    w.block = blocks - 1 - i / size;
    w.head = pair % heads;
    w.batch = pair / heads;
    return w;
}
#endif

template <bool kHeaviestFirst, bool kBatchInY = false>
struct SingleTileScheduler {
    using Work = WorkTile;

    static dim3 grid(int blocks, int heads, int batch) {
        return kBatchInY ? dim3(blocks, batch, heads) : dim3(blocks, heads, batch);
    }

#if defined(__CUDACC__)
    __device__ __forceinline__ static Work work(bool reverse = kHeaviestFirst) {
        Work w;
        w.block = reverse ? int(gridDim.x - 1 - blockIdx.x) : int(blockIdx.x);
        w.head = kBatchInY ? int(blockIdx.z) : int(blockIdx.y);
        w.batch = kBatchInY ? int(blockIdx.y) : int(blockIdx.z);
        return w;
    }
    // The reversed order on a 1-D grid of blocks x pairs CTAs (pairs: heads x batch, head fastest): the pairs go `group`
    // at a time (the last group may be smaller), and within a group the CTAs in launch order take block blocks - 1 of
    // each pair, then block blocks - 2 of each, .. So a pair's blocks still launch in reverse (each one after the
    // block above it, as work(true) has it), but `group` pairs' chains take turns: where CTAs of one pair would start
    // side by side as others finish, here CTAs of different pairs do. One division by run-time values per CTA.
    static dim3 grid_interleaved(int blocks, int heads, int batch) { return dim3(unsigned(blocks) * heads * batch); }
    __device__ __forceinline__ static Work work_interleaved(int blocks, int heads, int group) {
        return interleaved_tile(int(blockIdx.x), blocks, heads, int(gridDim.x) / blocks, group);
    }
    // work(reverse).block again, for a kernel that would rather recompute it at each use than hold it in a register
    // for the CTA's life: %ctaid.x through a volatile move, which the compiler neither merges with other reads nor
    // keeps live between them.
    __device__ __forceinline__ static int block_now(bool reverse = kHeaviestFirst) {
#if defined(__CUDA_ARCH__)
        unsigned x;
        asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(x));
#else
        const unsigned x = blockIdx.x;
#endif
        return reverse ? int(gridDim.x - 1 - x) : int(x);
    }
#endif
};

// A persistent grid with a dynamic tile counter: grid = min(tiles, resident CTAs), CTA i starts on tile i and takes
// each next tile from an atomic add on a counter word in the caller's workspace, so that the hardware's speed spread
// and unequal causal tiles are balanced as the one-tile grid's dispatch balances them, while a CTA's prologue (its
// pipelines, barriers, descriptor prefetch) is paid once and the next tile's K / V loads run under the current tile's
// epilogue. Without a counter (counter == nullptr: no workspace) the grid is one CTA per tile and fetch() ends each
// CTA after its first tile: the same kernel, the one-tile order.
//
// Tile order (decode): the (head, batch) pairs, head fastest (so the query heads that share a K/V head under GQA sit
// together), go `section` at a time (sized on the host so that a section's K and V fit in a share of L2; the last
// section may be smaller). Within a section, heaviest_first (causal and window masks: the last query block does the
// most work) takes block blocks - 1 of every pair, then blocks - 2, .. (interleaved_tile): longest-processing-time
// first, so the light tiles fill the tail; otherwise a pair's blocks run in order, one pair after another.
//
// The counter: a 64-bit word in the caller's workspace, (epoch << 32) | tiles handed out, where the epoch is the
// call's (FwdParams::counter_epoch: a nonzero number the runtime gives every call). A fetch that finds another
// epoch in the word (0 after the previous launch, an older launch's leftover, or whatever a fresh or reused
// workspace held) claims the word for this launch as its first fetch, so the caller never zeroes it and the
// workspace may double as other scratch between calls. Every launch fetches exactly `total` times (total - grid
// tiles handed out plus one failing fetch per CTA); the fetch that returns total - 1 is the launch's last and puts
// the word back to 0, so that a CUDA graph's replays (which reuse the captured epoch) start from a word of another
// epoch too. What the caller must not do: let two launches that can run at the same time share the word (one
// workspace per stream). A garbage word holding this very epoch (one chance in 2^32) would skip tiles.
struct DynamicPersistentScheduler {
    using Work = WorkTile;
    struct Params {
        int blocks;   // query blocks per (head, batch) pair
        int heads;    // query heads
        int pairs;    // heads x batch
        int section;  // pairs per section (>= 1)
        int total;    // blocks x pairs: the work tiles
        bool heaviest_first;
        unsigned long long* counter;  // the caller's workspace (nullptr: one CTA per tile)
        unsigned epoch;               // this launch's nonzero tag of the counter word
    };

    static Params params(int blocks, int heads, int batch, int section, bool heaviest_first,
                         unsigned long long* counter, unsigned epoch) {
        Params p;
        p.blocks = blocks;
        p.heads = heads;
        p.pairs = heads * batch;
        p.section = section < 1 ? 1 : section > p.pairs ? p.pairs : section;
        p.total = blocks * p.pairs;
        p.heaviest_first = heaviest_first;
        p.counter = counter;
        p.epoch = epoch;
        return p;
    }
    // ctas: how many CTAs of the kernel are resident at once (SMs x CTAs per SM).
    static dim3 grid(Params const& p, int ctas) {
        return dim3(unsigned(p.counter != nullptr && ctas < p.total ? ctas : p.total));
    }

#if defined(__CUDACC__)
    __device__ __forceinline__ static int first() { return int(blockIdx.x); }
    // kLastAbsorbs: the last section takes the remainder (a one-tile grid's balance, interleaved_tile).
    template <bool kLastAbsorbs = false>
    __device__ __forceinline__ static Work decode(Params const& p, int t) {
        if (p.heaviest_first) return interleaved_tile(t, p.blocks, p.heads, p.pairs, p.section, kLastAbsorbs);
        const int pair = t / p.blocks;  // in order: sections change nothing
        Work w;
        w.block = t % p.blocks;
        w.head = pair % p.heads;
        w.batch = pair / p.heads;
        return w;
    }
    // The next tile of this CTA (>= total: none), by one thread.
    __device__ __forceinline__ static int fetch(Params const& p) {
        if (p.counter == nullptr) return p.total;
        const unsigned long long tag = static_cast<unsigned long long>(p.epoch) << 32;
        unsigned long long old = atomicAdd(p.counter, 1ull);
        if ((old >> 32) != p.epoch) {
            // Not this launch's word yet: claim it as ticket 0, unless another CTA did meanwhile (then its tag is
            // there and the next add is ours); a CAS that loses to another CTA's add on the old word retries.
            unsigned long long cur = old + 1;
            for (;;) {
                const unsigned long long seen = atomicCAS(p.counter, cur, tag | 1ull);
                if (seen == cur) {
                    old = tag;
                    break;
                }
                if ((seen >> 32) == p.epoch) {
                    old = atomicAdd(p.counter, 1ull);
                    break;
                }
                cur = seen;
            }
        }
        const int v = static_cast<int>(static_cast<unsigned>(old));
        if (v == p.total - 1) atomicExch(p.counter, 0ull);  // the launch's last fetch: another epoch for the next
        return v + int(gridDim.x);
    }
#endif
};

}  // namespace mhakit
