#!/usr/bin/env bash
# Branch modorder: the batch-mode "_mods" forward instances take the one-tile 1-D order (kOneTileOrder) that the d256
# plain instances took in branch lpt: a causal modifier call runs heaviest query block first, (head, batch) pairs an
# L2 section at a time, instead of the 3-D grid. Run on the H200 from an export of the branch:
#
#   OUT=<log dir> BASE=<export of main> bash tools/verify_modorder.sh
#
# 1. build (~100 s, both trees at once): the d128 bf16 batch Hopper forward instances, plain and `_mods`, with
#    benchmark_mha_fwd.
# 2. correctness (~20 s): host-validated causal / window modifier calls (every modifier, GQA, odd lengths), each on
#    the `_mods` Hopper instance; memcheck on 1.
# 3. the cost loop (~90 s): b=1 h=16 s=4096 d=128 bf16, plain and each modifier, causal and unmasked, base and branch
#    interleaved, 3 repetitions, medians. Capped at MODORDER_BUDGET (300) s.
set -u
cd "$(dirname "$0")/.."
repo=$(pwd)
OUT=${OUT:-$repo/verify_modorder_logs}
BASE=${BASE:-}
BUDGET=${MODORDER_BUDGET:-300}
mkdir -p "$OUT"
summary=()
note() { summary+=("$1"); echo "== $1"; }
start=$(date +%s)
cap() {
    local left=$(( BUDGET - ($(date +%s) - start) ))
    if [ "$left" -lt 10 ]; then echo 1; elif [ "$1" -lt "$left" ]; then echo "$1"; else echo "$left"; fi
}
sel='fwd_d128_bf16_batch_*_sm90a_hopper_*'
build() {  # name, root, dir
    local t0; t0=$(date +%s)
    mkdir -p "$3"
    (cd "$3" && timeout "$(cap 170)" python3 "$2/compile.py" --arch sm_90a --api fwd --profile default --filter "$sel" \
        --benchmark -j 8 --build-dir "$3/obj") >"$OUT/build_$1.log" 2>&1
    echo "build $1: rc=$? in $(( $(date +%s) - t0 )) s" >"$OUT/build_$1.status"
}
cand=$repo/build/modorder
base=${BASE:+$BASE/build/modorder}
[ -n "$base" ] && build base "$BASE" "$base" &
build cand "$repo" "$cand" &
wait
for n in base cand; do [ -f "$OUT/build_$n.status" ] && note "$(cat "$OUT/build_$n.status")"; done

cases=(
    "-b=2 -h=4 -s=1000 -mask=t -sink=1"
    "-b=1 -h=8 -h_k=2 -s=777 -s_k=900 -mask=b -logits_soft_cap=20"
    "-b=2 -h=4 -h_k=1 -s=513 -mask=t -bias=a"
    "-b=1 -h=4 -s=640 -s_k=1024 -mask=b -bias=e"
    "-b=3 -h=2 -s=300 -s_k=257 -mask=b:64,0 -bias=e -sink=1"
    "-b=2 -h=4 -s=900 -mask=t -p_drop=0.2 -s_randval=1"
    "-b=1 -h=16 -h_k=4 -s=1500 -mask=t:128,30 -logits_soft_cap=30 -bias=a -sink=1"
    "-b=4 -h=6 -s=257 -mask=t -bias=e"
)
i=0
for c in "${cases[@]}"; do
    i=$((i + 1))
    # shellcheck disable=SC2086
    (cd "$cand" && timeout "$(cap 60)" ./benchmark_mha_fwd -prec=bf16 -d=128 $c -lse=1 -v=1 -kname=1 -warmup=0 \
        -repeat=1 >"$OUT/case_$i.out" 2>&1; echo "rc=$?" >>"$OUT/case_$i.out") &
done
wait
ok=0; bad=0; i=0
for c in "${cases[@]}"; do
    i=$((i + 1))
    out=$(cat "$OUT/case_$i.out" 2>/dev/null)
    if echo "$out" | grep -q "valid:y" && ! echo "$out" | grep -q "valid:n" &&
        echo "$out" | grep -q "fwd_d128_bf16_batch_mask_mods_sm90a_hopper_b128x128"; then
        ok=$((ok + 1))
    else
        bad=$((bad + 1)); note "case $i FAILED ($c): $(echo "$out" | tail -2 | tr '\n' ' ' | cut -c1-240)"
    fi
done
note "correct: $ok valid, $bad failed of ${#cases[@]}"
(cd "$cand" && timeout "$(cap 60)" compute-sanitizer --tool memcheck --error-exitcode 99 ./benchmark_mha_fwd -prec=bf16 \
    -d=128 -b=2 -h=4 -h_k=2 -s=777 -s_k=900 -mask=b -bias=e -sink=1 -logits_soft_cap=20 -v=1 -kname=1 -warmup=0 \
    -repeat=1 >"$OUT/memcheck.log" 2>&1
 note "memcheck: rc=$? $(grep -o 'ERROR SUMMARY: [0-9]* errors*' "$OUT/memcheck.log") $(grep -o 'valid:[yn]' "$OUT/memcheck.log" | tail -1)")

mods=("" "-sink=1" "-logits_soft_cap=30" "-bias=a" "-bias=e" "-p_drop=0.1")
: >"$OUT/cost.txt"
for rep in 1 2 3; do
    for tree in base cand; do
        dir=$cand; [ "$tree" = base ] && dir=$base
        [ -n "$dir" ] && [ -x "$dir/benchmark_mha_fwd" ] || continue
        for mask in b 0; do
            for m in "${mods[@]}"; do
                # shellcheck disable=SC2086
                ms=$(cd "$dir" && timeout "$(cap 20)" ./benchmark_mha_fwd -prec=bf16 -b=1 -h=16 -s=4096 -d=128 -v=0 \
                    -warmup=10 -repeat=30 -mask=$mask $m 2>&1 | grep -o '[0-9.]* ms' | head -1 | cut -d' ' -f1)
                echo "$tree $mask ${m:-plain} $rep ${ms:-NA}" >>"$OUT/cost.txt"
            done
        done
    done
done
timeout 30 python3 - "$OUT/cost.txt" <<'PY' >"$OUT/table.md" 2>&1
import sys, statistics as st
d = {}
for line in open(sys.argv[1]):
    tree, mask, mod, rep, ms = line.split()
    if ms != "NA":
        d.setdefault((tree, mask, mod), []).append(float(ms))
med = {k: st.median(v) for k, v in d.items()}
print("| mask | call | base ms (cost) | branch ms (cost) | branch / base |")
print("|---|---|---|---|---|")
for mask in ("b", "0"):
    for mod in ("plain", "-sink=1", "-logits_soft_cap=30", "-bias=a", "-bias=e", "-p_drop=0.1"):
        b, c = med.get(("base", mask, mod)), med.get(("cand", mask, mod))
        pb, pc = med.get(("base", mask, "plain")), med.get(("cand", mask, "plain"))
        f = lambda v, p: "-" if v is None else f"{v:.3f}" + ("" if p is None or mod == "plain" else f" ({100 * (v / p - 1):+.1f} %)")
        print(f"| {'causal' if mask == 'b' else 'none'} | {mod} | {f(b, pb)} | {f(c, pc)} | {f'{c / b:.3f}' if b and c else '-'} |")
PY
{
    echo "== summary (verify_modorder, $(date -u +%FT%TZ), $(( $(date +%s) - start )) s)"
    printf '%s\n' "${summary[@]}"
    echo
    cat "$OUT/table.md"
} | tee "$OUT/summary.txt"
