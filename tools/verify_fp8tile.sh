#!/usr/bin/env bash
# The fp8 d128 tile sweep (branch fp8tile, issue 12 item 5: fp8 forward at hd 128 past 1000 TFLOPS), in two parts:
#
#   bash tools/verify_fp8tile.sh build [TILE...]   # the 2-core machine, before the device call (-j 2: ~12 min)
#   bash tools/verify_fp8tile.sh run [TILE...]     # the H200, from those prebuilt libraries, no compiling (~2 min)
#
# TILE: b128x<N>, default every fp8 d128 width of the catalogue. MHAKIT_FP8TILE_JOBS: the build's -j (default 2).
#
# build: one directory per fp8 d128 tile of the catalogue (the chosen one and the `candidate = true` ones, read from
#   codegen/catalogue/cuda.toml), build/verify_fp8tile/b128x<N>/, each holding libmha_fwd.so with that tile's two
#   fp8bf16 d128 batch instances (masked and not) and the bf16 d128 batch unmasked Hopper instance (the peer row),
#   plus benchmark_mha_fwd. Objects go to $MHAKIT_FP8TILE_OBJ (default /tmp/mhakit_fp8tile_obj), shared by the
#   libraries (the bf16 instance and the runtime compile once). Carry build/verify_fp8tile to the device machine.
# run: per tile library, (1) bench/bench_fwd.py --dtype bf16,fp8 --peers cudnn at hd 128, s = 16k causal and not,
#   s = 4k not (fp8 checked against fp32 on the dequantized inputs), (2) the forward smoke grid's fp8 section at
#   hd 128 (16 runs: odd lengths, every mask kind, GQA / MQA, no keys, d 96 x d_v 64, validated on the host),
#   (3) one compute-sanitizer memcheck case (GQA, s_q 333, s_k 517: a partial last key tile for every width);
#   (2) and (3) of every tile run first, in parallel (nothing is timed then), then (1) one library at a time; then a
#   table of TFLOPS per tile. Logs under $OUT (else ./verify_fp8tile_logs).
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
libs=$repo/build/verify_fp8tile
step=${1:-}
shift
picked=("$@")
summary=()
note() { summary+=("$1"); echo "== $1"; }
elapsed() { echo "$(( $(date +%s) - $1 )) s"; }

# The tiles of the fp8bf16 d128 batch unmasked instances the catalogue describes, candidates included (b128x192 ...),
# or those named on the command line.
tiles() {
    if [ "${#picked[@]}" -gt 0 ]; then
        echo "${picked[@]}"
        return
    fi
    python3 - <<'PY'
from codegen import profiles
specs = profiles.enumerate_specs("fwd", "sm_90a", candidates=True).specs
print(" ".join(sorted({s.algorithm.tile_token for s in specs
                       if s.name.startswith("fwd_d128_fp8bf16_batch_nmask_sm90a_hopper_")},
                      key=lambda t: int(t.split("x")[1]))))
PY
}

case "$step" in
build)
    obj=${MHAKIT_FP8TILE_OBJ:-/tmp/mhakit_fp8tile_obj}
    logs=$libs/build_logs
    mkdir -p "$libs" "$logs"
    start=$(date +%s)
    for tile in $(tiles); do
        mkdir -p "$libs/$tile"
        t0=$(date +%s)
        (cd "$libs/$tile" && python3 "$repo/compile.py" --api fwd --arch sm_90a --profile candidates \
            --filter "fwd_d128_fp8bf16_batch_*_sm90a_hopper_$tile,fwd_d128_bf16_batch_nmask_sm90a_hopper" \
            --benchmark -j "${MHAKIT_FP8TILE_JOBS:-2}" --build-dir "$obj") >"$logs/$tile.log" 2>&1
        note "build $tile: rc=$? in $(elapsed "$t0"): $(tail -1 "$logs/$tile.log")"
    done
    note "built in $(elapsed "$start"): $(du -sh --exclude=build_logs "$libs" | cut -f1) under $libs"
    echo "carry: build/verify_fp8tile (the run step reads $libs/<tile>/{libmha_fwd.so,benchmark_mha_fwd})"
    ;;
