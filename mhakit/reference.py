"""NumPy reference of the mhakit forward and backward passes (CPU, no GPU, no torch).

Semantics are those of csrc/include/mha_fwd.h and csrc/include/mha_bwd.h:

    O      = softmax(scale * Q K^T, restricted to the visible keys) V        (accumulated in float64 by default)
    LSE[i] = log(sum_j exp(scale * q_i . k_j))  over the keys row i may see  (natural log)
    backward, for an incoming gradient dO (P = softmax(...) as above, recomputed):
    dP = dO V^T,  D = rowsum(dO * O),  dS = P * (dP - D),  dV = P^T dO,  dQ = scale dS K,  dK = scale dS^T Q

* GQA / MQA: query head h reads key/value head h // (nhead_q // nhead_k).
* Masks follow CK's generic coordinate (csrc/kernels/common/mask.h, ``make_mask_coord``), computed per sequence:
  row i sees key j iff ``i - y + 1 <= j < min(i + x, seqlen_k)``.
* Rows that see no key (seqlen_k == 0, or a window that excludes every key) give O = 0 and LSE = -inf, and in the
  backward dQ = 0; keys that no row sees get dK = dV = 0. With GQA, dK / dV of a kv head are summed over the query
  heads that read it.

Inputs may be float16, float32 (e.g. bf16 values widened to float32) or float64; outputs are float32.
The module also holds the helpers every test and bench shares: ``mask_coord``, ``visible_mask``, ``parse_mask``
(the CLI mask strings of CK / aiter), ``check_close`` (CK's pass rule), ``tolerances`` / ``tolerances_bwd`` and
``flops_fwd`` / ``flops_bwd`` (FlashAttention's count).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Tuple

import numpy as np

__all__ = [
    "MASK_NONE",
    "MASK_TOP_LEFT",
    "MASK_BOTTOM_RIGHT",
    "MASK_GENERIC",
    "MaskCoord",
    "MaskSpec",
    "CloseResult",
    "mask_coord",
    "visible_mask",
    "parse_mask",
    "attention_fwd",
    "attention_varlen_fwd",
    "attention_fwd_kvcache",
    "attention_bwd",
    "attention_varlen_bwd",
    "check_close",
    "tolerances",
    "tolerances_bwd",
    "flops_fwd",
    "flops_bwd",
]

# Same numbers as mhakit_mask_type in csrc/include/mha_common.h (and CK / aiter).
MASK_NONE = 0
MASK_TOP_LEFT = 1
MASK_BOTTOM_RIGHT = 2
MASK_GENERIC = 3
_MASK_TYPES = (MASK_NONE, MASK_TOP_LEFT, MASK_BOTTOM_RIGHT, MASK_GENERIC)

# Rows x keys of one score block; bounds the reference's temporary memory (2^22 float64 = 32 MiB per array).
_BLOCK_ELEMS = 1 << 22


# ----------------------------------------------------------------------------------------------------------------
# Masks
# ----------------------------------------------------------------------------------------------------------------


class MaskCoord(NamedTuple):
    """CK's generic mask coordinate: row i sees keys j with ``i - y + 1 <= j < min(i + x, seqlen_k)``."""

    y: int
    x: int


class MaskSpec(NamedTuple):
    """A mask as the API takes it: ``mhakit_fwd_args.mask_type / window_size_left / window_size_right``."""

    mask_type: int
    left: int
    right: int


def mask_coord(mask_type: int, left: int, right: int, seqlen_q: int, seqlen_k: int) -> MaskCoord:
    """(y, x) of one sequence, exactly as ``mhakit::make_mask_coord`` in csrc/kernels/common/mask.h."""
    mask_type, left, right, seqlen_q, seqlen_k = (int(mask_type), int(left), int(right), int(seqlen_q),
                                                  int(seqlen_k))
    if mask_type not in _MASK_TYPES:
        raise ValueError(f"mask_type must be one of {_MASK_TYPES}, got {mask_type}")
    if mask_type == MASK_NONE:
        return MaskCoord(seqlen_q, seqlen_k)
    if mask_type == MASK_GENERIC:
        return MaskCoord(left, right)
    top_left = mask_type == MASK_TOP_LEFT
    if left < 0:
        left = seqlen_q - 1 if top_left else seqlen_k - 1
    if right < 0:
        right = seqlen_k - 1 if top_left else seqlen_q - 1
    x = 1 + right + (0 if top_left else seqlen_k - seqlen_q)
    y = 1 + left + (0 if top_left else seqlen_q - seqlen_k)
    return MaskCoord(y, x)


def visible_mask(mask_type: int, left: int, right: int, seqlen_q: int, seqlen_k: int) -> np.ndarray:
    """Boolean [seqlen_q, seqlen_k] matrix: True where query row i may see key j."""
    c = mask_coord(mask_type, left, right, seqlen_q, seqlen_k)
    return _visible_rows(c, 0, seqlen_q, seqlen_k)


def _visible_rows(c: MaskCoord, row_begin: int, row_end: int, seqlen_k: int) -> np.ndarray:
    i = np.arange(row_begin, row_end, dtype=np.int64)[:, None]
    j = np.arange(seqlen_k, dtype=np.int64)[None, :]
    # j < seqlen_k holds by construction, so min(i + x, seqlen_k) reduces to i + x.
    return (j >= i - c.y + 1) & (j < i + c.x)


def _parse_ints(text: str, count: int, what: str) -> Tuple[int, ...]:
    parts = text.split(",")
    if len(parts) != count:
        if len(parts) == count + 1:
            raise ValueError(f"mask {what!r}: attention sinks are not supported")
        raise ValueError(f"mask {what!r}: expected {count} comma-separated integer(s)")
    try:
        return tuple(int(p.strip()) for p in parts)
    except ValueError:
        raise ValueError(f"mask {what!r}: expected integers") from None


