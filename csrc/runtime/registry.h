// The tables of kernel instances built into a library (generated: templates/<api>_dispatch.cu.j2).
#pragma once

#include <stddef.h>

#include "kernels/common/bwd_params.h"
#include "kernels/common/fwd_params.h"
#include "mha_common.h"
#include "runtime/device_api.h"

namespace mhakit {

template <class Params>
struct KernelInstance {
    const char* name;
    mhakit_dtype dtype;
    int hdim_q;       // compiled bucket: serves real head dims <= it
    int hdim_v;
    bool group_mode;  // true: serves group mode only; false: batch mode only
    bool masked;      // true: serves every mask kind (and none); false: no mask only
    int priority;     // family rank from the catalogue (higher is faster)
    bool (*supports)(const Params&);                  // run-time guard of the family (pure host arithmetic)
    dev::Error (*run)(const Params&, dev::Stream);    // launch; no sync, no allocation
    size_t (*workspace_bytes)(const Params&);         // scratch the caller must provide (nullptr: none)
};

using FwdInstance = KernelInstance<FwdParams>;
using BwdInstance = KernelInstance<BwdParams>;

// Defined by the generated dispatch source of each library.
extern const char* const kFwdBuiltArch;
extern const FwdInstance kFwdInstances[];
extern const int kNumFwdInstances;

extern const char* const kBwdBuiltArch;
extern const BwdInstance kBwdInstances[];
extern const int kNumBwdInstances;

}  // namespace mhakit
