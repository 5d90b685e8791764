#!/usr/bin/env bash
# decode_tma's ring for issue 10's s_q = 1 rows (branch decsq1): three catalogue candidates of the bf16 d128 tile
# timed side by side with main's tile, after their correctness.
#
#   OUT=/path/to/logs BASE=/path/to/main-754eb5e-export bash tools/verify_decsq1.sh
#
# Run from an export of the branch on the H200 machine (16 cores, nvcc 13.0, torch + cuDNN, compute-sanitizer).
# Libraries (build/decsq1/<variant>/libmha_fwd.so; objects in build/decsq1/obj, shared by the branch's variants):
#   base   $BASE (main at 754eb5e): the bf16 d128 decode_tma instance only (b32x64w4: 3 slots of 32 KB, 2 CTAs/SM)
#   head   this branch, every split-KV instance (decode and decode_tma, fp16 / bf16, d64 / d128 / d256) and
#          benchmark_mha_fwd: the chosen tiles are main's (their kernels unchanged); the full decode smoke grid
#   s2     head with the candidate ..._decode_tma_b32x64w4s2 in place of the bf16 d128 decode_tma instance: 2 slots,
#          3 CTAs per SM in the key split (its 32-row key-split kernel spills 216 bytes at the 136-register cap)
#   s4     likewise ..._b32x64w4s4: 4 slots, 1 CTA per SM (128 KB in flight per SM instead of 192)
#   w8s2   (dropped from the catalogue after the H200 run: its kernels cannot launch) ..._b32x128w8s2: 128 keys x 8 consumer warps, 2 slots of 64 KB, 1 CTA per SM; its row split
#          holds 128 packed rows (s_q = 16 with a group of 8 reads the cache once); pages must hold 128 rows
#   c1s2   likewise ..._b32x64w4c1s2: 2 slots, capped at 1 CTA per SM (64 KB in flight per SM, about what
#          FlashAttention-2's split-KV kernel keeps, which streams at 4.54 TB/s on the rows it splits)
# Steps (each under `timeout`; a failing step does not stop the later ones; logs under $OUT, summary.txt first):
#   1. build: base and head in parallel (-j 8 each), then the candidates one after another (each compiles only its
#      candidate, ~25 s of a core; the other nine instances' objects are head's). Expected ~100-140 s.
#   2. correctness, all at once (~90 s): the full decode smoke grid on head (-j 8; its kernels are main's);
#      eight host-validated d128 bf16 runs per candidate (-v=1 -kname=1: each must say valid:y and name the
#      candidate) covering paged 128 / 256, ragged lengths incl. 0, appended rows, cache_batch_idx, GQA 1 / 4 / 8,
#      causal, window, s_q 1 / 4 / 16, the key split of 32 rows, the row split of 64 and 128 rows, b=64;
#      compute-sanitizer memcheck on each candidate: a paged split with appended rows and a big-batch case.
#   3. timing (~150 s), one library at a time: bench/bench_decode.py --sq 1,4,16 --lib <library> (issue 10's rows):
#      head with cuDNN and FA2 and 64-token pages (--show-kernel); base and the candidates with cuDNN (its output is
#      every row's check, its time the run-to-run reference); s2, s4 and c1s2 paged (64) too; w8s2 contiguous only
#      (64-token pages go to the decode family with 128-key blocks). Every row of every library is also checked
#      against cuDNN there (bench_decode.py's check: FAIL in the table).
#   4. while time is left (the script stops starting steps at ~470 s): an s_k sweep (2k .. 64k) of b=1 and b=16
#      32/8 at s_q = 1 on base and each candidate with cuDNN (~15 s each), and ncu kernel times of base (split
#      kernel and combine apart, DRAM throughput) on three rows when ncu is installed.
#   5. table.md: TB/s per row and library, each library over the better peer of head's run; the sweep's fit of
#      time per call to T0 + bytes / BW for each library and cuDNN (fixed cost vs streaming rate).
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
out=${OUT:-$repo/verify_decsq1_logs}
base_tree=${BASE:-}
mkdir -p "$out"
libs=$repo/build/decsq1
tma=splitkv_d128_bf16_batch_mask_sm90a_decode_tma_b32x64w4
others='splitkv_*_decode_b*,splitkv_d64_*decode_tma*,splitkv_d128_fp16_*decode_tma*'
cands=(s2 s4 c1s2)
declare -A cand_name=([s2]=${tma}s2 [s4]=${tma}s4 [w8s2]=splitkv_d128_bf16_batch_mask_sm90a_decode_tma_b32x128w8s2
                      [c1s2]=${tma}c1s2)
