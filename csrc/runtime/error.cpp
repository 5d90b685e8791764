#include "runtime/error.h"

#include <cstdio>
#include <cstring>

#include "mha_common.h"

#define MHAKIT_EXPORT extern "C" __attribute__((visibility("default")))

namespace {
constexpr int kErrorBytes = 1024;
thread_local char g_text[kErrorBytes];  // this library's text of the calling thread's last failure
}  // namespace

MHAKIT_EXPORT const char* mhakit_last_error(void) { return g_text; }

namespace mhakit {
namespace {
// The process's text. libmha_fwd.so and libmha_bwd.so both define mhakit_last_error(); when a process links or
// globally loads both, the dynamic linker binds every call of it, this library's own included, to one definition,
// so this is the text a C++ program linking both reads through mhakit::last_error(). (Loaded with RTLD_LOCAL, or
// alone, it is this library's own.) Failures are written to both, so that each library's own mhakit_last_error()
// (e.g. asked through its dlopen handle) says what failed too, and nothing but the C ABI needs to be exported.
char* process_text() { return const_cast<char*>(mhakit_last_error()); }
}  // namespace

void clear_error() {
    g_text[0] = '\0';
    process_text()[0] = '\0';
}

float fail(int code, const char* fmt, ...) {
    va_list args;
    va_start(args, fmt);
    std::vsnprintf(g_text, kErrorBytes, fmt, args);
    va_end(args);
    char* shared = process_text();
    if (shared != g_text) std::memcpy(shared, g_text, kErrorBytes);
    return static_cast<float>(code);
}

}  // namespace mhakit
