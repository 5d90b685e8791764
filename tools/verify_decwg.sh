#!/usr/bin/env bash
# decode_tma's wgmma consumers (branch decwg, issue 10's s_q = 16 GQA rows): correctness of the new instances and the
# runtime's choice between them and the mma.sync tile, then bench_decode.py base vs branch, interleaved, twice.
#
#   OUT=/path/to/logs BASE=/path/to/export/of/main-at-1a0356e bash tools/verify_decwg.sh
#
# Run from an export of the branch on the H200 machine (16 cores, nvcc 13.0, torch + cuDNN, compute-sanitizer).
# Libraries (each tree's build/decwg/<variant>/libmha_fwd.so, objects in its build/decwg/obj):
#   base    $BASE: the bf16 d128 split-KV instances (decode, decode_tma b32x64w4: main's tile for every call)
#   branch  this tree: the bf16 d128 and d64 split-KV instances (decode; decode_tma b32x64w4, the mma.sync tile, below
#           64 packed rows per kv head; b64x64g1, one wgmma warpgroup, from 64 rows, one block at a time; d128
#           b128x64g2, two warpgroups in one CTA, from 128 rows, one block at a time) + benchmark_mha_fwd
#   g1o1    the catalogue candidate b64x64g1o1s3 (one warpgroup, pipelined) as the only decode_tma instance (+ decode)
#   (g2s6   was the two-warpgroup tile with the other loop; the pipelined one failed, so it is the chosen tile now)
#           speed, and the fallback should the chosen loop be wrong
# Steps (each under `timeout`; a failing step does not stop the later ones; logs under $OUT, summary.txt first):
#   1. build base (-j 4), branch (-j 8) and the two candidates (-j 2 each, own object dirs) at once. Expected
#      ~60-90 s (a wgmma instance ~15 s of a core, the mma.sync decode_tma one ~25 s).
#   2. correctness (~40-70 s, all at once): host-validated runs (-v=1 -kname=1: each must say valid:y AND name the
#      expected instance): 64 packed rows (32/8 x 16, 16/4 x 16, 64/8 x 8), 96 (a chunk of 64 + one with 32 padded
#      rows), 128 (two warpgroups), 192 (a padded two-warpgroup chunk), 48 and 32 rows (the mma.sync tile); paged 64 /
#      256 and contiguous; ragged lengths incl. 0 and non-multiples of 64; appended rows; cache_batch_idx; forced
#      splits and the heuristic; causal (bottom-right), window, top-left and generic masks; d64, d72 / d96 (partial
#      box), d128 x d_v 64 and d64 x d_v 128 (a V or K box past the head dim, zeroed once per slot); compute-sanitizer memcheck on a paged split case with
#      appended rows of each wgmma instance; five of the runs on each candidate library (expected: the candidate).
#   3. timing (~130-170 s): bench/bench_decode.py --lib <lib> (issue 10's rows, bf16 d128), base and branch
#      interleaved, two reps: rep 1 --sq 1,4,16 (branch with 64-token pages too, and FA2), rep 2 --sq 16 (the rows
#      the branch changes; s_q 1 and 4 run on the same mma.sync kernel in both). cuDNN in every run. Then, while
#      time is left, the candidates at --sq 16 (g1o1 serves every row there, g2s6 too). Rough times: rep 1 ~35 s
#      (base) / ~50 s (branch, paged too), rep 2 and each candidate ~15-20 s.
#   4. table.md: TB/s per row, branch / base, branch over the better peer; summary.txt.
# The script starts no timing run after ~280 s (each is cut at ~325 s; budget 330 s).
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
out=${OUT:-$repo/verify_decwg_logs}
base_tree=${BASE:-}
mkdir -p "$out"
summary=$out/summary.txt
: >"$summary"
note() { echo "$1" >>"$summary"; echo "== $1"; }
elapsed() { echo "$(( $(date +%s) - $1 )) s"; }
t_all=$(date +%s)
left() { echo $(( 305 - ($(date +%s) - t_all) )); }  # seconds left of the 330 s budget, less a margin
nvidia-smi --query-gpu=name,compute_cap,driver_version,clocks.sm,clocks.max.sm --format=csv >"$out/gpu.txt" 2>&1

