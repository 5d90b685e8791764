// Raising a kernel's dynamic shared-memory limit above the default 48 KB, which every family's run() needs.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include <atomic>

namespace mhakit {

// cudaFuncSetAttribute(MaxDynamicSharedMemorySize) holds for the current device only, so it is set once per device:
// `done` (one per kernel, owned by the caller) keeps a bit per device id; two threads racing both set it, which is
// harmless, and devices past id 63 simply set it on every call.
template <class Kernel>
inline cudaError_t opt_in_dynamic_smem(Kernel kernel, int bytes, std::atomic<uint64_t>& done) {
    if (bytes <= 48 * 1024) return cudaSuccess;
    int dev = 0;
    cudaError_t err = cudaGetDevice(&dev);
    if (err != cudaSuccess) return err;
    const uint64_t bit = (dev >= 0 && dev < 64) ? (uint64_t{1} << dev) : 0;
    if (bit != 0 && (done.load(std::memory_order_acquire) & bit) != 0) return cudaSuccess;
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (err != cudaSuccess) return err;
    done.fetch_or(bit, std::memory_order_acq_rel);
    return cudaSuccess;
}

}  // namespace mhakit
