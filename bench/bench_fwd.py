#!/usr/bin/env python3
"""Forward-pass peer comparison on one GPU: mhakit (libmha_fwd.so through ctypes) vs PyTorch SDPA with the cuDNN
backend and with the FlashAttention-2 backend, all in one process, on the same tensors.

Problem shapes follow the FlashAttention-3 paper: 16384 tokens in
total (batch = 16384 / seqlen), hidden size 2048 (heads = 2048 / hdim), q, k, v random normal, allocated contiguous
as [b, h, s, d]; s_q = s_k; causal = MHAKIT_MASK_TOP_LEFT (-1, 0), which equals SDPA's is_causal when s_q == s_k.
Timing: 5 warm-up launches, then the median of 20 launches, each between its own pair of CUDA events, on the
current torch stream (the GPU is kept busy while the host enqueues, so host launch overhead is not timed). Inputs
are not rotated. FLOPs: 4*b*h*s*s*d, halved when causal (FlashAttention convention).

Before timing, mhakit's output is checked against SDPA's (cuDNN's, else FA2's) with CK's rule
|out - ref| <= atol + rtol*|ref| (bf16 1e-2/1e-2, fp16 1e-3/1e-3) and the max abs error is printed.

    python3 bench/bench_fwd.py --lib ./libmha_fwd.so                       # bf16, 18 shapes
    python3 bench/bench_fwd.py --dtype bf16,fp16 --json fwd.json
    python3 bench/bench_fwd.py --shape 128,4096,1 --dtype fp16              # hdim, seqlen, causal
    python3 bench/bench_fwd.py --dtype bf16,fp8 --shape 128,16384,0         # fp8 rows beside bf16 ones

fp8 rows (--dtype fp8: e4m3 q/k/v with per-tensor descale factors, bf16 O; Hopper): q, k, v are drawn as for bf16,
quantized per tensor (x / (max|x| / 448), rounded to e4m3), and mhakit runs on those bytes; the peers run bf16 on the
same (dequantized) values, so the row compares mhakit's fp8 with cuDNN's and FA2's bf16. The check is against fp32
on the dequantized inputs (batch 0, the first and last query head, the first 256 query rows, every key), with
mhakit.reference.tolerances_fp8; its max abs error is printed.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run in place: the repository root holds mhakit/

import torch  # noqa: E402  (torch lives in bench/ only, never in mhakit/)
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from mhakit import _capi, _codegen  # noqa: E402
from mhakit.reference import E4M3_MAX, flops_fwd, tolerances, tolerances_fp8  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
FWD_DTYPES = {**DTYPES, "fp8": torch.bfloat16}  # the forward's fp8 rows: bf16 is O's type and the peers'.
PEERS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "fa2": SDPBackend.FLASH_ATTENTION}
# Spin-wait put on the stream before the timed launches so that the GPU stays busy while the host enqueues them
# (about 10 ms at H200 clocks); without it the first events would time the host's launch latency too.
_SLEEP_CYCLES = 20_000_000


def add_grid_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments bench_fwd.py and bench_bwd.py share: dtypes, the shape grid, timing, peers, output."""
    p.add_argument("--dtype", default="bf16", help="comma list of bf16, fp16 (the forward: also fp8; default bf16)")
    p.add_argument("--shape", action="append", default=None, metavar="HDIM,SEQLEN,CAUSAL",
                   help="run only this case (causal: 0/1; HDIM may be QxV, e.g. 192x128); may be repeated")
    p.add_argument("--hdims", default="64,128,256",
                   help="comma list; QxV for hdim_q != hdim_v, e.g. 192x128 (default 64,128,256)")
    p.add_argument("--seqlens", default="1024,4096,16384", help="comma list (default 1024,4096,16384)")
    p.add_argument("--tokens", type=int, default=16384, help="total tokens: batch = tokens / seqlen (16384)")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size: heads = hidden / hdim (2048)")
    p.add_argument("--kv-heads", type=int, default=0, metavar="HK",
                   help="K/V heads (GQA / MQA; they must divide the query heads); 0: as many as query heads")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--peers", default="cudnn,fa2", help="comma list of SDPA backends to run: cudnn, fa2")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="OUT.json", help="also write the results as JSON")


