#!/usr/bin/env bash
# Decode at s_q = 1 towards the peers' bandwidth (branch decpdl, issue 10), in two parts:
#
#   bash tools/verify_decpdl.sh build   # the 2-core machine, before the device call (-j 1 by default: ~5 min)
#   bash tools/verify_decpdl.sh run     # the H200, from those prebuilt libraries, no compiling (~3 min)
#
# Libraries (build/decpdl/<variant>/libmha_fwd.so; carry build/decpdl, about 18.5 MB, to the device machine):
#   base  main at the branch's start (3d0fdc4, from `git archive`): the bf16 d128 decode_tma instance only, for a
#         same-run comparison (no PDL, the old split heuristic and combine)
#   head  this branch: every split-KV instance (decode and decode_tma, fp16 / bf16, d64 / d128 / d256): the combine
#         as a programmatic dependent (PDL), the split heuristic's time model; the smoke grid runs on it; with
#         benchmark_mha_fwd, which the other variants' host-validated runs use too (LD_LIBRARY_PATH before its
#         $ORIGIN runpath)
#   p2    this branch with the catalogue's decode_tma d128 bf16 candidate: 2 key blocks of L2 prefetch
# Objects go to $MHAKIT_DECPDL_OBJ (default /tmp/mhakit_decpdl_obj); MHAKIT_DECPDL_JOBS is the build's -j (default 1).
#
# run (logs under $OUT, else ./verify_decpdl_logs), correctness first, everything at once (nothing is timed):
#   (a) the decode smoke grid on head (smoke_tests/smoke_test_decode.sh -j 10, every run validated on the host);
#   (b) compute-sanitizer memcheck on head: a paged split case (64-token pages, 5 forced splits, s_q = 4 causal with
#       appended rows), a contiguous one (the row split: 128 packed rows, 3 splits, cache_batch_idx-free) and the
#       heuristic's 32-way split of b=1 32/8 s_k=32k (the dependent combine); and on p2 a paged case whose block
#       table spans several 32-block windows (the prefetch's own window);
#   (c) five host-validated decode_tma runs (d128 bf16: paged 64 / 256, ragged lengths, appended rows, the row
#       split, cache_batch_idx, a 64k paged cache) on head and p2;
# then the timing, one library at a time:
#   (d) bench/bench_decode.py --sq 1,4,16 (issue 10's rows): head with --page 64 against cuDNN and FA2
#       (--show-kernel), base / p2 against cuDNN (contiguous; p2 also paged: it checks its paged output against
#       the contiguous one);
#   (e) CUDA-graph capture of split calls on head (torch.cuda.graph around mha_fwd_kvcache(..., out=): the
#       dependent combine, and with appended rows the dependent split kernel, inside a graph), replayed on new
#       inputs and compared with direct calls;
#   (f) the split count on head for the one-wave s_q = 1 rows (b=1 32/8 32k, b=16 32/8 8k, b=8 64/8 64k):
#       num_splits 8, 29 (the old heuristic's at b=1) and 64 beside the heuristic's 32 / 2 / 4 of row (d);
# then a table of TB/s per row and library (table.md). The Python GPU tests of the kv-cache paths are not run: they
# build their libraries through the JIT (MHAKIT_CACHE_DIR), i.e. they would compile on the device machine.
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
libs=$repo/build/decpdl
base_commit=3d0fdc4
tma=splitkv_d128_bf16_batch_mask_sm90a_decode_tma_b32x64w4
summary=()
note() { summary+=("$1"); echo "== $1"; }
elapsed() { echo "$(( $(date +%s) - $1 )) s"; }

case "${1:-}" in
build)
    obj=${MHAKIT_DECPDL_OBJ:-/tmp/mhakit_decpdl_obj}
    jobs=${MHAKIT_DECPDL_JOBS:-1}
    logs=$libs/build_logs
    rm -rf "$libs"
    mkdir -p "$libs" "$logs"
    start=$(date +%s)
    # variant, source tree, profile, filter, extra compile.py arguments
    src_base=$obj/src_base
    rm -rf "$src_base" && mkdir -p "$src_base"
    git archive "$base_commit" | tar -x -C "$src_base"
    while read -r name src profile filter extra; do
        mkdir -p "$libs/$name"
        t0=$(date +%s)
        (cd "$libs/$name" && python3 "$src/compile.py" --api fwd --arch sm_90a --profile "$profile" \
            --filter "$filter" $extra -j "$jobs" --build-dir "$obj/$( [ "$src" = "$repo" ] && echo head || echo base)") \
            >"$logs/$name.log" 2>&1
        note "build $name: rc=$? in $(elapsed "$t0"): $(tail -1 "$logs/$name.log")"
    done <<EOF
