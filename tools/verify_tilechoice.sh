#!/usr/bin/env bash
# Branch tilechoice (issue 9, "Tile choice by shape": the runtime picks the forward tile by max_seqlen_q from the
# catalogue's ranges; hdim 64 masked runs 128 x 128 up to 1024 query rows, 192 x 128 beyond; 2048 until the
# H200 run, which measured the 128-row tile 3.5 % slower at s = 2048), verified on the H200
# from the repository root of an export of this branch:
#
#   OUT=/some/logs BASE=/path/to/an/export/of/main@<this branch's start> bash tools/verify_tilechoice.sh
#
# 1. build, in this tree and in $BASE at once (-j $TILECHOICE_JOBS each, default 8: 16 in all), the d64 bf16 forward
#    instances: Hopper batch mask / nmask and group mask (on this branch each masked one twice: the default
#    192 x 128 tile and the ranged 128 x 128 one) and their generic fallbacks, with benchmark_mha_fwd, into
#    build/tilechoice/lib (objects in build/tilechoice/obj) under each tree: 5 + 3 Hopper instances, 3 + 3 generic.
# 2. correctness (branch; the same cases on the base, for reference): benchmark_mha_fwd -prec=bf16 -d=64 -v=1
#    -kname=1, causal at s = 1024, 2048, 2049, 4096 (and bottom-right / windowed, unmasked, and group mode with
#    max_seqlen_q 2048 and 2049); each line must say valid:y and name the instance the range gives (CHOICE: the
#    expected name, checked against the one the library printed). compute-sanitizer memcheck on 2 cases (batch
#    s = 1000 x 1200 bottom-right, group 2048 / 333 / 517), both on the 128 x 128 instances.
# 3. A/B: bench/bench_fwd.py --hdims 64 --seqlens 1024,2048,4096,16384 --dtype bf16 --peers cudnn on the base's and
#    the branch's library, interleaved, $TILECHOICE_REPS times (default 2); the table gives per row the median TFLOPS
#    of each, branch / base, cuDNN, and the kernels (the branch's must be b128x128 for causal s <= 1024).
#    Then group mode: benchmark_mha_fwd's own timing, base vs branch, 16k packed tokens causal (16 x 1024, 8 x 2048,
#    8 mixed <= 2048, 4 x 4096), $TILECHOICE_REPS times interleaved.
# 4. candidates (issue 9's measured table, extended), while time is left (each run within 470 s): the catalogue's
#    short-sequence candidates (bf16 batch masked: d64 128 x 96, d128 128 x 160, d256 128 x 96; built in step 1 into
#    build/tilechoice/cand with --profile candidates, one library) against the tiles in use (d128 / d256 masked
#    defaults in build/tilechoice/ref; d64 from step 3), bench_fwd.py causal s = 1024 / 2048 --peers cudnn.
# Logs under $OUT (default ./verify_tilechoice_logs); $OUT/summary.txt has the key lines first, then the tables.
# Expected time on the H200 machine: build ~150 s (13 Hopper instances in all, at once), correctness + memcheck
# ~60 s, A/B ~2 x 2 x 40 s, group mode ~40 s, candidates ~40 s (~400 s in all).
set -u
cd "$(dirname "$0")/.."
BR=$(pwd)
OUT=${OUT:-$BR/verify_tilechoice_logs}
BASE=${BASE:-}
JOBS=${TILECHOICE_JOBS:-8}
REPS=${TILECHOICE_REPS:-2}
mkdir -p "$OUT"
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"
note() { echo "$1" | tee -a "$SUMMARY"; }
T0=$(date +%s)
since() { echo "$(( $(date +%s) - T0 )) s"; }
export PYTHONPATH="$BR${PYTHONPATH:+:$PYTHONPATH}"

# Every d64 bf16 Hopper instance of these signatures (both tiles where the catalogue has two), generic fallbacks.
FILTER='fwd_d64_bf16_batch_mask_sm90a_hopper,fwd_d64_bf16_batch_nmask_sm90a_hopper,fwd_d64_bf16_group_mask_sm90a_hopper'
FILTER+=',fwd_d64_bf16_batch_mask_sm90a_generic,fwd_d64_bf16_batch_nmask_sm90a_generic,fwd_d64_bf16_group_mask_sm90a_generic'
FILTER=${TILECHOICE_FILTER:-$FILTER}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv >"$OUT/gpu.txt" 2>&1
note "== verify_tilechoice: branch $(git -C "$BR" rev-parse --short HEAD 2>/dev/null || echo '(export)') vs base ${BASE:-none}; $(head -2 "$OUT/gpu.txt" | tail -1)"

