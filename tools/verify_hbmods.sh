#!/usr/bin/env bash
# Verifies branch hbmods (score modifiers on the Hopper backward, "_mods" instances) on an H100/H200 (sm_90a), in
# about six minutes on 16 cores. Run from the repository root:
#
#   bash tools/verify_hbmods.sh           # logs under $OUT (default ./verify_hbmods), a summary at the end
#
# Steps (each logged to $OUT/<step>.log; a failed step is reported and the next one still runs; exit 1 if any failed):
#   1. build: libmha_fwd.so, libmha_bwd.so + benchmark_mha_bwd (compile.py --profile all --filter, -j $JOBS) in
#      $OUT/build: the Hopper "_mods" backward instances of 64 / 128 / 256 / (192, 128) (fp16, bf16; masked, batch
#      and group), the generic 64 / 128 ones (odd head dims, dropout, a sink alone) and the plain Hopper
#      d128 bf16 batch ones (the timing's baseline); the forward: the same buckets' instances (the tests' and the
#      benchmark's O and LSE);
#   2. prebuild: the same selection into the Python JIT cache ($OUT/cache) for the GPU tests;
#   3. pytest: tests/test_python_gpu_hopper_bwd_mods.py (every modifier alone and combined with dbias / d sink, every
#      mask kind, GQA, group mode with empty sequences, rows without keys, head dims 64 / 128 / 256 / (192, 128),
#      fp16, deterministic mode bit for bit; each backward call's kernel name asserted);
#   4. smoke: the backward smoke grid's modifier cases (MHA_SMOKE_ONLY=mods,hmods: 64 / 128 on Hopper, 59 on
#      generic, then 256 and (192, 128)), -kname=1, -j $JOBS;
#   5. memcheck: compute-sanitizer on a soft-cap + ALiBi causal backward and an elementwise-bias + dbias (+ sink,
#      d sink) group-mode backward;
#   6. timing: hd128, s=4k, bf16, b=1, h=16, no mask and causal: the plain Hopper backward and each modifier on Hopper
#      (soft-cap 30, ALiBi [h], elementwise bias [1, 1, s, s] bf16 with and without dbias, sink with d sink), printing
#      each modifier's cost against the plain call (issue 12's bar: <= 10 %).
set -uo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$PWD/verify_hbmods}"
JOBS="${JOBS:-16}"
python="${PYTHON:-python3}"
mkdir -p "$OUT/build"
OUT="$(cd "$OUT" && pwd)"
cd "$repo" || exit 2
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's mhakit and codegen, not an installed one
failed=()

step() {  # step NAME COMMAND...: runs it with its output in $OUT/NAME.log (and on the terminal), records a failure
    local name="$1"
    shift
    echo "=== [$name] $*"
    local t0=$SECONDS
    if "$@" 2>&1 | tee "$OUT/$name.log"; then
        echo "=== [$name] ok ($((SECONDS - t0)) s)"
    else
        echo "=== [$name] FAILED ($((SECONDS - t0)) s)"
        failed+=("$name")
    fi
}

# The instances (compile.py / prebuild --filter globs, matched anywhere in the name).
MODS="_d64_*_mask_mods_sm90a_hopper_,_d128_*_mask_mods_sm90a_hopper_,_d256_*_mask_mods_sm90a_hopper_"
MODS+=",_d192x128_*_mask_mods_sm90a_hopper_"
BWD="${MODS//_d/bwd_d},bwd_d64_*_sm90a_generic_,bwd_d128_*_sm90a_generic_"
BWD+=",bwd_d128_bf16_batch_nmask_sm90a_hopper_,bwd_d128_bf16_batch_mask_sm90a_hopper_"
FWD="${MODS//_d/fwd_d},fwd_d64_*_sm90a_generic_,fwd_d128_*_sm90a_generic_"
FWD+=",fwd_d128_bf16_batch_nmask_sm90a_hopper_,fwd_d128_bf16_batch_mask_sm90a_hopper_"

