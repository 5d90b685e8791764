#!/usr/bin/env bash
# mhakit backward smoke test: aiter's / CK's smoke_test_bwd.sh grid, restricted to what mhakit supports
# (dropout included):
#   prec {fp16, bf16} x perm {0, 1} (iperm = operm) x hdim {32, 64, 128, 256} x mode {0, 1}, six shapes each
#   (GQA, s != s_k, causal top-left / bottom-right, sliding windows t:128,30 and b:4,35), 192 runs;
# then deterministic runs (-deterministic=1; with -v=1 the benchmark also runs the backward twice and requires
# bitwise-identical dQ / dK / dV): prec x mode x hdim x three of the shapes, 48 runs; then group mode with
# per-sequence lengths: prec x perm x hdim {64, 128, 256} x three shapes, 36 runs; then head dims that are not
# multiples of 8 (1, 59, 111, 255, d != d_v among them, two deterministic shapes): prec x perm x mode x 8, 64 runs;
# then the score modifiers (elementwise bias with dbias, ALiBi, soft-cap, sinks with d sink, combined, one
# deterministic): prec x mode x hdim {59, 64, 128} x 10, 120 runs; then the modifiers at the Hopper-only buckets:
# prec x mode x hdim {256, 192/128} x 5, 40 runs; then dropout (random bytes checked against the
# host's Philox, masks, GQA, device seed / offset, with modifiers, deterministic): prec x mode x hdim x 4, 48 runs;
# then the (192, 128) bucket's plain calls (its Hopper tile of every plain call, the swapped key split: causal kinds
# with s != s_k and key tails of 96-key blocks, windows, GQA / MQA, deterministic, no mask): prec x mode x 6, 24 runs;
# then the Hopper GQA split (b = 1 with one or two kv heads, whose unsplit grid leaves SMs idle: several CTAs per kv
# group, dK / dV from fp32 partial sums; masks, short and odd lengths, deterministic, dbias and d sink, dropout):
# prec x mode x hdim {64, 128, 256, 192/128} x 5, 80 runs.
# Every run validates dQ, dK, dV against the CPU reference (-v=1) and must exit 0.
#
# Runs from any directory. The benchmark is $BENCH, or ./benchmark_mha_bwd in the current directory.
# Options, queueing and the parallel runner live in smoke_common.sh (shared with smoke_test_fwd.sh).
set -u

usage() {
    cat <<'USAGE'
usage: smoke_test_bwd.sh [-v LEVEL] [-q] [-k] [-j JOBS] [-h]
  -v LEVEL  validation level, passed as -v=LEVEL (default: 1)
  -j JOBS   runs in parallel (default: 1; 0: one per CPU core); output stays in grid order
  -q        quick subset: fp16 and iperm=operm=1 only (253 runs instead of 652)
  -k        pass -kname=1 (print the chosen kernel names)
  -h        show this help
environment:
  BENCH           benchmark executable (default: ./benchmark_mha_bwd)
  MHA_EXTRA_ARGS  extra arguments appended to every command, e.g. MHA_EXTRA_ARGS="-init=0 -seed=7"
  MHA_TIMEOUT     seconds allowed per run when `timeout` is installed (default: 600; 0: no limit)
  MHA_SMOKE_ONLY  comma list of the sections to run (default: all): grid, det, group, odd, mods, hmods, dropout, mla,
                  split
  MHA_SMOKE_PRECS the 16-bit precisions (default: "fp16 bf16"; -q: fp16)
  MHA_MODS_HDIMS  the head dims of the modifier and dropout sections (default: "59 64 128")
USAGE
}

SMOKE_NAME=smoke_test_bwd
SMOKE_EXE_DEFAULT=./benchmark_mha_bwd
# shellcheck source=smoke_common.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/smoke_common.sh" || exit 2
smoke_setup "$@"

PRECS="${MHA_SMOKE_PRECS:-fp16 bf16}"
PERMS="0 1"
if [ "$QUICK" -eq 1 ]; then
    PRECS="fp16"
    PERMS="1"
fi

# Whether section $1 runs (MHA_SMOKE_ONLY lists the sections to run; unset: all of them).
want() { [ -z "${MHA_SMOKE_ONLY:-}" ] || [[ ",$MHA_SMOKE_ONLY," == *",$1,"* ]]; }

smoke_header
want grid &&
for prec in $PRECS; do
for perm in $PERMS; do
for hdim in 32 64 128 256; do
for mode in 0 1; do
    p=(-prec="$prec" -d="$hdim" -iperm="$perm" -operm="$perm" -mode="$mode")
    run "${p[@]}" -b=1 -h=4 -h_k=2 -s=259
    run "${p[@]}" -b=2 -h=2 -s=516 -s_k=253
    run "${p[@]}" -b=1 -h=4 -h_k=1 -s=500 -s_k=251 -mask=1
    run "${p[@]}" -b=1 -h=2 -s=900 -s_k=258 -mask=2
    run "${p[@]}" -b=2 -h=1 -s=987 -s_k=219 -mask=t:128,30
    run "${p[@]}" -b=2 -h=3 -h_k=1 -s=244 -s_k=499 -mask=b:4,35
