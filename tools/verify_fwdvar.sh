#!/usr/bin/env bash
# Branch fwdvar (the forward "_mods" instances launch a fixed soft-cap or ALiBi main kernel, chosen on the host:
# FwdModVar / fwd_mod_variant in csrc/kernels/hopper/fmha_hopper_kernel.hpp, FwdKernel::builds / run in
# fmha_fwd_hopper.cuh; the ALiBi kernel adds the term with one FFMA per score off the diagonal, its rows' part going
# to the softmax: apply_alibi_folding, OnlineSoftmax::update<., kOff>), verified on an H200 against main. Never run on
# a GPU when written (compile-only session): the correct phase is the first real test of the folded ALiBi numerics.
#
# From the repository root of the branch's tree (the device copy), with the base tree (an export of main at the
# branch's start, e.g. `git archive main | tar -x -C base`) carried in a directory of its own:
#
#   PYTHONPATH=/tmp/site BASE=/path/to/base bash tools/verify_fwdvar.sh build
#   PYTHONPATH=/tmp/site BASE=/path/to/base bash tools/verify_fwdvar.sh correct
#   PYTHONPATH=/tmp/site BASE=/path/to/base bash tools/verify_fwdvar.sh time kernels
#
# (each phase well under 10 minutes on 16 cores; `all` runs every phase in order). The CUTLASS headers come from the
# nvidia-cutlass wheel that the caller installed into /tmp/site: compile.py must see it on PYTHONPATH (the script
# adds each tree's own root in front). Build outputs of both trees go under $VDIR (default /tmp/fwdvar_verify), never
# into $BASE or this tree, whose device copies may be replaced between calls; logs and summary.txt go to $OUT
# (default $VDIR/logs; on the device machine pass its $OUT to get them back).
#
# Phases:
#   build    both trees at once (-j $JOBS each, default 8), compile.py --api fwd --benchmark with the filter below:
#            the d128 bf16 Hopper instances (batch / group, mask / nmask, plain and "_mods"), the d64 and d256 bf16
#            batch ones (plain mask / nmask, "_mods" mask): libmha_fwd.so + benchmark_mha_fwd in $VDIR/<tree>/lib.
#            The build log's wall time per tree is in the summary (the branch's "_mods" instances compile two more
#            main kernels each: about +4 s of nvcc per instance on 2 cores).
#   correct  host-validated runs (benchmark_mha_fwd -prec=bf16 -v=1 -lse=1 -kname=1) on both trees: modifier sets
#            (soft-cap, ALiBi [h] and [b, h], elementwise bias e / e:2 (unaligned rows: s_k odd, and a staged one),
#            soft-cap with ALiBi or bias (generic kernel), sinks with and without soft-cap / ALiBi, dropout + soft-cap)
#            x masks (0, b, t, t:64,10, b:4,35, xb:96) x shapes (odd lengths, GQA -h_k, group mode with empty
#            sequences -mode=1 -s=100,0,37 -s_k=64,19,0), plus d64 / d256 and a staged-bias shape; 10 at a time.
#            Every line must say valid:y on the branch; the summary lists the branch's failures and every case whose
#            verdict differs between the trees. Then compute-sanitizer memcheck on 3 branch cases.
#   time     benchmark_mha_fwd -prec=bf16 $TARGS -warmup=10 -repeat=30 -v=0 (TARGS default -b=1 -h=16 -s=4096
#            -d=128), base and branch interleaved, $REPS rounds (default 3), for: plain, -logits_soft_cap=30, -bias=a,
#            -bias=e (staged), -sink=1, soft-cap + ALiBi, each unmasked (-mask=0) and causal (-mask=t); a table of
#            medians (ms), base / branch, and each tree's modifier cost against its plain call. Expected from the
#            SASS (no GPU run yet): soft-cap and ALiBi faster on the branch (a full tile's path 632 -> 598 and
#            629 -> 568 instructions per consumer thread; the soft-cap stays MUFU-bound), the other rows ~1.00 (same
#            kernels on both trees).
#   kernels  which main kernel ran (ncu, mangled names; skipped without ncu): soft-cap alone and with a sink ->
#            HopperFwdKernelModsVarImpl<..., 3>, ALiBi -> <..., 5>, bias e, soft-cap + ALiBi, dropout -> the generic
#            HopperFwdKernelModsImpl; base: always HopperFwdKernelModsImpl.
set -u
cd "$(dirname "$0")/.."
BR=$(pwd)
BASE=${BASE:-}
VDIR=${VDIR:-/tmp/fwdvar_verify}
OUT=${OUT:-$VDIR/logs}
JOBS=${JOBS:-8}
REPS=${REPS:-3}
TARGS=${TARGS:--b=1 -h=16 -s=4096 -d=128}  # the timed shape (issue 12 measured b=4: TARGS="-b=4 -h=16 -s=4096 -d=128")
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
exe() { echo "$VDIR/$1/lib/benchmark_mha_fwd"; }

