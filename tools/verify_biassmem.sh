#!/usr/bin/env bash
# The Hopper forward's and backward's staged elementwise bias (branch biassmem, issue 12: bias at <= 10 % of the plain
# kernel's time), in two parts:
#
#   bash tools/verify_biassmem.sh build   # the 2-core machine, before the device call (-j 2: about 8 minutes)
#   bash tools/verify_biassmem.sh run     # the H200, from those prebuilt libraries, no compiling (about 2.5 minutes)
#
# build: libmha_fwd.so, libmha_bwd.so, benchmark_mha_fwd and benchmark_mha_bwd in build/biassmem/ with the d128 bf16
#   Hopper instances (batch plain and _mods, mask and nmask; group _mods; forward: b128x128, backward: b64x128) and
#   the forward's d128 bf16 generic fallbacks (batch and group, plain and _mods; the backward's would take the
#   directory past 20 MB: 12 MB of objects). At -j 1 on the 2-core machine (shared): 914 s with the backward's
#   generic ones (fwd 620 s, bwd 293 s), about 13 minutes without. Objects go to $MHAKIT_BIASSMEM_OBJ (default
#   /tmp/mhakit_biassmem_obj); MHAKIT_BIASSMEM_JOBS: -j (default 2). Carry build/biassmem (about 15 MB) to the
#   device machine.
# run (logs under $OUT, else ./verify_biassmem_logs; every run under a timeout: a ring that never completes a phase
# hangs its kernel, and that must not eat the device time):
#   (a) correctness, host-validated (-v=1): bias e / e:1 / e:2 at d128 in batch and group mode over every mask kind,
#       GQA, odd s_q, s_k whose bias rows are 16-byte aligned (staged in shared memory: partial last key tiles of
#       8, 40, 72 keys, long rows crossing the ring's phases) and not (s_k = 77, 130: the direct global loads), with
#       soft-cap and sink; every run must print valid:y and run a "_mods" hopper instance (-kname=1);
#       the backward likewise (fewer cases, with dbias, a "_mods" hopper backward instance);
#   (b) compute-sanitizer memcheck on two staged forward calls (batch: odd lengths, causal, GQA, e:2; group: e:1,
#       mask b) and one backward (group, GQA, causal, e:1 + dbias);
#   (c) the cost loop at hd 128, s = 4096, bf16, b = 1, h = 16, no mask and causal (-mask=1), warmup 10, repeat 30:
#       plain, bias e (staged), e:1 (a bias per head), ALiBi and sink (controls), plus bias e at s_k = 4092 (rows
#       not 16-byte aligned: the unstaged path) against plain at the same s_k; the cost of each against plain;
#       the backward's plain, bias e (no dbias), ALiBi and sink rows likewise.
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
lib=$repo/build/biassmem
step=${1:-}
summary=()
note() { summary+=("$1"); echo "== $1"; }

case "$step" in
build)
    obj=${MHAKIT_BIASSMEM_OBJ:-/tmp/mhakit_biassmem_obj}
    mkdir -p "$lib"
    start=$(date +%s)
    (cd "$lib" && python3 "$repo/compile.py" --api fwd --arch sm_90a --profile all \
        --filter 'fwd_d128_bf16_batch_*_sm90a_hopper_b128x128,fwd_d128_bf16_group_*mods_sm90a_hopper_b128x128,fwd_d128_bf16_*_sm90a_generic_b128x64w4' \
        --benchmark -j "${MHAKIT_BIASSMEM_JOBS:-2}" --build-dir "$obj" &&
     python3 "$repo/compile.py" --api bwd --arch sm_90a --profile all \
        --filter 'bwd_d128_bf16_batch_*_sm90a_hopper_b64x128,bwd_d128_bf16_group_*mods_sm90a_hopper_b64x128' \
        --benchmark -j "${MHAKIT_BIASSMEM_JOBS:-2}" --build-dir "$obj") >"$lib/build.log" 2>&1
    rc=$?
    echo "build rc=$rc in $(( $(date +%s) - start )) s: $(tail -1 "$lib/build.log")"
    ls -la "$lib"
    echo "size: $(du -sh "$lib" | cut -f1); carry: build/biassmem (the run step reads $lib/{libmha_fwd.so,benchmark_mha_fwd})"
    exit $rc
    ;;
