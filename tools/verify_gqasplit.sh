#!/usr/bin/env bash
# Branch gqasplit (the Hopper backward shares a kv group's query heads over several CTAs where the unsplit grid
# leaves SMs idle: csrc/kernels/hopper/bwd_gqa_split.h, the split twin HopperBwdKernelSplitImpl and its
# store_partial in fmha_bwd_hopper_kernel.hpp, reduce_dkv_kernel in fmha_bwd_hopper_aux.hpp, BwdKernel::run / layout
# in fmha_bwd_hopper.cuh), verified on an H200 against main. Never run on a GPU when written (compile-only session):
# the correct phase is the first real test of the split's numerics.
#
# From the repository root of the branch's tree (the device copy), with the base tree (an export of main at the
# branch's start, e.g. `git archive 516e05b | tar -x -C base`) carried in a directory of its own:
#
#   PYTHONPATH=/tmp/site BASE=/path/to/base bash tools/verify_gqasplit.sh build
#   PYTHONPATH=/tmp/site BASE=/path/to/base bash tools/verify_gqasplit.sh correct
#   PYTHONPATH=/tmp/site BASE=/path/to/base bash tools/verify_gqasplit.sh time
#
# (each phase under 8 minutes on 16 cores; `all` runs them in order; a build cut off by its timeout resumes where it
# stopped when run again: ninja keeps the objects). The CUTLASS headers come from the nvidia-cutlass wheel that the
# caller installed into /tmp/site (on PYTHONPATH; the script puts each tree's root in front). Build outputs of both
# trees go under $VDIR (default /tmp/gqasplit_verify), never into $BASE or this tree; logs and summary.txt go to $OUT
# (default $VDIR/logs; on the device machine pass its $OUT to get them back). At most 8 files land in $OUT:
# summary.txt, build.log, correct.log, memcheck.log, time.log, cases.txt, gpu.txt.
#
# Phases:
#   build    both trees at once, each: compile.py --api fwd (the forward instances benchmark_mha_bwd's forward call
#            needs) then --api bwd --benchmark, -j $JOBS (default 8) each, the bf16 Hopper instances of the filters
#            below (d128 batch / group, mask / nmask, plain and "_mods"; d64 batch and group mask; d256 and (192, 128)
#            batch). libmha_fwd.so, libmha_bwd.so and benchmark_mha_bwd in $VDIR/<tree>/lib. The branch's
#            instances compile one more main kernel (the split twin of the generic kernel) and reduce_dkv_kernel.
#   correct  host-validated runs (benchmark_mha_bwd -prec=bf16 -v=1 -kname=1) on both trees, 10 at a time: calls
#            that split on the H200 (b = 1 with one or two kv heads: 2 to 16 CTAs per kv group) with every mask kind,
#            odd and short key lengths, bottom-right with s_k > s_q (keys no query sees), group mode with empty
#            sequences, deterministic (-v=1 runs the backward twice and requires bitwise-identical dQ / dK / dV),
#            d != d_v, d64 / d256 / (192, 128), the modifiers (bias with dbias, ALiBi, soft-cap, sink with d sink,
#            dropout); and calls that do not split (MHA, b = 4 32/8) as a control. Every line must say valid:y on the
#            branch; the summary lists the branch's failures and each case whose verdict differs between the trees.
#            Then compute-sanitizer memcheck on 3 split cases (one deterministic, one group mode, one with dbias).
#   time     benchmark_mha_bwd -prec=bf16 -warmup=10 -repeat=30 -v=0, base and branch interleaved, $REPS rounds
#            (default 3): b1 h16 s4096 d128 with h_k 1 / 2 / 4 / 16, none and causal; b4 h32 h_k8 s4096 d128 (must
#            not move: 1024 CTAs, unsplit); d64 and d256 b1 h16 h_k1 / 2 s4096 causal. A table of medians (ms), base /
#            branch, and the split count the rule gives on 132 SMs. Predicted (the wave model, not measured): b1 h16
#            h_k2 s4096 d128 none 1.08 -> about 0.56 ms (s = 2: 128 CTAs of four heads each, plus ~20 us of slot
#            writes and the reduction), h_k1 about 2 -> 0.55 ms (s = 4), h_k4 / h_k16 / b4 unchanged.
set -u
cd "$(dirname "$0")/.."
BR=$(pwd)
BASE=${BASE:-}
VDIR=${VDIR:-/tmp/gqasplit_verify}
OUT=${OUT:-$VDIR/logs}
JOBS=${JOBS:-8}
REPS=${REPS:-3}
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
exe() { echo "$VDIR/$1/lib/benchmark_mha_bwd"; }

