"""Integer Q·K scores over 4-bit K rows (q4, q4h) for the integer-score kernel (:mod:`.cpu_int`).

A 4-bit row stores, per block ``b`` of 32 values, an fp16 scale ``s_b`` and the codes ``c + 8``
(``c`` in -8..7, llama.cpp's q4_0 rule) two per byte (llama.cpp's q4_0 order: byte ``i`` holds value ``i`` in its low nibble
and value ``i + 16`` in its high one). With the query quantized to int8 per 32-block (``q ≈ s_q,b ·
q8``, the 8-bit rule of :func:`kvlens.kernels.cpu_int.quantize_query`), a score is

    q·k = Σ_b s_q,b · s_b · Σ_i q8_i (u_i - 8) = Σ_b s_q,b · s_b · (Σ_i q8_i u_i - 8 Σ_i q8_i)

``Σ_i q8_i u_i`` is an integer dot of the stored (unsigned) codes with the signed query codes —
``vpdpbusd`` / ``vpmaddubsw`` take exactly u8 x i8, so no shift is needed (:func:`intdot.score4`) —
and ``8 Σ_i q8_i`` (:func:`lane_offsets`) is computed once per query. Both are exact in int32; the
difference is exact in f32 (|·| <= 32 · 8 · 127 < 2^24). Only the block scales are float.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from . import intdot
from .stage import _FM, q4_tile_scales

Q4_VALUES = 2 * intdot.Q4_CHUNK  # values per step of dot4 (head_dim must be a multiple)


def permute_query(q8: np.ndarray) -> np.ndarray:
    """int8 query codes ``[H, hd]`` in :func:`intdot.score4`'s order: per 64 values (two blocks), the
    low halves of both blocks (values 0..15, 32..47), then the high halves (16..31, 48..63)."""
    n_heads, hd = q8.shape
    if hd % Q4_VALUES:
        raise ValueError(f"integer scores over 4-bit K need head_dim divisible by {Q4_VALUES}, got {hd}")
    chunks = q8.reshape(n_heads, hd // Q4_VALUES, 2, 2, 16)  # (chunk, block, half, 16)
    return np.ascontiguousarray(chunks.transpose(0, 1, 3, 2, 4).reshape(n_heads, hd))


def lane_offsets(qp: np.ndarray) -> np.ndarray:
    """Per query head and 32-bit lane of :func:`intdot.score4` (8 per 64 values): 8 x the sum of the
    permuted codes ``qp`` the lane multiplies (4 low-half and 4 high-half values), int32 ``[H, hd // 8]``:
    the +8 of the stored codes, taken off in integers."""
    n_heads, hd = qp.shape
    lanes = qp.reshape(n_heads, hd // Q4_VALUES, 2, 8, 4).astype(np.int32).sum(axis=(2, 4), dtype=np.int32)
    return 8 * lanes.reshape(n_heads, hd // 8)


def lane_scales(block_scale: np.ndarray) -> np.ndarray:
    """Each lane's query block scale (f32 ``[H, hd // 8]``: 4 lanes per 32-value block)."""
    return np.ascontiguousarray(np.repeat(block_scale, 4, axis=1))


@njit(fastmath=_FM, cache=True)
def score_tile_q4(path, qp, qoff, qs, raw, bsc, h, t0, nt, hq0, group, sc, bs_u, bs_f):  # pragma: no cover
    """Raw scores (f32, 1/sqrt(hd) in ``qs``) of tile rows t0..t0+nt of 4-bit K head ``h`` for query
    heads hq0..hq0+group-1: ``qp`` the permuted int8 query, ``qoff``/``qs`` its :func:`lane_offsets` and
    :func:`lane_scales`; ``raw`` the store's packed bytes, ``bsc`` its fp16 scale bits (``bs_u``/``bs_f``:
    the tile's f32 scales). ``path``: a compile-time constant. The tile's rows are contiguous in the
    store (a tile never crosses a block of a paged cache)."""
    q4_tile_scales(bsc, h, t0, nt, bs_u, bs_f)
    k_at = raw[h, t0].ctypes.data
    for g in range(group):
        hq = hq0 + g
        intdot.score4(path, qp[hq].ctypes.data, qoff[hq].ctypes.data, qs[hq].ctypes.data, k_at, bs_f.ctypes.data,
                      raw.shape[2], nt, sc[g].ctypes.data)  # fmt: skip
