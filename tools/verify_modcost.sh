#!/usr/bin/env bash
# Verifies branch modcost (cheaper score modifiers on the Hopper forward / backward `_mods` instances) in two parts:
#
#   bash tools/verify_modcost.sh build    # on any machine with nvcc 13.0 (no GPU): the libraries and benchmarks
#   bash tools/verify_modcost.sh run      # on the H100 / H200, from what `build` made: no compiling, ~2-3 minutes
#
# MODCOST_DIR (default build/modcost in this checkout, git-ignored: carry that path to the GPU machine) receives the
# libraries and benchmarks, MODCOST_OBJ (default /tmp/modcost_verify_obj) the objects, which `run` does not need;
# logs of `run` go to $OUT (default ./verify_modcost), a summary at the end.
#
# build (-j $JOBS, default 2): libmha_fwd.so + benchmark_mha_fwd, then libmha_bwd.so + benchmark_mha_bwd (which links
#   the forward library), with the d128 bf16 batch-mode instances only: plain, masked and their `_mods`, Hopper and
#   the generic fallbacks (16 instances; 232 s + 304 s at -j 1 on the 2-core machine, 17 MB in build/modcost).
#   Every case line of `run` was checked to parse (the benchmarks stop at "no CUDA device" without a GPU).
# run:
#   1. check: the modifier cases of the forward smoke grid (section `mods`) at hdim 128, bf16, batch mode, validated
#      against the host reference (-v=1), plus the backward's at the same shapes (soft-cap, ALiBi, bias + dbias,
#      sink + d sink, combined), each call's instance named (-kname=1);
#   2. memcheck: compute-sanitizer on a soft-cap + ALiBi + sink causal forward and backward, and a bias + sink
#      forward;
#   3. cost: bench/gpu_check.sh's modifier cost loop (hd128, s=4k, bf16, b=1, h=16; plain, soft-cap 30, ALiBi [h],
#      bias [1, 1, s, s], sink; no mask and causal; forward and backward), each modifier's time against the plain
#      call (issue 12's bar: <= 10 %).
set -uo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="${MODCOST_DIR:-$repo/build/modcost}"
python="${PYTHON:-python3}"
FILTER="fwd_d128_bf16_batch_*_sm90a_*,bwd_d128_bf16_batch_*_sm90a_*"

case "${1:-}" in
build)
    mkdir -p "$dir"
    cd "$dir" || exit 2
    for api in fwd bwd; do  # fwd first: benchmark_mha_bwd links libmha_fwd.so
        "$python" "$repo/compile.py" --api $api --arch sm_90a --profile all --filter "$FILTER" --benchmark \
            -j "${JOBS:-2}" --build-dir "${MODCOST_OBJ:-/tmp/modcost_verify_obj}" || exit 1
    done
    ls -l "$dir"/libmha_fwd.so "$dir"/libmha_bwd.so "$dir"/benchmark_mha_fwd "$dir"/benchmark_mha_bwd || exit 1
    echo "built into $dir (run: MODCOST_DIR=$dir bash tools/verify_modcost.sh run)"
    exit 0
    ;;
run) ;;
*)
    echo "usage: $0 build|run" >&2
    exit 2
    ;;
esac

OUT="${OUT:-$PWD/verify_modcost}"
mkdir -p "$OUT"
FWD="$dir/benchmark_mha_fwd"
BWD="$dir/benchmark_mha_bwd"
[ -x "$FWD" ] && [ -x "$BWD" ] || { echo "no benchmarks in $dir: run '$0 build' first" >&2; exit 2; }
export LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
failed=()
step() {  # step NAME COMMAND...: output in $OUT/NAME.log (and on the terminal), a failure recorded
    local name="$1"
    shift
    echo "=== [$name]"
    local t0=$SECONDS
    if "$@" 2>&1 | tee "$OUT/$name.log"; then
        echo "=== [$name] ok ($((SECONDS - t0)) s)"
    else
        echo "=== [$name] FAILED ($((SECONDS - t0)) s)"
        failed+=("$name")
    fi
}

