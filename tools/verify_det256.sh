#!/usr/bin/env bash
# Branch det256 (issue 13: the deterministic Hopper backward >= 0.85x the non-deterministic one, bitwise identical
# over 3 runs), on the H200, from the repository root of an export of the branch:
#
#   OUT=/path/to/logs BASE=/path/to/export/of/main@754eb5e bash tools/verify_det256.sh
#
# Three backward libraries, each with the bf16 d256 batch Hopper instances (mask, nmask):
#   base    BASE's tree (main at 754eb5e): the consumers wait for each dQ turn, fence their adds, pass it on;
#   branch  this tree: the turn keeper warp + the interleaved deterministic grid (the branch's two commits);
#   keeper  this tree with the interleaved grid switched off (det_group() returns 0: the reversed 3-D grid), to
#           tell the two changes apart; built from a copy under build/det256/keeper-src.
# One forward library (this tree's; the forward is unchanged) serves all three (O and LSE for bench_bwd.py), with
# benchmark_mha_fwd / _bwd next to the branch's library for the host-validated runs. The branch's library also has
# the bf16 (192, 128) batch instances (the other query split, whose deterministic mode changed too: 2 runs).
#
# Steps (each under `timeout`; a failing step does not stop the later ones), about 150-200 s of building on 16 cores
# (12 Hopper instances and the two benchmarks) and about 4 min of running, under 480 s in all:
#   1. build (in parallel: the forward, the three backward libraries; then the branch's benchmark_mha_bwd);
#   2. correctness on the branch: benchmark_mha_bwd -v=1 -kname=1 -deterministic=1 at d256 bf16 (causal top-left and
#      bottom-right, window, GQA 8/2, MQA, s_q 1000 / s_k 777, s_q != s_k; each run is validated against the host
#      reference and rerun once, bitwise), plus a non-deterministic one; the bench shapes' gradients from 3
#      deterministic runs compared bitwise (torch, 4 shapes, GQA among them, thousands of CTAs waiting on each
#      other's turns), each also against the non-deterministic gradients; tests/test_gpu_bwd.py's d256 bf16 and
#      176 x 120 deterministic cases against the NumPy reference, 3 runs bitwise (needs CuPy, else skipped); compute-sanitizer memcheck on 2 deterministic cases, at once;
#   3. A/B: bench/bench_bwd.py --hdims 256 --dtype bf16 (16k tokens, hidden 2048: s = 1k / 4k / 16k, causal and not):
#      base and branch non-deterministic (cuDNN beside the base run), base, branch and keeper deterministic.
# Logs under $OUT; $OUT/summary.txt starts with the key lines and the table.
set -u
cd "$(dirname "$0")/.."
repo=$(pwd)
OUT=${OUT:-$repo/verify_det256_logs}
BASE=${BASE:-}
JOBS=${JOBS:-16}
mkdir -p "$OUT"
work=$repo/build/det256
lib=$work/lib                 # branch: libmha_fwd.so, libmha_bwd.so, benchmark_mha_fwd, benchmark_mha_bwd
klib=$work/keeper/lib         # keeper: libmha_bwd.so
ksrc=$work/keeper-src
blib=${BASE:+$BASE/build/det256/lib}
mkdir -p "$lib" "$klib"
summary=()
note() { summary+=("$1"); echo "== $1"; }
elapsed() { echo "$(( $(date +%s) - $1 )) s"; }
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)
nvidia-smi --query-gpu=name,compute_cap,driver_version,clocks.sm,clocks.max.sm --format=csv >"$OUT/gpu.txt" 2>&1

# (overridable for a dry run of the script on a machine without a GPU, e.g. one instance each, BRANCH_EXTRA= and
# JOBS=1)
BWD_FILTER=${BWD_FILTER:-'bwd_d256_bf16_batch_mask_sm90a_hopper_b64x64,bwd_d256_bf16_batch_nmask_sm90a_hopper_b64x64'}
FWD_FILTER=${FWD_FILTER:-'fwd_d256_bf16_batch_mask_sm90a_hopper_*,fwd_d256_bf16_batch_nmask_sm90a_hopper_*,fwd_d192x128_bf16_batch_mask_sm90a_hopper_*,fwd_d192x128_bf16_batch_nmask_sm90a_hopper_*'}
# the branch's library also holds the (192, 128) instances: the other query split, whose deterministic mode changed too
BRANCH_EXTRA=${BRANCH_EXTRA-'bwd_d192x128_bf16_batch_mask_sm90a_hopper_b64x64,bwd_d192x128_bf16_batch_nmask_sm90a_hopper_b64x64'}

