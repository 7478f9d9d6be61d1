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

Q4_BLOCK = 32  # kvlens.kv.kinds.Q4_BLOCK (this module is a leaf: the kv layer checks they agree)
Q4_LOW = np.float32(8.0)  # q4_0: d = (signed max) / -8, stored codes 0..15 (value (code - 8) * d)
FP16_ZERO_MAX = np.float32(2.0**-25)  # an f32 at or below this rounds to an fp16 zero (ties to even)
SEARCHED_STEP_MAX = np.float32(4.0)  # |searched step| <= |max| / 4 (first_fp16_overflow)
GROUP_MAX_EPS = np.float32(1e-15)  # make_qx_quants: a block with a smaller |max| is all zero (no 1/max)
# q4h's scale search (llama.cpp's make_qx_quants, nmax 8): the candidate steps |max| / (8 + 0.1 is), in
# its order is = 0, -9..-1, 1..9, each ``nmax + 0.1f * is`` in f32 as C computes it
Q4_SEARCH = np.array(
    [np.float32(8.0) + np.float32(0.1) * np.float32(i) for i in [0, *range(-9, 0), *range(1, 10)]], np.float32
)


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
def searched_block(xb, codes):  # pragma: no cover - compiled
    """q4h's block rule on one f32 block ``xb [32]``: llama.cpp's ``make_qx_quants(32, 8, x, L, ·,
    weights 1)`` (the search its q4_0 runs with importance weights), plain squared error. For each
    candidate ``iscale = -Q4_SEARCH[c] / max`` (f32, ``max`` the signed block max): codes
    ``l = clamp(rint(iscale * x), -8, 7)``, the least-squares step ``sum(l x) / sum(l²)`` and the
    error it removes ``sum(l x)² / sum(l²)``; the first candidate removing the most wins. Sums in
    float64, exact here (each nonzero ``l x`` has |x| ≥ |max| / 18 and 28 significant bits), so any
    summation order gives the same choice. Writes the stored codes ``l + 8`` (0..15) into ``codes``
    and returns the step as f32 (0, codes 8, for a block whose |max| is under GROUP_MAX_EPS)."""
    mx = signed_absmax(xb)
    if abs(mx) < GROUP_MAX_EPS:
        codes[:] = 8
        return np.float32(0.0)
    best, best_lx, best_l2, best_iscale = -1.0, 0.0, 1.0, np.float32(0.0)
    for c in range(Q4_SEARCH.size):
        iscale = -Q4_SEARCH[c] / mx
        lx, l2 = _candidate_sums(iscale, xb)
        gain = lx * lx / l2  # l2 >= 49: the block max maps to |l| >= 7
        if gain > best:
            best, best_lx, best_l2, best_iscale = gain, lx, l2, iscale
    for i in range(Q4_BLOCK):  # the winner's codes, computed again rather than kept for every candidate
        codes[i] = np.int32(_search_code(best_iscale, xb[i])) + 8
    return np.float32(best_lx / best_l2)


@njit(fastmath={"reassoc", "contract"}, cache=True)
def _candidate_sums(iscale, xb):  # pragma: no cover - compiled
    """``(sum(l x), sum(l²))`` over a block for one candidate's codes ``l`` (:func:`_search_code`), in
    float64. Both sums are exact (:func:`searched_block`) and each product ``l x`` is exact (4 × 24
    bits), so reassociation (vectorized sums) and contraction (FMA) cannot change them: a compiled
    function of its own, so these flags reach no other operation (not inlined by numba: LLVM keeps
    each instruction's flags when it inlines)."""
    lx, l2 = 0.0, 0.0
    for i in range(Q4_BLOCK):
        q = np.float64(_search_code(iscale, xb[i]))
        lx += q * np.float64(xb[i])
        l2 += q * q
    return lx, l2


@njit(inline="always")
def _search_code(iscale, v):  # pragma: no cover - compiled
    """A candidate's code for value ``v``: ``clamp(rint(iscale * v), -8, 7)`` (f32)."""
    return min(max(np.rint(iscale * v), np.float32(-8.0)), np.float32(7.0))


