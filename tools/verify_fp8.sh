#!/usr/bin/env bash
# Verification of the fp8 forward (branch fp8, issue 12 item 5) on an H100/H200, in one go (about 6 minutes on 16
# cores; nothing of it has run before: the branch was written without a GPU):
#   1. build the fp8 instances (default profile: fp8bf16, head dims 128 / 256, masked and not) with the bf16 batch
#      instances of the same head dims (the peers of the timing rows) into libmha_fwd.so + benchmark_mha_fwd, and
#      fill the JIT cache with every fp8 instance (fp8bf16 and fp8fp16) for the Python tests;
#   2. the GPU tests: tests/test_python_gpu_fp8.py (hd 128 / 256, odd lengths, zero keys, every mask kind, GQA / MQA,
#      descales, fp16 output, torch float8 tensors) against the NumPy fp32 reference, and the CPU model of the
#      register / shared-memory contract (tests/test_fp8_layout.py);
#   3. the forward smoke grid's fp8 section (32 runs, validated against the host reference, kernel names printed);
#   4. compute-sanitizer memcheck on fp8 calls at hd128 and hd256 (odd lengths, masks, GQA, no keys);
#   5. timing: bench/bench_fwd.py rows hd128 / hd256, s = 16k (16384 tokens, hidden 2048), causal and not, fp8 beside
#      bf16, with cuDNN (bf16, same process) and mhakit bf16; TFLOPS (FlashAttention's FLOP count) and the max error
#      against fp32; then benchmark_mha_fwd's aiter lines for the same fp8 shapes (-qscale=pt, validated on s=4k).
# Logs under $OUT (else ./verify_fp8_logs); the summary comes last.
#
#   bash tools/verify_fp8.sh [build] [tests] [smoke] [sanitizer] [bench]     (default: all five)
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
logs=${OUT:-$repo/verify_fp8_logs}
mkdir -p "$logs"
work=${MHAKIT_GPU_WORK:-/tmp/mhakit_fp8}
mkdir -p "$work/lib"
export MHAKIT_CACHE_DIR="$work/jit_cache" MHAKIT_TEST_CACHE_DIR="$work/jit_cache"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's mhakit, not an installed one
jobs=$(nproc)
steps=${*:-build tests smoke sanitizer bench}
want() { [[ " $steps " == *" $1 "* ]]; }
summary=()
note() { summary+=("$1"); echo "== $1"; }
elapsed() { echo "$(( $(date +%s) - $1 )) s"; }

nvidia-smi --query-gpu=name,compute_cap,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$logs/gpu.txt"

if want build; then
    start=$(date +%s)
    (cd "$work/lib" && python3 "$repo/compile.py" --api fwd --profile default \
        --filter 'fp8,fwd_d128_bf16_batch_*mask_sm90a_hopper,fwd_d256_bf16_batch_*mask_sm90a_hopper' --benchmark \
        -j "$jobs" --build-dir "$work/objects") >"$logs/build.log" 2>&1
    rc=$?
    note "build fp8bf16 d128/d256 + bf16 hopper d128/d256 batch + benchmark_mha_fwd: rc=$rc in $(elapsed "$start")"
    tail -3 "$logs/build.log"
    start=$(date +%s)
    python3 -m mhakit prebuild --profile all --filter fp8 -j "$jobs" >"$logs/prebuild.log" 2>&1
    note "JIT prebuild of the fp8 entries (fp8bf16 + fp8fp16): rc=$? in $(elapsed "$start")"
    tail -3 "$logs/prebuild.log"
fi

if want tests; then
    start=$(date +%s)
    python3 -m pytest -q tests/test_python_gpu_fp8.py tests/test_fp8_layout.py 2>&1 \
        | tee "$logs/pytest_gpu.log" | tail -15
    note "pytest (fp8 GPU tests + layout model): $(tail -1 "$logs/pytest_gpu.log") in $(elapsed "$start")"
fi

