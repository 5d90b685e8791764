#!/usr/bin/env python3
"""Variable-length (group mode) forward and backward against batch mode and the peers, on one GPU, in one process.

The same 16384 packed tokens (hd128, bf16/fp16, causal and not) three ways:
  * mhakit group mode (libmha_fwd.so through ctypes, packed [total, h, d] tensors, seqstart offsets);
  * mhakit batch mode on the same tokens (equal lengths) or, for mixed lengths, batch mode 4 x 4096 at the same
    head count (the bar: varlen >= 0.9x of it in useful FLOPs);
  * cuDNN through SDPA in batch mode (equal lengths), and PyTorch's FlashAttention-2 varlen
    (torch.nn.attention.varlen.varlen_attn) on the packed tokens.
Heads: MHA 16/16 and GQA 32/8. Lengths: "4x4096" (equal) and "mixed" (8 sequences, 128..4096, 16384 in all).
With --bwd-lib, the backward the same three ways (mhakit's dQ/dK/dV from its own forward's O and LSE, the
workspace allocated once outside the timing; FA2 varlen's and cuDNN's backward timed as `out.backward(dO)` on a
retained graph).
FLOPs are useful FLOPs, summed per sequence (FlashAttention convention: backward 2.5x forward, halved when causal).
Timing as bench_fwd.py: median of 20 launches between CUDA events after 5 warm-ups, the GPU kept busy while the host
enqueues. Each mhakit output is checked against FA2 varlen's (bf16 1e-2/1e-2, fp16 1e-3/1e-3; gradients at 4x) before
timing.

    python3 bench/bench_varlen.py --lib ./libmha_fwd.so [--bwd-lib ./libmha_bwd.so] [--dtype bf16,fp16] [--json F]
"""

from __future__ import annotations

import argparse
import ctypes
import inspect
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from bench_fwd import DTYPES, fmt, time_launches  # noqa: E402
from mhakit import _capi  # noqa: E402
from mhakit.reference import flops_bwd, flops_fwd, tolerances  # noqa: E402

LENGTHS = {"4x4096": [4096] * 4, "mixed": [4096, 128, 2048, 3000, 512, 1024, 4096, 1480]}
HEADS = [(16, 16), (32, 8)]
HDIM = 128


def fa2_varlen():
    """PyTorch's FA2 varlen entry point as a function (q, k, v, cu, max_len, causal, scale), or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters

    def call(q, k, v, cu, max_len, causal, scale):
        kw = {}
        if "scale" in params:
            kw["scale"] = scale
        if "enable_gqa" in params and q.shape[1] != k.shape[1]:
            kw["enable_gqa"] = True
        if "is_causal" in params:
            kw["is_causal"] = causal
        elif causal:
            kw["window_size"] = (-1, 0)
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kw)
    return call


def bhs(t):  # (batch, head, row) element strides of [total, h, d] (group mode) or [b, s, h, d]
    return (0, t.stride(1), t.stride(0)) if t.dim() == 3 else (t.stride(0), t.stride(2), t.stride(1))


def lse_strides(lse):  # [h, total] (group mode) or [b, h, s]
    return (0, lse.stride(0)) if lse.dim() == 2 else (lse.stride(0), lse.stride(1))


def common_args(q, k, v, batch, seqlen, cu, max_len, causal, scale):
    """The arguments forward and backward share: group mode when cu is given (q: [total, h, d]), else batch mode
    (q: [b, s, h, d]); causal is bottom-right (equal lengths per sequence here, so top-left too)."""
    group = cu is not None
    return dict(batch=batch, seqlen_q=q.shape[0] if group else seqlen, seqlen_k=k.shape[0] if group else seqlen,
                nhead_q=q.shape[-2], nhead_k=k.shape[-2], hdim_q=q.shape[-1], hdim_v=v.shape[-1],
                q_strides=bhs(q), k_strides=bhs(k), v_strides=bhs(v), seqstart_q_ptr=cu.data_ptr() if group else None,
                seqstart_k_ptr=cu.data_ptr() if group else None, max_seqlen_q=max_len if group else None,
                scale=scale, mask_type=_capi.MASK_BOTTOM_RIGHT if causal else _capi.MASK_NONE, window_left=-1,
                window_right=0 if causal else -1)


def launcher(lib, fn_name, args):
    cfg = _capi.make_stream_config(torch.cuda.current_stream().cuda_stream)
    fn, pa, pc = getattr(lib.cdll, fn_name), ctypes.byref(args), ctypes.byref(cfg)

    def run():
        if fn(pa, pc) < 0:
            raise RuntimeError(lib.last_error())
    return run


def mhakit_call(lib, dtype, q, k, v, o, lse, batch, seqlen, cu, max_len, causal, scale):
    """A timed closure of one mhakit forward (writing o and lse), and its kernel's name."""
    args = _capi.make_fwd_args(dtype=dtype, q_ptr=q.data_ptr(), k_ptr=k.data_ptr(), v_ptr=v.data_ptr(),
                               o_ptr=o.data_ptr(), o_strides=bhs(o), lse_ptr=lse.data_ptr(),
                               lse_strides=lse_strides(lse),
                               **common_args(q, k, v, batch, seqlen, cu, max_len, causal, scale))
    return launcher(lib, "mhakit_mha_fwd", args), lib.kernel_name(args)


