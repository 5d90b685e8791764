#!/usr/bin/env bash
# Dropout on the Hopper forward and backward (branch hdrop, issue 12 item 4: dropout <= 25 % of the plain kernel's
# time at hd128 s=4k), in two parts:
#
#   bash tools/verify_hdrop.sh build   # the 2-core machine, before the device call (-j 2)
#   bash tools/verify_hdrop.sh run     # the H200, from those prebuilt libraries, no compiling (~2-3 min)
#
# build: build/hdrop/ (relative to the repository root; carry it to the device machine) gets libmha_fwd.so,
#   libmha_bwd.so, benchmark_mha_fwd and benchmark_mha_bwd with the bf16 d128 instances a dropout call and its plain
#   peer need: Hopper batch nmask / mask (plain, the cost loop's baseline) and batch + group mask_mods (dropout), the
#   generic fallbacks of the same (batch nmask / mask / mask_mods, group mask_mods), and the minimal profile's two
#   decode instances (so that the CPU compile tests with MHAKIT_TEST_BUILD_DIR share these objects). Objects go to
#   $MHAKIT_HDROP_OBJ (default /tmp/mhakit_hdrop/objects); MHAKIT_HDROP_JOBS: the build's -j (default 2).
# run: logs under $OUT (else ./verify_hdrop_logs), a summary at the end:
#   (a) the smoke grids' dropout sections at d128 bf16 (forward 6 runs, backward 8: masks, GQA, group mode, seed /
#       offset in device memory, with soft-cap / bias / sink / dbias, deterministic), host-validated (-v=1) with the
#       random bytes stored (-s_randval=1; the backward benchmark's forward stores them too), each run's instance
#       named (-kname=1): every dropout call must name a "_mods_sm90a_hopper_" instance; plus four larger runs
#       (several key tiles, both consumer warpgroups, causal and windowed, GQA, group mode);
#   (b) the keep rate, statistically (bench/dropout_rate.py: q = k = 0, v = 1, p 0.1 / 0.5, causal or not);
#   (c) compute-sanitizer memcheck of one forward and one backward dropout call (odd lengths, causal, GQA, group
#       mode);
#   (d) the cost loop: plain vs -p_drop=0.1 at hd128 s=4k bf16 b=1 h=16, no mask and causal, forward and backward,
#       warmup 10, repeat 30 (the benchmarks' own timing), and the dropout / plain ratio.
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
libs=$repo/build/hdrop
step=${1:-}
summary=()
note() { summary+=("$1"); echo "== $1"; }
elapsed() { echo "$(( $(date +%s) - $1 )) s"; }

# The instances (compile.py --filter: names containing one of these).
FWD="fwd_d128_bf16_batch_nmask_sm90a_hopper,fwd_d128_bf16_batch_mask_sm90a_hopper"
FWD+=",fwd_d128_bf16_batch_mask_mods_sm90a_hopper,fwd_d128_bf16_group_mask_mods_sm90a_hopper"
FWD+=",fwd_d128_bf16_batch_nmask_sm90a_generic,fwd_d128_bf16_batch_mask_sm90a_generic"
FWD+=",fwd_d128_bf16_batch_mask_mods_sm90a_generic,fwd_d128_bf16_group_mask_mods_sm90a_generic"
FWD+=",splitkv_d128_bf16_batch_mask_sm90a_decode"
BWD=${FWD//fwd_/bwd_}
BWD=${BWD%,splitkv*}

case "$step" in
build)
    obj=${MHAKIT_HDROP_OBJ:-/tmp/mhakit_hdrop/objects}
    mkdir -p "$libs"
    start=$(date +%s)
    for api in fwd bwd; do
        filter=$FWD
        [ "$api" = bwd ] && filter=$BWD
        t0=$(date +%s)
        (cd "$libs" && python3 "$repo/compile.py" --api "$api" --arch sm_90a --profile all --filter "$filter" \
            --benchmark -j "${MHAKIT_HDROP_JOBS:-2}" --build-dir "$obj") >"$libs/build_$api.log" 2>&1
        note "build $api: rc=$? in $(elapsed "$t0"): $(grep -cE '^(fwd|bwd|splitkv)_' <(python3 "$repo/compile.py" --api "$api" \
            --arch sm_90a --profile all --filter "$filter" --list 2>/dev/null)) instances; $(tail -1 "$libs/build_$api.log")"
    done
    note "built in $(elapsed "$start"): $(du -sh --exclude='*.log' "$libs" | cut -f1) in build/hdrop ($libs)"
    echo "carry: build/hdrop (the run step reads build/hdrop/{libmha_fwd.so,libmha_bwd.so,benchmark_mha_fwd,benchmark_mha_bwd})"
    ;;