done
done
done
done

# deterministic mode, checked bitwise against a second run
want det &&
for prec in $PRECS; do
for mode in 0 1; do
for hdim in 32 64 128 256; do
    p=(-prec="$prec" -d="$hdim" -iperm=1 -operm=1 -mode="$mode" -deterministic=1)
    run "${p[@]}" -b=1 -h=4 -h_k=2 -s=259
    run "${p[@]}" -b=1 -h=2 -s=900 -s_k=258 -mask=2
    run "${p[@]}" -b=2 -h=3 -h_k=1 -s=244 -s_k=499 -mask=b:4,35
done
done
done

# Group mode with per-sequence lengths (seqlen_q != seqlen_k, empty sequences on either side, tiles that cross into
# the next sequence) on the equal head dims that the Hopper family serves.
want group &&
for prec in $PRECS; do
for perm in $PERMS; do
for hdim in 64 128 256; do
    p=(-prec="$prec" -mode=1 -iperm="$perm" -operm="$perm" -d="$hdim")
    run "${p[@]}" -b=3 -h=4 -h_k=2 -s=100,0,37 -s_k=64,19,0 -mask=t
    run "${p[@]}" -b=4 -h=2 -s=513,77,1,300 -s_k=300,600,5,1 -mask=b:40,9
    run "${p[@]}" -b=2 -h=6 -h_k=1 -s=1000,129 -s_k=257,1100
done
done
done

# Head dims that are not multiples of 8 (partial last chunks, odd row strides), deterministic mode included
want odd &&
for prec in $PRECS; do
for perm in $PERMS; do
for mode in 0 1; do
    p=(-prec="$prec" -iperm="$perm" -operm="$perm" -mode="$mode")
    run "${p[@]}" -d=59 -b=1 -h=4 -h_k=2 -s=259
    run "${p[@]}" -d=111 -d_v=59 -b=2 -h=2 -s=216 -s_k=153 -mask=2
    run "${p[@]}" -d=59 -d_v=111 -b=1 -h=4 -h_k=1 -s=200 -s_k=251 -mask=1
    run "${p[@]}" -d=111 -b=2 -h=3 -h_k=1 -s=144 -s_k=199 -mask=t:64,10
    run "${p[@]}" -d=1 -b=1 -h=2 -s=100 -s_k=90
    run "${p[@]}" -d=255 -b=1 -h=2 -h_k=1 -s=130 -s_k=200 -mask=b:4,35
    run "${p[@]}" -d=59 -b=1 -h=4 -h_k=2 -s=259 -deterministic=1
    run "${p[@]}" -d=111 -b=1 -h=2 -s=300 -s_k=158 -mask=2 -deterministic=1
done
done
done

# Score modifiers: aiter's bias grid with dbias for the elementwise kinds, ALiBi, soft-cap, sinks (d sink checked),
# combinations, GQA, group mode, an odd head dim (generic) and a deterministic run; 64 / 128 run on the Hopper
# "_mods" instances where the library has them. An odd s_k makes the elementwise bias's rows unaligned (the Hopper
# backward reads it from global memory, not through its bias ring): the last two runs without dbias, over several
# key blocks.
want mods &&
for prec in $PRECS; do
for mode in 0 1; do
for hdim in ${MHA_MODS_HDIMS:-59 64 128}; do
    p=(-prec="$prec" -d="$hdim" -mode="$mode")
    run "${p[@]}" -b=1 -h=4 -h_k=2 -s=259 -bias=e -dbias=1
    run "${p[@]}" -b=2 -h=2 -s=216 -s_k=153 -mask=2 -bias=e:2 -dbias=1
    run "${p[@]}" -b=1 -h=4 -h_k=1 -s=200 -s_k=251 -mask=t:64,10 -bias=e:1 -dbias=1
    run "${p[@]}" -b=2 -h=3 -h_k=1 -s=244 -s_k=199 -mask=b:4,35 -bias=a
    run "${p[@]}" -b=1 -h=2 -s=300 -s_k=158 -bias=a:1 -mask=1
    run "${p[@]}" -b=1 -h=4 -h_k=2 -s=259 -logits_soft_cap=30
    run "${p[@]}" -b=2 -h=2 -s=216 -s_k=153 -mask=2 -logits_soft_cap=10 -bias=a
    run "${p[@]}" -b=1 -h=4 -h_k=2 -s=259 -s_k=200 -sink=1
    run "${p[@]}" -b=1 -h=2 -s=130 -s_k=77 -mask=b:4,35 -sink=1 -logits_soft_cap=20 -bias=e:1 -dbias=1
    run "${p[@]}" -b=1 -h=2 -s=300 -s_k=158 -mask=2 -sink=1 -bias=e -dbias=1 -deterministic=1
    run "${p[@]}" -b=1 -h=4 -h_k=2 -s=517 -s_k=1023 -mask=t -bias=e
    run "${p[@]}" -b=2 -h=2 -s=300 -s_k=301 -mask=b:64,0 -logits_soft_cap=20 -bias=e:2