def mhakit_bwd_call(blib, dtype, q, k, v, o, lse, do, grads, batch, seqlen, cu, max_len, causal, scale):
    """A timed closure of one mhakit backward into grads (dq, dk, dv), its workspace, and its kernel's name."""
    kw = dict(dtype=dtype, q_ptr=q.data_ptr(), k_ptr=k.data_ptr(), v_ptr=v.data_ptr(), o_ptr=o.data_ptr(),
              lse_ptr=lse.data_ptr(), do_ptr=do.data_ptr(), dq_ptr=grads[0].data_ptr(), dk_ptr=grads[1].data_ptr(),
              dv_ptr=grads[2].data_ptr(), o_strides=bhs(o), do_strides=bhs(do), lse_strides=lse_strides(lse),
              dq_strides=bhs(grads[0]), dk_strides=bhs(grads[1]), dv_strides=bhs(grads[2]),
              max_seqlen_k=max_len if cu is not None else None,
              **common_args(q, k, v, batch, seqlen, cu, max_len, causal, scale))
    args = _capi.make_bwd_args(**kw)
    nbytes = blib.workspace_size(args)
    ws = torch.empty(max(nbytes, 1), device="cuda", dtype=torch.uint8)
    args = _capi.make_bwd_args(**kw, workspace_ptr=ws.data_ptr() if nbytes else None, workspace_bytes=nbytes)
    return launcher(blib, "mhakit_mha_bwd", args), ws, blib.kernel_name(args)


def time_backward(out, grad, opts):
    """Median ms of out.backward(grad) on a retained graph (the peers' backward alone)."""
    return time_launches(lambda: out.backward(grad, retain_graph=True), opts.warmup, opts.repeat)


def check(row, key, got, ref, dtype_name, factor=1.0):
    rtol, atol = tolerances(dtype_name)
    diff = (got.float() - ref.float()).abs()
    row[f"{key}_max_abs_err"] = diff.max().item()
    ok = bool((diff <= factor * (atol + rtol * ref.float().abs())).all().item())
    row["verified"] = row.get("verified", True) and ok
    if not ok:
        row["notes"].append(f"mhakit {key} differs from FA2 varlen's")