def head_dims_of(token: str) -> tuple[int, int]:
    """(hdim_q, hdim_v) of a grid token: "128" or "192x128"."""
    hq, _, hv = token.strip().partition("x")
    return int(hq), int(hv or hq)


def hdim_label(hq: int, hv: int):
    """The table's and JSON's hdim: the head dim, or "QxV" when they differ."""
    return hq if hq == hv else f"{hq}x{hv}"


def check_grid_arguments(p: argparse.ArgumentParser, args: argparse.Namespace, dtypes=DTYPES) -> None:
    """Validate the shared arguments and derive args.dtypes, args.peer_list and args.cases (hdim, seqlen, causal)."""
    args.dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    for d in args.dtypes:
        if d not in dtypes:
            p.error(f"--dtype: unknown {d!r}; use {', '.join(dtypes)}")
    args.peer_list = [x.strip() for x in args.peers.split(",") if x.strip()]
    for x in args.peer_list:
        if x not in PEERS:
            p.error(f"--peers: unknown {x!r}; use cudnn and/or fa2")
    try:
        if args.shape:
            cases = []
            for s in args.shape:
                hd, sl, ca = s.split(",")
                cases.append((head_dims_of(hd), int(sl), bool(int(ca))))
        else:
            # row order: hdim, then seqlen, then causal no/yes (as the FlashAttention-3 paper's tables)
            cases = [(head_dims_of(hd), int(sl), ca) for hd in args.hdims.split(",")
                     for sl in args.seqlens.split(",") for ca in (False, True)]
    except ValueError:
        p.error("--shape HDIM,SEQLEN,CAUSAL (e.g. 128,4096,1 or 192x128,4096,0) and --hdims (e.g. 64,192x128) "
                "take integers")
    head_dims = _codegen.submodule("catalogue").load("cuda").head_dims  # the API's rule: catalogue data
    for (hq, hv), sl, _ in cases:
        for hd in (hq, hv):
            if not head_dims.accepts(hd):
                p.error(f"hdim {hd} is not supported; head dims must be {head_dims.describe()}")
        if sl <= 0 or args.tokens % sl or args.hidden % hq:
            p.error(f"hdim {hq} / seqlen {sl} must divide hidden {args.hidden} / tokens {args.tokens}")
        if args.kv_heads < 0 or (args.kv_heads and (args.hidden // hq) % args.kv_heads):
            p.error(f"--kv-heads {args.kv_heads} must divide the {args.hidden // hq} query heads of hdim {hq}")
    args.cases = cases
    if args.repeat < 1 or args.warmup < 0:
        p.error("--repeat must be >= 1 and --warmup >= 0")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lib", default="./libmha_fwd.so", help="path of libmha_fwd.so (default ./libmha_fwd.so)")
    p.add_argument("--lse", action="store_true", help="make mhakit store LSE too (SDPA inference stores none)")
    add_grid_arguments(p)
    args = p.parse_args(argv)
    check_grid_arguments(p, args, FWD_DTYPES)
    return args


def time_launches(fn, warmup: int, repeat: int) -> float:
    """Median milliseconds of ``repeat`` launches of fn, each between two CUDA events, after ``warmup`` launches."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeat)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeat)]
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(_SLEEP_CYCLES)
    for i in range(repeat):
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def kv_heads_of(opts, heads: int) -> int:
    """The K/V heads of a case: --kv-heads, or as many as the query heads."""
    return opts.kv_heads or heads


def heads_label(heads: int, heads_kv: int):
    """The table's heads: h, or "hq/hk" for GQA / MQA."""
    return f"{heads}" if heads == heads_kv else f"{heads}/{heads_kv}"


def attend(q, k, v, causal: bool, scale: float):
    """SDPA on b.h.s.d tensors with whichever backend is in force; GQA / MQA when K/V have fewer heads than Q."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=k.shape[1] != q.shape[1])


def sdpa(backend, q, k, v, causal: bool, scale: float):
    with sdpa_kernel(backend):
        return attend(q, k, v, causal, scale)


def run_case(lib, dtype_name: str, hdims: tuple[int, int], seqlen: int, causal: bool, opts) -> dict:
    dt = FWD_DTYPES[dtype_name]
    hdim, hdim_v = hdims
    batch, heads = opts.tokens // seqlen, opts.hidden // hdim
    heads_kv = kv_heads_of(opts, heads)
    scale = 1.0 / math.sqrt(hdim)
    flops = flops_fwd(batch, heads, seqlen, seqlen, hdim, hdim_v, causal)
    row = {"dtype": dtype_name, "hdim": hdim_label(hdim, hdim_v), "seqlen": seqlen, "batch": batch, "heads": heads,
           "heads_kv": heads_kv, "causal": causal, "flops": flops, "kernel": None, "verified": None,
           "max_abs_err": None, "notes": []}

    gen = torch.Generator(device="cuda").manual_seed(opts.seed)
    shape, shape_v = (batch, heads, seqlen, hdim), (batch, heads, seqlen, hdim_v)
    shape_k, shape_kv = (batch, heads_kv, seqlen, hdim), (batch, heads_kv, seqlen, hdim_v)
    q, k, v = (torch.randn(sh, device="cuda", dtype=dt, generator=gen) for sh in (shape, shape_k, shape_kv))
    o = torch.zeros(shape_v, device="cuda", dtype=dt)
    fp8 = dtype_name == "fp8"
    if fp8:  # mhakit gets e4m3 bytes and descale factors; the peers the same values in bf16
        (q8, k8, v8), descale = quantize_fp8((q, k, v))
        q, k, v = ((x.float() * descale[i]).to(dt) for i, x in enumerate((q8, k8, v8)))
    lse = torch.empty((batch, heads, seqlen), device="cuda", dtype=torch.float32) if opts.lse else None
    stream = torch.cuda.current_stream().cuda_stream

    def bhs(t):  # (batch, head, row) element strides of a b·h·s·d tensor
        return (t.stride(0), t.stride(1), t.stride(2))

    qm, km, vm = (q8, k8, v8) if fp8 else (q, k, v)  # what mhakit reads
    fargs = _capi.make_fwd_args(
        dtype="fp8bf16" if fp8 else dtype_name, q_ptr=qm.data_ptr(), k_ptr=km.data_ptr(), v_ptr=vm.data_ptr(),
        o_ptr=o.data_ptr(), descale_ptrs=[descale.data_ptr() + 4 * i for i in range(3)] if fp8 else None,
        lse_ptr=None if lse is None else lse.data_ptr(), lse_strides=(0, 0) if lse is None else (lse.stride(0),
                                                                                                  lse.stride(1)),
        batch=batch, seqlen_q=seqlen, seqlen_k=seqlen, nhead_q=heads, nhead_k=heads_kv, hdim_q=hdim, hdim_v=hdim_v,
        q_strides=bhs(qm), k_strides=bhs(km), v_strides=bhs(vm), o_strides=bhs(o), scale=scale,
        mask_type=_capi.MASK_TOP_LEFT if causal else _capi.MASK_NONE, window_left=-1,
        window_right=0 if causal else -1)
    # The workspace mhakit_mha_fwd_workspace_size asks for: fp8, V transposed; a persistent instance, its tile counter
    # (each call tags it anew: no zeroing needed). torch's allocations are 256-byte aligned.
    workspace = None
    try:
        need = lib.workspace_size(fargs)
    except _capi.MhakitError:
        need = 0  # refused: the kernel-name query below says why
    if need > 0 or fp8:
        workspace = torch.empty(max(need, 1), device="cuda", dtype=torch.uint8)
        fargs.workspace_ptr, fargs.workspace_bytes = workspace.data_ptr(), need
    cfg = _capi.make_stream_config(stream)
    fwd = lib.cdll.mhakit_mha_fwd
    pargs, pcfg = ctypes.byref(fargs), ctypes.byref(cfg)

    # --- our forward, once, for the kernel name and the check -----------------------------------------------
    ours_ok = False
    row["kernel"] = lib.kernel_name(fargs)
    if row["kernel"] is None:
        row["notes"].append(f"mhakit: {lib.last_error()}")
    else:
        ret = fwd(pargs, pcfg)
        torch.cuda.synchronize()
        if ret < 0:
            row["notes"].append(f"mhakit returned {ret:g}: {lib.last_error()}")
        else:
            ours_ok = True

    # --- peers, once each; the first one that runs is the reference for the check ---------------------------
    ref = None
    peer_ok = {}
    for name in opts.peer_list:
        try:
            out = sdpa(PEERS[name], q, k, v, causal, scale)
            torch.cuda.synchronize()
            peer_ok[name] = True
            if ref is None:
                ref, row["reference"] = out, name
            else:
                del out
        except RuntimeError as e:  # backend cannot serve this shape / dtype
            peer_ok[name] = False
            row["notes"].append(f"{name}: {str(e).splitlines()[0]}")

    if ours_ok and fp8:
        row["max_abs_err"], row["verified"], why = check_fp8(q8, k8, v8, descale, o, causal, scale)
        row["reference"] = "fp32"
        if not row["verified"]:
            row["notes"].append(why)
    elif ours_ok and ref is not None:
        rtol, atol = tolerances(dtype_name)
        of, rf = o.float(), ref.float()
        diff = (of - rf).abs()
        finite = torch.isfinite(of).all().item()
        row["max_abs_err"] = diff.max().item() if finite else float("nan")
        row["verified"] = bool(finite and (diff <= atol + rtol * rf.abs()).all().item())
        del of, rf, diff
        if not row["verified"]:
            row["notes"].append(f"mhakit output differs from {row['reference']} beyond rtol={rtol} atol={atol}")
    del ref

    # --- timing ----------------------------------------------------------------------------------------------
    def tflops(ms):
        return flops / (ms * 1e-3) / 1e12

    row["mhakit_ms"] = row["mhakit_tflops"] = None
    if ours_ok:
        rets = []
        ms = time_launches(lambda: rets.append(fwd(pargs, pcfg)), opts.warmup, opts.repeat)
        if min(rets) < 0:
            row["notes"].append(f"mhakit failed during timing: {lib.last_error()}")
        else:
            row["mhakit_ms"], row["mhakit_tflops"] = ms, tflops(ms)
    for name in PEERS:
        row[f"{name}_ms"] = row[f"{name}_tflops"] = None
    for name in opts.peer_list:
        if peer_ok.get(name):
            with sdpa_kernel(PEERS[name]):
                ms = time_launches(lambda: attend(q, k, v, causal, scale), opts.warmup, opts.repeat)
            row[f"{name}_ms"], row[f"{name}_tflops"] = ms, tflops(ms)
    for name in PEERS:
        ours, theirs = row["mhakit_tflops"], row[f"{name}_tflops"]
        row[f"mhakit_over_{name}"] = ours / theirs if ours and theirs else None
    del q, k, v, o, lse, qm, km, vm, workspace
    torch.cuda.empty_cache()
    return row


def quantize_fp8(tensors):
    """Per-tensor e4m3 quantization (the benchmark's -qscale=pt): (e4m3 tensors, float32 [3] descale factors)."""
    descale = torch.empty(len(tensors), device="cuda", dtype=torch.float32)
    out = []
    for i, t in enumerate(tensors):
        amax = t.float().abs().max()
        descale[i] = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
        out.append((t.float() / descale[i]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn))
    return out, descale


def check_fp8(q8, k8, v8, descale, o, causal: bool, scale: float, rows: int = 256):
    """mhakit's fp8 O against fp32 on the dequantized inputs: batch 0, the first and last query head, the first
    `rows` query rows against every key (top-left causal as the call). (max abs err, ok, note)."""
    heads, heads_kv, seqlen = q8.shape[1], k8.shape[1], q8.shape[2]
    rows = min(rows, seqlen)
    vmax = (v8.float().abs().max() * descale[2]).item()
    rtol, atol = tolerances_fp8(vmax)
    worst, ok = 0.0, True
    for h in sorted({0, heads - 1}):
        hk = h // (heads // heads_kv)
        qf = q8[0, h, :rows].float() * descale[0]
        kf, vf = k8[0, hk].float() * descale[1], v8[0, hk].float() * descale[2]
        s = (qf @ kf.T) * scale
        if causal:
            s.masked_fill_(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
        ref = torch.softmax(s, dim=-1) @ vf
        out = o[0, h, :rows].float()
        diff = (out - ref).abs()
        worst = max(worst, diff.max().item())
        ok = ok and bool(torch.isfinite(out).all().item() and (diff <= atol + rtol * ref.abs()).all().item())
    return worst, ok, "" if ok else f"mhakit fp8 output differs from fp32 beyond rtol={rtol} atol={atol:.3g}"


def fmt(x, spec=".1f", suffix=""):
    return "-" if x is None else f"{x:{spec}}{suffix}"


def print_table(rows, out=sys.stdout):
    print("| dtype | hdim | seqlen | batch x heads | causal | mhakit TFLOPS | cuDNN TFLOPS | FA2 TFLOPS "
          "| mhakit/cuDNN | mhakit/FA2 | max abs err | kernel |", file=out)
    print("|---|---|---|---|---|---|---|---|---|---|---|---|", file=out)
    for r in rows:
        dname = {"bf16": "bfloat16", "fp16": "float16", "fp8": "fp8 e4m3 (peers bf16)"}[r["dtype"]]
        err = fmt(r["max_abs_err"], ".2e")
        if r["verified"] is False:
            err += " FAIL"
        print(f"| {dname} | {r['hdim']} | {r['seqlen']} | {r['batch']}x{heads_label(r['heads'], r['heads_kv'])} | "
              f"{'yes' if r['causal'] else 'no'} | {fmt(r['mhakit_tflops'])} | {fmt(r['cudnn_tflops'])} | "
              f"{fmt(r['fa2_tflops'])} | {fmt(r['mhakit_over_cudnn'], '.2f', 'x')} | "
              f"{fmt(r['mhakit_over_fa2'], '.2f', 'x')} | {err} | {r['kernel'] or '-'} |", file=out)
    out.flush()


def main(argv=None) -> int:
    opts = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_fwd: no CUDA device visible to torch", file=sys.stderr)
        return 2
    try:
        lib = _capi.load_library(opts.lib)
    except (OSError, FileNotFoundError) as e:
        print(f"bench_fwd: cannot load {opts.lib}: {e}", file=sys.stderr)
        return 2
    env = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(), "lib": lib.path,
           "warmup": opts.warmup, "repeat": opts.repeat, "tokens": opts.tokens, "hidden": opts.hidden,
           "lse": opts.lse, "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None
                                                                          else sys.argv[1:]))}
    print(f"# {env['device']}, torch {env['torch']} (CUDA {env['cuda']}, cuDNN {env['cudnn']}), lib {env['lib']}")
    print(f"# median of {opts.repeat} launches after {opts.warmup} warm-ups, CUDA events; "
          f"{opts.tokens} tokens, hidden {opts.hidden}, b.h.s.d, FLOPs 4*b*h*s*s*d (/2 causal)", flush=True)

    rows = []
    for dtype_name in opts.dtypes:
        for hdim, seqlen, causal in opts.cases:
            row = run_case(lib, dtype_name, hdim, seqlen, causal, opts)
            rows.append(row)
            status = ("ok" if row["verified"] else "FAIL" if row["verified"] is False else "unchecked")
            print(f"# {dtype_name} d={row['hdim']} s={seqlen} causal={int(causal)}: check {status} "
                  f"(max abs err {fmt(row['max_abs_err'], '.2e')} vs {row.get('reference', '-')}); "
                  f"mhakit {fmt(row['mhakit_tflops'])} cuDNN {fmt(row['cudnn_tflops'])} "
                  f"FA2 {fmt(row['fa2_tflops'])} TFLOPS" + "".join(f"; {n}" for n in row["notes"]),
                  file=sys.stderr, flush=True)
    print()
    print_table(rows)
    if opts.json:
        Path(opts.json).write_text(json.dumps({"env": env, "rows": rows}, indent=2) + "\n")
    return 0 if all(r["verified"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
