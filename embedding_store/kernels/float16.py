"""The float16 codec of the store's kernels: float32 to float16 bits (and back) as
numpy's ``astype`` rounds, and the gather that writes rows as float16.

Where the CPU converts in one instruction (F16C on x86, every aarch64) the kernels
use LLVM's ``fptrunc``/``fpext`` (``intrinsics``); elsewhere the integer-only
conversions here, which give the same bits (``tests/embedding_store/test_frames.py``
checks every float32).
"""

from __future__ import annotations

import numba as nb
import numpy as np
import numpy.typing as npt

from embedding_store.kernels.intrinsics import (
    AHEAD,
    f16_fptrunc,
    f16_round_trip,
    native_f16,
    prefetch,
)

I64 = npt.NDArray[np.int64]
U32 = npt.NDArray[np.uint32]
U16 = npt.NDArray[np.uint16]
F32 = npt.NDArray[np.float32]


@nb.njit(nogil=True, cache=True, inline="always")
def f16_bits(u: np.uint32) -> np.uint16:
    """IEEE float32 bits to float16 bits, rounded to nearest even (as numpy's astype).

    Equal to ``numpy.float32.astype(numpy.float16)`` for every float32 that is not a
    NaN (checked over all 2**32 bit patterns); a NaN becomes the quiet NaN 0x7E00.
    Integer-only: the portable conversion, for CPUs without a float16 instruction.
    """
    sign = (u >> np.uint32(16)) & np.uint32(0x8000)
    a = u & np.uint32(0x7FFFFFFF)
    if a >= np.uint32(0x47800000):  # |x| >= 65536 rounds to Inf; Inf; NaN
        h = np.uint32(0x7E00) if a > np.uint32(0x7F800000) else np.uint32(0x7C00)
    elif a >= np.uint32(0x38800000):  # a normal float16: rebias the exponent, round
        h = (a + np.uint32(0xC8000FFF) + ((a >> np.uint32(13)) & np.uint32(1))) >> np.uint32(13)
    elif a >= np.uint32(0x33000000):  # a subnormal float16: shift the mantissa, round
        m = (a & np.uint32(0x7FFFFF)) | np.uint32(0x800000)
        shift = np.uint32(126) - (a >> np.uint32(23))
        q = m >> shift
        rem = m & ((np.uint32(1) << shift) - np.uint32(1))
        half = np.uint32(1) << (shift - np.uint32(1))
        if rem > half or (rem == half and (q & np.uint32(1))):
            q += np.uint32(1)
        h = q
    else:  # below half the smallest subnormal: zero
        h = np.uint32(0)
    return np.uint16(h | sign)


@nb.njit(nogil=True, cache=True, inline="always")
def _f16_of_bits(u: np.uint32) -> np.uint16:
    return f16_bits(u)


@nb.njit(nogil=True, cache=True, inline="always")
def _f16_of_float(u: np.uint32) -> np.uint16:
    bits: np.uint16 = f16_fptrunc(np.uint32(u).view(np.float32))
    return bits


_f16 = _f16_of_float if native_f16() else _f16_of_bits


@nb.njit(nogil=True, cache=True)
def gather_f16(weight_bits: U32, rows: I64, out: U16) -> None:
    """As ``gather``, writing float16 bits (``weight_bits``: the weights viewed as uint32)."""
    n = rows.shape[0]
    dim = weight_bits.shape[1]
    for i in range(n):
        if i + AHEAD < n and rows[i + AHEAD] >= 0:
            prefetch(weight_bits, rows[i + AHEAD])
        r = rows[i]
        if r < 0:
            for j in range(dim):
                out[i, j] = 0
        else:
            for j in range(dim):
                out[i, j] = _f16(weight_bits[r, j])


@nb.njit(nogil=True, cache=True, inline="always")
def _f32_of_f16(h: np.uint16) -> np.float32:
    """The float32 of float16 bits ``h`` (exact: every float16 is a float32)."""
    u = np.uint32(h)
    sign = (u & np.uint32(0x8000)) << np.uint32(16)
    e = (u >> np.uint32(10)) & np.uint32(0x1F)
    m = u & np.uint32(0x3FF)
    if e == np.uint32(0x1F):  # Inf, NaN
        bits = sign | np.uint32(0x7F800000) | (m << np.uint32(13))
    elif e != np.uint32(0):
        bits = sign | ((e + np.uint32(112)) << np.uint32(23)) | (m << np.uint32(13))
    else:  # zero or subnormal: m * 2**-24, exact in float32
        bits = sign | np.float32(np.float32(m) * np.float32(2.0**-24)).view(np.uint32)
    return np.uint32(bits).view(np.float32)


@nb.njit(nogil=True, cache=True, inline="always")
def half_rounded_native(x: np.float32) -> np.float32:
    y: np.float32 = f16_round_trip(x)
    return y


@nb.njit(nogil=True, cache=True, inline="always")
def half_rounded_bits(x: np.float32) -> np.float32:
    return _f32_of_f16(f16_bits(np.float32(x).view(np.uint32)))


# ``x`` rounded to float16 and back: ``x.astype(np.float16).astype(np.float32)``.
half_rounded = half_rounded_native if native_f16() else half_rounded_bits


def f32_to_f16(values: F32) -> U16:
    """Float32 values to float16 bits with the gather's conversion (a test hook).

    >>> f32_to_f16(np.array([1.0, -2.5, 1e-8, 7e4], dtype=np.float32)).view(np.float16).tolist()
    [1.0, -2.5, 0.0, inf]
    """
    flat = np.ascontiguousarray(values, dtype=np.float32).reshape(-1, 1)
    out = np.empty(flat.shape, dtype=np.uint16)
    gather_f16(flat.view(np.uint32), np.arange(flat.shape[0], dtype=np.int64), out)
    return out.reshape(np.shape(values))
