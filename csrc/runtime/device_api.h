// The device-runtime calls that the runtime and the benchmarks make, under one set of names for both vendors:
// CUDA's runtime by default, HIP's when built for AMD GPUs (the ROCm toolchain defines MHAKIT_HIP). Kernel families
// use their own vendor's API directly; everything vendor-neutral goes through mhakit::dev.
#pragma once

#if defined(MHAKIT_HIP)
#include <hip/hip_runtime.h>
#else
#include <cuda_runtime.h>
#endif

#include <stddef.h>

namespace mhakit::dev {

#if defined(MHAKIT_HIP)
inline constexpr const char* kName = "HIP";
using Error = hipError_t;
using Stream = hipStream_t;
using Event = hipEvent_t;
inline constexpr Error kSuccess = hipSuccess;
inline const char* error_string(Error e) { return hipGetErrorString(e); }
inline const char* error_name(Error e) { return hipGetErrorName(e); }
inline Error last_error() { return hipGetLastError(); }
inline Error event_create(Event* e) { return hipEventCreate(e); }
inline Error event_destroy(Event e) { return hipEventDestroy(e); }
inline Error event_record(Event e, Stream s) { return hipEventRecord(e, s); }
inline Error event_synchronize(Event e) { return hipEventSynchronize(e); }
inline Error event_elapsed_ms(float* ms, Event a, Event b) { return hipEventElapsedTime(ms, a, b); }
inline Error stream_synchronize(Stream s) { return hipStreamSynchronize(s); }
inline Error device_synchronize() { return hipDeviceSynchronize(); }
inline Error get_device(int* d) { return hipGetDevice(d); }
inline Error malloc(void** p, size_t n) { return hipMalloc(p, n); }
inline Error free(void* p) { return hipFree(p); }
inline Error memset(void* p, int v, size_t n) { return hipMemset(p, v, n); }
inline Error memset_async(void* p, int v, size_t n, Stream s) { return hipMemsetAsync(p, v, n, s); }
inline Error copy_to_device(void* dst, const void* src, size_t n) { return hipMemcpy(dst, src, n, hipMemcpyHostToDevice); }
inline Error copy_to_host(void* dst, const void* src, size_t n) { return hipMemcpy(dst, src, n, hipMemcpyDeviceToHost); }
#else
inline constexpr const char* kName = "CUDA";
using Error = cudaError_t;
using Stream = cudaStream_t;
using Event = cudaEvent_t;
inline constexpr Error kSuccess = cudaSuccess;
inline const char* error_string(Error e) { return cudaGetErrorString(e); }
inline const char* error_name(Error e) { return cudaGetErrorName(e); }
inline Error last_error() { return cudaGetLastError(); }
inline Error event_create(Event* e) { return cudaEventCreate(e); }
inline Error event_destroy(Event e) { return cudaEventDestroy(e); }
inline Error event_record(Event e, Stream s) { return cudaEventRecord(e, s); }
inline Error event_synchronize(Event e) { return cudaEventSynchronize(e); }
inline Error event_elapsed_ms(float* ms, Event a, Event b) { return cudaEventElapsedTime(ms, a, b); }
inline Error stream_synchronize(Stream s) { return cudaStreamSynchronize(s); }
inline Error device_synchronize() { return cudaDeviceSynchronize(); }
inline Error get_device(int* d) { return cudaGetDevice(d); }
inline Error malloc(void** p, size_t n) { return cudaMalloc(p, n); }
inline Error free(void* p) { return cudaFree(p); }
inline Error memset(void* p, int v, size_t n) { return cudaMemset(p, v, n); }
inline Error memset_async(void* p, int v, size_t n, Stream s) { return cudaMemsetAsync(p, v, n, s); }
inline Error copy_to_device(void* dst, const void* src, size_t n) { return cudaMemcpy(dst, src, n, cudaMemcpyHostToDevice); }
inline Error copy_to_host(void* dst, const void* src, size_t n) { return cudaMemcpy(dst, src, n, cudaMemcpyDeviceToHost); }
#endif

}  // namespace mhakit::dev
