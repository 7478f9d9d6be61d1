"""Element conversions the compiled kernels inline (numba has no bf16 or f16 arrays: such values
arrive as their bits)."""

from __future__ import annotations

import numpy as np
from numba import njit


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
