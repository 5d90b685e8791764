#!/usr/bin/env bash
# Branch mla192c (issue 13: the (192, 128) Hopper backward, causal rows at 0.71-0.81x cuDNN): a query split of 128
# keys per CTA (tile b64x128, `candidate = true` in codegen/catalogue/cuda.toml) against the shipped 64 x 64 one.
# Run on the H200 from the repository root of an export of the branch:
#
#   OUT=<log dir> BASE=<export of main at 754eb5e> bash tools/verify_mla192c.sh
#
# 1. build (<= 240 s on 16 cores; three trees of libraries, in parallel):
#      base    $BASE/build/mla192c/base: libmha_bwd.so, the d192x128 bf16 batch Hopper instances (mask, nmask)
#      branch  build/mla192c/branch: libmha_fwd.so (d192x128 bf16 Hopper forward: batch mask / nmask, group mask),
#              libmha_bwd.so (the same backward instances as base, 64 x 64, + group mask) + benchmark_mha_bwd
#      cand    build/mla192c/cand: libmha_bwd.so of the candidate b64x128 (batch mask / nmask, group mask) +
#              benchmark_mha_bwd (the branch's libmha_fwd.so copied beside it)
#    11 Hopper instances in all (base 2, branch 3 + 3 forward, cand 3).
# 2. correctness, branch and cand libraries: benchmark_mha_bwd -v=1 -kname=1 at (192, 128) bf16, 10 cases each
#    (causal top-left / bottom-right, sliding window, GQA, MQA, odd lengths, s_q != s_k, group mode with empty
#    sequences, deterministic, a long causal run); every line must say valid:y and name a _hopper_ instance of the
#    library's tile; compute-sanitizer memcheck on 2 cases of the candidate (GQA causal, group mode).
# 3. A/B timing, one process per library: bench/bench_bwd.py --hdims 192x128 --hidden 3072 --dtype bf16 (s = 1k,
#    4k, 16k; causal and not): base with cuDNN beside it (--peers cudnn once), cand, branch; a table base / branch /
#    cand / cuDNN in table.md. Each step's timeout is capped so that the script ends within MLA192C_BUDGET (470) s.
# Logs under $OUT (default ./verify_mla192c_logs); summary.txt first. Whole script: about 6-7 minutes.
set -u
cd "$(dirname "$0")/.."
repo=$(pwd)
OUT=${OUT:-$repo/verify_mla192c_logs}
BASE=${BASE:-}
JOBS=${MHAKIT_JOBS:-16}
mkdir -p "$OUT"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
summary=()
note() { summary+=("$1"); echo "== $1"; }
elapsed() { echo "$(( $(date +%s) - $1 )) s"; }
start=$(date +%s)
BUDGET=${MLA192C_BUDGET:-470}  # seconds for the whole script: each step's timeout is capped by what is left
cap() {  # the timeout for a step of at most $1 s (1 s, the step cut at once, when the budget is spent)
    local left=$(( BUDGET - ($(date +%s) - start) ))
    if [ "$left" -lt 10 ]; then echo 1; elif [ "$1" -lt "$left" ]; then echo "$1"; else echo "$left"; fi
}

branch=$repo/build/mla192c/branch
cand=$repo/build/mla192c/cand
base=${BASE:+$BASE/build/mla192c/base}
mkdir -p "$branch" "$cand" ${base:+"$base"}
bwd_b64x64='bwd_d192x128_bf16_batch_*mask_sm90a_hopper_b64x64,bwd_d192x128_bf16_group_mask_sm90a_hopper_b64x64'
bwd_b64x128='bwd_d192x128_bf16_batch_*mask_sm90a_hopper_b64x128,bwd_d192x128_bf16_group_mask_sm90a_hopper_b64x128'
fwd_sel='fwd_d192x128_bf16_batch_*mask_sm90a_hopper_b*,fwd_d192x128_bf16_group_mask_sm90a_hopper_b*'

