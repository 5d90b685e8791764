#!/usr/bin/env bash
# Branch pfwd (issue 9: the s = 1024 forward rows): the Hopper forward's persistent grid with a dynamic tile counter
# (DynamicPersistentScheduler, catalogue `persistent` on the d64 / d128 / d256 tiles: batch-mode plain fp16 / bf16
# instances), verified on the H200 from the repository root of an export of this branch:
#
#   OUT=/some/logs BASE=/path/to/an/export/of/main@b6e7c03 bash tools/verify_pfwd.sh
#
# 1. build, here and in $BASE at once (-j $PFWD_JOBS each, default 8: 16 in all), the bf16 batch Hopper forward
#    instances of d64 (nmask 192 x 128, mask 192 x 128 and the ranged 128 x 128), d128 (128 x 128) and d256
#    (128 x 64), mask and nmask, with benchmark_mha_fwd, into build/pfwd/lib (objects: build/pfwd/obj) under each
#    tree: 7 Hopper instances per tree, no generic fallback (every case below is one the Hopper family serves).
# 2. correctness (branch): benchmark_mha_fwd -prec=bf16 -v=1 -kname=1 -lse=1, each case after -warmup=2 -repeat=3
#    launches on one stream with one workspace (the benchmark zeroes it once: a counter left stale by a launch makes
#    the next one skip tiles, which the host check sees): causal top-left / bottom-right, windows, GQA / MQA, odd
#    lengths, s_q != s_k, rows without keys (bottom-right with s_q > s_k), fewer work tiles than SMs (b*h*tiles <
#    132) and many more, 3 consumer warpgroups (d64 nmask 192 x 128), and -workspace=0 (no workspace: the one-tile
#    grid of the same kernel). Each line must say valid:y and name the instance CASES expects. compute-sanitizer
#    memcheck on 2 cases, racecheck on 1 (shared-memory hazards between the tile hand-over and the pipelines).
#    The same cases on the base for reference (its instances have no persistent grid).
# 3. A/B: bench/bench_fwd.py --dtype bf16 --peers cudnn (the 18 bf16 rows: d64 / d128 / d256 x s = 1k / 4k / 16k x
#    causal / not) on the base's and the branch's library, interleaved, up to $PFWD_REPS times (default 2; the second
#    round only while the script is under 230 s); the table: per row the median TFLOPS, branch / base, cuDNN,
#    branch / cuDNN, the kernels.
# Logs under $OUT (default ./verify_pfwd_logs); $OUT/summary.txt has the key lines first, then the table.
# Expected time on the H200 machine: build ~150 s (14 Hopper instances at once), correctness + sanitizers <= 90 s
# (at once), A/B ~4 x 30 s: ~320 s.
set -u
cd "$(dirname "$0")/.."
BR=$(pwd)
OUT=${OUT:-$BR/verify_pfwd_logs}
BASE=${BASE:-}
JOBS=${PFWD_JOBS:-8}
REPS=${PFWD_REPS:-2}
mkdir -p "$OUT"
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"
note() { echo "$1" | tee -a "$SUMMARY"; }
T0=$(date +%s)
since() { echo "$(( $(date +%s) - T0 )) s"; }
export PYTHONPATH="$BR${PYTHONPATH:+:$PYTHONPATH}"

FILTER='fwd_d64_bf16_batch_nmask_sm90a_hopper_b192x128,fwd_d64_bf16_batch_mask_sm90a_hopper_b192x128'
FILTER+=',fwd_d64_bf16_batch_mask_sm90a_hopper_b128x128'
FILTER+=',fwd_d128_bf16_batch_nmask_sm90a_hopper_b128x128,fwd_d128_bf16_batch_mask_sm90a_hopper_b128x128'
FILTER+=',fwd_d256_bf16_batch_nmask_sm90a_hopper_b128x64,fwd_d256_bf16_batch_mask_sm90a_hopper_b128x64'
FILTER=${PFWD_FILTER:-$FILTER}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv >"$OUT/gpu.txt" 2>&1
note "== verify_pfwd: branch $(git -C "$BR" rev-parse --short HEAD 2>/dev/null || echo '(export)') vs base ${BASE:-none}; $(head -2 "$OUT/gpu.txt" | tail -1)"

# ---- 1. build ----------------------------------------------------------------------------------------------------
build() {  # tree tag
    local tree=$1 tag=$2
    mkdir -p "$tree/build/pfwd/lib"
    (cd "$tree/build/pfwd/lib" && timeout 280 python3 "$tree/compile.py" --api fwd --arch sm_90a --profile all \
        --filter "$FILTER" --benchmark -j "$JOBS" --build-dir "$tree/build/pfwd/obj") >"$OUT/build_$tag.log" 2>&1
    echo "rc=$?" >>"$OUT/build_$tag.log"
}
trees=(branch)
[ -n "$BASE" ] && [ -f "$BASE/compile.py" ] && trees+=(base)
[ -n "$BASE" ] && [ ! -f "$BASE/compile.py" ] && note "BASE=$BASE has no compile.py: no A/B"
dir_of() { [ "$1" = base ] && echo "$BASE" || echo "$BR"; }
for t in "${trees[@]}"; do build "$(dir_of "$t")" "$t" & done
wait
for t in "${trees[@]}"; do
    note "build $t: $(tail -1 "$OUT/build_$t.log"), $(grep -c 'gen/instances/' "$OUT/build_$t.log") instance compiles; $(grep -m1 '^\[mhakit\] fwd:' "$OUT/build_$t.log" | cut -c1-120)"
