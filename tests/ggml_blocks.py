"""GGML block formats decoded from their spec (llama.cpp ggml-quants.c, dequantize_row_*), in float64
numpy, one block at a time: the independent reference for the loader's dequantization.

Every block starts or ends with f16 scales; 32-value blocks for Q8_0/Q4_0/Q4_1, 256-value
super-blocks (QK_K) with packed 6-bit sub-block scales for the K-quants.
"""

from __future__ import annotations

import numpy as np

QK_K = 256
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def _f16(b: np.ndarray) -> float:
    return float(b[:2].copy().view(np.float16)[0])


def _scale_min_k4(j: int, q: np.ndarray) -> tuple[int, int]:
    """get_scale_min_k4: sub-block j's 6-bit scale and min from the 12 packed bytes."""
    q = q.astype(np.int64)
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


def _q8_0(b: np.ndarray) -> np.ndarray:
    return _f16(b) * b[2:34].view(np.int8).astype(np.float64)


def _q4_0(b: np.ndarray) -> np.ndarray:
    qs = b[2:18].astype(np.int64)
    return _f16(b) * (np.concatenate([qs & 0xF, qs >> 4]) - 8)


def _q4_1(b: np.ndarray) -> np.ndarray:
    qs = b[4:20].astype(np.int64)
    return _f16(b) * np.concatenate([qs & 0xF, qs >> 4]) + _f16(b[2:])


def _q4_k(b: np.ndarray) -> np.ndarray:
    d, dmin, scales, qs = _f16(b), _f16(b[2:]), b[4:16], b[16:144].astype(np.int64)
    y = np.empty(QK_K)
    for j in range(4):  # 64 values per step: low nibbles of 32 bytes, then their high nibbles
        q = qs[32 * j : 32 * j + 32]
        for half, codes in enumerate((q & 0xF, q >> 4)):
            sc, m = _scale_min_k4(2 * j + half, scales)
            y[64 * j + 32 * half : 64 * j + 32 * half + 32] = d * sc * codes - dmin * m
    return y


def _q5_k(b: np.ndarray) -> np.ndarray:
    d, dmin, scales = _f16(b), _f16(b[2:]), b[4:16]
    qh, qs = b[16:48].astype(np.int64), b[48:176].astype(np.int64)
    y = np.empty(QK_K)
    for j in range(4):
        q = qs[32 * j : 32 * j + 32]
        for half, low in enumerate((q & 0xF, q >> 4)):
            high = ((qh >> (2 * j + half)) & 1) * 16  # bit u1 = 1 << 2j, u2 = 2 << 2j
            sc, m = _scale_min_k4(2 * j + half, scales)
            y[64 * j + 32 * half : 64 * j + 32 * half + 32] = d * sc * (low + high) - dmin * m
    return y


def _q6_k(b: np.ndarray) -> np.ndarray:
    ql, qh = b[0:128].astype(np.int64), b[128:192].astype(np.int64)
    sc, d = b[192:208].view(np.int8).astype(np.int64), _f16(b[208:])
    y = np.empty(QK_K)
    for n in range(2):  # two halves of 128 values: 64 ql bytes, 32 qh bytes, 8 scales each
        l_, h, s, out = ql[64 * n :], qh[32 * n :], sc[8 * n :], y[128 * n :]
        for i in range(32):
            codes = (
                (l_[i] & 0xF) | ((h[i] & 3) << 4),
                (l_[i + 32] & 0xF) | (((h[i] >> 2) & 3) << 4),
                (l_[i] >> 4) | (((h[i] >> 4) & 3) << 4),
                (l_[i + 32] >> 4) | (((h[i] >> 6) & 3) << 4),
            )
            for r, code in enumerate(codes):
                out[i + 32 * r] = d * s[i // 16 + 2 * r] * (code - 32)
    return y


_DECODE = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def dequantize_blocks(raw: np.ndarray, qtype: str) -> np.ndarray:
    """Rows of raw uint8 blocks [rows, n_blocks * block_bytes] -> float64 [rows, n_blocks * block_values]."""
    size = BLOCK_BYTES[qtype]
    blocks = raw.reshape(raw.shape[0], -1, size)
    return np.stack([np.concatenate([_DECODE[qtype](blk) for blk in row]) for row in blocks])
