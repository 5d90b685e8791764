// mhakit hopper family, backward pass — pieces shared by the three kernels of the backward
// (preprocess, main, dQ convert): the workspace layout and the PTX wrappers for the 1-D bulk copies (TMA engine
// without a tensor map). The mask geometry seen from a key block is the shared one (kernels/common/mask_geometry.h).
#pragma once

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"

#include "kernels/common/mask_geometry.h"

namespace mhakit::hopper::bwd {

// The query tiles (kBlockM rows) that key block n (kBlockN keys, n < the sequence's key blocks) visits, for the main
// kernel's loop over them and the preprocess's zeroing of the dbias tiles no key block writes
// (MaskGeometry::key_block_query_tiles, the rule of both families, with this family's tile as constants).
template <int kBlockM, int kBlockN, class Geometry>
CUTLASS_HOST_DEVICE TileRange key_block_query_tiles(Geometry const& geom, int n) {
    return geom.key_block_query_tiles(n, kBlockM, kBlockN);
}

// ---- workspace ---------------------------------------------------------------------------------------------
//
//   lse2 [b][hq][sq_pad]            LSE * log2(e) (+inf for padding rows and rows whose LSE is -inf)
//   dsum [b][hq][sq_pad]            D = rowsum(dO * O) (0 for padding rows)
//   dq   [b][hq][m_tiles][BM * D]   fp32 dQ accumulator, each query tile in "fragment order" (see the main kernel)
//   sem  [b][hq][m_tiles]           int32 turn counter of each dQ tile (deterministic mode: how many key blocks have
//                                   added their part of the tile; zeroed by the preprocess kernel)
//   dkv  [splits][b][hk][key blocks][BN * (D + Dv)]
//                                   the GQA split's fp32 dK / dV partial sums (dkv_slot; absent unsplit): written
//                                   whole by the main kernel's split CTAs, read by reduce_dkv_kernel
// with sq_pad = m_tiles * BM. Every region starts on a 256-byte boundary. dkv_floats: the last region's floats
// (BwdKernel::layout: the slots of the largest split the call may take, bwd_gqa_split.h).
struct WorkspaceLayout {
    size_t lse_off, dsum_off, dq_off, sem_off, dkv_off, total;
    int64_t sq_pad;

    CUTLASS_HOST_DEVICE static size_t align256(size_t v) { return (v + 255) & ~size_t(255); }

    CUTLASS_HOST_DEVICE WorkspaceLayout(int batch, int nhead_q, int seqlen_q, int block_m, int hdim_bucket,
                                        size_t dkv_floats = 0) {
        const int64_t m_tiles = (int64_t(seqlen_q) + block_m - 1) / block_m;
        sq_pad = m_tiles * block_m;
        const size_t rows = size_t(batch) * size_t(nhead_q) * size_t(sq_pad);
        lse_off = 0;
        dsum_off = align256(lse_off + rows * sizeof(float));
        dq_off = align256(dsum_off + rows * sizeof(float));
        sem_off = align256(dq_off + rows * size_t(hdim_bucket) * sizeof(float));
        dkv_off = align256(sem_off + size_t(batch) * size_t(nhead_q) * size_t(m_tiles) * sizeof(int32_t));
        total = align256(dkv_off + dkv_floats * sizeof(float));
    }
};

// The GQA split's dK / dV slot of split sp's CTA of (key block n, kv head hk, batch b): kSlotFloats = BN * (D + Dv)
// floats, dK's fragments then dV's, each thread's float4 v at v * 256 + thread (the main kernel's store_partial,
// reduce_dkv_kernel's reads).
template <int kSlotFloats>
CUTLASS_HOST_DEVICE float* dkv_slot(float* base, int sp, int b, int hk, int n, int batch, int nhead_k, int key_blocks) {
    return base + (((int64_t(sp) * batch + b) * nhead_k + hk) * key_blocks + n) * int64_t(kSlotFloats);
}

// The split kernels' parameters beyond the plain ones (the main kernel's Params derives from BwdSplitParams<kSplit>;
// empty unsplit, so the unsplit kernels keep their parameter block).
template <bool kSplit>
struct BwdSplitParams {};
template <>
struct BwdSplitParams<true> {
    int splits;       // CTAs per (key block, kv head, batch): the grid's heads are nhead_k x splits
    int split_heads;  // query heads per CTA: group / splits
    float* dkv_part;  // the workspace's dkv region (dkv_slot)
};

// ---- PTX: 1-D bulk copies ----------------------------------------------------------------------------------

// global -> shared, completion reported to an mbarrier as transaction bytes. bytes % 16 == 0, both 16B aligned.
CUTLASS_DEVICE void bulk_load(void* smem_dst, void const* gmem_src, uint32_t bytes, uint64_t* mbar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const uint32_t s = cute::cast_smem_ptr_to_uint(smem_dst);
    const uint32_t b = cute::cast_smem_ptr_to_uint(mbar);
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 :
                 : "r"(s), "l"(gmem_src), "r"(bytes), "r"(b)
                 : "memory");
#endif
}

// shared -> global fp32 add-reduction (one bulk-group operation).
CUTLASS_DEVICE void bulk_reduce_add_f32(float* gmem_dst, void const* smem_src, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const uint32_t s = cute::cast_smem_ptr_to_uint(smem_src);
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                 :
                 : "l"(gmem_dst), "r"(s), "r"(bytes)
                 : "memory");
#endif
}

CUTLASS_DEVICE void bulk_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#endif
}

template <int N>
CUTLASS_DEVICE void bulk_wait_read() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
#endif
}

template <int N>
CUTLASS_DEVICE void bulk_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// ---- PTX: fp32 vector add into global memory -----------------------------------------------------------------
//
// dst[0..3] += v (relaxed, gpu scope), 16-byte aligned; the query split's dQ adds. Written as `red`, not as
// atomicAdd(float4*): atomicAdd is an `atom` whose result the compiler drops, and ptxas turns such an atom into a
// fire-and-forget REDG only when no fence can follow it in the kernel. Since the deterministic mode's __threadfence
// after the adds (a run-time branch, so reachable in every mode) it kept ATOMG, an atomic that L2 answers, for the
// 16 vectors per thread and tile at head dim 256: the one change in the d256 main loop's memory traffic between the
// fast backward of be56bb4 and the 8-19 % slower one since fc7846d. An explicit `red` stays REDG with or without
// the fence (the same memory semantics: the fence orders it all the same).
CUTLASS_DEVICE void red_add_f32x4(float* dst, float4 v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("red.relaxed.gpu.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n"
                 :
                 : "l"(dst), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w)
                 : "memory");
#endif
}

// ---- PTX: the turn counters of deterministic dQ accumulation ----------------------------------------------
//
// A CTA waits until a dQ tile's counter says it is its turn (acquire: the earlier adders' writes are visible), adds
// its part, waits for its own adds to complete, and passes the turn on (release). The order of turns is fixed by the
// kernel, so every run adds the same fp32 values in the same order.

CUTLASS_DEVICE void turn_wait(int32_t const* counter, int32_t turn) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    int32_t v;
    do {
        asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(counter) : "memory");
    } while (v != turn);
#endif
}

CUTLASS_DEVICE void turn_pass(int32_t* counter) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(counter) : "memory");
#endif
}

}  // namespace mhakit::hopper::bwd