build() {  # the forward library first: the backward benchmark links it (its O and LSE)
    cd "$OUT/build" &&
        "$python" "$repo/compile.py" --api fwd --arch sm_90a --profile all --filter "$FWD" -j "$JOBS" \
            --build-dir "$OUT/build/obj" &&
        "$python" "$repo/compile.py" --api bwd --arch sm_90a --profile all --filter "$BWD" --benchmark -j "$JOBS" \
            --build-dir "$OUT/build/obj"
}
step build build
BENCH="$OUT/build/benchmark_mha_bwd"

export MHAKIT_CACHE_DIR="$OUT/cache" MHAKIT_TEST_CACHE_DIR="$OUT/cache"
prebuild() {
    "$python" -m mhakit prebuild --api bwd --arch sm_90a --profile all --filter "$BWD" -j "$JOBS" &&
        "$python" -m mhakit prebuild --api fwd --arch sm_90a --profile all --filter "$FWD" -j "$JOBS"
}
step prebuild prebuild

step pytest "$python" -m pytest -q -p no:cacheprovider "$repo/tests/test_python_gpu_hopper_bwd_mods.py"

smoke() { cd "$OUT/build" && MHA_SMOKE_ONLY=mods,hmods BENCH="$BENCH" bash "$repo/smoke_tests/smoke_test_bwd.sh" -k -j "$JOBS"; }
step smoke smoke

memcheck() {
    local cs=compute-sanitizer
    command -v "$cs" >/dev/null 2>&1 || cs="${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer"
    "$cs" --tool memcheck --error-exitcode 9 "$BENCH" -prec=bf16 -b=2 -h=4 -h_k=2 -s=300 -s_k=333 -d=128 -mask=b \
        -logits_soft_cap=20 -bias=a -v=1 -kname=1 -warmup=0 -repeat=1 &&
    "$cs" --tool memcheck --error-exitcode 9 "$BENCH" -prec=bf16 -mode=1 -b=4 -h=4 -h_k=1 -s=100,0,257,31 \
        -s_k=64,19,300,0 -d=128 -mask=t -bias=e -dbias=1 -sink=1 -v=1 -kname=1 -warmup=0 -repeat=1
}
step memcheck memcheck

timing() {
    local base=(-prec=bf16 -b=1 -h=16 -s=4096 -d=128 -v=0 -warmup=10 -repeat=30 -kname=1)
    local mask mod plain ms line name
    for mask in 0 b; do
        plain=""
        for mod in "" "-logits_soft_cap=30" "-bias=a" "-bias=e" "-bias=e -dbias=1" "-sink=1"; do
            # shellcheck disable=SC2086
            line="$("$BENCH" "${base[@]}" -mask=$mask $mod 2>&1)" || { echo "$line"; return 1; }
            echo "$line"
            ms="$(grep -o ', [0-9.]* ms' <<<"$line" | tail -1 | tr -dc '0-9.')"
            name="$(grep -o 'mha_bwd -> [^ ]*' <<<"$line" | tail -1)"
            name="${name#mha_bwd -> }"
            if [ -z "$mod" ]; then
                plain="$ms"
                echo "  -> mask=$mask plain: $ms ms ($name)"
                [[ "$name" == *_sm90a_hopper_* && "$name" != *_mods_* ]] || { echo "not a plain Hopper instance"; return 1; }
            else
                [[ "$name" == *_mods_sm90a_hopper_* ]] || { echo "$mod did not run on a Hopper _mods instance"; return 1; }
                echo "  -> mask=$mask ${mod#-}: $ms ms, cost vs plain: $(awk -v a="$ms" -v b="$plain" \
                    'BEGIN { printf "%+.1f %%", (a / b - 1) * 100 }')"
            fi
        done
    done
}
step timing timing

echo "=== summary: logs in $OUT"
grep -h -- "-> mask=" "$OUT/timing.log" 2>/dev/null
grep -h -E "passed|failed" "$OUT/pytest.log" 2>/dev/null | tail -1
grep -h -E "passed, .* failed" "$OUT/smoke.log" 2>/dev/null | tail -1
if [ ${#failed[@]} -gt 0 ]; then
    echo "FAILED steps: ${failed[*]}"
    exit 1
fi
echo "all steps ok"
