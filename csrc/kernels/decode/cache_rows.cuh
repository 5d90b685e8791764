// mhakit decode family — where the rows of a KV cache live: one (batch, kv head)'s view of the K or V cache, either
// contiguous (row j at base + j·row_stride) or paged (row j in page block_table[j / page_size] at row j % page_size),
// and the packed-GQA row map of the query tile. Shared by the split-KV kernel (reads) and the append kernel (writes).
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "../common/splitkv_params.h"

namespace mhakit::decode::detail {

#if defined(__CUDACC__)

// One (batch, kv head) of a cache tensor. pages == nullptr: contiguous, else the batch's row of the block table.
template <class T>
struct CacheRows {
    T* base;                // contiguous: the batch's row 0 of this head; paged: page 0, row 0 of this head
    int64_t row_stride;     // elements between rows
    int64_t page_stride;    // elements between pages (paged only)
    const int32_t* pages;   // block-table row of this batch, or nullptr
    int page_size;
    int page_shift;         // log2(page_size) when it is a power of two (the usual 16, 64, 256), else -1

    // Paged: the block-table slot of row j, and row j's address once its page is known (the kernel reads the block
    // table one key block ahead, so that the lookup's latency is not paid between a block's loads).
    __device__ __forceinline__ int page_slot(int j) const { return page_shift >= 0 ? j >> page_shift : j / page_size; }
    __device__ __forceinline__ int in_page(int j) const {  // row j's row within its page
        return page_shift >= 0 ? (j & (page_size - 1)) : j - (j / page_size) * page_size;
    }
    __device__ __forceinline__ T* row_in_page(int page, int j) const {
        return base + int64_t(page) * page_stride + int64_t(in_page(j)) * row_stride;
    }

    __device__ __forceinline__ T* row(int j) const {
        if (pages == nullptr) return base + int64_t(j) * row_stride;
        return row_in_page(__ldg(pages + page_slot(j)), j);
    }

    // Rows [n0, n0 + n) with n0 a multiple of n: row n0 + r is at the result + r·row_stride when they lie in one
    // page (a page size that is a multiple of n) or the cache is contiguous; nullptr when they may span pages.
    __device__ __forceinline__ T* run_of_rows(int n0, int n) const {
        if (pages != nullptr && page_size % n != 0) return nullptr;
        return row(n0);
    }
};

// The K (or V: kValues) cache rows of batch b, kv head hk.
template <bool kValues, class T = uint16_t>
__device__ __forceinline__ CacheRows<T> cache_rows(const SplitkvParams& p, int b, int hk) {
    void* cache = kValues ? p.v_cache : p.k_cache;
    const int64_t rs = kValues ? p.v_row_stride : p.k_row_stride;
    const int64_t hs = kValues ? p.v_head_stride : p.k_head_stride;
    const int64_t bs = kValues ? p.v_batch_stride : p.k_batch_stride;
    T* head0 = static_cast<T*>(cache) + hk * hs;
    CacheRows<T> v;
    v.row_stride = rs;
    v.page_stride = bs;
    v.page_size = p.page_block_size;
    v.page_shift = (p.page_block_size > 0 && (p.page_block_size & (p.page_block_size - 1)) == 0)
                       ? __ffs(p.page_block_size) - 1
                       : -1;
    if (p.block_table != nullptr) {
        v.base = head0;
        v.pages = p.block_table + int64_t(b) * p.block_table_batch_stride;
    } else {
        const int cb = p.cache_batch_idx != nullptr ? __ldg(p.cache_batch_idx + b) : b;
        v.base = head0 + int64_t(cb) * bs;
        v.pages = nullptr;
    }
    return v;
}

// Rows filled in batch b's cache before this call (negative values read as 0).
__device__ __forceinline__ int cache_len(const SplitkvParams& p, int b) {
    const int n = __ldg(p.seqlen_k + b);
    return n > 0 ? n : 0;
}

// Packed GQA: row r of a (batch, kv head)'s query tile is query row qi = r / group of query head hk·group + r % group,
// so the group's heads of one query row are adjacent (they share every mask bound).
struct PackedRow {
    int qi, head;
};
__device__ __forceinline__ PackedRow packed_row(int r, int group, int hk) {
    const int qi = r / group;
    return PackedRow{qi, hk * group + (r - qi * group)};
}

#endif  // __CUDACC__

}  // namespace mhakit::decode::detail