summary=$out/summary.txt
: >"$summary"
note() { echo "$1" >>"$summary"; echo "== $1"; }
elapsed() { echo "$(( $(date +%s) - $1 )) s"; }
t_all=$(date +%s)
left() { echo $(( 470 - ($(date +%s) - t_all) )); }  # seconds left of the 480 s budget, less a margin
nvidia-smi --query-gpu=name,compute_cap,driver_version,clocks.sm,clocks.max.sm --format=csv >"$out/gpu.txt" 2>&1

# ---------------- 1. build ----------------
build() {  # variant, tree, profile, filter, seconds, extra compile.py arguments
    local name=$1 tree=$2 profile=$3 filter=$4 secs=$5 t0
    shift 5
    t0=$(date +%s)
    mkdir -p "$tree/build/decsq1/$name"
    (cd "$tree/build/decsq1/$name" && timeout "$secs" python3 "$tree/compile.py" --api fwd --arch sm_90a \
        --profile "$profile" --filter "$filter" --build-dir "$tree/build/decsq1/obj" "$@") >"$out/build_$name.log" 2>&1
    note "build $name: rc=$? in $(elapsed "$t0"): $(tail -1 "$out/build_$name.log")"
}
t0=$(date +%s)
if [ -n "$base_tree" ] && [ -f "$base_tree/compile.py" ]; then
    build base "$base_tree" all "$tma" 200 -j 8 &
else
    note "build base: BASE is not set to an export of main (754eb5e): no base library"
fi
build head "$repo" all splitkv 200 -j 8 --benchmark
wait
for c in "${cands[@]}"; do
    build "$c" "$repo" candidates "$others,${cand_name[$c]}" 120 -j 8
done
note "builds in $(elapsed "$t0")"
lib_of() {  # variant -> its library
    if [ "$1" = base ]; then echo "$base_tree/build/decsq1/base/libmha_fwd.so"; else echo "$libs/$1/libmha_fwd.so"; fi
}
exe=$libs/head/benchmark_mha_fwd
[ -x "$exe" ] || note "MISSING: $exe (head's build failed): no host-validated runs, smoke grids or memcheck"

# ---------------- 2. correctness ----------------
t0=$(date +%s)
runs=(
    "-b=4 -h=32 -h_k=8 -s=1 -s_k=0,17,1000,4096 -page_block_size=128 -num_splits=0"
    "-b=3 -h=32 -h_k=8 -s=4 -s_k=63,1,3000 -page_block_size=256 -mask=b -s_knew=3 -num_splits=0 -lse=1"
    "-b=2 -h=64 -h_k=8 -s=16 -s_k=100,5000 -mask=b:64,0 -num_splits=3 -lse=1"
    "-b=2 -h=64 -h_k=8 -s=4 -s_k=3000,129 -mask=b -num_splits=0 -lse=1"
    "-b=3 -h=8 -h_k=4 -s=1 -s_k=500,7,1 -cache_batch_idx=1 -s_knew=2 -num_splits=0 -lse=1"
    "-b=2 -h=32 -h_k=32 -s=16 -s_k=2048,1500 -mask=b -num_splits=0 -lse=1"
    "-b=1 -h=32 -h_k=8 -s=16 -s_k=9000 -page_block_size=256 -mask=b -num_splits=0"
    "-b=64 -h=32 -h_k=8 -s=1 -s_k=4096 -num_splits=0"
)
with_lib() {  # variant, command...: the command with the variant's library first on the loader's path
    local name=$1
    shift
    LD_LIBRARY_PATH="$(dirname "$(lib_of "$name")")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$@"
}
checks() {  # variant
    local a
    for a in "${runs[@]}"; do
        # shellcheck disable=SC2086
        with_lib "$1" timeout 120 "$exe" -prec=bf16 -d=128 -v=1 -kname=1 -warmup=1 -repeat=2 $a 2>&1
        echo "rc=$?"
    done
}
memcheck() {  # log, variant, arguments
    local log=$1 name=$2
    shift 2
    with_lib "$name" timeout 150 compute-sanitizer --tool memcheck --error-exitcode 99 "$exe" -prec=bf16 -d=128 \
        -v=1 -warmup=0 -repeat=1 -kname=1 "$@" >"$out/$log" 2>&1
    echo "rc=$?" >>"$out/$log"
}
if [ -x "$exe" ]; then
    (BENCH=$exe MHA_TIMEOUT=150 timeout 180 bash smoke_tests/smoke_test_decode.sh -k -j 8 >"$out/smoke_head.log" 2>&1
     echo "rc=$?" >>"$out/smoke_head.log") &
    for c in "${cands[@]}"; do
        [ -f "$(lib_of "$c")" ] || continue
        memcheck "memcheck_paged_$c.log" "$c" -b=2 -h=32 -h_k=8 -s=4 -s_k=3000,777 -page_block_size=256 \
            -num_splits=5 -mask=b -s_knew=2 -lse=1 &
        memcheck "memcheck_batch_$c.log" "$c" -b=32 -h=32 -h_k=8 -s=1 -s_k=2048 -num_splits=0 -lse=1 &
    done
    for v in "${cands[@]}"; do
        [ -f "$(lib_of "$v")" ] || continue
        checks "$v" >"$out/checks_$v.log" &
    done
    wait
    for v in head; do
        f=$out/smoke_$v.log
        [ -f "$f" ] && note "smoke $v: $(grep -o 'smoke_test_decode: [0-9]* passed, [0-9]* failed' "$f") $(tail -1 "$f"); instances: $(grep -o 'splitkv_[a-z0-9_]*' "$f" | sort | uniq -c | sort -rn | awk '{printf "%s %s; ", $1, $2}')"
    done
    for v in "${cands[@]}"; do
        f=$out/checks_$v.log
        [ -f "$f" ] && note "checks $v: $(grep -c 'valid:y' "$f") of ${#runs[@]} valid:y, $(grep -c 'valid:n' "$f") valid:n, rc $(grep -o 'rc=[0-9]*' "$f" | sort | uniq -c | tr -s ' \n' ' '); instances: $(grep -o 'splitkv_[a-z0-9_]*' "$f" | sort | uniq -c | awk '{printf "%s %s; ", $1, $2}')"
    done
    for f in "$out"/memcheck_*.log; do
        [ -f "$f" ] && note "$(basename "$f" .log): $(grep -o 'ERROR SUMMARY: [0-9]* errors' "$f") $(tail -1 "$f"), $(grep -o 'valid:[yn]' "$f" | head -1), $(grep -o 'splitkv_[a-z0-9_]*' "$f" | head -1)"
    done
