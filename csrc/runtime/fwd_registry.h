// The table of forward kernel instances built into libmha_fwd.so (generated: templates/fwd_dispatch.cu.j2).
#pragma once

#include <cuda_runtime.h>

#include "kernels/common/fwd_params.h"
#include "mha_common.h"

namespace mhakit {

struct FwdInstance {
    const char* name;
    mhakit_dtype dtype;
    int hdim_q;       // compiled bucket: serves real head dims <= it
    int hdim_v;
    bool group_mode;  // true: serves group mode only; false: batch mode only
    bool masked;      // true: serves every mask kind (and none); false: no mask only
    int priority;     // family rank from the catalogue (higher is faster)
    bool (*supports)(const FwdParams&);                    // run-time guard of the family (alignment, shapes, ...)
    cudaError_t (*run)(const FwdParams&, cudaStream_t);    // launch; no sync, no allocation
};

extern const char* const kFwdBuiltArch;
extern const FwdInstance kFwdInstances[];
extern const int kNumFwdInstances;

}  // namespace mhakit
