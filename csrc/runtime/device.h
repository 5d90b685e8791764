// Does the current GPU run the machine code this library was built for?
#pragma once

#include "runtime/registry.h"

namespace mhakit {

// 0 when the current device can run code built for `arch` (the library's record), else
// MHAKIT_ERROR_UNSUPPORTED (a GPU of another architecture: a rebuild for it helps) or MHAKIT_ERROR_CUDA (no CUDA
// device/driver available, or the runtime failed), with last_error set. Cached per device after the first call.
float check_device_arch(const BuiltArch& arch);

}  // namespace mhakit
