#!/usr/bin/env bash
# Branch review2 (two review items, no behaviour change intended): (1) the Hopper forward's consumers make the
# staged-bias test (bias_rows) once per CTA (staged_bias) instead of per key tile; (2) common/mma_fragment.cuh
# (MmaFragLane), the m16n8 fragment coordinates the generic kernels and store_randval used to write out. On the
# 2-core machine (nvcc 13.0): the generic fwd / bwd d128 bf16 _mods SASS is identical to main's, the Hopper d64 /
# d256 _mods forwards are identical, the d128 one has the same count (13728), registers (168) and spills (16 / 12).
# Run on the H200 from the repository root of an export of this branch:
#
#   OUT=/some/logs BASE=/path/to/an/export/of/main@e88b63e bash tools/verify_review2.sh
#
# 1. build (all at once, -j $REVIEW2_JOBS in all, default 16), into build/review2/lib under each tree (objects in
#    build/review2/obj_<api>): branch forward: the bf16 masked _mods instances the smoke sections below need (d128
#    Hopper + generic, d256 and (192, 128) Hopper + generic, the d64 generic that runs head dim 59; batch and group)
#    and the plain d128 batch masked Hopper instance (the cost loop's reference): 15 instances, 7 Hopper; branch backward:
#    the bf16 masked _mods d128 (Hopper + generic) and d64 generic instances, 6; base: the d128 bf16 batch masked
#    Hopper forward, plain and _mods, 2. The benchmarks too (the backward's links the forward library, so it is
#    linked in a second, short step).
# 2. correctness (branch): the smoke grid's sections with the built benchmarks (bf16 only, modifier head dims 59 and
#    128: MHA_SMOKE_PRECS=bf16 MHA_MODS_HDIMS="59 128"): smoke_test_fwd.sh mods,hmods,dropout (112 runs) and
#    smoke_test_bwd.sh mods,dropout (56 runs; its hmods section would need 8 more Hopper backward instances, code this
#    branch does not touch: REVIEW2_BWD_SECTIONS=mods,hmods,dropout runs it where they are built), -v=1 -kname=1, every
#    run must exit 0; the summary counts the instances the runs named. compute-sanitizer memcheck on 2 cases: the
#    d128 Hopper _mods forward with a staged bias (bf16 e, s_k = 520: 16-byte rows) and the generic backward at head
#    dim 59 with dropout and bias e:1.
# 3. the modifier cost loop base vs branch (docs/PERFORMANCE.md "Staged elementwise bias"): benchmark_mha_fwd
#    -prec=bf16 -b=1 -h=16 -s=4096 -d=128 -warmup=10 -repeat=30, plain and -bias=e, no mask and causal, base and
#    branch interleaved, $REVIEW2_REPS times (default 3); medians, the bias's cost over plain and branch / base.
#    Only masked instances are built, so the unmasked calls run on them too (the plain unmasked one is not the
#    default library's nmask instance: compare base with branch here, not with the PERFORMANCE.md table's plain).
# Logs under $OUT (default ./verify_review2_logs); $OUT/summary.txt has the key lines first, then the table.
# Expected time on the H200 machine: build ~120 s (the 7 + 2 Hopper forwards and 2 Hopper backwards in parallel),
# smoke + memcheck ~70 s (at once), cost loop ~24 runs x 2 s; ~250 s in all.
set -u
cd "$(dirname "$0")/.."
BR=$(pwd)
OUT=${OUT:-$BR/verify_review2_logs}
BASE=${BASE:-}
JOBS=${REVIEW2_JOBS:-16}
REPS=${REVIEW2_REPS:-3}
mkdir -p "$OUT"
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"
note() { echo "$1" | tee -a "$SUMMARY"; }
T0=$(date +%s)
since() { echo "$(( $(date +%s) - T0 )) s"; }

