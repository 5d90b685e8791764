#!/usr/bin/env bash
# Branch p192b (issue 13's 192 s = 1024 causal row): the persistent 192 tile with O staged in padded rows of its own,
# 128 columns at a time (two passes), verified on the H200 from the repository root of an export of this branch:
#
#   OUT=/some/logs BASE=/path/to/an/export/of/main@<this branch's start> bash tools/verify_p192b.sh
#
# 1. build at once (-j 8 per tree): this tree's and $BASE's bf16 batch-mode Hopper forward instances of 192 and
#    (192, 128), masked and unmasked (profile all), with benchmark_mha_fwd; the branch also the fp8 d128 masked
#    instance (its O staging goes through the same, generalised store_o_rows). ~110 s.
# 2. correctness (branch): benchmark_mha_fwd -v=1 -kname=1 on the persistent 192 / (192, 128) instances (tiles >
#    SMs and < SMs, odd lengths, s_q != s_k, GQA / MQA, every mask kind, LSE, head-major layout, head dims 184 / 136
#    with hdim_v < 192 so the second column pass is partial or empty) and fp8; each line valid:y on the expected
#    instance. compute-sanitizer memcheck on two 192 cases. ~40 s.
# 3. A/B: bench_fwd.py --hdims 192x128,192 --hidden 3072 (s = 1k / 4k / 16k, none / causal, bf16, cuDNN in the same
#    process) on base and branch, interleaved, twice. ~50 s.
# Logs under $OUT; $OUT/summary.txt has the key lines and the table.
set -u
cd "$(dirname "$0")/.."
BR=$(pwd)
OUT=${OUT:-$BR/verify_p192b_logs}
BASE=${BASE:-}
mkdir -p "$OUT"
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"
note() { echo "$1" | tee -a "$SUMMARY"; }
T0=$(date +%s)
since() { echo "$(( $(date +%s) - T0 )) s"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv >"$OUT/gpu.txt" 2>&1
note "== verify_p192b: branch vs base ${BASE:-none}; $(head -2 "$OUT/gpu.txt" | tail -1)"

FILTER='fwd_d192x128_bf16_batch_mask_sm90a_hopper,fwd_d192x128_bf16_batch_nmask_sm90a_hopper'
FILTER+=',fwd_d192_bf16_batch_mask_sm90a_hopper,fwd_d192_bf16_batch_nmask_sm90a_hopper'
build() {  # tree tag profile filter
    local tree=$1 tag=$2
    mkdir -p "$tree/build/p192b/$tag"
    (cd "$tree/build/p192b/$tag" && timeout 420 python3 "$tree/compile.py" --api fwd --arch sm_90a --profile "$3" \
        --filter "$4" --benchmark -j 8 --build-dir "$tree/build/p192b/obj_$tag") >"$OUT/build_$tag.log" 2>&1
    echo "rc=$?" >>"$OUT/build_$tag.log"
}
trees=(branch)
if [ -n "$BASE" ] && [ -f "$BASE/compile.py" ]; then trees+=(base); else note "no BASE: no A/B"; fi
dir_of() { case $1 in base) echo "$BASE/build/p192b/base" ;; *) echo "$BR/build/p192b/$1" ;; esac; }
build "$BR" branch all "$FILTER,fwd_d128_fp8bf16_batch_mask_sm90a_hopper" &
[ "${#trees[@]}" -gt 1 ] && build "$BASE" base all "$FILTER" &
wait
for t in "${trees[@]}"; do note "build $t: $(tail -1 "$OUT/build_$t.log"); $(grep -m1 '^\[mhakit\] fwd:' "$OUT/build_$t.log" | cut -c1-120)"; done
note "built at $(since)"

# ---- 2. correctness ----------------------------------------------------------------------------------------------
# "tree|expected instance suffix|arguments"
CASES=(
    "branch|d192_bf16_batch_mask_sm90a_hopper_b128x96|-b=2 -h=16 -h_k=4 -s=1000 -d=192 -mask=t"
    "branch|d192_bf16_batch_mask_sm90a_hopper_b128x96|-b=3 -h=8 -s=517 -s_k=900 -d=192 -mask=b -iperm=0 -operm=0"
    "branch|d192_bf16_batch_mask_sm90a_hopper_b128x96|-b=1 -h=4 -h_k=1 -s=1333 -s_k=700 -d=192 -mask=t:128,30"
    "branch|d192_bf16_batch_mask_sm90a_hopper_b128x96|-b=2 -h=2 -s=1 -s_k=257 -d=192 -mask=b"
    "branch|d192_bf16_batch_mask_sm90a_hopper_b128x96|-b=2 -h=6 -h_k=2 -s=700 -s_k=513 -d=184 -mask=b:64,0"
    "branch|d192_bf16_batch_nmask_sm90a_hopper_b128x96|-b=4 -h=16 -s=1024 -d=192"
    "branch|d192_bf16_batch_nmask_sm90a_hopper_b128x96|-b=1 -h=6 -h_k=2 -s=77 -s_k=3000 -d=192"
    "branch|d192_bf16_batch_nmask_sm90a_hopper_b128x96|-b=1 -h=3 -h_k=1 -s=129 -s_k=1000 -d=184 -iperm=0 -operm=0"
    "branch|d192_bf16_batch_nmask_sm90a_hopper_b128x96|-b=2 -h=4 -s=640 -d=136"
    "branch|d192x128_bf16_batch_mask_sm90a_hopper_b128x96|-b=2 -h=16 -h_k=4 -s=1000 -d=192 -d_v=128 -mask=t"
    "branch|d192x128_bf16_batch_nmask_sm90a_hopper_b128x96|-b=1 -h=6 -h_k=2 -s=77 -s_k=3000 -d=192 -d_v=128"
    "branch|d192x128_bf16_batch_mask_sm90a_hopper_b128x96|-b=2 -h=4 -s=900 -d=192 -d_v=72 -mask=b"
    "branch|d128_fp8bf16_batch_mask_sm90a_hopper|-prec=fp8 -qscale=pt -b=2 -h=4 -h_k=2 -s=333 -s_k=517 -d=128 -mask=b"
)
: >"$OUT/correct.log"
for c in "${CASES[@]}"; do
    IFS='|' read -r t want args <<<"$c"
    # shellcheck disable=SC2086
    line=$(timeout 120 "$(dir_of "$t")/benchmark_mha_fwd" -prec=bf16 -lse=1 -v=1 -kname=1 -warmup=0 -repeat=1 $args 2>&1 | tr '\n' ' ')
    kern=$(echo "$line" | grep -o 'fwd_d[0-9x]*_[a-z0-9_]*' | head -1)
    if ! echo "$line" | grep -q 'valid:y'; then echo "INVALID ${kern:-?} $t $args :: ${line:0:300}"
    elif [[ "$kern" != *"$want"* ]]; then echo "WRONGKERNEL ${kern:-?} (want $want) $t $args"
    else echo "VALID ${kern} $t $args"; fi >>"$OUT/correct.log"
