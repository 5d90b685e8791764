// What the benchmark executables share besides the command line (../reference/bench_cli.hpp): exit codes, device
// runtime error checks (CUDA or HIP, through runtime/device_api.h), device buffers and the messages around them.
#pragma once


#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "mha_common.h"
#include "runtime/device_api.h"

namespace mhakit::bench {

constexpr int kExitFail = 1;   // validation failed, or the library refused the call
constexpr int kExitUsage = 2;  // bad command line
constexpr int kExitCuda = 3;   // the device runtime (CUDA or HIP) failed

// The running program's name, for messages; each benchmark sets it first thing in main().
inline const char* g_program = "benchmark";

[[noreturn]] inline void cuda_failure(dev::Error err, const char* expr, const char* file, int line) {
    std::cout << std::flush;
    std::fprintf(stderr, "\n%s: %s error at %s:%d: %s -> %s (%s)\n", g_program, dev::kName, file, line, expr,
                 dev::error_name(err), dev::error_string(err));
    std::exit(kExitCuda);
}

#define MHAKIT_CHECK_CUDA(expr)                                                                  \
    do {                                                                                         \
        const ::mhakit::dev::Error err_ = (expr);                                                            \
        if (err_ != ::mhakit::dev::kSuccess) ::mhakit::bench::cuda_failure(err_, #expr, __FILE__, __LINE__); \
    } while (0)

// A device allocation (at least 256 bytes, so that empty tensors still get a valid pointer).
class DeviceBuffer {
public:
    explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
        MHAKIT_CHECK_CUDA(dev::malloc(&ptr_, std::max<size_t>(bytes, 256)));
    }
    ~DeviceBuffer() {
        if (ptr_ != nullptr) {
            const dev::Error e = dev::free(ptr_);
            if (e != dev::kSuccess)
                std::fprintf(stderr, "%s: warning: freeing device memory failed: %s\n", g_program, dev::error_string(e));
        }
    }
    DeviceBuffer(const DeviceBuffer&) = delete;
    DeviceBuffer& operator=(const DeviceBuffer&) = delete;

    void* get() const { return ptr_; }
    size_t bytes() const { return bytes_; }
    void upload(const void* host) const {
        if (bytes_ > 0) MHAKIT_CHECK_CUDA(dev::copy_to_device(ptr_, host, bytes_));
    }
    void download(void* host) const {
        if (bytes_ > 0) MHAKIT_CHECK_CUDA(dev::copy_to_host(host, ptr_, bytes_));
    }
    // All bytes 0xFF: NaN in fp16, bf16 and fp32, so anything the kernel forgets to write fails validation.
    void poison() const { MHAKIT_CHECK_CUDA(dev::memset(ptr_, 0xFF, std::max<size_t>(bytes_, 256))); }

private:
    void* ptr_ = nullptr;
    size_t bytes_ = 0;
};

[[noreturn]] inline void usage_error(const std::string& msg) {
    std::fprintf(stderr, "%s: error: %s\n", g_program, msg.c_str());
    std::exit(kExitUsage);
}

template <class T>
std::string list_str(const std::vector<T>& v, size_t max_items = 64) {
    std::ostringstream os;
    os << "[";
    for (size_t i = 0; i < v.size() && i < max_items; ++i) os << (i ? ", " : "") << v[i];
    if (v.size() > max_items) os << ", ... (" << v.size() << " values)";
    os << "]";
    return os.str();
}

// The name of a negative mhakit return code.
inline const char* status_name(float r) {
    if (r == float(MHAKIT_ERROR_UNSUPPORTED)) return "unsupported";
    if (r == float(MHAKIT_ERROR_INVALID_ARGS)) return "invalid arguments";
    if (r == float(MHAKIT_ERROR_CUDA)) return "CUDA error";
    return "error";
}

}  // namespace mhakit::bench
