#!/usr/bin/env bash
# Branch bwd96n: the swapped key split (tile b64x96, merged for the masked (192, 128) backward) as a candidate for
# the unmasked calls too (catalogue `candidate = true`, masks = ["nmask"]), against main's unmasked 64 x 128 query
# split. Run on the H200 from the repository root of an export of the branch:
#
#   OUT=<log dir> BASE=<export of main> bash tools/verify_bwd96n.sh
#
# 1. build (~80 s, three compile.py runs at once): base's bwd_d192x128_bf16_batch_nmask b64x128; the branch's
#    (192, 128) forward instances the benchmark needs (bf16 / fp16, batch / group, nmask) and the candidate's four
#    nmask b64x96 backward instances with benchmark_mha_bwd.
# 2. correctness (~20 s): 10 host-validated benchmark_mha_bwd cases at once (odd lengths, 96-key tails, s_q != s_k,
#    GQA / MQA, group mode with empty sequences, deterministic, fp16), each valid:y on an nmask b64x96 instance;
#    compute-sanitizer memcheck on 2.
# 3. A/B timing (~60 s): bench_bwd.py --hidden 3072 non-causal (192, 128) at 1k / 4k / 16k, base and candidate
#    interleaved twice, cuDNN beside both in the first rep. Every step capped to end within BWD96N_BUDGET (240) s.
set -u
cd "$(dirname "$0")/.."
repo=$(pwd)
OUT=${OUT:-$repo/verify_bwd96n_logs}
BASE=${BASE:-}
BUDGET=${BWD96N_BUDGET:-240}
mkdir -p "$OUT"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
summary=()
note() { summary+=("$1"); echo "== $1"; }
start=$(date +%s)
cap() {
    local left=$(( BUDGET - ($(date +%s) - start) ))
    if [ "$left" -lt 10 ]; then echo 1; elif [ "$1" -lt "$left" ]; then echo "$1"; else echo "$left"; fi
}
cand=$repo/build/bwd96n/cand
base=${BASE:+$BASE/build/bwd96n/base}
mkdir -p "$cand" ${base:+"$base"}
bwd_cand='bwd_d192x128_*_nmask_sm90a_hopper_b64x96'
fwd_sel='fwd_d192x128_*_nmask_sm90a_hopper_b'

build() {  # name, timeout, dir, root, compile.py arguments...
    local name=$1 limit=$2 dir=$3 root=$4 t0
    shift 4
    t0=$(date +%s)
    (cd "$dir" && timeout "$limit" python3 "$root/compile.py" --arch sm_90a "$@") >"$OUT/build_$name.log" 2>&1
    echo "build $name: rc=$? in $(( $(date +%s) - t0 )) s" >"$OUT/build_$name.status"
}
if [ -n "$base" ] && [ -f "$BASE/compile.py" ]; then
    build base "$(cap 150)" "$base" "$BASE" --api bwd --profile default --filter bwd_d192x128_bf16_batch_nmask_sm90a_hopper \
        -j 6 --build-dir "$base/obj" &
else
    base=
    note "BASE unset: no base column"
fi
build fwd "$(cap 150)" "$cand" "$repo" --api fwd --profile default --filter "$fwd_sel" -j 5 --build-dir "$cand/obj_fwd" &
build cand_objects "$(cap 150)" "$cand" "$repo" --api bwd --profile candidates --filter "$bwd_cand" -j 5 \
    --build-dir "$cand/obj_bwd" &
wait
build cand "$(cap 100)" "$cand" "$repo" --api bwd --profile candidates --filter "$bwd_cand" --benchmark -j 16 \
    --build-dir "$cand/obj_bwd"
for n in base fwd cand_objects cand; do [ -f "$OUT/build_$n.status" ] && note "$(cat "$OUT/build_$n.status")"; done

cases=(
    "-prec=bf16 -b=2 -h=4 -s=512"
    "-prec=bf16 -b=2 -h=4 -s=333 -s_k=517"
    "-prec=bf16 -b=1 -h=4 -s=700 -s_k=650"
    "-prec=bf16 -b=1 -h=2 -s=97 -s_k=95"
    "-prec=bf16 -b=2 -h=8 -h_k=2 -s=257"
    "-prec=bf16 -b=1 -h=8 -h_k=1 -s=300 -s_k=450"
    "-prec=bf16 -mode=1 -b=3 -h=4 -h_k=2 -s=257,0,129 -s_k=311,64,0"
    "-prec=bf16 -b=1 -h=4 -h_k=2 -s=640 -s_k=700 -deterministic=1"
    "-prec=fp16 -b=1 -h=4 -h_k=2 -s=300 -s_k=500"
    "-prec=fp16 -mode=1 -b=2 -h=2 -s=200,333 -s_k=777,45"
)
i=0
for c in "${cases[@]}"; do
    i=$((i + 1))
    # shellcheck disable=SC2086
    (cd "$cand" && timeout "$(cap 60)" ./benchmark_mha_bwd -d=192 -d_v=128 $c -v=1 -kname=1 -warmup=0 -repeat=1 \
        >"$OUT/case_$i.out" 2>&1; echo "rc=$?" >>"$OUT/case_$i.out") &