run)
    logs=${OUT:-$repo/verify_hdrop_logs}
    mkdir -p "$logs"
    export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
    F=$libs/benchmark_mha_fwd
    B=$libs/benchmark_mha_bwd
    for f in "$F" "$B" "$libs/libmha_fwd.so" "$libs/libmha_bwd.so"; do
        [ -e "$f" ] || { echo "missing $f: run the build step and carry build/hdrop" >&2; exit 2; }
    done
    nvidia-smi --query-gpu=name,compute_cap,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$logs/gpu.txt"
    start=$(date +%s)

    # (a) + (b) + (c): correctness, in parallel (nothing timed yet)
    (MHA_SMOKE_ONLY=dropout MHA_SMOKE_PRECS=bf16 MHA_MODS_HDIMS=128 BENCH="$F" \
        bash smoke_tests/smoke_test_fwd.sh -k -j 3 >"$logs/smoke_fwd.log" 2>&1; echo "rc=$?" >>"$logs/smoke_fwd.log") &
    (MHA_SMOKE_ONLY=dropout MHA_SMOKE_PRECS=bf16 MHA_MODS_HDIMS=128 BENCH="$B" \
        bash smoke_tests/smoke_test_bwd.sh -k -j 3 >"$logs/smoke_bwd.log" 2>&1; echo "rc=$?" >>"$logs/smoke_bwd.log") &
    (
        c=(-prec=bf16 -d=128 -v=1 -warmup=0 -repeat=1 -kname=1)
        "$F" "${c[@]}" -b=2 -h=8 -h_k=2 -s=1000 -s_k=1100 -mask=b -p_drop=0.3 -drop_seed=99 -drop_offset=5 \
            -s_randval=1 -lse=1; echo "rc=$?"
        "$F" "${c[@]}" -mode=1 -b=3 -h=4 -h_k=1 -s=700 -s_k=900 -mask=t:300,20 -p_drop=0.15 -drop_prefs=1 \
            -drop_seed=31337 -s_randval=1 -lse=1; echo "rc=$?"
        "$B" "${c[@]}" -b=2 -h=8 -h_k=2 -s=1000 -s_k=1100 -mask=b -p_drop=0.3 -drop_seed=99 -drop_offset=5; echo "rc=$?"
        "$B" "${c[@]}" -mode=1 -b=3 -h=4 -h_k=1 -s=700 -s_k=900 -mask=t:300,20 -p_drop=0.15 -drop_prefs=1 \
            -drop_seed=31337 -deterministic=1; echo "rc=$?"
    ) >"$logs/larger.log" 2>&1 &
    python3 bench/dropout_rate.py --lib "$libs/libmha_fwd.so" >"$logs/rate.log" 2>&1 &
    (
        m=(compute-sanitizer --tool memcheck --error-exitcode 99)
        "${m[@]}" "$F" -prec=bf16 -d=128 -mode=1 -b=3 -h=4 -h_k=2 -s=333 -s_k=517 -mask=b -p_drop=0.2 -s_randval=1 \
            -lse=1 -v=1 -warmup=0 -repeat=1 -kname=1; echo "rc=$?"
        "${m[@]}" "$B" -prec=bf16 -d=128 -mode=1 -b=3 -h=4 -h_k=2 -s=333 -s_k=517 -mask=b -p_drop=0.2 \
            -v=1 -warmup=0 -repeat=1 -kname=1; echo "rc=$?"
    ) >"$logs/memcheck.log" 2>&1 &
    wait
    for w in fwd bwd; do
        log=$logs/smoke_$w.log
        runs=$(grep -c "mha_$w -> " "$log")
        hop=$(grep -c "mha_$w -> [^ ,]*_mods_sm90a_hopper_" "$log")
        note "(a) smoke $w dropout: $(grep -o '[0-9]* passed, [0-9]* failed' "$log" | tail -1), $(tail -1 "$log"); $hop of $runs mha_$w calls on a _mods hopper instance"
    done
    note "(a) larger runs: $(grep -c '^rc=0' "$logs/larger.log") of 4 rc=0, $(grep -c 'valid:y' "$logs/larger.log") valid:y; instances: $(grep -o 'mha_[a-z]* -> [^ ,]*' "$logs/larger.log" | sort | uniq -c | tr '\n' ';')"
    note "(b) keep rate: $(grep -c ' ok; rows: .* ok$' "$logs/rate.log") of 4 cases ok; $(tail -1 "$logs/rate.log"); $(grep -o 'kernel [^;]*' "$logs/rate.log" | sort -u | tr '\n' ' ')"
    note "(c) memcheck: $(grep -o 'ERROR SUMMARY: [0-9]* errors*' "$logs/memcheck.log" | tr '\n' ' ') $(grep '^rc=' "$logs/memcheck.log" | tr '\n' ' ')$(grep -o 'mha_[a-z]* -> [^ ,]*' "$logs/memcheck.log" | sort -u | tr '\n' ' ')"
    note "correctness in $(elapsed "$start")"

    # (d) the cost loop, one run at a time
    t0=$(date +%s)
    : >"$logs/cost.log"
    for exe in "$F" "$B"; do
        for mask in 0 t; do
            for drop in 0 0.1; do
                echo "## $(basename "$exe") mask=$mask p_drop=$drop" >>"$logs/cost.log"
                c=(-prec=bf16 -b=1 -h=16 -s=4096 -d=128 -mask=$mask -p_drop=$drop -v=0)
                "$exe" "${c[@]}" -warmup=10 -repeat=30 >>"$logs/cost.log" 2>&1
                "$exe" "${c[@]}" -warmup=0 -repeat=1 -kname=1 2>&1 | grep -o 'mha_[a-z]* -> [^ ,]*' >>"$logs/cost.log"
            done
        done
    done
    python3 - "$logs/cost.log" <<'PY' | tee "$logs/cost.md"
