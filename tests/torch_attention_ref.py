"""Attention written out in PyTorch with the score modifiers and dropout, for mhakit.torch's tests (the GPU file
against the kernels, the CPU plumbing file against the NumPy reference behind mhakit's calls). Imported only by
modules that already have torch."""
from __future__ import annotations

import torch


def attention_ref(q, k, v, *, causal=False, softcap=None, alibi=None, bias=None, sink=None, keep=None, p=0.0):
    """Attention on bshd tensors in at least fp32 (fp64 stays fp64), GQA by repeating kv heads, modifiers in
    mhakit's order: soft-cap, ALiBi (-slope·|i + s_k - s_q - j|), bias, mask (bottom-right causal), sink, dropout
    (keep / (1 - p)). Differentiable in every tensor it is given."""
    dt = torch.promote_types(q.dtype, torch.float32)
    q, k, v = (t.to(dt).transpose(1, 2) for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    sq, sk = q.shape[2], k.shape[2]
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(sq, device=q.device).view(-1, 1)
    j = torch.arange(sk, device=q.device).view(1, -1)
    if alibi is not None:
        s = s - alibi.to(dt).view(1, -1, 1, 1) * (i + sk - sq - j).abs().to(dt)
    if bias is not None:
        s = s + bias.to(dt)
    if causal:
        s = s.masked_fill(j > i + sk - sq, float("-inf"))
    if sink is not None:
        col = sink.to(dt).view(1, -1, 1, 1).expand(s.shape[0], -1, sq, 1)
        prob = torch.softmax(torch.cat([s, col], dim=-1), dim=-1)[..., :-1]
    else:
        prob = torch.softmax(s, dim=-1)
    if keep is not None:
        prob = prob * keep.to(dt) / (1.0 - p)
    return (prob @ v).transpose(1, 2)