# ---- 1. build: objects of every tree at once, then the benchmarks (which link the forward library) ----
build() {  # name, timeout, dir, compile.py arguments... (runs in the background: its line goes to a file)
    local name=$1 limit=$2 dir=$3
    shift 3
    local t0
    t0=$(date +%s)
    (cd "$dir" && timeout "$limit" python3 "$repo/compile.py" --arch sm_90a "$@") >"$OUT/build_$name.log" 2>&1
    echo "build $name: rc=$? in $(elapsed "$t0"): $(tail -1 "$OUT/build_$name.log")" >"$OUT/build_$name.status"
}
built() { for n in "$@"; do note "$(cat "$OUT/build_$n.status" 2>/dev/null || echo "build $n: no status")"; done; }
nb=$(( JOBS / 4 > 0 ? JOBS / 4 : 1 ))
if [ -n "$base" ] && [ -f "$BASE/compile.py" ]; then
    (cd "$base" && timeout 230 python3 "$BASE/compile.py" --arch sm_90a --api bwd --profile all \
        --filter "bwd_d192x128_bf16_batch_*mask_sm90a_hopper_b64x64" -j 2 --build-dir "$base/obj" \
        >"$OUT/build_base.log" 2>&1; echo "build base: rc=$? $(tail -1 "$OUT/build_base.log")" >"$OUT/build_base.status") &
else
    note "BASE unset or not a tree: no base library (the A/B has no base column)"
fi
build fwd 230 "$branch" --api fwd --profile all --filter "$fwd_sel" -j 3 --build-dir "$branch/obj" &
build bwd_objects 230 "$branch" --api bwd --profile all --filter "$bwd_b64x64" -j 3 --build-dir "$branch/obj_bwd" &
build cand_objects 230 "$cand" --api bwd --profile candidates --filter "$bwd_b64x128" -j "$(( nb > 3 ? nb : 3 ))" \
    --build-dir "$cand/obj" &
wait
[ -n "$base" ] && built base
built fwd bwd_objects cand_objects
cp -f "$branch/libmha_fwd.so" "$cand/" 2>/dev/null || note "no branch libmha_fwd.so to copy beside cand"
build bwd "$(cap 150)" "$branch" --api bwd --profile all --filter "$bwd_b64x64" --benchmark -j "$JOBS" \
    --build-dir "$branch/obj_bwd" &
build cand "$(cap 150)" "$cand" --api bwd --profile candidates --filter "$bwd_b64x128" --benchmark -j "$JOBS" \
    --build-dir "$cand/obj" &
wait
built bwd cand
note "builds done in $(elapsed "$start")"

# ---- 2. correctness ----
cases=(
    "-b=2 -h=4 -s=512 -mask=t"
    "-b=2 -h=4 -s=333 -s_k=517 -mask=b"
    "-b=1 -h=4 -s=700 -s_k=650 -mask=t:96,0"
    "-b=1 -h=4 -s=1024 -mask=b:200,64"
    "-b=2 -h=8 -h_k=2 -s=257 -mask=t"
    "-b=1 -h=8 -h_k=1 -s=300 -s_k=450 -mask=0"
    "-b=2 -h=3 -s=1000 -s_k=77 -mask=0"
    "-mode=1 -b=3 -h=4 -h_k=2 -s=257,0,129 -s_k=311,64,0 -mask=b"
    "-b=1 -h=4 -h_k=2 -s=640 -mask=t -deterministic=1"
    "-b=1 -h=2 -s=2048 -mask=t"
)
check() {  # label, dir, tile token
    local label=$1 dir=$2 tile=$3 i=0 ok=0 bad=0
    local log="$OUT/correct_$label.log"
    : >"$log"
    if [ ! -x "$dir/benchmark_mha_bwd" ]; then
        note "correct $label: no benchmark_mha_bwd in $dir"
        return
    fi
    for c in "${cases[@]}"; do
        i=$((i + 1))
        # shellcheck disable=SC2086
        out=$(cd "$dir" && timeout "$(cap 60)" ./benchmark_mha_bwd -prec=bf16 -d=192 -d_v=128 $c -v=1 -kname=1 -warmup=1 \
            -repeat=2 2>&1)
        echo "## case $i: $c" >>"$log"
        echo "$out" >>"$log"
        if echo "$out" | grep -q "valid:y" && ! echo "$out" | grep -q "valid:n" &&
            echo "$out" | grep -q "_hopper_$tile"; then
            ok=$((ok + 1))
        else
            bad=$((bad + 1))
            note "correct $label case $i FAILED ($c): $(echo "$out" | grep -o 'bwd_[a-z0-9_]*' | head -1) $(echo "$out" | tail -1 | cut -c1-160)"
        fi
    done
    note "correct $label: $ok valid, $bad failed of ${#cases[@]} (kernel $(grep -o "bwd_d192x128_[a-z0-9_]*" "$log" | sort -u | tr '\n' ' '))"
}
check branch "$branch" b64x64
check cand "$cand" b64x128
memcheck() {  # n, args
    local n=$1
    shift
    # shellcheck disable=SC2068
    (cd "$cand" && timeout "$(cap 120)" compute-sanitizer --tool memcheck --error-exitcode 99 ./benchmark_mha_bwd -prec=bf16 \
        -d=192 -d_v=128 $@ -v=1 -kname=1 -warmup=0 -repeat=1) >"$OUT/memcheck_$n.log" 2>&1
    note "memcheck cand $n: rc=$? $(grep -o 'ERROR SUMMARY: [0-9]* errors*' "$OUT/memcheck_$n.log") $(grep -o 'valid:[yn]' "$OUT/memcheck_$n.log" | tail -1) $(grep -o 'bwd_d192x128_[a-z0-9_]*' "$OUT/memcheck_$n.log" | head -1)"
}
memcheck 1 -b=1 -h=4 -h_k=2 -s=333 -s_k=517 -mask=t
memcheck 2 -mode=1 -b=3 -h=2 -s=257,0,129 -s_k=311,64,0 -mask=b
note "correctness done at $(elapsed "$start")"

