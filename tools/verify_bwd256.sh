#!/usr/bin/env bash
# Verifies branch bwd256 (issues 9 / 13: the Hopper backward 8-19 % slower at d256 and at d128 s=16k since the
# deterministic mode; the branch brings back the main loop's code of be56bb4: the query split's dQ adds as REDG, not
# ATOMG, and the key split's consumers without per-tile spills) in two parts, run from the repository root:
#
#   bash tools/verify_bwd256.sh build [DIR]   # no GPU needed (nvcc 13.0): builds everything into DIR (default
#                                             # ./verify_bwd256), about 10-12 minutes with -j 2 (JOBS=2)
#   bash tools/verify_bwd256.sh run [DIR]     # on the H200, from DIR's libraries, no compiling: logs under $OUT
#                                             # (default DIR/logs), about 2.5 minutes
# DIR's libraries are ignored by git (*.so, benchmark_mha_bwd): the device call carries DIR/lib and DIR/base (about
# 15 MB together, ~1 MB an instance; objects and sources stay in $WORK, outside DIR).
#
# build: in DIR/lib, libmha_fwd.so (the forward's O and LSE: d128 / d256 bf16 Hopper, batch; d256 group) and
#   libmha_bwd.so + benchmark_mha_bwd (d128 / d256 bf16 batch Hopper, no mask and mask; d256 bf16 group Hopper; the
#   generic d128 / d256 bf16 batch fallbacks); in DIR/base, libmha_bwd.so of the d128 / d256 bf16 batch Hopper
#   instances at the branch's base commit (git merge-base HEAD main, through git archive), so that the run times the
#   two on the same GPU minutes apart.
# run (each step logged to $OUT/<step>.log; a failed step is reported, the next one still runs; exit 1 if any failed):
#   1. ab: bench/bench_bwd.py --dtype bf16 --hdims 128,256 with the base library (no peers), then with the branch's
#      and cuDNN (12 rows each, every gradient checked against fp32 first): the branch's d256 rows should be back
#      near 2026-11-22's 400 / 325 TFLOPS (s=4k) and 412 / 397 (s=16k), d128 s=16k non-causal near 518;
#   2. cases: benchmark_mha_bwd -v=1 -kname=1 at d256 (every call checked against the CPU reference, the instance
#      name printed; each must be a _hopper_ one): GQA, MQA, causal top-left / bottom-right, a window, odd lengths,
#      s_q != s_k, group mode with an empty sequence, deterministic (bitwise rerun), deterministic + GQA + causal;
#   3. memcheck: compute-sanitizer on a d256 GQA causal batch call with odd lengths and a d256 deterministic group call.
set -uo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cmd="${1:-}"
DIR="${2:-$PWD/verify_bwd256}"
JOBS="${JOBS:-2}"
python="${PYTHON:-python3}"

# compile.py --filter globs (matched anywhere in the name)
FWD="fwd_d128_bf16_batch_*_sm90a_hopper_,fwd_d256_bf16_batch_*_sm90a_hopper_,fwd_d256_bf16_group_*_sm90a_hopper_"
BWD="bwd_d128_bf16_batch_*_sm90a_hopper_,bwd_d256_bf16_batch_*_sm90a_hopper_,bwd_d256_bf16_group_*_sm90a_hopper_"
BWD+=",bwd_d128_bf16_batch_*_sm90a_generic_,bwd_d256_bf16_batch_*_sm90a_generic_"
BASE_BWD="bwd_d128_bf16_batch_nmask_sm90a_hopper_,bwd_d128_bf16_batch_mask_sm90a_hopper_"
BASE_BWD+=",bwd_d256_bf16_batch_nmask_sm90a_hopper_,bwd_d256_bf16_batch_mask_sm90a_hopper_"
EXCLUDE_MODS='_mods_'  # the globs also match the "_mods" instances: dropped from compile.py --list's names
# objects and the base commit's sources: outside DIR, so that DIR holds only what the run needs (carry DIR/lib, DIR/base)
WORK="${WORK:-${TMPDIR:-/tmp}/verify_bwd256_work}"

build() {
    mkdir -p "$DIR/lib" "$DIR/base" "$WORK" || return 1
    DIR="$(cd "$DIR" && pwd)"
    local f b
    # the globs above also match the _mods instances; list the plain names and pass them exactly
    f="$(cd "$repo" && "$python" compile.py --api fwd --arch sm_90a --profile all --filter "$FWD" --list |
        grep -v -- "$EXCLUDE_MODS" | grep '^fwd_' | paste -sd, -)"
    b="$(cd "$repo" && "$python" compile.py --api bwd --arch sm_90a --profile all --filter "$BWD" --list |
        grep -v -- "$EXCLUDE_MODS" | grep '^bwd_' | paste -sd, -)"
    echo "forward: $f"
    echo "backward: $b"
    [ -n "$f" ] && [ -n "$b" ] || { echo "no instances matched"; return 1; }
    (cd "$DIR/lib" &&
        "$python" "$repo/compile.py" --api fwd --arch sm_90a --profile all --filter "$f" -j "$JOBS" \
            --build-dir "$WORK/obj" &&
        "$python" "$repo/compile.py" --api bwd --arch sm_90a --profile all --filter "$b" --benchmark -j "$JOBS" \
            --build-dir "$WORK/obj") || return 1
    # the base commit's d128 / d256 backward, from a clean export of that commit
    local base
    base="$(cd "$repo" && git merge-base HEAD main)" || return 1
    rm -rf "$WORK/base_src" && mkdir -p "$WORK/base_src" &&
        (cd "$repo" && git archive "$base") | tar -x -C "$WORK/base_src" || return 1
    (cd "$DIR/base" &&
        "$python" "$WORK/base_src/compile.py" --api bwd --arch sm_90a --profile all --filter "$BASE_BWD" -j "$JOBS" \
            --build-dir "$WORK/obj_base") || return 1
    echo "$base" > "$DIR/base/COMMIT"
    echo "built into $DIR (lib: the branch, base: $base)"
}