pre=splitkv_d128_bf16_batch_mask_sm90a
g1=${pre}_decode_tma_b64x64g1
g2=${pre}_decode_tma_b128x64g2
w4=${pre}_decode_tma_b32x64w4
d64g1=splitkv_d64_bf16_batch_mask_sm90a_decode_tma_b64x64g1
d64w4=splitkv_d64_bf16_batch_mask_sm90a_decode_tma_b32x64w4

# ---------------- 1. build ----------------
build() {  # variant, tree, profile, filter, object dir, seconds, extra compile.py arguments
    local name=$1 tree=$2 profile=$3 filter=$4 objs=$5 secs=$6 t0
    shift 6
    t0=$(date +%s)
    mkdir -p "$tree/build/decwg/$name"
    (cd "$tree/build/decwg/$name" && timeout "$secs" python3 "$tree/compile.py" --api fwd --arch sm_90a \
        --profile "$profile" --filter "$filter" --build-dir "$tree/build/decwg/$objs" "$@") \
        >"$out/build_$name.log" 2>&1
    note "build $name: rc=$? in $(elapsed "$t0"): $(tail -1 "$out/build_$name.log")"
}
t0=$(date +%s)
if [ -n "$base_tree" ] && [ -f "$base_tree/compile.py" ]; then
    build base "$base_tree" default "${pre}_decode_" obj 150 -j 4 &
else
    note "build base: BASE is not set to an export of main (1a0356e): no base library"
fi
build g1o1 "$repo" candidates "${pre}_decode_b32x64w4,${g1}o1s3" obj_g1o1 150 -j 2 &
build branch "$repo" default "${pre}_decode_,splitkv_d64_bf16_batch_mask_sm90a_decode_" obj 150 -j 8 --benchmark
wait
note "builds in $(elapsed "$t0")"
lib_base=$base_tree/build/decwg/base/libmha_fwd.so
lib_branch=$repo/build/decwg/branch/libmha_fwd.so
exe=$repo/build/decwg/branch/benchmark_mha_fwd
[ -x "$exe" ] || note "MISSING: $exe (the branch's build failed): no host-validated runs or memcheck"
note "ptxas notes in the branch build (C7519: warpgroup.arrive injected, i.e. wgmma serialised): $(grep -c 'C7519' "$out/build_branch.log")"