import re, sys
text = open(sys.argv[1]).read()
rows = {}
for block in text.split("## ")[1:]:
    head, _, body = block.partition("\n")
    exe, mask, drop = head.split()
    ms = re.search(r"([0-9.]+) ms", body)  # the timed run (the kernel name comes from a one-launch run after it)
    kname = re.search(r"mha_%s -> ([^ ,\n]+)" % exe[-3:], body)  # the backward benchmark runs a forward first
    rows[(exe, mask, drop)] = (float(ms.group(1)) if ms else None, kname.group(1) if kname else "?")
print("| direction | mask | plain ms | p_drop=0.1 ms | cost | plain kernel | dropout kernel |")
print("|---|---|---|---|---|---|---|")
for exe in ("benchmark_mha_fwd", "benchmark_mha_bwd"):
    for mask in ("mask=0", "mask=t"):
        (a, ka), (b, kb) = rows.get((exe, mask, "p_drop=0"), (None, "?")), rows.get((exe, mask, "p_drop=0.1"), (None, "?"))
        cost = f"{(b / a - 1) * 100:+.1f} %" if a and b else "-"
        print(f"| {exe[-3:]} | {mask[5:]} | {a} | {b} | {cost} | {ka} | {kb} |")
PY
    note "(d) cost loop in $(elapsed "$t0"): $logs/cost.md"
    note "run in $(elapsed "$start")"
    ;;
*)
    echo "usage: bash tools/verify_hdrop.sh build|run" >&2
    exit 2
    ;;
esac

echo
echo "== summary"
printf '%s\n' "${summary[@]}"
