#!/usr/bin/env bash
# Everything that needs the GPU, in one go (one device session): build the `all` profile of both directions with
# every core, run the GPU tests, the full forward and backward smoke grids, compute-sanitizer memcheck over a
# representative subset, and the peer benchmarks. Logs go to $OUT (or ./gpu_check_logs); the last lines printed are
# the summary.
#
#   bash bench/gpu_check.sh [all|build|build_fwd|build_bwd|tests|smoke|sanitizer|bench]...     (default: all)
#
# build is build_fwd then build_bwd, each the library, its benchmark and its JIT prebuild. On the H200 machine the
# default profile's build_fwd takes about 5 minutes and build_bwd about 4-5 (2026-11-25): together they no longer fit
# one 10-minute device call, so give them a call each (on the same machine: the second keeps the first's outputs).
# On the lent GPU machine the pinned CUTLASS wheel travels as a carried wheel: install it once per machine, not in
# every call (`[ -d /tmp/site/cutlass_library ] || python3 -m pip install ... --target /tmp/site .whl/*.whl`), since
# a reinstall rewrites every CUTLASS header and ninja then recompiles every instance in the next call.
# MHAKIT_GPU_PROFILE picks the build profile (default: all). Without the build step, the libraries and benchmarks
# must already be in $MHAKIT_GPU_WORK/lib (e.g. `compile.py --benchmark` run on another machine of the same nvcc):
# the later steps use what is there.
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
logs=${OUT:-$repo/gpu_check_logs}
mkdir -p "$logs"
work=${MHAKIT_GPU_WORK:-/tmp/mhakit_gpu}
mkdir -p "$work/lib"
profile=${MHAKIT_GPU_PROFILE:-all}
steps=${*:-all}
want() { [[ " $steps " == *" all "* || " $steps " == *" $1 "* ]]; }
summary=()
note() { summary+=("$1"); echo "== $1"; }

nvidia-smi --query-gpu=name,compute_cap,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$logs/gpu.txt"
# The host: its kernel names the machine's runtime (host costs and tools differ between them).
echo "host: $(uname -r), $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)" | tee -a "$logs/gpu.txt"

mkdir -p "$work/objects"

# The JIT libraries of the profile (every one a Python call could need), into $work/jit_cache, from the build step's
# objects where it ran; entries already in the cache are kept.
prebuild() {  # prebuild API...
    local api start
    for api in "$@"; do
        start=$(date +%s)
        MHAKIT_CACHE_DIR="$work/jit_cache" python3 -m mhakit prebuild --api $api --profile "$profile" -j "$(nproc)" \
            --build-dir "$work/objects" >"$logs/prebuild_$api.log" 2>&1
        note "JIT prebuild $profile $api: rc=$?, $(( $(date +%s) - start )) s"
    done
}

for api in fwd bwd; do  # fwd first: benchmark_mha_bwd links libmha_fwd.so
    if want build || want "build_$api"; then
        start=$(date +%s)
        (cd "$work/lib" && python3 "$repo/compile.py" --api $api --profile "$profile" --benchmark -j "$(nproc)" \
            --build-dir "$work/objects") >"$logs/build_$api.log" 2>&1
        rc=$?
        count=$(python3 compile.py --api $api --list --arch sm_90a --profile "$profile" | tail -1)
        note "build $profile $api: rc=$rc, $(( $(date +%s) - start )) s on $(nproc) cores ($count)"
        tail -2 "$logs/build_$api.log"
        # The tests' JIT libraries of this API, linked from these objects in the build's own device call (40 + 38 s
        # on the H200). In a later call (the machine copies the tree afresh for each) the prebuild compiled every
        # instance again (227 + 138 s), and so did a second build call (2026-11-25: all of fwd once more), even with
        # the sources dated back to match the objects (tried in the fifth session). Likely cause (not yet confirmed
        # on the GPU machine): each call began by reinstalling the CUTLASS wheel (`pip install --upgrade --target`),
        # which gives every CUTLASS header a new mtime, and every instance includes them; install it once per
        # machine instead (the header above). Each build step still makes the JIT libraries, so that the tests
        # step's prebuild finds every library in the cache either way.
        prebuild "$api"
    fi
done
lib_dir="$work/lib"

