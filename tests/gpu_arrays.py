"""CuPy-side helpers shared by the GPU tests: strided 16-bit tensors on the device, rounding to fp16/bf16 on the
host, NaN poisoning, and CK's closeness check with a readable failure."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mhakit import reference

try:
    import cupy as cp
except ImportError:  # the CPU machines; GPU tests skip themselves
    cp = None

NAN_BITS = {"fp16": 0x7E00, "bf16": 0x7FC0}


def to_bits(values: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Round float32 values to dtype. Returns (uint16 bit patterns, the rounded values as float32)."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    if dtype == "fp16":
        half = values.astype(np.float16)
        return half.view(np.uint16), half.astype(np.float32)
    bits = values.view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return rounded, (rounded.astype(np.uint32) << 16).view(np.float32)


def fill_value(value: float, array_dtype) -> float | int:
    """The scalar that fills an array of array_dtype with `value`: its bf16 bit pattern where the array holds bf16
    as uint16 bits (a plain 7 there would be a denormal next to 0), else value itself."""
    if np.dtype(array_dtype) == np.uint16:
        return int(to_bits(np.array([value], np.float32), "bf16")[0][0])
    return value


def from_bits(bits: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "fp16":
        return bits.view(np.float16).astype(np.float32)
    return (bits.astype(np.uint32) << 16).view(np.float32)


@dataclass
class Strided:
    """A [n0, n1, n2, d] logical view on a flat device buffer: element strides (s0, s1, s2, 1)."""
    storage: "cp.ndarray"
    shape: tuple[int, int, int, int]
    strides: tuple[int, int, int]

    @property
    def ptr(self) -> int:
        return int(self.storage.data.ptr)

    def host_view(self, host_storage: np.ndarray) -> np.ndarray:
        s0, s1, s2 = self.strides
        item = host_storage.itemsize
        return np.lib.stride_tricks.as_strided(host_storage, self.shape, (s0 * item, s1 * item, s2 * item, item))


def make_strided(shape, order: str, pad: int, fill_bits: int) -> Strided:
    """order 'bhsd' or 'bshd' for logical [b, h, s, d]; pad adds elements after each head's row (pad=1 makes every
    stride odd, i.e. not 16-byte aligned)."""
    b, h, s, d = shape
    dp = d + pad
    if order == "bhsd":
        strides, size = (h * s * dp, s * dp, dp), b * h * s * dp
    else:
        strides, size = (s * h * dp, dp, h * dp), b * s * h * dp
    return Strided(cp.full(max(size, 1), fill_bits, dtype=cp.uint16), shape, strides)


def upload(values_bhsd: np.ndarray, dtype: str, order: str, pad: int) -> tuple[Strided, np.ndarray]:
    """A device tensor holding values_bhsd rounded to dtype, and the rounded values (float32, [b, h, s, d])."""
    bits, rounded = to_bits(values_bhsd, dtype)
    t = make_strided(values_bhsd.shape, order, pad, 0)
    host = cp.asnumpy(t.storage)
    if values_bhsd.size:
        t.host_view(host)[...] = bits
    t.storage.set(host)
    return t, rounded


def download(t: Strided, dtype: str) -> np.ndarray:
    host = cp.asnumpy(t.storage)
    return from_bits(np.ascontiguousarray(t.host_view(host)), dtype)


def assert_outside_untouched(t: Strided, fill_bits: int, what: str) -> None:
    """Every element of t's buffer outside its logical view (the padding after each row) still holds fill_bits: the
    kernel wrote nothing past a row's real head dim."""
    host = cp.asnumpy(t.storage)
    inside = np.zeros(host.shape, dtype=bool)
    t.host_view(inside)[...] = True
    bad = np.count_nonzero(host[~inside] != fill_bits)
    assert bad == 0, f"{what}: {bad} elements outside the tensor's rows were overwritten"


def assert_close(out, ref, tolerances: tuple[float, float], what: str) -> None:
    rtol, atol = tolerances
    res = reference.check_close(out, ref, rtol, atol)
    assert res.ok, f"{what}: {res.num_bad}/{res.num_total} bad, first at {res.first_bad}, max abs {res.max_abs_err:.3g}"
