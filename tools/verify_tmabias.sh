#!/usr/bin/env bash
# The Hopper forward's staged elementwise bias loaded by TMA (branch tmabias, issue 12): correctness of the bias
# calls on the "_mods" instances, then what a bias costs over the plain call, base (main) and branch interleaved.
#
#   OUT=/path/to/logs BASE=/path/to/export/of/main-at-91ab2b5 bash tools/verify_tmabias.sh
#
# Run from an export of the branch on the H200 machine (16 cores, nvcc 13.0, compute-sanitizer). Libraries:
#   head   this branch, default profile, the d128 bf16 Hopper b128x128 instances (batch / group, mask / nmask, plain
#          and "_mods": what the issue-12 calls run on) + benchmark_mha_fwd          (build/tmabias/head)
#   extra  this branch, profile all: the d128 bf16 nmask "_mods" (batch, group), d128 fp16 batch mask "_mods" and
#          d96 bf16 batch mask "_mods" instances: correctness only                   (build/tmabias/extra)
#   base   $BASE, the same instances as head + its own benchmark_mha_fwd            ($BASE/build/tmabias/base)
# Steps (each under `timeout`; a failing step does not stop the later ones; logs under $OUT, summary.txt first):
#   1. build (~80-110 s): head, extra and base at once (-j 6, -j 4, -j 6 on the 16 cores; 6 + 4 + 6 instances, each
#      ~50-60 s of a core, + the runtime and benchmark_mha_fwd).
#   2. correctness (~60-80 s, runs 4 at a time): host-validated runs (-v=1 -kname=1; each must say valid:y and name
#      the expected "_mods_sm90a_hopper_" instance): bias e / e:1 / e:2, every mask kind (none, t, b, windows, g:y,x),
#      s_k 1000 / 520 / 77 (partial key tiles, rows aligned), odd s_q, s_q != s_k, GQA / MQA, group mode with uneven
#      and empty sequences, soft-cap and sink combined, unaligned s_k 4092 (the fallback), fp16, d96;
#      compute-sanitizer memcheck on a group-mode and a batch partial-tile case (~30 s each, beside the runs).
#   3. timing (~110-140 s): issue 12's cost loop, benchmark_mha_fwd -prec=bf16 -b=1 -h=16 -s=4096 -d=128
#      -warmup=10 -repeat=30, -mask=0 and b, plain / -bias=e / -bias=e:1 / -logits_soft_cap=30 / -sink=1, base and
#      head interleaved, 3 repetitions; plus group mode (-mode=1 -b=2 -s=4096,4096, causal) plain and bias e; medians
#      in a markdown table (ms and cost over plain per tree, head / base). 72 runs of ~1-4 s (e:1 makes 512 MB).
#      The script stops starting timing runs at ~315 s.
# cuDNN / FA2: bench_mods.py (the repo's modifier bench, cuDNN with the bias as attn_mask) goes through the JIT
# cache, which would compile its kernels inside the time budget; not run here (the lead's usual bench_mods.py run
# gives the peers).
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
out=${OUT:-$repo/verify_tmabias_logs}
base_tree=${BASE:-}
mkdir -p "$out"
summary=$out/summary.txt
: >"$summary"
details=$out/details.txt
: >"$details"
note() { echo "$1" >>"$summary"; echo "== $1"; }
detail() { echo "$1" >>"$details"; }
t_all=$(date +%s)
elapsed() { echo "$(( $(date +%s) - $1 )) s"; }
left() { echo $(( 315 - ($(date +%s) - t_all) )); }
nvidia-smi --query-gpu=name,compute_cap,driver_version,clocks.sm,clocks.max.sm --format=csv >"$out/gpu.txt" 2>&1

# ---------------- 1. build ----------------
head_filter='fwd_d128_bf16_*_sm90a_hopper_b128x128'
extra_filter='fwd_d128_bf16_*_nmask_mods_sm90a_hopper_b128x128,fwd_d128_fp16_batch_mask_mods_sm90a_hopper_b128x128,fwd_d96_bf16_batch_mask_mods_sm90a_hopper_b128x128'
build() {  # name, tree, profile, filter, jobs, extra compile.py arguments
    local name=$1 tree=$2 profile=$3 filter=$4 jobs=$5 t0
    shift 5
    t0=$(date +%s)
    mkdir -p "$tree/build/tmabias/$name"
    (cd "$tree/build/tmabias/$name" && timeout 200 python3 "$tree/compile.py" --api fwd --arch sm_90a \
        --profile "$profile" --filter "$filter" -j "$jobs" --build-dir "$tree/build/tmabias/obj_$name" "$@") \
        >"$out/build_$name.log" 2>&1
    note "build $name: rc=$? in $(elapsed "$t0"): $(tail -1 "$out/build_$name.log")"
}
t0=$(date +%s)
if [ -n "$base_tree" ] && [ -f "$base_tree/compile.py" ]; then
    build base "$base_tree" default "$head_filter" 6 --benchmark &
