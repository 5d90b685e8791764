#include "runtime/device.h"

#include <cuda_runtime.h>

#include <atomic>

#include "mha_common.h"
#include "runtime/error.h"

namespace mhakit {
namespace {

constexpr int kMaxDevices = 64;
std::atomic<int> g_checked[kMaxDevices];  // 0 unknown, 1 compatible

// Built only as SASS (no PTX), so code for sm_XY runs on the same major with minor >= Y, and an
// arch-specific target (sm_90a) runs only on exactly that compute capability.
bool runs_on(const BuiltArch& arch, int major, int minor) {
    if (arch.arch_specific) return major == arch.major && minor == arch.minor;
    return major == arch.major && minor >= arch.minor;
}

// Errors that mean "this process has no GPU to run on" rather than a fault of the call.
bool no_device_or_driver(cudaError_t err) {
    return err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver || err == cudaErrorStubLibrary ||
           err == cudaErrorDevicesUnavailable || err == cudaErrorInitializationError ||
           err == cudaErrorSystemDriverMismatch || err == cudaErrorCompatNotSupportedOnDevice;
}

float device_failure(cudaError_t err, const char* what, int device) {
    cudaGetLastError();  // reset the runtime error state so that later calls start clean
    if (no_device_or_driver(err))
        return fail(MHAKIT_ERROR_CUDA, "no CUDA device/driver is available to this process (%s: %s)", what,
                    cudaGetErrorString(err));
    return fail(MHAKIT_ERROR_CUDA, "%s failed for device %d: %s", what, device, cudaGetErrorString(err));
}

}  // namespace

float check_device_arch(const BuiltArch& arch) {
    int device = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err != cudaSuccess) return device_failure(err, "cudaGetDevice", device);
    if (device >= 0 && device < kMaxDevices && g_checked[device].load(std::memory_order_relaxed) == 1) return 0.f;
    int major = 0, minor = 0;
    if ((err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device)) != cudaSuccess ||
        (err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device)) != cudaSuccess)
        return device_failure(err, "reading the compute capability", device);
    if (!runs_on(arch, major, minor))
        return fail(MHAKIT_ERROR_UNSUPPORTED,
                    "this library was built for %s but device %d has compute capability %d.%d; rebuild with "
                    "compile.py --arch for this GPU",
                    arch.name, device, major, minor);
    if (device >= 0 && device < kMaxDevices) g_checked[device].store(1, std::memory_order_relaxed);
    return 0.f;
}

}  // namespace mhakit
