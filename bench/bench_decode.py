#!/usr/bin/env python3
"""Decode peer comparison on one GPU: mhakit.mha_fwd_kvcache (the C call path, torch tensors, out=) vs PyTorch SDPA
with the cuDNN backend and with the FlashAttention-2 backend, all in one process, on the same tensors.

Rows: issue 10's decode shapes (bf16, head dim 128; b, h_q/h_k, s_k) at s_q = 1, 4 and 16, plus mhakit on a paged
cache (64-token pages, shuffled) beside the contiguous one. Memory: q [b, s_q, h_q, d] and a full cache
[b, s_k, h_k, d] (FlashAttention's kv-cache layout); SDPA gets the same memory as [b, h, s, d] views with
enable_gqa=True. s_q > 1 is causal, bottom-right aligned (mhakit's causal=True; SDPA's causal_lower_right bias where
the backend takes it, else no mask, noted). The metric is K+V bytes read per second: b * s_k * h_k * (d + d_v) * 2
bytes over the median time, so GQA peers are not credited for reading K/V once per query head. A device-to-device
copy of 2 GiB in the same process gives the bandwidth the rows are measured against, and each row's "read ceiling"
is the best of a few plain streaming-read kernels that read exactly that row's K and V once (one launch, no math,
timed the same way): what any single kernel reading those bytes reached under this method, the per-call cost
included (a lower bound on the true ceiling, not a proof of it).

Timing: 5 warm-up launches, then the median of 30 launches, each between its own pair of CUDA events, behind a
spin-wait that keeps the GPU busy while the host enqueues (host overhead is not timed). mhakit's output is checked
against the first peer that runs (CK's rule, bf16 1e-2/1e-2).

    python3 bench/bench_decode.py                       # every row
    python3 bench/bench_decode.py --rows 1,16 --sq 1 --json decode.json
    python3 bench/bench_decode.py --lib build/x/libmha_fwd.so --peers ""   # a prebuilt library, no peers
    python3 bench/bench_decode.py --rows 16 --sq 1 --sk 2048,8192,32768   # one row at several cache lengths
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run in place: the repository root holds mhakit/
sys.path.insert(0, str(Path(__file__).resolve().parent))      # bench_fwd.py (shared timing)

import torch  # noqa: E402  (torch lives in bench/ only, never in mhakit/)
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import sdpa_kernel  # noqa: E402

import mhakit  # noqa: E402
from bench_fwd import DTYPES, PEERS, time_launches  # noqa: E402
from mhakit.reference import tolerances  # noqa: E402

# (batch, h_q, h_k, s_k): issue 10's rows
ROWS = [(1, 32, 8, 32768), (16, 32, 8, 8192), (64, 32, 8, 4096), (8, 64, 8, 65536), (128, 32, 32, 2048)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--hdim", type=int, default=128)
    p.add_argument("--rows", default=None, help="comma list of batch sizes selecting issue rows (default: all)")
    p.add_argument("--sq", default="1,4,16", help="comma list of query lengths (default 1,4,16)")
    p.add_argument("--sk", default=None,
                   help="comma list of cache lengths that replace each selected row's s_k (one row per length, the "
                        "row's batch and heads kept): a sweep that separates a call's fixed cost from its bytes")
    p.add_argument("--page", type=int, default=64, help="page size of the paged runs (0: none; default 64)")
    p.add_argument("--num-splits", type=int, default=0, help="mhakit's num_splits (default 0: its heuristic)")
    p.add_argument("--lib", metavar="LIBMHA_FWD.so",
                   help="a prebuilt libmha_fwd.so that serves mhakit's calls (default: the JIT's library, built on "
                        "first use); it must hold the split-KV instances the rows need")
    p.add_argument("--cache-layout", default="bshd", choices=["bshd", "bhsd"],
                   help="memory order of the cache (and of each page): bshd (FlashAttention's kv-cache, default) or "
                        "bhsd (each head's keys contiguous); the calls see [b, s, h, d] views either way")
    p.add_argument("--peers", default="cudnn,fa2", help="comma list of SDPA backends: cudnn, fa2")
    p.add_argument("--no-read-ceiling", dest="read_ceiling", action="store_false",
                   help="skip each row's read ceiling (plain streaming reads of its K and V; needs CuPy)")
    p.add_argument("--show-kernel", action="store_true",
                   help="print the split-KV instance of each row's first contiguous and paged call on stdout (the "
                        "library's log line: decode_tma or decode, and the split count)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--json", metavar="OUT.json")
    args = p.parse_args(argv)
    args.sq_list = [int(x) for x in args.sq.split(",") if x]
    want = None if args.rows is None else {int(x) for x in args.rows.split(",") if x}
    args.row_list = [r for r in ROWS if want is None or r[0] in want]
    if args.sk is not None:
        lengths = [int(x) for x in args.sk.split(",") if x]
        if not lengths or min(lengths) < 1:
            p.error("--sk: cache lengths >= 1")
        args.row_list = [(b, hq, hk, sk) for b, hq, hk, _ in args.row_list for sk in lengths]
    args.peer_list = [x for x in args.peers.split(",") if x]
    if args.lib is not None and not Path(args.lib).is_file():
        p.error(f"--lib: no file {args.lib}")
    for x in args.peer_list:
        if x not in PEERS:
            p.error(f"--peers: unknown {x!r}; use cudnn and/or fa2")
    return args


def copy_bandwidth() -> float:
    """TB/s of a device-to-device copy of 2 GiB (read + write counted)."""
    src = torch.empty(1 << 30, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    ms = time_launches(lambda: dst.copy_(src), 3, 20)
    del src, dst
    return 2 * (2 << 30) / (ms * 1e-3) / 1e12


# One streaming read of two buffers (K, then V) in 16-byte loads, evict-first, grid-stride, UNROLL loads in flight
# per thread; the XOR of what was read is stored only if it hits a constant, so that no load is dead code.
_READ_SRC = r"""
extern "C" __global__ void read_two(const uint4* __restrict__ a, unsigned long long na,
                                    const uint4* __restrict__ b, unsigned long long nb, unsigned int* sink) {
    const unsigned long long n = na + nb, stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned int acc = 0;
    const unsigned long long first = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (unsigned long long i = first; i < n; i += UNROLL * stride) {
        uint4 v[UNROLL];
#pragma unroll
        for (int j = 0; j < UNROLL; ++j) {
            const unsigned long long e = i + j * stride;
            v[j] = e < na ? __ldcs(a + e) : (e < n ? __ldcs(b + (e - na)) : make_uint4(0, 0, 0, 0));
        }
#pragma unroll
        for (int j = 0; j < UNROLL; ++j) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
    }
    if (acc == 0x9e3779b9u) sink[0] = acc;
}
"""
# (CTAs per SM, threads, loads in flight per thread) tried for each row's ceiling.
_READ_CONFIGS = [(2, 1024, 4), (4, 512, 4), (8, 256, 8), (4, 1024, 2), (16, 256, 4)]


def read_ceiling(a: torch.Tensor, b: torch.Tensor, warmup: int, repeat: int) -> tuple[float, str] | None:
    """Best median milliseconds of one kernel launch that reads the memory of a and b once (each tensor's whole
    storage: the row's caches own theirs) over _READ_CONFIGS, and the configuration; None without CuPy (the column
    then reads "-")."""
    try:
        import cupy
    except ImportError:
        return None
    a, b = a.untyped_storage(), b.untyped_storage()  # the whole cache, in either layout
    if (a.nbytes() | b.nbytes()) % 16:
        return None
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    sink = torch.zeros(1, dtype=torch.int32, device="cuda")
    best = None
    with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
        for per_sm, threads, unroll in _READ_CONFIGS:
            kern = cupy.RawKernel(_READ_SRC.replace("UNROLL", str(unroll)), "read_two")
            args = (cupy.uint64(a.data_ptr()), cupy.uint64(a.nbytes() // 16), cupy.uint64(b.data_ptr()),
                    cupy.uint64(b.nbytes() // 16), cupy.uint64(sink.data_ptr()))
            ms = time_launches(lambda: kern((sms * per_sm,), (threads,), args), warmup, repeat)  # noqa: B023
            if best is None or ms < best[0]:
                best = (ms, f"{per_sm} x {threads} threads x {unroll}")
    return best


def new_cache(shape, dt, layout: str, gen) -> torch.Tensor:
    """A random [n, s, h, d] tensor stored in `layout` order (bhsd: a transposed view of [n, h, s, d] memory)."""
    n, s, h, d = shape
    if layout == "bshd":
        return torch.randn((n, s, h, d), device="cuda", dtype=dt, generator=gen)
    return torch.randn((n, h, s, d), device="cuda", dtype=dt, generator=gen).transpose(1, 2)


def paged_copy(cache: torch.Tensor, page: int, perm: torch.Tensor, layout: str) -> torch.Tensor:
    """The cache [b, s, h, d] as pages [b * s / page, page, h, d] (each page stored in `layout` order): logical
    block i of the flattened cache goes to page perm[i] (the block table is perm viewed as [b, s / page])."""
    b, s, h, d = cache.shape
    pages = new_cache((b * s // page, page, h, d), cache.dtype, layout, None)
    pages[perm] = cache.reshape(b * s // page, page, h, d)
    return pages


def sdpa_call(name, q, k, v, sq, sk, scale):
    """A closure running one SDPA backend on [b, h, s, d] views (GQA native), and the mask it applies."""
    mask, note = None, "no mask"
    if sq > 1:
        from torch.nn.attention.bias import causal_lower_right
        mask, note = causal_lower_right(sq, sk), "causal lower right"

    def run(m):
        with sdpa_kernel(PEERS[name]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=scale, enable_gqa=True)
    try:
        out = run(mask)
    except RuntimeError as e:
        if mask is None:
            raise
        first = str(e).splitlines()[0]
        out, mask, note = run(None), None, f"no mask ({first[:80]})"
    return (lambda: run(mask)), out, note


def first_call(opts, fn) -> None:
    """fn() once; with --show-kernel at log level 1, so that the library prints the instance it launches."""
    if not opts.show_kernel:
        fn()
        return
    level, mhakit.api.LOG_LEVEL = mhakit.api.LOG_LEVEL, 1
    try:
        fn()
    finally:
        mhakit.api.LOG_LEVEL = level
        sys.stdout.flush()
        ctypes.CDLL(None).fflush(None)  # the library's printf, before the rows that follow


def use_library(path: str) -> str:
    """Serve mhakit's forward and split-KV calls (both call paths resolve them through jit.library) from the library
    at `path` instead of the JIT's; returns its resolved path."""
    from mhakit import _capi, jit
    lib = _capi.load_library(path)
    jit_library = jit.library

    def library(api, *args, **kwargs):
        return lib if api in ("fwd", "splitkv") else jit_library(api, *args, **kwargs)
    jit.library = library
    return str(lib.path)