# ---- 1. build ------------------------------------------------------------------------------------------------
# The keeper variant: this tree with det_group() returning 0 (the line below must be found, or the step says so).
rm -rf "$ksrc" && mkdir -p "$ksrc"
tar --exclude=./build --exclude=./.git --exclude=./verify_det256_logs -cf - . | tar -xf - -C "$ksrc"
sel='if (!p.deterministic || Impl::kKeySplit || p.num_sms < 1) return 0;'
if grep -qF "$sel" "$ksrc/csrc/kernels/hopper/fmha_bwd_hopper.cuh"; then
    sed -i "s/if (!p.deterministic || Impl::kKeySplit || p.num_sms < 1) return 0;/return 0;  \/\/ verify_det256: keeper only/" \
        "$ksrc/csrc/kernels/hopper/fmha_bwd_hopper.cuh"
    note "keeper variant: det_group() -> 0 in $ksrc"
else
    note "keeper variant: det_group()'s first line not found; the keeper build will equal the branch"
fi

build() {  # name, tree, lib dir, api, filter, build dir, [--benchmark]
    local name=$1 tree=$2 dir=$3 api=$4 filter=$5 bdir=$6 extra=${7:-}
    local t0
    t0=$(date +%s)
    (cd "$dir" && timeout 400 python3 "$tree/compile.py" --api "$api" --arch sm_90a --profile all \
        --filter "$filter" -j "$JOBS" --build-dir "$bdir" $extra) >"$OUT/build_$name.log" 2>&1
    echo "build $name: rc=$? in $(elapsed "$t0"): $(tail -1 "$OUT/build_$name.log")" >"$OUT/build_$name.status"
}
build fwd "$repo" "$lib" fwd "$FWD_FILTER" "$work/obj-fwd" --benchmark &
build bwd "$repo" "$lib" bwd "$BWD_FILTER${BRANCH_EXTRA:+,$BRANCH_EXTRA}" "$work/obj-bwd" &
build keeper "$ksrc" "$klib" bwd "$BWD_FILTER" "$work/obj-keeper" &
if [ -n "$BASE" ] && [ -f "$BASE/compile.py" ]; then
    mkdir -p "$blib"
    build base "$BASE" "$blib" bwd "$BWD_FILTER" "$BASE/build/det256/obj" &
else
    note "BASE not set (or no compile.py there): no base library, the A/B runs the branch and keeper only"
fi
wait
# benchmark_mha_bwd links the forward library of its directory: once the forward is there
build bwd_bench "$repo" "$lib" bwd "$BWD_FILTER${BRANCH_EXTRA:+,$BRANCH_EXTRA}" "$work/obj-bwd" --benchmark
for s in fwd bwd keeper base bwd_bench; do [ -f "$OUT/build_$s.status" ] && note "$(cat "$OUT/build_$s.status")"; done
note "built in $(elapsed "$start")"

