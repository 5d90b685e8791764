#include "runtime/error.h"

#include <cstdio>

#include "mha_common.h"

#define MHAKIT_EXPORT extern "C" __attribute__((visibility("default")))

// The per-thread error text lives behind one exported function. libmha_fwd.so and libmha_bwd.so both define it;
// when a process links or globally loads both, the dynamic linker binds every reference, the other library's
// internal ones included, to a single definition, so both libraries write and mhakit_last_error() reads the same
// buffer. (A library loaded with RTLD_LOCAL keeps its own, and is asked through its own handle.)
MHAKIT_EXPORT char* mhakit_error_buffer_(void) {
    static thread_local char buffer[1024];
    return buffer;
}

MHAKIT_EXPORT const char* mhakit_last_error(void) { return mhakit_error_buffer_(); }

namespace mhakit {

void clear_error() { mhakit_error_buffer_()[0] = '\0'; }

float fail(int code, const char* fmt, ...) {
    va_list args;
    va_start(args, fmt);
    std::vsnprintf(mhakit_error_buffer_(), 1024, fmt, args);
    va_end(args);
    return static_cast<float>(code);
}

}  // namespace mhakit