FILTER='fwd_d128_bf16_*_sm90a_hopper,fwd_d64_bf16_batch_*mask_sm90a_hopper,fwd_d64_bf16_batch_mask_mods_sm90a_hopper'
FILTER+=',fwd_d256_bf16_batch_*mask_sm90a_hopper,fwd_d256_bf16_batch_mask_mods_sm90a_hopper'
FILTER=${FWDVAR_FILTER:-$FILTER}

# ---- build ---------------------------------------------------------------------------------------------------------
build_tree() {  # tree
    local t=$1 tree lib
    tree=$(dir_of "$t")
    lib=$VDIR/$t/lib
    mkdir -p "$lib"
    local t1=$(date +%s)
    (cd "$lib" && PYTHONPATH="$tree:$SITE${PYTHONPATH:+:$PYTHONPATH}" timeout 560 python3 "$tree/compile.py" \
        --api fwd --arch sm_90a --filter "$FILTER" --benchmark -j "$JOBS" --build-dir "$VDIR/$t/obj") \
        >"$OUT/build_$t.log" 2>&1
    echo "rc=$? wall=$(( $(date +%s) - t1 )) s" >>"$OUT/build_$t.log"
}
phase_build() {
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >"$OUT/gpu.txt" 2>&1
    note "== verify_fwdvar build: branch $(git -C "$BR" rev-parse --short HEAD 2>/dev/null || echo '(no git)'), base ${BASE:-none}; $(head -1 "$OUT/gpu.txt")"
    local t
    for t in "${trees[@]}"; do build_tree "$t" & done
    wait
    for t in "${trees[@]}"; do
        note "build $t: $(tail -1 "$OUT/build_$t.log"), $(grep -c 'gen/instances/' "$OUT/build_$t.log") instance compiles, exe $( [ -x "$(exe "$t")" ] && echo ok || echo MISSING)"
    done
    note "build done at $(since)"
}

