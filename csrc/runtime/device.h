// Does the current GPU run the machine code this library was built for?
#pragma once

namespace mhakit {

// 0 when the current device can run code built for `arch` (e.g. "sm_90a", "gfx942"), else MHAKIT_ERROR_UNSUPPORTED (no
// GPU, or another architecture) or MHAKIT_ERROR_CUDA, with last_error set. Cached per device after the first call.
float check_device_arch(const char* arch);

}  // namespace mhakit
