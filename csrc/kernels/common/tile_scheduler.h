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

template <bool kHeaviestFirst, bool kBatchInY = false>
struct SingleTileScheduler {
    struct Work {
        int block, head, batch;
    };

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
        const int pairs = int(gridDim.x) / blocks;
        const int g = int(blockIdx.x) / (group * blocks);
        const int first = g * group;
        const int size = pairs - first < group ? pairs - first : group;
        const int p = int(blockIdx.x) - first * blocks;
        const int pair = first + p % size;
        Work w;
        w.block = blocks - 1 - p / size;
        w.head = pair % heads;
        w.batch = pair / heads;
        return w;
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

}  // namespace mhakit