BWD_FILTER='bwd_d128_bf16_*_sm90a_hopper*,bwd_d64_bf16_batch_*_sm90a_hopper*,bwd_d64_bf16_group_mask_sm90a_hopper*'
BWD_FILTER+=',bwd_d256_bf16_batch_*mask_sm90a_hopper*,bwd_d256_bf16_batch_mask_mods_sm90a_hopper*'
BWD_FILTER+=',bwd_d192x128_bf16_batch_*_sm90a_hopper*'
FWD_FILTER='fwd_d128_bf16_*_sm90a_hopper*,fwd_d64_bf16_batch_*_sm90a_hopper*,fwd_d64_bf16_group_mask_sm90a_hopper*'
FWD_FILTER+=',fwd_d256_bf16_batch_*_sm90a_hopper*,fwd_d192x128_bf16_batch_*_sm90a_hopper*'

# ---- build ---------------------------------------------------------------------------------------------------------
build_tree() {  # tree
    local t=$1 tree lib api filter rc
    tree=$(dir_of "$t")
    lib=$VDIR/$t/lib
    mkdir -p "$lib"
    local t1=$(date +%s)
    : >"$VDIR/build_$t.log"
    for api in fwd bwd; do
        local args=(--api "$api" --arch sm_90a --filter "$FWD_FILTER" -j "$JOBS" --build-dir "$VDIR/$t/obj")
        [ "$api" = bwd ] && args=(--api bwd --arch sm_90a --filter "$BWD_FILTER" --benchmark -j "$JOBS"
                                  --build-dir "$VDIR/$t/obj")
        (cd "$lib" && PYTHONPATH="$tree:$SITE${PYTHONPATH:+:$PYTHONPATH}" timeout 450 python3 "$tree/compile.py" \
            "${args[@]}") >>"$VDIR/build_$t.log" 2>&1
        rc=$?
        echo "$api rc=$rc wall=$(( $(date +%s) - t1 )) s" >>"$VDIR/build_$t.log"
        [ $rc -eq 0 ] || break
    done
}
phase_build() {
    nvidia-smi --query-gpu=name,driver_version,multiprocessor_count --format=csv,noheader >"$OUT/gpu.txt" 2>&1 ||
        nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >"$OUT/gpu.txt" 2>&1
    note "== verify_gqasplit build: branch $(git -C "$BR" rev-parse --short HEAD 2>/dev/null || echo '(no git)'), base ${BASE:-none}; $(head -1 "$OUT/gpu.txt")"
    local t
    for t in "${trees[@]}"; do build_tree "$t" & done
    wait
    : >"$OUT/build.log"
    for t in "${trees[@]}"; do
        { echo "==== $t"; tail -40 "$VDIR/build_$t.log"; } >>"$OUT/build.log"
        note "build $t: $(grep -E '^(fwd|bwd) rc=' "$VDIR/build_$t.log" | tr '\n' ' '), exe $( [ -x "$(exe "$t")" ] && echo ok || echo MISSING)"
    done
    note "build done at $(since)"
}

