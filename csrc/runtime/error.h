// Per-thread "last error" text behind mhakit_last_error(), and the helpers that set it.
#pragma once

#include <cstdarg>

namespace mhakit {

void clear_error();
// printf-style; returns `code` so that call sites can `return fail(MHAKIT_ERROR_INVALID_ARGS, "...", ...)`.
float fail(int code, const char* fmt, ...) __attribute__((format(printf, 2, 3)));

}  // namespace mhakit