def run_case(lib, blib, fa2, dtype_name, lengths_name, hq, hk, causal, opts):
    dt = DTYPES[dtype_name]
    lens = LENGTHS[lengths_name]
    total, max_len, scale = sum(lens), max(lens), 1.0 / math.sqrt(HDIM)
    flops = sum(flops_fwd(1, hq, s, s, HDIM, HDIM, causal) for s in lens)
    gen = torch.Generator(device="cuda").manual_seed(opts.seed)
    q = torch.randn((total, hq, HDIM), device="cuda", dtype=dt, generator=gen)
    k, v = (torch.randn((total, hk, HDIM), device="cuda", dtype=dt, generator=gen) for _ in range(2))
    do = torch.randn((total, hq, HDIM), device="cuda", dtype=dt, generator=gen)
    o = torch.zeros_like(q)
    lse = torch.empty((hq, total), device="cuda", dtype=torch.float32)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), device="cuda", dtype=torch.int32)
    row = {"dtype": dtype_name, "lengths": lengths_name, "heads": f"{hq}/{hk}", "causal": causal, "notes": []}

    def tflops(ms, f=flops):
        return f / (ms * 1e-3) / 1e12

    ours, row["kernel"] = mhakit_call(lib, dtype_name, q, k, v, o, lse, len(lens), 0, cu, max_len, causal, scale)
    ours()
    ref = None
    if fa2 is not None:
        try:
            qg, kg, vg = (t.detach().requires_grad_(blib is not None) for t in (q, k, v))
            ref = fa2(qg, kg, vg, cu, max_len, causal, scale)
            row["fa2_varlen_tflops"] = tflops(time_launches(lambda: fa2(q, k, v, cu, max_len, causal, scale),
                                                            opts.warmup, opts.repeat))
            if blib is not None:
                ref_grads = torch.autograd.grad(ref, (qg, kg, vg), do, retain_graph=True)
                row["fa2_varlen_bwd_tflops"] = tflops(time_backward(ref, do, opts), 2.5 * flops)
        except (RuntimeError, TypeError) as e:
            row["notes"].append(f"fa2 varlen: {str(e).splitlines()[0]}")
            ref = None
    if ref is not None:
        check(row, "O", o, ref, dtype_name)
    row["mhakit_varlen_tflops"] = tflops(time_launches(ours, opts.warmup, opts.repeat))
    if blib is not None:
        grads = [torch.empty_like(t) for t in (q, k, v)]
        bwd, ws, row["bwd_kernel"] = mhakit_bwd_call(blib, dtype_name, q, k, v, o, lse, do, grads, len(lens), 0, cu,
                                                     max_len, causal, scale)
        bwd()
        if ref is not None:
            for key, got, want in zip(("dQ", "dK", "dV"), grads, ref_grads):
                check(row, key, got, want, dtype_name, 4.0)
        row["mhakit_varlen_bwd_tflops"] = tflops(time_launches(bwd, opts.warmup, opts.repeat), 2.5 * flops)
        del grads, ws

    # Batch mode: the same tokens when the lengths are equal, else 4 x 4096 at the same head count.
    b, s = (len(lens), lens[0]) if len(set(lens)) == 1 else (4, 4096)
    bflops = flops_fwd(b, hq, s, s, HDIM, HDIM, causal)
    qb = torch.randn((b, s, hq, HDIM), device="cuda", dtype=dt, generator=gen)
    kb, vb = (torch.randn((b, s, hk, HDIM), device="cuda", dtype=dt, generator=gen) for _ in range(2))
    dob = torch.randn((b, s, hq, HDIM), device="cuda", dtype=dt, generator=gen)
    ob = torch.zeros_like(qb)
    lseb = torch.empty((b, hq, s), device="cuda", dtype=torch.float32)
    batch_run, _ = mhakit_call(lib, dtype_name, qb, kb, vb, ob, lseb, b, s, None, s, causal, scale)
    row["mhakit_batch_tflops"] = tflops(time_launches(batch_run, opts.warmup, opts.repeat), bflops)
    if blib is not None:
        gb = [torch.empty_like(t) for t in (qb, kb, vb)]
        bwd_b, wsb, _ = mhakit_bwd_call(blib, dtype_name, qb, kb, vb, ob, lseb, dob, gb, b, s, None, s, causal, scale)
        row["mhakit_batch_bwd_tflops"] = tflops(time_launches(bwd_b, opts.warmup, opts.repeat), 2.5 * bflops)
        del gb, wsb
    qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_(blib is not None) for t in (qb, kb, vb))
    try:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            sdpa_fn = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale,  # noqa: E731
                                                             enable_gqa=hq != hk)
            row["cudnn_batch_tflops"] = tflops(time_launches(sdpa_fn, opts.warmup, opts.repeat), bflops)
            if blib is not None:
                out = sdpa_fn()
                row["cudnn_batch_bwd_tflops"] = tflops(time_backward(out, dob.transpose(1, 2), opts), 2.5 * bflops)
                del out
    except RuntimeError as e:
        row["notes"].append(f"cudnn: {str(e).splitlines()[0]}")
    row["batch_shape"] = f"{b}x{s}"
    del q, k, v, o, qb, kb, vb, ob, ref
    torch.cuda.empty_cache()
    return row


