#!/usr/bin/env bash
# Branch lpt (issue 9: longest-processing-time-first block order for the one-tile grids of causal calls): the
# Hopper backward's masked instances and the forward's one-tile masked instances (d256, group mode, modifiers) run a
# 1-D grid whose (head, batch) pairs interleave their blocks in balance groups. Run on the H200 from the repository
# root of an export of the branch:
#
#   OUT=<log dir> BASE=<export of main at the branch's start> bash tools/verify_lpt.sh
#
# 1. build (about 200 s on 16 cores): in both trees, the bf16 Hopper forward mask instances (batch d64 / d128 / d256,
#    d192x128, d256 group, d128 batch _mods) with benchmark_mha_fwd, then the backward mask instances (batch d64 /
#    d128 / d256 / d192x128, d128 group) with benchmark_mha_bwd.
# 2. correctness on the branch: host-validated runs (-v=1 -kname=1; valid:y on a _hopper_ instance) of causal /
#    window / bottom-right / group-mode / GQA / many-pair calls (several balance groups, the last one absorbing the
#    remainder); compute-sanitizer memcheck on a backward and a forward case.
# 3. A/B timing, base and branch interleaved: bench_bwd.py causal rows (d64 / d128 / d256 / 192x128 at 1k / 4k, d128
#    16k), GQA 64/8 and 32/8 causal rows (2k / 4k / 8k), bench_fwd.py d256 causal rows; cuDNN beside each run.
# Every step's timeout is capped so that the script ends within LPT_BUDGET (560) s. Logs under $OUT.
set -u
cd "$(dirname "$0")/.."
repo=$(pwd)
OUT=${OUT:-$repo/verify_lpt_logs}
BASE=${BASE:-}
mkdir -p "$OUT"
summary=()
note() { summary+=("$1"); echo "== $1"; }
start=$(date +%s)
BUDGET=${LPT_BUDGET:-560}
cap() {
    local left=$(( BUDGET - ($(date +%s) - start) ))
    if [ "$left" -lt 10 ]; then echo 1; elif [ "$1" -lt "$left" ]; then echo "$1"; else echo "$left"; fi
}
fwd_sel='fwd_d64_bf16_batch_mask_sm90a_hopper,fwd_d128_bf16_batch_mask_sm90a_hopper,fwd_d256_bf16_batch_mask_sm90a_hopper,fwd_d192x128_bf16_batch_mask_sm90a_hopper,fwd_d256_bf16_group_mask_sm90a_hopper,fwd_d128_bf16_batch_mask_mods_sm90a_hopper'
bwd_sel='bwd_d64_bf16_batch_mask_sm90a_hopper,bwd_d128_bf16_batch_mask_sm90a_hopper,bwd_d256_bf16_batch_mask_sm90a_hopper,bwd_d192x128_bf16_batch_mask_sm90a_hopper,bwd_d128_bf16_group_mask_sm90a_hopper'

# ---- 1. build: each tree fwd then bwd (benchmark_mha_bwd links libmha_fwd.so), the two trees side by side ----
build_tree() {  # label, tree
    local label=$1 tree=$2 t0
    t0=$(date +%s)
    mkdir -p "$tree/build/lpt"
    (cd "$tree/build/lpt" &&
        timeout "$(cap 300)" python3 "$tree/compile.py" --arch sm_90a --api fwd --profile all --filter "$fwd_sel" \
            --benchmark -j 8 --build-dir obj >"$OUT/build_${label}_fwd.log" 2>&1 &&
        timeout "$(cap 250)" python3 "$tree/compile.py" --arch sm_90a --api bwd --profile all --filter "$bwd_sel" \
            --benchmark -j 8 --build-dir obj >"$OUT/build_${label}_bwd.log" 2>&1)
    echo "build $label: rc=$? in $(( $(date +%s) - t0 )) s" >"$OUT/build_$label.status"
}
build_tree branch "$repo" &
if [ -n "$BASE" ] && [ -f "$BASE/compile.py" ]; then build_tree base "$BASE" & else note "no BASE: no A/B"; fi
wait
for l in branch base; do [ -f "$OUT/build_$l.status" ] && note "$(cat "$OUT/build_$l.status")"; done
br=$repo/build/lpt
bs=${BASE:+$BASE/build/lpt}

