#!/usr/bin/env python3
"""Plots of the peer benchmarks: TFLOPS against sequence length for mhakit, cuDNN and FA2, one panel per head dim
and mask (causal or not), one PNG per JSON file and dtype, from the JSON that bench_fwd.py / bench_bwd.py write
(--json). Plain Python (zlib + struct): no plotting package is needed, so the plots can be made on the GPU machine
right after the run, or anywhere later from the JSON.

    python3 bench/bench_fwd.py --dtype bf16,fp16 --json fwd.json
    python3 bench/bench_bwd.py --dtype bf16,fp16 --json bwd.json
    python3 bench/plot_perf.py fwd.json bwd.json --out-dir docs/plots      # fwd_bf16.png, fwd_fp16.png, bwd_...

Rows with GQA (heads_kv != heads) are plotted apart, in <stem>_<dtype>_gqa<H>x<HK>.png. A row without a figure for a
series (a peer that could not run the shape) leaves a gap in that series.
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import sys
import zlib
from pathlib import Path

# 5 x 7 bitmap glyphs (rows top to bottom, bit 4 = leftmost column); text is drawn upper-case.
GLYPHS = {
    '0': (0x0e, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0e),
    '1': (0x04, 0x0c, 0x04, 0x04, 0x04, 0x04, 0x0e),
    '2': (0x0e, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1f),
    '3': (0x1f, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0e),
    '4': (0x02, 0x06, 0x0a, 0x12, 0x1f, 0x02, 0x02),
    '5': (0x1f, 0x10, 0x1e, 0x01, 0x01, 0x11, 0x0e),
    '6': (0x06, 0x08, 0x10, 0x1e, 0x11, 0x11, 0x0e),
    '7': (0x1f, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08),
    '8': (0x0e, 0x11, 0x11, 0x0e, 0x11, 0x11, 0x0e),
    '9': (0x0e, 0x11, 0x11, 0x0f, 0x01, 0x02, 0x0c),
    'A': (0x0e, 0x11, 0x11, 0x1f, 0x11, 0x11, 0x11),
    'B': (0x1e, 0x11, 0x11, 0x1e, 0x11, 0x11, 0x1e),
    'C': (0x0e, 0x11, 0x10, 0x10, 0x10, 0x11, 0x0e),
    'D': (0x1e, 0x11, 0x11, 0x11, 0x11, 0x11, 0x1e),
    'E': (0x1f, 0x10, 0x10, 0x1e, 0x10, 0x10, 0x1f),
    'F': (0x1f, 0x10, 0x10, 0x1e, 0x10, 0x10, 0x10),
    'G': (0x0e, 0x11, 0x10, 0x17, 0x11, 0x11, 0x0f),
    'H': (0x11, 0x11, 0x11, 0x1f, 0x11, 0x11, 0x11),
    'I': (0x0e, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0e),
    'J': (0x07, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0c),
    'K': (0x11, 0x12, 0x14, 0x18, 0x14, 0x12, 0x11),
    'L': (0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x1f),
    'M': (0x11, 0x1b, 0x15, 0x15, 0x11, 0x11, 0x11),
    'N': (0x11, 0x11, 0x19, 0x15, 0x13, 0x11, 0x11),
    'O': (0x0e, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0e),
    'P': (0x1e, 0x11, 0x11, 0x1e, 0x10, 0x10, 0x10),
    'Q': (0x0e, 0x11, 0x11, 0x11, 0x15, 0x12, 0x0d),
    'R': (0x1e, 0x11, 0x11, 0x1e, 0x14, 0x12, 0x11),
    'S': (0x0f, 0x10, 0x10, 0x0e, 0x01, 0x01, 0x1e),
    'T': (0x1f, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04),
    'U': (0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0e),
    'V': (0x11, 0x11, 0x11, 0x11, 0x11, 0x0a, 0x04),
    'W': (0x11, 0x11, 0x11, 0x15, 0x15, 0x15, 0x0a),
    'X': (0x11, 0x11, 0x0a, 0x04, 0x0a, 0x11, 0x11),
    'Y': (0x11, 0x11, 0x0a, 0x04, 0x04, 0x04, 0x04),
    'Z': (0x1f, 0x01, 0x02, 0x04, 0x08, 0x10, 0x1f),
    ' ': (0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00),
    '.': (0x00, 0x00, 0x00, 0x00, 0x00, 0x0c, 0x0c),
    ',': (0x00, 0x00, 0x00, 0x00, 0x0c, 0x04, 0x08),
    ':': (0x00, 0x0c, 0x0c, 0x00, 0x0c, 0x0c, 0x00),
    '-': (0x00, 0x00, 0x00, 0x1f, 0x00, 0x00, 0x00),
    '+': (0x00, 0x04, 0x04, 0x1f, 0x04, 0x04, 0x00),
    '/': (0x01, 0x01, 0x02, 0x04, 0x08, 0x10, 0x10),
    '(': (0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02),
    ')': (0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08),
    '=': (0x00, 0x00, 0x1f, 0x00, 0x1f, 0x00, 0x00),
    '%': (0x18, 0x19, 0x02, 0x04, 0x08, 0x13, 0x03),
    '_': (0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x1f),
    '?': (0x0e, 0x11, 0x01, 0x02, 0x04, 0x00, 0x04),
}

SERIES = (("mhakit", "MHAKIT", (31, 97, 180)), ("cudnn", "CUDNN", (230, 120, 20)), ("fa2", "FA2", (40, 150, 60)))
WHITE, BLACK, GRID, AXIS = (255, 255, 255), (20, 20, 20), (225, 225, 225), (90, 90, 90)


class Canvas:
    """An RGB raster with the few primitives a line chart needs, written out as a PNG."""

    def __init__(self, width: int, height: int):
        self.w, self.h = width, height
        self.px = bytearray(WHITE * (width * height))

    def put(self, x: int, y: int, rgb) -> None:
        if 0 <= x < self.w and 0 <= y < self.h:
            i = 3 * (y * self.w + x)
            self.px[i:i + 3] = bytes(rgb)

    def rect(self, x0: int, y0: int, x1: int, y1: int, rgb) -> None:
        """Fill [x0, x1] x [y0, y1] (inclusive)."""
        for y in range(max(y0, 0), min(y1, self.h - 1) + 1):
            a, b = max(x0, 0), min(x1, self.w - 1)
            if a <= b:
                self.px[3 * (y * self.w + a):3 * (y * self.w + b + 1)] = bytes(rgb) * (b - a + 1)

    def line(self, x0: int, y0: int, x1: int, y1: int, rgb, width: int = 1) -> None:
        """Bresenham's line, each point a width x width square."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err, lo, hi = dx + dy, -(width // 2), width - width // 2 - 1
        while True:
            self.rect(x0 + lo, y0 + lo, x0 + hi, y0 + hi, rgb)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err, x0 = err + dy, x0 + sx
            if e2 <= dx:
                err, y0 = err + dx, y0 + sy

    def text(self, x: int, y: int, s: str, rgb=BLACK, scale: int = 2, anchor: str = "left") -> None:
        """Draw s with its top at y; anchor left / center / right at x."""
        s = s.upper()
        width = text_width(s, scale)
        x -= {"left": 0, "center": width // 2, "right": width}[anchor]
        for ch in s:
            rows = GLYPHS.get(ch, GLYPHS["?"])
            for r, bits in enumerate(rows):
                for c in range(5):
                    if bits & (0x10 >> c):
                        self.rect(x + c * scale, y + r * scale, x + (c + 1) * scale - 1, y + (r + 1) * scale - 1, rgb)
            x += 6 * scale

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(self.px[3 * y * self.w:3 * (y + 1) * self.w]) for y in range(self.h))

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def text_width(s: str, scale: int = 2) -> int:
    return max(len(s) * 6 - 1, 0) * scale