run)
    logs=${OUT:-$repo/verify_biassmem_logs}
    mkdir -p "$logs"
    bench=$lib/benchmark_mha_fwd
    bench_bwd=$lib/benchmark_mha_bwd
    if [ ! -x "$bench" ] || [ ! -x "$bench_bwd" ] || [ ! -f "$lib/libmha_fwd.so" ] || [ ! -f "$lib/libmha_bwd.so" ]; then
        echo "no prebuilt library in $lib: run the build step and carry build/biassmem"
        exit 1
    fi
    nvidia-smi --query-gpu=name,compute_cap,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$logs/gpu.txt"
    start=$(date +%s)
    cd "$lib"

    # ---- (a) correctness ----
    mkdir -p "$logs/correctness"
    runs=0
    validated() {  # RUN API (fwd | bwd), then the benchmark's arguments: one host-validated run, which must print
        # valid:y and run a hopper _mods instance of that API (the backward's forward, for O and LSE, runs too);
        # its verdict and output go to correctness/RUN.log (runs go 8 at a time: the host references dominate)
        local run=$1 api=$2 exe=$bench extra=(-lse=1) out verdict=FAIL
        shift 2
        if [ "$api" = bwd ]; then exe=$bench_bwd extra=(); fi
        out=$(timeout 60 "$exe" -prec=bf16 -d=128 -v=1 -kname=1 -warmup=0 -repeat=1 "${extra[@]}" "$@" 2>&1)
        if grep -q "valid:y" <<<"$out" && grep -q "mha_$api -> ${api}_d128_bf16_.*_mods_sm90a_hopper" <<<"$out" &&
            ! grep -q "mha_$api -> .*generic" <<<"$out"; then
            verdict=ok
        fi
        printf '%s: %s %s\n%s\n' "$verdict" "$api" "$*" "$out" >"$logs/correctness/$run.log"
    }
    launch() {
        runs=$((runs + 1))
        validated "$runs" "$@" &
        while [ "$(jobs -rp | wc -l)" -ge 8 ]; do wait -n; done
    }
    check() { launch fwd "$@"; }
    check_bwd() { launch bwd "$@"; }
    for mode in 0 1; do
        for bias in e e:1 e:2; do
            p=(-mode=$mode -bias=$bias)
            check "${p[@]}" -b=2 -h=2 -h_k=1 -s=100 -s_k=77                   # unaligned rows: global loads
            check "${p[@]}" -b=1 -h=2 -h_k=1 -s=257 -s_k=130 -mask=b          # unaligned rows, causal b
            check "${p[@]}" -b=2 -h=3 -s=200 -s_k=520 -mask=t:128,30          # staged, last tile 8 keys
            check "${p[@]}" -b=1 -h=2 -h_k=1 -s=257 -s_k=136 -mask=b          # staged, causal b
            check "${p[@]}" -b=2 -h=4 -h_k=2 -s=333 -s_k=200 -mask=t          # staged, causal t, GQA, last tile 72
            check "${p[@]}" -b=1 -h=2 -s=131 -s_k=264 -mask=g:30,100          # staged, generic (y, x) mask
            check "${p[@]}" -b=1 -h=2 -s=129 -s_k=296 -mask=b:64,30           # staged, window b, last tile 40
            check "${p[@]}" -b=2 -h=2 -s=300 -s_k=296 -logits_soft_cap=30 -sink=1  # staged + soft-cap + sink
            check "${p[@]}" -b=1 -h=2 -s=1000 -s_k=1000 -mask=1               # staged, 8 tiles per block
        done
    done
    check -bias=e:2 -b=1 -h=2 -h_k=1 -s=2048 -s_k=2048 -mask=2                 # 16 key tiles, causal b
    for mode in 0 1; do
        p=(-mode=$mode)
        check_bwd "${p[@]}" -b=1 -h=2 -h_k=1 -s=130 -s_k=77 -mask=b:4,35 -bias=e:1 -dbias=1   # unaligned rows
        check_bwd "${p[@]}" -b=1 -h=4 -h_k=2 -s=259 -s_k=264 -bias=e -dbias=1       # staged, last key block 8
        check_bwd "${p[@]}" -b=2 -h=2 -s=216 -s_k=152 -mask=2 -bias=e:2 -dbias=1    # staged, causal b
        check_bwd "${p[@]}" -b=1 -h=4 -h_k=1 -s=200 -s_k=256 -mask=t:64,10 -bias=e:1 -dbias=1  # staged, MQA, window
        check_bwd "${p[@]}" -b=1 -h=2 -s=300 -s_k=160 -mask=1 -bias=e -logits_soft_cap=20 -sink=1  # staged + cap + sink
        check_bwd "${p[@]}" -b=1 -h=2 -s=300 -s_k=296 -mask=2 -sink=1 -bias=e -dbias=1 -deterministic=1
        check_bwd "${p[@]}" -b=1 -h=2 -s=333 -s_k=200 -mask=g:30,100 -bias=e:2       # staged, (y, x) mask, no dbias
    done
    wait
    ok=$(cat "$logs"/correctness/*.log | grep -c '^ok: ')
    bad=$((runs - ok))
    grep -h '^FAIL: ' "$logs"/correctness/*.log | tee "$logs/failures.log"
    note "correctness: $ok of $runs valid on a hopper _mods instance, $bad failed ($(( $(date +%s) - start )) s; correctness/)"

    # ---- (b) memcheck ----
    if command -v compute-sanitizer >/dev/null; then
        m=0
        for args in "-mode=0 -b=2 -h=4 -h_k=2 -s=333 -s_k=200 -mask=t -bias=e:2" \
                    "-mode=1 -b=3 -h=2 -h_k=1 -s=257 -s_k=136 -mask=b -bias=e:1" \
                    "bwd -mode=1 -b=2 -h=4 -h_k=2 -s=200 -s_k=264 -mask=1 -bias=e:1 -dbias=1"; do
            m=$((m + 1))
            exe=$bench
            if [ "${args%% *}" = bwd ]; then exe=$bench_bwd; args=${args#bwd }; fi
            # shellcheck disable=SC2086
            timeout 120 compute-sanitizer --tool memcheck --error-exitcode 3 "$exe" -prec=bf16 -d=128 -v=1 -kname=1 \
                -warmup=0 -repeat=1 $args >"$logs/memcheck_$m.log" 2>&1
            rc=$?
            note "memcheck $m ($args): rc=$rc, $(grep -E 'ERROR SUMMARY' "$logs/memcheck_$m.log" | tail -1), $(grep -o 'valid:[yn]' "$logs/memcheck_$m.log" | tail -1)"
        done
    else
        note "memcheck: no compute-sanitizer on PATH"
    fi

    # ---- (c) cost loop ----
    log_of() { echo "$logs/cost_$1_$(shift; echo "$*" | tr ' =:' '_..').log"; }
    timed() {  # API, then the benchmark's arguments: its time (ms) of one configuration; the log at log_of
        local api=$1 exe=$bench
        if [ "$api" = bwd ]; then exe=$bench_bwd; fi
        timeout 60 "$exe" -prec=bf16 -d=128 -b=1 -h=16 -v=0 -kname=1 -warmup=10 -repeat=30 "${@:2}" >"$(log_of "$@")" 2>&1
        grep -Eo '[0-9]+\.[0-9]+ ms' "$(log_of "$@")" | tail -1 | cut -d' ' -f1
    }
    instance() { grep -o "mha_$1 -> [a-z0-9_]*" "$(log_of "$@")" | tail -1 | sed 's/.*-> //'; }
    pct() { python3 -c "print(f'{($1 / $2 - 1) * 100:+.1f}')" 2>/dev/null; }
    {
        for api in fwd bwd; do
            printf "%-34s %10s %8s  %s\n" "$api hd128 s=4096 bf16 b=1 h=16" "ms" "cost" "instance"
            mods=(-bias=e -bias=e:1 -bias=a -sink=1)
            if [ "$api" = bwd ]; then mods=(-bias=e -bias=a -sink=1); fi
            for mask in 0 1; do
                base=$(timed $api -s=4096 -mask=$mask)
                printf "%-34s %10s %8s  %s\n" "mask=$mask plain" "$base" "-" "$(instance $api -s=4096 -mask=$mask)"
                for mod in "${mods[@]}"; do
                    t=$(timed $api -s=4096 -mask=$mask "$mod")
                    printf "%-34s %10s %7s%%  %s\n" "mask=$mask $mod" "$t" "$(pct "$t" "$base")" \
                        "$(instance $api -s=4096 -mask=$mask "$mod")"
                done
            done
            # rows of 4092 elements (8184 bytes): not 16-byte aligned, so the bias is read from global memory
            base=$(timed $api -s=4096 -s_k=4092 -mask=0)
            t=$(timed $api -s=4096 -s_k=4092 -mask=0 -bias=e)
            printf "%-34s %10s %8s\n" "s_k=4092 mask=0 plain" "$base" "-"
            printf "%-34s %10s %7s%%  %s\n\n" "s_k=4092 mask=0 -bias=e" "$t" "$(pct "$t" "$base")" "unstaged (global loads)"
        done
    } | tee "$logs/cost.txt"
    note "cost loop: $logs/cost.txt"
    note "run took $(( $(date +%s) - start )) s"
    printf '%s\n' "${summary[@]}" | tee "$logs/summary.txt"
    [ "$bad" -eq 0 ]
    ;;
*)
    echo "usage: $0 build|run"
    exit 2
    ;;
esac
