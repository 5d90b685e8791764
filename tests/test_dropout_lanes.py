"""Dropout's register contract on the Hopper family (csrc/kernels/hopper/hopper_dropout.hpp over
csrc/kernels/common/dropout_lanes.cuh), checked on the CPU: a model of the lanes' Philox calls, their shuffle, the
packing of each call's eight bytes (call_half) and the register each byte is applied to (drop_reg), placed by the PTX
ISA's wgmma fp32 accumulator layout, must give every accumulator element the byte dropout.h assigns to its (query,
key) (mhakit.reference's Philox); and the keep test on whole words (drop_flags, prmt's sign-replicating selector)
must say "dropped" exactly for bytes > keep_max. No GPU: the formulas are read back from the headers."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from mhakit import reference as R

ROOT = Path(__file__).resolve().parents[1] / "csrc" / "kernels"
LANES = (ROOT / "common" / "dropout_lanes.cuh").read_text()
HOPPER = (ROOT / "hopper" / "hopper_dropout.hpp").read_text()


def c_coord(lane: int, warp: int, v: int) -> tuple:
    """PTX ISA, wgmma fp32 accumulator (m64nN): value v of a thread -> (row, col) of the warpgroup's tile."""
    g, t = lane // 4, lane % 4
    return 16 * warp + g + 8 * ((v // 2) % 2), 8 * (v // 4) + 2 * t + v % 2


def drop_reg(kt: bool, np_: int, w: int, k: int) -> int:  # hopper_dropout.hpp
    return 4 * (2 * np_ + (k >> 1)) + (2 * (k & 1) + w if kt else 2 * w + (k & 1))


def byte_perm(a: int, b: int, sel: int) -> int:  # __byte_perm (selector nibbles 0..7, no sign mode)
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    return sum(src[(sel >> (4 * n)) & 7] << (8 * n) for n in range(4))


def call_half(kt: bool, x: tuple, parity: int) -> tuple:  # dropout_lanes.cuh
    if not kt:
        return (x[2], x[3]) if parity else (x[0], x[1])
    sel = 0x7531 if parity else 0x6420
    return byte_perm(x[0], x[1], sel), byte_perm(x[2], x[3], sel)


def philox_call(seed: int, offset: int, bh: int, i_blk: int, j_blk: int, a: int, b: int) -> tuple:
    words = R.philox4x32_10(j_blk * 4 + b, i_blk * 4 + a, offset & 0xFFFFFFFF, ((offset >> 32) + bh) & 0xFFFFFFFF,
                            seed & 0xFFFFFFFF, seed >> 32)
    return tuple(int(np.asarray(w)) for w in words)


def warp_bytes(kt: bool, knp: int, seed: int, offset: int, bh: int, row0: int, col0: int) -> list:
    """dropout_bytes<kT, 1, kNP> for the 32 lanes of a warp: rnd[lane][np] = (word 0, word 1), with the lane pairs'
    split (each computes every other call and trades the other half through __shfl_xor_sync(..., 4))."""
    def call(lane, c):
        g, t4 = lane // 4, lane % 4
        a, b = (t4, g >> 1) if kt else (g >> 1, t4)
        i_blk = (col0 >> 4) + c if kt else row0 >> 4
        j_blk = row0 >> 4 if kt else (col0 >> 4) + c
        return philox_call(seed, offset, bh, i_blk, j_blk, a, b)
    assert knp % 2 == 0
    rnd = [[None] * knp for _ in range(32)]
    for u in range(0, knp, 2):
        sent = {}
        mine = {}
        for lane in range(32):
            parity = (lane // 4) & 1
            x = call(lane, u + parity)
            mine[lane] = call_half(kt, x, parity)
            sent[lane] = call_half(kt, x, parity ^ 1)
        for lane in range(32):
            parity = (lane // 4) & 1
            got = sent[lane ^ 4]
            rnd[lane][u] = got if parity else mine[lane]
            rnd[lane][u + 1] = mine[lane] if parity else got
    return rnd


def test_the_headers_state_the_formulas_this_model_checks():
    assert "return 4 * (2 * np + (k >> 1)) + (kT ? 2 * (k & 1) + w : 2 * w + (k & 1));" in HOPPER
    assert "const uint32_t sel = parity ? 0x7531u : 0x6420u;" in LANES
    assert "return parity ? make_uint2(x.z, x.w) : make_uint2(x.x, x.y);" in LANES
    assert "got.x = __shfl_xor_sync(0xffffffffu, theirs.x, 4);" in LANES
    assert "const int a = kT ? t4 : g >> 1;" in LANES and "const int b = kT ? g >> 1 : t4;" in LANES
    assert re.search(r"slab_row\(TensorC const& c\) \{ return cute::get<0>\(c\(0\)\) & ~15; \}", HOPPER)


@pytest.mark.parametrize("kt, knp", [(False, 8), (False, 6), (False, 4), (True, 4), (True, 2)])
def test_every_accumulator_element_gets_its_score_byte(kt, knp):
    """Forward (kT false: rows are queries; 64 x 16·kNP tiles of the d128 / d192 / d256 forwards) and backward (kT:
    rows are keys, columns queries; the key split's 64 x 64 and the query split's 64 x 32 Sᵀ parts)."""
    seed, offset, bh = 0x1234_5678_9ABC_DEF1, 0x0000_0003_0000_0011, 37
    tile_row0, tile_col0 = 192, 320  # a warpgroup's first row (query / key) and the tile's first column
    for warp in range(4):
        slab = c_coord(0, warp, 0)[0] & ~15
        rnd = warp_bytes(kt, knp, seed, offset, bh, tile_row0 + slab, tile_col0)
        for lane in range(32):
            seen = set()
            for np_ in range(knp):
                for w in range(2):
                    for k in range(4):
                        reg = drop_reg(kt, np_, w, k)
                        seen.add(reg)
                        row, col = c_coord(lane, warp, reg)
                        byte = (rnd[lane][np_][w] >> (8 * k)) & 0xFF
                        q, key = (tile_col0 + col, tile_row0 + row) if kt else (tile_row0 + row, tile_col0 + col)
                        want_byte = _byte(seed, offset, bh, q, key)
                        assert byte == want_byte, (kt, warp, lane, np_, w, k, q, key)
            assert seen == set(range(8 * knp))  # every register, once


def _byte(seed: int, offset: int, bh: int, i: int, j: int) -> int:
    """dropout.h's dropout_byte, through the reference's Philox."""
    x = philox_call(seed, offset, bh, i >> 4, j >> 4, (i >> 1) & 3, (j >> 1) & 3)
    k = (i & 1) * 8 + ((i >> 3) & 1) * 4 + ((j >> 3) & 1) * 2 + (j & 1)
    return (x[k // 4] >> (8 * (k % 4))) & 0xFF


def test_the_byte_rule_matches_the_reference_randval():
    seed, offset = 99, 5
    rv = R.dropout_randval(seed, offset, 1, 2, 40, 37)
    for i in range(40):
        for j in range(37):
            assert _byte(seed, offset, 1, i, j) == rv[0, 1, i, j]


def test_drop_flags_and_the_sign_replicating_prmt():
    """drop_flags(w, c4) puts (byte > keep_max) into bit 7 of each byte, exhaustively over bytes and keep_max; prmt's
    selector (0x8 | k) in every nibble spreads bit 7 of byte k over the word (PTX ISA, prmt's default mode)."""
    assert "const uint32_t s7 = (w & 0x7f7f7f7fu) + (c4 & 0x7f7f7f7fu);" in LANES
    assert "return (w & c4) | (w & s7) | (c4 & s7);" in LANES
    assert "return static_cast<uint32_t>(255 - keep_max) * 0x01010101u;" in LANES
    assert "constexpr uint32_t sel = 0x8888u | (static_cast<uint32_t>(k) * 0x1111u);" in LANES
    x = np.arange(256, dtype=np.uint64)
    words = x | ((255 - x) << 8) | (((x * 7) & 0xFF) << 16) | (((x * 13 + 5) & 0xFF) << 24)  # 4 bytes per word
    for keep_max in range(256):
        c4 = np.uint64((255 - keep_max) * 0x01010101)
        s7 = ((words & np.uint64(0x7F7F7F7F)) + (c4 & np.uint64(0x7F7F7F7F))) & np.uint64(0xFFFFFFFF)
        flags = (words & c4) | (words & s7) | (c4 & s7)
        for k in range(4):
            byte = (words >> np.uint64(8 * k)) & np.uint64(0xFF)
            sign = (flags >> np.uint64(8 * k + 7)) & np.uint64(1)
            assert ((sign == 1) == (byte > keep_max)).all(), (keep_max, k)
    for flags in (0x80000000, 0x00800000, 0x00008000, 0x00000080, 0x7F7F7F7F, 0xFFFFFFFF):
        for k in range(4):
            sel = 0x8888 | (k * 0x1111)
            out = 0
            for n in range(4):
                nib = (sel >> (4 * n)) & 0xF
                src = (flags >> (8 * (nib & 7))) & 0xFF if (nib & 7) < 4 else 0
                out |= (0xFF if (nib & 8) and src & 0x80 else (0 if nib & 8 else src)) << (8 * n)
            assert out == (0xFFFFFFFF if (flags >> (8 * k + 7)) & 1 else 0)


def test_mma_fragment_coordinates_are_the_accumulator_layout():
    """common/mma_fragment.cuh (MmaFragLane::row / col_pair / col, evaluated here from its source) against the PTX
    ISA's accumulator layout (c_coord: mma.sync m16n8's D fragment is one warp's 16 rows of it): element e of tile
    (mt, nt) is register 4·nt + e of the tiles' 16-row block mt, every (row, column) of the grid once."""
    src = (ROOT / "common" / "mma_fragment.cuh").read_text()

    def body(name: str) -> str:
        m = re.search(rf"int {name}\(([^)]*)\) const \{{ return ([^;]*); \}}", src)
        assert m, name
        return m.group(2)

    row_e, pair_e, col_e = body("row"), body("col_pair"), body("col")
    for lane in range(32):
        g, t4 = lane // 4, lane % 4
        env = {"g": g, "t4": t4}
        col_pair = lambda c0, nt: eval(pair_e, {}, {**env, "c0": c0, "nt": nt})  # noqa: E731
        seen = set()
        for mt in range(3):
            for nt in range(4):
                for e in range(4):
                    r0, c0 = 48, 40
                    row = eval(row_e, {}, {**env, "r0": r0, "mt": mt, "e": e})
                    col = eval(col_e, {"col_pair": col_pair}, {**env, "c0": c0, "nt": nt, "e": e})
                    want_row, want_col = c_coord(lane, mt, 4 * nt + e)
                    assert (row, col) == (r0 + want_row, c0 + want_col), (lane, mt, nt, e)
                    seen.add((row, col))
        assert len(seen) == 3 * 4 * 4
