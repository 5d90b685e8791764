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

// Every call below exists in both runtimes under the same name after the vendor prefix (cudaMalloc / hipMalloc).
#if defined(MHAKIT_HIP)
#define MHAKIT_DEV_API(name) hip##name
#define MHAKIT_DEV_NAME "HIP"
#else
#define MHAKIT_DEV_API(name) cuda##name
#define MHAKIT_DEV_NAME "CUDA"
#endif

namespace mhakit::dev {

inline constexpr const char* kName = MHAKIT_DEV_NAME;
using Error = MHAKIT_DEV_API(Error_t);
using Stream = MHAKIT_DEV_API(Stream_t);
using Event = MHAKIT_DEV_API(Event_t);
inline constexpr Error kSuccess = MHAKIT_DEV_API(Success);
inline const char* error_string(Error e) { return MHAKIT_DEV_API(GetErrorString)(e); }
inline const char* error_name(Error e) { return MHAKIT_DEV_API(GetErrorName)(e); }
inline Error last_error() { return MHAKIT_DEV_API(GetLastError)(); }
inline Error event_create(Event* e) { return MHAKIT_DEV_API(EventCreate)(e); }
inline Error event_destroy(Event e) { return MHAKIT_DEV_API(EventDestroy)(e); }
inline Error event_record(Event e, Stream s) { return MHAKIT_DEV_API(EventRecord)(e, s); }
inline Error event_synchronize(Event e) { return MHAKIT_DEV_API(EventSynchronize)(e); }
inline Error event_elapsed_ms(float* ms, Event a, Event b) { return MHAKIT_DEV_API(EventElapsedTime)(ms, a, b); }
inline Error stream_synchronize(Stream s) { return MHAKIT_DEV_API(StreamSynchronize)(s); }
inline Error device_synchronize() { return MHAKIT_DEV_API(DeviceSynchronize)(); }
inline Error get_device(int* d) { return MHAKIT_DEV_API(GetDevice)(d); }
inline Error device_count(int* n) { return MHAKIT_DEV_API(GetDeviceCount)(n); }
inline Error malloc(void** p, size_t n) { return MHAKIT_DEV_API(Malloc)(p, n); }
inline Error free(void* p) { return MHAKIT_DEV_API(Free)(p); }
inline Error memset(void* p, int v, size_t n) { return MHAKIT_DEV_API(Memset)(p, v, n); }
inline Error memset_async(void* p, int v, size_t n, Stream s) { return MHAKIT_DEV_API(MemsetAsync)(p, v, n, s); }
#if defined(MHAKIT_HIP)
inline Error multiprocessor_count(int* n, int device) {
    return hipDeviceGetAttribute(n, hipDeviceAttributeMultiprocessorCount, device);
}
inline Error shared_memory_per_multiprocessor(int* n, int device) {
    return hipDeviceGetAttribute(n, hipDeviceAttributeMaxSharedMemoryPerMultiprocessor, device);
}
#else
inline Error multiprocessor_count(int* n, int device) {
    return cudaDeviceGetAttribute(n, cudaDevAttrMultiProcessorCount, device);
}
inline Error shared_memory_per_multiprocessor(int* n, int device) {
    return cudaDeviceGetAttribute(n, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device);
}
#endif
inline Error copy_to_device(void* dst, const void* src, size_t n) {
    return MHAKIT_DEV_API(Memcpy)(dst, src, n, MHAKIT_DEV_API(MemcpyHostToDevice));
}
inline Error copy_to_host(void* dst, const void* src, size_t n) {
    return MHAKIT_DEV_API(Memcpy)(dst, src, n, MHAKIT_DEV_API(MemcpyDeviceToHost));
}

}  // namespace mhakit::dev

#undef MHAKIT_DEV_API
#undef MHAKIT_DEV_NAME
