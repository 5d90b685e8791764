#!/usr/bin/env bash
# The Hopper backward's staged elementwise bias loaded by TMA (branch tmabwd, issue 12): correctness of the backward's
# bias calls on the "_mods" instances, then what a bias costs over the plain backward call, base (main) and branch
# interleaved.
#
#   OUT=/path/to/logs BASE=/path/to/export/of/main-at-ffff616 bash tools/verify_tmabwd.sh
#
# Run from an export of the branch on the H200 machine (16 cores, nvcc 13.0, compute-sanitizer, PyTorch for the
# peers). Libraries (each directory: libmha_fwd.so first, then libmha_bwd.so + benchmark_mha_bwd, which links it):
#   head  this branch, profile all (fp16 "_mods" is only there): forward d128 bf16 Hopper batch mask / nmask /
#         mask_mods, group mask_mods, d128 fp16 batch mask_mods, d64 bf16 batch / group mask_mods; backward the same
#         signatures (b64x128)                                                     (build/tmabwd/head)
#   base  $BASE, default profile: forward and backward d128 bf16 Hopper batch mask / nmask / mask_mods  (timing only)
#                                                                                  ($BASE/build/tmabwd/base)
# Steps (each under `timeout`; a failing step does not stop the later ones; logs under $OUT, summary.txt first):
#   1. build (~110-140 s): head and base at once (-j 8 each): forward 7 + 3 instances (~40 s a wave), then backward
#      7 + 3 (~40-60 s a wave on one core each) + the runtimes and benchmark_mha_bwd.
#   2. correctness (~50-70 s, 4 runs at a time; host validation of every dq / dk / dv (and dbias) element):
#      benchmark_mha_bwd -v=1 -kname=1, each must say valid:y and name the expected "_mods_sm90a_hopper_" instance:
#      bias e / e:1 / e:2, with and without -dbias=1, every mask kind (none, t, b, windows, g:y,x), s_k 1000 / 520 /
#      77 (partial key tiles), odd s_q, s_q != s_k, GQA / MQA, group mode with uneven and empty sequences, soft-cap
#      and sink combined, deterministic, s_k 4092 (unaligned rows: the unstaged fallback), fp16, d64 (batch, group);
#      compute-sanitizer memcheck on a group-mode and a batch partial-tile case with -dbias=1 (~30 s each, beside).
#   3. timing (what is left of ~300 s; typically ~100-130 s): issue 12's cost loop, benchmark_mha_bwd -prec=bf16
#      -b=1 -h=16 -s=4096 -d=128 -warmup=10 -repeat=30, -mask=0 and b, plain / -bias=e / -bias=e:1 /
#      -logits_soft_cap=30 / -sink=1, base and head interleaved, 3 repetitions (each run ~1-2 s, e:1 makes 512 MB on
#      the host); medians in a markdown table (ms and cost over plain per tree, head / base). The loop stops starting
#      runs at 285 s; then, if 30 s are left, bench/bench_bwd.py (plain d128 s=4096 h=16, causal and not, --peers
#      cudnn,fa2) once on the head's library for the peers' times (the bias calls have no peer in bench_bwd.py).
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
out=${OUT:-$repo/verify_tmabwd_logs}
base_tree=${BASE:-}
mkdir -p "$out"
summary=$out/summary.txt
: >"$summary"
note() { echo "$1" >>"$summary"; echo "== $1"; }
t_all=$(date +%s)
elapsed() { echo "$(( $(date +%s) - $1 )) s"; }
left() { echo $(( 285 - ($(date +%s) - t_all) )); }
nvidia-smi --query-gpu=name,compute_cap,driver_version,clocks.sm,clocks.max.sm --format=csv >"$out/gpu.txt" 2>&1
note "verify_tmabwd: branch $(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo '(export)') vs base ${base_tree:-none}; $(tail -1 "$out/gpu.txt")"

