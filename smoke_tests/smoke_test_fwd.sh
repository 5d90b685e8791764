#!/usr/bin/env bash
# mhakit forward smoke test: aiter's smoke_test_fwd.sh grid, restricted to what mhakit supports
# (no split-kv / paged kv-cache here: smoke_test_decode.sh; row-major V):
#   prec {fp16, bf16} x mode {1, 0} x perm {0, 1} (iperm = operm) x hdim {32, 64, 128, 256} x lse {0, 1},
#   nine shapes each (GQA, d != d_v, causal top-left / bottom-right, sliding windows, empty K, s_q = 1); then group
#   mode with per-sequence lengths: prec x perm {0, 1} x hdim {64, 128, 256} x lse {0, 1}, three shapes each;
#   then head dims that are not multiples of 8 (1, 3, 59, 111, 255, d != d_v among them): prec x mode x perm, seven
#   shapes each (GQA, masks, LSE). They run on the generic family's smallest bucket that holds them. Then the score
#   modifiers: prec x mode x hdim {59, 64, 128} x (aiter's bias kinds e, e:1, e:2, a, a:1 on three shapes, plus five
#   soft-cap / sink / combined shapes), 240 runs (59 on the generic family, 64 / 128 on the Hopper "_mods" instances
#   where the library has them); then the modifiers at the Hopper-only buckets: prec x mode x hdim {256, 192/128} x 5
#   shapes, 40 runs; then dropout with the random bytes stored and checked: prec x mode x hdim {59, 64, 128} x 3
#   shapes, 36 runs. Then fp8 (e4m3 in, bf16 out; Hopper only: on when the GPU is sm_90, or
#   MHA_FP8=1 / 0): hdim {128, 256} x perm {0, 1} x 8 shapes (per-tensor and unscaled, odd lengths, masks, GQA, no
#   keys, smaller head dims and d != d_v), 32 runs.
# Every run validates against the CPU reference (-v=1) and must exit 0.
#
# Runs from any directory. The benchmark is $BENCH, or ./benchmark_mha_fwd in the current directory.
# Options, queueing and the parallel runner live in smoke_common.sh (shared with smoke_test_bwd.sh).
set -u

usage() {
    cat <<'USAGE'
usage: smoke_test_fwd.sh [-v LEVEL] [-q] [-k] [-j JOBS] [-h]
  -v LEVEL  validation level, passed as -v=LEVEL (default: 1)
  -j JOBS   runs in parallel (default: 1; 0: one per CPU core); output stays in grid order
  -q        quick subset: fp16 and lse=1 only (328 runs instead of 980)
  -k        pass -kname=1 (print the chosen kernel names)
  -h        show this help
environment:
  BENCH           benchmark executable (default: ./benchmark_mha_fwd)
  MHA_EXTRA_ARGS  extra arguments appended to every command, e.g. MHA_EXTRA_ARGS="-init=nf -seed=7"
  MHA_TIMEOUT     seconds allowed per run when `timeout` is installed (default: 600; 0: no limit)
  MHA_SMOKE_ONLY  comma list of the sections to run (default: all): grid, group, odd, mods, hmods, dropout, fp8
  MHA_SMOKE_PRECS the 16-bit precisions (default: "fp16 bf16"; -q: fp16)
  MHA_MODS_HDIMS  the head dims of the modifier and dropout sections (default: "59 64 128")
  MHA_FP8         1: run the fp8 section, 0: skip it, only: run nothing else (default: run it when nvidia-smi
                  reports compute capability 9.0)
  MHA_FP8_HDIMS   the fp8 section's head-dim buckets (default: "128 256"; e.g. 128 for a library of d128 fp8 tiles)
USAGE
}

SMOKE_NAME=smoke_test_fwd
SMOKE_EXE_DEFAULT=./benchmark_mha_fwd
# shellcheck source=smoke_common.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/smoke_common.sh" || exit 2
smoke_setup "$@"

PRECS="${MHA_SMOKE_PRECS:-fp16 bf16}"
LSES="0 1"
if [ "$QUICK" -eq 1 ]; then
    PRECS="fp16"
    LSES="1"