run() {
    DIR="$(cd "$DIR" && pwd)" || return 1
    local L="$DIR/lib" OUT="${OUT:-$DIR/logs}"
    mkdir -p "$OUT"
    local BENCH="$L/benchmark_mha_bwd"
    [ -x "$BENCH" ] && [ -f "$L/libmha_fwd.so" ] && [ -f "$DIR/base/libmha_bwd.so" ] ||
        { echo "run '$0 build $DIR' first"; return 1; }
    cd "$repo" || return 1
    local failed=()
    step() {  # step NAME COMMAND...: output in $OUT/NAME.log (and on the terminal), a failure recorded
        local name="$1" t0=$SECONDS
        shift
        echo "=== [$name]"
        if "$@" 2>&1 | tee "$OUT/$name.log"; then
            echo "=== [$name] ok ($((SECONDS - t0)) s)"
        else
            echo "=== [$name] FAILED ($((SECONDS - t0)) s)"
            failed+=("$name")
        fi
    }

    ab() {  # both runs, whatever the first one's status
        local rc=0
        echo "--- base $(cat "$DIR/base/COMMIT")"
        "$python" bench/bench_bwd.py --lib "$DIR/base/libmha_bwd.so" --fwd-lib "$L/libmha_fwd.so" --dtype bf16 \
            --hdims 128,256 --peers "" --json "$OUT/ab_base.json" || rc=1
        echo "--- branch"
        "$python" bench/bench_bwd.py --lib "$L/libmha_bwd.so" --fwd-lib "$L/libmha_fwd.so" --dtype bf16 \
            --hdims 128,256 --peers cudnn --json "$OUT/ab_branch.json" || rc=1
        return $rc
    }
    step ab ab

    cases() {
        local c line rc=0
        local common=(-prec=bf16 -d=256 -v=1 -kname=1 -warmup=0 -repeat=1)
        local list=(
            "-b=2 -h=8 -h_k=2 -s=512 -mask=0"
            "-b=2 -h=8 -h_k=1 -s=384 -mask=t"
            "-b=1 -h=4 -s=300 -s_k=517 -mask=b"
            "-b=2 -h=4 -h_k=2 -s=333 -s_k=271 -mask=t"
            "-b=1 -h=4 -s=640 -mask=b:96,32"
            "-b=3 -h=2 -s=129 -s_k=65 -mask=0"
            "-mode=1 -b=4 -h=4 -h_k=2 -s=200,0,333,64 -s_k=256,17,300,0 -mask=0"
            "-mode=1 -b=3 -h=4 -s=257,128,31 -s_k=300,128,77 -mask=b"
            "-b=2 -h=4 -s=512 -mask=0 -deterministic=1"
            "-b=1 -h=8 -h_k=2 -s=700 -mask=t -deterministic=1"
            "-mode=1 -b=3 -h=4 -h_k=2 -s=300,65,512 -s_k=300,65,512 -mask=b -deterministic=1"
        )
        for c in "${list[@]}"; do
            # shellcheck disable=SC2086
            line="$("$BENCH" "${common[@]}" $c 2>&1)"
            local r=$?
            echo "[$c] rc=$r"
            echo "$line" | grep -v '^\[mhakit\] mha_fwd' | tail -4
            if [ $r -ne 0 ] || ! grep -q 'valid:y' <<<"$line" ||
                ! grep -q 'mha_bwd -> bwd_d256_bf16_.*_sm90a_hopper_' <<<"$line"; then
                echo "  -> FAILED (rc, validation or not a Hopper instance)"
                rc=1
            fi
        done
        return $rc
    }
    step cases cases

    memcheck() {
        local cs=compute-sanitizer
        command -v "$cs" >/dev/null 2>&1 || cs="${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer"
        "$cs" --tool memcheck --error-exitcode 9 "$BENCH" -prec=bf16 -b=2 -h=4 -h_k=2 -s=257 -s_k=301 -d=256 \
            -mask=t -v=1 -kname=1 -warmup=0 -repeat=1 &&
            "$cs" --tool memcheck --error-exitcode 9 "$BENCH" -prec=bf16 -mode=1 -b=3 -h=4 -h_k=1 -s=100,0,193 \
                -s_k=64,33,200 -d=256 -mask=b -deterministic=1 -v=1 -kname=1 -warmup=0 -repeat=1
    }
    step memcheck memcheck

    echo "=== summary: logs in $OUT"
    grep -h -E "^---|\| (128|256) \|" "$OUT/ab.log" 2>/dev/null
    if [ ${#failed[@]} -gt 0 ]; then
        echo "FAILED steps: ${failed[*]}"
        return 1
    fi
    echo "all steps ok"
}

case "$cmd" in
build) build ;;
run) run ;;
*)
    echo "usage: $0 build|run [DIR]" >&2
    exit 2
    ;;
esac
