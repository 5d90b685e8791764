// Does the current GPU run the machine code this library was built for?
#pragma once

#include "runtime/registry.h"

namespace mhakit {

// 0 when the current device can run code built for `arch` (the library's record: "sm_90a", "gfx942", ...), else
// MHAKIT_ERROR_UNSUPPORTED (a GPU of another architecture: a rebuild for it helps) or MHAKIT_ERROR_CUDA (no
// device/driver available, or the device runtime failed), with last_error set. Cached per device after the first call.
float check_device_arch(const BuiltArch& arch);

// The current device's multiprocessor count and shared memory per multiprocessor (bytes), read once per device.
// Returns 0, or MHAKIT_ERROR_CUDA with last_error set.
float device_multiprocessors(int* count, int* smem_per_sm);

}  // namespace mhakit