fi
FP8="${MHA_FP8:-}"
if [ -z "$FP8" ]; then
    FP8=0
    if command -v nvidia-smi >/dev/null 2>&1 &&
        nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | grep -qx '9.0'; then
        FP8=1
    fi
fi
[ "$FP8" = only ] && PRECS=""  # every 16-bit section loops over PRECS

# Whether section $1 runs (MHA_SMOKE_ONLY lists the sections to run; unset: all of them).
want() { [ -z "${MHA_SMOKE_ONLY:-}" ] || [[ ",$MHA_SMOKE_ONLY," == *",$1,"* ]]; }

smoke_header
want grid &&
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

# Group mode with per-sequence lengths (seqlen_q != seqlen_k, empty sequences on either side, tiles that cross into
# the next sequence) on the equal head dims that the Hopper family serves; both layouts (perm).
want group &&
for prec in $PRECS; do
for perm in 0 1; do
for hdim in 64 128 256; do
for lse in $LSES; do
    p=(-mode=1 -lse="$lse" -iperm="$perm" -operm="$perm" -d="$hdim")
    run -prec="$prec" "${p[@]}" -b=3 -h=4 -h_k=2 -s=100,0,37 -s_k=64,19,0 -mask=t
    run -prec="$prec" "${p[@]}" -b=4 -h=2 -s=513,77,1,300 -s_k=300,600,5,1 -mask=b:40,9
    run -prec="$prec" "${p[@]}" -b=2 -h=6 -h_k=1 -s=1000,129 -s_k=257,1100
done
done
done
done

# Head dims that are not multiples of 8: rows of odd byte length (contiguous d=59: 118 bytes), partial last chunks.
want odd &&
for prec in $PRECS; do
for mode in 1 0; do
for perm in 0 1; do
    p=(-prec="$prec" -mode="$mode" -iperm="$perm" -operm="$perm")
    run "${p[@]}" -b=2 -h=2 -h_k=1 -d=59 -s=100 -s_k=77 -lse=1
    run "${p[@]}" -b=1 -h=3 -d=111 -d_v=59 -s=200 -s_k=130 -mask=2 -lse=1
    run "${p[@]}" -b=2 -h=2 -d=59 -d_v=111 -s=99 -s_k=256 -mask=1
    run "${p[@]}" -b=1 -h=4 -h_k=2 -d=111 -s=300 -s_k=300 -mask=2 -lse=1
    run "${p[@]}" -b=2 -h=2 -h_k=1 -d=1 -s=64 -s_k=80 -mask=t:16,8
    run "${p[@]}" -b=2 -h=1 -d=3 -d_v=3 -s=33 -s_k=65 -lse=1
    run "${p[@]}" -b=1 -h=2 -d=255 -s=130 -s_k=129 -mask=b:4,35 -lse=1
done
done
done

# Score modifiers: aiter's bias grid (elementwise e, e:1, e:2; ALiBi a, a:1) over masks, GQA and group mode, plus
# soft-cap, sinks (an empty K gives LSE = sink) and combinations, at an odd head dim (generic) too.
want mods &&
for prec in $PRECS; do
for mode in 1 0; do
for hdim in ${MHA_MODS_HDIMS:-59 64 128}; do
for bias in e e:1 e:2 a a:1; do
    p=(-prec="$prec" -mode="$mode" -d="$hdim" -bias="$bias" -lse=1)
    run "${p[@]}" -b=2 -h=2 -h_k=1 -s=100 -s_k=77
    run "${p[@]}" -b=2 -h=3 -s=200 -s_k=520 -mask=t:128,30
    run "${p[@]}" -b=1 -h=2 -h_k=1 -s=257 -s_k=130 -mask=b
done
    p=(-prec="$prec" -mode="$mode" -d="$hdim" -lse=1)
    run "${p[@]}" -b=2 -h=2 -h_k=1 -s=100 -s_k=77 -logits_soft_cap=30
    run "${p[@]}" -b=1 -h=2 -s=300 -s_k=300 -mask=2 -logits_soft_cap=10 -bias=a
    run "${p[@]}" -b=2 -h=4 -h_k=2 -s=129 -s_k=200 -sink=1
    run "${p[@]}" -b=1 -h=2 -s=64 -s_k=80 -mask=t:16,8 -sink=1 -logits_soft_cap=20 -bias=e:1
    run "${p[@]}" -b=1 -h=2 -h_k=1 -s=33 -s_k=0 -mask=2 -sink=1