# ---- 1. build ----------------------------------------------------------------------------------------------------
build() {  # tree tag [dir profile filter]: dir "lib" builds benchmark_mha_fwd too
    local tree=$1 tag=$2 dir=${3:-lib} profile=${4:-default} filter=${5:-$FILTER} bench=()
    [ "$dir" = lib ] && bench=(--benchmark)
    mkdir -p "$tree/build/tilechoice/$dir"
    (cd "$tree/build/tilechoice/$dir" && timeout 400 python3 "$tree/compile.py" --api fwd --arch sm_90a \
        --profile "$profile" --filter "$filter" ${bench[@]+"${bench[@]}"} -j "$JOBS" --build-dir "$tree/build/tilechoice/obj_$dir") \
        >"$OUT/build_$tag.log" 2>&1
    echo "rc=$?" >>"$OUT/build_$tag.log"
}
CAND_FILTER=${TILECHOICE_CAND_FILTER:-fwd_d64_bf16_batch_mask_sm90a_hopper_b128x96,fwd_d128_bf16_batch_mask_sm90a_hopper_b128x160,fwd_d256_bf16_batch_mask_sm90a_hopper_b128x96}
REF_FILTER=${TILECHOICE_REF_FILTER:-fwd_d128_bf16_batch_mask_sm90a_hopper_b128x128,fwd_d256_bf16_batch_mask_sm90a_hopper_b128x64}
trees=(branch)
[ -n "$BASE" ] && [ -f "$BASE/compile.py" ] && trees+=(base)
[ -n "$BASE" ] && [ ! -f "$BASE/compile.py" ] && note "BASE=$BASE has no compile.py: no A/B"
dir_of() { [ "$1" = base ] && echo "$BASE" || echo "$BR"; }
for t in "${trees[@]}"; do build "$(dir_of "$t")" "$t" & done
build "$BR" cand cand candidates "$CAND_FILTER" &
build "$BR" ref ref default "$REF_FILTER" &
wait
for t in "${trees[@]}" cand ref; do
    note "build $t: $(tail -1 "$OUT/build_$t.log"), $(grep -c 'gen/instances/' "$OUT/build_$t.log") instance compiles; $(grep -m1 '^\[mhakit\] fwd:' "$OUT/build_$t.log" | cut -c1-150)"
done
note "built at $(since)"
exe() { echo "$(dir_of "$1")/build/tilechoice/lib/benchmark_mha_fwd"; }
lib() { echo "$(dir_of "$1")/build/tilechoice/lib/libmha_fwd.so"; }