# ---------------- 2. correctness ----------------
# expected instance | benchmark_mha_fwd arguments (bf16; -d=128 unless given)
runs=(
    "$g1|-b=3 -h=32 -h_k=8 -s=16 -s_k=0,17,4096 -num_splits=0 -lse=1"
    "$g1|-b=2 -h=32 -h_k=8 -s=16 -s_k=1000,4097 -page_block_size=64 -mask=b -num_splits=3 -lse=1"
    "$g1|-b=2 -h=16 -h_k=4 -s=16 -s_k=700,33 -page_block_size=256 -mask=b -s_knew=2 -num_splits=0 -lse=1"
    "$g1|-b=2 -h=64 -h_k=8 -s=8 -s_k=2100,65 -page_block_size=64 -mask=b:300,0 -s_knew=1 -num_splits=0"
    "$g1|-b=3 -h=32 -h_k=8 -s=16 -s_k=500,7,1 -cache_batch_idx=1 -s_knew=2 -num_splits=5 -lse=1"
    "$g1|-b=2 -h=64 -h_k=8 -s=12 -s_k=3000,129 -page_block_size=256 -mask=b -num_splits=0 -lse=1"
    "$g1|-b=2 -h=32 -h_k=8 -s=16 -s_k=64,200 -mask=t:2,3 -num_splits=2 -lse=1"
    "$g1|-b=2 -h=32 -h_k=8 -s=16 -s_k=300,1024 -mask=g:30,5 -num_splits=0 -lse=1"
    "$g1|-b=2 -h=32 -h_k=8 -s=16 -s_k=300,999 -d=72 -num_splits=2 -lse=1"
    "$g1|-b=2 -h=32 -h_k=8 -s=16 -s_k=1500,64 -d=128 -d_v=64 -s_knew=1 -num_splits=0 -lse=1"
    "$g1|-b=2 -h=32 -h_k=8 -s=16 -s_k=700,1 -d=64 -d_v=128 -page_block_size=64 -num_splits=2 -lse=1"
    "$g1|-b=2 -h=32 -h_k=8 -s=16 -s_k=0 -s_knew=5 -page_block_size=64 -mask=b -lse=1"
    "$g2|-b=2 -h=64 -h_k=8 -s=16 -s_k=5000,63 -num_splits=0 -lse=1"
    "$g2|-b=2 -h=64 -h_k=8 -s=16 -s_k=2048,777 -page_block_size=64 -mask=b -s_knew=3 -num_splits=7 -lse=1"
    "$g2|-b=2 -h=64 -h_k=8 -s=16 -s_k=4100,0 -page_block_size=256 -mask=b:100,3 -num_splits=2"
    "$g2|-b=1 -h=128 -h_k=8 -s=12 -s_k=3333 -mask=b -num_splits=0 -lse=1"
    "$g2|-b=2 -h=64 -h_k=8 -s=16 -s_k=640,1 -d=96 -page_block_size=64 -mask=b -num_splits=0 -lse=1"
    "$w4|-b=2 -h=24 -h_k=8 -s=16 -s_k=1000,4097 -page_block_size=64 -mask=b -num_splits=3 -lse=1"
    "$w4|-b=2 -h=16 -h_k=8 -s=16 -s_k=900,90 -mask=b -num_splits=0 -lse=1"
    "$d64g1|-b=2 -h=32 -h_k=8 -s=16 -s_k=1111,250 -d=64 -page_block_size=64 -mask=b -s_knew=1 -num_splits=0 -lse=1"
    "$d64w4|-b=2 -h=8 -h_k=2 -s=3 -s_k=700,33 -d=64 -mask=b -num_splits=0 -lse=1"
)
check_one() {  # variant, index[, expected instance]: one host-validated run, its verdict line
    local lib=$repo/build/decwg/$1/libmha_fwd.so spec=${runs[$2]} want args log d
    want=${3:-${spec%%|*}}
    args=${spec#*|}
    log=$out/check_$1_$2.log
    d=-d=128
    case " $args " in *" -d="*) d= ;; esac
    # shellcheck disable=SC2086
    LD_LIBRARY_PATH="$(dirname "$lib")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" timeout 100 "$exe" -prec=bf16 \
        $d -v=1 -kname=1 -warmup=1 -repeat=2 $args >"$log" 2>&1
    local rc=$? valid got
    valid=$(grep -o 'valid:[yn]' "$log" | head -1)
    got=$(grep -o 'mha_fwd_splitkv -> [a-z0-9_]*' "$log" | head -1 | sed 's/mha_fwd_splitkv -> //')
    if [ "$rc" = 0 ] && [ "$valid" = valid:y ] && [ "$got" = "$want" ]; then
        echo "ok   $args -> $got"
    else
        echo "FAIL $args: rc=$rc ${valid:-no verdict}, instance ${got:-none} (want $want); see check_$1_$2.log"
    fi
}
memcheck() {  # log name, benchmark_mha_fwd arguments
    local log=$out/$1
    shift
    LD_LIBRARY_PATH="$(dirname "$lib_branch")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" timeout 120 \
        compute-sanitizer --tool memcheck --error-exitcode 99 "$exe" -prec=bf16 -d=128 -v=1 -warmup=0 -repeat=1 \
        -kname=1 "$@" >"$log" 2>&1
    echo "rc=$?" >>"$log"
}
t0=$(date +%s)
if [ -x "$exe" ]; then
    memcheck memcheck_g1.log -b=2 -h=32 -h_k=8 -s=16 -s_k=3000,777 -page_block_size=64 -num_splits=5 -mask=b \
        -s_knew=2 -lse=1 &
    memcheck memcheck_g2.log -b=2 -h=64 -h_k=8 -s=16 -s_k=2000,65 -page_block_size=256 -num_splits=3 -mask=b \
        -s_knew=1 -lse=1 &
    jobs_list=()
    for i in "${!runs[@]}"; do jobs_list+=("branch $i"); done
    # the candidates: 64 rows (contiguous, paged split with appended rows, top-left mask), 128 rows (paged split), 192
    for v in g1o1 g2s6; do
        [ -f "$repo/build/decwg/$v/libmha_fwd.so" ] || continue
        for i in 0 1 6 12 14; do jobs_list+=("$v $i ${pre}_decode_tma_b$([ $v = g1o1 ] && echo 64x64g1o1s3 || echo 128x64g2s6)"); done
    done
    for j in "${jobs_list[@]}"; do
        set -- $j
        check_one "$@" >"$out/verdict_$1_$2.txt" &
        # at most 8 checks at once beside the two memchecks (each validates on one host core)
        while [ "$(jobs -rp | wc -l)" -ge 10 ]; do sleep 0.2; done
    done
    wait
    for v in branch g1o1 g2s6; do
        cat "$out"/verdict_${v}_*.txt >"$out/checks_$v.txt" 2>/dev/null || continue
        [ -s "$out/checks_$v.txt" ] || continue
        note "checks $v: $(grep -c '^ok' "$out/checks_$v.txt") of $(wc -l <"$out/checks_$v.txt") ok, $(grep -c '^FAIL' "$out/checks_$v.txt") FAIL"
        grep '^FAIL' "$out/checks_$v.txt" >>"$summary"
    done
    for f in "$out"/memcheck_*.log; do
        [ -f "$f" ] && note "$(basename "$f" .log): $(grep -o 'ERROR SUMMARY: [0-9]* errors' "$f") $(tail -1 "$f"), $(grep -o 'valid:[yn]' "$f" | head -1), $(grep -o 'mha_fwd_splitkv -> [a-z0-9_]*' "$f" | head -1)"
    done