FWD_FILTER=${REVIEW2_FWD_FILTER:-'fwd_d64_bf16_*_mask_mods_sm90a_generic*,fwd_d128_bf16_*_mask_mods_sm90a_*,fwd_d128_bf16_batch_mask_sm90a_hopper*,fwd_d256_bf16_*_mask_mods_sm90a_*,fwd_d192x128_bf16_*_mask_mods_sm90a_*'}
BWD_FILTER=${REVIEW2_BWD_FILTER:-'bwd_d64_bf16_*_mask_mods_sm90a_generic*,bwd_d128_bf16_*_mask_mods_sm90a_*'}
BASE_FILTER=${REVIEW2_BASE_FILTER:-'fwd_d128_bf16_batch_mask_mods_sm90a_hopper*,fwd_d128_bf16_batch_mask_sm90a_hopper*'}
BWD_SECTIONS=${REVIEW2_BWD_SECTIONS:-mods,dropout}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv >"$OUT/gpu.txt" 2>&1
note "== verify_review2: branch $(git -C "$BR" rev-parse --short HEAD 2>/dev/null || echo '(export)') vs base ${BASE:-none}; $(head -2 "$OUT/gpu.txt" | tail -1)"

# ---- 1. build ----------------------------------------------------------------------------------------------------
build() {  # tree tag api filter jobs [bench: 1 builds benchmark_mha_<api>]; objects in build/review2/obj_<api>
    local tree=$1 tag=$2 api=$3 filter=$4 jobs=$5 bench=()
    [ "${6:-1}" = 1 ] && bench=(--benchmark)
    [ "$jobs" -ge 1 ] || jobs=1
    mkdir -p "$tree/build/review2/lib"
    (cd "$tree/build/review2/lib" && timeout 300 python3 "$tree/compile.py" --api "$api" --arch sm_90a --profile all \
        --filter "$filter" ${bench[@]+"${bench[@]}"} -j "$jobs" --build-dir "$tree/build/review2/obj_$api") \
        >"$OUT/build_$tag.log" 2>&1
    echo "rc=$?" >>"$OUT/build_$tag.log"
}
HAVE_BASE=0
if [ -n "$BASE" ] && [ -f "$BASE/compile.py" ]; then HAVE_BASE=1; elif [ -n "$BASE" ]; then note "BASE=$BASE has no compile.py: no A/B"; fi
# the branch's forward and backward objects and the base's forward at once; then the backward benchmark (it links
# libmha_fwd.so from the same directory), its objects already built
build "$BR" branch_fwd fwd "$FWD_FILTER" $(( JOBS * 5 / 8 )) &
build "$BR" branch_bwd_objs bwd "$BWD_FILTER" $(( JOBS * 2 / 8 )) 0 &
[ "$HAVE_BASE" = 1 ] && build "$BASE" base_fwd fwd "$BASE_FILTER" $(( JOBS / 8 )) &
wait
build "$BR" branch_bwd bwd "$BWD_FILTER" "$JOBS"
for t in branch_fwd branch_bwd_objs branch_bwd base_fwd; do
    [ -f "$OUT/build_$t.log" ] || continue
    note "build $t: $(tail -1 "$OUT/build_$t.log"), $(grep -m1 -o '[0-9]* instances for sm_90a' "$OUT/build_$t.log")"
done
note "built at $(since)"
LIB=$BR/build/review2/lib
BLIB=$BASE/build/review2/lib

# ---- 2. correctness ----------------------------------------------------------------------------------------------
smoke() {  # api sections
    local api=$1 only=$2
    (MHA_SMOKE_ONLY=$only MHA_SMOKE_PRECS=bf16 MHA_MODS_HDIMS="59 128" MHA_FP8=0 MHA_TIMEOUT=90 \
        BENCH="$LIB/benchmark_mha_$api" timeout 200 bash "$BR/smoke_tests/smoke_test_$api.sh" -k -j 6) \
        >"$OUT/smoke_$api.log" 2>&1
    echo "rc=$?" >>"$OUT/smoke_$api.log"
}
memcheck() {  # tag api args
    # shellcheck disable=SC2086
    timeout 200 compute-sanitizer --tool memcheck --error-exitcode 99 "$LIB/benchmark_mha_$2" -prec=bf16 -v=1 \
        -kname=1 -warmup=0 -repeat=1 $3 >"$OUT/memcheck_$1.log" 2>&1
    echo "rc=$?" >>"$OUT/memcheck_$1.log"
}
smoke fwd mods,hmods,dropout &
smoke bwd "$BWD_SECTIONS" &
memcheck fwd_staged_bias fwd "-d=128 -b=1 -h=4 -h_k=2 -s=300 -s_k=520 -mask=t -bias=e -lse=1" &
memcheck bwd_generic_dropout bwd "-d=59 -b=1 -h=2 -s=130 -s_k=251 -mask=t:64,10 -p_drop=0.2 -bias=e:1 -dbias=1" &
wait
for api in fwd bwd; do
    f=$OUT/smoke_$api.log
    note "smoke $api: $(grep -o "smoke_test_$api: [0-9]* passed, [0-9]* failed" "$f" | tail -1) $(tail -1 "$f")"
    note "  instances: $(grep -o '[fb]wd_d[0-9x]*_bf16_[a-z0-9_]*' "$f" | sort | uniq -c | sort -rn | awk '{printf "%s %s; ", $1, $2}')"
    grep -iE 'FAIL|valid:n' "$f" | head -6 | sed 's/^/  /' | tee -a "$SUMMARY"
