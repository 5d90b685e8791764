#!/usr/bin/env bash
# mhakit decode smoke test: mha_fwd_splitkv (benchmark_mha_fwd's kv-cache arguments) against the CPU reference:
#   prec {fp16, bf16} x pages {contiguous, 1, 16, 256} x GQA ratio {1, 4, 8}, three shapes each: s_q = 1 over ragged
#   cache lengths 0 .. 4096 (heuristic splits), s_q = 4 with bottom-right causal, 3 appended rows and LSE, s_q = 16
#   with a bottom-right sliding window and 3 forced splits; then long caches (64k), empty caches, cache_batch_idx,
#   head dims 64 / 256 / 59 x 100, top-left and generic masks.
# Every run validates (-v=1: O, LSE when stored, and the appended rows in the cache) and must exit 0.
#
# Runs from any directory. The benchmark is $BENCH, or ./benchmark_mha_fwd in the current directory.
set -u

usage() {
    cat <<'USAGE'
usage: smoke_test_decode.sh [-v LEVEL] [-q] [-k] [-j JOBS] [-h]
  -v LEVEL  validation level, passed as -v=LEVEL (default: 1)
  -j JOBS   runs in parallel (default: 1; 0: one per CPU core); output stays in grid order
  -q        quick subset: bf16 only
  -k        pass -kname=1 (print the chosen kernel names)
  -h        show this help
environment:
  BENCH           benchmark executable (default: ./benchmark_mha_fwd)
  MHA_EXTRA_ARGS  extra arguments appended to every command, e.g. MHA_EXTRA_ARGS="-init=nf -seed=7"
  MHA_TIMEOUT     seconds allowed per run when `timeout` is installed (default: 600; 0: no limit)
USAGE
}

SMOKE_NAME=smoke_test_decode
SMOKE_EXE_DEFAULT=./benchmark_mha_fwd
# shellcheck source=smoke_common.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/smoke_common.sh" || exit 2
smoke_setup "$@"

PRECS="fp16 bf16"
if [ "$QUICK" -eq 1 ]; then
    PRECS="bf16"
fi

smoke_header
for prec in $PRECS; do
for page in 0 1 16 256; do
for heads in "8 8" "32 8" "16 2"; do
    set -- $heads
    p=(-prec="$prec" -h="$1" -h_k="$2" -page_block_size="$page" -d=128)
    run "${p[@]}" -b=4 -s=1 -s_k=0,17,1000,4096 -num_splits=0
    run "${p[@]}" -b=3 -s=4 -s_k=63,1,300 -mask=b -s_knew=3 -lse=1 -num_splits=0
    run "${p[@]}" -b=2 -s=16 -s_k=100,2000 -mask=b:64,0 -num_splits=3 -lse=1
done
done
done

for prec in $PRECS; do
    p=(-prec="$prec")
    # long caches: heuristic splits over 64k keys, paged and contiguous
    run "${p[@]}" -b=1 -h=32 -h_k=8 -s=1 -s_k=65536 -num_splits=0 -lse=1
    run "${p[@]}" -b=2 -h=16 -h_k=2 -s=4 -s_k=65536,33001 -page_block_size=256 -mask=b -num_splits=0
    # empty caches (every row sees nothing: O = 0, LSE = -inf), with and without new rows
    run "${p[@]}" -b=2 -h=8 -h_k=2 -s=2 -s_k=0 -num_splits=0 -lse=1
    run "${p[@]}" -b=2 -h=8 -h_k=2 -s=2 -s_k=0 -s_knew=5 -page_block_size=16 -mask=b -lse=1
    # cache_batch_idx (a shuffled map into one more cache batch than the call has), with appended rows
    run "${p[@]}" -b=3 -h=8 -h_k=4 -s=1 -s_k=500,7,1 -cache_batch_idx=1 -s_knew=2 -num_splits=0 -lse=1
    run "${p[@]}" -b=2 -h=4 -h_k=1 -s=8 -s_k=129,64 -cache_batch_idx=1 -mask=b -num_splits=2
    # other head-dim buckets, d != d_v and head dims that are not multiples of 8
    run "${p[@]}" -b=2 -h=8 -h_k=2 -s=3 -s_k=700,33 -d=64 -mask=b -num_splits=0 -lse=1
    run "${p[@]}" -b=2 -h=8 -h_k=1 -s=2 -s_k=300,1024 -d=256 -page_block_size=16 -num_splits=0 -lse=1
    run "${p[@]}" -b=2 -h=6 -h_k=3 -s=5 -s_k=77,250 -d=59 -d_v=100 -mask=b -s_knew=1 -lse=1
    # top-left and generic masks (over s_q queries and the cache length + new rows)
    run "${p[@]}" -b=2 -h=4 -h_k=4 -s=6 -s_k=10,40 -mask=t:2,3 -num_splits=0 -lse=1
    run "${p[@]}" -b=2 -h=8 -h_k=2 -s=4 -s_k=64,200 -mask=g:30,5 -num_splits=2 -lse=1
done

run_all
smoke_finish
