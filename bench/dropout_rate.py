#!/usr/bin/env python3
"""Dropout's keep rate on the GPU, statistically, through a prebuilt libmha_fwd.so (no JIT, no compiler).

With q = k = 0 every probability of a row is 1 / s_k, and with v = 1 each output is (kept keys of the row) / s_k /
(1 − p). The forward stores its random bytes (randval), so the check is twofold:
  * the kept fraction of all bytes is (keep_max + 1) / 256 (keep_max = floor((1 − p)·255)) within five standard
    deviations of a binomial count;
  * every output row equals its own row of stored bytes' kept fraction / (1 − p), to the output's rounding (bf16),
    i.e. the kernel dropped exactly the scores whose bytes it stored, and scaled the kept ones;
and it prints the instance that ran (a dropout call at hd 128 on sm_90a must name a Hopper "_mods" instance; the
caller checks that).

    python3 bench/dropout_rate.py --lib build/hdrop/libmha_fwd.so [--p 0.1 0.5] [--causal]
"""

from __future__ import annotations

import argparse
import ctypes
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run in place: the repository root holds mhakit/

import torch  # noqa: E402  (torch lives in bench/ only, never in mhakit/)

from mhakit import _capi, reference  # noqa: E402


def check(lib, p: float, causal: bool, b: int, h: int, s: int, d: int, seed: int) -> bool:
    q = torch.zeros((b, h, s, d), device="cuda", dtype=torch.bfloat16)
    v = torch.ones((b, h, s, d), device="cuda", dtype=torch.bfloat16)
    o = torch.zeros_like(q)
    rv = torch.zeros((b, h, s, s), device="cuda", dtype=torch.uint8)

    def bhs(t):
        return (t.stride(0), t.stride(1), t.stride(2))

    a = _capi.make_fwd_args(dtype="bf16", q_ptr=q.data_ptr(), k_ptr=q.data_ptr(), v_ptr=v.data_ptr(),
                            o_ptr=o.data_ptr(), batch=b, seqlen_q=s, seqlen_k=s, nhead_q=h, nhead_k=h, hdim_q=d,
                            hdim_v=d, q_strides=bhs(q), k_strides=bhs(q), v_strides=bhs(v), o_strides=bhs(o),
                            mask_type=_capi.MASK_TOP_LEFT if causal else _capi.MASK_NONE, window_left=-1,
                            window_right=0 if causal else -1)
    a.p_drop, a.drop_seed, a.drop_offset = p, seed, 3
    a.randval_ptr = rv.data_ptr()
    a.stride_randval, a.nhead_stride_randval, a.batch_stride_randval = rv.stride(2), rv.stride(1), rv.stride(0)
    name = lib.kernel_name(a)
    cfg = _capi.make_stream_config(torch.cuda.current_stream().cuda_stream)
    ret = lib.cdll.mhakit_mha_fwd(ctypes.byref(a), ctypes.byref(cfg))
    torch.cuda.synchronize()
    if ret < 0:
        print(f"p={p} causal={causal}: mha_fwd returned {ret:g}: {lib.last_error()}")
        return False
    keep_max = reference.dropout_keep_max(p)
    rows = torch.arange(s, device="cuda").view(s, 1)
    cols = torch.arange(s, device="cuda").view(1, s)
    visible = (cols <= rows) if causal else torch.ones((s, s), dtype=torch.bool, device="cuda")
    keep = (rv.int() <= keep_max) & visible
    n = int(visible.sum().item()) * b * h
    kept = int(keep.sum().item())
    rate = (keep_max + 1) / 256
    sigma = math.sqrt(rate * (1 - rate) / n)
    ok_rate = abs(kept / n - rate) < 5 * sigma
    rp = 1.0 / float(torch.tensor(1.0 - p, dtype=torch.float32).item())
    expected = keep.sum(-1).double() / visible.sum(-1).double() * rp  # [b, h, s]
    got = o[..., 0].double()
    err = (got - expected).abs().max().item()
    ok_rows = err <= 2 ** -8 * expected.abs().max().item() + 1e-6 and bool((o == o[..., :1]).all().item())
    print(f"p={p} causal={int(causal)} b={b} h={h} s={s} d={d}: kernel {name}; kept {kept}/{n} = {kept / n:.5f} "
          f"(expected {rate:.5f}, {abs(kept / n - rate) / sigma:.2f} sigma) {'ok' if ok_rate else 'FAIL'}; "
          f"rows: max |O - kept/(1-p)| = {err:.2e} {'ok' if ok_rows else 'FAIL'}")
    return ok_rate and ok_rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib", default="./libmha_fwd.so")
    ap.add_argument("--p", type=float, nargs="+", default=[0.1, 0.5])
    ap.add_argument("--shape", default="2,8,1024,128", help="b,h,s,d (default 2,8,1024,128)")
    ap.add_argument("--seed", type=int, default=2024)
    opts = ap.parse_args()
    b, h, s, d = (int(x) for x in opts.shape.split(","))
    lib = _capi.load_library(opts.lib)
    ok = True
    for p in opts.p:
        for causal in (False, True):
            ok = check(lib, p, causal, b, h, s, d, opts.seed) and ok
    print("dropout_rate:", "ok" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