# ---- 3. A/B timing: one library per process, cuDNN beside base ----
bench() {  # label, lib, peers
    local label=$1 lib=$2 peers=$3
    if [ ! -f "$lib" ]; then
        note "bench $label: no library $lib"
        return
    fi
    local t0
    t0=$(date +%s)
    timeout "$(cap 120)" python3 bench/bench_bwd.py --lib "$lib" --fwd-lib "$branch/libmha_fwd.so" --dtype bf16 \
        --hdims 192x128 --hidden 3072 --peers "$peers" --json "$OUT/bench_$label.json" \
        >"$OUT/bench_$label.md" 2>"$OUT/bench_$label.err"
    note "bench $label: rc=$? in $(elapsed "$t0") ($(grep -c FAIL "$OUT/bench_$label.md") FAIL rows)"
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv >"$OUT/gpu.txt" 2>&1
[ -n "$base" ] && bench base "$base/libmha_bwd.so" cudnn
bench cand "$cand/libmha_bwd.so" ""
bench branch "$branch/libmha_bwd.so" ""  # the shipped tile, its SASS unchanged by the branch: last
timeout 30 python3 - "$OUT" <<'PY' >"$OUT/table.md" 2>&1
import json, os, sys
out = sys.argv[1]
rows = {}
for label in ("base", "branch", "cand"):
    path = os.path.join(out, f"bench_{label}.json")
    if os.path.exists(path):
        rows[label] = {(r["seqlen"], bool(r["causal"])): r for r in json.load(open(path))["rows"]}
keys = sorted({k for v in rows.values() for k in v}, key=lambda k: (k[1], k[0]))
def tf(label, k, field="mhakit_tflops"):
    r = rows.get(label, {}).get(k, {})
    v = r.get(field)
    return ("-" if v is None else f"{v:.1f}") + (" FAIL" if r.get("verified") is False else "")
print("| seqlen | causal | base (b64x64) | branch (b64x64) | cand (b64x128) | cuDNN | cand / cuDNN | cand / base | kernel (cand) |")
print("|---|---|---|---|---|---|---|---|---|")
for k in keys:
    c = rows.get("cand", {}).get(k, {})
    cud = rows.get("base", {}).get(k, {}).get("cudnn_tflops")
    b = rows.get("base", {}).get(k, {}).get("mhakit_tflops")
    ct = c.get("mhakit_tflops")
    r1 = f"{ct / cud:.2f}x" if ct and cud else "-"
    r2 = f"{ct / b:.2f}x" if ct and b else "-"
    print(f"| {k[0]} | {'yes' if k[1] else 'no'} | {tf('base', k)} | {tf('branch', k)} | {tf('cand', k)} | "
          f"{'-' if cud is None else f'{cud:.1f}'} | {r1} | {r2} | {c.get('kernel') or '-'} |")
PY
note "bench table ($OUT/table.md) at $(elapsed "$start")"

{
    echo "== summary (verify_mla192c, $(date -u +%FT%TZ), $(elapsed "$start"))"
    printf '%s\n' "${summary[@]}"
    echo
    cat "$OUT/table.md"
} | tee "$OUT/summary.txt"