done
note "built at $(since)"
exe() { echo "$(dir_of "$1")/build/pfwd/lib/benchmark_mha_fwd"; }
lib() { echo "$(dir_of "$1")/build/pfwd/lib/libmha_fwd.so"; }

# ---- 2. correctness ----------------------------------------------------------------------------------------------
# "expected instance (suffix)|arguments". Work tiles = b x h x ceil(s_q / block_m); the H200 has 132 SMs.
CASES=(
    "d128_bf16_batch_mask_sm90a_hopper_b128x128|-d=128 -b=2 -h=8 -s=1000 -mask=t"
    "d128_bf16_batch_mask_sm90a_hopper_b128x128|-d=128 -b=2 -h=4 -s=300 -s_k=1000 -mask=b"
    "d128_bf16_batch_mask_sm90a_hopper_b128x128|-d=128 -b=1 -h=4 -s=1000 -s_k=300 -mask=b"
    "d128_bf16_batch_mask_sm90a_hopper_b128x128|-d=128 -b=2 -h=6 -h_k=2 -s=777 -s_k=1500 -mask=t:128,16"
    "d128_bf16_batch_mask_sm90a_hopper_b128x128|-d=128 -b=1 -h=2 -s=256 -mask=t"
    "d128_bf16_batch_mask_sm90a_hopper_b128x128|-d=128 -b=2 -h=12 -h_k=4 -s=1024 -mask=t"
    "d128_bf16_batch_mask_sm90a_hopper_b128x128|-d=128 -b=2 -h=8 -s=1000 -mask=t -workspace=0"
    "d128_bf16_batch_nmask_sm90a_hopper_b128x128|-d=128 -b=2 -h=8 -h_k=1 -s=513 -s_k=2049"
    "d128_bf16_batch_nmask_sm90a_hopper_b128x128|-d=120 -b=3 -h=4 -s=1111 -s_k=17 -iperm=0 -operm=0"
    "d64_bf16_batch_mask_sm90a_hopper_b128x128|-d=64 -b=4 -h=8 -s=1024 -mask=t"
    "d64_bf16_batch_mask_sm90a_hopper_b128x128|-d=64 -b=2 -h=4 -h_k=1 -s=1000 -s_k=1200 -mask=b:64,32"
    "d64_bf16_batch_mask_sm90a_hopper_b192x128|-d=64 -b=2 -h=8 -s=2500 -mask=t"
    "d64_bf16_batch_nmask_sm90a_hopper_b192x128|-d=64 -b=2 -h=8 -s=1500 -s_k=700"
    "d64_bf16_batch_nmask_sm90a_hopper_b192x128|-d=64 -b=1 -h=2 -s=100 -workspace=0"
    "d256_bf16_batch_mask_sm90a_hopper_b128x64|-d=256 -b=2 -h=8 -h_k=2 -s=1024 -mask=t"
    "d256_bf16_batch_mask_sm90a_hopper_b128x64|-d=256 -b=1 -h=2 -s=1500 -s_k=600 -mask=b"
    "d256_bf16_batch_nmask_sm90a_hopper_b128x64|-d=256 -b=2 -h=4 -s=1033 -s_k=999"
)
check_case() {  # tree "want|args" -> VALID|INVALID|WRONGKERNEL, the kernel, the case
    local t=$1 want=${2%%|*} args=${2#*|} line kern
    # shellcheck disable=SC2086
    line=$(timeout 120 "$(exe "$t")" -prec=bf16 -lse=1 -v=1 -kname=1 -warmup=2 -repeat=3 $args 2>&1)
    echo "$args => $line" >>"$OUT/correct_${t}_full.log"
    kern=$(echo "$line" | grep -o 'fwd_d[0-9]*_[a-z0-9_]*' | head -1)
    if ! echo "$line" | grep -q 'valid:y'; then echo "INVALID     ${kern:-?} $args"
    elif [[ "$kern" != *"$want" ]]; then echo "WRONGKERNEL ${kern:-?} (want *$want) $args"
    else echo "VALID       ${kern:-?} $args"; fi
}
correct() {  # tree -> $OUT/correct_<tree>.log
    local t=$1 c log=$OUT/correct_$1.log
    : >"$log"
    for c in "${CASES[@]}"; do check_case "$t" "$c" >>"$log"; done
}
sanitize() {  # tool tag args
    # shellcheck disable=SC2086
    timeout 90 compute-sanitizer --tool "$1" --error-exitcode 99 "$(exe branch)" -prec=bf16 -lse=1 -v=1 -kname=1 \
        -warmup=1 -repeat=1 $3 >"$OUT/$1_$2.log" 2>&1
    echo "rc=$?" >>"$OUT/$1_$2.log"
}
if [ -x "$(exe branch)" ]; then
    sanitize memcheck causal "-d=128 -b=2 -h=4 -h_k=2 -s=1000 -s_k=1200 -mask=b" &
    sanitize memcheck d64nmask "-d=64 -b=2 -h=8 -s=700 -s_k=333" &
    sanitize racecheck causal "-d=128 -b=1 -h=2 -s=600 -mask=t" &
    [[ " ${trees[*]} " == *" base "* ]] && [ -x "$(exe base)" ] && correct base &
    correct branch
    wait
    note "correctness (branch): $(grep -c '^VALID' "$OUT/correct_branch.log") valid, $(grep -c '^INVALID' "$OUT/correct_branch.log") invalid, $(grep -c '^WRONGKERNEL' "$OUT/correct_branch.log") on another instance, of ${#CASES[@]}; kernels: $(awk '{print $2}' "$OUT/correct_branch.log" | sort | uniq -c | tr -s ' \n' ' ')"
    grep -E '^(INVALID|WRONGKERNEL)' "$OUT/correct_branch.log" | sed 's/^/  /' | tee -a "$SUMMARY"
    for m in memcheck_causal memcheck_d64nmask racecheck_causal; do
        note "$m: $(grep -Eo '(ERROR|RACECHECK) SUMMARY: [0-9]* (errors*|hazards*)' "$OUT/$m.log" | head -1) $(tail -1 "$OUT/$m.log"), $(grep -o 'valid:[yn]' "$OUT/$m.log" | head -1), $(grep -o 'fwd_d[0-9]*_[a-z0-9_]*' "$OUT/$m.log" | head -1)"
    done
    if [ -f "$OUT/correct_base.log" ]; then
        note "correctness (base, for reference): $(grep -c '^VALID' "$OUT/correct_base.log") valid, $(grep -c '^INVALID' "$OUT/correct_base.log") invalid (-workspace is the branch's argument: the base refuses those lines)"
    fi
else
    note "correctness: no benchmark_mha_fwd on the branch (build failed)"
fi
note "correctness done at $(since)"

# ---- 3. A/B ------------------------------------------------------------------------------------------------------
for rep in $(seq 1 "$REPS"); do
    if [ "$rep" -gt 1 ] && [ $(( $(date +%s) - T0 )) -gt 230 ]; then note "bench rep $rep: skipped at $(since)"; break; fi
    for t in "${trees[@]}"; do
        [ -f "$(lib "$t")" ] || { note "bench $t: no library"; continue; }
        timeout 80 python3 "$BR/bench/bench_fwd.py" --lib "$(lib "$t")" --dtype bf16 --peers cudnn \
            --json "$OUT/bench_${t}_$rep.json" >"$OUT/bench_${t}_$rep.md" 2>"$OUT/bench_${t}_$rep.err"
        note "bench $t rep $rep: rc=$? at $(since), $(grep -c 'FAIL' "$OUT/bench_${t}_$rep.md") FAIL rows"
    done
done
timeout 30 python3 - "$OUT" <<'PY' | tee -a "$SUMMARY"
import glob, json, os, statistics, sys
out = sys.argv[1]
def rows(tree):
    got = {}
    for path in sorted(glob.glob(os.path.join(out, f"bench_{tree}_*.json"))):
        for r in json.load(open(path))["rows"]:
            got.setdefault((int(str(r["hdim"]).split("x")[0]), r["seqlen"], bool(r["causal"])), []).append(r)
    return got
base, branch = rows("base"), rows("branch")
def med(rs, key):
    vals = [r[key] for r in rs if r.get(key)]
    return statistics.median(vals) if vals else None
fmt = lambda v: "-" if v is None else f"{v:.1f}"
print("\n| hdim | seqlen | causal | base TFLOPS | branch TFLOPS | branch/base | cuDNN | branch/cuDNN | kernel (branch) | checked |")
print("|---|---|---|---|---|---|---|---|---|---|")
ratios = []
for key in sorted(set(base) | set(branch)):
    b, n = base.get(key, []), branch.get(key, [])
    tb, tn = med(b, "mhakit_tflops"), med(n, "mhakit_tflops")
    cu = med(b + n, "cudnn_tflops")
    if tn and cu:
        ratios.append(tn / cu)
    kern = ",".join(sorted({(r.get("kernel") or "?").replace("fwd_", "").replace("_sm90a_hopper", "") for r in n})) or "-"
    ok = all(r.get("verified") for r in b + n)
    print(f"| {key[0]} | {key[1]} | {'yes' if key[2] else 'no'} | {fmt(tb)} | {fmt(tn)} | "
          f"{f'{tn / tb:.3f}' if tb and tn else '-'} | {fmt(cu)} | {f'{tn / cu:.2f}x' if tn and cu else '-'} | "
          f"{kern} | {'y' if ok else 'n'} |")
if ratios:
    print(f"\nbranch / cuDNN: min {min(ratios):.2f}x, median {statistics.median(ratios):.2f}x, "
          f"{sum(r >= 1.0 for r in ratios)} of {len(ratios)} rows >= 1.0x")
PY
note "done at $(since)"