if want smoke; then
    start=$(date +%s)
    (cd "$work/lib" && MHA_FP8=only bash "$repo/smoke_tests/smoke_test_fwd.sh" -k -j "$jobs") \
        >"$logs/smoke_fp8.log" 2>&1
    note "smoke_test_fwd fp8 section (validated, max_err printed per run): $(tail -1 "$logs/smoke_fp8.log") in $(elapsed "$start")"
    grep -o 'max_err:[0-9.e+-]*' "$logs/smoke_fp8.log" | sort -t: -k2 -g | tail -3
    grep -A3 '^FAILED' "$logs/smoke_fp8.log" | head -40
fi

if want sanitizer; then
    : >"$logs/sanitizer.log"
    bad=0; n=0
    while read -r args; do
        [ -z "$args" ] && continue
        n=$((n + 1))
        # shellcheck disable=SC2086
        out=$(cd "$work/lib" && compute-sanitizer --tool memcheck --error-exitcode 99 ./benchmark_mha_fwd $args \
            -v=1 -warmup=0 -repeat=1 -kname=1 2>&1)
        rc=$?
        printf '### %s (rc=%d)\n%s\n' "$args" "$rc" "$out" >>"$logs/sanitizer.log"
        [ "$rc" -ne 0 ] && bad=$((bad + 1)) && echo "sanitizer FAILED: $args"
    done <<'CASES'
-prec=fp8 -qscale=pt -b=2 -h=4 -h_k=2 -d=128 -s=333 -s_k=517 -lse=1
-prec=fp8 -qscale=pt -b=1 -h=2 -d=128 -s=257 -s_k=257 -mask=b -iperm=0 -operm=0 -lse=1
-prec=fp8 -qscale=pt -b=2 -h=4 -h_k=1 -d=256 -s=190 -s_k=300 -mask=t:64,16 -lse=1
-prec=fp8 -qscale=n -init=ufq -b=1 -h=2 -d=256 -s=129 -s_k=77 -lse=1
-prec=fp8 -qscale=pt -b=1 -h=2 -d=128 -s=40 -s_k=0 -lse=1
CASES
    note "compute-sanitizer memcheck: $((n - bad))/$n fp8 cases clean (kernels: $(grep -o 'fwd_d[0-9]*_fp8[a-z0-9_]*' "$logs/sanitizer.log" | sort | uniq -c | tr '\n' ' '))"
fi

if want bench; then
    start=$(date +%s)
    python3 bench/bench_fwd.py --lib "$work/lib/libmha_fwd.so" --dtype bf16,fp8 --peers cudnn \
        --shape 128,16384,0 --shape 128,16384,1 --shape 256,16384,0 --shape 256,16384,1 \
        --json "$logs/bench_fwd.json" >"$logs/bench_fwd.md" 2>"$logs/bench_fwd.err"
    rc=$?
    cat "$logs/bench_fwd.err" | grep '^#' || true
    sed -n '/^| dtype |/,$p' "$logs/bench_fwd.md"
    note "bench_fwd fp8 vs bf16 vs cuDNN bf16 (s=16k, hd 128/256, causal and not): rc=$rc in $(elapsed "$start"); table in bench_fwd.md"
    : >"$logs/benchmark_fp8.log"
    for d in 128 256; do
        for mask in 0 t; do
            (cd "$work/lib" && ./benchmark_mha_fwd -prec=fp8 -qscale=pt -b=1 -h=$((2048 / d)) -s=16384 -d=$d \
                -mask=$mask -iperm=1 -operm=1 -v=0 -kname=1) >>"$logs/benchmark_fp8.log" 2>&1
            (cd "$work/lib" && ./benchmark_mha_fwd -prec=fp8 -qscale=pt -b=4 -h=$((2048 / d)) -s=4096 -d=$d \
                -mask=$mask -v=1) >>"$logs/benchmark_fp8.log" 2>&1
        done
    done
    grep '^\[' "$logs/benchmark_fp8.log"
    note "benchmark_mha_fwd fp8 lines (s=16k timed, s=4k validated with max_err): $(grep -c 'valid:y' "$logs/benchmark_fp8.log") valid:y of 4; log benchmark_fp8.log"
fi

echo
echo "== summary"
printf '%s\n' "${summary[@]}"