def parse_mask(text: str) -> MaskSpec:
    """Decode a CLI mask string (the grammar of CK's / aiter's ``mask_info::decode``).

    ``0`` none; ``1``/``t`` causal top-left; ``2``/``b`` causal bottom-right; ``t:l,r`` / ``b:l,r`` sliding window
    anchored top-left / bottom-right (FA style, -1 = unbounded); ``g:y,x`` raw generic coordinate;
    ``xt:w`` / ``xb:w`` xformers window of w keys (w > 0: left = w // 2, right = w - 1 - left; w <= 0: causal).
    """
    s = str(text).strip()
    if s == "0":
        return MaskSpec(MASK_NONE, -1, -1)
    if s in ("1", "t"):
        return MaskSpec(MASK_TOP_LEFT, -1, 0)
    if s in ("2", "b"):
        return MaskSpec(MASK_BOTTOM_RIGHT, -1, 0)
    head, sep, rest = s.partition(":")
    if sep:
        if head in ("t", "b"):
            left, right = _parse_ints(rest, 2, s)
            return MaskSpec(MASK_TOP_LEFT if head == "t" else MASK_BOTTOM_RIGHT, left, right)
        if head == "g":
            y, x = _parse_ints(rest, 2, s)
            return MaskSpec(MASK_GENERIC, y, x)
        if head in ("xt", "xb"):
            (w,) = _parse_ints(rest, 1, s)
            mtype = MASK_TOP_LEFT if head == "xt" else MASK_BOTTOM_RIGHT
            if w > 0:
                left = w // 2
                return MaskSpec(mtype, left, w - 1 - left)
            return MaskSpec(mtype, -1, 0)
    raise ValueError(
        f"invalid mask string {text!r}; expected 0, 1/t, 2/b, t:l,r, b:l,r, g:y,x, xt:w or xb:w")


# ----------------------------------------------------------------------------------------------------------------
# Forward reference
# ----------------------------------------------------------------------------------------------------------------


def _check_compute_dtype(compute_dtype, name: str = "compute_dtype") -> np.dtype:
    dt = np.dtype(compute_dtype)
    if dt not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise ValueError(f"{name} must be float32 or float64, got {dt}")
    return dt


def _as_float(a, dt: np.dtype, name: str) -> np.ndarray:
    arr = np.asarray(a)
    if arr.dtype.kind not in "fiu" and arr.dtype.name != "bfloat16":
        raise TypeError(f"{name} must hold real numbers, got dtype {arr.dtype}")
    return arr.astype(dt, copy=False)


def _default_scale(scale: Optional[float], hdim_q: int) -> float:
    if scale is None:
        if hdim_q <= 0:
            raise ValueError("scale=None needs hdim_q > 0")
        return 1.0 / math.sqrt(hdim_q)
    scale = float(scale)
    if not math.isfinite(scale) or scale <= 0.0:
        raise ValueError(f"scale must be finite and > 0, got {scale}")
    return scale


# ----------------------------------------------------------------------------------------------------------------
# Dropout's random bytes: Philox4x32-10 and the byte of each score (csrc/kernels/common/dropout.h states the rule)
# ----------------------------------------------------------------------------------------------------------------

_U32 = np.uint64(0xFFFFFFFF)


def philox4x32_10(c0, c1, c2, c3, k0: int, k1: int):
    """Philox4x32 with 10 rounds (Salmon et al., SC 2011) over arrays of 32-bit counters (any broadcastable shapes)
    under the key (k0, k1): the four 32-bit output words, as uint64 arrays."""
    c0, c1, c2, c3 = (np.asarray(x, dtype=np.uint64) & _U32 for x in (c0, c1, c2, c3))
    k0, k1 = np.uint64(k0 & 0xFFFFFFFF), np.uint64(k1 & 0xFFFFFFFF)
    m0, m1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
    w0, w1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
    shift = np.uint64(32)
    for _ in range(10):
        p0, p1 = m0 * c0, m1 * c2  # < 2**64: exact
        c0, c1, c2, c3 = (p1 >> shift) ^ c1 ^ k0, p1 & _U32, (p0 >> shift) ^ c3 ^ k1, p0 & _U32
        k0, k1 = (k0 + w0) & _U32, (k1 + w1) & _U32
    return c0, c1, c2, c3


def _randval_block(seed: int, offset: int, bh: int, seqlen_q: int, seqlen_k: int) -> np.ndarray:
    """uint8 [seqlen_q, seqlen_k]: the random bytes of head index bh = b·nhead_q + h."""
    i = np.arange(seqlen_q, dtype=np.uint64)[:, None]
    j = np.arange(seqlen_k, dtype=np.uint64)[None, :]
    one, two, three, four = (np.uint64(x) for x in (1, 2, 3, 4))
    c0 = (j >> four) * four + ((j >> one) & three)
    c1 = (i >> four) * four + ((i >> one) & three)
    c3 = ((offset >> 32) + bh) & 0xFFFFFFFF
    x = philox4x32_10(c0, c1, offset & 0xFFFFFFFF, c3, seed & 0xFFFFFFFF, seed >> 32)
    byte = (i & one) * np.uint64(8) + ((i >> np.uint64(3)) & one) * four + ((j >> np.uint64(3)) & one) * two + (j & one)
    words = np.stack([np.broadcast_to(w, (seqlen_q, seqlen_k)) for w in x])  # [4, sq, sk]
    word = np.take_along_axis(words, (byte >> two).astype(np.intp)[None], axis=0)[0]
    return ((word >> (np.uint64(8) * (byte & three))) & np.uint64(0xFF)).astype(np.uint8)


def dropout_randval(seed: int, offset: int, batch: int, nhead: int, seqlen_q: int, seqlen_k: int) -> np.ndarray:
    """The random bytes dropout draws for a batch-mode call, uint8 [batch, nhead, seqlen_q, seqlen_k] (what the
    forward's randval= receives for every score it visits)."""
    out = np.empty((batch, nhead, seqlen_q, seqlen_k), dtype=np.uint8)
    for b in range(batch):
        for h in range(nhead):
            out[b, h] = _randval_block(seed, offset, b * nhead + h, seqlen_q, seqlen_k)
    return out


def dropout_randval_varlen(seed: int, offset: int, cu_seqlens_q, cu_seqlens_k, nhead: int) -> np.ndarray:
    """The same for a varlen call: uint8 [nhead, total_q, max_seqlen_k], sequence b's row r at
    [:, cu_seqlens_q[b] + r, :s_k_b] (zeros elsewhere)."""
    cq, ck = np.asarray(cu_seqlens_q, dtype=np.int64), np.asarray(cu_seqlens_k, dtype=np.int64)
    max_k = int(np.diff(ck).max()) if len(ck) > 1 else 0
    out = np.zeros((nhead, int(cq[-1]), max_k), dtype=np.uint8)
    for b in range(len(cq) - 1):
        q0, q1, nk = int(cq[b]), int(cq[b + 1]), int(ck[b + 1] - ck[b])
        for h in range(nhead):
            out[h, q0:q1, :nk] = _randval_block(seed, offset, b * nhead + h, q1 - q0, nk)
    return out