@njit(cache=True)
def block_codes(xb, search, codes):  # pragma: no cover - compiled
    """One block's step before its fp16 rounding, its stored codes (0..15) into ``codes``: q4h's
    search (:func:`searched_block`) or q4_0's ``max / -8`` with ``min(15, (int)(x * id + 8.5f))``;
    code 8 (value 0) throughout where the step rounds to an fp16 zero."""
    d = searched_block(xb, codes) if search else signed_absmax(xb) / -Q4_LOW
    if abs(d) <= FP16_ZERO_MAX:  # (1/d may even overflow: no cast of inf or NaN)
        codes[:] = 8
    elif not search:
        inv = np.float32(1.0) / d
        for i in range(Q4_BLOCK):
            # x * inv + 8.5 >= 0.5 (|x * inv| <= 8 + an ulp): C's cast truncates, = floor here
            codes[i] = min(np.int32(xb[i] * inv + np.float32(8.5)), 15)
    return d


@njit(cache=True)
def first_fp16_overflow(x, search):  # pragma: no cover - compiled
    """Flat index of the first 32-block of rows ``x [m, d]`` whose step (``|max| / 8``, or the
    searched one) exceeds the fp16 range, or -1. A searched step is at most |max| / 4 (it is an
    average of ``x_i / l_i`` weighted by ``l_i²``, each at most ``1.5 / |iscale|`` ≤ |max| / 4.7 where
    ``l_i`` is rounded, |max| / 7 where it is clipped), so a block under 4 × 65504 needs no search."""
    m, d = x.shape
    codes = np.empty(Q4_BLOCK, np.int32)
    for r in range(m):
        for b in range(d // Q4_BLOCK):
            xb = x[r, b * Q4_BLOCK : (b + 1) * Q4_BLOCK]
            peak = absmax(xb)
            if search and peak / SEARCHED_STEP_MAX <= FP16_MAX:
                continue
            step = block_codes(xb, search, codes) if search else peak / Q4_LOW
            if abs(step) > FP16_MAX:
                return r * (d // Q4_BLOCK) + b
    return -1


@njit(cache=True)
def store_q4_rows(x, data, bits, start, search):  # pragma: no cover - compiled
    """The q4 rule, or with ``search`` q4h's (:func:`block_codes`), over rows ``x [n_kv, n, d]`` (f32,
    finite) into ``data [n_kv, cap, d/2]`` (uint8 code pairs, llama.cpp's q4_0 order: byte i of a
    block holds elements i and i + 16) and ``bits [n_kv, cap, d/32]`` (the fp16 scales' bits), at
    positions ``start ..``. Returns -1, or the flat index (as :func:`first_fp16_overflow`'s) of the
    first block whose step is past fp16: nothing is stored then. The blocks are coded into scratch
    first, so each is searched once. :func:`kvlens.kv.quant.quantize_q4_0_blocks` and
    :func:`kvlens.kv.quant.quantize_q4_search_blocks` are the torch rules, bit-identical."""
    n_kv, n, hd = x.shape
    nb, half = hd // Q4_BLOCK, Q4_BLOCK // 2
    steps = np.empty((n_kv, n, nb), np.float32)
    packed = np.empty((n_kv, n, hd // 2), np.uint8)
    codes = np.empty(Q4_BLOCK, np.int32)
    for h in range(n_kv):
        for j in range(n):
            for b in range(nb):
                d = block_codes(x[h, j, b * Q4_BLOCK : (b + 1) * Q4_BLOCK], search, codes)
                if abs(d) > FP16_MAX:
                    return (h * n + j) * nb + b
                steps[h, j, b] = d
                for i in range(half):
                    packed[h, j, b * half + i] = np.uint8(codes[i] | (codes[i + half] << 4))
    for h in range(n_kv):
        for j in range(n):
            data[h, start + j, :] = packed[h, j, :]
            for b in range(nb):
                bits[h, start + j, b] = fp16_bits(steps[h, j, b])
    return -1
