#!/usr/bin/env python3
"""Host cost of a call from Python: mhakit.mha_* (C call path, and the pure-Python path for comparison) next to
PyTorch SDPA in the same process, plus the s=1024 forward rows timed kernel-only and end to end through Python.

Host µs per call: a tiny problem (the GPU time is negligible), 200 calls enqueued back to back with no
synchronisation inside the loop, median of 7 such loops after a warm-up, divided by the call count; the GPU is
synchronised before each loop. What it measures is what a Python caller pays to get work onto the stream.

End to end (s=1024 rows of bench_fwd.py's grid, bf16, b·h·s·d tensors through layout='bhsd'): 50 calls back to
back from an idle GPU, synchronised once, wall time per call — host overhead shows wherever it exceeds the kernel.
Kernel-only: bench_fwd.py's method (the GPU busy while the host enqueues; median of per-launch event pairs).

    python3 bench/bench_overhead.py [--json overhead.json] [--skip-e2e]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run in place: the repository root holds mhakit/
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX shares the GPU with torch here

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import mhakit  # noqa: E402
from mhakit import _ext  # noqa: E402
from bench_fwd import time_launches  # noqa: E402
from mhakit.reference import flops_fwd  # noqa: E402


def host_us(fn, calls: int = 200, loops: int = 7, warmup: int = 20) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(loops):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(samples)


def end_to_end_ms(fn, calls: int = 50, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e3


def use_c_path(enabled: bool) -> None:
    if enabled:
        os.environ.pop(_ext.ENV_DISABLE, None)
    else:
        os.environ[_ext.ENV_DISABLE] = "1"
    _ext.reset()
    if enabled and _ext.module() is None:
        raise SystemExit("bench_overhead: the C call path did not build")


def sdpa(backend, q, k, v, causal=False):
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def host_rows() -> list[dict]:
    rows = []
    dt = torch.bfloat16
    b, s, h, d = 1, 128, 4, 64
    q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=dt) for _ in range(4))
    o, lse = torch.empty_like(q), torch.empty(b, h, s, device="cuda", dtype=torch.float32)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    cu = torch.tensor([0, 50, 128], device="cuda", dtype=torch.int32)
    pq, pk, pv = (t.view(b * s, h, d) for t in (q, k, v))
    po, plse = o.view(b * s, h, d), torch.empty(h, b * s, device="cuda", dtype=torch.float32)
    pdq, pdk, pdv, pdo = (t.view(b * s, h, d) for t in (dq, dk, dv, do))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # SDPA's b·h·s·d view of the same memory

    def add(name, fn, path, producer="torch"):
        rows.append({"call": name, "path": path, "arrays": producer, "host_us": host_us(fn)})
        print(f"| {name} | {path} | {producer} | {rows[-1]['host_us']:.1f} |", flush=True)

    print("| call | path | arrays | host µs per call |\n|---|---|---|---|")
    for enabled, path in ((True, "C"), (False, "Python")):
        use_c_path(enabled)
        mhakit.mha_fwd(q, k, v, causal=True, out=o, lse_out=lse)  # builds / loads the libraries once
        mhakit.mha_bwd(do, q, k, v, o, lse, causal=True, dq=dq, dk=dk, dv=dv)
        mhakit.mha_varlen_fwd(pq, pk, pv, cu, cu, 78, 78, causal=True, out=po, lse_out=plse)
        mhakit.mha_varlen_bwd(pdo, pq, pk, pv, po, plse, cu, cu, 78, 78, causal=True, dq=pdq, dk=pdk, dv=pdv)
        add("mha_fwd(out=, lse_out=)", lambda: mhakit.mha_fwd(q, k, v, causal=True, out=o, lse_out=lse), path)
        add("mha_fwd (allocates O)", lambda: mhakit.mha_fwd(q, k, v, causal=True), path)
        add("mha_varlen_fwd(out=, lse_out=)",
            lambda: mhakit.mha_varlen_fwd(pq, pk, pv, cu, cu, 78, 78, causal=True, out=po, lse_out=plse), path)
        add("mha_varlen_fwd (allocates O)", lambda: mhakit.mha_varlen_fwd(pq, pk, pv, cu, cu, 78, 78, causal=True),
            path)
        add("mha_bwd(dq=, dk=, dv=)",
            lambda: mhakit.mha_bwd(do, q, k, v, o, lse, causal=True, dq=dq, dk=dk, dv=dv), path)
        add("mha_bwd (allocates dQ, dK, dV)", lambda: mhakit.mha_bwd(do, q, k, v, o, lse, causal=True), path)
        add("mha_varlen_bwd(dq=, dk=, dv=)",
            lambda: mhakit.mha_varlen_bwd(pdo, pq, pk, pv, po, plse, cu, cu, 78, 78, causal=True, dq=pdq, dk=pdk,
                                          dv=pdv), path)
    use_c_path(True)
    # A 16-bit elementwise bias at d128 is staged through shared memory by TMA on the Hopper modifier instances, with
    # a tensor map encoded on the host for every call: these rows put that call's host cost beside the same shape's
    # plain call (d64's tile reads its bias from global memory).
    q2, k2, v2, do2 = (torch.randn(b, s, h, 128, device="cuda", dtype=dt) for _ in range(4))
    o2, lse2 = torch.empty_like(q2), torch.empty(b, h, s, device="cuda", dtype=torch.float32)
    dq2, dk2, dv2 = torch.empty_like(q2), torch.empty_like(k2), torch.empty_like(v2)
    bias = torch.randn(1, 1, s, s, device="cuda", dtype=dt)
    for name, kw in (("", {}), ("bias=, ", {"bias": bias})):
        mhakit.mha_fwd(q2, k2, v2, causal=True, out=o2, lse_out=lse2, **kw)
        mhakit.mha_bwd(do2, q2, k2, v2, o2, lse2, causal=True, dq=dq2, dk=dk2, dv=dv2, **kw)
        add(f"mha_fwd({name}out=, lse_out=), d128",
            lambda kw=kw: mhakit.mha_fwd(q2, k2, v2, causal=True, out=o2, lse_out=lse2, **kw), "C")
        add(f"mha_bwd({name}dq=, dk=, dv=), d128",
            lambda kw=kw: mhakit.mha_bwd(do2, q2, k2, v2, o2, lse2, causal=True, dq=dq2, dk=dk2, dv=dv2, **kw), "C")
    try:
        import cupy as cp
        cq, ck, cv = (cp.asarray(t) for t in (q.view(torch.int16), k.view(torch.int16), v.view(torch.int16)))
        co = cp.empty_like(cq)
        add("mha_fwd(out=)", lambda: mhakit.mha_fwd(cq, ck, cv, causal=True, out=co, dtype="bf16"), "C", "CuPy")
    except ImportError:
        pass
    try:
        import jax
        jq, jk, jv = (jax.dlpack.from_dlpack(t) for t in (q, k, v))
        add("mha_fwd (allocates O)", lambda: mhakit.mha_fwd(jq, jk, jv, causal=True), "C", "JAX")
    except Exception as exc:  # JAX missing or without a GPU
        print(f"(JAX row skipped: {exc})")

    import mhakit.torch as mt
    gq, gk, gv = (t.detach().clone().requires_grad_() for t in (q, k, v))
    gqt, gkt, gvt = (t.detach().clone().transpose(1, 2).requires_grad_() for t in (q, k, v))
    grad = torch.ones_like(q)

    def ours_train():
        mt.attention(gq, gk, gv, causal=True).backward(grad)

    def sdpa_train():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(gqt, gkt, gvt, is_causal=True).backward(grad.transpose(1, 2))

    add("mhakit.torch.attention forward + backward", ours_train, "C (torch op)")
    # The host's own yardstick: one tiny kernel launched through PyTorch. Host speed differs from machine to machine
    # and run to run by a third or more (6.3-8.5 µs for this row in one call on the H200 machine, 2026-11-24), so
    # mhakit's rows are read against this one, not against another day's table.
    x, y, z = (torch.randn(64, device="cuda") for _ in range(3))
    add("torch.add(out=), 64 floats (yardstick)", lambda: torch.add(x, y, out=z), "PyTorch")
    add("SDPA cuDNN forward", lambda: sdpa(SDPBackend.CUDNN_ATTENTION, qt, kt, vt, True), "PyTorch")
    add("SDPA FA2 forward", lambda: sdpa(SDPBackend.FLASH_ATTENTION, qt, kt, vt, True), "PyTorch")
    add("SDPA cuDNN forward + backward", sdpa_train, "PyTorch")
    return rows


def e2e_rows() -> list[dict]:
    rows = []
    use_c_path(True)
    print("\n| hdim | causal | b x h | mhakit kernel-only | mhakit via Python | cuDNN kernel-only | cuDNN via Python "
          "| FA2 kernel-only | FA2 via Python | via Python: mhakit/cuDNN | mhakit/FA2 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for hdim in (64, 128, 256):
        for causal in (False, True):
            b, h, s = 16, 2048 // hdim, 1024
            q, k, v = (torch.randn(b, h, s, hdim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            o = torch.empty_like(q)
            flops = flops_fwd(b, h, s, s, hdim, hdim, causal)
            fns = {"mhakit": lambda: mhakit.mha_fwd(q, k, v, causal=causal, out=o, layout="bhsd"),
                   "cudnn": lambda: sdpa(SDPBackend.CUDNN_ATTENTION, q, k, v, causal),
                   "fa2": lambda: sdpa(SDPBackend.FLASH_ATTENTION, q, k, v, causal)}
            row = {"hdim": hdim, "causal": causal, "batch": b, "heads": h, "seqlen": s}
            for name, fn in fns.items():
                row[f"{name}_kernel_tflops"] = flops / (time_launches(fn, 5, 20) * 1e-3) / 1e12
                row[f"{name}_python_tflops"] = flops / (end_to_end_ms(fn) * 1e-3) / 1e12
            rows.append(row)
            print(f"| {hdim} | {'yes' if causal else 'no'} | {b}x{h} | "
                  + " | ".join(f"{row[f'{n}_{m}_tflops']:.0f}" for n in fns for m in ("kernel", "python"))
                  + f" | {row['mhakit_python_tflops'] / row['cudnn_python_tflops']:.2f}x"
                  + f" | {row['mhakit_python_tflops'] / row['fa2_python_tflops']:.2f}x |", flush=True)
            del q, k, v, o
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="OUT.json")
    p.add_argument("--skip-e2e", action="store_true", help="only the host-cost table")
    opts = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_overhead: no CUDA device visible to torch", file=sys.stderr)
        return 2
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "host": host_rows()}
    if not opts.skip_e2e:
        result["end_to_end"] = e2e_rows()
    if opts.json:
        Path(opts.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