def dropout_keep_max(dropout_p: float) -> int:
    """A score is kept when its random byte is <= this (floor((1 - p)·255), CK's and aiter's rule)."""
    return min(255, max(0, int(np.float32((np.float32(1.0) - np.float32(dropout_p)) * np.float32(255.0)))))


def _drop_factors(dropout_p: float, randval_block) -> Optional[np.ndarray]:
    """[s_q, s_k] of 1/(1-p) where the score is kept and 0 where dropped (None without dropout)."""
    if not dropout_p:
        return None
    if randval_block is None:
        raise ValueError("dropout_p > 0 needs randval= (the random bytes: the forward's store, or dropout_randval)")
    keep = np.asarray(randval_block) <= dropout_keep_max(dropout_p)
    return np.where(keep, 1.0 / (1.0 - float(np.float32(dropout_p))), 0.0)


def _mod_logits(s: np.ndarray, scale: float, r0: int, r1: int, sq: int, sk: int, softcap, slope, bias_rows):
    """Scaled q·k of rows r0..r1 -> the modified logits (soft-cap, ALiBi, bias; mhakit_fwd_args' order), and the
    soft-cap's derivative with respect to scale·q·k (1 without one)."""
    dcap = None
    if softcap:
        t = np.tanh(s / s.dtype.type(softcap))
        s = s.dtype.type(softcap) * t
        dcap = 1.0 - t * t
    if slope is not None:
        i = np.arange(r0, r1)[:, None]
        j = np.arange(sk)[None, :]
        s = s - s.dtype.type(slope) * np.abs(i + (sk - sq) - j).astype(s.dtype)
    if bias_rows is not None:
        s = s + bias_rows[r0:r1, :sk].astype(s.dtype)
    return s, dcap


