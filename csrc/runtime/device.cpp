#include "runtime/device.h"

#include <atomic>
#include <cstring>

#include "mha_common.h"
#include "runtime/device_api.h"
#include "runtime/error.h"

namespace mhakit {
namespace {

constexpr int kMaxDevices = 64;
std::atomic<int> g_checked[kMaxDevices];  // 0 unknown, 1 compatible

#if defined(MHAKIT_HIP)
// Errors that mean "this process has no GPU to run on" rather than a fault of the call.
bool no_device_or_driver(dev::Error err) {
    return err == hipErrorNoDevice || err == hipErrorInsufficientDriver || err == hipErrorInitializationError ||
           err == hipErrorNotInitialized;
}
#else
bool no_device_or_driver(dev::Error err) {
    return err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver || err == cudaErrorStubLibrary ||
           err == cudaErrorDevicesUnavailable || err == cudaErrorInitializationError ||
           err == cudaErrorSystemDriverMismatch || err == cudaErrorCompatNotSupportedOnDevice;
}
#endif

float device_failure(dev::Error err, const char* what, int device) {
    dev::last_error();  // reset the runtime error state so that later calls start clean
    if (no_device_or_driver(err))
        return fail(MHAKIT_ERROR_CUDA, "no %s device/driver is available to this process (%s: %s)", dev::kName, what,
                    dev::error_string(err));
    return fail(MHAKIT_ERROR_CUDA, "%s failed for device %d: %s", what, device, dev::error_string(err));
}

#if defined(MHAKIT_HIP)
// Code objects are built per gfx target, so the device's architecture name (gcnArchName, e.g.
// "gfx942:sramecc+:xnack-") must name exactly the target the library was built for.
bool runs_on(const BuiltArch& arch, const char* device_arch) {
    const size_t n = std::strlen(arch.name);
    return std::strncmp(device_arch, arch.name, n) == 0 && (device_arch[n] == '\0' || device_arch[n] == ':');
}

float device_mismatch(const BuiltArch& arch, int device) {
    hipDeviceProp_t props;
    if (dev::Error err = hipGetDeviceProperties(&props, device); err != hipSuccess)
        return device_failure(err, "reading the device properties", device);
    if (!runs_on(arch, props.gcnArchName))
        return fail(MHAKIT_ERROR_UNSUPPORTED,
                    "this library was built for %s but device %d is %s; rebuild with compile.py --arch for this GPU",
                    arch.name, device, props.gcnArchName);
    return 0.f;
}
#else
// Built only as SASS (no PTX), so code for sm_XY runs on the same major with minor >= Y, and an
// arch-specific target (sm_90a) runs only on exactly that compute capability.
bool runs_on(const BuiltArch& arch, int major, int minor) {
    if (arch.arch_specific) return major == arch.major && minor == arch.minor;
    return major == arch.major && minor >= arch.minor;
}

float device_mismatch(const BuiltArch& arch, int device) {
    int major = 0, minor = 0;
    dev::Error err;
    if ((err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device)) != cudaSuccess ||
        (err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device)) != cudaSuccess)
        return device_failure(err, "reading the compute capability", device);
    if (!runs_on(arch, major, minor))
        return fail(MHAKIT_ERROR_UNSUPPORTED,
                    "this library was built for %s but device %d has compute capability %d.%d; rebuild with "
                    "compile.py --arch for this GPU",
                    arch.name, device, major, minor);
    return 0.f;
}
#endif

}  // namespace

float check_device_arch(const BuiltArch& arch) {
    int device = 0;
    if (dev::Error err = dev::get_device(&device); err != dev::kSuccess)
        return device_failure(err, "reading the current device", device);
    if (device >= 0 && device < kMaxDevices && g_checked[device].load(std::memory_order_relaxed) == 1) return 0.f;
    if (float rc = device_mismatch(arch, device)) return rc;
    if (device >= 0 && device < kMaxDevices) g_checked[device].store(1, std::memory_order_relaxed);
    return 0.f;
}

float device_multiprocessors(int* count, int* smem_per_sm) {
    static std::atomic<int> cached_count[kMaxDevices], cached_smem[kMaxDevices];
    int device = 0;
    if (dev::Error err = dev::get_device(&device); err != dev::kSuccess)
        return device_failure(err, "reading the current device", device);
    const bool cacheable = device >= 0 && device < kMaxDevices;
    if (cacheable && cached_count[device].load(std::memory_order_acquire) > 0) {
        *count = cached_count[device].load(std::memory_order_relaxed);
        *smem_per_sm = cached_smem[device].load(std::memory_order_relaxed);
        return 0.f;
    }
    int n = 0, smem = 0;
    if (dev::Error err = dev::multiprocessor_count(&n, device); err != dev::kSuccess)
        return device_failure(err, "reading the multiprocessor count", device);
    if (dev::Error err = dev::shared_memory_per_multiprocessor(&smem, device); err != dev::kSuccess)
        return device_failure(err, "reading the shared memory per multiprocessor", device);
    if (cacheable) {
        cached_smem[device].store(smem, std::memory_order_relaxed);
        cached_count[device].store(n, std::memory_order_release);  // after smem: a reader seeing n sees it too
    }
    *count = n;
    *smem_per_sm = smem;
    return 0.f;
}

}  // namespace mhakit