# ---- correct -------------------------------------------------------------------------------------------------------
MODS=(
    "-logits_soft_cap=30"
    "-bias=a"
    "-bias=a:1"
    "-bias=e"
    "-bias=e:2"
    "-logits_soft_cap=30 -bias=a"
    "-logits_soft_cap=20 -bias=e:2"
    "-logits_soft_cap=30 -sink=1"
    "-bias=a -sink=1"
    "-sink=1"
)
MASKS=("-mask=0" "-mask=b" "-mask=t" "-mask=t:64,10" "-mask=b:4,35" "-mask=xb:96")
SHAPES=(
    "-b=2 -h=4 -s=300 -s_k=517"
    "-b=1 -h=8 -h_k=2 -s=1000 -s_k=777"
    "-mode=1 -b=3 -h=4 -s=100,0,37 -s_k=64,19,0"
)
EXTRA=(
    "-b=2 -h=4 -s=256 -s_k=512 -mask=0 -bias=e"             # a staged bias (rows 16-byte aligned): generic kernel
    "-b=2 -h=4 -s=256 -s_k=512 -mask=t -bias=e:2"
    "-b=2 -h=4 -s=256 -s_k=512 -mask=t -logits_soft_cap=30 -bias=e"
    "-b=2 -h=4 -s=300 -s_k=517 -mask=t -logits_soft_cap=30 -p_drop=0.2"  # dropout: generic kernel
    "-b=2 -h=4 -s=300 -s_k=517 -mask=0 -bias=a -p_drop=0.1"
    "-d=64 -b=2 -h=4 -s=1000 -s_k=777 -mask=t -logits_soft_cap=30"
    "-d=64 -b=2 -h=4 -h_k=1 -s=1000 -s_k=777 -mask=0 -bias=a"
    "-d=256 -b=2 -h=4 -s=300 -s_k=517 -mask=b -logits_soft_cap=30"
    "-d=256 -b=2 -h=4 -h_k=2 -s=300 -s_k=517 -mask=t -bias=a:1"
    "-b=1 -h=2 -s=1 -s_k=333 -mask=b -bias=a"
    "-b=1 -h=2 -s=129 -s_k=1 -mask=0 -logits_soft_cap=50"
)
one_case() {  # tree args -> one line: VALID|INVALID|NOTRUN <instance> <args>
    local t=$1 args=$2 line kern d=-d=128
    [[ "$args" == *"-d="* ]] && d=
    # shellcheck disable=SC2086
    line=$(timeout 300 "$(exe "$t")" -prec=bf16 $d -v=1 -lse=1 -kname=1 -warmup=0 -repeat=1 $args 2>&1)
    kern=$(echo "$line" | grep -o 'fwd_d[0-9a-z_]*' | head -1)
    if echo "$line" | grep -q 'valid:y'; then echo "VALID   ${kern:-?} | $args"
    elif echo "$line" | grep -q 'valid:n'; then echo "INVALID ${kern:-?} | $args"
    else echo "NOTRUN  ${kern:-?} | $args | $(echo "$line" | tail -2 | tr '\n' ' ' | cut -c1-200)"; fi
}
export -f one_case exe
export VDIR
phase_correct() {
    local cases=() m k s t
    for m in "${MODS[@]}"; do for k in "${MASKS[@]}"; do for s in "${SHAPES[@]}"; do cases+=("$s $k $m"); done; done; done
    cases+=("${EXTRA[@]}")
    printf '%s\n' "${cases[@]}" >"$OUT/cases.txt"
    for t in "${trees[@]}"; do
        [ -x "$(exe "$t")" ] || { note "correct $t: no benchmark_mha_fwd (run the build phase)"; continue; }
        # 10 at a time: the CPU reference sets the pace
        tr '\n' '\0' <"$OUT/cases.txt" | xargs -0 -P 10 -I{} bash -c 'one_case "$0" "$1"' "$t" {} \
            | LC_ALL=C sort -t'|' -k2,2 >"$OUT/correct_$t.log"
        note "correct $t: $(grep -c '^VALID' "$OUT/correct_$t.log") valid, $(grep -c '^INVALID' "$OUT/correct_$t.log") invalid, $(grep -c '^NOTRUN' "$OUT/correct_$t.log") not run, of ${#cases[@]} at $(since)"
    done
    grep -v '^VALID' "$OUT/correct_branch.log" 2>/dev/null | sed 's/^/  branch: /' | head -40 | tee -a "$SUMMARY"
    if [ -f "$OUT/correct_base.log" ] && [ -f "$OUT/correct_branch.log" ]; then
        # verdicts that differ between the trees (the instance names are the same on both)
        LC_ALL=C join -t'|' -j2 \
            <(awk -F'|' '{split($1,a," "); print a[1] "|" $2}' "$OUT/correct_base.log" | LC_ALL=C sort -t'|' -k2,2) \
            <(awk -F'|' '{split($1,a," "); print a[1] "|" $2}' "$OUT/correct_branch.log" | LC_ALL=C sort -t'|' -k2,2) \
            | awk -F'|' '$2 != $3 {print "  differs: base " $2 ", branch " $3 " |" $1}' | tee -a "$SUMMARY"
    fi
    if command -v compute-sanitizer >/dev/null && [ -x "$(exe branch)" ]; then
        local i=0 c
        for c in "-b=1 -h=8 -h_k=2 -s=1000 -s_k=777 -mask=t -logits_soft_cap=30" \
                 "-mode=1 -b=3 -h=4 -s=100,0,37 -s_k=64,19,0 -mask=b -bias=a:1" \
                 "-b=2 -h=4 -s=300 -s_k=517 -mask=xb:96 -bias=a -sink=1"; do
            i=$((i + 1))
            # shellcheck disable=SC2086
            timeout 280 compute-sanitizer --tool memcheck --error-exitcode 99 "$(exe branch)" -prec=bf16 -d=128 -v=1 \
                -kname=1 -warmup=0 -repeat=1 $c >"$OUT/memcheck_$i.log" 2>&1
            note "memcheck $i ($c): rc=$?, $(grep -o 'ERROR SUMMARY: [0-9]* errors*' "$OUT/memcheck_$i.log" | head -1), $(grep -o 'valid:[yn]' "$OUT/memcheck_$i.log" | head -1)"
        done
    fi
    note "correct done at $(since)"
}

