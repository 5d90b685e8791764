// The tables of kernel instances built into a library (generated: templates/<api>_dispatch.cu.j2).
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "kernels/common/bwd_params.h"
#include "kernels/common/fwd_params.h"
#include "kernels/common/splitkv_params.h"
#include "mha_common.h"
#include "runtime/device_api.h"

namespace mhakit {

// The arch a library was built for, from the catalogue's [arch.*] record: the device check compares the GPU with it.
struct BuiltArch {
    const char* name;    // "sm_90a"
    int major, minor;    // the lowest compute capability it is built for
    bool arch_specific;  // true: runs on exactly major.minor (sm_90a); false: on major.y for every y >= minor
};

// The head dims the API accepts, from the catalogue's [head_dims]: multiples of `multiple` in [multiple, max]
// (multiple = 1: every head dim up to max).
struct HeadDimRule {
    int multiple, max;
};

template <class Params>
struct KernelInstance {
    const char* name;
    mhakit_dtype dtype;
    int hdim_q;       // compiled bucket: serves real head dims <= it
    int hdim_v;
    bool group_mode;  // true: serves group mode only; false: batch mode only
    bool masked;      // true: serves every mask kind (and none); false: no mask only
    int priority;     // family rank from the catalogue (higher is faster)
    // The family's static guards (catalogue): checked by choose_instance before the run-time guard `supports`.
    bool equal_head_dims;  // serves only hdim_q == hdim_v
    bool deterministic;    // serves deterministic backward calls
    int align_bytes;       // every tensor's base pointer and strides a multiple of this many bytes
    int head_dim_multiple; // serves only hdim_q and hdim_v that are multiples of this
    bool mods;             // holds the modifier kernel ("_mods") instead of the plain one
    uint32_t mod_kinds;    // the score modifiers (mhakit_score_mod bits) it serves (catalogue score_mods)
    uint32_t plain_mod_kinds;  // those the family's plain instances serve: a "_mods" instance takes only calls that
                               // set a modifier beyond them
    // The tile's preferred range of the call's max_seqlen_q (batch mode: seqlen_q), inclusive, from the catalogue's
    // min_seqlen_q / max_seqlen_q: among instances that differ only in their tile, choose_instance takes the one
    // whose range holds the call, else the default tile's (seqlen_q_max = 0: no range).
    int seqlen_q_min, seqlen_q_max;
    bool (*supports)(const Params&);                  // run-time guard of the family (pure host arithmetic)
    dev::Error (*run)(const Params&, dev::Stream);    // launch; no sync, no allocation
    size_t (*workspace_bytes)(const Params&);         // scratch the caller must provide (nullptr: none)
    // The workspace is wanted, not needed (the forward's persistent 16-bit instances: a tile counter; without it they
    // run the one-tile grid): a call that gives none is served; one that gives less than workspace_bytes is refused.
    bool workspace_optional;
    // Runs a persistent grid when the call's workspace holds its tile counter (the forward's catalogue `persistent`):
    // the launch needs the multiprocessor count and a counter tag (FwdParams::num_sms, counter_epoch).
    bool persistent;
};

using FwdInstance = KernelInstance<FwdParams>;

// A split-KV (decode) instance of libmha_fwd.so: one per dtype and head-dim bucket and family, serving every mask
// and GQA ratio at run time (layouts and page sizes: within its family's guards).
struct SplitkvInstance {
    const char* name;
    mhakit_dtype dtype;
    int hdim_q;     // compiled bucket: serves real head dims <= it
    int hdim_v;
    int priority;   // family rank from the catalogue (higher is faster)
    // The family's static guards (catalogue), checked before the run-time guard `supports`.
    bool equal_head_dims;   // serves only hdim_q == hdim_v
    int align_bytes;        // every tensor's base pointer and used strides a multiple of this many bytes
    int head_dim_multiple;  // serves only hdim_q and hdim_v that are multiples of this
    // The packed rows per kv head (seqlen_q x nhead_q / nhead_k) from which the runtime prefers this instance over
    // the family's others of the same bucket (catalogue tile `min_rows`; 0: no such preference). Below it the
    // instance still serves a call that nothing else built serves.
    int min_rows;
    bool (*supports)(const SplitkvParams&);                    // run-time guard (pure host arithmetic)
    int (*num_splits)(const SplitkvParams&, int smem_per_sm);  // the split heuristic for num_splits = 0
    dev::Error (*run)(const SplitkvParams&, dev::Stream);      // append, attend, combine; no sync, no allocation
};
using BwdInstance = KernelInstance<BwdParams>;

// Defined by the generated dispatch source of each library.
extern const BuiltArch kFwdBuiltArch;
extern const HeadDimRule kFwdHeadDims;
extern const FwdInstance kFwdInstances[];
extern const int kNumFwdInstances;
// The split-KV instances of the forward library (nullptr and 0 when a build selected none).
extern const SplitkvInstance* const kSplitkvInstances;
extern const int kNumSplitkvInstances;

extern const BuiltArch kBwdBuiltArch;
extern const HeadDimRule kBwdHeadDims;
extern const BwdInstance kBwdInstances[];
extern const int kNumBwdInstances;

}  // namespace mhakit
