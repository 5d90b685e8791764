#include "runtime/device.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "mha_common.h"
#include "runtime/device_api.h"
#include "runtime/error.h"

namespace mhakit {
namespace {

constexpr int kMaxDevices = 64;
std::atomic<int> g_checked[kMaxDevices];  // 0 unknown, 1 compatible

#if defined(MHAKIT_HIP)
// Code objects are built per gfx target, so the device's architecture name (gcnArchName, e.g.
// "gfx942:sramecc+:xnack-") must name exactly the target the library was built for.
bool runs_on(const char* arch, const char* device_arch) {
    const size_t n = std::strlen(arch);
    return std::strncmp(device_arch, arch, n) == 0 && (device_arch[n] == '\0' || device_arch[n] == ':');
}

float device_mismatch(const char* arch, int device, dev::Error* err) {
    hipDeviceProp_t props;
    if ((*err = hipGetDeviceProperties(&props, device)) != hipSuccess)
        return fail(MHAKIT_ERROR_CUDA, "cannot read the properties of device %d: %s", device, dev::error_string(*err));
    if (!runs_on(arch, props.gcnArchName))
        return fail(MHAKIT_ERROR_UNSUPPORTED,
                    "this library was built for %s but device %d is %s; rebuild with compile.py --arch for this GPU",
                    arch, device, props.gcnArchName);
    return 0.f;
}
#else
// Built only as SASS (no PTX), so code for sm_XY runs on the same major with minor >= Y, and an
// arch-specific target (sm_90a) runs only on exactly that compute capability.
bool runs_on(const char* arch, int major, int minor) {
    if (std::strncmp(arch, "sm_", 3) != 0) return false;
    const int cc = std::atoi(arch + 3);
    const bool arch_specific = arch[std::strlen(arch) - 1] == 'a';
    if (arch_specific) return major * 10 + minor == cc;
    return major == cc / 10 && minor >= cc % 10;
}

float device_mismatch(const char* arch, int device, dev::Error* err) {
    int major = 0, minor = 0;
    if ((*err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device)) != cudaSuccess ||
        (*err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device)) != cudaSuccess)
        return fail(MHAKIT_ERROR_CUDA, "cannot read the compute capability of device %d: %s", device,
                    cudaGetErrorString(*err));
    if (!runs_on(arch, major, minor))
        return fail(MHAKIT_ERROR_UNSUPPORTED,
                    "this library was built for %s but device %d has compute capability %d.%d; rebuild with "
                    "compile.py --arch for this GPU",
                    arch, device, major, minor);
    return 0.f;
}
#endif

}  // namespace

float check_device_arch(const char* arch) {
    int device = 0;
    dev::Error err = dev::get_device(&device);
    if (err != dev::kSuccess) {
        dev::last_error();  // reset the runtime error state so that later calls start clean
        return fail(MHAKIT_ERROR_UNSUPPORTED, "no usable %s device: %s", dev::kName, dev::error_string(err));
    }
    if (device >= 0 && device < kMaxDevices && g_checked[device].load(std::memory_order_relaxed) == 1) return 0.f;
    if (float rc = device_mismatch(arch, device, &err)) return rc;
    if (device >= 0 && device < kMaxDevices) g_checked[device].store(1, std::memory_order_relaxed);
    return 0.f;
}

}  // namespace mhakit
