// Programmatic dependent launch (sm_90+): a kernel launched right behind another on the same stream with
// cudaLaunchAttributeProgrammaticStreamSerialization may be scheduled before the first one has finished, once every
// CTA of the first has executed trigger_dependents() (or exited); it must call wait_for_primary() before it reads
// anything the first one writes: that waits for the first grid to complete and its memory to be visible. Both
// instructions are no-ops in a grid launched without the attribute, and compile to nothing below sm_90 (a kernel
// built for an older arch must then not be launched with the attribute: launch_dependent() is for sm_90a instances).
#pragma once

#include <cuda_runtime.h>

namespace mhakit {

__device__ __forceinline__ void trigger_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void wait_for_primary() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

#if defined(__CUDACC__)
// kernel<<<grid, block, smem, stream>>>(args...) as a programmatic dependent of the kernel launched before it on the
// stream: its CTAs may start while that kernel's last CTAs still run (it hides the launch gap and the first kernel's
// tail); the kernel calls wait_for_primary() before it reads the first kernel's results.
template <class... KernelArgs, class... Args>
inline cudaError_t launch_dependent(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem,
                                    cudaStream_t stream, Args&&... args) {
    cudaLaunchConfig_t config = {};
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    cudaLaunchAttribute attribute[1];
    attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[0].val.programmaticStreamSerializationAllowed = 1;
    config.attrs = attribute;
    config.numAttrs = 1;
    return cudaLaunchKernelEx(&config, kernel, static_cast<Args&&>(args)...);
}
#endif

}  // namespace mhakit