def _attend_one_head(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, c: MaskCoord,
                     o_out: np.ndarray, lse_out: np.ndarray, softcap=None, slope=None, bias_rows=None,
                     sink=None, drop=None) -> None:
    """One (sequence, query head): q [sq, d], k [sk, d], v [sk, dv] -> o_out [sq, dv], lse_out [sq]. Score
    modifiers: softcap (cap), slope (ALiBi), bias_rows ([>= sq, >= sk] elementwise bias), sink (logit); drop
    ([sq, sk] dropout factors, _drop_factors: O takes P ∘ drop, the LSE stays the undropped one)."""
    sq, sk = q.shape[0], k.shape[0]
    if sq == 0:
        return
    if sk == 0:
        o_out[...] = 0.0
        lse_out[...] = -np.inf if sink is None else sink
        return
    rows = max(1, _BLOCK_ELEMS // sk)
    kt = k.T
    for r0 in range(0, sq, rows):
        r1 = min(sq, r0 + rows)
        vis = _visible_rows(c, r0, r1, sk)
        any_vis = vis.any(axis=1)
        s = (q[r0:r1] @ kt) * q.dtype.type(scale)
        s, _ = _mod_logits(s, scale, r0, r1, sq, sk, softcap, slope, bias_rows)
        s = np.where(vis, s, -np.inf)
        m = np.where(any_vis, s.max(axis=1), 0.0).astype(s.dtype)
        if sink is not None:  # the sink: one more term exp(sink) in the denominator, with no value
            m = np.maximum(m, s.dtype.type(sink))
            any_vis = np.ones_like(any_vis)
        p = np.exp(s - m[:, None])  # masked entries: exp(-inf) = 0
        l = p.sum(axis=1) + (0.0 if sink is None else np.exp(s.dtype.type(sink) - m))
        l_safe = np.where(any_vis, l, 1.0)
        if drop is not None:
            p = p * drop[r0:r1].astype(p.dtype)
        o = (p @ v) / l_safe[:, None]
        o[~any_vis] = 0.0
        with np.errstate(divide="ignore"):
            lse = np.where(any_vis, m + np.log(l_safe), -np.inf)
        o_out[r0:r1] = o
        lse_out[r0:r1] = lse


def _kv_group(nhead_q: int, nhead_k: int) -> int:
    if nhead_k <= 0 or nhead_q % nhead_k != 0:
        raise ValueError(f"nhead_q ({nhead_q}) must be a positive multiple of nhead_k ({nhead_k})")
    return nhead_q // nhead_k


def _to_bhsd(arrays, layout: str):
    """The arrays (None stays None) in b·h·s·d order, from layout 'bhsd' or 'bshd'."""
    if layout == "bshd":
        return tuple(None if a is None else a.transpose(0, 2, 1, 3) for a in arrays)
    if layout != "bhsd":
        raise ValueError(f"layout must be 'bhsd' or 'bshd', got {layout!r}")
    return tuple(arrays)


def _batch_shapes(q, k, v):
    """(b, h_q, s_q, d, h_k, s_k, d_v) of batch-mode q, k, v in b·h·s·d order; ValueError when they disagree."""
    b, hq, sq, d = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(f"batch mismatch: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}")
    hk, sk = k.shape[1], k.shape[2]
    if k.shape[3] != d:
        raise ValueError(f"k head dim {k.shape[3]} != q head dim {d}")
    if v.shape[1] != hk or v.shape[2] != sk:
        raise ValueError(f"v shape {v.shape} does not match k shape {k.shape} in heads / seqlen")
    return b, hq, sq, d, hk, sk, v.shape[3]


def _packed_shapes(q, k, v):
    """(total_q, h_q, d, total_k, h_k, d_v) of packed [total, h, d] q, k, v; ValueError when they disagree."""
    total_q, hq, d = q.shape
    total_k, hk = k.shape[0], k.shape[1]
    if k.shape[2] != d:
        raise ValueError(f"k head dim {k.shape[2]} != q head dim {d}")
    if v.shape[0] != total_k or v.shape[1] != hk:
        raise ValueError(f"v shape {v.shape} does not match k shape {k.shape} in tokens / heads")
    return total_q, hq, d, total_k, hk, v.shape[2]


def _head_mods(b: int, h: int, alibi_slopes, bias, sink) -> dict:
    """The modifiers of (sequence b, query head h): ALiBi slopes [h] or [b, h], bias [b|1, h|1, s_q, s_k] (a
    dimension of extent 1 broadcasts), sink logits [h]."""
    out = {}
    if alibi_slopes is not None:
        sl = np.asarray(alibi_slopes, dtype=np.float64)
        out["slope"] = float(sl[h] if sl.ndim == 1 else sl[b, h])
    if bias is not None:
        out["bias_rows"] = bias[b if bias.shape[0] > 1 else 0, h if bias.shape[1] > 1 else 0]
    if sink is not None:
        out["sink"] = float(np.asarray(sink, dtype=np.float64)[h])
    return out


def attention_fwd(q, k, v, *, scale: Optional[float] = None, mask_type: int = MASK_NONE, window_left: int = -1,
                  window_right: int = -1, return_lse: bool = False, layout: str = "bhsd",
                  compute_dtype=np.float64, out_dtype=np.float32, softcap: Optional[float] = None,
                  alibi_slopes=None, bias=None, sink=None, dropout_p: float = 0.0, randval=None):
    """Batch-mode forward over arrays in [b, h, s, d] (``layout="bhsd"``, default) or [b, s, h, d] ("bshd").

    q: [b, h_q, s_q, d], k: [b, h_k, s_k, d], v: [b, h_k, s_k, d_v] with h_q % h_k == 0 (h_k is read from k).
    scale: softmax scale (default 1/sqrt(d)). mask_type / window_left / window_right as in mhakit_fwd_args.
    Returns O as float32 in the input layout ([b, h_q, s_q, d_v] for bhsd), and with ``return_lse`` also
    LSE as float32 [b, h_q, s_q] (natural log; -inf for rows that see no key). ``out_dtype=np.float64`` returns
    both in float64 instead (finite-difference checks need that). Score modifiers as in mhakit_fwd_args:
    ``softcap`` (cap·tanh(l/cap)), ``alibi_slopes`` [h_q] or [b, h_q] (-slope·|i + s_k - s_q - j|), ``bias``
    [b|1, h_q|1, s_q, s_k], ``sink`` [h_q] (exp(sink) joins the denominator; a row without keys gets LSE = sink).
    Dropout: ``dropout_p`` with ``randval`` uint8 [b, h_q, s_q, s_k], the random bytes (the forward's store, or
    ``dropout_randval``): a probability is kept where its byte <= ``dropout_keep_max(p)`` and scaled by 1/(1-p).
    """
    dt = _check_compute_dtype(compute_dtype)
    odt = _check_compute_dtype(out_dtype, "out_dtype")
    q, k, v = _as_float(q, dt, "q"), _as_float(k, dt, "k"), _as_float(v, dt, "v")
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError("q, k, v must be 4-D arrays")
    q, k, v = _to_bhsd((q, k, v), layout)
    b, hq, sq, d, hk, sk, dv = _batch_shapes(q, k, v)
    group = _kv_group(hq, hk)
    scale = _default_scale(scale, d)
    c = mask_coord(mask_type, window_left, window_right, sq, sk)

    o = np.zeros((b, hq, sq, dv), dtype=odt)
    lse = np.full((b, hq, sq), -np.inf, dtype=odt)
    for bi in range(b):
        for h in range(hq):
            kh = h // group
            _attend_one_head(q[bi, h], k[bi, kh], v[bi, kh], scale, c, o[bi, h], lse[bi, h], softcap=softcap,
                             drop=_drop_factors(dropout_p, None if randval is None else randval[bi, h, :sq, :sk]),
                             **_head_mods(bi, h, alibi_slopes, bias, sink))
    if layout == "bshd":
        o = np.ascontiguousarray(o.transpose(0, 2, 1, 3))
    return (o, lse) if return_lse else o


# ----------------------------------------------------------------------------------------------------------------
# fp8 e4m3 (OCP e4m3fn: bias 7, no infinities, 0x7F / 0xFF NaN, largest finite 448): the fp8 forward's inputs
# ----------------------------------------------------------------------------------------------------------------

E4M3_MAX = 448.0


def _e4m3_table() -> np.ndarray:
    codes = np.arange(256, dtype=np.int64)
    e, m = (codes >> 3) & 0xF, codes & 0x7
    mag = np.where(e == 0, m * 2.0 ** -9, (1.0 + m / 8.0) * np.exp2(e - 7.0))
    mag = np.where((e == 0xF) & (m == 0x7), np.nan, mag)
    return np.where(codes & 0x80, -mag, mag).astype(np.float32)


_E4M3 = _e4m3_table()
_E4M3_POS = _E4M3[:0x7F].astype(np.float64)  # codes 0 .. 126: 0 .. 448, increasing


def e4m3_to_float(codes) -> np.ndarray:
    """e4m3fn bytes (uint8, any shape; or a float8_e4m3fn array viewed as uint8) -> float32, exactly."""
    c = np.asarray(codes)
    if c.dtype != np.uint8:
        raise TypeError(f"e4m3 codes must be uint8 bytes, got dtype {c.dtype}")
    return _E4M3[c]


def float_to_e4m3(x) -> np.ndarray:
    """float -> e4m3fn bytes (uint8): round to nearest, ties to even, saturating to ±448 (cvt.rn.satfinite); NaN ->
    0x7F."""
    a = np.asarray(x, dtype=np.float64)
    mag = np.minimum(np.abs(np.nan_to_num(a, nan=0.0)), E4M3_MAX)
    hi = np.clip(np.searchsorted(_E4M3_POS, mag, side="left"), 0, 0x7E)  # first code >= mag
    lo = np.maximum(hi - 1, 0)
    d_lo, d_hi = mag - _E4M3_POS[lo], _E4M3_POS[hi] - mag
    code = np.where((d_lo < d_hi) | ((d_lo == d_hi) & (lo % 2 == 0)), lo, hi)  # codes are monotone: even = even mantissa
    code = np.where(mag == _E4M3_POS[hi], hi, code).astype(np.uint8)
    code = np.where(np.signbit(a), code | 0x80, code)
    return np.where(np.isnan(a), np.uint8(0x7F), code).astype(np.uint8)


def quantize_e4m3(x, per_tensor: bool = True) -> Tuple[np.ndarray, float]:
    """(e4m3 bytes, descale factor) of x: per tensor, x / (max|x| / 448) rounded (descale max|x| / 448; 1 for an
    all-zero tensor), as the benchmark's -qscale=pt does; otherwise x itself rounded (saturating) with descale 1."""
    a = np.asarray(x, dtype=np.float64)
    amax = float(np.max(np.abs(a))) if per_tensor and a.size else 0.0
    descale = amax / E4M3_MAX if amax > 0.0 else 1.0
    return float_to_e4m3(a / descale), descale


def attention_fwd_fp8(q, k, v, descale_q: float, descale_k: float, descale_v: float, **kwargs):
    """The fp8 forward's meaning (mha_fwd.h): q, k, v e4m3 bytes (uint8) whose real values are q·dq, k·dk, v·dv;
    :func:`attention_fwd` on those values, in fp32/fp64 (P is not rounded here: the kernels round it to e4m3 for the
    P·V product, which :func:`tolerances_fp8` accounts for)."""
    return attention_fwd(e4m3_to_float(q) * np.float32(descale_q), e4m3_to_float(k) * np.float32(descale_k),
                         e4m3_to_float(v) * np.float32(descale_v), **kwargs)


def tolerances_fp8(v_absmax: float) -> Tuple[float, float]:
    """(rtol, atol) for an fp8 forward's O against :func:`attention_fwd_fp8`, v_absmax = max|v·dv|. The kernels round
    each unnormalised probability (<= 1) to e4m3 for P·V: at most 2^-4 of it in e4m3's normal range (3 mantissa
    bits, round to nearest), at most 2^-10 absolute below 2^-6. With normal probabilities only, O = Σ P̃·v / Σ P is off
    by at most 2^-4·max|v| (random rounding errors of both signs make it several times smaller in practice); the
    tiny ones add errors of both signs that the row sum dilutes; plus the bf16 / fp16 rounding of O itself."""
    return 2e-2, max(1e-2, 0.0625 * float(v_absmax))


def _check_seqstarts(cu, total: int, name: str) -> np.ndarray:
    arr = np.asarray(cu)
    if arr.ndim != 1 or arr.shape[0] < 1 or arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must be a 1-D integer array of batch + 1 offsets")
    arr = arr.astype(np.int64)
    if np.any(np.diff(arr) < 0) or arr[0] < 0 or arr[-1] > total:
        raise ValueError(f"{name} must be non-decreasing offsets within [0, {total}], got {arr.tolist()}")
    return arr


def attention_fwd_kvcache(q, k_cache, v_cache, cache_seqlens, *, block_table=None, k=None, v=None,
                          cache_batch_idx=None, scale: Optional[float] = None, mask_type: int = MASK_NONE,
                          window_left: int = -1, window_right: int = -1, return_lse: bool = False,
                          compute_dtype=np.float64, out_dtype=np.float32):
    """Decode against a KV cache (``mhakit.mha_fwd_kvcache``, FlashAttention's ``flash_attn_with_kvcache``).

    q: [b, s_q, h_q, d]; k_cache / v_cache: [b_c, s_cache, h_k, d / d_v], or paged [num_blocks, page_block_size,
    h_k, ...] with ``block_table`` [b, max_blocks] (row j of batch i lives in page block_table[i, j // page_size] at
    row j % page_size); cache_seqlens [b]: rows each batch's cache holds; k / v [b, s_new, h_k, d / d_v]: new rows
    appended at rows cache_seqlens[i] .. + s_new; cache_batch_idx [b]: the cache batch of each batch (contiguous
    caches). Batch i attends to its cache_seqlens[i] + s_new rows with the mask over (s_q, that many) keys
    (mask_type 2 with (-1, 0) is the bottom-right causal mask).
    Returns (O float32 [b, s_q, h_q, d_v], k_cache', v_cache') where the caches are copies holding the appended rows
    (the device call writes them in place), and with ``return_lse`` LSE float32 [b, h_q, s_q] after O.
    """
    dt = _check_compute_dtype(compute_dtype)
    q = _as_float(q, dt, "q")
    kc, vc = np.array(k_cache, copy=True), np.array(v_cache, copy=True)
    if q.ndim != 4 or kc.ndim != 4 or vc.ndim != 4:
        raise ValueError("q, k_cache, v_cache must be 4-D arrays")
    b, sq, hq, d = q.shape
    seqlens = np.asarray(cache_seqlens, dtype=np.int64).reshape(-1)
    if seqlens.shape[0] != b or np.any(seqlens < 0):
        raise ValueError(f"cache_seqlens must hold {b} non-negative lengths, got {seqlens.tolist()}")
    s_new = 0 if k is None else np.asarray(k).shape[1]
    page = kc.shape[1]
    table = None if block_table is None else np.asarray(block_table, dtype=np.int64)
    batch_map = np.arange(b) if cache_batch_idx is None else np.asarray(cache_batch_idx, dtype=np.int64)

    def rows(i, j0, j1):  # (cache batch or page index, row) of batch i's rows j0 .. j1 - 1
        j = np.arange(j0, j1)
        if table is None:
            return np.full_like(j, batch_map[i]), j
        return table[i, j // page], j % page

    if k is not None:
        kn, vn = np.asarray(k), np.asarray(v)
        for i in range(b):
            cb, r = rows(i, int(seqlens[i]), int(seqlens[i]) + s_new)
            kc[cb, r], vc[cb, r] = kn[i], vn[i]
    hk, dv = kc.shape[2], vc.shape[3]
    group = _kv_group(hq, hk)
    scale = _default_scale(scale, d)
    odt = _check_compute_dtype(out_dtype, "out_dtype")
    o = np.zeros((b, sq, hq, dv), dtype=odt)
    lse = np.full((b, hq, sq), -np.inf, dtype=odt)
    for i in range(b):
        n = int(seqlens[i]) + s_new
        cb, r = rows(i, 0, n)
        keys, values = _as_float(kc[cb, r], dt, "k_cache"), _as_float(vc[cb, r], dt, "v_cache")  # [n, h_k, d]
        c = mask_coord(mask_type, window_left, window_right, sq, n)
        for h in range(hq):
            buf = np.empty((sq, dv), dtype=odt)
            _attend_one_head(q[i, :, h], keys[:, h // group], values[:, h // group], scale, c, buf, lse[i, h])
            o[i, :, h] = buf
    return (o, lse, kc, vc) if return_lse else (o, kc, vc)


def attention_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, *, scale: Optional[float] = None,
                         mask_type: int = MASK_NONE, window_left: int = -1, window_right: int = -1,
                         return_lse: bool = False, compute_dtype=np.float64, out_dtype=np.float32,
                         softcap: Optional[float] = None, alibi_slopes=None, bias=None, sink=None,
                         dropout_p: float = 0.0, randval=None):
    """Group-mode (variable length) forward over packed arrays.

    q: [total_q, h_q, d], k: [total_k, h_k, d], v: [total_k, h_k, d_v]; cu_seqlens_q / cu_seqlens_k: batch + 1
    cumulative offsets (sequence b owns rows [cu[b], cu[b+1])). Masks use each sequence's own lengths.
    Returns O float32 [total_q, h_q, d_v] and, with ``return_lse``, LSE float32 [h_q, total_q] (the layout of the
    C API's group-mode LSE). Rows outside every sequence are left at O = 0, LSE = -inf. ``out_dtype`` and the score
    modifiers as in ``attention_fwd``, per sequence: ALiBi positions count from each sequence's start, a ``bias`` is
    [b|1, h_q|1, max_s_q, max_s_k] with sequence b's block at [b, :, :s_q_b, :s_k_b]; a dropout ``randval`` is uint8
    [h_q, total_q, max_s_k] (``dropout_randval_varlen``).
    """
    dt = _check_compute_dtype(compute_dtype)
    odt = _check_compute_dtype(out_dtype, "out_dtype")
    q, k, v = _as_float(q, dt, "q"), _as_float(k, dt, "k"), _as_float(v, dt, "v")
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
        raise ValueError("q, k, v must be 3-D packed arrays [total, h, d]")
    total_q, hq, d, total_k, hk, dv = _packed_shapes(q, k, v)
    group = _kv_group(hq, hk)
    scale = _default_scale(scale, d)
    cq = _check_seqstarts(cu_seqlens_q, total_q, "cu_seqlens_q")
    ck = _check_seqstarts(cu_seqlens_k, total_k, "cu_seqlens_k")
    if cq.shape != ck.shape:
        raise ValueError(f"cu_seqlens_q has {cq.shape[0]} entries, cu_seqlens_k {ck.shape[0]}")

    o = np.zeros((total_q, hq, dv), dtype=odt)
    lse = np.full((hq, total_q), -np.inf, dtype=odt)
    for bi in range(cq.shape[0] - 1):
        q0, q1, k0, k1 = int(cq[bi]), int(cq[bi + 1]), int(ck[bi]), int(ck[bi + 1])
        c = mask_coord(mask_type, window_left, window_right, q1 - q0, k1 - k0)
        for h in range(hq):
            kh = h // group
            # o[q0:q1, h] is a strided view: write through a contiguous buffer.
            buf = np.empty((q1 - q0, dv), dtype=odt)
            _attend_one_head(q[q0:q1, h], k[k0:k1, kh], v[k0:k1, kh], scale, c, buf, lse[h, q0:q1], softcap=softcap,
                             drop=_drop_factors(dropout_p, None if randval is None else randval[h, q0:q1, :k1 - k0]),
                             **_head_mods(bi, h, alibi_slopes, bias, sink))
            o[q0:q1, h] = buf
    return (o, lse) if return_lse else o


# ----------------------------------------------------------------------------------------------------------------
# Backward reference
# ----------------------------------------------------------------------------------------------------------------


def _grad_one_head(q: np.ndarray, k: np.ndarray, v: np.ndarray, do: np.ndarray, o: Optional[np.ndarray],
                   scale: float, c: MaskCoord, dq_out: np.ndarray, dk_acc: np.ndarray, dv_acc: np.ndarray,
                   softcap=None, slope=None, bias_rows=None, sink=None, dbias_out=None, drop=None) -> float:
    """One (sequence, query head): recompute P, then dq_out [sq, d] = scale dS K and accumulate
    dk_acc [sk, d] += scale dS^T Q, dv_acc [sk, dv] += P^T dO (all in the compute dtype of q).
    D = rowsum(dO * O) with the given o [sq, dv], or with the recomputed O when o is None. With score modifiers
    dbias_out [sq, sk] (optional) receives dS of the logits; returns d sink (0 without a sink). drop: the forward's
    dropout factors [sq, sk] (dV takes P ∘ drop, dS = P ∘ (dP ∘ drop − D))."""
    sq, sk = q.shape[0], k.shape[0]
    dsink = 0.0
    if sq == 0:
        return dsink
    if sk == 0:
        dq_out[...] = 0.0
        return dsink
    rows = max(1, _BLOCK_ELEMS // sk)
    kt, vt = k.T, v.T
    sc = q.dtype.type(scale)
    for r0 in range(0, sq, rows):
        r1 = min(sq, r0 + rows)
        vis = _visible_rows(c, r0, r1, sk)
        any_vis = vis.any(axis=1)
        s = (q[r0:r1] @ kt) * sc
        s, dcap = _mod_logits(s, scale, r0, r1, sq, sk, softcap, slope, bias_rows)
        s = np.where(vis, s, -np.inf)
        m = np.where(any_vis, s.max(axis=1), 0.0).astype(s.dtype)
        if sink is not None:
            m = np.maximum(m, s.dtype.type(sink))
        p = np.exp(s - m[:, None])  # masked entries: exp(-inf) = 0
        l = p.sum(axis=1) + (0.0 if sink is None else np.exp(s.dtype.type(sink) - m))
        p_sink = None if sink is None else np.exp(s.dtype.type(sink) - m) / l
        p = p / np.where(any_vis | (sink is not None), l, 1.0)[:, None]  # rows without keys stay all-zero
        do_blk = do[r0:r1]
        dblk = None if drop is None else drop[r0:r1].astype(p.dtype)
        pd = p if dblk is None else p * dblk
        o_blk = (pd @ v) if o is None else o[r0:r1]
        d_row = (do_blk * o_blk).sum(axis=1)
        dp = do_blk @ vt
        ds = p * ((dp if dblk is None else dp * dblk) - d_row[:, None])
        if dbias_out is not None:
            dbias_out[r0:r1] = ds
        if p_sink is not None:
            dsink -= float((p_sink * d_row).sum())
        if dcap is not None:
            ds = ds * dcap
        dq_out[r0:r1] = sc * (ds @ k)
        dk_acc += sc * (ds.T @ q[r0:r1])
        dv_acc += pd.T @ do_blk
    return dsink


def attention_bwd(q, k, v, do, *, scale: Optional[float] = None, mask_type: int = MASK_NONE,
                  window_left: int = -1, window_right: int = -1, layout: str = "bhsd", o=None,
                  compute_dtype=np.float64, out_dtype=np.float32, softcap: Optional[float] = None,
                  alibi_slopes=None, bias=None, sink=None, return_mod_grads: bool = False, dropout_p: float = 0.0,
                  randval=None):
    """Batch-mode backward over arrays in [b, h, s, d] (``layout="bhsd"``, default) or [b, s, h, d] ("bshd").

    q: [b, h_q, s_q, d], k: [b, h_k, s_k, d], v: [b, h_k, s_k, d_v], do: [b, h_q, s_q, d_v] (the gradient of O).
    The forward is recomputed in ``compute_dtype`` (float64 by default, float32 possible); ``o`` (same shape as do),
    when given, is the O used for D = rowsum(dO * O) instead of the recomputed one (e.g. a kernel's fp16 O, which is
    what the library's backward reads). Returns (dq, dk, dv) in the input layout and ``out_dtype`` (float32 by
    default): dq like q, dk like k, dv like v; with GQA dk / dv are summed over each kv head's query heads.
    softcap / alibi_slopes / bias / sink: the forward's score modifiers (``attention_fwd``); with
    ``return_mod_grads`` the result also holds dbias ([b, h_q, s_q, s_k], dS of the logits) and dsink ([h_q]).
    dropout_p / randval: the forward's dropout (``attention_fwd``).
    """
    dt = _check_compute_dtype(compute_dtype)
    odt = _check_compute_dtype(out_dtype, "out_dtype")
    q, k, v, do = (_as_float(a, dt, n) for a, n in ((q, "q"), (k, "k"), (v, "v"), (do, "do")))
    if o is not None:
        o = _as_float(o, dt, "o")
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or do.ndim != 4:
        raise ValueError("q, k, v, do must be 4-D arrays")
    q, k, v, do, o = _to_bhsd((q, k, v, do, o), layout)
    b, hq, sq, d, hk, sk, dv = _batch_shapes(q, k, v)
    if do.shape != (b, hq, sq, dv):
        raise ValueError(f"do has shape {do.shape} (in bhsd order), expected {(b, hq, sq, dv)}")
    if o is not None and o.shape != do.shape:
        raise ValueError(f"o has shape {o.shape}, expected that of do {do.shape}")
    group = _kv_group(hq, hk)
    scale = _default_scale(scale, d)
    c = mask_coord(mask_type, window_left, window_right, sq, sk)

    dq = np.zeros((b, hq, sq, d), dtype=odt)
    dk = np.zeros((b, hk, sk, d), dtype=odt)
    dvv = np.zeros((b, hk, sk, dv), dtype=odt)
    dbias = np.zeros((b, hq, sq, sk), dtype=odt) if return_mod_grads else None
    dsink = np.zeros((hq,), dtype=odt)
    for bi in range(b):
        for kh in range(hk):
            dk_acc = np.zeros((sk, d), dtype=dt)
            dv_acc = np.zeros((sk, dv), dtype=dt)
            for h in range(kh * group, (kh + 1) * group):
                buf = np.zeros((sq, d), dtype=dt)
                dbias_buf = np.zeros((sq, sk), dtype=dt) if return_mod_grads else None
                dsink[h] += _grad_one_head(q[bi, h], k[bi, kh], v[bi, kh], do[bi, h], None if o is None else o[bi, h],
                                           scale, c, buf, dk_acc, dv_acc, softcap=softcap, dbias_out=dbias_buf,
                                           drop=_drop_factors(dropout_p,
                                                              None if randval is None else randval[bi, h, :sq, :sk]),
                                           **_head_mods(bi, h, alibi_slopes, bias, sink))
                dq[bi, h] = buf
                if dbias is not None:
                    dbias[bi, h] = dbias_buf
            dk[bi, kh] = dk_acc
            dvv[bi, kh] = dv_acc
    if layout == "bshd":
        dq, dk, dvv = (np.ascontiguousarray(a.transpose(0, 2, 1, 3)) for a in (dq, dk, dvv))
    return (dq, dk, dvv, dbias, dsink) if return_mod_grads else (dq, dk, dvv)


def attention_varlen_bwd(q, k, v, do, cu_seqlens_q, cu_seqlens_k, *, scale: Optional[float] = None,
                         mask_type: int = MASK_NONE, window_left: int = -1, window_right: int = -1, o=None,
                         compute_dtype=np.float64, out_dtype=np.float32, softcap: Optional[float] = None,
                         alibi_slopes=None, bias=None, sink=None, return_mod_grads: bool = False,
                         dropout_p: float = 0.0, randval=None):
    """Group-mode (variable length) backward over packed arrays.

    q: [total_q, h_q, d], k: [total_k, h_k, d], v: [total_k, h_k, d_v], do (and o, if given): [total_q, h_q, d_v];
    cu_seqlens_q / cu_seqlens_k: batch + 1 cumulative offsets. Masks use each sequence's own lengths.
    Returns (dq [total_q, h_q, d], dk [total_k, h_k, d], dv [total_k, h_k, d_v]) in ``out_dtype``; rows outside
    every sequence are left at 0. ``o``, ``compute_dtype`` as in ``attention_bwd``; the score modifiers as in
    ``attention_varlen_fwd``, and with ``return_mod_grads`` also dbias [b, h_q, max_s_q, max_s_k] (each sequence's
    block; zero elsewhere) and dsink [h_q].
    """
    dt = _check_compute_dtype(compute_dtype)
    odt = _check_compute_dtype(out_dtype, "out_dtype")
    q, k, v, do = (_as_float(a, dt, n) for a, n in ((q, "q"), (k, "k"), (v, "v"), (do, "do")))
    if o is not None:
        o = _as_float(o, dt, "o")
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3 or do.ndim != 3:
        raise ValueError("q, k, v, do must be 3-D packed arrays [total, h, d]")
    total_q, hq, d, total_k, hk, dv = _packed_shapes(q, k, v)
    if do.shape != (total_q, hq, dv):
        raise ValueError(f"do has shape {do.shape}, expected {(total_q, hq, dv)}")
    if o is not None and o.shape != do.shape:
        raise ValueError(f"o has shape {o.shape}, expected that of do {do.shape}")
    group = _kv_group(hq, hk)
    scale = _default_scale(scale, d)
    cq = _check_seqstarts(cu_seqlens_q, total_q, "cu_seqlens_q")
    ck = _check_seqstarts(cu_seqlens_k, total_k, "cu_seqlens_k")
    if cq.shape != ck.shape:
        raise ValueError(f"cu_seqlens_q has {cq.shape[0]} entries, cu_seqlens_k {ck.shape[0]}")

    dq = np.zeros((total_q, hq, d), dtype=odt)
    dk = np.zeros((total_k, hk, d), dtype=odt)
    dvv = np.zeros((total_k, hk, dv), dtype=odt)
    nb = cq.shape[0] - 1
    lens_q, lens_k = np.diff(cq), np.diff(ck)
    max_q = int(lens_q.max()) if nb else 0
    max_k = int(lens_k.max()) if nb else 0
    dbias = np.zeros((nb, hq, max_q, max_k), dtype=odt) if return_mod_grads else None
    dsink = np.zeros((hq,), dtype=odt)
    for bi in range(nb):
        q0, q1, k0, k1 = int(cq[bi]), int(cq[bi + 1]), int(ck[bi]), int(ck[bi + 1])
        c = mask_coord(mask_type, window_left, window_right, q1 - q0, k1 - k0)
        for kh in range(hk):
            dk_acc = np.zeros((k1 - k0, d), dtype=dt)
            dv_acc = np.zeros((k1 - k0, dv), dtype=dt)
            for h in range(kh * group, (kh + 1) * group):
                buf = np.zeros((q1 - q0, d), dtype=dt)
                dbias_buf = np.zeros((q1 - q0, k1 - k0), dtype=dt) if return_mod_grads else None
                dsink[h] += _grad_one_head(q[q0:q1, h], k[k0:k1, kh], v[k0:k1, kh], do[q0:q1, h],
                                           None if o is None else o[q0:q1, h], scale, c, buf, dk_acc, dv_acc,
                                           softcap=softcap, dbias_out=dbias_buf,
                                           drop=_drop_factors(dropout_p, None if randval is None
                                                              else randval[h, q0:q1, :k1 - k0]),
                                           **_head_mods(bi, h, alibi_slopes, bias, sink))
                dq[q0:q1, h] = buf
                if dbias is not None:
                    dbias[bi, h, :q1 - q0, :k1 - k0] = dbias_buf
            dk[k0:k1, kh] = dk_acc
            dvv[k0:k1, kh] = dv_acc
    return (dq, dk, dvv, dbias, dsink) if return_mod_grads else (dq, dk, dvv)


# ----------------------------------------------------------------------------------------------------------------
# Comparison and FLOPs
# ----------------------------------------------------------------------------------------------------------------


class CloseResult(NamedTuple):
    """Outcome of ``check_close``; truthy exactly when every element passed."""

    ok: bool
    max_abs_err: float   # over the elements where both values are finite (0.0 when there are none)
    num_bad: int         # elements failing the rule
    num_total: int
    first_bad: Optional[Tuple[int, ...]]  # index of the first failing element, or None

    def __bool__(self) -> bool:
        return bool(self.ok)

    def __str__(self) -> str:
        status = "pass" if self.ok else f"FAIL ({self.num_bad}/{self.num_total} bad, first at {self.first_bad})"
        return f"{status}, max abs err {self.max_abs_err:.3g}"


# CK's per-dtype tolerances for the forward pass (rtol, atol).
_TOLERANCES = {"fp16": (1e-3, 1e-3), "bf16": (1e-2, 1e-2), "fp32": (1e-5, 1e-5)}
_DTYPE_ALIASES = {"float16": "fp16", "half": "fp16", "bfloat16": "bf16", "float32": "fp32", "float": "fp32"}


def tolerances(dtype: str) -> Tuple[float, float]:
    """(rtol, atol) that CK uses for this element type: fp16 1e-3/1e-3, bf16 1e-2/1e-2."""
    key = _DTYPE_ALIASES.get(str(dtype), str(dtype))
    if key not in _TOLERANCES:
        raise ValueError(f"no tolerance for dtype {dtype!r}; known: {sorted(_TOLERANCES)}")
    return _TOLERANCES[key]


def check_close(out, ref, rtol: float, atol: float) -> CloseResult:
    """CK's rule, elementwise: |out - ref| <= atol + rtol * |ref|.

    NaN never passes (not even against NaN); an infinity passes only against the same infinity (so an LSE of
    -inf matches -inf); a finite value never matches an infinite one. Shapes must be equal.
    """
    o = np.asarray(out, dtype=np.float64)
    r = np.asarray(ref, dtype=np.float64)
    if o.shape != r.shape:
        raise ValueError(f"shape mismatch: out {o.shape} vs ref {r.shape}")
    both_finite = np.isfinite(o) & np.isfinite(r)
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.where(both_finite, np.abs(o - r), 0.0)
        finite_ok = both_finite & (diff <= atol + rtol * np.abs(np.where(both_finite, r, 0.0)))
    same_inf = np.isinf(o) & np.isinf(r) & (np.sign(o) == np.sign(r))
    ok = finite_ok | same_inf
    num_bad = int(ok.size - np.count_nonzero(ok))
    first_bad = None
    if num_bad:
        first_bad = tuple(int(i) for i in np.unravel_index(int(np.argmin(ok.ravel())), ok.shape))
    max_abs = float(diff.max()) if diff.size else 0.0
    return CloseResult(num_bad == 0, max_abs, num_bad, int(ok.size), first_bad)


def tolerances_bwd(dtype: str, hdim_q: int = 0, hdim_v: int = 0) -> Tuple[float, float]:
    """(rtol, atol) of aiter's backward check for dQ / dK / dV: 1e-2 / 1e-2, and 3.2e-2 / 3.2e-2 for bf16 when
    both head dims exceed 128."""
    key = _DTYPE_ALIASES.get(str(dtype), str(dtype))
    if key not in _TOLERANCES:
        raise ValueError(f"no tolerance for dtype {dtype!r}; known: {sorted(_TOLERANCES)}")
    if key == "bf16" and hdim_q > 128 and hdim_v > 128:
        return (3.2e-2, 3.2e-2)
    return (1e-2, 1e-2)


def flops_fwd(b: int, h: int, sq: int, sk: int, d: int, dv: Optional[int] = None, causal: bool = False) -> float:
    """Forward FLOPs, FlashAttention convention: 2*b*h*sq*sk*(d + dv) (= 4*b*h*sq*sk*d when d == dv),
    halved when causal (regardless of the exact masked area)."""
    if dv is None:
        dv = d
    f = 2.0 * b * h * sq * sk * (d + dv)
    return f / 2.0 if causal else f


def flops_bwd(b: int, h: int, sq: int, sk: int, d: int, dv: Optional[int] = None, causal: bool = False) -> float:
    """Backward FLOPs, FlashAttention convention: 2.5 x ``flops_fwd`` (= 10*b*h*sq*sk*d when d == dv), halved
    when causal."""
    return 2.5 * flops_fwd(b, h, sq, sk, d, dv, causal)