base $src_base all $tma
head $repo all splitkv --benchmark
p2 $repo candidates ${tma}p2
EOF
    note "built in $(elapsed "$start"): $(du -sh --exclude=build_logs "$libs" | cut -f1) under $libs"
    for name in base head p2; do
        [ -f "$libs/$name/libmha_fwd.so" ] || note "MISSING: $libs/$name/libmha_fwd.so"
    done
    [ -x "$libs/head/benchmark_mha_fwd" ] || note "MISSING: $libs/head/benchmark_mha_fwd"
    echo "carry: build/decpdl (the run step reads build/decpdl/<variant>/libmha_fwd.so and head/benchmark_mha_fwd)"
    ;;
run)
    logs=${OUT:-$repo/verify_decpdl_logs}
    mkdir -p "$logs"
    export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
    export MHAKIT_CACHE_DIR=${MHAKIT_CACHE_DIR:-$(mktemp -d)}  # the C call path's extension only (host C compiler)
    nvidia-smi --query-gpu=name,compute_cap,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$logs/gpu.txt"
    start=$(date +%s)
    for name in base head p2; do
        [ -f "$libs/$name/libmha_fwd.so" ] || note "$name: no prebuilt library in $libs/$name (run the build step)"
    done
    head=$libs/head/benchmark_mha_fwd
    tma_runs=(
        "-b=4 -h=32 -h_k=8 -s=1 -s_k=0,17,1000,4096 -page_block_size=64 -num_splits=0"
        "-b=3 -h=32 -h_k=8 -s=4 -s_k=63,1,3000 -page_block_size=256 -mask=b -s_knew=3 -num_splits=0 -lse=1"
        "-b=2 -h=64 -h_k=8 -s=16 -s_k=100,5000 -mask=b:64,0 -num_splits=3 -lse=1"
        "-b=1 -h=32 -h_k=8 -s=1 -s_k=65536 -page_block_size=64 -num_splits=0 -lse=1"
        "-b=3 -h=8 -h_k=4 -s=1 -s_k=500,7,1 -cache_batch_idx=1 -s_knew=2 -num_splits=0 -lse=1"
    )
    memcheck() {  # log, variant, arguments
        local log=$1 name=$2
        shift 2
        LD_LIBRARY_PATH="$libs/$name${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" compute-sanitizer --tool memcheck \
            --error-exitcode 99 "$head" -prec=bf16 -d=128 -v=1 -warmup=0 -repeat=1 -kname=1 "$@" >"$logs/$log" 2>&1
        echo "rc=$?" >>"$logs/$log"
    }
    # ---- correctness, all at once (nothing timed) ----
    (BENCH=$head bash smoke_tests/smoke_test_decode.sh -k -j 10 >"$logs/smoke.log" 2>&1; echo "rc=$?" >>"$logs/smoke.log") &
    memcheck memcheck_paged.log head -b=2 -h=32 -h_k=8 -s=4 -s_k=3000,777 -page_block_size=64 -num_splits=5 \
        -mask=b -s_knew=2 -lse=1 &
    memcheck memcheck_rowsplit.log head -b=2 -h=64 -h_k=8 -s=16 -s_k=2100,65 -mask=b -num_splits=3 -lse=1 &
    memcheck memcheck_b1.log head -b=1 -h=32 -h_k=8 -s=1 -s_k=32768 -num_splits=0 -lse=1 &
    memcheck memcheck_p2_paged.log p2 -b=2 -h=32 -h_k=8 -s=1 -s_k=5000,2113 \
        -page_block_size=64 -num_splits=2 -lse=1 &
    for name in head p2; do
        (for a in "${tma_runs[@]}"; do
            # shellcheck disable=SC2086
            LD_LIBRARY_PATH="$libs/$name${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$head" -prec=bf16 -d=128 -v=1 -kname=1 -warmup=1 -repeat=2 $a 2>&1
            echo "rc=$?"
        done >"$logs/tma_$name.log") &
    done
    wait
    note "smoke (head): $(grep -o 'smoke_test_decode: [0-9]* passed, [0-9]* failed' "$logs/smoke.log") $(tail -1 "$logs/smoke.log")"
    for f in memcheck_paged memcheck_rowsplit memcheck_b1 memcheck_p2_paged; do
        note "$f: $(grep -o 'ERROR SUMMARY: [0-9]* errors' "$logs/$f.log") $(tail -1 "$logs/$f.log"), $(grep -o 'valid:[yn]' "$logs/$f.log" | head -1), $(grep -o 'splitkv_[a-z0-9_]*' "$logs/$f.log" | head -1)"
    done
    for name in head p2; do
        note "tma checks $name: $(grep -c 'valid:y' "$logs/tma_$name.log") of ${#tma_runs[@]} valid, rc $(grep -o 'rc=[0-9]*' "$logs/tma_$name.log" | sort | uniq -c | tr '\n' ' ')"
    done
    note "correctness in $(elapsed "$start")"
    # ---- timing, one library at a time ----
    bench() {  # name, library, arguments
        local name=$1 lib=$2 t0
        shift 2
        t0=$(date +%s)
        python3 bench/bench_decode.py --lib "$lib" --sq 1,4,16 --json "$logs/bench_$name.json" "$@" \
            >"$logs/bench_$name.md" 2>"$logs/bench_$name.err"
        note "bench $name: rc=$? in $(elapsed "$t0") ($(grep -c 'FAIL\|differs' "$logs/bench_$name.md") failing rows)"
    }
    bench head "$libs/head/libmha_fwd.so" --page 64 --show-kernel
    bench base "$libs/base/libmha_fwd.so" --page 0 --peers cudnn
    bench p2 "$libs/p2/libmha_fwd.so" --page 64 --peers cudnn
    python3 - "$libs/head/libmha_fwd.so" >"$logs/graph.log" 2>&1 <<'PY'