else
    note "build base: BASE is not set to an export of main (91ab2b5): no base timings"
fi
build head "$repo" default "$head_filter" 6 --benchmark &
build extra "$repo" all "$extra_filter" 4 &
wait
note "builds in $(elapsed "$t0")"
exe_of() { if [ "$1" = base ]; then echo "$base_tree/build/tmabias/base/benchmark_mha_fwd"; else echo "$repo/build/tmabias/head/benchmark_mha_fwd"; fi; }
libdir_of() { if [ "$1" = base ]; then echo "$base_tree/build/tmabias/base"; else echo "$repo/build/tmabias/$1"; fi; }
with_lib() {  # library name, command...: the command with that library first on the loader's path
    local name=$1
    shift
    LD_LIBRARY_PATH="$(libdir_of "$name")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$@"
}
exe=$(exe_of head)
[ -x "$exe" ] || note "MISSING: $exe (head's build failed): no correctness runs, no head timings"

# ---------------- 2. correctness ----------------
# "library|expected instance (a substring of the -kname=1 name)|arguments"
runs=(
    "head|d128_bf16_batch_mask_mods_sm90a_hopper|-b=2 -h=4 -s=1000 -s_k=1000 -mask=t -bias=e"
    "head|d128_bf16_batch_mask_mods_sm90a_hopper|-b=2 -h=4 -s=333 -s_k=520 -mask=b -bias=e:1"
    "head|d128_bf16_batch_mask_mods_sm90a_hopper|-b=2 -h=4 -h_k=2 -s=257 -s_k=1000 -mask=b -bias=e:2 -logits_soft_cap=30"
    "head|d128_bf16_batch_mask_mods_sm90a_hopper|-b=1 -h=8 -h_k=1 -s=777 -s_k=520 -mask=t:128,30 -bias=e:1 -sink=1"
    "head|d128_bf16_batch_mask_mods_sm90a_hopper|-b=2 -h=3 -s=64 -s_k=520 -mask=g:30,100 -bias=e"
    "head|d128_bf16_batch_mask_mods_sm90a_hopper|-b=2 -h=4 -s=129 -s_k=77 -mask=b:64,0 -bias=e:2 -logits_soft_cap=30 -sink=1"
    "head|d128_bf16_batch_mask_mods_sm90a_hopper|-b=1 -h=4 -s=1025 -s_k=1000 -mask=b -bias=e:2"
    "head|d128_bf16_batch_mask_mods_sm90a_hopper|-b=1 -h=2 -s=300 -s_k=4092 -mask=t -bias=e:1"
    "head|d128_bf16_batch_mask_mods_sm90a_hopper|-b=2 -h=2 -s=1000 -s_k=1000 -bias=e"
    "head|d128_bf16_group_mask_mods_sm90a_hopper|-mode=1 -b=3 -h=4 -h_k=2 -s=1000,0,333 -s_k=1000,520,0 -mask=b -bias=e:2"
    "head|d128_bf16_group_mask_mods_sm90a_hopper|-mode=1 -b=3 -h=4 -s=1024,1000,517 -s_k=1024,1000,520 -mask=t -bias=e:1 -logits_soft_cap=20 -sink=1"
    "head|d128_bf16_group_mask_mods_sm90a_hopper|-mode=1 -b=2 -h=2 -s=300,2000 -s_k=500,1900 -mask=b -bias=e"
    "head|d128_bf16_group_mask_mods_sm90a_hopper|-mode=1 -b=2 -h=2 -h_k=1 -s=200,100 -s_k=4092,77 -mask=t:64,0 -bias=e:2"
    "head|d128_bf16_group_mask_mods_sm90a_hopper|-mode=1 -b=4 -h=2 -s=64,130,1,700 -s_k=128,64,520,1000 -mask=0 -bias=e:1 -sink=1"
    "extra|d128_bf16_batch_nmask_mods_sm90a_hopper|-b=2 -h=4 -h_k=1 -s=1000 -s_k=520 -bias=e:1 -logits_soft_cap=30"
    "extra|d128_bf16_group_nmask_mods_sm90a_hopper|-mode=1 -b=3 -h=2 -s=513,0,1000 -s_k=1000,77,520 -bias=e:2"
    "extra|d128_fp16_batch_mask_mods_sm90a_hopper|-prec=fp16 -b=2 -h=4 -h_k=2 -s=1000 -s_k=1000 -mask=b -bias=e:1"
    "extra|d128_fp16_batch_mask_mods_sm90a_hopper|-prec=fp16 -b=1 -h=4 -s=333 -s_k=520 -mask=t:64,64 -bias=e -sink=1"
    "extra|d96_bf16_batch_mask_mods_sm90a_hopper|-d=96 -b=2 -h=4 -s=1000 -s_k=520 -mask=b -bias=e:2 -logits_soft_cap=30"
    "extra|d96_bf16_batch_mask_mods_sm90a_hopper|-d=96 -b=1 -h=2 -s=777 -s_k=1000 -mask=t -bias=e:1 -sink=1"
)
check_one() {  # index, spec: one host-validated run, its verdict on one line
    local i=$1 lib=${2%%|*} rest=${2#*|} want args log rc line
    want=${rest%%|*}
    args=${rest#*|}
    log=$out/check_$i.log
    # shellcheck disable=SC2086
    with_lib "$lib" timeout 100 "$exe" -prec=bf16 -d=128 -v=1 -kname=1 -lse=1 -warmup=1 -repeat=2 $args >"$log" 2>&1
    rc=$?
    line=$(grep -m1 'valid:' "$log")
    # the instance: "[mhakit] mha_fwd -> <name>" (-kname=1), a line of its own
    if [ $rc -eq 0 ] && echo "$line" | grep -q 'valid:y' && grep -q "mha_fwd -> fwd_$want" "$log"; then
        echo "PASS check_$i [$lib] $args"
    else
        echo "FAIL check_$i [$lib] $args (rc=$rc, want $want): $(tail -2 "$log" | tr '\n' ' ' | cut -c1-300)"
    fi
}
memcheck() {  # name, arguments
    local name=$1 log
    shift
    log=$out/memcheck_$name.log
    with_lib head timeout 150 compute-sanitizer --tool memcheck --error-exitcode 99 "$exe" -prec=bf16 -d=128 -v=1 \
        -kname=1 -warmup=0 -repeat=1 "$@" >"$log" 2>&1
    echo "rc=$?" >>"$log"
}
t0=$(date +%s)
if [ -x "$exe" ]; then
    memcheck group -mode=1 -b=3 -h=2 -h_k=1 -s=300,0,129 -s_k=520,77,1000 -mask=b -bias=e:2 &
    memcheck batch -b=1 -h=2 -s=200 -s_k=520 -mask=t -bias=e:1 -logits_soft_cap=30 &
    : >"$out/checks.txt"
    i=0
    for spec in "${runs[@]}"; do
        check_one "$i" "$spec" >>"$out/checks.txt" &
        i=$((i + 1))
        if (( i % 4 == 0 )); then wait -n 2>/dev/null; wait -n 2>/dev/null; fi
    done
    wait
    note "checks: $(grep -c '^PASS' "$out/checks.txt") of ${#runs[@]} PASS, $(grep -c '^FAIL' "$out/checks.txt") FAIL"
    grep '^FAIL' "$out/checks.txt" >>"$summary"
    for f in "$out"/memcheck_*.log; do
        [ -f "$f" ] && note "$(basename "$f" .log): $(grep -o 'ERROR SUMMARY: [0-9]* errors' "$f") $(tail -1 "$f"), $(grep -o 'valid:[yn]' "$f" | head -1), $(grep -o 'fwd_[a-z0-9_]*' "$f" | head -1)"
    done
fi
note "correctness in $(elapsed "$t0")"

# ---------------- 3. timing: the cost loop, base and head interleaved ----------------
t0=$(date +%s)
trees=(head)
[ -x "$(exe_of base)" ] && trees=(base head)
variants=("plain|" "bias e|-bias=e" "bias e:1|-bias=e:1" "softcap 30|-logits_soft_cap=30" "sink|-sink=1")
masks=(0 b g)  # g: group mode, two sequences of 4096 (the map's group-mode extents, boundary slots from global)
: >"$out/timing.txt"
stopped=""
for rep in 1 2 3; do
    for mask in "${masks[@]}"; do
        for v in "${variants[@]}"; do
            for tree in "${trees[@]}"; do
                if [ "$(left)" -le 0 ]; then stopped="rep $rep"; break 4; fi
                shape="-b=1 -h=16 -s=4096 -mask=$mask"
                if [ "$mask" = g ]; then
                    case ${v%%|*} in plain|"bias e") ;; *) continue ;; esac
                    shape="-mode=1 -b=2 -h=16 -s=4096,4096 -s_k=4096,4096 -mask=b"
                fi
                log=$out/time_${tree}_${mask}_${rep}_$(echo "${v%%|*}" | tr ' :' '__').log
                # shellcheck disable=SC2086
                with_lib "$tree" timeout 40 "$(exe_of "$tree")" -prec=bf16 $shape -d=128 -v=0 \
                    -kname=1 -warmup=10 -repeat=30 ${v#*|} >"$log" 2>&1
                ms=$(grep -o '[0-9.]* ms,' "$log" | head -1 | cut -d' ' -f1)
                name=$(grep -o 'mha_fwd -> fwd_[a-z0-9_]*' "$log" | head -1 | cut -d' ' -f3)
                echo "$tree|$mask|${v%%|*}|$rep|${ms:-NA}|${name:-no instance named}" >>"$out/timing.txt"
            done
        done
    done
done
[ -n "$stopped" ] && note "timing stopped at $stopped (time budget)"
python3 - "$out/timing.txt" >"$out/table.md" 2>"$out/table.err" <<'EOF'
import statistics, sys
rows = [l.rstrip("\n").split("|", 5) for l in open(sys.argv[1]) if l.count("|") >= 5]
ms = {}
for tree, mask, var, rep, t, _ in rows:
    try:
        ms.setdefault((tree, mask, var), []).append(float(t))
    except ValueError:
        pass
med = {k: statistics.median(v) for k, v in ms.items()}
trees = [t for t in ("base", "head") if any(k[0] == t for k in med)]
print("bf16 b=1 h=16 s=4096 d=128, median ms of up to 3 runs (benchmark_mha_fwd -warmup=10 -repeat=30); cost = "
      "ms / plain ms - 1 of the same tree and mask; mask g: group mode -b=2 -s=4096,4096, causal (b)")
print()
hdr = "| mask | call | " + " | ".join(f"{t} ms | {t} cost" for t in trees) + (" | head / base |" if len(trees) == 2 else " |")
print(hdr)
print("|" + "---|" * (2 + 2 * len(trees) + (1 if len(trees) == 2 else 0)))
for mask in ("0", "b", "g"):
    for var in ("plain", "bias e", "bias e:1", "softcap 30", "sink"):
        cells = []
        for t in trees:
            m, p = med.get((t, mask, var)), med.get((t, mask, "plain"))
            cells.append(f"{m:.3f}" if m else "NA")
            cells.append(f"{100 * (m / p - 1):+.0f} %" if m and p and var != "plain" else "")
        if not any(med.get((t, mask, var)) for t in trees):
            continue
        if len(trees) == 2:
            b, h = med.get(("base", mask, var)), med.get(("head", mask, var))
            cells.append(f"{h / b:.3f}" if b and h else "NA")
        print(f"| {mask} | {var} | " + " | ".join(cells) + " |")
EOF
note "timing in $(elapsed "$t0") ($(wc -l <"$out/timing.txt") runs)"
# Key lines first: the bias rows of the table, then the whole table, then the details.
{
    echo "--- key lines (table.md) ---"
    grep -E '\| (bias e|bias e:1|softcap 30|sink) \|' "$out/table.md" 2>/dev/null
    echo "--- table.md ---"
    cat "$out/table.md" 2>/dev/null
    cat "$out/table.err" 2>/dev/null
    echo "--- steps ---"
    cat "$summary"
    echo "--- instances of the timing runs (tree|mask|call|instance) ---"
    cut -d'|' -f1,2,3,6 "$out/timing.txt" | sort | uniq -c
    cat "$details"
} >"$out/summary.tmp" && mv "$out/summary.tmp" "$summary"
echo "total $(elapsed "$t_all")" >>"$summary"
cat "$summary"