# ---------------- 1. build ----------------
head_fwd='fwd_d128_bf16_batch_mask_sm90a_hopper,fwd_d128_bf16_batch_nmask_sm90a_hopper,fwd_d128_bf16_batch_mask_mods_sm90a_hopper,fwd_d128_bf16_group_mask_mods_sm90a_hopper,fwd_d128_fp16_batch_mask_mods_sm90a_hopper,fwd_d64_bf16_batch_mask_mods_sm90a_hopper,fwd_d64_bf16_group_mask_mods_sm90a_hopper'
head_bwd=${head_fwd//fwd_/bwd_}
base_fwd='fwd_d128_bf16_batch_mask_sm90a_hopper,fwd_d128_bf16_batch_nmask_sm90a_hopper,fwd_d128_bf16_batch_mask_mods_sm90a_hopper'
base_bwd=${base_fwd//fwd_/bwd_}
build() {  # name, tree, profile, forward filter, backward filter: both libraries and benchmark_mha_bwd in one directory
    local name=$1 tree=$2 profile=$3 ffilter=$4 bfilter=$5 t0 rc
    t0=$(date +%s)
    mkdir -p "$tree/build/tmabwd/$name"
    (cd "$tree/build/tmabwd/$name" && timeout 150 python3 "$tree/compile.py" --api fwd --arch sm_90a \
        --profile "$profile" --filter "$ffilter" -j 8 --build-dir "$tree/build/tmabwd/obj_fwd_$name") \
        >"$out/build_${name}_fwd.log" 2>&1
    rc=$?
    (cd "$tree/build/tmabwd/$name" && timeout 200 python3 "$tree/compile.py" --api bwd --arch sm_90a \
        --profile "$profile" --filter "$bfilter" -j 8 --benchmark --build-dir "$tree/build/tmabwd/obj_bwd_$name") \
        >"$out/build_${name}_bwd.log" 2>&1
    note "build $name: fwd rc=$rc, bwd rc=$? in $(elapsed "$t0"): $(tail -1 "$out/build_${name}_fwd.log" | cut -c1-100) / $(tail -1 "$out/build_${name}_bwd.log" | cut -c1-100)"
}
t0=$(date +%s)
if [ -n "$base_tree" ] && [ -f "$base_tree/compile.py" ]; then
    build base "$base_tree" default "$base_fwd" "$base_bwd" &
else
    note "build base: BASE is not set to an export of main (ffff616): no base timings"
fi
build head "$repo" all "$head_fwd" "$head_bwd" &
wait
note "builds in $(elapsed "$t0")"
dir_of() { if [ "$1" = base ]; then echo "$base_tree/build/tmabwd/base"; else echo "$repo/build/tmabwd/head"; fi; }
exe_of() { echo "$(dir_of "$1")/benchmark_mha_bwd"; }
with_lib() {  # tree, command...: the command with that tree's libraries first on the loader's path
    local dir
    dir=$(dir_of "$1")
    shift
    LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$@"
}
exe=$(exe_of head)
[ -x "$exe" ] || note "MISSING: $exe (head's build failed): no correctness runs, no head timings"

# ---------------- 2. correctness ----------------
# "expected instance (a substring of the -kname=1 name)|arguments" (d128 bf16 unless the arguments say otherwise; a
# masked "_mods" instance serves unmasked modifier calls too)
B=d128_bf16_batch_mask_mods_sm90a_hopper
G=d128_bf16_group_mask_mods_sm90a_hopper
runs=(
    "$B|-b=2 -h=4 -s=1000 -s_k=1000 -mask=t -bias=e"
    "$B|-b=2 -h=4 -s=1000 -s_k=1000 -mask=t -bias=e -dbias=1"
    "$B|-b=2 -h=4 -s=333 -s_k=520 -mask=b -bias=e:1 -dbias=1"
    "$B|-b=2 -h=4 -h_k=2 -s=257 -s_k=1000 -mask=b -bias=e:2 -logits_soft_cap=30 -dbias=1"
    "$B|-b=1 -h=8 -h_k=1 -s=777 -s_k=520 -mask=t:128,30 -bias=e:1 -sink=1"
    "$B|-b=2 -h=3 -s=64 -s_k=520 -mask=g:30,100 -bias=e -dbias=1"
    "$B|-b=2 -h=4 -s=129 -s_k=77 -mask=b:64,0 -bias=e:2 -logits_soft_cap=30 -sink=1"
    "$B|-b=1 -h=4 -s=1025 -s_k=1000 -mask=b -bias=e:2 -deterministic=1 -dbias=1"
    "$B|-b=1 -h=2 -s=300 -s_k=4092 -mask=t -bias=e:1 -dbias=1"
    "$B|-b=2 -h=2 -s=1000 -s_k=1000 -bias=e"
    "$B|-b=1 -h=2 -s=2048 -s_k=2048 -mask=b -bias=e -deterministic=1"
    "$B|-b=1 -h=2 -s=77 -s_k=77 -bias=e:2 -dbias=1"
    "$G|-mode=1 -b=3 -h=4 -h_k=2 -s=1000,0,333 -s_k=1000,520,0 -mask=b -bias=e:2 -dbias=1"
    "$G|-mode=1 -b=3 -h=4 -s=1024,1000,517 -s_k=1024,1000,520 -mask=t -bias=e:1 -logits_soft_cap=20 -sink=1"
    "$G|-mode=1 -b=2 -h=2 -s=300,2000 -s_k=500,1900 -mask=b -bias=e -deterministic=1"
    "$G|-mode=1 -b=2 -h=2 -h_k=1 -s=200,100 -s_k=4092,77 -mask=t:64,0 -bias=e:2"
    "$G|-mode=1 -b=4 -h=2 -s=64,130,1,700 -s_k=128,64,520,1000 -mask=0 -bias=e:1 -sink=1 -dbias=1"
    "d128_fp16_batch_mask_mods_sm90a_hopper|-prec=fp16 -b=2 -h=4 -h_k=2 -s=1000 -s_k=1000 -mask=b -bias=e:1 -dbias=1"
    "d128_fp16_batch_mask_mods_sm90a_hopper|-prec=fp16 -b=1 -h=4 -s=333 -s_k=520 -mask=t:64,64 -bias=e -sink=1"
    "d64_bf16_batch_mask_mods_sm90a_hopper|-d=64 -b=2 -h=4 -s=1000 -s_k=520 -mask=b -bias=e:2 -logits_soft_cap=30 -dbias=1"
    "d64_bf16_group_mask_mods_sm90a_hopper|-d=64 -mode=1 -b=3 -h=2 -s=513,0,1000 -s_k=1000,77,520 -mask=t -bias=e:2 -dbias=1"
)
check_one() {  # index, spec: one host-validated run, its verdict on one line
    local i=$1 want=${2%%|*} args=${2#*|} log rc line
    log=$out/check_$i.log
    # shellcheck disable=SC2086
    with_lib head timeout 100 "$exe" -prec=bf16 -d=128 -v=1 -kname=1 -warmup=1 -repeat=2 $args >"$log" 2>&1
    rc=$?
    line=$(grep -m1 'valid:' "$log")
    # the instance: "[mhakit] mha_bwd -> <name>" (-kname=1), a line of its own
    if [ $rc -eq 0 ] && echo "$line" | grep -q 'valid:y' && grep -q "mha_bwd -> bwd_$want" "$log"; then
        echo "PASS check_$i $args"
    else
        echo "FAIL check_$i $args (rc=$rc, want $want): $(tail -3 "$log" | tr '\n' ' ' | cut -c1-300)"
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
    memcheck group -mode=1 -b=3 -h=2 -h_k=1 -s=300,0,129 -s_k=520,77,1000 -mask=b -bias=e:2 -dbias=1 &
    memcheck batch -b=1 -h=2 -s=200 -s_k=520 -mask=t -bias=e:1 -logits_soft_cap=30 -dbias=1 &
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
        [ -f "$f" ] && note "$(basename "$f" .log): $(grep -o 'ERROR SUMMARY: [0-9]* errors*' "$f" | head -1) $(tail -1 "$f"), $(grep -o 'valid:[yn]' "$f" | head -1), $(grep -o 'bwd_[a-z0-9_]*' "$f" | head -1)"
    done
fi
note "correctness in $(elapsed "$t0")"

# ---------------- 3. timing: the cost loop, base and head interleaved ----------------
t0=$(date +%s)
trees=()
[ -x "$(exe_of base)" ] && trees+=(base)
[ -x "$exe" ] && trees+=(head)
variants=("plain|" "bias e|-bias=e" "bias e:1|-bias=e:1" "softcap 30|-logits_soft_cap=30" "sink|-sink=1")
masks=(0 b)
: >"$out/timing.txt"
stopped=""
for rep in 1 2 3; do
    for mask in "${masks[@]}"; do
        for v in "${variants[@]}"; do
            for tree in ${trees[@]+"${trees[@]}"}; do
                if [ "$(left)" -le 0 ]; then stopped="rep $rep"; break 4; fi
                log=$out/time_${tree}_${mask}_${rep}_$(echo "${v%%|*}" | tr ' :' '__').log
                # shellcheck disable=SC2086
                with_lib "$tree" timeout 40 "$(exe_of "$tree")" -prec=bf16 -b=1 -h=16 -s=4096 -d=128 -mask=$mask \
                    -v=0 -kname=1 -warmup=10 -repeat=30 ${v#*|} >"$log" 2>&1
                ms=$(grep -o '[0-9.]* ms,' "$log" | head -1 | cut -d' ' -f1)
                name=$(grep -o 'mha_bwd -> bwd_[a-z0-9_]*' "$log" | head -1 | cut -d' ' -f3)
                echo "$tree|$mask|${v%%|*}|$rep|${ms:-NA}|${name:-no instance named}" >>"$out/timing.txt"
            done
        done
    done
done
[ -n "$stopped" ] && note "timing stopped at $stopped (time budget)"
timeout 30 python3 - "$out/timing.txt" >"$out/table.md" 2>"$out/table.err" <<'EOF'
import statistics, sys
rows = [l.rstrip("\n").split("|", 5) for l in open(sys.argv[1]) if l.count("|") >= 5]
ms, names = {}, {}
for tree, mask, var, rep, t, name in rows:
    names.setdefault((tree, mask, var), set()).add(name)
    try:
        ms.setdefault((tree, mask, var), []).append(float(t))
    except ValueError:
        pass
med = {k: statistics.median(v) for k, v in ms.items()}
trees = [t for t in ("base", "head") if any(k[0] == t for k in med)]
print("backward, bf16 b=1 h=16 s=4096 d=128, median ms of up to 3 runs (benchmark_mha_bwd -warmup=10 -repeat=30); "
      "cost = ms / plain ms - 1 of the same tree and mask")
print()
hdr = "| mask | call | " + " | ".join(f"{t} ms | {t} cost" for t in trees) + (" | head / base |" if len(trees) == 2 else " |")
print(hdr)
print("|" + "---|" * (2 + 2 * len(trees) + (1 if len(trees) == 2 else 0)))
for mask in ("0", "b"):
    for var in ("plain", "bias e", "bias e:1", "softcap 30", "sink"):
        cells = []
        for t in trees:
            m, p = med.get((t, mask, var)), med.get((t, mask, "plain"))
            cells.append(f"{m:.3f}" if m else "NA")
            cells.append(f"{100 * (m / p - 1):+.0f} %" if m and p and var != "plain" else "")
        if len(trees) == 2:
            a, b = med.get(("base", mask, var)), med.get(("head", mask, var))
            cells.append(f"{b / a:.3f}" if a and b else "NA")
        print(f"| {mask} | {var} | " + " | ".join(cells) + " |")
print()
print("instances:", "; ".join(f"{t}/{m}/{v}: {','.join(sorted(n))}" for (t, m, v), n in sorted(names.items())))
EOF
note "table rc=$? (timing in $(elapsed "$t0"))"
cat "$out/table.md" >>"$summary"

# ---------------- peers (plain calls), if time is left ----------------
if [ -x "$exe" ] && [ $(( $(left) + 15 )) -ge 30 ]; then
    with_lib head timeout $(( $(left) + 15 )) python3 "$repo/bench/bench_bwd.py" --lib "$(dir_of head)/libmha_bwd.so" \
        --shape 128,4096,0 --shape 128,4096,1 --tokens 4096 --hidden 2048 --dtype bf16 --peers cudnn,fa2 \
        --warmup 10 --repeat 30 >"$out/bench_bwd_peers.md" 2>"$out/bench_bwd_peers.err"
    note "bench_bwd.py (head, plain, peers cudnn / fa2): rc=$?"
    cat "$out/bench_bwd_peers.md" >>"$summary"
else
    note "bench_bwd.py peers: skipped (time budget)"
fi
note "total $(elapsed "$t_all")"