fi
note "correctness in $(elapsed "$t0")"

# ---------------- 3. timing: base and branch interleaved, two reps ----------------
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export MHAKIT_CACHE_DIR=${MHAKIT_CACHE_DIR:-$(mktemp -d)}  # the C call path's host extension only
bench() {  # run name, library, bench_decode.py arguments
    local name=$1 lib=$2 t0
    shift 2
    if [ ! -f "$lib" ]; then note "bench $name: no library"; return; fi
    if [ "$(left)" -lt 25 ]; then note "bench $name: skipped (time)"; return; fi
    t0=$(date +%s)
    timeout "$(( $(left) + 20 ))" python3 bench/bench_decode.py --lib "$lib" --json "$out/bench_$name.json" "$@" \
        >"$out/bench_$name.md" 2>"$out/bench_$name.err"
    note "bench $name: rc=$? in $(elapsed "$t0") ($(grep -c 'FAIL\|differs' "$out/bench_$name.md") failing rows)"
}
t0=$(date +%s)
bench base1 "$lib_base" --sq 1,4,16 --page 0 --peers cudnn
bench branch1 "$lib_branch" --sq 1,4,16 --page 64 --peers cudnn,fa2 --show-kernel
bench base2 "$lib_base" --sq 16 --page 0 --peers cudnn
bench branch2 "$lib_branch" --sq 16 --page 0 --peers cudnn --show-kernel
bench g1o1 "$repo/build/decwg/g1o1/libmha_fwd.so" --sq 16 --page 0 --peers cudnn --show-kernel
bench g2s6 "$repo/build/decwg/g2s6/libmha_fwd.so" --sq 16 --page 0 --peers cudnn --show-kernel
note "timing in $(elapsed "$t0")"

# ---------------- 4. table ----------------
python3 - "$out" >"$out/table.md" 2>&1 <<'PY'
import json, os, sys
out = sys.argv[1]
def load(name):
    try:
        return {(r["sq"], r["b"], r["hq"], r["hk"], r["sk"]): r
                for r in json.load(open(os.path.join(out, f"bench_{name}.json")))["rows"]}
    except (OSError, ValueError, KeyError):
        return {}