done
done
done

# The same modifiers at the head dims only the Hopper family has buckets for (256 and (192, 128): their "_mods"
# instances where the library has them, else generic), with masks, GQA, group mode and rows that see no key.
want hmods &&
for prec in $PRECS; do
for mode in 1 0; do
for dims in 256,256 192,128; do
    p=(-prec="$prec" -mode="$mode" -d="${dims%,*}" -d_v="${dims#*,}" -lse=1)
    run "${p[@]}" -b=2 -h=4 -h_k=2 -s=200 -s_k=333 -mask=b -bias=e:1 -sink=1
    run "${p[@]}" -b=1 -h=2 -s=300 -s_k=300 -mask=t:64,30 -logits_soft_cap=10 -bias=a:1
    run "${p[@]}" -b=2 -h=2 -h_k=1 -s=129 -s_k=77 -bias=e:2 -logits_soft_cap=30
    run "${p[@]}" -b=1 -h=2 -s=250 -s_k=70 -mask=b -sink=1 -bias=a
    run "${p[@]}" -b=2 -h=3 -s=64 -s_k=520 -mask=g:30,100 -bias=e
done
done
done

# Dropout (on the Hopper "_mods" instances at 64 / 128 where the library has them, else on generic's): aiter's
# -p_drop with the random bytes stored (-s_randval=1: they must equal the host's Philox and feed the host reference),
# masks, GQA, group mode, seed / offset in device memory (-drop_prefs=1), with modifiers.
want dropout &&
for prec in $PRECS; do
for mode in 1 0; do
for hdim in ${MHA_MODS_HDIMS:-59 64 128}; do
    p=(-prec="$prec" -mode="$mode" -d="$hdim" -lse=1 -s_randval=1)
    run "${p[@]}" -b=2 -h=2 -h_k=1 -s=100 -s_k=77 -p_drop=0.2 -drop_seed=7 -drop_offset=11
    run "${p[@]}" -b=2 -h=3 -s=200 -s_k=520 -mask=t:128,30 -p_drop=0.5 -drop_prefs=1 -drop_seed=123456789012
    run "${p[@]}" -b=1 -h=2 -h_k=1 -s=257 -s_k=130 -mask=b -p_drop=0.1 -logits_soft_cap=20 -bias=e:1 -sink=1
done
done
done

# fp8 (hopper family, batch mode; -prec=fp8 is e4m3 q/k/v with bf16 o): per-tensor descales (-qscale=pt) and unscaled
# full-range data (-qscale=n -init=ufq), odd lengths, every mask kind, GQA / MQA, no keys, head dims below the bucket.
if want fp8 && { [ "$FP8" = 1 ] || [ "$FP8" = only ]; }; then
for hdim in ${MHA_FP8_HDIMS:-128 256}; do
for perm in 0 1; do
    p=(-prec=fp8 -mode=0 -d="$hdim" -iperm="$perm" -operm="$perm" -lse=1)
    run "${p[@]}" -qscale=pt -init=nf -b=2 -h=3 -s=100 -s_k=51
    run "${p[@]}" -qscale=n -init=ufq -b=1 -h=2 -s=77 -s_k=300
    run "${p[@]}" -qscale=pt -b=2 -h=4 -h_k=1 -s=257 -s_k=257 -mask=2
    run "${p[@]}" -qscale=pt -b=1 -h=2 -h_k=1 -s=1024 -s_k=256 -mask=t
    run "${p[@]}" -qscale=pt -b=3 -h=2 -h_k=1 -s=200 -s_k=520 -mask=t:128,30
    run "${p[@]}" -qscale=pt -b=1 -h=2 -s=33 -s_k=0 -mask=2
    run "${p[@]}" -qscale=pt -b=1 -h=2 -s=1 -s_k=1000 -mask=b:100,0
    run -prec=fp8 -mode=0 -d=$((hdim - 32)) -d_v=$((hdim - 64)) -iperm="$perm" -operm="$perm" -lse=1 -qscale=pt \
        -b=2 -h=2 -s=130 -s_k=190 -mask=g:50,80
done
done
fi

run_all
smoke_finish
