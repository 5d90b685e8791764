#!/usr/bin/env bash
# mhakit forward smoke test: aiter's smoke_test_fwd.sh grid, restricted to what mhakit supports
# (no bias, no dropout, no split-kv / paged kv-cache, row-major V):
#   prec {fp16, bf16} x mode {1, 0} x perm {0, 1} (iperm = operm) x hdim {32, 64, 128, 256} x lse {0, 1},
#   nine shapes each (GQA, d != d_v, causal top-left / bottom-right, sliding windows, empty K, s_q = 1).
# Every run validates against the CPU reference (-v=1) and must exit 0.
#
# Runs from any directory. The benchmark is $BENCH, or ./benchmark_mha_fwd in the current directory.
set -u

usage() {
    cat <<'EOF'
usage: smoke_test_fwd.sh [-v LEVEL] [-q] [-k] [-j JOBS] [-h]
  -v LEVEL  validation level, passed as -v=LEVEL (default: 1)
  -j JOBS   runs in parallel (default: 1; 0: one per CPU core); output stays in grid order
  -q        quick subset: fp16 and lse=1 only (144 runs instead of 576)
  -k        pass -kname=1 (print the chosen kernel names)
  -h        show this help
environment:
  BENCH           benchmark executable (default: ./benchmark_mha_fwd)
  MHA_EXTRA_ARGS  extra arguments appended to every command, e.g. MHA_EXTRA_ARGS="-init=nf -seed=7"
  MHA_TIMEOUT     seconds allowed per run when `timeout` is installed (default: 600; 0: no limit)
EOF
}

VALIDATE=1
QUICK=0
KNAME=0
JOBS=1
while getopts ":v:qkj:h" opt; do
    case "$opt" in
        v) VALIDATE=$OPTARG ;;
        q) QUICK=1 ;;
        k) KNAME=1 ;;
        j) JOBS=$OPTARG ;;
        h) usage; exit 0 ;;
        :) echo "smoke_test_fwd: option -$OPTARG needs a value" >&2; usage >&2; exit 2 ;;
        *) echo "smoke_test_fwd: unknown option -$OPTARG" >&2; usage >&2; exit 2 ;;
    esac
done
shift $((OPTIND - 1))
if [ $# -gt 0 ]; then
    echo "smoke_test_fwd: unexpected argument(s): $*" >&2
    usage >&2
    exit 2
fi

case "$JOBS" in
    ''|*[!0-9]*) echo "smoke_test_fwd: -j needs a whole number" >&2; exit 2 ;;
esac
if [ "$JOBS" -eq 0 ]; then
    JOBS=$(nproc 2>/dev/null || echo 1)
fi

EXE=${BENCH:-./benchmark_mha_fwd}
if [ ! -f "$EXE" ] || [ ! -x "$EXE" ]; then
    if command -v -- "$EXE" >/dev/null 2>&1 && [ "${EXE#*/}" = "$EXE" ]; then
        EXE=$(command -v -- "$EXE")
    else
        echo "smoke_test_fwd: benchmark executable '$EXE' not found or not executable" >&2
        echo "  (build it, run from its directory, or set BENCH=/path/to/benchmark_mha_fwd)" >&2
        exit 2
    fi
fi

COMMON_ARGS=(-v="$VALIDATE" -warmup=0 -repeat=1)
if [ "$KNAME" -eq 1 ]; then
    COMMON_ARGS+=(-kname=1)
fi
EXTRA_ARGS=()
if [ -n "${MHA_EXTRA_ARGS:-}" ]; then
    read -r -a EXTRA_ARGS <<<"$MHA_EXTRA_ARGS"
fi
TIMEOUT_CMD=()
MHA_TIMEOUT=${MHA_TIMEOUT:-600}
if [ "$MHA_TIMEOUT" != "0" ] && command -v timeout >/dev/null 2>&1; then
    TIMEOUT_CMD=(timeout "$MHA_TIMEOUT")
fi

PASSED=0
FAILED=0
FAILED_CMDS=()

summary() {
    if [ "$FAILED" -gt 0 ]; then
        echo "failed commands:"
        for c in "${FAILED_CMDS[@]}"; do
            echo "  $c"
        done
    fi
    echo "smoke_test_fwd: $PASSED passed, $FAILED failed"
}
trap 'echo; echo "smoke_test_fwd: interrupted"; summary; exit 130' INT TERM