# gpu_test_files LABEL WHAT FILE...: `pytest -m gpu` on each file, cut into MHAKIT_GPU_TEST_SHARDS (3) shards of its
# collected tests (conftest.py's --shard=I/N), each shard a process of its own, MHAKIT_GPU_TEST_JOBS (12) at a time
# (the environment passes through; the NumPy references are CPU-bound, one core each): whole files took more than one
# 10-minute device call (test_python_gpu_mods.py alone about 6 minutes), a third of each fits beside the others. A log
# per shard in $logs/LABEL/, a line per shard in $logs/LABEL.log.
gpu_test_files() {
    local label=$1 what=$2 start totals shards=${MHAKIT_GPU_TEST_SHARDS:-3} f i
    shift 2
    rm -rf "${logs:?}/$label"; mkdir -p "$logs/$label"
    start=$(date +%s)
    for f in "$@"; do for ((i = 0; i < shards; i++)); do echo "$f $i"; done; done |
        xargs -P "${MHAKIT_GPU_TEST_JOBS:-12}" -L 1 bash -c \
        'log="$1/$(basename "$3" .py)_$4.log"; python3 -m pytest -q -m gpu -p no:cacheprovider --shard="$4/$2" "$3" \
             >"$log" 2>&1
         echo "$3 [$4/$2]: rc=$? $(grep -E "[0-9]+ (passed|failed|errors?|skipped|deselected)" "$log" | tail -1)"' \
        _ "$logs/$label" "$shards" | tee "$logs/$label.log"
    totals=$(grep -o -E "[0-9]+ (passed|failed|errors?|skipped)" "$logs/$label.log" |
        awk '{n[$2] += $1} END {for (k in n) printf "%d %s, ", n[k], k}')
    note "pytest -m gpu, $what ($# files in $shards shards each, $(( $(date +%s) - start )) s): ${totals%, }; shards that failed (rc other than 0, or 5: nothing selected): $(grep -c -v -E ': rc=(0|5) ' "$logs/$label.log")"
}

if want tests; then
    # The Python tests' kernels, compiled up front with every core (on first use they would build one entry at a
    # time): every library a call could need within the profile (already in the cache when the build step ran).
    prebuild fwd bwd
    # Each file with GPU tests in shards of pytest processes (gpu_test_files): in one process the suites take about
    # 25 minutes on the H200 machine, most of it the NumPy references on one CPU core. A log per shard under
    # $logs/<label>/, its summary line in $logs/<label>.log, the totals in the summary.
    export MHAKIT_TEST_PROFILE=$profile MHAKIT_TEST_LIB_DIR="$lib_dir" MHAKIT_TEST_BUILD_DIR="$work" \
        MHAKIT_TEST_CACHE_DIR="$work/jit_cache" OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
    gpu_test_files pytest_gpu "the C call path" $(grep -l -E "pytest\.mark\.gpu|pytestmark = .*gpu" tests/test_*.py)
    # mhakit.torch's plumbing on the CPU (torch is on this machine, not on CI's): the NumPy reference behind its calls.
    python3 -m pytest -q -p no:cacheprovider tests/test_torch_plumbing.py >"$logs/torch_plumbing.log" 2>&1
    note "mhakit.torch plumbing (CPU, NumPy reference behind the calls): $(tail -1 "$logs/torch_plumbing.log")"
    # The same Python GPU tests through the pure-Python call path (the C path above is the default).
    MHAKIT_NO_EXT=1 gpu_test_files pytest_gpu_python_path "the pure-Python call path" tests/test_python_gpu.py \
        tests/test_python_gpu_bwd.py tests/test_python_gpu_kvcache.py
fi

if want smoke; then
    for api in fwd bwd decode; do  # decode: benchmark_mha_fwd's split-KV path
        start=$(date +%s)
        (cd "$lib_dir" && bash "$repo/smoke_tests/smoke_test_$api.sh" -j "$(nproc)") >"$logs/smoke_$api.log" 2>&1
        note "smoke_test_$api (full grid, -v=1): $(tail -1 "$logs/smoke_$api.log") in $(( $(date +%s) - start )) s"
        grep -A3 '^FAILED' "$logs/smoke_$api.log" | head -40
    done
fi

memcheck_case() {  # memcheck_case N API ARGS...: one case, its output in $logs/sanitizer/N.log
    local n=$1 api=$2
    shift 2
    out=$(compute-sanitizer --tool memcheck --error-exitcode 99 "$lib_dir/benchmark_mha_$api" "$@" -v=1 -warmup=0 \
        -repeat=1 -kname=1 2>&1)
    rc=$?
    printf '### %s %s (rc=%d)\n%s\n' "$api" "$*" "$rc" "$out" >"$logs/sanitizer/$n.log"
    [ "$rc" -eq 0 ] || echo "sanitizer FAILED: $api $*"
}

