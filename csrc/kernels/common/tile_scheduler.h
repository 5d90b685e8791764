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
// dispatched earlier, which is what keeps the waits free of deadlock).
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