WORK=$(mktemp -d "${TMPDIR:-/tmp}/smoke_fwd.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
NUM_CMDS=0

# run ARGS... : queue one benchmark run (executed by run_all, JOBS at a time)
run() {
    local cmd=("$EXE" "$@" "${COMMON_ARGS[@]}" ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"})
    printf '%q ' "${cmd[@]}" >"$WORK/$NUM_CMDS.cmd"
    NUM_CMDS=$((NUM_CMDS + 1))
}

# execute_one N : run queued command N, keeping its output and exit status
execute_one() {
    local cmd
    cmd=$(cat "$WORK/$1.cmd")
    eval "${TIMEOUT_CMD[*]+${TIMEOUT_CMD[*]}} $cmd" >"$WORK/$1.out" 2>&1
    echo $? >"$WORK/$1.rc"
}

# run_all : execute the queue, then report every run in grid order
run_all() {
    local i running=0 rc printable out
    for ((i = 0; i < NUM_CMDS; i++)); do
        execute_one "$i" &
        running=$((running + 1))
        if [ "$running" -ge "$JOBS" ]; then
            wait -n
            running=$((running - 1))
        fi
    done
    wait
    for ((i = 0; i < NUM_CMDS; i++)); do
        rc=$(cat "$WORK/$i.rc" 2>/dev/null || echo 255)
        printable=$(cat "$WORK/$i.cmd")
        printable=${printable% }
        out=$(cat "$WORK/$i.out" 2>/dev/null)
        if [ "$rc" -eq 0 ]; then
            PASSED=$((PASSED + 1))
            [ -n "$out" ] && printf '%s\n' "$out"
        else
            FAILED=$((FAILED + 1))
            FAILED_CMDS+=("$printable")
            if [ "$rc" -eq 124 ] && [ ${#TIMEOUT_CMD[@]} -gt 0 ]; then
                echo "FAILED (timed out after ${MHA_TIMEOUT}s): $printable"
            else
                echo "FAILED (exit $rc): $printable"
            fi
            [ -n "$out" ] && printf '%s\n' "$out" | sed 's/^/    /'
        fi
    done
}

PRECS="fp16 bf16"
LSES="0 1"
if [ "$QUICK" -eq 1 ]; then
    PRECS="fp16"
    LSES="1"
fi

echo "smoke_test_fwd: $EXE ${COMMON_ARGS[*]} ${EXTRA_ARGS[*]+${EXTRA_ARGS[*]}}"
for prec in $PRECS; do
for mode in 1 0; do
for perm in 0 1; do
for hdim in 32 64 128 256; do
for lse in $LSES; do
    p=(-lse="$lse" -iperm="$perm" -operm="$perm")
    run -prec="$prec" -mode="$mode" -b=2 -h=2 -h_k=1 -d=16 -d_v="$hdim" -s=55 -s_k=256 "${p[@]}"
    run -prec="$prec" -mode="$mode" -b=1 -h=3 -d="$hdim" -s=100 -s_k=51 "${p[@]}"
    run -prec="$prec" -mode="$mode" -b=2 -h=1 -d=16 -d_v="$hdim" -s=99 -s_k=256 "${p[@]}" -mask=1
    run -prec="$prec" -mode="$mode" -b=1 -h=2 -h_k=1 -d="$hdim" -s=1024 -s_k=256 "${p[@]}" -mask=2
    run -prec="$prec" -mode="$mode" -b=2 -h=1 -d="$hdim" -d_v=24 -s=3 -s_k=99 "${p[@]}" -mask=2
    run -prec="$prec" -mode="$mode" -b=3 -h=2 -h_k=1 -d="$hdim" -s=200 -s_k=520 "${p[@]}" -mask=t:128,30
    run -prec="$prec" -mode="$mode" -b=2 -h=1 -d="$hdim" -s=99 -s_k=32 "${p[@]}" -mask=b:4,35
    run -prec="$prec" -mode="$mode" -b=1 -h=2 -h_k=1 -d="$hdim" -s=33 -s_k=0 "${p[@]}" -mask=2
    run -prec="$prec" -mode="$mode" -b=1 -h=2 -h_k=1 -d="$hdim" -s=1 -s_k=10 "${p[@]}" -mask=2
done
done
done
done
done

run_all
summary
if [ "$FAILED" -ne 0 ]; then
    exit 1
fi
exit 0
