"""bench/plot_perf.py, the plots of the peer benchmarks: valid PNGs from bench JSON, one per dtype (GQA apart), the
TFLOPS axis pointing up, and one-line errors for bad input."""
from __future__ import annotations

import json
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "plot_perf.py"
MHAKIT_RGB, CUDNN_RGB, FA2_RGB = (31, 97, 180), (230, 120, 20), (40, 150, 60)


def run(*args, cwd):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], cwd=cwd, capture_output=True, text=True)


def read_png(path: Path):
    """(width, height, rows of RGB tuples) of an 8-bit RGB PNG with filter 0 on every row (what the script writes)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, dims = 8, b"", None
    while pos < len(data):
        (n,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + n]
        assert struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])[0] == zlib.crc32(kind + body)
        if kind == b"IHDR":
            dims = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    w, h, depth, color = dims[:4]
    assert (depth, color) == (8, 2)
    raw = zlib.decompress(idat)
    assert len(raw) == h * (1 + 3 * w)
    rows = []
    for y in range(h):
        line = raw[y * (1 + 3 * w):(y + 1) * (1 + 3 * w)]
        assert line[0] == 0
        rows.append([tuple(line[1 + 3 * x:4 + 3 * x]) for x in range(w)])
    return w, h, rows


def rows_of(dtype="bf16", heads=16, heads_kv=16, mhakit=400.0, cudnn=200.0, fa2=None):
    return [dict(dtype=dtype, hdim=128, seqlen=s, causal=c, heads=heads, heads_kv=heads_kv, mhakit_tflops=mhakit,
                 cudnn_tflops=cudnn, fa2_tflops=fa2) for s in (1024, 4096) for c in (False, True)]


def write(path: Path, rows, command="bench_fwd.py"):
    path.write_text(json.dumps({"env": {"device": "NVIDIA H200", "command": command}, "rows": rows}))
    return path


def topmost(rows, rgb, below: int) -> int:
    return min(y for y in range(below, len(rows)) if rgb in rows[y])


def test_one_png_per_dtype_and_gqa_shape(tmp_path):
    src = write(tmp_path / "fwd.json", rows_of() + rows_of(dtype="fp16") + rows_of(heads=32, heads_kv=8))
    proc = run(src, "--out-dir", tmp_path / "plots", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    names = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert names == ["fwd_bf16.png", "fwd_bf16_gqa32x8.png", "fwd_fp16.png"]
    w, h, _ = read_png(tmp_path / "plots" / "fwd_bf16.png")
    assert w > 300 and h > 500  # one head-dim column, two mask rows


def test_faster_series_is_drawn_higher(tmp_path):
    """mhakit at twice cuDNN's TFLOPS sits above it; a peer with no figures draws nothing but its legend key."""
    src = write(tmp_path / "bwd.json", rows_of(mhakit=400.0, cudnn=200.0, fa2=None), command="bench_bwd.py")
    assert run(src, cwd=tmp_path).returncode == 0
    _, h, px = read_png(tmp_path / "bwd_bf16.png")
    below_legend = 80  # title and legend rows
    top_ours, top_cudnn = topmost(px, MHAKIT_RGB, below_legend), topmost(px, CUDNN_RGB, below_legend)
    assert top_ours < top_cudnn
    assert not any(FA2_RGB in px[y] for y in range(below_legend, h))
    assert any(FA2_RGB in px[y] for y in range(below_legend))  # the legend still names it


@pytest.mark.parametrize("content, message", [
    (None, "cannot read"),
    ("not json", "is not JSON"),
    (json.dumps({"rows": []}), "has no benchmark rows"),
    (json.dumps({"rows": [{"dtype": "bf16"}]}), "has no benchmark rows"),
])
def test_bad_input_is_one_line(tmp_path, content, message):
    src = tmp_path / "in.json"
    if content is not None:
        src.write_text(content)
    proc = run(src, cwd=tmp_path)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not list(tmp_path.glob("*.png"))
