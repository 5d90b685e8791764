#include "runtime/error.h"

#include <cstdio>
#include <string>

#include "mha_common.h"

namespace mhakit {
namespace {
thread_local std::string g_last_error;
}

void clear_error() { g_last_error.clear(); }

float fail(int code, const char* fmt, ...) {
    char buffer[1024];
    va_list args;
    va_start(args, fmt);
    std::vsnprintf(buffer, sizeof(buffer), fmt, args);
    va_end(args);
    g_last_error = buffer;
    return static_cast<float>(code);
}

}  // namespace mhakit

extern "C" __attribute__((visibility("default"))) const char* mhakit_last_error(void) {
    return mhakit::g_last_error.c_str();
}