# ---- 2. correctness (branch) ----
ok=0; bad=0
run_case() {  # api, expected instance token, args...
    local api=$1 tok=$2
    shift 2
    local out
    out=$(cd "$br" && timeout "$(cap 60)" ./benchmark_mha_"$api" -prec=bf16 "$@" -v=1 -kname=1 -warmup=1 -repeat=2 2>&1)
    echo "## $api $*" >>"$OUT/correct.log"; echo "$out" >>"$OUT/correct.log"
    if echo "$out" | grep -q "valid:y" && ! echo "$out" | grep -q "valid:n" && echo "$out" | grep -q "$tok"; then
        ok=$((ok + 1))
    else
        bad=$((bad + 1)); note "FAILED $api $*: $(echo "$out" | tail -1 | cut -c1-200)"
    fi
}
: >"$OUT/correct.log"
run_case bwd _hopper_ -d=128 -b=2 -h=8 -h_k=2 -s=1000 -mask=t
run_case bwd _hopper_ -d=128 -b=2 -h=4 -s=333 -s_k=517 -mask=b
run_case bwd _hopper_ -d=128 -b=1 -h=4 -s=700 -mask=t:96,0
run_case bwd _hopper_ -d=64 -b=16 -h=10 -s=512 -mask=t
run_case bwd _hopper_ -d=64 -b=16 -h=12 -h_k=4 -s=257 -s_k=300 -mask=b
run_case bwd _hopper_ -d=256 -b=4 -h=6 -s=640 -mask=t
run_case bwd _hopper_ -d=192 -d_v=128 -b=8 -h=6 -h_k=2 -s=300 -mask=t
run_case bwd _hopper_ -d=128 -b=1 -h=4 -h_k=2 -s=640 -mask=t -deterministic=1
run_case bwd _hopper_ -d=128 -mode=1 -b=4 -h=4 -h_k=2 -s=257,0,129,700 -s_k=311,64,0,650 -mask=b
run_case bwd _hopper_ -d=128 -b=2 -h=4 -s=300 -mask=0
run_case fwd _hopper_ -d=256 -b=16 -h=10 -s=512 -mask=t -lse=1
run_case fwd _hopper_ -d=256 -b=2 -h=8 -h_k=2 -s=333 -s_k=517 -mask=b -lse=1
run_case fwd _hopper_ -d=256 -b=3 -h=4 -s=1000 -mask=t:128,30 -lse=1
run_case fwd _hopper_ -d=256 -mode=1 -b=4 -h=4 -h_k=2 -s=257,0,129,700 -s_k=311,64,0,650 -mask=b -lse=1
run_case fwd _mods_ -d=128 -b=6 -h=8 -s=700 -mask=t -logits_soft_cap=20 -lse=1
run_case fwd _hopper_ -d=256 -b=2 -h=4 -s=300 -mask=0 -lse=1
note "correctness: $ok valid, $bad failed"
memcheck() {  # n, api, args
    local n=$1 api=$2
    shift 2
    (cd "$br" && timeout "$(cap 120)" compute-sanitizer --tool memcheck --error-exitcode 99 ./benchmark_mha_"$api" -prec=bf16 \
        "$@" -v=1 -kname=1 -warmup=0 -repeat=1) >"$OUT/memcheck_$n.log" 2>&1
    note "memcheck $n ($api $*): rc=$? $(grep -o 'ERROR SUMMARY: [0-9]* errors*' "$OUT/memcheck_$n.log") $(grep -o 'valid:[yn]' "$OUT/memcheck_$n.log" | tail -1)"
}
memcheck 1 bwd -d=128 -b=4 -h=8 -h_k=2 -s=333 -s_k=517 -mask=t
memcheck 2 fwd -d=256 -mode=1 -b=3 -h=4 -s=257,0,129 -s_k=311,64,0 -mask=b
note "correctness done at $(( $(date +%s) - start )) s"

