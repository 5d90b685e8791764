#!/usr/bin/env bash
# Branch ubias (issue 12: the Hopper backward's unstaged elementwise bias, rows not 16-byte aligned such as a
# contiguous odd s_k: the generic "_mods" kernel issues every load of an Sᵀ part ahead of its modifier loop,
# load_bias16_t in csrc/kernels/hopper/hopper_score_mod.hpp, instead of a load per element used right after it),
# verified on an H200 against the branch's base. Never run on a GPU when written (compile-only session).
#
# From the repository root of the branch's tree (the device copy), with the base tree (an export of main at the
# branch's start, 9c818a7: `git archive 9c818a7 | tar -x -C base`) carried in a directory of its own:
#
#   OUT=$OUT PYTHONPATH=/tmp/site BASE=/path/to/base bash tools/verify_ubias.sh build
#   OUT=$OUT PYTHONPATH=/tmp/site BASE=/path/to/base bash tools/verify_ubias.sh correct
#   OUT=$OUT PYTHONPATH=/tmp/site BASE=/path/to/base bash tools/verify_ubias.sh time
#
# (each phase under 8 minutes on 16 cores; `all` runs them in order). The CUTLASS headers come from the nvidia-cutlass
# wheel the caller installed into $SITE (default /tmp/site), which compile.py must see on PYTHONPATH (each tree's own
# root goes in front). Build outputs go under $VDIR (default /tmp/ubias_verify), never into either tree. $OUT gets five
# files: summary.txt (the key lines and tables), build.log, correct.log, memcheck.log, time.log.
#
# Phases:
#   build    both trees at once (-j $JOBS each, default 8), profile all (the fp16 "_mods" instances are only there):
#            libmha_fwd.so, then libmha_bwd.so + benchmark_mha_bwd (which links the forward for O and LSE) in
#            $VDIR/<tree>/lib: the d128 bf16 Hopper batch mask / nmask plain and "_mods", group mask "_mods", d128 fp16
#            batch mask "_mods", d64 and d256 bf16 batch mask "_mods", forward and backward alike (8 + 8 instances).
#   correct  host-validated runs (benchmark_mha_bwd -v=1 -kname=1: every dq / dk / dv and dbias element against the
#            CPU reference) on both trees, 10 at a time: -bias=e ([1, 1, s_q, s_k]) and -bias=e:2 ([b, h, s_q, s_k])
#            with s_k odd (2-byte rows every other row), even but unaligned (4-byte rows) and staged (16-byte rows),
#            x every mask kind x shapes (GQA, partial tiles), each with and without -dbias=1; soft-cap and sink with
#            the bias; deterministic; group mode with empty sequences and odd lengths; fp16; d64; d256 (no bias ring:
#            every bias unstaged). Each line names the instance it ran on (the expected "_mods_sm90a_hopper_" one:
#            a line on generic counts as a failure). The summary lists the branch's failures and every case whose
#            verdict differs between the trees. Then compute-sanitizer memcheck on 3 branch cases.
#   time     benchmark_mha_bwd -prec=bf16 $TARGS -warmup=10 -repeat=30 (TARGS default -b=1 -h=16 -s=4096 -d=128),
#            base and branch interleaved, $REPS rounds (default 3): plain at s_k 4096 / 4095, -bias=e at s_k 4095
#            (unstaged, odd rows), 4094 (unstaged, 4-byte rows) and 4096 (staged), -bias=e:2 at 4095, -dbias=1 with
#            e at 4095 and 4096; unmasked and causal. A table of medians (ms) and each tree's cost over the plain call
#            of its s_k. Expected (from the SASS, not measured): the unstaged rows faster on the branch (the bias tile's
#            instructions per thread 481 -> 218, soft-cap 589 -> 323, loads ~10 in flight instead of 2-4: the lead
#            measured base 1.752 / 1.046 ms unmasked / causal at s_k 4095), the staged and plain rows ~1.00 (the same
#            kernels on both trees: the fixed variants' and plain kernels' SASS is identical).
set -u
cd "$(dirname "$0")/.."
BR=$(pwd)
BASE=${BASE:-}
VDIR=${VDIR:-/tmp/ubias_verify}
OUT=${OUT:-$VDIR/logs}
JOBS=${JOBS:-8}
REPS=${REPS:-3}
TARGS=${TARGS:--b=1 -h=16 -s=4096 -d=128}
SITE=${SITE:-/tmp/site}
mkdir -p "$OUT" "$VDIR"
SUMMARY=$OUT/summary.txt
touch "$SUMMARY"
note() { echo "$1" | tee -a "$SUMMARY"; }
T0=$(date +%s)
since() { echo "$(( $(date +%s) - T0 )) s"; }