def ratio(a, b):
    return a / b if a and b else None


def print_table(rows, direction="", out=sys.stdout):
    """One markdown table; direction "" (forward) or "_bwd" (backward)."""
    d = direction
    print(f"{'Backward' if d else 'Forward'}, TFLOPS:", file=out)
    print("| dtype | lengths | heads q/kv | causal | mhakit varlen | mhakit batch (shape) | cuDNN batch | FA2 varlen "
          "| varlen/batch | varlen/FA2 varlen | varlen/cuDNN batch | kernel |", file=out)
    print("|---|---|---|---|---|---|---|---|---|---|---|---|", file=out)
    for r in rows:
        v = r.get(f"mhakit_varlen{d}_tflops")
        ok = "" if r.get("verified", True) else " (FAIL)"
        print(f"| {r['dtype']} | {r['lengths']} | {r['heads']} | {'yes' if r['causal'] else 'no'} | {fmt(v)}{ok} | "
              f"{fmt(r.get(f'mhakit_batch{d}_tflops'))} ({r['batch_shape']}) | {fmt(r.get(f'cudnn_batch{d}_tflops'))} "
              f"| {fmt(r.get(f'fa2_varlen{d}_tflops'))} | "
              f"{fmt(ratio(v, r.get(f'mhakit_batch{d}_tflops')), '.2f', 'x')} | "
              f"{fmt(ratio(v, r.get(f'fa2_varlen{d}_tflops')), '.2f', 'x')} | "
              f"{fmt(ratio(v, r.get(f'cudnn_batch{d}_tflops')), '.2f', 'x')} | "
              f"{r.get('bwd_kernel' if d else 'kernel') or '-'} |", file=out)
    out.flush()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lib", default="./libmha_fwd.so")
    p.add_argument("--bwd-lib", default=None, help="libmha_bwd.so: also benchmark the backward")
    p.add_argument("--dtype", default="bf16", help="comma list of bf16, fp16")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="OUT.json")
    opts = p.parse_args(argv)
    dtypes = opts.dtype.split(",")
    if any(d not in DTYPES for d in dtypes):
        p.error(f"--dtype: choose from {', '.join(DTYPES)}")
    if not torch.cuda.is_available():
        print("bench_varlen: no CUDA device visible to torch", file=sys.stderr)
        return 2
    lib = _capi.load_library(opts.lib)
    blib = _capi.load_bwd_library(opts.bwd_lib) if opts.bwd_lib else None
    fa2 = fa2_varlen()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
          f"lib {lib.path}; FLOPs: useful, TFLOPS")
    rows = [run_case(lib, blib, fa2, d, ln, hq, hk, c, opts)
            for d in dtypes for ln in LENGTHS for hq, hk in HEADS for c in (True, False)]
    print_table(rows)
    if blib is not None:
        print_table(rows, "_bwd")
    for r in rows:
        for n in r["notes"]:
            print(f"note ({r['lengths']}, {r['heads']}): {n}")
    if opts.json:
        Path(opts.json).write_text(json.dumps({"rows": rows}, indent=1))
    return 0 if all(r.get("verified", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
