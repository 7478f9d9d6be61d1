"""Element conversions the compiled kernels inline (numba has no bf16 or f16 arrays: such values
arrive as their bits)."""

from __future__ import annotations

import math

import numpy as np
from numba import njit

FP16_MAX = np.float32(65504.0)  # the largest finite fp16
FP16_ROUNDS_TO_INF = np.float32(65520.0)  # the least |x| whose fp16 (nearest even) is infinite
F16_MAGIC = np.float32(2.0**112)  # (h & 0x7fff) << 13 read as f32, times 2^112, is the f16 value (exact)


@njit(inline="always")
def absmax(x):  # pragma: no cover - compiled
    """max |x| over a 1-D f32 slice (0 for an empty one): what every row or block quantizer starts from."""
    m = np.float32(0.0)
    for i in range(x.size):
        m = max(m, abs(x[i]))
    return m


@njit(inline="always")
def signed_absmax(x):  # pragma: no cover - compiled
    """The element of largest |x| of a 1-D f32 slice with its sign, the first on ties (+0 for an empty
    or all-zero one): llama.cpp's q4_0 block max (``if (amax < fabsf(v)) { amax = fabsf(v); max = v; }``)."""
    a = np.float32(0.0)
    m = np.float32(0.0)
    for i in range(x.size):
        if a < abs(x[i]):
            a = abs(x[i])
            m = x[i]
    return m


@njit(inline="always")
def int8_f32(code):  # pragma: no cover - compiled
    """An int8 code as f32 (exact)."""
    return np.float32(code)


@njit(inline="always")
def same_bits(u):  # pragma: no cover - compiled
    """f32 bits kept as they are."""
    return u


@njit(inline="always")
def bf16_bits(b):  # pragma: no cover - compiled
    """bf16 bits as the f32 bits of the same value: bf16 is the top half of an f32."""
    return np.uint32(b) << np.uint32(16)


@njit(inline="always")
def bf16_f32(b):  # pragma: no cover - compiled
    """bf16 bits as the f32 value."""
    return np.uint32(bf16_bits(b)).view(np.float32)


@njit(cache=True)
def fp16_bits(d):  # pragma: no cover - compiled
    """The fp16 bit pattern of a finite f32 ``d`` with |d| <= 65504, rounded to nearest even (the
    sign kept, -0 included): one rounding of the exact |d| in float64 (``m 2^e``, ``m`` in [0.5, 1):
    11 significant bits)."""
    sign = np.uint16(0x8000) if np.signbit(d) else np.uint16(0)
    x = abs(np.float64(d))
    if x < 2.0**-14:  # subnormal fp16: a multiple of 2^-24 (1024 * 2^-24 is the smallest normal)
        return sign | np.uint16(np.rint(x * 2.0**24))
    m, e = math.frexp(x)
    r = np.rint(m * 2048.0)  # 1024..2048; 2048 carries into the exponent field below
    return sign | np.uint16(((e + 14) << 10) + np.int64(r) - 1024)


@njit(inline="always")
def f16_f32(u):  # pragma: no cover - compiled
    """fp16 bits ``u`` (uint16) as the f32 value, exactly (subnormals included; finite only)."""
    v = (np.uint32(u) & np.uint32(0x7FFF)) << np.uint32(13)
    f = np.uint32(v).view(np.float32) * F16_MAGIC
    return -f if np.uint32(u) & np.uint32(0x8000) else f