run)
    logs=${OUT:-$repo/verify_fp8tile_logs}
    mkdir -p "$logs"
    export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
    nvidia-smi --query-gpu=name,compute_cap,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$logs/gpu.txt"
    start=$(date +%s)
    ready=()
    for tile in $(tiles); do
        if [ -f "$libs/$tile/libmha_fwd.so" ] && [ -x "$libs/$tile/benchmark_mha_fwd" ]; then
            ready+=("$tile")
        else
            note "$tile: no prebuilt library in $libs/$tile (run the build step and carry build/verify_fp8tile)"
        fi
    done
    # Correctness first, every tile at once (host-validated smoke runs and memcheck: nothing timed yet) ...
    for tile in "${ready[@]}"; do
        dir=$libs/$tile
        (MHA_FP8=only MHA_FP8_HDIMS=128 BENCH="$dir/benchmark_mha_fwd" bash smoke_tests/smoke_test_fwd.sh -k -j 2 \
            >"$logs/smoke_$tile.log" 2>&1; echo "rc=$?" >>"$logs/smoke_$tile.log") &
        (compute-sanitizer --tool memcheck --error-exitcode 99 "$dir/benchmark_mha_fwd" -prec=fp8 -qscale=pt -b=2 \
            -h=4 -h_k=2 -d=128 -s=333 -s_k=517 -lse=1 -v=1 -warmup=0 -repeat=1 -kname=1 \
            >"$logs/memcheck_$tile.log" 2>&1; echo "rc=$?" >>"$logs/memcheck_$tile.log") &
    done
    wait
    for tile in "${ready[@]}"; do
        note "$tile: smoke $(tail -2 "$logs/smoke_$tile.log" | tr '\n' ' '); memcheck $(grep -o 'ERROR SUMMARY: [0-9]* errors' "$logs/memcheck_$tile.log") $(tail -1 "$logs/memcheck_$tile.log"), $(grep -o 'mha_fwd -> [^ ,]*' "$logs/memcheck_$tile.log" | head -1)"
    done
    note "correctness (smoke + memcheck of every tile, in parallel) in $(elapsed "$start")"
    # ... then the timing, one library at a time.
    for tile in "${ready[@]}"; do
        t0=$(date +%s)
        python3 bench/bench_fwd.py --lib "$libs/$tile/libmha_fwd.so" --dtype bf16,fp8 --peers cudnn \
            --shape 128,16384,0 --shape 128,16384,1 --shape 128,4096,0 --json "$logs/bench_$tile.json" \
            >"$logs/bench_$tile.md" 2>"$logs/bench_$tile.err"
        note "$tile: bench rc=$? in $(elapsed "$t0") ($(grep -c FAIL "$logs/bench_$tile.md") FAIL rows)"
    done
    python3 - "$logs" <<'PY' | tee "$logs/table.md"
import glob, json, os, re, sys
logs = sys.argv[1]
tiles = sorted({os.path.basename(f).split("_", 1)[1].rsplit(".", 1)[0]
                for f in glob.glob(os.path.join(logs, "bench_b*.json")) + glob.glob(os.path.join(logs, "smoke_b*.log"))},
               key=lambda t: int(t.rsplit("x", 1)[1]))
shapes = [(128, 16384, False), (128, 16384, True), (128, 4096, False)]
def cell(rows, dtype, shape, key="mhakit_tflops"):
    for r in rows:
        if (r["dtype"], r["hdim"], r["seqlen"], bool(r["causal"])) == (dtype, *shape):
            v = r.get(key)
            text = "-" if v is None else f"{v:.2e}" if key == "max_abs_err" else f"{v:.1f}"
            return text + (" FAIL" if r.get("verified") is False else "")
    return "-"
head = " | ".join(f"fp8 s={s} {'causal' if c else 'nc'}" for _, s, c in shapes)
def last_match(path, pattern):
    try:
        found = re.findall(pattern, open(path, errors="replace").read())
    except OSError:
        return "no log"
    return found[-1] if found else "?"
print(f"| tile | {head} | bf16 s=16384 nc | cuDNN bf16 s=16384 nc | fp8 max abs err (16k nc / causal) "
      "| fp8 kernel (16k nc) | smoke | memcheck |")
print("|---" * (len(shapes) + 7) + "|")
for tile in tiles:
    bench = os.path.join(logs, f"bench_{tile}.json")
    rows = json.load(open(bench))["rows"] if os.path.exists(bench) else []  # no rows: the bench failed (see .err)
    errs = " / ".join(cell(rows, "fp8", s, "max_abs_err") for s in shapes[:2])
    kernel = next((r.get("kernel") for r in rows if r["dtype"] == "fp8" and r["seqlen"] == 16384
                   and not r["causal"]), None) or "-"
    smoke = last_match(os.path.join(logs, f"smoke_{tile}.log"), r"\d+ passed, \d+ failed")
    memcheck = last_match(os.path.join(logs, f"memcheck_{tile}.log"), r"ERROR SUMMARY: \d+ errors?")
    print(f"| {tile} | " + " | ".join(cell(rows, "fp8", s) for s in shapes)
          + f" | {cell(rows, 'bf16', shapes[0])} | {cell(rows, 'fp8', shapes[0], 'cudnn_tflops')} | {errs} "
          + f"| {kernel.rsplit('_', 1)[-1]} | {smoke} | {memcheck} |")
PY
    note "run in $(elapsed "$start"); table in $logs/table.md (kernel names in bench_<tile>.md)"
    ;;
*)
    echo "usage: bash tools/verify_fp8tile.sh build|run" >&2
    exit 2
    ;;
esac

echo
echo "== summary"
printf '%s\n' "${summary[@]}"