def nice_ceiling(v: float) -> float:
    """The smallest 1 / 1.5 / 2 / 2.5 / 3 / 4 / 5 / 6 / 8 x 10^k at or above v (the y axis' top)."""
    if v <= 0:
        return 1.0
    base = 10.0 ** math.floor(math.log10(v))
    for m in (1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10):
        if m * base >= v - 1e-9:
            return m * base
    return 10 * base


def seqlen_label(s: int) -> str:
    return f"{s // 1024}K" if s >= 1024 and s % 1024 == 0 else str(s)


# Panel geometry (pixels).
PANEL_W, PANEL_H, MARGIN_L, MARGIN_B, MARGIN_T, GAP = 330, 250, 60, 40, 30, 24
TITLE_H, LEGEND_H = 40, 30


def plot(rows: list, title: str) -> Canvas:
    """One figure: a column per head dim (in the rows' order), a row of panels per mask (non-causal, causal)."""
    hdims = list(dict.fromkeys(str(r["hdim"]) for r in rows))
    masks = [c for c in (False, True) if any(bool(r["causal"]) == c for r in rows)]
    seqlens = sorted({int(r["seqlen"]) for r in rows})
    top = nice_ceiling(max((r.get(f"{k}_tflops") or 0.0) for r in rows for k, _, _ in SERIES))
    cw = MARGIN_L + PANEL_W + GAP
    ch = MARGIN_T + PANEL_H + MARGIN_B
    cv = Canvas(GAP + cw * len(hdims), TITLE_H + LEGEND_H + ch * len(masks) + GAP // 2)
    cv.text(cv.w // 2, 12, title, scale=2, anchor="center")
    lx = GAP + MARGIN_L
    for _, name, rgb in SERIES:
        cv.rect(lx, TITLE_H + 12, lx + 28, TITLE_H + 15, rgb)
        cv.text(lx + 36, TITLE_H + 7, name, scale=2)
        lx += 36 + text_width(name) + 40
    ticks = [top * i / 5 for i in range(6)]
    for pi, causal in enumerate(masks):
        for pj, hd in enumerate(hdims):
            x0 = GAP + pj * cw + MARGIN_L
            y0 = TITLE_H + LEGEND_H + pi * ch + MARGIN_T
            x1, y1 = x0 + PANEL_W, y0 + PANEL_H

            def xy(s: int, t: float):
                i = seqlens.index(s)
                fx = (i + 0.5) / len(seqlens)
                return x0 + round(fx * PANEL_W), y1 - round(t / top * PANEL_H)

            for t in ticks:
                _, ty = xy(seqlens[0], t)
                cv.rect(x0, ty, x1, ty, GRID if t else AXIS)
                cv.text(x0 - 6, ty - 7, f"{t:g}", AXIS, scale=2, anchor="right")
            cv.rect(x0, y0, x0, y1, AXIS)
            for s in seqlens:
                sx, _ = xy(s, 0)
                cv.rect(sx, y1, sx, y1 + 4, AXIS)
                cv.text(sx, y1 + 8, seqlen_label(s), AXIS, scale=2, anchor="center")
            cv.text((x0 + x1) // 2, y0 - 22, f"HDIM {hd}, {'CAUSAL' if causal else 'NON-CAUSAL'}", scale=2,
                    anchor="center")
            panel = sorted((r for r in rows if str(r["hdim"]) == hd and bool(r["causal"]) == causal),
                           key=lambda r: int(r["seqlen"]))
            for key, _, rgb in reversed(SERIES):  # mhakit drawn last, on top
                pts = [xy(int(r["seqlen"]), r[f"{key}_tflops"]) if r.get(f"{key}_tflops") else None for r in panel]
                for a, b in zip(pts, pts[1:]):
                    if a and b:
                        cv.line(*a, *b, rgb, width=3)
                for p in pts:
                    if p:
                        cv.rect(p[0] - 4, p[1] - 4, p[0] + 4, p[1] + 4, rgb)
    cv.text(GAP, cv.h - 18, "TFLOPS (FLASHATTENTION CONVENTION) VS SEQUENCE LENGTH", AXIS, scale=1)
    return cv


class PlotError(Exception):
    pass


def load_rows(path: Path) -> tuple[dict, list]:
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise PlotError(f"cannot read {path}: {e.strerror or e}") from None
    except ValueError:
        raise PlotError(f"{path} is not JSON (write it with bench_fwd.py / bench_bwd.py --json)") from None
    rows = data.get("rows") if isinstance(data, dict) else None
    need = ("dtype", "hdim", "seqlen", "causal")
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) and all(k in r for k in need)
                                                       for r in rows):
        raise PlotError(f"{path} has no benchmark rows (a list 'rows' of dicts with {', '.join(need)})")
    return data.get("env") or {}, rows


