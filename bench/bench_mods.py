#!/usr/bin/env python3
"""What each score modifier costs: mhakit's forward and backward with soft-cap, ALiBi, an elementwise bias (with and
without dbias), a sink logit (with d sink), and soft-cap + bias + sink together, each against mhakit's plain call, with cuDNN
plain and cuDNN with the same bias as an additive SDPA ``attn_mask`` measured beside them, in one process.

Calls go through ``mhakit.mha_fwd`` / ``mhakit.mha_bwd`` on torch tensors (DLPack; kernels from the JIT cache,
built on first use), in b.h.s.d layout. The shape is issue 12's: hd 128, s = 4096 (16384 tokens, hidden 2048:
batch 4, 16 heads), bf16, no mask and causal. The elementwise bias is [1, 1, s, s] (broadcast over batch and heads)
in the inputs' dtype; the dbias rows give a [b, h, s, s] bias (dbias has the bias's shape). Timing as
bench_fwd.py's: median of --repeat launches between CUDA events after --warmup, the GPU kept busy while the host
enqueues. "cost" is time / plain time - 1 of the same implementation and mask. The "bias+dbias traffic" row is a
floor, not a call: one device copy of the [b, h, s, s] bias into dbias (the bytes a backward with dbias must read and
write beyond the plain call's), its cost that copy's time over the plain backward's.

Before timing, each mhakit modifier call's O (forward) or dQ (backward) is compared with SDPA on the same inputs,
the modifier written out in PyTorch (math backend, fp32), with the forward's tolerance of the dtype.

    python3 bench/bench_mods.py --json mods.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run in place: the repository root holds mhakit/

import torch  # noqa: E402  (torch lives in bench/ only, never in mhakit/)
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from bench_fwd import DTYPES, fmt, time_launches  # noqa: E402
import mhakit  # noqa: E402
from mhakit.reference import tolerances  # noqa: E402

MODS = ("plain", "softcap", "alibi", "bias", "bias+dbias", "sink", "all")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--hdim", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=16384, help="batch = tokens / seqlen (16384)")
    p.add_argument("--hidden", type=int, default=2048, help="heads = hidden / hdim (2048)")
    p.add_argument("--direction", default="fwd,bwd", help="comma list of fwd, bwd")
    p.add_argument("--softcap", type=float, default=30.0)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--json", metavar="OUT.json")
    args = p.parse_args(argv)
    args.directions = [d for d in args.direction.split(",") if d]
    if any(d not in ("fwd", "bwd") for d in args.directions):
        p.error("--direction takes fwd and/or bwd")
    if args.seqlen <= 0 or args.tokens % args.seqlen or args.hidden % args.hdim:
        p.error("--seqlen must divide --tokens and --hdim must divide --hidden")
    if args.repeat < 1 or args.warmup < 0:
        p.error("--repeat must be >= 1 and --warmup >= 0")
    return args


def modifiers(name: str, b: int, h: int, s: int, dt, opts, gen) -> tuple[dict, dict]:
    """(mhakit's forward keyword arguments, the backward's extra outputs) of a modifier row."""
    kw, extra = {}, {}
    if name in ("softcap", "all"):
        kw["softcap"] = opts.softcap
    if name == "alibi":  # ALiBi and an elementwise bias are exclusive (aiter's -bias= takes one); "all" has the bias
        slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)], device="cuda")
        kw["alibi_slopes"] = slopes
    if name in ("bias", "bias+dbias", "all"):
        shape = (b, h, s, s) if name == "bias+dbias" else (1, 1, s, s)
        kw["bias"] = torch.randn(shape, device="cuda", dtype=dt, generator=gen)
        if name == "bias+dbias":
            extra["dbias"] = torch.empty(shape, device="cuda", dtype=dt)
    if name in ("sink", "all"):
        kw["sink"] = torch.randn(h, device="cuda", dtype=torch.float32, generator=gen)
        extra["dsink"] = torch.empty(h, device="cuda", dtype=torch.float32)
    return kw, extra


def reference(q, k, v, causal: bool, scale: float, kw: dict, dt):
    """fp32 attention with the modifiers written out (ALiBi as FlashAttention defines it: -slope * |i - j| with the
    query rows aligned bottom-right; s_q == s_k here)."""
    qf, kf, vf = (t.float() for t in (q, k, v))
    sc = qf @ kf.transpose(-1, -2) * scale
    if "softcap" in kw:
        sc = kw["softcap"] * torch.tanh(sc / kw["softcap"])
    s = q.shape[2]
    pos = torch.arange(s, device="cuda")
    if "alibi_slopes" in kw:
        sc = sc - kw["alibi_slopes"].view(1, -1, 1, 1) * (pos.view(-1, 1) - pos.view(1, -1)).abs().float()
    if "bias" in kw:
        sc = sc + kw["bias"].float()
    if causal:
        sc = sc.masked_fill(pos.view(-1, 1) < pos.view(1, -1), float("-inf"))
    if "sink" in kw:
        sink = kw["sink"].view(1, -1, 1, 1).expand(sc.shape[0], -1, sc.shape[2], 1)
        p = torch.softmax(torch.cat([sc, sink], dim=-1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(sc, dim=-1)
    return (p @ vf).to(dt)


def check(name, q, k, v, o, causal, scale, kw, dt) -> float:
    """Max abs error of mhakit's O against the fp32 reference on batch 0 (all heads), asserted within tolerance."""
    ref = reference(q[:1], k[:1], v[:1], causal, scale,
                    {n: (t[:1] if n == "bias" and t.shape[0] > 1 else t) for n, t in kw.items()}, dt).float()
    err = (o[:1].float() - ref).abs()
    atol, rtol = tolerances(next(n for n, t in DTYPES.items() if t == dt))
    bad = err > atol + rtol * ref.abs()
    if bool(bad.any()):
        raise SystemExit(f"{name}: mhakit's O differs from the reference (max abs error {err.max().item():.3g})")
    return err.max().item()


