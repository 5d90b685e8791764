#!/usr/bin/env bash
# Verification of the decode_tma family (branch dectma) on an H100/H200, in one go (about 6 minutes on 16 cores):
#   1. build the split-KV instances only (decode + decode_tma, default profile) into libmha_fwd.so with
#      benchmark_mha_fwd, and fill the JIT cache with the same instances for the Python tests and the benchmark;
#   2. the GPU tests of both decode families (tests/test_python_gpu_kvcache_tma.py asserts which family serves each
#      case; tests/test_python_gpu_kvcache.py is the decode family's, now partly served by decode_tma);
#   3. the decode smoke grid's quick mode (bf16), kernel names printed;
#   4. compute-sanitizer memcheck on decode_tma calls: paged with forced splits, contiguous with appended rows and a
#      tail block, cache_batch_idx, d64 paged, the row split (64 rows paged; 128 rows, two chunks), and one call the
#      guard sends to the decode family (pages of 16);
#   5. bench/bench_decode.py: issue 10's rows at s_q 1, 4, 16, contiguous and paged (64), cuDNN and FA2 in the same
#      process, TB/s and ratios, the instance of each row.
# Logs under $OUT (else ./verify_dectma_logs); the summary comes last.
#
#   bash tools/verify_dectma.sh [build] [tests] [smoke] [sanitizer] [bench]     (default: all five)
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
logs=${OUT:-$repo/verify_dectma_logs}
mkdir -p "$logs"
work=${MHAKIT_GPU_WORK:-/tmp/mhakit_dectma}
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
    (cd "$work/lib" && python3 "$repo/compile.py" --api fwd --profile default --filter splitkv --benchmark \
        -j "$jobs" --build-dir "$work/objects") >"$logs/build.log" 2>&1
    rc=$?
    note "build splitkv (decode + decode_tma) + benchmark_mha_fwd: rc=$rc in $(elapsed "$start")"
    tail -3 "$logs/build.log"
    start=$(date +%s)
    python3 -m mhakit prebuild --profile default --filter splitkv -j "$jobs" >"$logs/prebuild.log" 2>&1
    note "JIT prebuild of the split-KV entries: rc=$? in $(elapsed "$start")"
    tail -3 "$logs/prebuild.log"
fi

if want tests; then
    start=$(date +%s)
    python3 -m pytest -q -m gpu tests/test_python_gpu_kvcache_tma.py tests/test_python_gpu_kvcache.py 2>&1 \
        | tee "$logs/pytest_gpu.log" | tail -15
    note "pytest -m gpu (decode_tma + decode kvcache tests): $(tail -1 "$logs/pytest_gpu.log") in $(elapsed "$start")"
fi

if want smoke; then
    start=$(date +%s)
    (cd "$work/lib" && bash "$repo/smoke_tests/smoke_test_decode.sh" -q -k -j "$jobs") >"$logs/smoke_decode.log" 2>&1
    note "smoke_test_decode -q (bf16, validated): $(tail -1 "$logs/smoke_decode.log") in $(elapsed "$start")"
    note "  runs per family: decode_tma $(grep -c '_decode_tma_b' "$logs/smoke_decode.log"), decode $(grep -c '_decode_b' "$logs/smoke_decode.log") (kernel-name lines)"
    grep -A3 '^FAILED' "$logs/smoke_decode.log" | head -40
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
-prec=bf16 -b=3 -h=32 -h_k=8 -s=1 -s_k=1000,4033,64 -page_block_size=64 -num_splits=3 -lse=1
-prec=fp16 -b=2 -h=16 -h_k=4 -s=4 -s_k=777,5000 -mask=b -s_knew=2 -num_splits=0 -lse=1
-prec=bf16 -b=3 -h=8 -h_k=4 -s=1 -s_k=500,7,1 -cache_batch_idx=1 -s_knew=2 -num_splits=7 -lse=1
-prec=bf16 -b=2 -h=8 -h_k=2 -s=3 -s_k=700,33 -d=64 -page_block_size=256 -mask=b:64,0 -num_splits=0
-prec=bf16 -b=2 -h=32 -h_k=8 -s=16 -s_k=1500,77 -page_block_size=64 -num_splits=3 -mask=b -lse=1
-prec=fp16 -b=2 -h=64 -h_k=8 -s=16 -s_k=999,3000 -s_knew=1 -mask=b -num_splits=0 -lse=1
-prec=bf16 -b=2 -h=16 -h_k=2 -s=16 -s_k=1500,77 -page_block_size=16 -num_splits=3 -mask=b -lse=1
CASES
    note "compute-sanitizer memcheck: $((n - bad))/$n cases clean (families: $(grep -o 'sm90a_decode[a-z_]*' "$logs/sanitizer.log" | sort | uniq -c | tr '\n' ' '))"
fi

if want bench; then
    start=$(date +%s)
    python3 bench/bench_decode.py --sq 1,4,16 --page 64 --show-kernel --json "$logs/bench_decode.json" \
        >"$logs/bench_decode.md" 2>"$logs/bench_decode.err"
    rc=$?
    grep 'mha_fwd_splitkv ->' "$logs/bench_decode.md" | sed 's/.*-> //' | sort | uniq -c
    sed -n '/^| b |/,$p' "$logs/bench_decode.md"
    note "bench_decode (issue 10 rows, s_q 1/4/16, contiguous + paged 64, cuDNN + FA2): rc=$rc in $(elapsed "$start"); table in bench_decode.md"
fi

echo
echo "===== summary ====="
printf '%s\n' "${summary[@]}" | tee "$logs/summary.txt"