# ---- 3. A/B timing, interleaved ----
bench() {  # label, dir, rep
    local label=$1 dir=$2 rep=$3
    [ -f "$dir/libmha_bwd.so" ] || { note "bench $label: no library"; return; }
    timeout "$(cap 150)" python3 bench/bench_bwd.py --lib "$dir/libmha_bwd.so" --fwd-lib "$dir/libmha_fwd.so" \
        --dtype bf16 --peers cudnn --shape 64,1024,1 --shape 64,4096,1 --shape 128,1024,1 --shape 128,4096,1 \
        --shape 128,16384,1 --shape 256,1024,1 --shape 256,4096,1 --json "$OUT/bwd_${label}_$rep.json" \
        >"$OUT/bwd_${label}_$rep.md" 2>&1
    timeout "$(cap 150)" python3 bench/bench_bwd.py --lib "$dir/libmha_bwd.so" --fwd-lib "$dir/libmha_fwd.so" \
        --dtype bf16 --peers cudnn --hdims 192x128 --hidden 3072 --shape 192x128,1024,1 --shape 192x128,4096,1 \
        --json "$OUT/bwd192_${label}_$rep.json" >"$OUT/bwd192_${label}_$rep.md" 2>&1
    for hid in 8192 4096; do
        timeout "$(cap 150)" python3 bench/bench_bwd.py --lib "$dir/libmha_bwd.so" --fwd-lib "$dir/libmha_fwd.so" \
            --dtype bf16 --peers cudnn --hidden $hid --kv-heads 8 --shape 128,2048,1 --shape 128,4096,1 \
            --shape 128,8192,1 --json "$OUT/gqa${hid}_${label}_$rep.json" >"$OUT/gqa${hid}_${label}_$rep.md" 2>&1
    done
    timeout "$(cap 100)" python3 bench/bench_fwd.py --lib "$dir/libmha_fwd.so" --dtype bf16 --peers cudnn \
        --shape 256,1024,1 --shape 256,4096,1 --shape 256,16384,1 --json "$OUT/fwd_${label}_$rep.json" \
        >"$OUT/fwd_${label}_$rep.md" 2>&1
    note "bench $label rep $rep done at $(( $(date +%s) - start )) s"
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv >"$OUT/gpu.txt" 2>&1
for rep in 1 2; do
    [ -n "$bs" ] && bench base "$bs" $rep
    bench branch "$br" $rep
done
timeout 30 python3 - "$OUT" <<'PY' >"$OUT/table.md" 2>&1
import glob, json, os, sys, statistics
out = sys.argv[1]
rows = {}
for path in glob.glob(os.path.join(out, "*_*_*.json")):
    kind, label, rep = os.path.basename(path)[:-5].rsplit("_", 2)
    for r in json.load(open(path))["rows"]:
        key = (kind, r.get("hdim"), r.get("seqlen"), r.get("heads") or r.get("hq"), bool(r.get("causal")))
        d = rows.setdefault(key, {})
        d.setdefault(label, []).append(r.get("mhakit_tflops"))
        if r.get("cudnn_tflops"):
            d.setdefault("cudnn", []).append(r["cudnn_tflops"])
        if r.get("verified") is False:
            d["fail"] = True
med = lambda v: statistics.median([x for x in v if x]) if v and any(v) else None
print("| bench | hdim | seqlen | heads | causal | base | branch | cuDNN | branch / base | branch / cuDNN | base / cuDNN |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for key in sorted(rows, key=str):
    d = rows[key]
    b, n, c = med(d.get("base", [])), med(d.get("branch", [])), med(d.get("cudnn", []))
    f = lambda x: "-" if x is None else f"{x:.1f}"
    r = lambda x, y: "-" if not x or not y else f"{x / y:.3f}"
    print(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {key[4]} | {f(b)} | {f(n)} | {f(c)} | {r(n, b)} | {r(n, c)} | "
          f"{r(b, c)} |" + (" FAIL" if d.get("fail") else ""))
PY
{
    echo "== summary (verify_lpt, $(date -u +%FT%TZ), $(( $(date +%s) - start )) s)"
    printf '%s\n' "${summary[@]}"
    echo
    cat "$OUT/table.md"
} | tee "$OUT/summary.txt"