# ---- 2. correctness ----------------------------------------------------------------------------------------------
# "expected block token|arguments": causal d64 in batch mode on 192 x 128 at every length (since the thirteenth
# session), group mode up to max_seqlen_q 1024 on 128 x 128, past it on 192 x 128;
# unmasked on the nmask default whatever the length; group mode by the longest sequence (max_seqlen_q), not the sum.
CASES=(
    "batch_mask_sm90a_hopper_b192x128|-b=2 -h=4 -s=1024 -mask=t"
    "batch_mask_sm90a_hopper_b192x128|-b=1 -h=4 -s=1024 -mask=t"
    "batch_mask_sm90a_hopper_b192x128|-b=1 -h=4 -s=1025 -mask=t"
    "batch_mask_sm90a_hopper_b192x128|-b=1 -h=2 -s=4096 -mask=t"
    "batch_mask_sm90a_hopper_b192x128|-b=1 -h=4 -h_k=2 -s=1000 -s_k=1200 -mask=b"
    "batch_mask_sm90a_hopper_b192x128|-b=2 -h=2 -s=777 -s_k=500 -mask=t:128,16"
    "batch_mask_sm90a_hopper_b192x128|-b=1 -h=2 -s=1 -s_k=333 -mask=b"
    "batch_mask_sm90a_hopper_b192x128|-b=1 -h=2 -s=3000 -s_k=2500 -mask=b:256,0"
    "batch_mask_sm90a_hopper_b192x128|-b=2 -h=6 -h_k=2 -s=517 -s_k=1033 -mask=t -iperm=0 -operm=0"
    "batch_nmask_sm90a_hopper_b192x128|-b=2 -h=4 -s=1024"
    "batch_nmask_sm90a_hopper_b192x128|-b=1 -h=4 -s=2049"
    "group_mask_sm90a_hopper_b128x128|-mode=1 -b=3 -h=4 -s=1024,1000,517 -mask=t"
    "group_mask_sm90a_hopper_b192x128|-mode=1 -b=3 -h=4 -s=1025,1000,517 -mask=t"
    "group_mask_sm90a_hopper_b192x128|-mode=1 -b=4 -h=2 -s=1500,1500,1500,1500 -mask=b"
    "group_mask_sm90a_hopper_b192x128|-mode=1 -b=2 -h=2 -s=300,4000 -s_k=500,3900 -mask=b"
    "group_mask_sm90a_hopper_b128x128|-mode=1 -b=3 -h=4 -h_k=1 -s=129,1,700 -s_k=200,64,650 -mask=t:64,0 -iperm=0 -operm=0"
)
check_case() {  # tree "want|args" -> VALID|INVALID|WRONGKERNEL, the kernel, the case (base: no expectation)
    local t=$1 want=${2%%|*} args=${2#*|} line kern
    [ "$t" = base ] && want=sm90a_hopper_b192x128  # main has one masked d64 tile
    # shellcheck disable=SC2086
    line=$(timeout 120 "$(exe "$t")" -prec=bf16 -d=64 -lse=1 -v=1 -kname=1 -warmup=0 -repeat=1 $args 2>&1)
    echo "$args => $line" >>"$OUT/correct_${t}_full.log"
    kern=$(echo "$line" | grep -o 'fwd_d64[a-z0-9_]*' | head -1)
    if ! echo "$line" | grep -q 'valid:y'; then echo "INVALID     ${kern:-?} $args"
    elif [[ "$kern" != *"$want" ]]; then echo "WRONGKERNEL ${kern:-?} (want *$want) $args"
    else echo "VALID       ${kern:-?} $args"; fi
}
correct() {  # tree -> $OUT/correct_<tree>.log
    local t=$1 c log=$OUT/correct_$1.log
    : >"$log"
    for c in "${CASES[@]}"; do check_case "$t" "$c" >>"$log"; done
}
memcheck() {  # tag args
    # shellcheck disable=SC2086
    timeout 240 compute-sanitizer --tool memcheck --error-exitcode 99 "$(exe branch)" -prec=bf16 -d=64 -lse=1 \
        -v=1 -kname=1 -warmup=0 -repeat=1 $2 >"$OUT/memcheck_$1.log" 2>&1
    echo "rc=$?" >>"$OUT/memcheck_$1.log"
}
# all at once (host validation is CPU-bound; nothing is timed here)
memcheck batch "-b=1 -h=4 -h_k=2 -s=1000 -s_k=1200 -mask=b" &
memcheck group "-mode=1 -b=3 -h=2 -s=1024,333,517 -mask=t" &
[[ " ${trees[*]} " == *" base "* ]] && correct base &
correct branch
wait
note "correctness (branch): $(grep -c '^VALID' "$OUT/correct_branch.log") valid, $(grep -c '^INVALID' "$OUT/correct_branch.log") invalid, $(grep -c '^WRONGKERNEL' "$OUT/correct_branch.log") on another instance, of ${#CASES[@]}; kernels: $(awk '{print $2}' "$OUT/correct_branch.log" | sort | uniq -c | tr -s ' \n' ' ')"
grep -E '^(INVALID|WRONGKERNEL)' "$OUT/correct_branch.log" | sed 's/^/  /' | tee -a "$SUMMARY"
for m in batch group; do
    note "memcheck $m: $(grep -o 'ERROR SUMMARY: [0-9]* errors*' "$OUT/memcheck_$m.log" | head -1) $(tail -1 "$OUT/memcheck_$m.log"), $(grep -o 'valid:[yn]' "$OUT/memcheck_$m.log" | head -1), $(grep -o 'fwd_d64[a-z0-9_]*' "$OUT/memcheck_$m.log" | head -1)"
done
if [[ " ${trees[*]} " == *" base "* ]]; then
    note "correctness (base, for reference): $(grep -c '^VALID' "$OUT/correct_base.log") valid, $(grep -c '^INVALID' "$OUT/correct_base.log") invalid, $(grep -c '^WRONGKERNEL' "$OUT/correct_base.log") not on b192x128"
fi
note "correctness done at $(since)"

# ---- 3. A/B ------------------------------------------------------------------------------------------------------
for rep in $(seq 1 "$REPS"); do
    for t in "${trees[@]}"; do
        [ -f "$(lib "$t")" ] || { note "bench $t: no library"; continue; }
        timeout 150 python3 "$BR/bench/bench_fwd.py" --lib "$(lib "$t")" --hdims 64 \
            --seqlens 1024,2048,4096,16384 --dtype bf16 --peers cudnn --json "$OUT/bench_${t}_$rep.json" \
            >"$OUT/bench_${t}_$rep.md" 2>"$OUT/bench_${t}_$rep.err"
        note "bench $t rep $rep: rc=$? at $(since), $(grep -c 'FAIL' "$OUT/bench_${t}_$rep.md") FAIL rows"
    done
done
timeout 60 python3 - "$OUT" <<'PY' | tee -a "$SUMMARY"
import glob, json, os, statistics, sys
out = sys.argv[1]
def rows(tree):
    got = {}
    for path in sorted(glob.glob(os.path.join(out, f"bench_{tree}_*.json"))):
        for r in json.load(open(path))["rows"]:
            got.setdefault((r["seqlen"], bool(r["causal"])), []).append(r)
    return got
base, branch = rows("base"), rows("branch")
def med(rs, key):
    vals = [r[key] for r in rs if r.get(key)]
    return statistics.median(vals) if vals else None
fmt = lambda v: "-" if v is None else f"{v:.1f}"
print("\n| seqlen | causal | base TFLOPS | branch TFLOPS | branch/base | cuDNN | branch/cuDNN | base kernel | branch kernel | checked |")
print("|---|---|---|---|---|---|---|---|---|---|")
for key in sorted(set(base) | set(branch)):
    b, n = base.get(key, []), branch.get(key, [])
    tb, tn = med(b, "mhakit_tflops"), med(n, "mhakit_tflops")
    cu = med(b + n, "cudnn_tflops")
    kern = lambda rs: ",".join(sorted({(r.get("kernel") or "?").rsplit("_", 1)[-1] for r in rs})) or "-"
    ok = all(r.get("verified") for r in b + n)
    print(f"| {key[0]} | {'yes' if key[1] else 'no'} | {fmt(tb)} | {fmt(tn)} | "
          f"{f'{tn / tb:.3f}' if tb and tn else '-'} | {fmt(cu)} | {f'{tn / cu:.2f}x' if tn and cu else '-'} | "
          f"{kern(b)} | {kern(n)} | {'y' if ok else 'n'} |")
PY

# ---- 3b. group mode A/B (bench_fwd.py times batch mode only) -----------------------------------------------------
# benchmark_mha_fwd's own timing (mean of -repeat launches, CUDA events), base and branch interleaved, $REPS times:
# 16k packed tokens, 32 heads, causal; the longest sequence decides the tile (<= 1024: b128x128 on the branch).
GROUP_CASES=(
    "-b=16 -s=1024"
    "-b=8 -s=2048"
    "-b=8 -s=2048,1500,1024,700,2000,1800,300,1200"
    "-b=4 -s=4096"
)
GAB=$OUT/group_ab.txt
: >"$GAB"
for rep in $(seq 1 "$REPS"); do
    for c in "${GROUP_CASES[@]}"; do
        for t in "${trees[@]}"; do
            # shellcheck disable=SC2086
            line=$(timeout 60 "$(exe "$t")" -prec=bf16 -d=64 -h=32 -mode=1 -mask=t -v=0 -kname=1 -warmup=10 -repeat=50 $c 2>&1 | tr '\n' ' ')
            echo "$t|$c|$(echo "$line" | grep -o '[0-9.]* TFlops' | head -1 | cut -d' ' -f1)|$(echo "$line" | grep -o 'fwd_d64[a-z0-9_]*' | head -1)" >>"$GAB"
        done
    done
done
timeout 30 python3 - "$GAB" <<'PY' | tee -a "$SUMMARY"
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    tree, case, tf, kern = line.rstrip("\n").split("|")
    runs.setdefault(case, {}).setdefault(tree, []).append((float(tf) if tf else None, kern))
print("\n| group mode (d64 bf16 causal, h=32) | base TFLOPS | branch TFLOPS | branch / base | base kernel | branch kernel |")
print("|---|---|---|---|---|---|")
for case, trees in runs.items():
    med = {t: statistics.median([v for v, _ in rs if v]) if any(v for v, _ in rs) else None for t, rs in trees.items()}
    kern = {t: ",".join(sorted({k.rsplit("_", 1)[-1] for _, k in rs if k})) or "?" for t, rs in trees.items()}
    b, n = med.get("base"), med.get("branch")
    print(f"| {case} | {b if b is not None else '-'} | {n if n is not None else '-'} | "
          f"{f'{n / b:.3f}' if b and n else '-'} | {kern.get('base', '-')} | {kern.get('branch', '-')} |")
PY
note "group mode A/B done at $(since)"

# ---- 4. candidates -----------------------------------------------------------------------------------------------
SHAPES=(--shape 64,1024,1 --shape 64,2048,1 --shape 128,1024,1 --shape 128,2048,1 --shape 256,1024,1 --shape 256,2048,1)
for d in cand ref; do
    left=$(( 470 - ($(date +%s) - T0) ))  # the whole script within 480 s
    if [ "$left" -lt 30 ]; then note "bench $d: skipped, $(since) used"; continue; fi
    [ -f "$BR/build/tilechoice/$d/libmha_fwd.so" ] || { note "bench $d: no library"; continue; }
    if [ "$d" = ref ]; then shapes=("${SHAPES[@]:4}"); else shapes=("${SHAPES[@]}"); fi
    timeout "$(( left < 90 ? left : 90 ))" python3 "$BR/bench/bench_fwd.py" --lib "$BR/build/tilechoice/$d/libmha_fwd.so" "${shapes[@]}" \
        --dtype bf16 --peers cudnn --json "$OUT/cand_$d.json" >"$OUT/cand_$d.md" 2>"$OUT/cand_$d.err"
    note "bench $d: rc=$? at $(since), $(grep -c 'FAIL' "$OUT/cand_$d.md") FAIL rows"
done
timeout 60 python3 - "$OUT" <<'PY' | tee -a "$SUMMARY"
import glob, json, os, statistics, sys
out = sys.argv[1]
def load(pattern):
    got = {}
    for path in sorted(glob.glob(os.path.join(out, pattern))):
        for r in json.load(open(path))["rows"]:
            if r.get("causal"):
                got.setdefault((int(str(r["hdim"]).split("x")[0]), r["seqlen"]), []).append(r)
    return got
cand, ref = load("cand_cand.json"), load("cand_ref.json")
for tree in ("branch", "base"):  # d64's tiles in use: the A/B runs
    for key, rs in load(f"bench_{tree}_*.json").items():
        ref.setdefault(key, []).extend(rs)
def best(rs):
    ok = [r for r in rs if r.get("mhakit_tflops")]
    return max(ok, key=lambda r: r["mhakit_tflops"]) if ok else None
print("\n| hdim | seqlen (causal) | tile in use (best of the runs) | TFLOPS | candidate | TFLOPS | cand / in use | cuDNN | checked |")
print("|---|---|---|---|---|---|---|---|---|")
for key in sorted(set(cand) | set(ref)):
    if key[1] not in (1024, 2048):
        continue
    r, c = best(ref.get(key, [])), best(cand.get(key, []))
    tile = lambda x: "-" if x is None else (x.get("kernel") or "?").rsplit("_", 1)[-1]
    t = lambda x: "-" if x is None else f"{x['mhakit_tflops']:.1f}"
    ratio = f"{c['mhakit_tflops'] / r['mhakit_tflops']:.3f}" if r and c else "-"
    cu = [x.get("cudnn_tflops") for x in ref.get(key, []) + cand.get(key, []) if x.get("cudnn_tflops")]
    ok = all(x.get("verified") for x in ref.get(key, []) + cand.get(key, []))
    print(f"| {key[0]} | {key[1]} | {tile(r)} | {t(r)} | {tile(c)} | {t(c)} | {ratio} | "
          f"{f'{statistics.median(cu):.1f}' if cu else '-'} | {'y' if ok else 'n'} |")
PY
note "done at $(since)"