# ---- correct -------------------------------------------------------------------------------------------------------
CASES=(
    # split on 132 SMs (b = 1, few kv heads), d128 key split
    "-b=1 -h=16 -h_k=2 -s=1031 -mask=0"
    "-b=1 -h=16 -h_k=2 -s=1031 -mask=t"
    "-b=1 -h=8 -h_k=1 -s=777 -s_k=1531 -mask=b"
    "-b=1 -h=8 -h_k=1 -s=1531 -s_k=777 -mask=b"
    "-b=1 -h=12 -h_k=2 -s=500 -s_k=77 -mask=t:100,40"
    "-b=1 -h=8 -h_k=1 -s=64 -s_k=100 -mask=b:4,35"
    "-b=1 -h=6 -h_k=1 -s=900 -s_k=1000 -mask=xb:96"
    "-b=2 -h=8 -h_k=1 -s=129 -s_k=2000 -mask=b"
    "-b=1 -h=4 -h_k=1 -s=300 -s_k=400 -d=128 -d_v=64 -mask=t"
    "-b=1 -h=16 -h_k=1 -s=1100 -mask=0 -deterministic=1"
    "-b=1 -h=8 -h_k=2 -s=700 -s_k=1500 -mask=b -deterministic=1"
    # group mode: empty sequences on either side, key blocks past short sequences
    "-mode=1 -b=4 -h=8 -h_k=1 -s=300,0,129,517 -s_k=257,64,0,1000 -mask=b"
    "-mode=1 -b=3 -h=8 -h_k=2 -s=700,1,90 -s_k=650,33,0 -mask=t -deterministic=1"
    "-mode=1 -b=2 -h=6 -h_k=1 -d=64 -s=1000,129 -s_k=257,1100 -mask=t"
    # other layouts: d64 key split, d256 query split (deterministic: the turn keeper), (192, 128) swapped key split
    "-b=1 -h=16 -h_k=2 -d=64 -s=1031 -mask=t"
    "-b=1 -h=16 -h_k=1 -d=256 -s=900 -s_k=700 -mask=1"
    "-b=1 -h=12 -h_k=2 -d=256 -s=900 -s_k=700 -mask=0 -deterministic=1"
    "-b=1 -h=8 -h_k=2 -d=192 -d_v=128 -s=500 -s_k=513 -mask=b"
    "-b=1 -h=8 -h_k=1 -d=192 -d_v=128 -s=600 -s_k=777 -mask=t:128,30 -deterministic=1"
    # the "_mods" instances' generic kernel's split twin: dbias per query head, d sink, soft-cap, ALiBi, dropout
    "-b=1 -h=8 -h_k=1 -s=300 -s_k=333 -mask=t -bias=e -dbias=1"
    "-b=1 -h=8 -h_k=1 -s=300 -s_k=333 -mask=b -bias=e:1 -dbias=1 -sink=1"
    "-b=1 -h=8 -h_k=1 -s=300 -s_k=333 -mask=0 -logits_soft_cap=30 -bias=a"
    "-b=1 -h=8 -h_k=2 -s=700 -s_k=900 -mask=b -bias=a:1 -sink=1 -deterministic=1"
    "-b=1 -h=6 -h_k=1 -s=333 -s_k=257 -mask=t -p_drop=0.2 -drop_seed=3 -drop_offset=9"
    "-mode=1 -b=3 -h=8 -h_k=1 -s=100,0,37 -s_k=64,19,0 -mask=b -bias=e -dbias=1"
    "-b=1 -h=8 -h_k=1 -d=64 -s=300 -s_k=333 -mask=t -logits_soft_cap=20 -bias=e:2 -dbias=1"
    "-b=1 -h=16 -h_k=1 -d=256 -s=300 -s_k=333 -mask=t -bias=e -dbias=1 -sink=1"
    # controls that do not split: MHA, a full grid
    "-b=1 -h=8 -s=1031 -mask=t"
    "-b=4 -h=32 -h_k=8 -s=512 -mask=0"
)
one_case() {  # tree args -> one line: VALID|INVALID|NOTRUN <instance> <args>
    local t=$1 args=$2 line kern d=-d=128
    [[ "$args" == *"-d="* ]] && d=
    # shellcheck disable=SC2086
    line=$(timeout 300 "$(exe "$t")" -prec=bf16 $d -v=1 -kname=1 -warmup=0 -repeat=1 $args 2>&1)
    kern=$(echo "$line" | grep -o 'bwd_d[0-9a-z_]*' | head -1)
    if echo "$line" | grep -q 'valid:y'; then echo "VALID   ${kern:-?} | $args"
    elif echo "$line" | grep -q 'valid:n'; then echo "INVALID ${kern:-?} | $args | $(echo "$line" | grep -iv 'valid' | tail -3 | tr '\n' ' ' | cut -c1-300)"
    else echo "NOTRUN  ${kern:-?} | $args | $(echo "$line" | tail -2 | tr '\n' ' ' | cut -c1-200)"; fi
}
export -f one_case exe
export VDIR
phase_correct() {
    local t
    printf '%s\n' "${CASES[@]}" >"$OUT/cases.txt"
    : >"$OUT/correct.log"
    for t in "${trees[@]}"; do
        [ -x "$(exe "$t")" ] || { note "correct $t: no benchmark_mha_bwd (run the build phase)"; continue; }
        tr '\n' '\0' <"$OUT/cases.txt" | xargs -0 -P 10 -I{} bash -c 'one_case "$0" "$1"' "$t" {} \
            | LC_ALL=C sort -t'|' -k2,2 >"$VDIR/correct_$t.log"
        { echo "==== $t"; cat "$VDIR/correct_$t.log"; } >>"$OUT/correct.log"
        note "correct $t: $(grep -c '^VALID' "$VDIR/correct_$t.log") valid, $(grep -c '^INVALID' "$VDIR/correct_$t.log") invalid, $(grep -c '^NOTRUN' "$VDIR/correct_$t.log") not run, of ${#CASES[@]} at $(since)"
    done
    grep -v '^VALID' "$VDIR/correct_branch.log" 2>/dev/null | sed 's/^/  branch: /' | head -40 | tee -a "$SUMMARY"
    if [ -f "$VDIR/correct_base.log" ] && [ -f "$VDIR/correct_branch.log" ]; then
        LC_ALL=C join -t'|' -j2 \
            <(awk -F'|' '{split($1,a," "); print a[1] "|" $2}' "$VDIR/correct_base.log" | LC_ALL=C sort -t'|' -k2,2) \
            <(awk -F'|' '{split($1,a," "); print a[1] "|" $2}' "$VDIR/correct_branch.log" | LC_ALL=C sort -t'|' -k2,2) \
            | awk -F'|' '$2 != $3 {print "  differs: base " $2 ", branch " $3 " |" $1}' | tee -a "$SUMMARY"
    fi
    : >"$OUT/memcheck.log"
    if command -v compute-sanitizer >/dev/null && [ -x "$(exe branch)" ]; then
        local i=0 c
        for c in "-b=1 -h=8 -h_k=1 -s=700 -s_k=1500 -mask=b -deterministic=1" \
                 "-mode=1 -b=4 -h=8 -h_k=1 -s=300,0,129,517 -s_k=257,64,0,1000 -mask=t" \
                 "-b=1 -h=8 -h_k=2 -d=256 -s=300 -s_k=333 -mask=b -bias=e -dbias=1 -sink=1"; do
            i=$((i + 1))
            local d=-d=128
            [[ "$c" == *"-d="* ]] && d=
            # shellcheck disable=SC2086
            timeout 280 compute-sanitizer --tool memcheck --error-exitcode 99 "$(exe branch)" -prec=bf16 $d -v=1 \
                -kname=1 -warmup=0 -repeat=1 $c >"$VDIR/memcheck_$i.log" 2>&1
            local rc=$?
            { echo "==== memcheck $i: $c (rc=$rc)"; tail -30 "$VDIR/memcheck_$i.log"; } >>"$OUT/memcheck.log"
            note "memcheck $i ($c): rc=$rc, $(grep -o 'ERROR SUMMARY: [0-9]* errors*' "$VDIR/memcheck_$i.log" | head -1), $(grep -o 'valid:[yn]' "$VDIR/memcheck_$i.log" | head -1)"
        done
    else
        note "memcheck: no compute-sanitizer or no branch benchmark"
    fi
    note "correct done at $(since)"
}

