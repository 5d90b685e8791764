#!/usr/bin/env python3
"""Backward-pass peer comparison on one GPU: mhakit (libmha_bwd.so through ctypes) vs the backward of PyTorch SDPA
with the cuDNN backend and with the FlashAttention-2 backend, all in one process, on the same tensors.

Shapes and output format are those of bench/bench_fwd.py: 16384 tokens in total (batch = 16384 / seqlen), hidden size 2048
(heads = 2048 / hdim), q, k, v and dO random normal, contiguous [b, h, s, d]; s_q = s_k; causal =
MHAKIT_MASK_TOP_LEFT (-1, 0) = SDPA's is_causal. FLOPs: 2.5 x the forward's = 10*b*h*s*s*d, halved when causal
(FlashAttention convention).

What is timed, backward only:
  * mhakit: one mhakit_mha_bwd call per launch (every stage: dot(dO, O), the main kernel, dQ conversion / GQA
    reduction, and any workspace clearing the library does). Its inputs O and LSE come from mhakit's forward
    (libmha_fwd.so, run once before); the workspace is allocated once, outside the timing.
  * peers: ``torch.autograd.grad(out, (q, k, v), dO, retain_graph=True)`` on the graph of one SDPA call made under
    ``sdpa_kernel(backend)``, i.e. exactly the backward kernels that backend launches (its own preprocessing and
    dQ accumulation included) plus the autograd engine's host-side dispatch, which the GPU-side timing hides as long
    as the GPU stays ahead of the host (see the spin-wait in bench_fwd.time_launches).
Timing: 5 warm-up launches, then the median of 20 launches, each between its own pair of CUDA events.

Before timing, mhakit's dQ, dK, dV are checked against fp32 gradients (SDPA's math backend on the inputs upcast to
fp32, TF32 off, over the first sequence and its first two heads) with CK's rule |ours - ref| <= atol + rtol*|ref| at
aiter's backward tolerance (1e-2; bf16 with hdim > 128: 3.2e-2); the max abs error of ours and of each peer against
that same reference is printed, so a disagreement between two 16-bit kernels can be attributed.

    python3 bench/bench_bwd.py --lib ./libmha_bwd.so --fwd-lib ./libmha_fwd.so     # bf16, 18 shapes
    python3 bench/bench_bwd.py --shape 128,16384,0                                 # the issue's bar case
    python3 bench/bench_bwd.py --dtype bf16,fp16 --deterministic --json bwd.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run in place: the repository root holds mhakit/
sys.path.insert(0, str(Path(__file__).resolve().parent))      # bench_fwd.py (shared timing and formatting)

import torch  # noqa: E402  (torch lives in bench/ only, never in mhakit/)
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from bench_fwd import (DTYPES, PEERS, add_grid_arguments, attend, check_grid_arguments, fmt,  # noqa: E402
                       hdim_label, heads_label, kv_heads_of, time_launches)
from mhakit import _capi  # noqa: E402
from mhakit.reference import flops_bwd, tolerances_bwd  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lib", default="./libmha_bwd.so", help="path of libmha_bwd.so (default ./libmha_bwd.so)")
    p.add_argument("--fwd-lib", default=None,
                   help="path of libmha_fwd.so, which produces O and LSE (default: next to --lib)")
    p.add_argument("--deterministic", action="store_true",
                   help="run mhakit's backward with deterministic = 1 (peers are run as they are)")
    add_grid_arguments(p)
    args = p.parse_args(argv)
    if args.fwd_lib is None:
        args.fwd_lib = str(Path(args.lib).resolve().parent / "libmha_fwd.so")
    check_grid_arguments(p, args)
    return args


def bhs(t):
    """(batch, head, row) element strides of a b·h·s·d tensor."""
    return (t.stride(0), t.stride(1), t.stride(2))


REF_HEADS = 2  # heads of the first sequence checked against the fp32 reference


def ref_heads(q, k):
    """(query heads, kv heads) of the reference slice: REF_HEADS of each, or under GQA / MQA one kv head and its
    whole group of query heads (a kv head's dK and dV sum over all of them)."""
    group = q.shape[1] // k.shape[1]
    return (REF_HEADS, REF_HEADS) if group == 1 else (group, 1)


def fp32_reference_grads(q, k, v, do, causal, scale):
    """dQ, dK, dV of the first sequence's reference heads (ref_heads), in fp32 (SDPA math backend, TF32 off)."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    hq, hk = ref_heads(q, k)
    try:
        qf = q[:1, :hq].float().requires_grad_(True)
        kf, vf = (t[:1, :hk].float().requires_grad_(True) for t in (k, v))
        with sdpa_kernel(SDPBackend.MATH):
            out = attend(qf, kf, vf, causal, scale)
        return torch.autograd.grad(out, (qf, kf, vf), do[:1, :hq].float())
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def ref_slices(dq, dk, dv):
    """The reference slice of full-size gradients."""
    hq, hk = ref_heads(dq, dk)
    return dq[:1, :hq], dk[:1, :hk], dv[:1, :hk]


def ck_check(grads, ref, rtol, atol):
    """CK's rule |out - ref| <= atol + rtol * |ref| on the reference slice (grads: already sliced, see ref_slices);
    returns (passed, max abs error)."""
    ok, worst = True, 0.0
    for g, r in zip(grads, ref):
        gf = g.float()
        diff = (gf - r).abs()
        finite = bool(torch.isfinite(gf).all().item())
        worst = max(worst, diff.max().item() if finite else float("nan"))
        ok = ok and finite and bool((diff <= atol + rtol * r.abs()).all().item())
    return ok, worst


def run_case(fwd_lib, bwd_lib, dtype_name: str, hdims: tuple[int, int], seqlen: int, causal: bool, opts) -> dict:
    dt = DTYPES[dtype_name]
    hdim, hdim_v = hdims
    batch, heads = opts.tokens // seqlen, opts.hidden // hdim
    heads_kv = kv_heads_of(opts, heads)
    scale = 1.0 / math.sqrt(hdim)
    flops = flops_bwd(batch, heads, seqlen, seqlen, hdim, hdim_v, causal)
    row = {"dtype": dtype_name, "hdim": hdim_label(hdim, hdim_v), "seqlen": seqlen, "batch": batch, "heads": heads,
           "heads_kv": heads_kv, "causal": causal, "flops": flops, "deterministic": opts.deterministic, "kernel": None,
           "verified": None, "max_abs_err": None, "notes": []}

    gen = torch.Generator(device="cuda").manual_seed(opts.seed)
    shape, shape_v = (batch, heads, seqlen, hdim), (batch, heads, seqlen, hdim_v)
    shape_k, shape_kv = (batch, heads_kv, seqlen, hdim), (batch, heads_kv, seqlen, hdim_v)
    q, k, v, do = (torch.randn(sh, device="cuda", dtype=dt, generator=gen)
                   for sh in (shape, shape_k, shape_kv, shape_v))
    o = torch.zeros(shape_v, device="cuda", dtype=dt)
    lse = torch.empty((batch, heads, seqlen), device="cuda", dtype=torch.float32)
    dq, dk, dv = (torch.empty(sh, device="cuda", dtype=dt) for sh in (shape, shape_k, shape_kv))
    stream = torch.cuda.current_stream().cuda_stream
    cfg = _capi.make_stream_config(stream)
    mask = dict(mask_type=_capi.MASK_TOP_LEFT if causal else _capi.MASK_NONE, window_left=-1,
                window_right=0 if causal else -1)

    # --- our forward once (O and LSE), then the backward's arguments and workspace ---------------------------
    ours_ok = False
    ws = None
    bargs = None
    fargs = _capi.make_fwd_args(
        dtype=dtype_name, q_ptr=q.data_ptr(), k_ptr=k.data_ptr(), v_ptr=v.data_ptr(), o_ptr=o.data_ptr(),
        lse_ptr=lse.data_ptr(), lse_strides=(lse.stride(0), lse.stride(1)), batch=batch, seqlen_q=seqlen,
        seqlen_k=seqlen, nhead_q=heads, nhead_k=heads_kv, hdim_q=hdim, hdim_v=hdim_v, q_strides=bhs(q),
        k_strides=bhs(k), v_strides=bhs(v), o_strides=bhs(o), scale=scale, **mask)
    ret = fwd_lib.mha_fwd_raw(fargs, cfg)
    torch.cuda.synchronize()
    if ret < 0:
        row["notes"].append(f"mhakit forward returned {ret:g}: {fwd_lib.last_error()}")
    else:
        bargs = _capi.make_bwd_args(
            dtype=dtype_name, q_ptr=q.data_ptr(), k_ptr=k.data_ptr(), v_ptr=v.data_ptr(), o_ptr=o.data_ptr(),
            lse_ptr=lse.data_ptr(), do_ptr=do.data_ptr(), dq_ptr=dq.data_ptr(), dk_ptr=dk.data_ptr(),
            dv_ptr=dv.data_ptr(), batch=batch, seqlen_q=seqlen, seqlen_k=seqlen, nhead_q=heads, nhead_k=heads_kv,
            hdim_q=hdim, hdim_v=hdim_v, q_strides=bhs(q), k_strides=bhs(k), v_strides=bhs(v), o_strides=bhs(o),
            do_strides=bhs(do), dq_strides=bhs(dq), dk_strides=bhs(dk), dv_strides=bhs(dv),
            lse_strides=(lse.stride(0), lse.stride(1)), deterministic=opts.deterministic, scale=scale, **mask)
        try:
            nbytes = bwd_lib.workspace_size(bargs)
        except _capi.MhakitError as e:
            row["notes"].append(f"mhakit workspace query: {e.message}")
        else:
            ws = torch.empty(max(nbytes, 1), device="cuda", dtype=torch.uint8)
            bargs.workspace_ptr = ws.data_ptr() if nbytes else None
            bargs.workspace_bytes = nbytes
            row["workspace_bytes"] = nbytes
            row["kernel"] = bwd_lib.kernel_name(bargs)
            ret = bwd_lib.mha_bwd_raw(bargs, cfg)
            torch.cuda.synchronize()
            if ret < 0:
                row["notes"].append(f"mhakit backward returned {ret:g}: {bwd_lib.last_error()}")
            else:
                ours_ok = True

    # --- peers: one SDPA forward each (graph kept), gradients once --------------------------------------------
    graphs, peer_grads = {}, {}
    for name in opts.peer_list:
        try:
            qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
            with sdpa_kernel(PEERS[name]):
                out = attend(qg, kg, vg, causal, scale)
                grads = torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True)
            torch.cuda.synchronize()
            graphs[name] = (out, (qg, kg, vg))
            peer_grads[name] = tuple(g.float() for g in ref_slices(*grads))
            del grads
        except RuntimeError as e:  # backend cannot serve this shape / dtype
            row["notes"].append(f"{name}: {str(e).splitlines()[0]}")

    # --- correctness against an fp32 reference, before any timing ----------------------------------------------
    # Both we and the peers round P and dS to 16 bits, so two fast kernels can differ from each other by more than
    # either differs from the truth: judge each against fp32 SDPA (math backend, TF32 off) on the same inputs,
    # over the first sequence and REF_HEADS heads (heads are independent, so the slice is exact).
    if ours_ok:
        ref = fp32_reference_grads(q, k, v, do, causal, scale)
        rtol, atol = tolerances_bwd(dtype_name, hdim, hdim_v)
        ok, worst = ck_check(ref_slices(dq, dk, dv), ref, rtol, atol)
        row["max_abs_err"], row["verified"], row["reference"] = worst, ok, "fp32"
        for name, grads in peer_grads.items():
            row[f"{name}_max_abs_err"] = ck_check(grads, ref, rtol, atol)[1]
        if not ok:
            row["notes"].append(f"mhakit gradients differ from the fp32 reference beyond rtol={rtol} atol={atol}")
        del ref
    del peer_grads

    # --- timing (backward only) -------------------------------------------------------------------------------
    def tflops(ms):
        return flops / (ms * 1e-3) / 1e12

    row["mhakit_ms"] = row["mhakit_tflops"] = None
    if ours_ok:
        bwd = bwd_lib.cdll.mhakit_mha_bwd
        pargs, pcfg = ctypes.byref(bargs), ctypes.byref(cfg)
        rets = []
        ms = time_launches(lambda: rets.append(bwd(pargs, pcfg)), opts.warmup, opts.repeat)
        if min(rets) < 0:
            row["notes"].append(f"mhakit failed during timing: {bwd_lib.last_error()}")
        else:
            row["mhakit_ms"], row["mhakit_tflops"] = ms, tflops(ms)
    for name in PEERS:
        row[f"{name}_ms"] = row[f"{name}_tflops"] = None
    for name, (out, inputs) in graphs.items():
        with sdpa_kernel(PEERS[name]):
            ms = time_launches(lambda: torch.autograd.grad(out, inputs, do, retain_graph=True),
                               opts.warmup, opts.repeat)
        row[f"{name}_ms"], row[f"{name}_tflops"] = ms, tflops(ms)
    for name in PEERS:
        ours, theirs = row["mhakit_tflops"], row[f"{name}_tflops"]
        row[f"mhakit_over_{name}"] = ours / theirs if ours and theirs else None
    del graphs, q, k, v, do, o, lse, dq, dk, dv, ws
    torch.cuda.empty_cache()
    return row


def print_table(rows, out=sys.stdout):
    print("| dtype | hdim | seqlen | batch x heads | causal | mhakit TFLOPS | cuDNN TFLOPS | FA2 TFLOPS "
          "| mhakit/cuDNN | mhakit/FA2 | max abs err vs fp32: mhakit / cuDNN | kernel |", file=out)
    print("|---|---|---|---|---|---|---|---|---|---|---|---|", file=out)
    for r in rows:
        dname = {"bf16": "bfloat16", "fp16": "float16"}[r["dtype"]]
        err = fmt(r["max_abs_err"], ".2e")
        if r["verified"] is False:
            err += " FAIL"
        err += " / " + fmt(r.get("cudnn_max_abs_err"), ".2e")
        print(f"| {dname} | {r['hdim']} | {r['seqlen']} | {r['batch']}x{heads_label(r['heads'], r['heads_kv'])} | "
              f"{'yes' if r['causal'] else 'no'} | {fmt(r['mhakit_tflops'])} | {fmt(r['cudnn_tflops'])} | "
              f"{fmt(r['fa2_tflops'])} | {fmt(r['mhakit_over_cudnn'], '.2f', 'x')} | "
              f"{fmt(r['mhakit_over_fa2'], '.2f', 'x')} | {err} | {r['kernel'] or '-'} |", file=out)
    out.flush()


def main(argv=None) -> int:
    opts = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_bwd: no CUDA device visible to torch", file=sys.stderr)
        return 2
    try:
        bwd_lib = _capi.load_bwd_library(opts.lib)
        fwd_lib = _capi.load_library(opts.fwd_lib)
    except (OSError, FileNotFoundError) as e:
        print(f"bench_bwd: cannot load the libraries: {e}", file=sys.stderr)
        return 2
    env = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(), "lib": bwd_lib.path,
           "fwd_lib": fwd_lib.path, "warmup": opts.warmup, "repeat": opts.repeat, "tokens": opts.tokens,
           "hidden": opts.hidden, "deterministic": opts.deterministic,
           "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:]))}
    print(f"# {env['device']}, torch {env['torch']} (CUDA {env['cuda']}, cuDNN {env['cudnn']}), lib {env['lib']}")
    print(f"# backward only: median of {opts.repeat} launches after {opts.warmup} warm-ups, CUDA events; "
          f"{opts.tokens} tokens, hidden {opts.hidden}, b.h.s.d, FLOPs 10*b*h*s*s*d (/2 causal); peers timed as "
          f"torch.autograd.grad of a retained SDPA graph" + ("; mhakit deterministic" if opts.deterministic else ""),
          flush=True)

    rows = []
    for dtype_name in opts.dtypes:
        for hdim, seqlen, causal in opts.cases:
            row = run_case(fwd_lib, bwd_lib, dtype_name, hdim, seqlen, causal, opts)
            rows.append(row)
            status = ("ok" if row["verified"] else "FAIL" if row["verified"] is False else "unchecked")
            print(f"# {dtype_name} d={row['hdim']} s={seqlen} causal={int(causal)}: check {status} "
                  f"(max abs err vs {row.get('reference', '-')}: mhakit {fmt(row['max_abs_err'], '.2e')}, "
                  f"cuDNN {fmt(row.get('cudnn_max_abs_err'), '.2e')}, FA2 {fmt(row.get('fa2_max_abs_err'), '.2e')}); "
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