fi
note "correctness in $(elapsed "$t0")"

# ---------------- 3. timing, one library at a time ----------------
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export MHAKIT_CACHE_DIR=${MHAKIT_CACHE_DIR:-$(mktemp -d)}  # the C call path's host extension only
bench() {  # variant, bench_decode.py arguments
    local name=$1 lib t0
    shift
    lib=$(lib_of "$name")
    if [ ! -f "$lib" ]; then note "bench $name: no library"; return; fi
    if [ "$(left)" -lt 45 ]; then note "bench $name: skipped (time)"; return; fi
    t0=$(date +%s)
    timeout 120 python3 bench/bench_decode.py --lib "$lib" --sq 1,4,16 --json "$out/bench_$name.json" "$@" \
        >"$out/bench_$name.md" 2>"$out/bench_$name.err"
    note "bench $name: rc=$? in $(elapsed "$t0") ($(grep -c 'FAIL\|differs' "$out/bench_$name.md") failing rows)"
}
t0=$(date +%s)
bench head --page 64 --peers cudnn,fa2 --show-kernel
bench base --page 0 --peers cudnn
bench c1s2 --page 64 --peers cudnn --show-kernel
bench s2 --page 64 --peers cudnn --show-kernel
bench s4 --page 64 --peers cudnn --show-kernel
note "timing in $(elapsed "$t0")"

# ---------------- 4. fixed cost and streaming rate (if time is left) ----------------
# b=16 32/8 and b=1 32/8 at s_q = 1 over cache lengths 2k .. 64k: table.md fits each library's (and cuDNN's) time
# per call to T0 + bytes / BW, separating the fixed cost of a call (launch, ramp, the last CTAs' tail, epilogue,
# combine) from the rate the K/V stream runs at. From the 2026-11-23 table: ours ~14 us + bytes / 4.22 TB/s,
# cuDNN ~3 us + bytes / 4.41 TB/s (fitted on b=8 64/8 64k and b=16 32/8 8k).
t0=$(date +%s)
for v in base c1s2 s2 s4; do
    lib=$(lib_of "$v")
    [ -f "$lib" ] || continue
    if [ "$(left)" -lt 40 ]; then note "sweep $v: skipped (time)"; continue; fi
    timeout 60 python3 bench/bench_decode.py --lib "$lib" --rows 1,16 --sq 1 --sk 2048,4096,8192,16384,32768,65536 \
        --page 0 --peers cudnn --json "$out/sweep_$v.json" >"$out/sweep_$v.md" 2>"$out/sweep_$v.err"
    note "sweep $v: rc=$?"