# ---- time ----------------------------------------------------------------------------------------------------------
TROWS=(
    "-b=1 -h=16 -h_k=1 -s=4096 -d=128 -mask=0"
    "-b=1 -h=16 -h_k=2 -s=4096 -d=128 -mask=0"
    "-b=1 -h=16 -h_k=4 -s=4096 -d=128 -mask=0"
    "-b=1 -h=16 -h_k=16 -s=4096 -d=128 -mask=0"
    "-b=1 -h=16 -h_k=1 -s=4096 -d=128 -mask=t"
    "-b=1 -h=16 -h_k=2 -s=4096 -d=128 -mask=t"
    "-b=1 -h=16 -h_k=4 -s=4096 -d=128 -mask=t"
    "-b=1 -h=16 -h_k=16 -s=4096 -d=128 -mask=t"
    "-b=4 -h=32 -h_k=8 -s=4096 -d=128 -mask=0"
    "-b=4 -h=32 -h_k=8 -s=4096 -d=128 -mask=t"
    "-b=1 -h=16 -h_k=1 -s=4096 -d=64 -mask=t"
    "-b=1 -h=16 -h_k=2 -s=4096 -d=64 -mask=t"
    "-b=1 -h=16 -h_k=1 -s=4096 -d=256 -mask=t"
    "-b=1 -h=16 -h_k=2 -s=4096 -d=256 -mask=t"
)
phase_time() {
    local rep t r line ms log=$VDIR/time_raw.txt
    : >"$log"
    for rep in $(seq 1 "$REPS"); do
        for r in "${TROWS[@]}"; do
            for t in "${trees[@]}"; do
                [ -x "$(exe "$t")" ] || continue
                # shellcheck disable=SC2086
                line=$(timeout 120 "$(exe "$t")" -prec=bf16 -warmup=10 -repeat=30 -v=0 -kname=1 $r 2>&1 | grep ' ms' | tail -1)
                ms=$(echo "$line" | grep -o '[0-9.]* ms' | head -1 | cut -d' ' -f1)
                echo "$t|$r|${ms:-NA}|$(echo "$line" | grep -o 'bwd_d[0-9a-z_]*' | head -1)" >>"$log"
            done
        done
        note "time round $rep done at $(since)"
    done
    cp "$log" "$OUT/time.log"
    python3 - "$log" <<'PY' | tee -a "$SUMMARY"
import re, sys, statistics, collections
rows = collections.defaultdict(list); kern = {}
for l in open(sys.argv[1]):
    t, r, ms, name = l.rstrip('\n').split('|')
    if ms != 'NA': rows[(t, r)].append(float(ms))
    kern[r] = name or kern.get(r, '')
med = {key: statistics.median(v) for key, v in rows.items()}

def split(r):  # bwd_gqa_split.h on 132 SMs (tile: d128 / d64 64 x 128, d256 64 x 64)
    a = dict(re.findall(r'-([a-z_]+)=([0-9a-z:,]+)', r))
    b, h, hk, s, d = int(a['b']), int(a['h']), int(a.get('h_k', a['h'])), int(a['s']), int(a['d'])
    bn = 64 if d == 256 else 128
    ctas, g, m = -(-s // bn) * hk * b, h // hk, -(-s // 64)
    cands = [x for x in range(1, g + 1) if g % x == 0 and (x == 1 or ctas * x <= 264)]
    cost = lambda x: -(-ctas * x // 132) * (g // x * m + 2)
    return min(cands, key=lambda x: (cost(x), x))

print('| row | base ms | branch ms | base / branch | split | instance |')
print('|---|---|---|---|---|---|')
for r in dict.fromkeys(r for (_, r) in med):
    b, n = med.get(('base', r)), med.get(('branch', r))
    f = lambda x: f'{x:.3f}' if x else '-'
    print(f'| {r} | {f(b)} | {f(n)} | {f(b / n) if b and n else "-"} | {split(r)} | {kern.get(r, "")} |')
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