done
note "correctness: $(grep -c '^VALID' "$OUT/correct.log") valid of ${#CASES[@]}"
grep -v '^VALID' "$OUT/correct.log" | tee -a "$SUMMARY"
memcheck() {  # tag args
    # shellcheck disable=SC2086
    timeout 150 compute-sanitizer --tool memcheck --error-exitcode 99 "$(dir_of branch)/benchmark_mha_fwd" -prec=bf16 \
        -lse=1 -v=1 -kname=1 -warmup=0 -repeat=1 $2 >"$OUT/memcheck_$1.log" 2>&1
    echo "rc=$?" >>"$OUT/memcheck_$1.log"
}
memcheck d192t "-b=2 -h=16 -h_k=4 -s=1000 -d=192 -mask=t" &
memcheck d184b "-b=2 -h=8 -s=700 -s_k=513 -d=184 -mask=b" &
wait
for m in d192t d184b; do
    note "memcheck $m: $(grep -o 'ERROR SUMMARY: [0-9]* errors*' "$OUT/memcheck_$m.log" | head -1) $(tail -1 "$OUT/memcheck_$m.log"), $(grep -o 'valid:[yn]' "$OUT/memcheck_$m.log" | head -1), $(grep -o 'fwd_d[0-9x]*_[a-z0-9_]*' "$OUT/memcheck_$m.log" | head -1)"
done
note "correctness done at $(since)"

# ---- 3. A/B ------------------------------------------------------------------------------------------------------
bench() {  # tree tag args...
    local t=$1 tag=$2
    shift 2
    timeout 150 python3 "$BR/bench/bench_fwd.py" --lib "$(dir_of "$t")/libmha_fwd.so" --dtype bf16 --peers cudnn \
        --json "$OUT/bench_$tag.json" "$@" >"$OUT/bench_$tag.md" 2>"$OUT/bench_$tag.err"
    note "bench $tag: rc=$? at $(since)"
}
for rep in 1 2; do
    for t in "${trees[@]}"; do bench "$t" "mla_${t}_$rep" --hdims 192x128,192 --hidden 3072; done
done
timeout 60 python3 - "$OUT" <<'PY' | tee -a "$SUMMARY"
import glob, json, os, statistics, sys
out = sys.argv[1]
def rows(pattern):
    got = {}
    for path in sorted(glob.glob(os.path.join(out, pattern))):
        try:
            data = json.load(open(path))
        except Exception:
            continue
        for r in data["rows"]:
            key = (str(r.get("hdim", r.get("hdims"))), r["seqlen"], bool(r["causal"]))
            got.setdefault(key, []).append(r)
    return got
def med(rs, key):
    vals = [r[key] for r in rs if r.get(key)]
    return statistics.median(vals) if vals else None
fmt = lambda v: "-" if v is None else f"{v:.1f}"
for title, a_pat, b_pat, an, bn in (("192 / (192, 128)", "bench_mla_base_*.json", "bench_mla_branch_*.json", "base", "branch"),):
    a, b = rows(a_pat), rows(b_pat)
    print(f"\n{title}\n\n| hdim | seqlen | causal | {an} TFLOPS | {bn} TFLOPS | ratio | cuDNN | {bn}/cuDNN | {an}/cuDNN | kernels | checked |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for key in sorted(set(a) | set(b)):
        ra, rb = a.get(key, []), b.get(key, [])
        ta, tb = med(ra, "mhakit_tflops"), med(rb, "mhakit_tflops")
        cu = med(ra + rb, "cudnn_tflops")
        kern = lambda rs: ",".join(sorted({(r.get("kernel") or "?").rsplit("_", 1)[-1] for r in rs})) or "-"
        ok = all(r.get("verified", True) for r in ra + rb)
        print(f"| {key[0]} | {key[1]} | {'yes' if key[2] else 'no'} | {fmt(ta)} | {fmt(tb)} | "
              f"{f'{tb / ta:.3f}' if ta and tb else '-'} | {fmt(cu)} | {f'{tb / cu:.2f}x' if tb and cu else '-'} | "
              f"{f'{ta / cu:.2f}x' if ta and cu else '-'} | {kern(ra)} / {kern(rb)} | {'y' if ok else 'n'} |")
PY
note "done at $(since)"