# ---- 2. correctness ------------------------------------------------------------------------------------------
t0=$(date +%s)
bench="$lib/benchmark_mha_bwd"
cases=(
    "-b=2 -h=4 -s=512 -mask=t"                      # causal top-left
    "-b=1 -h=4 -s=600 -s_k=900 -mask=b"             # causal bottom-right, s_q != s_k
    "-b=1 -h=4 -s=700 -mask=t:128,30"               # window
    "-b=2 -h=8 -h_k=2 -s=512 -mask=0"               # GQA 8/2
    "-b=1 -h=4 -h_k=1 -s=640 -s_k=513 -mask=t"      # MQA
    "-b=1 -h=2 -s=1000 -s_k=777 -mask=0"            # odd lengths
    "-b=1 -h=2 -s=1000 -s_k=777 -mask=b"            # odd lengths, bottom-right
    "-b=1 -h=2 -s=333 -s_k=1100 -mask=b:200,0"      # s_q < s_k, window from the bottom right
    "-b=2 -h=4 -h_k=2 -s=777 -s_k=900 -mask=0 -iperm=0 -operm=0"  # b*s*h*d layouts, GQA
    "-d=192 -d_v=128 -b=2 -h=8 -h_k=2 -s=700 -s_k=513 -mask=0"  # the (192, 128) query split, GQA
    "-d=192 -d_v=128 -b=1 -h=4 -s=640 -mask=t"                  # the (192, 128) query split, causal
)
: >"$OUT/valid.log"
nvalid=0
nhopper=0
ncase=0
for c in "${cases[@]}" "-b=2 -h=4 -h_k=2 -s=777 -s_k=900 -mask=t -deterministic=0"; do
    det="-deterministic=1"
    case "$c" in *deterministic=0*) det="" ;; esac
    ncase=$((ncase + 1))
    d="-d=256"
    case "$c" in *-d=*) d="" ;; esac
    timeout 120 "$bench" -prec=bf16 $d $c $det -v=1 -kname=1 -warmup=1 -repeat=2 >"$OUT/case.out" 2>&1
    rc=$?
    grep -q 'valid:y' "$OUT/case.out" && nvalid=$((nvalid + 1))
    grep -q 'mha_bwd -> bwd_d[0-9x]*_bf16_batch_n*mask_sm90a_hopper_b64x64' "$OUT/case.out" && nhopper=$((nhopper + 1))
    { echo "[$c $det] rc=$rc"; cat "$OUT/case.out"; } >>"$OUT/valid.log"
done
rm -f "$OUT/case.out"
note "host-validated bf16 runs, d256 and two (192, 128) (deterministic but the last; each deterministic one rerun and compared bitwise): $nvalid of $ncase valid:y, $nhopper of $ncase on a bwd_*_bf16_batch_(n)mask_sm90a_hopper_b64x64 instance; $OUT/valid.log"

mcases=("-b=1 -h=4 -h_k=2 -s=333 -s_k=517 -mask=b" "-b=2 -h=2 -s=200 -s_k=130 -mask=0")
for i in 0 1; do  # both at once, beside the two checks below (nothing is timed here)
    (timeout 240 compute-sanitizer --tool memcheck --error-exitcode 99 "$bench" -prec=bf16 -d=256 ${mcases[$i]} \
        -deterministic=1 -v=1 -kname=1 -warmup=0 -repeat=1 >"$OUT/memcheck_$i.log" 2>&1
     echo "rc=$?" >>"$OUT/memcheck_$i.log") &
done
timeout 240 python3 - "$lib" >"$OUT/bitwise.log" 2>&1 <<'PY'
# The bench's shapes (bf16, d256, hidden 2048), 3 deterministic backward runs each on freshly poisoned gradients and
# workspace: dQ, dK, dV must agree bit for bit; and the deterministic dQ must be close to the non-deterministic one.
import math, sys
import torch
from mhakit import _capi
libdir = sys.argv[1]
bwd = _capi.load_bwd_library(f"{libdir}/libmha_bwd.so")
fwd = _capi.load_library(f"{libdir}/libmha_fwd.so")
dt = torch.bfloat16
def bhs(t):
    return (t.stride(0), t.stride(1), t.stride(2))