import sys
sys.path.insert(0, "bench")
import torch
import mhakit
from bench_decode import use_library
use_library(sys.argv[1])
b, hq, hk, sk, d = 2, 32, 8, 20000, 128
q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16)
kc, vc = (torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
kn, vn = (torch.randn(b, 3, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
lens = torch.tensor([sk - 3, 7777], dtype=torch.int32, device="cuda")
calls = {"6 splits": dict(num_splits=6), "3 appended rows, heuristic splits": dict(k=kn, v=vn, causal=True)}
outs = {name: torch.empty_like(q) for name in calls}
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):  # warm-up outside the capture (the split accumulators' scratch grows here)
    for name, kw in calls.items():
        mhakit.mha_fwd_kvcache(q, kc, vc, lens, out=outs[name], **kw)
torch.cuda.current_stream().wait_stream(side)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    for name, kw in calls.items():
        mhakit.mha_fwd_kvcache(q, kc, vc, lens, out=outs[name], **kw)
ok = True
for _ in range(3):
    for t in (q, kc, vc, kn, vn):
        t.copy_(torch.randn_like(t))
    graph.replay()
    torch.cuda.synchronize()
    for name, kw in calls.items():
        same = torch.equal(outs[name], mhakit.mha_fwd_kvcache(q, kc, vc, lens, **kw))
        print(f"{name}: graph replay equals the direct call: {same}")
        ok &= same
sys.exit(0 if ok else 1)
PY
    note "graph capture (dependent combine; dependent split kernel after an append): rc=$? $(grep -c ': True' "$logs/graph.log") of 6 replays equal"
    for n in 8 29 64; do
        python3 bench/bench_decode.py --lib "$libs/head/libmha_fwd.so" --rows 1,16,8 --sq 1 --page 0 --peers "" \
            --num-splits "$n" --json "$logs/splits_$n.json" >"$logs/splits_$n.md" 2>&1
    done
    python3 - "$logs" <<'PY' | tee "$logs/table.md"
import json, os, sys
logs = sys.argv[1]
def load(name):
    path = os.path.join(logs, name)
    return json.load(open(path))["rows"] if os.path.exists(path) else []
variants = {v: load(f"bench_{v}.json") for v in ("base", "head", "p2")}
key = lambda r: (r["sq"], r["b"], r["hq"], r["hk"], r["sk"])
def cell(rows, k, field="mhakit_tbs"):
    for r in rows:
        if key(r) == k:
            v = r.get(field)
            bad = r.get("verified") is False or r.get("paged_matches") is False
            return ("-" if v is None else f"{v:.2f}") + (" FAIL" if bad and field == "mhakit_tbs" else "")
    return "-"
keys = sorted({key(r) for rows in variants.values() for r in rows})
print("| s_q | b | h_q/h_k | s_k | base | head | head paged | p2 | p2 paged | cuDNN | FA2 |")
print("|---" * 11 + "|")
for k in keys:
    sq, b, hq, hk, sk = k
    h = variants["head"]
    print(f"| {sq} | {b} | {hq}/{hk} | {sk} | {cell(variants['base'], k)} | {cell(h, k)} | "
          f"{cell(h, k, 'mhakit_paged_tbs')} | "
          f"{cell(variants['p2'], k)} | {cell(variants['p2'], k, 'mhakit_paged_tbs')} | {cell(h, k, 'cudnn_tbs')} | "
          f"{cell(h, k, 'fa2_tbs')} |")
print()
print("| s_q = 1 row on head | heuristic (row above) | 8 splits | 29 | 64 |")
print("|---|---|---|---|---|")
for k in [(1, 1, 32, 8, 32768), (1, 16, 32, 8, 8192), (1, 8, 64, 8, 65536)]:
    print(f"| b={k[1]} {k[2]}/{k[3]} s_k={k[4]} | {cell(variants['head'], k)} | "
          + " | ".join(cell(load(f"splits_{n}.json"), k) for n in (8, 29, 64)) + " |")
PY
    note "run in $(elapsed "$start"); table in $logs/table.md (kernel names in bench_head.md)"
    ;;
*)
    echo "usage: bash tools/verify_decpdl.sh build|run" >&2
    exit 2
    ;;
esac

echo
echo "== summary"
printf '%s\n' "${summary[@]}"