def figures(path: Path) -> list:
    """(file name, title, rows) of each figure of one JSON file: per dtype, MHA apart from each GQA shape."""
    env, rows = load_rows(path)
    command = str(env.get("command", ""))
    what = "BACKWARD" if "bwd" in command or "bwd" in path.stem else "FORWARD"
    device = str(env.get("device", "")).replace("NVIDIA ", "")
    out = []
    groups: dict = {}
    for r in rows:
        h, hk = r.get("heads"), r.get("heads_kv")
        gqa = f"_gqa{h}x{hk}" if h and hk and hk != h else ""
        groups.setdefault((r["dtype"], gqa), []).append(r)
    for (dtype, gqa), rs in groups.items():
        tag = f", GQA {gqa[4:].replace('x', '/')}" if gqa else ""
        title = f"{what}, {dtype}{tag}" + (f", {device}" if device else "")
        out.append((f"{path.stem}_{dtype}{gqa}.png", title, rs))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", nargs="+", type=Path, help="JSON written by bench_fwd.py / bench_bwd.py --json")
    p.add_argument("--out-dir", type=Path, default=Path("."), help="where the PNGs go (default: .)")
    opts = p.parse_args(argv)
    try:
        todo = [f for path in opts.json for f in figures(path)]
        opts.out_dir.mkdir(parents=True, exist_ok=True)
        for name, title, rows in todo:
            target = opts.out_dir / name
            target.write_bytes(plot(rows, title).png())
            print(target)
    except PlotError as e:
        print(f"plot_perf: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"plot_perf: cannot write to {opts.out_dir}: {e.strerror or e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
