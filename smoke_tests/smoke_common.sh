# mhakit smoke tests: the machinery shared by smoke_test_fwd.sh and smoke_test_bwd.sh. Sourced (bash), not run.
#
# The caller sets SMOKE_NAME (its name in messages, e.g. smoke_test_fwd) and SMOKE_EXE_DEFAULT (the benchmark run
# when $BENCH is unset, e.g. ./benchmark_mha_fwd), defines usage(), and then calls
#   smoke_setup "$@"   options -v LEVEL, -q, -k, -j JOBS, -h; finds the executable; sets VALIDATE, QUICK, KNAME,
#                      JOBS, EXE, COMMON_ARGS (-v=LEVEL -warmup=0 -repeat=1 [-kname=1]), EXTRA_ARGS ($MHA_EXTRA_ARGS),
#                      the per-run timeout ($MHA_TIMEOUT) and a scratch directory removed on exit
#   smoke_header       prints "<name>: <exe> <common args> <extra args>"
#   run ARGS...        queues one benchmark run: $EXE ARGS... COMMON_ARGS... EXTRA_ARGS...
#   run_all            executes the queue, JOBS at a time, then reports every run in queue order
#   smoke_finish       prints the failed commands and "<name>: N passed, M failed"; exits 1 if any failed, else 0
# With -j > 1 and MHAKIT_REF_THREADS unset, each run's CPU reference gets nproc / JOBS threads (at least 1), so that
# parallel runs do not oversubscribe the CPU (the reference's results do not depend on its thread count).

smoke_setup() {
    VALIDATE=1
    QUICK=0
    KNAME=0
    JOBS=1
    local opt OPTIND=1
    while getopts ":v:qkj:h" opt; do
        case "$opt" in
            v) VALIDATE=$OPTARG ;;
            q) QUICK=1 ;;
            k) KNAME=1 ;;
            j) JOBS=$OPTARG ;;
            h) usage; exit 0 ;;
            :) echo "$SMOKE_NAME: option -$OPTARG needs a value" >&2; usage >&2; exit 2 ;;
            *) echo "$SMOKE_NAME: unknown option -$OPTARG" >&2; usage >&2; exit 2 ;;
        esac
    done
    shift $((OPTIND - 1))
    if [ $# -gt 0 ]; then
        echo "$SMOKE_NAME: unexpected argument(s): $*" >&2
        usage >&2
        exit 2
    fi

    case "$JOBS" in
        ''|*[!0-9]*) echo "$SMOKE_NAME: -j needs a whole number" >&2; exit 2 ;;
    esac
    if [ "$JOBS" -eq 0 ]; then
        JOBS=$(nproc 2>/dev/null || echo 1)
    fi
    if [ "$JOBS" -gt 1 ] && [ -z "${MHAKIT_REF_THREADS:-}" ]; then
        local ncpu
        ncpu=$(nproc 2>/dev/null || echo 1)
        MHAKIT_REF_THREADS=$((ncpu / JOBS))
        [ "$MHAKIT_REF_THREADS" -ge 1 ] || MHAKIT_REF_THREADS=1
        export MHAKIT_REF_THREADS
    fi

    EXE=${BENCH:-$SMOKE_EXE_DEFAULT}
    if [ ! -f "$EXE" ] || [ ! -x "$EXE" ]; then
        if command -v -- "$EXE" >/dev/null 2>&1 && [ "${EXE#*/}" = "$EXE" ]; then
            EXE=$(command -v -- "$EXE")
        else
            echo "$SMOKE_NAME: benchmark executable '$EXE' not found or not executable" >&2
            echo "  (build it, run from its directory, or set BENCH=/path/to/${SMOKE_EXE_DEFAULT##*/})" >&2
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
    trap 'echo; echo "$SMOKE_NAME: interrupted"; summary; exit 130' INT TERM

    WORK=$(mktemp -d "${TMPDIR:-/tmp}/smoke_${SMOKE_NAME#smoke_test_}.XXXXXX")
    trap 'rm -rf "$WORK"' EXIT
    NUM_CMDS=0
}

summary() {
    if [ "$FAILED" -gt 0 ]; then
        echo "failed commands:"
        for c in "${FAILED_CMDS[@]}"; do
            echo "  $c"
        done
    fi
    echo "$SMOKE_NAME: $PASSED passed, $FAILED failed"
}

smoke_header() {
    echo "$SMOKE_NAME: $EXE ${COMMON_ARGS[*]} ${EXTRA_ARGS[*]+${EXTRA_ARGS[*]}}"
}

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

smoke_finish() {
    summary
    if [ "$FAILED" -ne 0 ]; then
        exit 1
    fi
    exit 0
}
