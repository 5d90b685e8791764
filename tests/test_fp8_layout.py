"""The fp8 forward's register / shared-memory contract (csrc/kernels/hopper/hopper_fp8.hpp), checked on the CPU
against the fragment layouts of the PTX ISA (wgmma .m64nNk32 with e4m3 A in registers, fp32 accumulator): P packed
from the S accumulator as pack_p_fp8 packs it, V transposed as transpose_v_fp8 writes it (slot s of each 16-key
group holds key vt_key_of_slot(s)), and the product the hardware then forms equals P·V. No GPU: a model of where
each byte sits, written from the ISA's tables, not from the kernel's code."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

FP8_HEADER = Path(__file__).resolve().parents[1] / "csrc" / "kernels" / "hopper" / "hopper_fp8.hpp"


def vt_key_of_slot(s: int) -> int:  # the kernel's formula, read back from the header below
    return 2 * (s >> 2) + (s & 1) + 8 * ((s >> 1) & 1)


def pack_sources(w: int) -> tuple:  # pack_p_fp8: register w of P takes these accumulator values, low byte first
    c0 = 2 * (w & 1) + 8 * ((w >> 1) & 1) + 16 * (w >> 2)
    return (c0, c0 + 1, c0 + 4, c0 + 5)


def c_coord(lane: int, warp: int, v: int) -> tuple:
    """PTX ISA, wgmma fp32 accumulator (m64nN): value v of a thread -> (row, col)."""
    g, t = lane // 4, lane % 4
    return 16 * warp + g + 8 * ((v // 2) % 2), 8 * (v // 4) + 2 * t + v % 2


def a_coord(lane: int, warp: int, reg: int, byte: int) -> tuple:
    """PTX ISA, wgmma .k32 8-bit A fragment in registers: byte `byte` of register a_reg of a k-block -> (row, k)."""
    g, t = lane // 4, lane % 4
    return 16 * warp + g + 8 * (reg % 2), 4 * t + byte + 16 * (reg // 2)


def test_the_header_states_the_formulas_this_model_checks():
    text = FP8_HEADER.read_text()
    assert "return 2 * (s >> 2) + (s & 1) + 8 * ((s >> 1) & 1);" in text
    assert "const int c0 = 2 * (w & 1) + 8 * ((w >> 1) & 1) + 16 * (w >> 2);" in text
    assert re.search(r"e4m3x4\(s\[c0\], s\[c0 \+ 1\], s\[c0 \+ 4\], s\[c0 \+ 5\]\)", text)


def test_slot_map_is_a_permutation_of_each_group():
    assert sorted(vt_key_of_slot(s) for s in range(16)) == list(range(16))


def catalogue_fp8_block_ns() -> list:
    """The key-tile widths of the fp8 tiles in the catalogue, the sweep's candidates included."""
    from codegen import catalogue
    tiles = catalogue.load("cuda").family("fwd", "hopper").tiles
    return sorted({t.get("block_n") for t in tiles if t.dtypes and all(d.startswith("fp8") for d in t.dtypes)})


def test_the_catalogue_has_fp8_tiles_whose_widths_this_model_covers():
    block_ns = catalogue_fp8_block_ns()
    assert block_ns and all(n % 32 == 0 and 32 <= n <= 256 for n in block_ns)  # whole k-blocks of 32 keys


def packed_a(p: np.ndarray) -> np.ndarray:
    """P (64 x block_n) as the hardware reads the P·V A operand, filled from each thread's accumulator through
    pack_p_fp8."""
    block_n = p.shape[1]
    a = np.full((64, block_n), np.nan)
    n_values = block_n // 2  # accumulator values per thread (64 x block_n over 128 threads)
    for warp in range(4):
        for lane in range(32):
            acc = np.empty(n_values)
            for c in range(n_values):
                row, col = c_coord(lane, warp, c)
                acc[c] = p[row, col]
            for w in range(n_values // 4):
                kb, reg = w // 4, w % 4
                for byte, src in enumerate(pack_sources(w)):
                    row, k = a_coord(lane, warp, reg, byte)
                    assert np.isnan(a[row, 32 * kb + k]), "two bytes land on one A element"
                    a[row, 32 * kb + k] = acc[src]
    assert not np.isnan(a).any()
    return a


def vt_as_written(v: np.ndarray) -> np.ndarray:
    """[slot, dv] of one (batch, head) as transpose_v_fp8 writes it: VtLayout's key extent, seqlen_k rounded up to
    16, slot 16q + s carrying key 16q + vt_key_of_slot(s), zero where that key is past seqlen_k."""
    sk, dv = v.shape
    keys = (sk + 15) // 16 * 16
    out = np.zeros((keys, dv))
    for slot in range(keys):
        key = 16 * (slot // 16) + vt_key_of_slot(slot % 16)
        if key < sk:
            out[slot] = v[key]
    return out


@pytest.mark.parametrize("block_n", sorted({32, *catalogue_fp8_block_ns()}))
def test_packed_p_times_slot_permuted_vt_is_p_times_v(block_n):
    rng = np.random.default_rng(block_n)
    dv = 24
    p = rng.random((64, block_n))
    v = rng.standard_normal((block_n, dv))
    # Vᵀ as the transpose kernel writes it, the K-major B operand seen slot by slot
    np.testing.assert_allclose(packed_a(p) @ vt_as_written(v), p @ v, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("block_n", catalogue_fp8_block_ns())
@pytest.mark.parametrize("seqlen_k", [1, 15, 17, 190, 333, 517])
def test_key_tiles_of_any_length_sum_to_p_times_v(block_n, seqlen_k):
    """The kernel's loop over key tiles n = 0, 1, ...: S's keys past seqlen_k masked (P = 0 there), the V tile read
    by TMA as the box of slots [n·block_n, (n+1)·block_n) of the transposed V, zero past its key extent; the tiles'
    products sum to P·V whether or not block_n divides seqlen_k (slot groups never straddle a tile: block_n % 16 = 0)."""
    rng = np.random.default_rng(seqlen_k * 1000 + block_n)
    dv = 16
    p = rng.random((64, seqlen_k))
    v = rng.standard_normal((seqlen_k, dv))
    vt = vt_as_written(v)
    o = np.zeros((64, dv))
    for n in range((seqlen_k + block_n - 1) // block_n):
        key0 = n * block_n
        p_tile = np.zeros((64, block_n))  # ForwardMask::apply: -inf past seqlen_k, so exp gives 0
        valid = min(block_n, seqlen_k - key0)
        p_tile[:, :valid] = p[:, key0:key0 + valid]
        v_box = np.zeros((block_n, dv))  # TMA fills the box past the tensor's key extent with zeros
        inside = vt[key0:key0 + block_n]
        v_box[:len(inside)] = inside
        o += packed_a(p_tile) @ v_box
    np.testing.assert_allclose(o, p @ v, rtol=1e-12, atol=1e-12)