check() {
    local bad=0 n=0 line
    local b=(-prec=bf16 -d=128 -v=1 -kname=1 -warmup=0 -repeat=1)
    while read -r api args; do
        [ -z "$api" ] && continue
        n=$((n + 1))
        local bench="$FWD -lse=1"  # (the backward has no -lse)
        [ "$api" = bwd ] && bench=$BWD
        # shellcheck disable=SC2086
        if line="$($bench "${b[@]}" $args 2>&1)" && grep -q "valid:y" <<<"$line" && ! grep -q "valid:n" <<<"$line"; then
            echo "ok   $api $args: $(grep -o "mha_$api -> [^ ,]*" <<<"$line" | head -1)"
        else
            bad=$((bad + 1))
            echo "FAIL $api $args"
            echo "$line" | tail -8
        fi
    done <<'CASES'
fwd -b=2 -h=2 -h_k=1 -s=100 -s_k=77 -bias=e
fwd -b=2 -h=3 -s=200 -s_k=520 -mask=t:128,30 -bias=e:1
fwd -b=1 -h=2 -h_k=1 -s=257 -s_k=130 -mask=b -bias=e:2
fwd -b=2 -h=2 -h_k=1 -s=100 -s_k=77 -bias=a
fwd -b=2 -h=3 -s=200 -s_k=520 -mask=t:128,30 -bias=a:1
fwd -b=1 -h=2 -h_k=1 -s=257 -s_k=130 -mask=b -bias=a
fwd -b=1 -h=2 -s=1000 -s_k=1300 -bias=a:1
fwd -b=2 -h=2 -h_k=1 -s=100 -s_k=77 -logits_soft_cap=30
fwd -b=1 -h=2 -s=300 -s_k=300 -mask=2 -logits_soft_cap=10 -bias=a
fwd -b=2 -h=4 -h_k=2 -s=129 -s_k=200 -sink=1
fwd -b=2 -h=4 -h_k=2 -s=129 -s_k=200 -mask=b -sink=1
fwd -b=1 -h=2 -s=64 -s_k=80 -mask=t:16,8 -sink=1 -logits_soft_cap=20 -bias=e:1
fwd -b=1 -h=2 -h_k=1 -s=33 -s_k=0 -mask=2 -sink=1
fwd -b=1 -h=4 -s=1024 -s_k=1024 -logits_soft_cap=50 -sink=1
bwd -b=1 -h=4 -h_k=2 -s=259 -logits_soft_cap=30
bwd -b=2 -h=2 -s=216 -s_k=153 -mask=2 -logits_soft_cap=10 -bias=a
bwd -b=1 -h=2 -s=130 -s_k=77 -mask=b:4,35 -sink=1 -logits_soft_cap=20 -bias=e:1 -dbias=1
bwd -b=2 -h=4 -h_k=2 -s=300 -s_k=333 -mask=b -bias=a:1
bwd -b=2 -h=2 -s=200 -s_k=257 -bias=e -dbias=1
bwd -b=2 -h=4 -h_k=2 -s=129 -s_k=200 -sink=1
bwd -b=1 -h=4 -s=1024 -s_k=1024 -mask=b -logits_soft_cap=50
CASES
    echo "check: $((n - bad)) of $n passed"
    [ "$bad" -eq 0 ]
}
step check check

memcheck() {
    local cs=compute-sanitizer
    command -v "$cs" >/dev/null 2>&1 || cs="${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer"
    local c=(--tool memcheck --error-exitcode 9)
    local b=(-prec=bf16 -d=128 -v=1 -kname=1 -warmup=0 -repeat=1)
    "$cs" "${c[@]}" "$FWD" "${b[@]}" -b=2 -h=4 -h_k=2 -s=300 -s_k=333 -mask=b -logits_soft_cap=20 -bias=a -sink=1 \
        -lse=1 &&
        "$cs" "${c[@]}" "$FWD" "${b[@]}" -b=2 -h=2 -s=200 -s_k=77 -bias=e:1 -sink=1 -lse=1 &&
        "$cs" "${c[@]}" "$BWD" "${b[@]}" -b=2 -h=4 -h_k=2 -s=300 -s_k=333 -mask=b -logits_soft_cap=20 -bias=a -sink=1
}
step memcheck memcheck

cost() {
    local api mask mod line ms plain name
    for api in fwd bwd; do
        local bench=$FWD
        [ "$api" = bwd ] && bench=$BWD
        for mask in 0 b; do
            for mod in "" -logits_soft_cap=30 -bias=a -bias=e -sink=1; do
                # shellcheck disable=SC2086
                line="$("$bench" -prec=bf16 -b=1 -h=16 -s=4096 -d=128 -v=0 -warmup=10 -repeat=30 -kname=1 \
                    -mask=$mask $mod 2>&1)" || { echo "$line"; return 1; }
                ms="$(grep -o '[0-9.]* ms' <<<"$line" | tail -1 | tr -dc '0-9.')"
                name="$(grep -o "mha_$api -> [^ ,]*" <<<"$line" | head -1)"
                if [ -z "$mod" ]; then
                    plain=$ms
                    echo "$api mask=$mask plain: $ms ms ($name)"
                else
                    echo "$api mask=$mask ${mod#-}: $ms ms ($name), cost vs plain: $(awk -v a="$ms" -v b="$plain" \
                        'BEGIN { printf "%+.1f %%", (a / b - 1) * 100 }')"
                fi
            done
        done
    done
}
step cost cost

echo "=== summary: logs in $OUT"
tail -1 "$OUT/check.log"
cat "$OUT/cost.log"
if [ ${#failed[@]} -gt 0 ]; then
    echo "FAILED steps: ${failed[*]}"
    exit 1
fi
echo "all steps ok"
