#!/usr/bin/env python3
"""Variable-length (group mode) forward against batch mode and the peers, on one GPU, in one process.

The same 16384 packed tokens (hd128, bf16/fp16, causal and not) three ways:
  * mhakit group mode (libmha_fwd.so through ctypes, packed [total, h, d] tensors, seqstart offsets);
  * mhakit batch mode on the same tokens (equal lengths) or, for mixed lengths, batch mode 4 x 4096 at the same
    head count (the bar: varlen >= 0.9x of it in useful FLOPs);
  * cuDNN through SDPA in batch mode (equal lengths), and PyTorch's FlashAttention-2 varlen
    (torch.nn.attention.varlen.varlen_attn) on the packed tokens.
Heads: MHA 16/16 and GQA 32/8. Lengths: "4x4096" (equal) and "mixed" (8 sequences, 128..4096, 16384 in all).
FLOPs are useful FLOPs, summed per sequence (FlashAttention convention, halved when causal). Timing as bench_fwd.py:
median of 20 launches between CUDA events after 5 warm-ups, the GPU kept busy while the host enqueues. Each mhakit
output is checked against FA2 varlen's (bf16 1e-2/1e-2, fp16 1e-3/1e-3) before timing.

    python3 bench/bench_varlen.py --lib ./libmha_fwd.so [--dtype bf16,fp16] [--json varlen.json]
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
from mhakit.reference import flops_fwd, tolerances  # noqa: E402

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


def mhakit_call(lib, dtype, q, k, v, o, batch, seqlen, cu, max_len, causal, scale):
    """A timed closure of one mhakit forward: group mode when cu is given (q: [total, h, d]), else batch mode
    (q: [b, s, h, d])."""
    hq, hk = q.shape[-2], k.shape[-2]
    def bhs(t):  # (batch, head, row) element strides
        return (0, t.stride(1), t.stride(0)) if t.dim() == 3 else (t.stride(0), t.stride(2), t.stride(1))
    group = cu is not None
    args = _capi.make_fwd_args(
        dtype=dtype, q_ptr=q.data_ptr(), k_ptr=k.data_ptr(), v_ptr=v.data_ptr(), o_ptr=o.data_ptr(), batch=batch,
        seqlen_q=q.shape[0] if group else seqlen, seqlen_k=k.shape[0] if group else seqlen, nhead_q=hq, nhead_k=hk,
        hdim_q=q.shape[-1], hdim_v=v.shape[-1], q_strides=bhs(q), k_strides=bhs(k), v_strides=bhs(v),
        o_strides=bhs(o), seqstart_q_ptr=cu.data_ptr() if group else None,
        seqstart_k_ptr=cu.data_ptr() if group else None, max_seqlen_q=max_len if group else None, scale=scale,
        mask_type=_capi.MASK_BOTTOM_RIGHT if causal else _capi.MASK_NONE, window_left=-1,
        window_right=0 if causal else -1)
    cfg = _capi.make_stream_config(torch.cuda.current_stream().cuda_stream)
    fn, pa, pc = lib.cdll.mhakit_mha_fwd, ctypes.byref(args), ctypes.byref(cfg)
    name = lib.kernel_name(args)

    def run():
        if fn(pa, pc) < 0:
            raise RuntimeError(lib.last_error())
    return run, name


def run_case(lib, fa2, dtype_name, lengths_name, hq, hk, causal, opts):
    dt = DTYPES[dtype_name]
    lens = LENGTHS[lengths_name]
    total, max_len, scale = sum(lens), max(lens), 1.0 / math.sqrt(HDIM)
    flops = sum(flops_fwd(1, hq, s, s, HDIM, HDIM, causal) for s in lens)
    gen = torch.Generator(device="cuda").manual_seed(opts.seed)
    q = torch.randn((total, hq, HDIM), device="cuda", dtype=dt, generator=gen)
    k, v = (torch.randn((total, hk, HDIM), device="cuda", dtype=dt, generator=gen) for _ in range(2))
    o = torch.zeros_like(q)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), device="cuda", dtype=torch.int32)
    row = {"dtype": dtype_name, "lengths": lengths_name, "heads": f"{hq}/{hk}", "causal": causal, "notes": []}

    def tflops(ms, f=flops):
        return f / (ms * 1e-3) / 1e12

    ours, row["kernel"] = mhakit_call(lib, dtype_name, q, k, v, o, len(lens), 0, cu, max_len, causal, scale)
    ours()
    ref = None
    if fa2 is not None:
        try:
            ref = fa2(q, k, v, cu, max_len, causal, scale)
            row["fa2_varlen_tflops"] = tflops(time_launches(lambda: fa2(q, k, v, cu, max_len, causal, scale),
                                                            opts.warmup, opts.repeat))
        except (RuntimeError, TypeError) as e:
            row["notes"].append(f"fa2 varlen: {str(e).splitlines()[0]}")
    if ref is not None:
        rtol, atol = tolerances(dtype_name)
        diff = (o.float() - ref.float()).abs()
        row["max_abs_err"] = diff.max().item()
        row["verified"] = bool((diff <= atol + rtol * ref.float().abs()).all().item())
    row["mhakit_varlen_tflops"] = tflops(time_launches(ours, opts.warmup, opts.repeat))

    # Batch mode: the same tokens when the lengths are equal, else 4 x 4096 at the same head count.
    b, s = (len(lens), lens[0]) if len(set(lens)) == 1 else (4, 4096)
    bflops = flops_fwd(b, hq, s, s, HDIM, HDIM, causal)
    qb = torch.randn((b, s, hq, HDIM), device="cuda", dtype=dt, generator=gen)
    kb, vb = (torch.randn((b, s, hk, HDIM), device="cuda", dtype=dt, generator=gen) for _ in range(2))
    ob = torch.zeros_like(qb)
    batch_run, _ = mhakit_call(lib, dtype_name, qb, kb, vb, ob, b, s, None, s, causal, scale)
    row["mhakit_batch_tflops"] = tflops(time_launches(batch_run, opts.warmup, opts.repeat), bflops)
    qt, kt, vt = (t.transpose(1, 2) for t in (qb, kb, vb))
    try:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            ms = time_launches(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale,
                                                                      enable_gqa=hq != hk), opts.warmup, opts.repeat)
        row["cudnn_batch_tflops"] = tflops(ms, bflops)
    except RuntimeError as e:
        row["notes"].append(f"cudnn: {str(e).splitlines()[0]}")
    row["batch_shape"] = f"{b}x{s}"
    del q, k, v, o, qb, kb, vb, ob, ref
    torch.cuda.empty_cache()
    return row


def ratio(a, b):
    return a / b if a and b else None


def print_table(rows, out=sys.stdout):
    print("| dtype | lengths | heads q/kv | causal | mhakit varlen | mhakit batch (shape) | cuDNN batch | FA2 varlen "
          "| varlen/batch | varlen/FA2 varlen | varlen/cuDNN batch | max abs err | kernel |", file=out)
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|", file=out)
    for r in rows:
        v = r.get("mhakit_varlen_tflops")
        err = fmt(r.get("max_abs_err"), ".2e") + ("" if r.get("verified", True) else " FAIL")
        print(f"| {r['dtype']} | {r['lengths']} | {r['heads']} | {'yes' if r['causal'] else 'no'} | {fmt(v)} | "
              f"{fmt(r.get('mhakit_batch_tflops'))} ({r['batch_shape']}) | {fmt(r.get('cudnn_batch_tflops'))} | "
              f"{fmt(r.get('fa2_varlen_tflops'))} | {fmt(ratio(v, r.get('mhakit_batch_tflops')), '.2f', 'x')} | "
              f"{fmt(ratio(v, r.get('fa2_varlen_tflops')), '.2f', 'x')} | "
              f"{fmt(ratio(v, r.get('cudnn_batch_tflops')), '.2f', 'x')} | {err} | {r['kernel'] or '-'} |", file=out)
    out.flush()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lib", default="./libmha_fwd.so")
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
    fa2 = fa2_varlen()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
          f"lib {lib.path}; FLOPs: useful, TFLOPS")
    rows = [run_case(lib, fa2, d, ln, hq, hk, c, opts)
            for d in dtypes for ln in LENGTHS for hq, hk in HEADS for c in (True, False)]
    print_table(rows)
    for r in rows:
        for n in r["notes"]:
            print(f"note ({r['lengths']}, {r['heads']}): {n}")
    if opts.json:
        Path(opts.json).write_text(json.dumps({"rows": rows}, indent=1))
    return 0 if all(r.get("verified", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