done
note "sweeps in $(elapsed "$t0")"
# Kernel times and DRAM throughput of the split kernel and the combine on base (ncu, when installed; it serialises
# the two kernels, so the combine's own time shows).
if command -v ncu >/dev/null 2>&1 && [ -x "$exe" ] && [ -f "$(lib_of base)" ] && [ "$(left)" -gt 30 ]; then
    for a in "-b=16 -h=32 -h_k=8 -s=1 -s_k=8192" "-b=8 -h=64 -h_k=8 -s=1 -s_k=65536" "-b=1 -h=32 -h_k=8 -s=1 -s_k=32768"; do
        # shellcheck disable=SC2086
        with_lib base timeout 60 ncu --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \
            "$exe" -prec=bf16 -d=128 -v=0 -warmup=0 -repeat=1 -num_splits=0 $a 2>&1
    done >"$out/ncu_base.log"
    note "ncu (base): $(grep -c 'gpu__time_duration' "$out/ncu_base.log") kernel records in ncu_base.log"
fi

# ---------------- 5. table ----------------
python3 - "$out" >"$out/table.md" 2>&1 <<'PY'
import json, os, sys
out = sys.argv[1]
def load(name):
    path = os.path.join(out, f"bench_{name}.json")
    try:
        return {(r["sq"], r["b"], r["hq"], r["hk"], r["sk"]): r for r in json.load(open(path))["rows"]}
    except (OSError, ValueError, KeyError):
        return {}
variants = ["base", "head", "s2", "s4", "c1s2", "w8s2"]
runs = {v: load(v) for v in variants}
head = runs["head"]
def val(v, k, field="mhakit_tbs"):
    r = runs[v].get(k)
    return None if r is None else r.get(field)
def cell(v, k, field="mhakit_tbs"):
    x = val(v, k, field)
    r = runs[v].get(k) or {}
    bad = field == "mhakit_tbs" and (r.get("verified") is False or r.get("paged_matches") is False)
    return ("-" if x is None else f"{x:.2f}") + (" FAIL" if bad else "")
keys = sorted({k for rows in runs.values() for k in rows})
print("TB/s of K + V read (bench_decode.py, bf16 d128); peers from head's run; x: over the better of cuDNN and FA2")
print()
print("| s_q | b | h_q/h_k | s_k | base | head | s2 | s4 | c1s2 | w8s2 | head p64 | s2 p64 | s4 p64 | c1s2 p64 | cuDNN | FA2 | cuDNN in base / s2 / s4 / c1s2 / w8s2 | best x |")
print("|---" * 18 + "|")
for k in keys:
    sq, b, hq, hk, sk = k
    peers = [x for x in (val("head", k, "cudnn_tbs"), val("head", k, "fa2_tbs")) if x]
    best_peer = max(peers) if peers else None
    ours = {v: val(v, k) for v in variants if val(v, k)}
    best_v = max(ours, key=ours.get) if ours else None
    best = f"{best_v} {ours[best_v] / best_peer:.2f}x" if best_v and best_peer else "-"
    drift = " / ".join(cell(v, k, "cudnn_tbs") for v in ("base", "s2", "s4", "c1s2", "w8s2"))
    print(f"| {sq} | {b} | {hq}/{hk} | {sk} | " + " | ".join(cell(v, k) for v in variants) + " | "
          + " | ".join(cell(v, k, "mhakit_paged_tbs") for v in ("head", "s2", "s4", "c1s2")) + f" | "
          f"{cell('head', k, 'cudnn_tbs')} | {cell('head', k, 'fa2_tbs')} | {drift} | {best} |")
print()
print("Fixed cost and streaming rate per call, T = T0 + bytes / BW, least squares over the s_k sweep (s_q = 1):")
print()
print("| row | library | T0 us | BW TB/s | cuDNN T0 us | cuDNN BW TB/s | points |")
print("|---|---|---|---|---|---|---|")
def fit(points):
    if len(points) < 2:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return None
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - slope * mx, slope  # us, us per byte
def fmt_fit(f):
    return ("-", "-") if f is None or f[1] <= 0 else (f"{f[0]:.1f}", f"{1e-6 / f[1]:.2f}")
for v in ["base", "s2", "s4", "c1s2", "w8s2"]:
    path = os.path.join(out, f"sweep_{v}.json")
    try:
        rows = json.load(open(path))["rows"]
    except (OSError, ValueError, KeyError):
        continue
    for b in sorted({r["b"] for r in rows}):
        sel = [r for r in rows if r["b"] == b]
        def pts(field):
            return [(r["kv_bytes"], r["kv_bytes"] / (r[field] * 1e12) * 1e6) for r in sel if r.get(field)]
        ours, peer = fmt_fit(fit(pts("mhakit_tbs"))), fmt_fit(fit(pts("cudnn_tbs")))
        r0 = sel[0]
        print(f"| b={b} {r0['hq']}/{r0['hk']} | {v} | {ours[0]} | {ours[1]} | {peer[0]} | {peer[1]} | {len(sel)} |")
PY
note "table: $out/table.md"
note "whole run in $(elapsed "$t_all")"
{ echo; echo "---- table.md"; cat "$out/table.md"; } >>"$summary"
echo
cat "$summary"