if want sanitizer; then
    # Four cases at a time: each is a short run under the sanitizer, mostly host-bound.
    rm -rf "$logs/sanitizer"; mkdir -p "$logs/sanitizer"
    export -f memcheck_case; export logs lib_dir
    grep -v '^$' <<'CASES' | nl -nln -w1 -s' ' | xargs -P 4 -L 1 bash -c 'memcheck_case "$@"' _ \
        | tee "$logs/sanitizer_failed.txt"
fwd -prec=bf16 -b=2 -h=4 -s=300 -s_k=517 -d=128 -mask=0 -lse=1
fwd -prec=fp16 -b=2 -h=4 -s=300 -s_k=517 -d=128 -mask=1 -lse=1
fwd -prec=bf16 -b=1 -h=2 -h_k=1 -s=1024 -s_k=256 -d=128 -mask=2
fwd -prec=fp16 -b=2 -h=2 -s=257 -s_k=129 -d=64 -mask=b -lse=1 -iperm=0 -operm=0
fwd -prec=bf16 -b=1 -h=2 -s=130 -s_k=200 -d=256 -mask=t -lse=1
fwd -prec=bf16 -b=2 -h=2 -h_k=1 -d=16 -d_v=256 -s=55 -s_k=256
fwd -prec=fp16 -b=2 -h=1 -d=256 -d_v=24 -s=3 -s_k=99 -mask=2
fwd -prec=bf16 -b=3 -h=2 -h_k=1 -d=192 -d_v=128 -s=200 -s_k=520 -mask=t:128,30 -lse=1
fwd -prec=fp16 -b=2 -h=1 -d=32 -s=99 -s_k=32 -mask=b:4,35
fwd -prec=bf16 -b=1 -h=2 -h_k=1 -d=128 -s=33 -s_k=0 -mask=2 -lse=1
fwd -prec=fp16 -mode=1 -b=3 -h=4 -h_k=2 -s=100,0,37 -s_k=64,19,0 -d=128 -mask=t -lse=1
fwd -prec=bf16 -mode=1 -b=2 -h=2 -s=513,77 -s_k=300,600 -d=64 -mask=g:40,9 -lse=1 -iperm=0 -operm=0
bwd -prec=bf16 -b=1 -h=4 -h_k=2 -s=259 -d=128
bwd -prec=fp16 -b=2 -h=2 -s=516 -s_k=253 -d=64 -mask=1 -iperm=0 -operm=0
bwd -prec=bf16 -b=1 -h=4 -h_k=1 -s=500 -s_k=251 -d=128 -mask=1 -deterministic=1
bwd -prec=bf16 -b=2 -h=1 -s=987 -s_k=219 -d=256 -mask=t:128,30
bwd -prec=fp16 -b=2 -h=3 -h_k=1 -s=244 -s_k=499 -d=192 -d_v=128 -mask=b:4,35
bwd -prec=bf16 -mode=1 -b=3 -h=4 -h_k=2 -s=100,0,37 -s_k=64,19,0 -d=128 -mask=b
fwd -prec=bf16 -mode=1 -b=4 -h=2 -s=513,77,1,300 -s_k=300,600,5,1 -d=256 -mask=b:40,9 -lse=1
bwd -prec=fp16 -mode=1 -b=4 -h=2 -s=513,77,1,300 -s_k=300,600,5,1 -d=64 -mask=b:40,9
bwd -prec=bf16 -mode=1 -b=2 -h=4 -h_k=1 -s=300,129 -s_k=1,300 -d=256 -mask=t
fwd -prec=bf16 -b=2 -h=4 -h_k=2 -s=100 -s_k=77 -d=59 -lse=1
fwd -prec=fp16 -mode=1 -b=2 -h=2 -s=99,31 -s_k=200,64 -d=111 -d_v=59 -mask=b -lse=1 -iperm=0 -operm=0
bwd -prec=bf16 -b=1 -h=4 -h_k=2 -s=259 -d=59
bwd -prec=fp16 -mode=1 -b=2 -h=4 -h_k=1 -s=200,57 -s_k=251,90 -d=111 -mask=1 -iperm=0 -operm=0
bwd -prec=bf16 -b=1 -h=2 -s=130 -s_k=200 -d=255 -mask=b:4,35 -deterministic=1
bwd -prec=fp16 -mode=1 -b=3 -h=4 -h_k=2 -s=300,0,129 -s_k=257,64,500 -d=64 -mask=t:50,20 -deterministic=1
bwd -prec=bf16 -b=1 -h=2 -s=300 -s_k=400 -d=256 -mask=b -deterministic=1
bwd -prec=fp16 -b=1 -h=4 -h_k=2 -s=300 -s_k=257 -d=192 -mask=t -deterministic=1
fwd -prec=bf16 -b=2 -h=4 -h_k=1 -s=300 -s_k=517 -d=64 -d_v=128 -mask=t -lse=1
fwd -prec=bf16 -b=2 -h=8 -h_k=2 -s=1 -s_k=3000,700 -page_block_size=64 -num_splits=0 -s_knew=2 -lse=1
fwd -prec=bf16 -b=2 -h=16 -h_k=2 -s=16 -s_k=1500,77 -page_block_size=16 -num_splits=3 -mask=b -lse=1
fwd -prec=fp16 -b=3 -h=8 -h_k=8 -s=3 -s_k=900,1,0 -num_splits=4 -cache_batch_idx=1 -s_knew=1 -d=59 -d_v=100 -lse=1
fwd -prec=bf16 -b=3 -h=32 -h_k=8 -s=1 -s_k=1000,4033,64 -page_block_size=64 -num_splits=3 -lse=1
fwd -prec=fp16 -b=2 -h=16 -h_k=4 -s=4 -s_k=777,5000 -mask=b -s_knew=2 -num_splits=0 -lse=1
fwd -prec=bf16 -b=3 -h=8 -h_k=4 -s=1 -s_k=500,7,1 -cache_batch_idx=1 -s_knew=2 -num_splits=7 -lse=1
fwd -prec=bf16 -b=2 -h=8 -h_k=2 -s=3 -s_k=700,33 -d=64 -page_block_size=256 -mask=b:64,0 -num_splits=0
fwd -prec=bf16 -b=2 -h=32 -h_k=8 -s=16 -s_k=1500,77 -page_block_size=64 -num_splits=3 -mask=b -lse=1
fwd -prec=fp16 -b=2 -h=64 -h_k=8 -s=16 -s_k=999,3000 -s_knew=1 -mask=b -num_splits=0 -lse=1
fwd -prec=fp8 -qscale=pt -b=2 -h=4 -h_k=2 -d=128 -s=333 -s_k=517 -lse=1
fwd -prec=fp8 -qscale=pt -b=1 -h=2 -d=128 -s=257 -s_k=257 -mask=b -iperm=0 -operm=0 -lse=1
fwd -prec=fp8 -qscale=pt -b=2 -h=4 -h_k=1 -d=256 -s=190 -s_k=300 -mask=t:64,16 -lse=1
fwd -prec=fp8 -qscale=n -init=ufq -b=1 -h=2 -d=256 -s=129 -s_k=77 -lse=1
fwd -prec=fp8 -qscale=pt -b=1 -h=2 -d=128 -s=40 -s_k=0 -lse=1
fwd -prec=bf16 -b=2 -h=4 -h_k=2 -s=300 -s_k=333 -d=128 -mask=b -logits_soft_cap=20 -bias=a -sink=1 -lse=1
fwd -prec=bf16 -mode=1 -b=4 -h=4 -h_k=1 -s=100,0,257,31 -s_k=64,19,300,0 -d=128 -mask=t -bias=e -sink=1 -lse=1
bwd -prec=bf16 -b=2 -h=4 -h_k=2 -s=300 -s_k=333 -d=128 -mask=b -logits_soft_cap=20 -bias=a
bwd -prec=bf16 -mode=1 -b=4 -h=4 -h_k=1 -s=100,0,257,31 -s_k=64,19,300,0 -d=128 -mask=t -bias=e -dbias=1 -sink=1
bwd -prec=bf16 -b=2 -h=4 -h_k=2 -s=300 -s_k=333 -d=128 -mask=0 -logits_soft_cap=20 -bias=a
bwd -prec=bf16 -mode=1 -b=3 -h=4 -h_k=2 -s=100,0,257 -s_k=64,19,300 -d=64 -mask=0 -bias=e -dbias=1 -p_drop=0.2
CASES
    n=$(find "$logs/sanitizer" -name '*.log' | wc -l)
    bad=$(grep -c 'sanitizer FAILED' "$logs/sanitizer_failed.txt")
    cat "$logs"/sanitizer/*.log >"$logs/sanitizer.log"
    note "compute-sanitizer memcheck: $((n - bad))/$n cases clean (families: $(grep -o 'mha_[a-z_]* -> [^ ,]*' \
        "$logs/sanitizer.log" | grep -o '_sm90a_[a-z_]*' | sed 's/^_sm90a_//; s/_b$//' | sort | uniq -c | tr -s ' \n' ' '))"
fi

if want bench; then
    python3 bench/bench_fwd.py --lib "$lib_dir/libmha_fwd.so" --dtype bf16,fp16 --json "$logs/bench_fwd.json" \
        2>&1 | tee "$logs/bench_fwd.md" | tail -40
    python3 bench/bench_bwd.py --lib "$lib_dir/libmha_bwd.so" --fwd-lib "$lib_dir/libmha_fwd.so" --dtype bf16,fp16 \
        --json "$logs/bench_bwd.json" 2>&1 | tee "$logs/bench_bwd.md" | tail -25
    python3 bench/bench_varlen.py --lib "$lib_dir/libmha_fwd.so" --bwd-lib "$lib_dir/libmha_bwd.so" \
        --json "$logs/bench_varlen.json" 2>&1 | tee "$logs/bench_varlen.md" | tail -25
    MHAKIT_CACHE_DIR="$work/jit_cache" python3 bench/bench_overhead.py --json "$logs/bench_overhead.json" 2>&1 \
        | tee "$logs/bench_overhead.md" | tail -30
    MHAKIT_CACHE_DIR="$work/jit_cache" python3 bench/bench_decode.py --json "$logs/bench_decode.json" 2>&1 \
        | tee "$logs/bench_decode.md" | tail -20
    MHAKIT_CACHE_DIR="$work/jit_cache" python3 bench/bench_mods.py --json "$logs/bench_mods.json" 2>&1 \
        | tee "$logs/bench_mods.md" | tail -30
    python3 bench/plot_perf.py "$logs/bench_fwd.json" "$logs/bench_bwd.json" --out-dir "$logs/plots"
    python3 bench/bench_fwd.py --lib "$lib_dir/libmha_fwd.so" --dtype bf16,fp8 --peers cudnn --shape 128,16384,0 \
        --shape 128,16384,1 --shape 256,16384,0 --shape 256,16384,1 --json "$logs/bench_fp8.json" 2>&1 \
        | tee "$logs/bench_fp8.md" | tail -12
    # What each score modifier costs against the plain call (issue 12's bar), hd 128, s = 4096, bf16, instance named.
    for api in fwd bwd; do
        for mask in 0 b; do
            for mod in "" -logits_soft_cap=30 -bias=a -bias=e -sink=1; do
                # shellcheck disable=SC2086
                "$lib_dir/benchmark_mha_$api" -prec=bf16 -b=1 -h=16 -s=4096 -d=128 -v=0 -warmup=10 -repeat=30 \
                    -kname=1 -mask=$mask $mod 2>&1 | grep -o -e "mha_$api -> [^ ]*" -e '[0-9.]* ms' | tr '\n' ' '
                echo " ($api, mask=$mask ${mod:-plain})"
            done
        done
    done | tee "$logs/mods_cost.txt"
    # The backward's GQA split at b = 1 (bwd_gqa_split.h): MHA, h_k 2 and 1, unmasked and causal, hd 128 (64, 256:
    # MQA), s = 4096, bf16; the instance and split count named.
    for mask in 0 t; do
        for shape in "128 16" "128 2" "128 1" "64 1" "256 1"; do
            read -r d hk <<<"$shape"
            "$lib_dir/benchmark_mha_bwd" -prec=bf16 -b=1 -h=16 -h_k="$hk" -s=4096 -d="$d" -mask=$mask -v=0 \
                -warmup=10 -repeat=30 -kname=1 2>&1 | grep -o -e "mha_bwd -> [^ ]*" -e '[0-9.]* ms' | tr '\n' ' '
            echo " (d$d h16/$hk mask=$mask)"
        done
    done | tee "$logs/gqa_split.txt"
    note "bench: see bench_fwd.md, bench_bwd.md, bench_varlen.md, bench_overhead.md, bench_decode.md, bench_mods.md, bench_fp8.md, mods_cost.txt, gqa_split.txt, plots/"
fi

echo
echo "===== summary ====="
printf '%s\n' "${summary[@]}" | tee "$logs/summary.txt"