def run(opts) -> list[dict]:
    dt = DTYPES[opts.dtype]
    s, d = opts.seqlen, opts.hdim
    b, h = opts.tokens // s, opts.hidden // d
    scale = 1.0 / math.sqrt(d)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn((b, h, s, d), device="cuda", dtype=dt, generator=gen) for _ in range(3))
    do = torch.randn((b, h, s, d), device="cuda", dtype=dt, generator=gen)
    rows = []
    for causal in (False, True):
        base = {}
        for name in MODS:
            kw, extra = modifiers(name, b, h, s, dt, opts, gen)
            o, lse = mhakit.mha_fwd(q, k, v, causal=causal, layout="bhsd", return_lse=True, **kw)
            err = check(name, q, k, v, o, causal, scale, kw, dt) if name != "plain" else None
            for direction in opts.directions:
                if direction == "fwd" and name == "bias+dbias":
                    continue
                if direction == "fwd":
                    fn = lambda: mhakit.mha_fwd(q, k, v, causal=causal, layout="bhsd", out=o, **kw)  # noqa: E731
                else:
                    bw = dict(kw, **extra)
                    fn = lambda: mhakit.mha_bwd(do, q, k, v, o, lse, causal=causal, layout="bhsd", **bw)  # noqa: E731
                fn()
                ms = time_launches(fn, opts.warmup, opts.repeat)
                key = (direction, causal)
                if name == "plain":
                    base[key] = ms
                rows.append({"direction": direction, "causal": causal, "modifier": name, "impl": "mhakit",
                             "ms": ms, "cost": ms / base[key] - 1.0, "max_abs_err": err})
                if "dbias" in extra and direction == "bwd":
                    # The least memory traffic dbias adds: the bias read and dbias written once, as one device copy
                    # (what any backward with dbias pays on top of the plain call, whatever its kernel does).
                    ms = time_launches(lambda: extra["dbias"].copy_(kw["bias"]), opts.warmup, opts.repeat)
                    rows.append({"direction": direction, "causal": causal, "modifier": "bias+dbias traffic",
                                 "impl": "floor", "ms": ms, "cost": ms / base[key]})
        rows += cudnn_rows(q, k, v, do, causal, scale, opts, gen)
    return rows


def cudnn_rows(q, k, v, do, causal: bool, scale: float, opts, gen) -> list[dict]:
    """cuDNN through SDPA: plain, and with a [1, 1, s, s] additive bias as attn_mask (causal folded into the bias as
    -inf, since SDPA takes either attn_mask or is_causal)."""
    s = q.shape[2]
    bias = torch.randn((1, 1, s, s), device="cuda", dtype=q.dtype, generator=gen)
    if causal:
        pos = torch.arange(s, device="cuda")
        bias = bias.masked_fill(pos.view(-1, 1) < pos.view(1, -1), float("-inf"))
    rows, plain = [], {}
    for name, mask in (("plain", None), ("bias", bias)):
        for direction in opts.directions:
            qq, kk, vv = (t.detach().requires_grad_(direction == "bwd") for t in (q, k, v))
            try:
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    call = lambda: F.scaled_dot_product_attention(  # noqa: E731
                        qq, kk, vv, attn_mask=mask, is_causal=causal and mask is None, scale=scale)
                    if direction == "fwd":
                        ms = time_launches(call, opts.warmup, opts.repeat)
                    else:
                        out = call()
                        ms = time_launches(lambda: torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True),
                                           opts.warmup, opts.repeat)
            except RuntimeError as exc:  # cuDNN refuses the case: say so in the row
                rows.append({"direction": direction, "causal": causal, "modifier": name, "impl": "cudnn",
                             "ms": None, "cost": None, "note": str(exc).splitlines()[0][:120]})
                continue
            if name == "plain":
                plain[direction] = ms
            rows.append({"direction": direction, "causal": causal, "modifier": name, "impl": "cudnn", "ms": ms,
                         "cost": ms / plain[direction] - 1.0 if direction in plain else None})
    return rows


def table(rows: list[dict], opts) -> str:
    lines = [f"hd {opts.hdim}, s {opts.seqlen}, {opts.dtype}, batch {opts.tokens // opts.seqlen}, "
             f"heads {opts.hidden // opts.hdim}", "",
             "| direction | causal | modifier | mhakit ms | cost | cuDNN ms | cuDNN cost |", "|---|---|---|---|---|---|---|"]
    peers = {(r["direction"], r["causal"], r["modifier"]): r for r in rows if r["impl"] == "cudnn"}
    for r in rows:
        if r["impl"] not in ("mhakit", "floor"):
            continue
        p = peers.get((r["direction"], r["causal"], r["modifier"]), {})
        plain = r["modifier"] == "plain"
        cost = "" if plain else fmt(100 * r["cost"], "+.1f", " %")
        peer_ms = fmt(p.get("ms"), ".3f") if p else ""
        peer_cost = "" if plain or p.get("cost") is None else fmt(100 * p["cost"], "+.1f", " %")
        causal = "yes" if r["causal"] else "no"
        lines.append(f"| {r['direction']} | {causal} | {r['modifier']} | {fmt(r['ms'], '.3f')} | {cost} | {peer_ms} | "
                     f"{peer_cost} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    opts = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_mods.py needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = run(opts)
    print(table(rows, opts))
    if opts.json:
        Path(opts.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