# ---- time ----------------------------------------------------------------------------------------------------------
TMODS=("" "-logits_soft_cap=30" "-bias=a" "-bias=e" "-sink=1" "-logits_soft_cap=30 -bias=a")
phase_time() {
    local rep t k m line ms log=$OUT/time_raw.txt
    : >"$log"
    for rep in $(seq 1 "$REPS"); do
        for k in "-mask=0" "-mask=t"; do
            for m in "${TMODS[@]}"; do
                for t in "${trees[@]}"; do
                    [ -x "$(exe "$t")" ] || continue
                    # shellcheck disable=SC2086
                    line=$(timeout 120 "$(exe "$t")" -prec=bf16 $TARGS -warmup=10 -repeat=30 -v=0 -kname=1 $k $m 2>&1 \
                        | grep ' ms' | tail -1)
                    ms=$(echo "$line" | grep -o '[0-9.]* ms' | head -1 | cut -d' ' -f1)
                    echo "$t|$k|${m:-plain}|${ms:-NA}|$(echo "$line" | grep -o 'fwd_d[0-9a-z_]*' | head -1)" >>"$log"
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
print('| mask | modifiers | base ms | branch ms | base / branch | base cost | branch cost | instance |')
print('|---|---|---|---|---|---|---|---|')
for k in ('-mask=0', '-mask=t'):
    mods = [m for (t, kk, m) in med if kk == k and t == 'branch'] or [m for (t, kk, m) in med if kk == k]
    for m in dict.fromkeys(mods):
        b, r = med.get(('base', k, m)), med.get(('branch', k, m))
        pb, pr = med.get(('base', k, 'plain')), med.get(('branch', k, 'plain'))
        f = lambda x: f'{x:.3f}' if x else '-'
        c = lambda x, p: f'{100 * (x / p - 1):+.1f} %' if x and p else '-'
        print(f'| {"causal" if k == "-mask=t" else "none"} | {m} | {f(b)} | {f(r)} | '
              f'{f(b / r) if b and r else "-"} | {c(b, pb)} | {c(r, pr)} | {kern.get(("branch", k, m), "")} |')
PY
    note "time done at $(since)"
}

# ---- kernels -------------------------------------------------------------------------------------------------------
phase_kernels() {
    command -v ncu >/dev/null || { note "kernels: no ncu"; return; }
    local t c want got log
    for t in "${trees[@]}"; do
        for c in "-logits_soft_cap=30|ModsVarImpl.*Li3EEEEEv" "-logits_soft_cap=30 -sink=1|ModsVarImpl.*Li3EEEEEv" \
                 "-bias=a|ModsVarImpl.*Li5EEEEEv" "-bias=a:1 -sink=1|ModsVarImpl.*Li5EEEEEv" \
                 "-bias=e|HopperFwdKernelModsImplI" "-logits_soft_cap=30 -bias=a|HopperFwdKernelModsImplI" \
                 "-logits_soft_cap=30 -p_drop=0.1|HopperFwdKernelModsImplI"; do
            want=${c#*|}
            [ "$t" = base ] && want=HopperFwdKernelModsImplI
            log=$OUT/ncu_${t}_$(echo "${c%%|*}" | tr -c 'a-z0-9' '_').log
            # shellcheck disable=SC2086
            timeout 120 ncu --kernel-name-base mangled --print-kernel-base mangled --metrics gpu__time_duration.sum -k regex:HopperFwd \
                "$(exe "$t")" -prec=bf16 -b=1 -h=4 -s=512 -d=128 -mask=t -v=0 -warmup=0 -repeat=1 ${c%%|*} >"$log" 2>&1
            got=$(grep -o '_ZN7cutlass13device_kernelIN6mhakit6hopper[A-Za-z0-9_]*' "$log" | sort -u | head -2 | tr '\n' ' ')
            if echo "$got" | grep -Eq "$want"; then note "kernel $t ${c%%|*}: ok"; else note "kernel $t ${c%%|*}: WRONG (want $want) got ${got:-none}"; fi
        done
    done
}

[ $# -eq 0 ] && set -- all
for ph in "$@"; do
    case $ph in
        build) phase_build ;;
        correct) phase_correct ;;
        time) phase_time ;;
        kernels) phase_kernels ;;
        all) phase_build; phase_correct; phase_time; phase_kernels ;;
        *) echo "unknown phase $ph (build, correct, time, kernels, all)" >&2; exit 2 ;;
    esac
done
