#!/usr/bin/env bash
# Build mhakit's MHA libraries and benchmark executables into the current directory.
#
#   bash build_mha.sh            # forward and backward
#   bash build_mha.sh fwd        # libmha_fwd.so + benchmark_mha_fwd
#   bash build_mha.sh bwd        # libmha_bwd.so + benchmark_mha_bwd (and libmha_fwd.so, which that benchmark runs)
#   bash build_mha.sh fwd_v3     # the same, with only the arch-specialised (Hopper) kernels (also bwd_v3)
#   bash build_mha.sh fwd --profile minimal -j 16    # anything after the API goes to compile.py
#
# When a GPU is visible (NVIDIA, or AMD with ROCm), the freshly built benchmark runs one default case as a check
# (MHA_SKIP_RUN=1 skips it); otherwise it says in one line that it skipped that run. --arch gfx942 (or an AMD GPU
# present) builds the ROCm backend: see the README.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-python3}"

api="${1:-all}"
[ $# -gt 0 ] && shift

build_api() {
    "$python" "$here/compile.py" --api "$1" --benchmark "${@:2}"
}

have_gpu() {  # an NVIDIA GPU, or an AMD GPU with its ROCm runtime
    { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; } ||
        { [ -e /dev/kfd ] && command -v rocminfo >/dev/null 2>&1 && rocminfo 2>/dev/null | grep -q 'Name:.*gfx'; }
}

run_check() {  # one default case with CPU validation, only where a GPU is present and the benchmark was linked;
               # says so when it skips it
    local exe="./benchmark_mha_$1"
    if [ "${MHA_SKIP_RUN:-0}" = "1" ]; then
        echo "[build_mha] skipped the validation run of $exe (MHA_SKIP_RUN=1)"
    elif ! have_gpu; then
        echo "[build_mha] skipped the validation run of $exe: no GPU visible (neither nvidia-smi -L nor rocminfo found one)"
    elif [ ! -x "$exe" ]; then
        echo "[build_mha] skipped the validation run of $exe: it was compiled but not linked (see above)"
    else
        echo "[build_mha] running $exe -prec=bf16 -b=2 -h=8 -s=512 -d=128 -v=1"
        "$exe" -prec=bf16 -b=2 -h=8 -s=512 -d=128 -v=1
    fi
}

case "$api" in
    fwd|fwd_v3)
        build_api "$api" "$@"
        run_check fwd ;;
    bwd|bwd_v3)
        build_api "${api/bwd/fwd}" "$@"   # benchmark_mha_bwd runs the forward for O and LSE
        build_api "$api" "$@"
        run_check bwd ;;
    all)
        build_api fwd "$@"
        build_api bwd "$@"
        run_check fwd
        run_check bwd ;;
    -h|--help|help)
        sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
        exit 0 ;;
    *)
        echo "build_mha.sh: unknown target '$api' (use fwd, bwd, fwd_v3, bwd_v3, or nothing for all)" >&2
        exit 2 ;;
esac
