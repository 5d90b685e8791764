#!/usr/bin/env bash
# d256 forward: the staged (TMA) bias ring at the cost of one K/V ring slot. Trees (each an export with compile.py):
#   base  = main (global-load bias at d256), head2 = ring 4 + 2 bias stages, head1 = ring 4 + 1 bias stage.
# OUT=... BASE=... HEAD2=... HEAD1=... bash verify_bias256.sh
set -uo pipefail
out=$OUT; mkdir -p "$out"; summary=$out/summary.txt; : >"$summary"
note() { echo "$1" >>"$summary"; echo "== $1"; }
t_all=$(date +%s)
elapsed() { echo "$(( $(date +%s) - $1 )) s"; }
left() { echo $(( ${LIMIT:-420} - ($(date +%s) - t_all) )); }
declare -A tree=([base]=$BASE [head2]=$HEAD2 [head1]=$HEAD1)
f_base='fwd_d256_bf16_batch_mask_sm90a_hopper,fwd_d256_bf16_batch_nmask_sm90a_hopper,fwd_d256_bf16_batch_mask_mods_sm90a_hopper,fwd_d256_bf16_group_mask_sm90a_hopper,fwd_d256_bf16_group_mask_mods_sm90a_hopper'
f_head="$f_base,fwd_d256_bf16_batch_nmask_mods_sm90a_hopper,fwd_d256_fp16_batch_mask_mods_sm90a_hopper"
build() {
    local name=$1 t=${tree[$1]} filter=$2 t0=$(date +%s)
    mkdir -p "$t/build/v/$name"
    (cd "$t/build/v/$name" && timeout 300 python3 "$t/compile.py" --api fwd --arch sm_90a --profile all \
        --filter "$filter" -j 6 --benchmark --build-dir "$t/build/v/obj") >"$out/build_$name.log" 2>&1
    note "build $name: rc=$? in $(elapsed "$t0"): $(tail -1 "$out/build_$name.log" | cut -c1-120)"
}
build base "$f_base" & build head2 "$f_head" & build head1 "$f_head" & wait
exe_of() { echo "${tree[$1]}/build/v/$1/benchmark_mha_fwd"; }
with_lib() { local n=$1; shift; LD_LIBRARY_PATH="${tree[$n]}/build/v/$n${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$@"; }
runs=(
    "d256_bf16_batch_mask_mods|-b=2 -h=4 -s=1000 -s_k=1000 -mask=t -bias=e"
    "d256_bf16_batch_mask_mods|-b=2 -h=4 -s=333 -s_k=520 -mask=b -bias=e:1"
    "d256_bf16_batch_mask_mods|-b=2 -h=4 -h_k=2 -s=257 -s_k=1000 -mask=b -bias=e:2 -logits_soft_cap=30"
    "d256_bf16_batch_mask_mods|-b=1 -h=8 -h_k=1 -s=777 -s_k=520 -mask=t:128,30 -bias=e:1 -sink=1"
    "d256_bf16_batch_mask_mods|-b=2 -h=3 -s=64 -s_k=520 -mask=g:30,100 -bias=e"
    "d256_bf16_batch_mask_mods|-b=2 -h=4 -s=129 -s_k=77 -mask=b:64,0 -bias=e:2 -logits_soft_cap=30 -sink=1"
    "d256_bf16_batch_mask_mods|-b=1 -h=4 -s=1025 -s_k=1000 -mask=b -bias=e:2"
    "d256_bf16_batch_mask_mods|-b=1 -h=2 -s=300 -s_k=4092 -mask=t -bias=e:1"
    "d256_bf16_batch_mask_mods|-b=2 -h=4 -s=1000 -s_k=1000 -mask=b -bias=a"
    "d256_bf16_batch_mask_mods|-b=2 -h=4 -s=1000 -s_k=1000 -mask=t -p_drop=0.2 -s_randval=1"
    "d256_bf16_batch_nmask_mods|-b=2 -h=4 -h_k=1 -s=1000 -s_k=520 -bias=e:1 -logits_soft_cap=30"
    "d256_bf16_group_mask_mods|-mode=1 -b=3 -h=4 -h_k=2 -s=1000,0,333 -s_k=1000,520,0 -mask=b -bias=e:2"
    "d256_bf16_group_mask_mods|-mode=1 -b=3 -h=4 -s=1024,1000,517 -s_k=1024,1000,520 -mask=t -bias=e:1 -logits_soft_cap=20 -sink=1"
    "d256_bf16_group_mask_mods|-mode=1 -b=2 -h=2 -s=300,2000 -s_k=500,1900 -mask=b -bias=e"
    "d256_bf16_group_mask_mods|-mode=1 -b=4 -h=2 -s=64,130,1,700 -s_k=128,64,520,1000 -mask=0 -bias=e:1 -sink=1"
    "d256_fp16_batch_mask_mods|-prec=fp16 -b=2 -h=4 -h_k=2 -s=1000 -s_k=1000 -mask=b -bias=e:1"
)
check_one() {
    local n=$1 i=$2 want=${3%%|*} args=${3#*|} log rc
    log=$out/check_${n}_$i.log
    with_lib "$n" timeout 100 "$(exe_of "$n")" -prec=bf16 -d=256 -v=1 -kname=1 -lse=1 -warmup=1 -repeat=2 $args >"$log" 2>&1
    rc=$?
    if [ $rc -eq 0 ] && grep -m1 'valid:' "$log" | grep -q 'valid:y' && grep -q "mha_fwd -> fwd_$want" "$log"; then
        echo "PASS $n check_$i $args"
    else
        echo "FAIL $n check_$i $args (rc=$rc): $(tail -2 "$log" | tr '\n' ' ' | cut -c1-300)"
    fi
}
t0=$(date +%s); : >"$out/checks.txt"
for n in head2 head1; do
    [ -x "$(exe_of $n)" ] || { note "MISSING $n"; continue; }
    with_lib $n timeout 150 compute-sanitizer --tool memcheck --error-exitcode 99 "$(exe_of $n)" -prec=bf16 -d=256 -v=1 -kname=1 -warmup=0 -repeat=1 -mode=1 -b=3 -h=2 -h_k=1 -s=300,0,129 -s_k=520,77,1000 -mask=b -bias=e:2 >"$out/memcheck_$n.log" 2>&1; echo "rc=$?" >>"$out/memcheck_$n.log" &
    i=0
    for spec in "${runs[@]}"; do
        check_one $n $i "$spec" >>"$out/checks.txt" &
        i=$((i + 1)); if (( i % 4 == 0 )); then wait -n; wait -n; fi
    done
done
wait
note "checks: $(grep -c '^PASS' "$out/checks.txt") PASS, $(grep -c '^FAIL' "$out/checks.txt") FAIL ($(elapsed $t0))"
grep '^FAIL' "$out/checks.txt" >>"$summary"
for n in head2 head1; do note "memcheck $n: $(grep -o 'ERROR SUMMARY: [0-9]* errors' "$out/memcheck_$n.log") $(tail -1 "$out/memcheck_$n.log") $(grep -o 'valid:[yn]' "$out/memcheck_$n.log" | head -1) $(grep -o 'fwd_d256[a-z0-9_]*' "$out/memcheck_$n.log" | head -1)"; done
variants=("plain|" "bias e|-bias=e" "bias e:1|-bias=e:1" "softcap 30|-logits_soft_cap=30" "sink|-sink=1" "alibi|-bias=a" "dropout 0.1|-p_drop=0.1")
: >"$out/timing.txt"; t0=$(date +%s)
for rep in 1 2 3; do for mask in 0 b g; do for v in "${variants[@]}"; do for n in base head2 head1; do
    [ "$(left)" -le 0 ] && { note "timing stopped at rep $rep"; break 5; }
    shape="-b=1 -h=8 -s=4096 -mask=$mask"
    if [ $mask = g ]; then case ${v%%|*} in plain|"bias e") ;; *) continue ;; esac; shape="-mode=1 -b=2 -h=8 -s=4096,4096 -s_k=4096,4096 -mask=b"; fi
    log=$out/t_${n}_${mask}_${rep}_$(echo "${v%%|*}" | tr ' :.' '___').log
    with_lib $n timeout 40 "$(exe_of $n)" -prec=bf16 $shape -d=256 -v=0 -kname=1 -warmup=10 -repeat=30 ${v#*|} >"$log" 2>&1
    ms=$(grep -o '[0-9.]* ms,' "$log" | head -1 | cut -d' ' -f1)
    name=$(grep -o 'mha_fwd -> fwd_[a-z0-9_]*' "$log" | head -1 | cut -d' ' -f3)
    echo "$n|$mask|${v%%|*}|$rep|${ms:-NA}|${name:-none}" >>"$out/timing.txt"
done; done; done; done
note "timing in $(elapsed $t0)"
python3 - "$out/timing.txt" >>"$summary" <<'PY'
import statistics, sys
rows=[l.rstrip("\n").split("|",5) for l in open(sys.argv[1])]
ms={}
for n,m,v,r,t,_ in rows:
    try: ms.setdefault((n,m,v),[]).append(float(t))
    except ValueError: pass
med={k:statistics.median(x) for k,x in ms.items()}
T=["base","head2","head1"]
print("| mask | call | "+" | ".join(f"{t} ms | cost" for t in T)+" |")
print("|"+"---|"*(2+2*len(T)))
for m in "0","b","g":
    for v in ["plain","bias e","bias e:1","softcap 30","sink","alibi","dropout 0.1"]:
        if not any((t,m,v) in med for t in T): continue
        c=[]
        for t in T:
            x,p=med.get((t,m,v)),med.get((t,m,"plain"))
            c+= [f"{x:.3f}" if x else "NA", f"{100*(x/p-1):+.1f} %" if x and p and v!="plain" else ""]
        print(f"| {m} | {v} | "+" | ".join(c)+" |")
PY
cut -d'|' -f1,2,3,6 "$out/timing.txt" | sort | uniq -c >>"$summary"
echo "total $(elapsed $t_all)" >>"$summary"
