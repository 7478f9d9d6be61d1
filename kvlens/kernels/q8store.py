"""The seed's int8 KV rule (:mod:`kvlens.kv.quant`) as one JIT pass, for the engine's per-token cache
writes on the CPU, and a one-pass finite check. Imports only kernels.bits (a leaf the kv layer calls)."""

from __future__ import annotations

import numpy as np
from numba import njit

from .bits import FP16_MAX, absmax, f16_f32, fp16_bits

# the integer attention kernels (kernels.cpu_int) correct a +128-shifted query with the sum of each
# 32-value block of key codes; |sum| <= 32 * 127 fits int16
KSUM_BLOCK = 32
NO_KSUM = np.zeros((0, 0, 0), np.int16)  # passed as ``ksum`` where a store keeps none


# quantize_q8 is ~8 small torch ops per K or V of a decode step; this is one call. The same float32
# operations in the same order (no fastmath: no FMA contraction), so the codes are bit-identical.
@njit(cache=True)
def first_nonfinite_index(x):  # pragma: no cover - compiled
    flat = x.reshape(-1)
    for i in range(flat.size):
        if not np.isfinite(flat[i]):
            return i
    return -1


@njit(inline="always")
def row_scale(row, qmax):  # pragma: no cover - compiled
    """(max_abs, qmax / max_abs) of one row; a max_abs under 1e-6 (kv.quant.TINY_MAX_ABS) is 1.0."""
    m = absmax(row)
    if m < np.float32(1e-6):
        m = np.float32(1.0)
    return m, qmax / m


@njit(inline="always")
def row_code(v, inv, qmax):  # pragma: no cover - compiled
    """The rule's code of ``v``: ``floor(v * inv + 0.5)`` clamped to ``-qmax..qmax`` (float32)."""
    c = np.floor(v * inv + np.float32(0.5))
    return min(max(c, -qmax), qmax)


@njit(cache=True)
def store_q8_rows(x, data, scale, start, ksum):  # pragma: no cover - compiled
    """``ksum [n_kv, cap, hd // 32]`` int16 (or :data:`NO_KSUM`): the codes' sum per 32-block."""
    n_kv, n, hd = x.shape
    qmax = np.float32(127.0)
    for h in range(n_kv):
        for j in range(n):
            m, inv = row_scale(x[h, j], qmax)
            for d in range(hd):
                data[h, start + j, d] = np.int8(row_code(x[h, j, d], inv, qmax))
            scale[h, start + j] = m
            if ksum.size:
                for b in range(hd // KSUM_BLOCK):
                    s = np.int32(0)
                    for d in range(b * KSUM_BLOCK, (b + 1) * KSUM_BLOCK):
                        s += np.int32(data[h, start + j, d])
                    ksum[h, start + j, b] = s


@njit(cache=True)
def first_row_past_fp16(x):  # pragma: no cover - compiled
    """The flat index (``h * n + j``) of the first row of ``x [n_kv, n, d]`` whose max_abs exceeds the
    fp16 range (65504): a packed row's scale could not be stored; -1 if none."""
    n_kv, n = x.shape[0], x.shape[1]
    for h in range(n_kv):
        for j in range(n):
            if absmax(x[h, j]) > FP16_MAX:
                return h * n + j
    return -1


@njit(cache=True)
def store_packed_rows(x, data, scale, start, bits):  # pragma: no cover - compiled
    """The same rule at ``bits`` (5..7: qmax ``2^(bits-1) - 1``) with an fp16 max_abs: the row's
    max_abs rounded to fp16 (nearest even; ``scale [n_kv, cap]`` holds its uint16 bits) and the codes
    made with that rounded value, so they decode by what is stored. The codes bit-packed as
    :func:`kvlens.kv.nbit.pack_bits` packs them: in each group of 8, code i's low ``bits`` bits
    (two's complement) at bits ``[i*bits, i*bits + bits)`` of ``bits`` little-endian bytes. Returns
    -1, or the flat index (``h * n + j``) of the first row whose max_abs exceeds the fp16 range
    (65504), in which case nothing is stored."""
    n_kv, n, hd = x.shape
    bad = first_row_past_fp16(x)
    if bad >= 0:
        return bad
    qmax = np.float32((1 << (bits - 1)) - 1)
    mask = np.uint64((1 << bits) - 1)
    for h in range(n_kv):
        for j in range(n):
            m16 = fp16_bits(row_scale(x[h, j], qmax)[0])
            inv = qmax / f16_f32(m16)
            for g in range(hd // 8):
                word = np.uint64(0)
                for i in range(8):
                    code = np.int64(row_code(x[h, j, g * 8 + i], inv, qmax))
                    word |= (np.uint64(code) & mask) << np.uint64(i * bits)
                for b in range(bits):
                    data[h, start + j, g * bits + b] = np.uint8((word >> np.uint64(8 * b)) & np.uint64(255))
            scale[h, start + j] = m16
    return -1