case "$VDIR/" in "$BR/"*) echo "VDIR=$VDIR is inside this tree: choose one under /tmp" >&2; exit 2 ;; esac
if [ -n "$BASE" ]; then
    BASE=$(cd "$BASE" && pwd)
    case "$VDIR/" in "$BASE/"*) echo "VDIR=$VDIR is inside BASE: choose one under /tmp" >&2; exit 2 ;; esac
fi
trees=(branch)
if [ -n "$BASE" ] && [ -f "$BASE/compile.py" ]; then trees+=(base); else note "no BASE tree (BASE=${BASE:-unset}): branch only"; fi
dir_of() { [ "$1" = base ] && echo "$BASE" || echo "$BR"; }
libdir() { echo "$VDIR/$1/lib"; }
exe() { echo "$VDIR/$1/lib/benchmark_mha_bwd"; }

FWD='fwd_d128_bf16_batch_mask_sm90a_hopper,fwd_d128_bf16_batch_nmask_sm90a_hopper'
FWD+=',fwd_d128_bf16_batch_mask_mods_sm90a_hopper,fwd_d128_bf16_batch_nmask_mods_sm90a_hopper'
FWD+=',fwd_d128_bf16_group_mask_mods_sm90a_hopper,fwd_d128_fp16_batch_mask_mods_sm90a_hopper'
FWD+=',fwd_d64_bf16_batch_mask_mods_sm90a_hopper,fwd_d256_bf16_batch_mask_mods_sm90a_hopper'
BWD=${FWD//fwd_/bwd_}

# ---- build ---------------------------------------------------------------------------------------------------------
build_tree() {  # tree: the forward library, then the backward one and its benchmark, in one directory
    local t=$1 tree lib log t1 rc1 rc2
    tree=$(dir_of "$t")
    lib=$(libdir "$t")
    log=$VDIR/build_$t.log
    mkdir -p "$lib"
    t1=$(date +%s)
    (cd "$lib" && PYTHONPATH="$tree:$SITE${PYTHONPATH:+:$PYTHONPATH}" timeout 200 python3 "$tree/compile.py" \
        --api fwd --arch sm_90a --profile all --filter "$FWD" -j "$JOBS" --build-dir "$VDIR/$t/obj_fwd") >"$log" 2>&1
    rc1=$?
    (cd "$lib" && PYTHONPATH="$tree:$SITE${PYTHONPATH:+:$PYTHONPATH}" timeout 260 python3 "$tree/compile.py" \
        --api bwd --arch sm_90a --profile all --filter "$BWD" --benchmark -j "$JOBS" --build-dir "$VDIR/$t/obj_bwd") \
        >>"$log" 2>&1
    rc2=$?
    echo "fwd rc=$rc1 bwd rc=$rc2 wall=$(( $(date +%s) - t1 )) s" >>"$log"
}
phase_build() {
    note "== verify_ubias build: branch $(git -C "$BR" rev-parse --short HEAD 2>/dev/null || echo '(export)'), base ${BASE:-none}; $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -1)"
    local t
    for t in "${trees[@]}"; do build_tree "$t" & done
    wait
    : >"$OUT/build.log"
    for t in "${trees[@]}"; do
        { echo "==== $t"; cat "$VDIR/build_$t.log"; } >>"$OUT/build.log"
        note "build $t: $(tail -1 "$VDIR/build_$t.log"), $(ls "$(libdir "$t")"/*.so 2>/dev/null | wc -l) libraries, exe $( [ -x "$(exe "$t")" ] && echo ok || echo MISSING)"
    done
    note "build done at $(since)"
}

# ---- correct -------------------------------------------------------------------------------------------------------
# "expected instance (a substring of the -kname=1 name)|arguments" (bf16 d128 unless the arguments say otherwise; a
# masked "_mods" instance serves unmasked calls where no nmask one is built: the d128 bf16 batch one is)
B=d128_bf16_batch_mask_mods_sm90a_hopper
N=d128_bf16_batch_nmask_mods_sm90a_hopper
G=d128_bf16_group_mask_mods_sm90a_hopper
cases() {
    local sk bias mask db want
    for sk in 1023 1022 1024; do  # odd rows, 4-byte rows, staged
        for bias in "-bias=e" "-bias=e:2"; do
            for mask in "-mask=0" "-mask=t" "-mask=b" "-mask=t:64,10" "-mask=b:4,35" "-mask=g:90,33"; do
                for db in "" "-dbias=1"; do
                    want=$B
                    [ "$mask" = "-mask=0" ] && want=$N
                    echo "$want|-b=2 -h=4 -h_k=2 -s=333 -s_k=$sk $mask $bias $db"
                done
            done
        done
    done
    echo "$B|-b=1 -h=4 -h_k=1 -s=1000 -s_k=1023 -mask=b -bias=e -logits_soft_cap=30"
    echo "$B|-b=1 -h=4 -h_k=1 -s=1000 -s_k=1023 -mask=b -bias=e:2 -logits_soft_cap=30 -dbias=1"
    echo "$N|-b=2 -h=2 -s=77 -s_k=77 -mask=0 -bias=e -logits_soft_cap=20 -sink=1 -dbias=1"
    echo "$B|-b=2 -h=4 -s=129 -s_k=301 -mask=t:40,17 -bias=e:2 -sink=1"
    echo "$B|-b=1 -h=4 -s=1025 -s_k=1001 -mask=b -bias=e:2 -deterministic=1 -dbias=1"
    echo "$B|-b=1 -h=2 -s=300 -s_k=4095 -mask=t -bias=e -dbias=1"
    echo "$B|-b=1 -h=2 -s=1 -s_k=333 -mask=b -bias=e"
    echo "$G|-mode=1 -b=3 -h=4 -h_k=2 -s=1000,0,333 -s_k=1023,77,0 -mask=b -bias=e:2 -dbias=1"
    echo "$G|-mode=1 -b=3 -h=4 -s=517,1000,37 -s_k=1001,999,1 -mask=t -bias=e -logits_soft_cap=20 -sink=1"
    echo "$G|-mode=1 -b=2 -h=2 -h_k=1 -s=200,100 -s_k=4095,77 -mask=t:64,0 -bias=e:2"
    echo "$G|-mode=1 -b=2 -h=2 -s=300,2000 -s_k=501,1901 -mask=0 -bias=e -deterministic=1 -dbias=1"
    echo "d128_fp16_batch_mask_mods_sm90a_hopper|-prec=fp16 -b=2 -h=4 -h_k=2 -s=333 -s_k=1023 -mask=b -bias=e:2 -dbias=1"
    echo "d128_fp16_batch_mask_mods_sm90a_hopper|-prec=fp16 -b=1 -h=4 -s=333 -s_k=1022 -mask=t:64,64 -bias=e -logits_soft_cap=30"
    echo "d64_bf16_batch_mask_mods_sm90a_hopper|-d=64 -b=2 -h=4 -s=1000 -s_k=777 -mask=b -bias=e:2 -logits_soft_cap=30 -dbias=1"
    echo "d64_bf16_batch_mask_mods_sm90a_hopper|-d=64 -b=2 -h=4 -h_k=2 -s=333 -s_k=1023 -mask=t -bias=e"
    echo "d256_bf16_batch_mask_mods_sm90a_hopper|-d=256 -b=2 -h=4 -h_k=2 -s=300 -s_k=517 -mask=b -bias=e -dbias=1"
    echo "d256_bf16_batch_mask_mods_sm90a_hopper|-d=256 -b=1 -h=4 -s=333 -s_k=1022 -mask=t:64,10 -bias=e:2 -logits_soft_cap=30"
    echo "d256_bf16_batch_mask_mods_sm90a_hopper|-d=256 -b=1 -h=2 -s=200 -s_k=512 -mask=0 -bias=e"
}
one_case() {  # tree spec -> one line: PASS|FAIL|NOTRUN <instance> | <args>
    local t=$1 want=${2%%|*} args=${2#*|} out kern d=-d=128 prec=-prec=bf16
    [[ "$args" == *"-d="* ]] && d=
    [[ "$args" == *"-prec="* ]] && prec=
    # shellcheck disable=SC2086
    out=$(LD_LIBRARY_PATH="$(libdir "$t")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" timeout 300 "$(exe "$t")" $prec $d \
        -v=1 -kname=1 -warmup=0 -repeat=1 $args 2>&1)
    kern=$(echo "$out" | grep -o 'mha_bwd -> bwd_[0-9a-z_]*' | head -1 | sed 's/.*-> //')
    if echo "$out" | grep -q 'valid:y' && [[ "$kern" == *"$want"* ]]; then echo "PASS   ${kern:-?} | $args"
    elif echo "$out" | grep -q 'valid:'; then echo "FAIL   ${kern:-?} (want $want, $(echo "$out" | grep -o 'valid:[yn]' | head -1)) | $args"
    else echo "NOTRUN ${kern:-?} | $args | $(echo "$out" | tail -2 | tr '\n' ' ' | cut -c1-200)"; fi
}
export -f one_case exe libdir
export VDIR
phase_correct() {
    local t n
    n=$(cases | wc -l)
    : >"$OUT/correct.log"
    for t in "${trees[@]}"; do
        [ -x "$(exe "$t")" ] || { note "correct $t: no benchmark_mha_bwd (run the build phase)"; continue; }
        # 10 at a time: the CPU reference sets the pace
        cases | tr '\n' '\0' | xargs -0 -P 10 -I{} bash -c 'one_case "$0" "$1"' "$t" {} \
            | LC_ALL=C sort -t'|' -k2,2 >"$VDIR/correct_$t.log"
        { echo "==== $t"; cat "$VDIR/correct_$t.log"; } >>"$OUT/correct.log"
        note "correct $t: $(grep -c '^PASS' "$VDIR/correct_$t.log") pass, $(grep -c '^FAIL' "$VDIR/correct_$t.log") fail, $(grep -c '^NOTRUN' "$VDIR/correct_$t.log") not run, of $n at $(since)"
    done
    grep -v '^PASS' "$VDIR/correct_branch.log" 2>/dev/null | sed 's/^/  branch: /' | head -40 | tee -a "$SUMMARY"
    if [ -f "$VDIR/correct_base.log" ] && [ -f "$VDIR/correct_branch.log" ]; then
        LC_ALL=C join -t'|' -j2 \
            <(awk -F'|' '{split($1,a," "); print a[1] "|" $2}' "$VDIR/correct_base.log" | LC_ALL=C sort -t'|' -k2,2) \
            <(awk -F'|' '{split($1,a," "); print a[1] "|" $2}' "$VDIR/correct_branch.log" | LC_ALL=C sort -t'|' -k2,2) \
            | awk -F'|' '$2 != $3 {print "  differs: base " $2 ", branch " $3 " |" $1}' | tee -a "$SUMMARY"
    fi
    : >"$OUT/memcheck.log"
    if command -v compute-sanitizer >/dev/null && [ -x "$(exe branch)" ]; then
        local i=0 c log
        for c in "-b=1 -h=4 -h_k=2 -s=333 -s_k=1023 -mask=t -bias=e -dbias=1" \
                 "-mode=1 -b=3 -h=2 -h_k=1 -s=300,0,129 -s_k=521,77,1001 -mask=b -bias=e:2 -logits_soft_cap=20 -dbias=1" \
                 "-d=256 -b=1 -h=2 -s=200 -s_k=331 -mask=b:4,35 -bias=e:2 -dbias=1"; do
            i=$((i + 1))
            log=$VDIR/memcheck_$i.log
            # shellcheck disable=SC2086
            LD_LIBRARY_PATH="$(libdir branch)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" timeout 150 compute-sanitizer \
                --tool memcheck --error-exitcode 99 "$(exe branch)" -prec=bf16 -v=1 -kname=1 -warmup=0 -repeat=1 \
                $( [[ "$c" == *"-d="* ]] || echo -d=128 ) $c >"$log" 2>&1
            local rc=$?
            { echo "==== memcheck $i: $c (rc=$rc)"; tail -20 "$log"; } >>"$OUT/memcheck.log"
            note "memcheck $i ($c): rc=$rc, $(grep -o 'ERROR SUMMARY: [0-9]* errors*' "$log" | head -1), $(grep -o 'valid:[yn]' "$log" | head -1)"
        done
    fi
    note "correct done at $(since)"
}

# ---- time ----------------------------------------------------------------------------------------------------------
TMODS=("-s_k=4096" "-s_k=4095" "-s_k=4095 -bias=e" "-s_k=4094 -bias=e" "-s_k=4096 -bias=e" "-s_k=4095 -bias=e:2"
       "-s_k=4095 -bias=e -dbias=1" "-s_k=4096 -bias=e -dbias=1")
phase_time() {
    local rep t k m line ms log=$OUT/time.log tp
    tp=$(date +%s)
    : >"$log"
    for rep in $(seq 1 "$REPS"); do
        for k in "-mask=0" "-mask=t"; do
            for m in "${TMODS[@]}"; do
                for t in "${trees[@]}"; do
                    [ -x "$(exe "$t")" ] || continue
                    [ $(( $(date +%s) - tp )) -lt 450 ] || { note "time: stopped at 450 s (round $rep)"; break 4; }
                    # shellcheck disable=SC2086
                    line=$(LD_LIBRARY_PATH="$(libdir "$t")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" timeout 120 "$(exe "$t")" \
                        -prec=bf16 $TARGS -warmup=10 -repeat=30 -v=0 -kname=1 $k $m 2>&1)
                    ms=$(echo "$line" | grep ' ms' | tail -1 | grep -o '[0-9.]* ms' | head -1 | cut -d' ' -f1)
                    echo "$t|$k|$m|${ms:-NA}|$(echo "$line" | grep -o 'mha_bwd -> bwd_[0-9a-z_]*' | head -1 | sed 's/.*-> //')" >>"$log"
                done
            done
        done
        note "time round $rep done at $(since)"
    done
    python3 - "$log" <<'PY' | tee -a "$SUMMARY"
import sys, statistics, collections
rows = collections.defaultdict(list); kern = {}
for l in open(sys.argv[1]):
    t, k, m, ms, name = l.rstrip('\n').split('|')
    if ms != 'NA': rows[(t, k, m)].append(float(ms))
    kern[(t, k, m)] = name
med = {key: statistics.median(v) for key, v in rows.items()}
print('| mask | call | base ms | branch ms | base / branch | base cost | branch cost | instance (branch) |')
print('|---|---|---|---|---|---|---|---|')
for k in ('-mask=0', '-mask=t'):
    for m in dict.fromkeys(mm for (t, kk, mm) in med if kk == k):
        plain = m.split()[0]  # the plain call of the same s_k
        b, r = med.get(('base', k, m)), med.get(('branch', k, m))
        pb, pr = med.get(('base', k, plain)), med.get(('branch', k, plain))
        f = lambda x: f'{x:.3f}' if x else '-'
        c = lambda x, p: f'{100 * (x / p - 1):+.1f} %' if x and p and m != plain else '-'
        print(f'| {"causal" if k == "-mask=t" else "none"} | {m} | {f(b)} | {f(r)} | '
              f'{f(b / r) if b and r else "-"} | {c(b, pb)} | {c(r, pr)} | {kern.get(("branch", k, m), "")} |')
PY
    note "time done at $(since)"
}

[ $# -eq 0 ] && set -- all
for ph in "$@"; do
    case $ph in
        build) phase_build ;;
        correct) phase_correct ;;
        time) phase_time ;;
        all) phase_build; phase_correct; phase_time ;;
        *) echo "unknown phase $ph (build, correct, time, all)" >&2; exit 2 ;;
    esac
done