bad = 0
for b, h, hk, s, causal in ((16, 8, 8, 1024, False), (4, 8, 8, 4096, True), (2, 8, 2, 2048, False), (1, 8, 8, 8192, False)):
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn((b, h, s, 256), device="cuda", dtype=dt, generator=g)
    k = torch.randn((b, hk, s, 256), device="cuda", dtype=dt, generator=g)
    v = torch.randn((b, hk, s, 256), device="cuda", dtype=dt, generator=g)
    do = torch.randn((b, h, s, 256), device="cuda", dtype=dt, generator=g)
    o = torch.zeros_like(q)
    lse = torch.empty((b, h, s), device="cuda", dtype=torch.float32)
    mask = dict(mask_type=_capi.MASK_TOP_LEFT if causal else _capi.MASK_NONE, window_left=-1,
                window_right=0 if causal else -1)
    scale = 1 / math.sqrt(256)
    cfg = _capi.make_stream_config(torch.cuda.current_stream().cuda_stream)
    fa = _capi.make_fwd_args(dtype="bf16", q_ptr=q.data_ptr(), k_ptr=k.data_ptr(), v_ptr=v.data_ptr(),
                             o_ptr=o.data_ptr(), lse_ptr=lse.data_ptr(), lse_strides=(lse.stride(0), lse.stride(1)),
                             batch=b, seqlen_q=s, seqlen_k=s, nhead_q=h, nhead_k=hk, hdim_q=256, hdim_v=256,
                             q_strides=bhs(q), k_strides=bhs(k), v_strides=bhs(v), o_strides=bhs(o), scale=scale,
                             **mask)
    assert fwd.mha_fwd_raw(fa, cfg) >= 0, fwd.last_error()
    outs = {}
    for det in (1, 1, 1, 0):
        dq, dk, dv = torch.full_like(q, float("nan")), torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
        ba = _capi.make_bwd_args(dtype="bf16", q_ptr=q.data_ptr(), k_ptr=k.data_ptr(), v_ptr=v.data_ptr(),
                                 o_ptr=o.data_ptr(), lse_ptr=lse.data_ptr(), do_ptr=do.data_ptr(), dq_ptr=dq.data_ptr(),
                                 dk_ptr=dk.data_ptr(), dv_ptr=dv.data_ptr(), batch=b, seqlen_q=s, seqlen_k=s,
                                 nhead_q=h, nhead_k=hk, hdim_q=256, hdim_v=256, q_strides=bhs(q), k_strides=bhs(k),
                                 v_strides=bhs(v), o_strides=bhs(o), do_strides=bhs(do), dq_strides=bhs(dq),
                                 dk_strides=bhs(dk), dv_strides=bhs(dv), lse_strides=(lse.stride(0), lse.stride(1)),
                                 deterministic=det, scale=scale, **mask)
        n = bwd.workspace_size(ba)
        ws = torch.full((max(n, 1),), 0xFF, device="cuda", dtype=torch.uint8)
        ba.workspace_ptr, ba.workspace_bytes = ws.data_ptr(), n
        name = bwd.kernel_name(ba)
        assert bwd.mha_bwd_raw(ba, cfg) >= 0, bwd.last_error()
        torch.cuda.synchronize()
        outs.setdefault(det, []).append((dq, dk, dv))
    runs = outs[1]
    same = all(torch.equal(runs[0][i].view(torch.int16), r[i].view(torch.int16)) for r in runs[1:] for i in range(3))
    finite = all(bool(torch.isfinite(t).all()) for t in runs[0])
    # relative to the gradient's largest magnitude: the two modes differ only in the order of dQ's fp32 adds
    err = max(float((runs[0][i].float() - outs[0][0][i].float()).abs().max() / outs[0][0][i].float().abs().max())
              for i in range(3))
    ok = same and finite and err < 1e-2
    bad += not ok
    print(f"b={b} h={h}/{hk} s={s} causal={int(causal)} {name}: 3 deterministic runs bitwise equal: {same}; finite: "
          f"{finite}; max |det - non-det| / max |non-det| over dQ, dK, dV: {err:.2e} -> {'ok' if ok else 'FAIL'}", flush=True)
print("bitwise: all ok" if bad == 0 else f"bitwise: {bad} FAILED")
sys.exit(1 if bad else 0)
PY
note "3-run bitwise check of the bench shapes: rc=$? $(tail -1 "$OUT/bitwise.log")"

MHAKIT_TEST_LIB_DIR=$lib timeout 180 python3 -m pytest -q -x tests/test_gpu_bwd.py \
    -k "(deterministic_hopper and bf16 and 256) or (unequal_head_dims_on_hopper and 176)" >"$OUT/pytest_det.log" 2>&1
note "tests/test_gpu_bwd.py deterministic d256 bf16 and 176 x 120 (on 192 x 128): rc=$? $(tail -1 "$OUT/pytest_det.log")"

