"""JIT (numba) CPU kernels of the kept-quantized linear layers (:mod:`.qlinear` holds the formats).

Weights are blocked ``[n_tiles, rows, TILE]``: each tile of TILE output rows is one contiguous
stream, read front to back by one thread; the inner loop runs over the tile's output columns
(convert a row of codes to f32, ``axpy`` it into the accumulators), which LLVM vectorizes.

* ``_mv_*``: one input row (decode), x [k] f32, out [n];
* ``_mm_*``: a few rows (up to qlinear.SMALL_M), x [m, k], out [m, n];
* ``_deq_*``: dequantize tiles to f32 for torch's GEMM (prefill).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

G = 32  # inputs per quantization group
_FM = {"reassoc", "contract", "nsz"}  # reassoc/contract: vectorized FMA accumulation


# -- a few input rows: x [m, k] f32, out [m, n] f32 --------------------------------------------------
@njit(parallel=True, fastmath=_FM, cache=True)
def _mm_int8(x, q, s, out):  # pragma: no cover - compiled
    m, k = x.shape
    n_tiles, _, T = q.shape
    for t in prange(n_tiles):
        acc = np.zeros((m, T), np.float32)
        part = np.empty((m, T), np.float32)
        wt = np.empty(T, np.float32)
        qt, st = q[t], s[t]
        for g in range(st.shape[0]):
            part[:] = 0
            for j in range(g * G, min(k, g * G + G)):
                qj = qt[j]
                for c in range(T):
                    wt[c] = np.float32(qj[c])
                for i in range(m):
                    xij, pi = x[i, j], part[i]
                    for c in range(T):
                        pi[c] += wt[c] * xij
            sg = st[g]
            for i in range(m):
                ai, pi = acc[i], part[i]
                for c in range(T):
                    ai[c] += pi[c] * sg[c]
        _store(acc, out, t * T)


@njit(parallel=True, fastmath=_FM, cache=True)
def _mm_int4(x, q, s, mn, out):  # pragma: no cover - compiled
    # q rows = input pairs: low nibble = input 2*j2, high nibble = input 2*j2 + 1; x has even k.
    # Nibbles go to f32 through int32: numba widens uint8 arithmetic to uint64, whose conversion
    # to f32 does not vectorize on AVX2.
    m, k = x.shape
    n_tiles, _, T = q.shape
    ng = s.shape[1]
    xs = np.zeros((m, ng), np.float32)  # per-group input sums carry the min term: Σ min·x = min·Σx
    for i in range(m):
        for j in range(k):
            xs[i, j // G] += x[i, j]
    for t in prange(n_tiles):
        acc = np.zeros((m, T), np.float32)
        part = np.empty((m, T), np.float32)
        lo = np.empty(T, np.float32)
        hi = np.empty(T, np.float32)
        qt, st, mt = q[t], s[t], mn[t]
        for g in range(ng):
            part[:] = 0
            for j2 in range(g * (G // 2), min(k // 2, (g + 1) * (G // 2))):
                qj = qt[j2]
                for c in range(T):
                    lo[c] = np.float32(np.int32(qj[c] & 15))
                    hi[c] = np.float32(np.int32(qj[c] >> 4))
                for i in range(m):
                    x0, x1, pi = x[i, 2 * j2], x[i, 2 * j2 + 1], part[i]
                    for c in range(T):
                        pi[c] += lo[c] * x0 + hi[c] * x1
            sg, mg = st[g], mt[g]
            for i in range(m):
                ai, pi, xg = acc[i], part[i], xs[i, g]
                for c in range(T):
                    ai[c] += pi[c] * sg[c] + mg[c] * xg
        _store(acc, out, t * T)


@njit(parallel=True, fastmath=_FM, cache=True)
def _mm_bf16(x, q, out):  # pragma: no cover - compiled
    m, k = x.shape
    n_tiles, _, T = q.shape
    for t in prange(n_tiles):
        acc = np.zeros((m, T), np.float32)
        wu = np.empty(T, np.uint32)
        wt = wu.view(np.float32)  # bf16 bits << 16 are the f32 bits (numba has no bf16 type)
        qt = q[t]
        for j in range(k):
            qj = qt[j]
            for c in range(T):
                wu[c] = np.uint32(qj[c]) << np.uint32(16)
            for i in range(m):
                xij, ai = x[i, j], acc[i]
                for c in range(T):
                    ai[c] += wt[c] * xij
        _store(acc, out, t * T)


@njit(fastmath=_FM, cache=True)
def _store(acc, out, c0):  # pragma: no cover - compiled
    w = min(acc.shape[1], out.shape[1] - c0)  # the last tile is padded past n
    for i in range(acc.shape[0]):
        o, a = out[i, c0 : c0 + w], acc[i]
        for c in range(w):
            o[c] = a[c]


# dequantize tiles t0.. into out [k, n_sel * TILE] (f32) for the GEMM path
@njit(parallel=True, cache=True)
def _deq_int8(q, s, t0, out):  # pragma: no cover - compiled
    k, T = out.shape[0], q.shape[2]
    for tt in prange(out.shape[1] // T):
        qt, st = q[t0 + tt], s[t0 + tt]
        for j in range(k):
            qj, sg, o = qt[j], st[j // G], out[j, tt * T : (tt + 1) * T]
            for c in range(T):
                o[c] = np.float32(qj[c]) * sg[c]


@njit(parallel=True, cache=True)
def _deq_int4(q, s, mn, t0, out):  # pragma: no cover - compiled
    k, T = out.shape[0], q.shape[2]
    for tt in prange(out.shape[1] // T):
        qt, st, mt = q[t0 + tt], s[t0 + tt], mn[t0 + tt]
        for j in range(k):
            qj, sg, mg, o = qt[j // 2], st[j // G], mt[j // G], out[j, tt * T : (tt + 1) * T]
            sh = 4 * (j % 2)
            for c in range(T):
                o[c] = np.float32(np.int32((qj[c] >> sh) & 15)) * sg[c] + mg[c]


@njit(parallel=True, cache=True)
def _deq_bf16(q, t0, out):  # pragma: no cover - compiled
    k, T = out.shape[0], q.shape[2]
    ou = out.view(np.uint32)
    for tt in prange(out.shape[1] // T):
        qt = q[t0 + tt]
        for j in range(k):
            qj, o = qt[j], ou[j, tt * T : (tt + 1) * T]
            for c in range(T):
                o[c] = np.uint32(qj[c]) << np.uint32(16)


# -- one input row (decode): matrix-vector kernels. Four weight rows per pass over the accumulator:
# one load/store of ``part`` feeds four FMAs (one per row was load/store-bound: 1.7x slower). ----------
@njit(parallel=True, fastmath=_FM, cache=True)
def _mv_int8(x, q, s, out):  # pragma: no cover - compiled
    k = x.shape[0]
    n_tiles, _, T = q.shape
    for t in prange(n_tiles):
        acc = np.zeros(T, np.float32)
        part = np.empty(T, np.float32)
        qt, st = q[t], s[t]
        for g in range(st.shape[0]):
            part[:] = 0
            j, j1 = g * G, min(k, g * G + G)
            while j + 4 <= j1:
                a, b, c, d = qt[j], qt[j + 1], qt[j + 2], qt[j + 3]
                xa, xb, xc, xd = x[j], x[j + 1], x[j + 2], x[j + 3]
                for i in range(T):
                    part[i] += (np.float32(a[i]) * xa + np.float32(b[i]) * xb) + (
                        np.float32(c[i]) * xc + np.float32(d[i]) * xd
                    )
                j += 4
            for jj in range(j, j1):
                a, xa = qt[jj], x[jj]
                for i in range(T):
                    part[i] += np.float32(a[i]) * xa
            sg = st[g]
            for i in range(T):
                acc[i] += part[i] * sg[i]
        _store_row(acc, out, t * T)


@njit(parallel=True, fastmath=_FM, cache=True)
def _mv_int4(x, q, s, mn, out):  # pragma: no cover - compiled
    """Two packed rows (four inputs) per pass; x has even length (see Int4Linear._kernel).

    The nibbles stay in float arithmetic: with f = the byte as f32 (exact), hi = floor(f / 16) and
    lo = f - 16 hi, so lo x0 + hi x1 = f x0 + hi (x1 - 16 x0): a convert, a multiply-round and two FMAs
    per byte. Integer masks and shifts were 1.75x slower: numba widens uint8 arithmetic to int64."""
    k2 = x.shape[0] // 2
    n_tiles, _, T = q.shape
    ng = s.shape[1]
    xs = np.zeros(ng, np.float32)  # per-group input sums carry the min term: Σ min·x = min·Σx
    for j in range(x.shape[0]):
        xs[j // G] += x[j]
    sixteenth, sixteen = np.float32(0.0625), np.float32(16.0)
    for t in prange(n_tiles):
        acc = np.zeros(T, np.float32)
        part = np.empty(T, np.float32)
        qt, st, mt = q[t], s[t], mn[t]
        for g in range(ng):
            part[:] = 0
            j2, j1 = g * (G // 2), min(k2, (g + 1) * (G // 2))
            while j2 + 2 <= j1:
                a, b = qt[j2], qt[j2 + 1]
                x0, x2 = x[2 * j2], x[2 * j2 + 2]
                ca, cb = x[2 * j2 + 1] - sixteen * x0, x[2 * j2 + 3] - sixteen * x2
                for i in range(T):
                    fa, fb = np.float32(a[i]), np.float32(b[i])
                    part[i] += (fa * x0 + np.floor(fa * sixteenth) * ca) + (
                        fb * x2 + np.floor(fb * sixteenth) * cb
                    )
                j2 += 2
            for jj in range(j2, j1):
                a, x0 = qt[jj], x[2 * jj]
                ca = x[2 * jj + 1] - sixteen * x0
                for i in range(T):
                    fa = np.float32(a[i])
                    part[i] += fa * x0 + np.floor(fa * sixteenth) * ca
            sg, mg, xg = st[g], mt[g], xs[g]
            for i in range(T):
                acc[i] += part[i] * sg[i] + mg[i] * xg
        _store_row(acc, out, t * T)


@njit(parallel=True, fastmath=_FM, cache=True)
def _mv_bf16(x, q, out):  # pragma: no cover - compiled
    k = x.shape[0]
    n_tiles, _, T = q.shape
    for t in prange(n_tiles):
        acc = np.zeros(T, np.float32)
        qt = q[t]
        j = 0
        while j + 4 <= k:
            a, b, c, d = qt[j], qt[j + 1], qt[j + 2], qt[j + 3]
            xa, xb, xc, xd = x[j], x[j + 1], x[j + 2], x[j + 3]
            for i in range(T):  # bf16 bits << 16 are the f32 bits (numba has no bf16 type)
                acc[i] += (_bf16(a[i]) * xa + _bf16(b[i]) * xb) + (_bf16(c[i]) * xc + _bf16(d[i]) * xd)
            j += 4
        for jj in range(j, k):
            a, xa = qt[jj], x[jj]
            for i in range(T):
                acc[i] += _bf16(a[i]) * xa
        _store_row(acc, out, t * T)


@njit(inline="always")
def _bf16(bits):  # pragma: no cover - compiled
    return np.uint32(np.uint32(bits) << np.uint32(16)).view(np.float32)


@njit(fastmath=_FM, cache=True)
def _store_row(acc, out, c0):  # pragma: no cover - compiled
    for c in range(min(acc.shape[0], out.shape[0] - c0)):  # the last tile is padded past n
        out[c0 + c] = acc[c]


@njit(parallel=True, fastmath=_FM, cache=True)
def _mv_f32(w, x, out):  # pragma: no cover - compiled
    """``out = w @ x`` for a row-major f32 ``w [n, k]``: four rows share each load of ``x``; a thread
    streams 16 contiguous rows. torch's GEMV reached ~15 GB/s here with 1 or 2 threads, this ~29."""
    n, k = w.shape
    for b in prange((n + 15) // 16):
        r, r1 = b * 16, min(n, b * 16 + 16)
        while r + 4 <= r1:
            a0 = a1 = a2 = a3 = np.float32(0.0)
            w0, w1, w2, w3 = w[r], w[r + 1], w[r + 2], w[r + 3]
            for j in range(k):
                a0 += w0[j] * x[j]
                a1 += w1[j] * x[j]
                a2 += w2[j] * x[j]
                a3 += w3[j] * x[j]
            out[r], out[r + 1], out[r + 2], out[r + 3] = a0, a1, a2, a3
            r += 4
        for rr in range(r, r1):
            a = np.float32(0.0)
            for j in range(k):
                a += w[rr, j] * x[j]
            out[rr] = a
