// Host-side checks of the CK-tile glue (csrc/kernels/ck/): which problems an instance's guard admits (CK's own
// dispatch rules: padding, tile fit, LSE, 32-bit indices, masks CK can express), the backward workspace layout and
// the mask conversion. No kernel is instantiated and nothing runs on a GPU: guards are host arithmetic.
// Built and run by tests/test_rocm_guards.py, once per direction (CK's fmha_fwd.hpp and fmha_bwd.hpp cannot share a
// translation unit, as CK's own instances never do: -DCHECK_BWD selects the backward); prints "N passed, M failed".
#include <cstdio>
#include <cstdint>

#if defined(CHECK_BWD)
#include "kernels/ck/ck_bwd.hpp"
#else
#include "kernels/ck/ck_fwd.hpp"
#endif

namespace {

int g_passed = 0, g_failed = 0;

void check(bool ok, const char* what) {
    if (ok) {
        ++g_passed;
    } else {
        ++g_failed;
        std::printf("FAILED: %s\n", what);
    }
}

using namespace mhakit::ck;

#if !defined(CHECK_BWD)
using mhakit::FwdParams;

FwdParams fwd(int seqlen_q, int seqlen_k, int hdim = 128) {
    FwdParams p{};
    p.batch = 2, p.nhead_q = 8, p.nhead_k = 8, p.hdim_q = hdim, p.hdim_v = hdim;
    p.seqlen_q = p.max_seqlen_q = seqlen_q, p.seqlen_k = seqlen_k;
    p.q_row_stride = p.k_row_stride = p.v_row_stride = p.o_row_stride = 8 * hdim;
    p.q_head_stride = p.k_head_stride = p.v_head_stride = p.o_head_stride = hdim;
    p.q_batch_stride = p.k_batch_stride = p.v_batch_stride = p.o_batch_stride = int64_t(seqlen_q) * 8 * hdim;
    return p;
}

FwdParams group(FwdParams p) {
    static const int32_t starts[3] = {0, 1, 2};  // host pointers: guards only test them for null
    p.seqstart_q = p.seqstart_k = starts;
    return p;
}

FwdParams with_lse(FwdParams p) {
    static float lse;
    p.lse = &lse;
    return p;
}

// Instances as the catalogue renders them (only the guard data matters here; the kernel types are not used).
using QrAsyncUnpaddedK = FwdInstance<void, void, FwdGuard{FwdChecks::QrAsync, true, false, true, true, 128, 128, 128, 0, false}>;
using QrAsyncPaddedK = FwdInstance<void, void, FwdGuard{FwdChecks::QrAsync, true, true, true, true, 128, 128, 128, 0, false}>;
using QrAsyncLse = FwdInstance<void, void, FwdGuard{FwdChecks::QrAsync, true, true, true, true, 128, 128, 128, 0, true}>;
using QrUnpadded = FwdInstance<void, void, FwdGuard{FwdChecks::Qr, false, false, false, false, 128, 128, 256, 0, false}>;
using QrPaddedSeq = FwdInstance<void, void, FwdGuard{FwdChecks::Qr, true, true, false, false, 128, 128, 256, 0, false}>;
using TrloadShort = FwdInstance<void, void, FwdGuard{FwdChecks::Trload, false, false, false, false, 16, 32, 128, 16, false}>;

void forward_guards() {
    check(QrAsyncUnpaddedK::supports(fwd(100, 256)), "qr_async psddv: seqlen_k a multiple of bn0");
    check(!QrAsyncUnpaddedK::supports(fwd(100, 200)), "qr_async psddv: ragged seqlen_k goes elsewhere");
    check(!QrAsyncUnpaddedK::supports(fwd(100, 0)), "qr_async psddv: seqlen_k = 0 goes elsewhere");
    check(!QrAsyncUnpaddedK::supports(group(fwd(100, 256))), "qr_async psddv: never group mode");
    check(QrAsyncPaddedK::supports(fwd(100, 200)) && QrAsyncPaddedK::supports(group(fwd(100, 256))),
          "qr_async psskddv: ragged seqlen_k and group mode");
    check(!QrAsyncPaddedK::supports(fwd(100, 256)), "qr_async psskddv: leaves whole tiles to psddv, as CK does");
    check(!QrAsyncPaddedK::supports(with_lse(fwd(100, 200))) && QrAsyncLse::supports(with_lse(fwd(100, 200))) &&
              !QrAsyncLse::supports(fwd(100, 200)),
          "LSE: an instance stores LSE exactly when the call asks for it");
    check(QrUnpadded::supports(fwd(256, 384, 256)), "qr npad: whole tiles and head dim 256");
    check(!QrUnpadded::supports(fwd(200, 384, 256)) && !QrUnpadded::supports(fwd(256, 300, 256)) &&
              !QrUnpadded::supports(fwd(256, 384, 192)),
          "qr npad: ragged seqlen_q, seqlen_k or head dim go elsewhere");
    check(QrPaddedSeq::supports(fwd(200, 300, 256)) && !QrPaddedSeq::supports(fwd(200, 300, 192)),
          "qr pssk: pads the sequences, not the head dims");
    check(TrloadShort::supports(fwd(16, 1000)) && !TrloadShort::supports(fwd(17, 1000)),
          "trload 16-row tile: seqlen_q <= 16 only (CK's seqtune)");
    FwdParams big = fwd(100, 200);
    big.q_batch_stride = int64_t(1) << 31;
    check(!QrAsyncPaddedK::supports(big), "strides beyond CK's 32-bit index are refused");
    FwdParams generic = fwd(100, 200);
    generic.mask_type = MHAKIT_MASK_GENERIC, generic.window_left = 0, generic.window_right = 5;
    check(!QrAsyncPaddedK::supports(generic), "a generic mask with y < 1 has no left/right window form");
    generic.window_left = 1, generic.window_right = 1;
    check(QrAsyncPaddedK::supports(generic), "a generic mask with y, x >= 1 is served");
}

void masks() {
    const CkMask none = ck_mask(MHAKIT_MASK_NONE, 7, 9);
    check(none.type == MHAKIT_MASK_NONE && none.left == -1 && none.right == -1, "no mask: unbounded window");
    const CkMask g = ck_mask(MHAKIT_MASK_GENERIC, 3, 2);
    check(g.type == MHAKIT_MASK_TOP_LEFT && g.left == 2 && g.right == 1, "generic (y, x) = top-left (y-1, x-1)");
    const CkMask br = ck_mask(MHAKIT_MASK_BOTTOM_RIGHT, -1, 0);
    check(br.type == MHAKIT_MASK_BOTTOM_RIGHT && br.left == -1 && br.right == 0, "causal bottom-right as is");
}

#else
using mhakit::BwdParams;

BwdParams bwd(int batch, int nhead, int seqlen_q, int seqlen_k, int hdim) {
    BwdParams p{};
    p.batch = batch, p.nhead_q = p.nhead_k = nhead, p.hdim_q = p.hdim_v = hdim;
    p.seqlen_q = p.max_seqlen_q = seqlen_q, p.seqlen_k = p.max_seqlen_k = seqlen_k;
    p.lse_head_stride = seqlen_q, p.lse_batch_stride = int64_t(nhead) * seqlen_q;
    return p;
}

using Bwd64 = BwdInstance<void, void, void, void, BwdGuard{0, 0, 64, 64, 128, 0, false}>;
using Bwd64Pad8 = BwdInstance<void, void, void, void, BwdGuard{8, 8, 64, 64, 128, 0, false}>;
using Bwd64Det = BwdInstance<void, void, void, void, BwdGuard{0, 0, 64, 64, 128, 0, true}>;
using Bwd64Short = BwdInstance<void, void, void, void, BwdGuard{0, 0, 64, 64, 128, 256, false}>;

void backward() {
    const BwdParams p = bwd(2, 4, 100, 300, 64);
    const BwdWorkspace ws(p, 128, false);
    // D covers LSE's extent: (batch-1)*400 + (heads-1)*100 + 100 = 800 floats, padded to 256 bytes; one fp32 dQ split
    check(ws.d_elems == 800 && ws.d_bytes == 3328 && ws.splits == 1 && ws.split_elems == 2 * 4 * 100 * 64 &&
              ws.total_bytes == 3328 + 2 * 4 * 100 * 64 * 4,
          "workspace: D then one dQ accumulator");
    check(Bwd64::workspace_bytes(p) == ws.total_bytes, "workspace_bytes reports the layout run() uses");
    const BwdWorkspace det(p, 128, true);
    check(det.splits == 3 && det.total_bytes == 3328 + 3 * size_t(2 * 4 * 100 * 64) * 4,
          "deterministic: one dQ split per key block");
    BwdParams g = p;
    static const int32_t starts[3] = {0, 60, 100};
    g.seqstart_q = g.seqstart_k = starts, g.max_seqlen_q = 60, g.lse_head_stride = 100, g.lse_batch_stride = 0;
    const BwdWorkspace gws(g, 128, false);
    check(gws.rows == 120 && gws.d_elems == 3 * 100 + 120 && gws.split_elems == 4 * 120 * 64,
          "group mode: rows bounded by batch x max_seqlen_q");
    check(Bwd64::supports(p) && !Bwd64::supports(bwd(2, 4, 100, 300, 40)) && Bwd64Pad8::supports(bwd(2, 4, 100, 300, 40)),
          "unpadded head dims must fill the tile; pd8dv8 takes multiples of 8");
    BwdParams d = p;
    d.deterministic = true;
    check(!Bwd64::supports(d) && Bwd64Det::supports(d) && !Bwd64Det::supports(p), "deterministic runs match exactly");
    check(Bwd64Short::supports(bwd(2, 4, 100, 256, 64)) && !Bwd64Short::supports(bwd(2, 4, 100, 257, 64)),
          "seqlen_k_max bounds the key length");
}
#endif

}  // namespace

int main() {
#if defined(CHECK_BWD)
    backward();
#else
    forward_guards();
    masks();
#endif
    std::printf("%d passed, %d failed\n", g_passed, g_failed);
    return g_failed == 0 ? 0 : 1;
}