runs = {n: load(n) for n in ("base1", "branch1", "base2", "branch2", "g1o1", "g2s6")}
def get(n, k, f="mhakit_tbs"):
    r = runs[n].get(k)
    return None if r is None else r.get(f)
def best(*xs):
    xs = [x for x in xs if x]
    return max(xs) if xs else None
def fmt(x):
    return "-" if x is None else f"{x:.2f}"
def ok(n, k):
    r = runs[n].get(k) or {}
    return "" if r.get("verified") is not False and r.get("paged_matches") is not False else " FAIL"
keys = sorted({k for rows in runs.values() for k in rows})
print("TB/s of K + V read (bench_decode.py, bf16 d128; rep 1 / rep 2); branch / base on the better of each's reps;")
print("x peer: branch's better rep over the better of cuDNN (any run) and FA2; g1o1 / g2s6: the candidates with")
print("the other consumer loop, each the only decode_tma instance of its library (g1o1: 64-row chunks, pipelined;")
print("g2s6: 128-row chunks, one block at a time)")
print()
print("| s_q | b | h_q/h_k | s_k | packed rows | base | branch | branch p64 | branch/base | g1o1 | g2s6 | cuDNN | FA2 | x peer | >= 3.5 |")
print("|---" * 15 + "|")
for k in keys:
    sq, b, hq, hk, sk = k
    base = [get("base1", k), get("base2", k)]
    br = [get("branch1", k), get("branch2", k)]
    cudnn = best(*(get(n, k, "cudnn_tbs") for n in runs))
    fa2 = get("branch1", k, "fa2_tbs")
    bb, bbr = best(*base), best(*br)
    ratio = f"{bbr / bb:.2f}" if bb and bbr else "-"
    peer = best(cudnn, fa2)
    xp = f"{bbr / peer:.2f}" if bbr and peer else "-"
    print(f"| {sq} | {b} | {hq}/{hk} | {sk} | {sq * hq // hk} | {fmt(base[0])} / {fmt(base[1])}{ok('base1', k)} | "
          f"{fmt(br[0])} / {fmt(br[1])}{ok('branch1', k)}{ok('branch2', k)} | {fmt(get('branch1', k, 'mhakit_paged_tbs'))} | "
          f"{ratio} | {fmt(get('g1o1', k))}{ok('g1o1', k)} | {fmt(get('g2s6', k))}{ok('g2s6', k)} | {fmt(cudnn)} | "
          f"{fmt(fa2)} | {xp} | {'y' if bbr and bbr >= 3.5 else 'n'} |")
PY
note "table: $out/table.md"
cat "$out"/bench_branch*.md "$out"/bench_g1o1.md "$out"/bench_g2s6.md 2>/dev/null | grep -o 'mha_fwd_splitkv -> [a-z0-9_]*' | sort | uniq -c \
    >"$out/bench_instances.txt"
note "bench instances (branch and candidates, first calls): $(awk '{printf "%s %s; ", $1, $4}' "$out/bench_instances.txt")"
note "whole run in $(elapsed "$t_all")"
# key lines first: the verdicts, then the s_q = 16 rows (the ones the branch changes), then the log of the steps
{
    echo "KEY: $(grep -h '^checks \|^memcheck_' "$summary" | tr '\n' ';')"
    grep '^| 16 ' "$out/table.md" | awk -F'|' '{printf "KEY s_q=16 b=%s %s s_k=%s rows=%s: base %s, branch %s, branch/base %s, g1o1 %s, g2s6 %s, cuDNN %s, FA2 %s\n", $3, $4, $5, $6, $7, $8, $10, $11, $12, $13, $14}' | tr -s ' '
    echo
    cat "$summary"
    echo
    echo "---- table.md"
    cat "$out/table.md"
} >"$summary.new" && mv "$summary.new" "$summary"
echo
cat "$summary"
