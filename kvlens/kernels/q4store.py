"""The rotated and 4-bit KV rules (:mod:`kvlens.kv.quant`) as JIT passes, for the engine's per-token
cache writes on the CPU: the randomized Hadamard rotation as a fast Walsh–Hadamard transform, and the
4-bit block rule (llama.cpp's q4_0) with its fp16 scale and two codes per byte. The torch reference does the
same float32 operations in the same order (no fastmath: no FMA contraction, no reassociation), so the
results are bit-identical (tests/test_kv_store_jit.py). Imports nothing from kvlens (a leaf the kv
layer calls)."""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from .bits import FP16_MAX, absmax, fp16_bits, signed_absmax

Q4_BLOCK = 32  # kvlens.kv.modes.Q4_BLOCK (this module is a leaf: the kv layer checks they agree)
Q4_LOW = np.float32(8.0)  # q4_0: d = (signed max) / -8, stored codes 0..15 (value (code - 8) * d)
FP16_ZERO_MAX = np.float32(2.0**-25)  # an f32 at or below this rounds to an fp16 zero (ties to even)


@njit(cache=True)
def hadamard_rows(x, pre, post, span, out):  # pragma: no cover - compiled
    """``out = ((x * pre) @ (I ⊗ H)) * (1/sqrt(span)) * post`` for rows ``x [m, d]`` (f32), ``H`` the
    Sylvester Hadamard matrix of order ``span`` (a power of two dividing d) on each contiguous block
    of ``span`` values (butterflies ``(a + b, a - b)`` of stride 1, 2, 4, ... below ``span``), ``pre``
    and ``post`` sign vectors: the rotation ``x @ R`` (pre = the signs, post = 1) and its inverse
    ``y @ R.T`` (pre = 1, post = the signs), ``R = diag(s) (I ⊗ H) / sqrt(span)``."""
    m, d = x.shape
    scale = np.float32(1.0 / math.sqrt(span))
    for r in range(m):
        for i in range(d):
            out[r, i] = x[r, i] * pre[i]
        h = 1
        while h < span:
            for i0 in range(0, d, 2 * h):
                for j in range(i0, i0 + h):
                    a, b = out[r, j], out[r, j + h]
                    out[r, j] = a + b
                    out[r, j + h] = a - b
            h *= 2
        for i in range(d):
            out[r, i] = out[r, i] * scale * post[i]


@njit(cache=True)
def first_fp16_overflow(x):  # pragma: no cover - compiled
    """Flat index of the first 32-block of rows ``x [m, d]`` whose scale ``|max| / 8`` exceeds the
    fp16 range, or -1."""
    m, d = x.shape
    for r in range(m):
        for b in range(d // Q4_BLOCK):
            if absmax(x[r, b * Q4_BLOCK : (b + 1) * Q4_BLOCK]) / Q4_LOW > FP16_MAX:
                return r * (d // Q4_BLOCK) + b
    return -1


@njit(cache=True)
def store_q4_rows(x, data, bits, start):  # pragma: no cover - compiled
    """The q4 rule over rows ``x [n_kv, n, d]`` (f32, finite, scales in range: the caller checks with
    :func:`first_fp16_overflow`) into ``data [n_kv, cap, d/2]`` (uint8 code pairs, llama.cpp's q4_0
    order: byte i of a block holds elements i and i + 16) and ``bits [n_kv, cap, d/32]`` (the fp16
    scales' bits), at positions ``start ..``. Per block, llama.cpp's ``quantize_row_q4_0_ref``:
    ``max`` the first element of largest |x| with its sign, ``d = max / -8``, ``id = d ? 1/d : 0``,
    stored code ``min(15, (int)(x * id + 8.5f))``; a scale that rounds to fp16 zero stores code 8
    (value 0; :func:`kvlens.kv.quant.quantize_q4_0_blocks` is the torch rule, bit-identical)."""
    n_kv, n, hd = x.shape
    half = Q4_BLOCK // 2
    codes = np.empty(Q4_BLOCK, np.int32)
    for h in range(n_kv):
        for j in range(n):
            for b in range(hd // Q4_BLOCK):
                o = b * Q4_BLOCK
                d = signed_absmax(x[h, j, o : o + Q4_BLOCK]) / -Q4_LOW
                inv = np.float32(1.0) / d if d != np.float32(0.0) else np.float32(0.0)
                zero = abs(d) <= FP16_ZERO_MAX
                for i in range(Q4_BLOCK):
                    if zero:  # (1/d may even overflow: no cast of inf or NaN)
                        codes[i] = 8
                        continue
                    y = x[h, j, o + i] * inv
                    # y + 8.5 >= 0.5 (|y| <= 8 + an ulp): C's cast truncates, = floor here
                    codes[i] = min(np.int32(y + np.float32(8.5)), 15)
                for i in range(half):
                    data[h, start + j, b * half + i] = np.uint8(codes[i] | (codes[i + half] << 4))
                bits[h, start + j, b] = fp16_bits(d)
