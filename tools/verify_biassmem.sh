#!/usr/bin/env bash
# The Hopper forward's staged elementwise bias (branch biassmem, issue 12: bias at <= 10 % of the plain kernel's time),
# in two parts:
#
#   bash tools/verify_biassmem.sh build   # the 2-core machine, before the device call (-j 2: about 8 minutes)
#   bash tools/verify_biassmem.sh run     # the H200, from that prebuilt library, no compiling (about 2 minutes)
#
# build: libmha_fwd.so + benchmark_mha_fwd in build/biassmem/ with the d128 bf16 Hopper instances (batch plain and
#   _mods, mask and nmask; group _mods) and the d128 bf16 generic fallbacks (batch and group, plain and _mods).
#   Objects go to $MHAKIT_BIASSMEM_OBJ (default /tmp/mhakit_biassmem_obj); MHAKIT_BIASSMEM_JOBS: -j (default 2).
#   Carry build/biassmem to the device machine.
# run (logs under $OUT, else ./verify_biassmem_logs):
#   (a) correctness, host-validated (-v=1): bias e / e:1 / e:2 at d128 in batch and group mode over every mask kind,
#       GQA, odd s_q, s_k whose bias rows are 16-byte aligned (staged in shared memory: partial last key tiles of
#       8, 40, 72 keys, long rows crossing the ring's phases) and not (s_k = 77, 130: the direct global loads), with
#       soft-cap and sink; every run must print valid:y and run a "_mods" hopper instance (-kname=1);
#   (b) compute-sanitizer memcheck on two staged calls (batch: odd lengths, causal, GQA, e:2; group: e:1, mask b);
#   (c) the cost loop at hd 128, s = 4096, bf16, b = 1, h = 16, no mask and causal (-mask=1), warmup 10, repeat 30:
#       plain, bias e (staged), e:1 (a bias per head), ALiBi and sink (controls), plus bias e at s_k = 4092 (rows
#       not 16-byte aligned: the unstaged path) against plain at the same s_k; the cost of each against plain.
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
    if [ ! -x "$bench" ] || [ ! -f "$lib/libmha_fwd.so" ]; then
        echo "no prebuilt library in $lib: run the build step and carry build/biassmem"
        exit 1
    fi
    nvidia-smi --query-gpu=name,compute_cap,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$logs/gpu.txt"
    start=$(date +%s)
    cd "$lib"

    # ---- (a) correctness ----
    ok=0 bad=0
    check() {  # one host-validated run: valid:y and a hopper _mods instance, else a FAIL line with its log
        local out
        out=$("$bench" -prec=bf16 -d=128 -lse=1 -v=1 -kname=1 -warmup=0 -repeat=1 "$@" 2>&1)
        echo "$* :: $out" >>"$logs/correctness.log"
        if grep -q "valid:y" <<<"$out" && grep -q "mha_fwd -> fwd_d128_bf16_.*_mods_sm90a_hopper" <<<"$out" &&
            ! grep -q "mha_fwd -> .*generic" <<<"$out"; then
            ok=$((ok + 1))
        else
            bad=$((bad + 1))
            echo "FAIL: $* :: $out" | tee -a "$logs/failures.log"
        fi
    }
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
    check -bias=e -b=1 -h=2 -s=2048 -s_k=2048                                  # 16 key tiles, no mask
    check -bias=e:2 -b=1 -h=4 -h_k=1 -s=2048 -s_k=2048 -mask=2                 # MQA, causal bottom-right
    note "correctness: $ok valid, $bad failed ($(( $(date +%s) - start )) s; runs in correctness.log)"

    # ---- (b) memcheck ----
    if command -v compute-sanitizer >/dev/null; then
        m=0
        for args in "-mode=0 -b=2 -h=4 -h_k=2 -s=333 -s_k=200 -mask=t -bias=e:2" \
                    "-mode=1 -b=3 -h=2 -h_k=1 -s=257 -s_k=136 -mask=b -bias=e:1"; do
            m=$((m + 1))
            # shellcheck disable=SC2086
            compute-sanitizer --tool memcheck --error-exitcode 3 "$bench" -prec=bf16 -d=128 -v=1 -kname=1 \
                -warmup=0 -repeat=1 $args >"$logs/memcheck_$m.log" 2>&1
            rc=$?
            note "memcheck $m ($args): rc=$rc, $(grep -E 'ERROR SUMMARY' "$logs/memcheck_$m.log" | tail -1), $(grep -o 'valid:[yn]' "$logs/memcheck_$m.log" | tail -1)"
        done
    else
        note "memcheck: no compute-sanitizer on PATH"
    fi

    # ---- (c) cost loop ----
    ms() {  # the benchmark's time of one configuration (ms)
        "$bench" -prec=bf16 -d=128 -b=1 -h=16 -v=0 -kname=1 -warmup=10 -repeat=30 "$@" >"$logs/cost_$(echo "$*" | tr ' =:' '_..').log" 2>&1
        grep -Eo '[0-9]+\.[0-9]+ ms' "$logs/cost_$(echo "$*" | tr ' =:' '_..').log" | tail -1 | cut -d' ' -f1
    }
    {
        printf "%-34s %10s %8s  %s\n" "hd128 s=4096 bf16 b=1 h=16" "ms" "cost" "instance"
        for mask in 0 1; do
            base=$(ms -s=4096 -mask=$mask)
            printf "%-34s %10s %8s\n" "mask=$mask plain" "$base" "-"
            for mod in -bias=e -bias=e:1 -bias=a -sink=1; do
                t=$(ms -s=4096 -mask=$mask $mod)
                inst=$(grep -o 'mha_fwd -> [a-z0-9_]*' "$logs/cost_$(echo "-s=4096 -mask=$mask $mod" | tr ' =:' '_..').log" | tail -1)
                printf "%-34s %10s %7s%%  %s\n" "mask=$mask $mod" "$t" \
                    "$(python3 -c "print(f'{($t / $base - 1) * 100:+.1f}')" 2>/dev/null)" "${inst#mha_fwd -> }"
            done
        done
        base=$(ms -s=4096 -s_k=4092 -mask=0)
        t=$(ms -s=4096 -s_k=4092 -mask=0 -bias=e)
        printf "%-34s %10s %8s\n" "s_k=4092 mask=0 plain" "$base" "-"
        printf "%-34s %10s %7s%%  %s\n" "s_k=4092 mask=0 -bias=e (unstaged)" "$t" \
            "$(python3 -c "print(f'{($t / $base - 1) * 100:+.1f}')" 2>/dev/null)" "global loads"
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