done
wait
ok=0; bad=0; i=0
for c in "${cases[@]}"; do
    i=$((i + 1))
    out=$(cat "$OUT/case_$i.out" 2>/dev/null)
    if echo "$out" | grep -q "valid:y" && ! echo "$out" | grep -q "valid:n" &&
        echo "$out" | grep -Eq "bwd_d192x128_(bf16|fp16)_(batch|group)_nmask_sm90a_hopper_b64x96"; then
        ok=$((ok + 1))
    else
        bad=$((bad + 1)); note "case $i FAILED ($c): $(echo "$out" | grep -o 'bwd_d192x128_[a-z0-9_]*' | head -1) $(echo "$out" | tail -2 | tr '\n' ' ' | cut -c1-200)"
    fi
done
note "correct: $ok valid, $bad failed of ${#cases[@]}"
for n in 1 2; do
    args=("-b=1 -h=4 -h_k=2 -s=333 -s_k=517" "-mode=1 -b=3 -h=2 -s=257,0,129 -s_k=311,64,0")
    # shellcheck disable=SC2086
    (cd "$cand" && timeout "$(cap 60)" compute-sanitizer --tool memcheck --error-exitcode 99 ./benchmark_mha_bwd \
        -prec=bf16 -d=192 -d_v=128 ${args[$((n - 1))]} -v=1 -kname=1 -warmup=0 -repeat=1 >"$OUT/memcheck_$n.log" 2>&1
     echo "memcheck $n: rc=$? $(grep -o 'ERROR SUMMARY: [0-9]* errors*' "$OUT/memcheck_$n.log") $(grep -o 'valid:[yn]' "$OUT/memcheck_$n.log" | tail -1)" \
        >"$OUT/memcheck_$n.status") &
done
wait
for n in 1 2; do note "$(cat "$OUT/memcheck_$n.status" 2>/dev/null || echo "memcheck $n: no status")"; done

bench() {  # label, lib, peers
    [ -f "$2" ] || { note "bench $1: no library"; return; }
    timeout "$(cap 60)" python3 bench/bench_bwd.py --lib "$2" --fwd-lib "$cand/libmha_fwd.so" --dtype bf16 --hidden 3072 \
        --shape 192x128,1024,0 --shape 192x128,4096,0 --shape 192x128,16384,0 --peers "$3" --json "$OUT/bench_$1.json" \
        >"$OUT/bench_$1.md" 2>&1
    note "bench $1: rc=$?"
}
[ -n "$base" ] && bench base_1 "$base/libmha_bwd.so" cudnn
bench cand_1 "$cand/libmha_bwd.so" cudnn
[ -n "$base" ] && bench base_2 "$base/libmha_bwd.so" ""
bench cand_2 "$cand/libmha_bwd.so" ""
timeout 30 python3 - "$OUT" <<'PY' >"$OUT/table.md" 2>&1
import json, os, sys
out = sys.argv[1]
runs = {}
for label in ("base_1", "cand_1", "base_2", "cand_2"):
    path = os.path.join(out, f"bench_{label}.json")
    if os.path.exists(path):
        runs[label] = {r["seqlen"]: r for r in json.load(open(path))["rows"]}
def get(label, s, field="mhakit_tflops"):
    return runs.get(label, {}).get(s, {}).get(field)
def mean(vals):
    vals = [v for v in vals if v]
    return sum(vals) / len(vals) if vals else None
f = lambda v: "-" if v is None else f"{v:.1f}"
print("| s (non-causal) | base b64x128 (rep 1 / 2) | cand b64x96 (rep 1 / 2) | cuDNN | cand / base | cand / cuDNN |")
print("|---|---|---|---|---|---|")
for s in sorted({s for r in runs.values() for s in r}):
    b, c = mean([get("base_1", s), get("base_2", s)]), mean([get("cand_1", s), get("cand_2", s)])
    cud = mean([get("base_1", s, "cudnn_tflops"), get("cand_1", s, "cudnn_tflops")])
    print(f"| {s} | {f(get('base_1', s))} / {f(get('base_2', s))} | {f(get('cand_1', s))} / {f(get('cand_2', s))} | "
          f"{f(cud)} | {f'{c / b:.3f}x' if b and c else '-'} | {f'{c / cud:.3f}x' if c and cud else '-'} |")
PY
{
    echo "== summary (verify_bwd96n, $(date -u +%FT%TZ), $(( $(date +%s) - start )) s)"
    printf '%s\n' "${summary[@]}"
    echo
    cat "$OUT/table.md"
} | tee "$OUT/summary.txt"