wait  # the memcheck runs
for i in 0 1; do
    note "memcheck [${mcases[$i]} -deterministic=1]: $(tail -1 "$OUT/memcheck_$i.log") $(grep -o 'ERROR SUMMARY: [0-9]* errors*' "$OUT/memcheck_$i.log" | tail -1), $(grep -o 'valid:[yn]' "$OUT/memcheck_$i.log" | tail -1), $(grep -o 'mha_bwd -> [a-z0-9_]*' "$OUT/memcheck_$i.log" | head -1)"
done
note "correctness in $(elapsed "$t0")"

# ---- 3. A/B timing -------------------------------------------------------------------------------------------
t0=$(date +%s)
bench_run() {  # tag, bwd lib, peers, [--deterministic]
    local tag=$1 blib_=$2 peers=$3 det=${4:-}
    if [ ! -f "$blib_" ]; then
        note "bench $tag: no library $blib_"
        return
    fi
    timeout 150 python3 bench/bench_bwd.py --lib "$blib_" --fwd-lib "$lib/libmha_fwd.so" --hdims 256 --dtype bf16 \
        --peers "$peers" $det --json "$OUT/bench_$tag.json" >"$OUT/bench_$tag.md" 2>"$OUT/bench_$tag.err"
    note "bench $tag: rc=$? ($(grep -c 'check ok' "$OUT/bench_$tag.err") rows checked ok, $(grep -c 'FAIL' "$OUT/bench_$tag.err") FAIL)"
}
[ -n "$blib" ] && bench_run base_nd "$blib/libmha_bwd.so" cudnn
bench_run branch_nd "$lib/libmha_bwd.so" ""
[ -n "$blib" ] && bench_run base_det "$blib/libmha_bwd.so" "" --deterministic
bench_run branch_det "$lib/libmha_bwd.so" "" --deterministic
bench_run keeper_det "$klib/libmha_bwd.so" "" --deterministic
note "timing in $(elapsed "$t0")"

python3 - "$OUT" >"$OUT/table.md" 2>&1 <<'PY'
import json, os, sys
out = sys.argv[1]
def rows(tag):
    p = os.path.join(out, f"bench_{tag}.json")
    if not os.path.exists(p):
        return {}
    return {(r["seqlen"], bool(r["causal"])): r for r in json.load(open(p))["rows"]}
runs = {t: rows(t) for t in ("base_nd", "branch_nd", "base_det", "branch_det", "keeper_det")}
keys = sorted({k for r in runs.values() for k in r})
def tf(tag, k, key="mhakit_tflops"):
    v = runs[tag].get(k, {}).get(key)
    return v
def f(v):
    return "-" if v is None else f"{v:.1f}"
def ratio(a, b):
    return "-" if a is None or b is None else f"{a / b:.2f}"
print("| s | causal | cuDNN | base nd | branch nd | base det | branch det | keeper det | base det/nd | branch det/nd | keeper det/branch nd |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for k in keys:
    s, c = k
    v = {t: tf(t, k) for t in runs}
    print(f"| {s} | {'yes' if c else 'no'} | {f(tf('base_nd', k, 'cudnn_tflops'))} | {f(v['base_nd'])} | {f(v['branch_nd'])} "
          f"| {f(v['base_det'])} | {f(v['branch_det'])} | {f(v['keeper_det'])} | {ratio(v['base_det'], v['base_nd'])} "
          f"| {ratio(v['branch_det'], v['branch_nd'])} | {ratio(v['keeper_det'], v['branch_nd'])} |")
fails = [f"{t} s={k[0]} causal={int(k[1])}" for t, r in runs.items() for k, row in r.items() if row.get("verified") is False]
print("\nrows failing the fp32 check: " + (", ".join(fails) if fails else "none"))
PY
note "TFLOPS table (bf16 d256, 16k tokens, hidden 2048): $OUT/table.md"
note "whole script in $(elapsed "$start")"

{
    echo "verify_det256 ($(date -u +%FT%TZ)), $(tail -1 "$OUT/gpu.txt")"
    printf '%s\n' "${summary[@]}"
    echo
    cat "$OUT/table.md"
    echo
    echo "host-validated runs:"
    cat "$OUT/valid.log"
    echo
    cat "$OUT/bitwise.log"
} >"$OUT/summary.txt"
echo
cat "$OUT/summary.txt"
