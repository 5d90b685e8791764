// What the benchmark executables share besides the command line (../reference/bench_cli.hpp): exit codes, device
// runtime error checks (CUDA or HIP, through runtime/device_api.h), device buffers and the messages around them.
#pragma once

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <new>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "../reference/bench_cli.hpp"  // checked_product
#include "mha_common.h"
#include "runtime/device_api.h"

namespace mhakit::bench {

constexpr int kExitFail = 1;   // validation failed, or the library refused the call
constexpr int kExitUsage = 2;  // bad command line
constexpr int kExitCuda = 3;   // no device/driver, or the device runtime (CUDA or HIP) failed

// The running program's name, for messages; each benchmark sets it first thing in main().
inline const char* g_program = "benchmark";

[[noreturn]] inline void usage_error(const std::string& msg) {
    std::fprintf(stderr, "%s: error: %s\n", g_program, msg.c_str());
    std::exit(kExitUsage);
}

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

// Exits with kExitCuda and one line when this process has no device to run on (no GPU, no driver, or a driver
// older than the runtime), before any buffer is allocated.
inline void require_device() {
    int count = 0;
    const dev::Error err = dev::device_count(&count);
    if (err == dev::kSuccess && count > 0) return;
    std::fprintf(stderr, "%s: no %s device/driver is available (%s)\n", g_program, dev::kName,
                 err != dev::kSuccess ? dev::error_string(err) : "no device found");
    std::exit(kExitCuda);
}

// Host memory this process may use: physical memory, or less under an address-space or data-size limit.
inline double host_memory_limit() {
    double limit = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGE_SIZE));
    for (int resource : {RLIMIT_AS, RLIMIT_DATA}) {
        rlimit rl{};
        if (getrlimit(resource, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) limit = std::min(limit, double(rl.rlim_cur));
    }
    return limit;
}

// The sizes of a run, for messages ("-b=2 -h=8 -s=512/512 -d=128/128").
inline std::string g_sizes;

[[noreturn]] inline void host_memory_failure(double bytes) {
    std::cout << std::flush;
    if (bytes > 0)
        std::fprintf(stderr, "%s: error: %s need about %.1f GiB of host memory (inputs and reference), more than this "
                             "process may use (%.1f GiB); use smaller sizes, or -v=0 to skip the reference\n",
                     g_program, g_sizes.c_str(), bytes / double(1ull << 30), host_memory_limit() / double(1ull << 30));
    else
        std::fprintf(stderr, "%s: error: ran out of host memory for %s; use smaller sizes\n", g_program,
                     g_sizes.c_str());
    std::exit(kExitUsage);
}

// Element counts of q, k, v, o (and dq, dk, dv, do, which have their shapes) and lse.
struct TensorCounts {
    size_t q, k, v, o, lse;
};

// The element counts of a run's tensors (shape_batch sequences of shape_sq / shape_sk tokens: group mode packs the
// batch into one), refused in one line (kExitUsage) when they cannot be addressed. Sets g_sizes for later messages.
inline TensorCounts checked_counts(int batch, int64_t shape_batch, int64_t nhead, int64_t nhead_k, int64_t shape_sq,
                                   int64_t shape_sk, int64_t hdim_q, int64_t hdim_v) {
    g_sizes = "-b=" + std::to_string(batch) + " -h=" + std::to_string(nhead) + " -s=" + std::to_string(shape_sq) + "/" +
              std::to_string(shape_sk) + " -d=" + std::to_string(hdim_q) + "/" + std::to_string(hdim_v);
    const int64_t counts[] = {checked_product({shape_batch, nhead, shape_sq, hdim_q}),
                              checked_product({shape_batch, nhead_k, shape_sk, hdim_q}),
                              checked_product({shape_batch, nhead_k, shape_sk, hdim_v}),
                              checked_product({shape_batch, nhead, shape_sq, hdim_v}),
                              checked_product({shape_batch, nhead, shape_sq})};
    for (int64_t c : counts)
        if (c < 0 || c > INT64_MAX / 16) usage_error(g_sizes + ": the tensors have too many elements to address");
    return {size_t(counts[0]), size_t(counts[1]), size_t(counts[2]), size_t(counts[3]), size_t(counts[4])};
}

// Refuses (kExitUsage, one line) a run whose host buffers cannot fit, before any allocation.
inline void require_host_memory(double bytes) {
    if (bytes > host_memory_limit()) host_memory_failure(bytes);
}

// main()'s body, with allocation failures that slip past require_host_memory() reported in one line instead of
// aborting.
template <class Body>
int run_main(Body&& body) {
    try {
        return body();
    } catch (const std::bad_alloc&) {
        host_memory_failure(0);
    } catch (const std::length_error&) {
        host_memory_failure(0);
    }
}

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