done
for m in fwd_staged_bias bwd_generic_dropout; do
    f=$OUT/memcheck_$m.log
    note "memcheck $m: $(grep -o 'ERROR SUMMARY: [0-9]* errors*' "$f" | head -1) $(tail -1 "$f"), $(grep -o 'valid:[yn]' "$f" | head -1), $(grep -o '[fb]wd_d[0-9x]*_bf16_[a-z0-9_]*' "$f" | sort -u | tr '\n' ' ')"
done
note "correctness done at $(since)"

# ---- 3. cost loop: base vs branch --------------------------------------------------------------------------------
COST=$OUT/cost.log
: >"$COST"
trees=(branch)
[ "$HAVE_BASE" = 1 ] && [ -x "$BLIB/benchmark_mha_fwd" ] && trees=(base branch)
for rep in $(seq 1 "$REPS"); do
    for mask in none t; do
        for t in "${trees[@]}"; do
            for call in plain bias_e; do
                exe=$LIB/benchmark_mha_fwd
                [ "$t" = base ] && exe=$BLIB/benchmark_mha_fwd
                args=(-prec=bf16 -b=1 -h=16 -s=4096 -d=128 -warmup=10 -repeat=30 -kname=1)
                [ "$mask" = t ] && args+=(-mask=t)
                [ "$call" = bias_e ] && args+=(-bias=e)
                line=$(timeout 60 "$exe" "${args[@]}" 2>&1 | tr '\n' ' ')
                echo "$t $mask $call rep$rep | $line" >>"$COST"
            done
        done
    done
done
timeout 30 python3 - "$COST" <<'PY' | tee -a "$SUMMARY"
import re, statistics, sys
runs = {}
kern = {}
for line in open(sys.argv[1]):
    head, _, rest = line.partition("|")
    t, mask, call, _ = head.split()
    m = re.search(r"([0-9.]+) ms", rest)
    if m:
        runs.setdefault((t, mask, call), []).append(float(m.group(1)))
    k = re.search(r"fwd_d128_bf16_[a-z0-9_]*", rest)
    if k:
        kern[(t, mask, call)] = k.group(0)
print("cost loop (median ms of the runs; bf16 b=1 h=16 s=4096 d=128):")
print("| mask | call | base ms | branch ms | branch / base | base cost | branch cost | kernel (branch) |")
print("|---|---|---|---|---|---|---|---|")
med = {k: statistics.median(v) for k, v in runs.items()}
for mask in ("none", "t"):
    for call in ("plain", "bias_e"):
        b, r = med.get(("base", mask, call)), med.get(("branch", mask, call))
        pb, pr = med.get(("base", mask, "plain")), med.get(("branch", mask, "plain"))
        f = lambda x: f"{x:.3f}" if x else "-"
        ratio = f"{r / b:.3f}" if b and r else "-"
        cb = f"{100 * (b / pb - 1):+.1f} %" if b and pb and call != "plain" else ""
        cr = f"{100 * (r / pr - 1):+.1f} %" if r and pr and call != "plain" else ""
        print(f"| {mask} | {call} | {f(b)} | {f(r)} | {ratio} | {cb} | {cr} | {kern.get(('branch', mask, call), '?')} |")
print("runs per cell: " + ", ".join(f"{'/'.join(k)}={len(v)}" for k, v in sorted(runs.items())))
PY
note "done at $(since)"