done
done
done

# The modifiers at the Hopper-only buckets 256 and (192, 128) (Hopper "_mods" backward instances where built).
want hmods &&
for prec in $PRECS; do
for mode in 0 1; do
for dims in "-d=256" "-d=192 -d_v=128"; do
    # shellcheck disable=SC2206
    p=(-prec="$prec" -mode="$mode" $dims)
    run "${p[@]}" -b=1 -h=4 -h_k=2 -s=259 -bias=e -dbias=1
    run "${p[@]}" -b=2 -h=2 -s=216 -s_k=153 -mask=2 -logits_soft_cap=10 -bias=a
    run "${p[@]}" -b=1 -h=2 -s=130 -s_k=77 -mask=b:4,35 -sink=1 -logits_soft_cap=20 -bias=e:1 -dbias=1
    run "${p[@]}" -b=1 -h=4 -h_k=1 -s=200 -s_k=251 -mask=t:64,10 -bias=e:2 -dbias=1
    run "${p[@]}" -b=1 -h=2 -s=300 -s_k=158 -mask=2 -sink=1 -bias=e -dbias=1 -deterministic=1
    run "${p[@]}" -b=1 -h=4 -h_k=2 -s=517 -s_k=1023 -mask=t -bias=e
done
done
done

# Dropout (on the Hopper "_mods" instances at 64 / 128 where the library has them, else on generic's; the forward
# stores its random bytes, which must equal the host's Philox and feed the host reference): masks, GQA, group mode,
# seed / offset in device memory, with a soft-cap and a bias, deterministic.
want dropout &&
for prec in $PRECS; do
for mode in 0 1; do
for hdim in ${MHA_MODS_HDIMS:-59 64 128}; do
    p=(-prec="$prec" -d="$hdim" -mode="$mode")
    run "${p[@]}" -b=2 -h=4 -h_k=2 -s=259 -s_k=200 -p_drop=0.2 -drop_seed=7 -drop_offset=11
    run "${p[@]}" -b=1 -h=2 -s=216 -s_k=153 -mask=2 -p_drop=0.5 -drop_prefs=1 -drop_seed=123456789012 -drop_offset=5
    run "${p[@]}" -b=2 -h=3 -h_k=1 -s=130 -s_k=251 -mask=t:64,10 -p_drop=0.1 -logits_soft_cap=20 -bias=e:1 -dbias=1
    run "${p[@]}" -b=1 -h=2 -s=300 -s_k=158 -mask=1 -p_drop=0.3 -sink=1 -deterministic=1
done
done
done

# The (192, 128) bucket (DeepSeek-style MLA) without modifiers: the swapped key split (96 keys per CTA) serves
# every plain call, masked or not, in batch and group mode.
want mla &&
for prec in $PRECS; do
for mode in 0 1; do
    p=(-prec="$prec" -mode="$mode" -d=192 -d_v=128)
    run "${p[@]}" -b=2 -h=4 -h_k=2 -s=333 -s_k=517 -mask=t
    run "${p[@]}" -b=1 -h=4 -s=700 -s_k=650 -mask=b
    run "${p[@]}" -b=1 -h=6 -h_k=1 -s=257 -s_k=1000 -mask=t:128,30
    run "${p[@]}" -b=2 -h=2 -s=130 -s_k=97 -mask=b:4,35
    run "${p[@]}" -b=1 -h=4 -h_k=2 -s=640 -mask=t -deterministic=1
    run "${p[@]}" -b=2 -h=4 -s=259 -s_k=301
done
done

# The Hopper GQA split (fmha_bwd_hopper.cuh, bwd_gqa_split.h): b = 1 with one or two kv heads, so that the unsplit
# grid (key blocks x kv heads) leaves SMs idle and the query heads of a kv group are shared by several CTAs (on the
# H200: 8, 8, 2, 8 and 8 of them below at d128); masks, a short and odd s_k, deterministic (bitwise against a second
# run), an elementwise bias with dbias and a sink with d sink, dropout (the "_mods" instances' generic kernel).
want split &&
for prec in $PRECS; do
for mode in 0 1; do
for dims in "-d=64" "-d=128" "-d=256" "-d=192 -d_v=128"; do
    # shellcheck disable=SC2206
    p=(-prec="$prec" -mode="$mode" $dims)
    run "${p[@]}" -b=1 -h=16 -h_k=2 -s=1031
    run "${p[@]}" -b=1 -h=8 -h_k=1 -s=700 -s_k=1500 -mask=1 -deterministic=1
    run "${p[@]}" -b=1 -h=8 -h_k=1 -s=2048 -s_k=4096 -mask=b:300,20
    run "${p[@]}" -b=1 -h=8 -h_k=1 -s=300 -s_k=77 -mask=2 -bias=e -dbias=1 -sink=1
    run "${p[@]}" -b=1 -h=6 -h_k=1 -s=333 -s_k=257 -mask=t -p_drop=0.2 -drop_seed=3 -drop_offset=9
done
done
done

run_all
smoke_finish