def run_row(opts, b, hq, hk, sk, sq, gen) -> dict:
    dt, d = DTYPES[opts.dtype], opts.hdim
    scale = 1.0 / math.sqrt(d)
    kv_bytes = 2.0 * b * sk * hk * (d + d)
    row = {"dtype": opts.dtype, "b": b, "hq": hq, "hk": hk, "sq": sq, "sk": sk, "d": d, "kv_bytes": kv_bytes,
           "notes": []}
    q = torch.randn((b, sq, hq, d), device="cuda", dtype=dt, generator=gen)
    kc = new_cache((b, sk, hk, d), dt, opts.cache_layout, gen)
    vc = new_cache((b, sk, hk, d), dt, opts.cache_layout, gen)
    lens = torch.full((b,), sk, dtype=torch.int32, device="cuda")
    out = torch.empty((b, sq, hq, d), device="cuda", dtype=dt)
    causal = sq > 1

    def ours():
        mhakit.mha_fwd_kvcache(q, kc, vc, lens, causal=causal, num_splits=opts.num_splits, out=out)

    first_call(opts, ours)
    torch.cuda.synchronize()
    ref, ref_note = None, None
    peer_runs = {}
    for name in opts.peer_list:
        try:
            fn, o_peer, note = sdpa_call(name, q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2), sq, sk,
                                         scale)
            torch.cuda.synchronize()
            peer_runs[name] = fn
            row[f"{name}_mask"] = note
            if ref is None and (note == "causal lower right" or not causal):
                ref, ref_note = o_peer.transpose(1, 2), name
        except RuntimeError as e:
            row["notes"].append(f"{name}: {str(e).splitlines()[0][:120]}")
    row["verified"] = None
    if ref is not None:
        rtol, atol = tolerances(opts.dtype)
        diff = (out.float() - ref.float()).abs()
        row["max_abs_err"] = diff.max().item()
        row["verified"] = bool((diff <= atol + rtol * ref.float().abs()).all().item())
        row["reference"] = ref_note
        del diff
    del ref

    def tbs(ms):
        return kv_bytes / (ms * 1e-3) / 1e12

    row["mhakit_tbs"] = tbs(time_launches(ours, opts.warmup, opts.repeat))
    for name, fn in peer_runs.items():
        row[f"{name}_tbs"] = tbs(time_launches(fn, opts.warmup, opts.repeat))
    ceiling = None
    if opts.read_ceiling:
        try:
            ceiling = read_ceiling(kc, vc, opts.warmup, opts.repeat)
        except Exception as e:  # noqa: BLE001  (a reference column: its failure must not cost the row)
            row["notes"].append(f"read ceiling: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
    if ceiling is not None:
        row["read_ceiling_tbs"], row["read_ceiling_config"] = tbs(ceiling[0]), ceiling[1]
    if opts.page and sk % opts.page == 0:
        perm = torch.randperm(b * sk // opts.page, device="cuda", generator=gen)
        pk, pv = paged_copy(kc, opts.page, perm, opts.cache_layout), paged_copy(vc, opts.page, perm, opts.cache_layout)
        table = perm.view(b, sk // opts.page).to(torch.int32)
        out_p = torch.empty_like(out)

        def ours_paged():
            mhakit.mha_fwd_kvcache(q, pk, pv, lens, block_table=table, causal=causal, num_splits=opts.num_splits,
                                   out=out_p)
        first_call(opts, ours_paged)
        torch.cuda.synchronize()
        rtol, atol = tolerances(opts.dtype)
        row["paged_matches"] = bool(torch.allclose(out_p.float(), out.float(), rtol=rtol, atol=atol))
        row["mhakit_paged_tbs"] = tbs(time_launches(ours_paged, opts.warmup, opts.repeat))
        del pk, pv, table, out_p, perm
    best = max([row.get(f"{n}_tbs") or 0.0 for n in opts.peer_list] + [0.0])
    row["mhakit_over_best_peer"] = row["mhakit_tbs"] / best if best else None
    del q, kc, vc, out
    torch.cuda.empty_cache()
    return row


def fmt(x, spec=".2f"):
    return "-" if x is None else f"{x:{spec}}"


def main(argv=None) -> int:
    opts = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_decode: no CUDA device visible to torch", file=sys.stderr)
        return 2
    lib_path = use_library(opts.lib) if opts.lib else None
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy_tbs = copy_bandwidth()
    env = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "cache_layout": opts.cache_layout, "lib": lib_path, "num_splits": opts.num_splits,
           "cudnn": torch.backends.cudnn.version(), "copy_tbs": copy_tbs, "warmup": opts.warmup,
           "repeat": opts.repeat, "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None
                                                                                 else sys.argv[1:]))}
    print(f"# {env['device']}, torch {env['torch']} (CUDA {env['cuda']}, cuDNN {env['cudnn']}); device copy "
          f"{copy_tbs:.2f} TB/s; {opts.dtype} d{opts.hdim}, cache {opts.cache_layout}; median of {opts.repeat} "
          f"launches; K+V bytes read per second; library {lib_path or 'JIT'}, num_splits {opts.num_splits}",
          flush=True)
    rows = []
    for sq in opts.sq_list:
        for b, hq, hk, sk in opts.row_list:
            row = run_row(opts, b, hq, hk, sk, sq, gen)
            rows.append(row)
            print(f"# b={b} h={hq}/{hk} s_q={sq} s_k={sk}: mhakit {fmt(row['mhakit_tbs'])} paged "
                  f"{fmt(row.get('mhakit_paged_tbs'))} cuDNN {fmt(row.get('cudnn_tbs'))} FA2 {fmt(row.get('fa2_tbs'))}"
                  f" read ceiling {fmt(row.get('read_ceiling_tbs'))} ({row.get('read_ceiling_config', '-')})"
                  f" TB/s; check {row['verified']} ({row.get('reference', '-')}, max abs err "
                  f"{fmt(row.get('max_abs_err'), '.2e')})" + "".join(f"; {n}" for n in row["notes"]),
                  file=sys.stderr, flush=True)
    print()
    print("| b | h_q/h_k | s_q | s_k | mhakit TB/s | mhakit paged (64) | cuDNN | FA2 | mhakit / best peer | read ceiling "
          "| mhakit / ceiling | check |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        check = {True: "ok", False: "FAIL", None: "-"}[r["verified"]]
        if r.get("paged_matches") is False:
            check += ", paged differs"
        print(f"| {r['b']} | {r['hq']}/{r['hk']} | {r['sq']} | {r['sk']} | {fmt(r['mhakit_tbs'])} | "
              f"{fmt(r.get('mhakit_paged_tbs'))} | {fmt(r.get('cudnn_tbs'))} | {fmt(r.get('fa2_tbs'))} | "
              f"{fmt(r['mhakit_over_best_peer'])}x | {fmt(r.get('read_ceiling_tbs'))} | "
              f"{fmt(r['mhakit_tbs'] / r['read_ceiling_tbs'] if r.get('read_ceiling_tbs') else None)}x | {check} |")
    if opts.json:
        Path(opts.json).write_text(json.dumps({"env": env, "rows": rows}, indent=2) + "\n")
    ok = all(r["verified"] is not False and r.get("paged_matches") is not False for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
