"""JIT (numba) CPU kernels of the kept-quantized linear layers (:mod:`.qlinear` holds the formats).

Weights are blocked ``[n_tiles, rows, TILE]``: each tile of TILE output rows is one contiguous
stream, read front to back by one thread; the inner loop runs over the tile's output columns
(convert a row of codes to f32, ``axpy`` it into the accumulators), which LLVM vectorizes.

* ``_mv_*``: up to qlinear.SMALL_M rows, x [m, k] f32, out [m, n]: independent rows (a batch of
  sequences, or a short prefill chunk), each computed exactly as alone;
* ``_deq_*``: dequantize tiles to f32 for torch's GEMM (prefill).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .bits import bf16_f32, int8_f32

G = 32  # inputs per quantization group
_FM = {"reassoc", "contract", "nsz"}  # reassoc/contract: vectorized FMA accumulation


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


@njit(inline="always")
def _fma4_row(dst, w, xa, xb, xc, xd):  # pragma: no cover - compiled
    """dst += w[0] xa + w[1] xb + w[2] xc + w[3] xd: one load/store of ``dst`` feeds four FMAs."""
    wa, wb, wc, wd = w[0], w[1], w[2], w[3]
    for i in range(dst.shape[0]):
        dst[i] += (wa[i] * xa + wb[i] * xb) + (wc[i] * xc + wd[i] * xd)


@njit(inline="always")
def _accumulate_rows(x, qt, j, j1, w, dst, to_f32):  # pragma: no cover - compiled
    """dst[r] += sum over weight rows jj in [j, j1) of to_f32(qt[jj]) * x[r, jj], for every input row
    r: four weight rows converted into the scratch ``w [4, T]`` per pass, then applied to each row."""
    m, T = dst.shape
    while j + 4 <= j1:
        for i in range(T):
            w[0, i] = to_f32(qt[j, i])
            w[1, i] = to_f32(qt[j + 1, i])
            w[2, i] = to_f32(qt[j + 2, i])
            w[3, i] = to_f32(qt[j + 3, i])
        for r in range(m):
            _fma4_row(dst[r], w, x[r, j], x[r, j + 1], x[r, j + 2], x[r, j + 3])
        j += 4
    for jj in range(j, j1):
        wa = w[0]
        for i in range(T):
            wa[i] = to_f32(qt[jj, i])
        for r in range(m):
            xa, dr = x[r, jj], dst[r]
            for i in range(T):
                dr[i] += wa[i] * xa


@njit(inline="always")
def _tile_scratch(m, T):  # pragma: no cover - compiled
    """A tile's accumulators ``acc [m, T]`` (zeros), group partial sums ``part [m, T]`` and the
    converted weight rows ``w [4, T]``."""
    return np.zeros((m, T), np.float32), np.empty((m, T), np.float32), np.empty((4, T), np.float32)


# -- decode rows: x [m, k], out [m, n], each row computed exactly as it would be alone --------------
# The rows are independent sequences (a decode batch): every weight row is converted to f32 once per
# tile into scratch and then applied to each input row in turn by the same instructions, so a row's
# sums run in the same order whatever m is (batch invariance; a 1-row call is m = 1 of the same
# kernel). Four weight rows per pass over the accumulator: one load/store of ``part`` feeds four FMAs
# (one per row was load/store-bound: 1.7x slower).
@njit(parallel=True, fastmath=_FM, cache=True)
def _mv_int8(x, q, s, out):  # pragma: no cover - compiled
    m, k = x.shape
    n_tiles, _, T = q.shape
    for t in prange(n_tiles):
        acc, part, w = _tile_scratch(m, T)
        qt, st = q[t], s[t]
        for g in range(st.shape[0]):
            part[:] = 0
            _accumulate_rows(x, qt, g * G, min(k, g * G + G), w, part, int8_f32)
            sg = st[g]
            for r in range(m):
                ar, pr = acc[r], part[r]
                for i in range(T):
                    ar[i] += pr[i] * sg[i]
        _store(acc, out, t * T)


@njit(parallel=True, fastmath=_FM, cache=True)
def _mv_int4(x, q, s, mn, out):  # pragma: no cover - compiled
    """Two packed rows (four inputs) per pass; x has even length (see Int4Linear._kernel).

    The nibbles stay in float arithmetic: with f = the byte as f32 (exact), hi = floor(f / 16) and
    lo = f - 16 hi, so lo x0 + hi x1 = f x0 + hi (x1 - 16 x0): per byte a convert and a multiply-round
    once for all rows, then two FMAs per row. Integer masks and shifts were 1.75x slower: numba widens
    uint8 arithmetic to int64."""
    m = x.shape[0]
    k2 = x.shape[1] // 2
    n_tiles, _, T = q.shape
    ng = s.shape[1]
    xs = np.zeros((m, ng), np.float32)  # per-group input sums carry the min term: Σ min·x = min·Σx
    for r in range(m):
        for j in range(x.shape[1]):
            xs[r, j // G] += x[r, j]
    sixteenth, sixteen = np.float32(0.0625), np.float32(16.0)
    for t in prange(n_tiles):
        acc, part, w = _tile_scratch(m, T)
        qt, st, mt = q[t], s[t], mn[t]
        for g in range(ng):
            part[:] = 0
            j2, j1 = g * (G // 2), min(k2, (g + 1) * (G // 2))
            while j2 + 2 <= j1:
                for i in range(T):
                    fa, fb = np.float32(qt[j2, i]), np.float32(qt[j2 + 1, i])
                    w[0, i], w[1, i] = fa, np.floor(fa * sixteenth)
                    w[2, i], w[3, i] = fb, np.floor(fb * sixteenth)
                for r in range(m):
                    x0, x2 = x[r, 2 * j2], x[r, 2 * j2 + 2]
                    _fma4_row(
                        part[r], w, x0, x[r, 2 * j2 + 1] - sixteen * x0, x2, x[r, 2 * j2 + 3] - sixteen * x2
                    )
                j2 += 2
            for jj in range(j2, j1):
                fa, ha = w[0], w[1]
                for i in range(T):
                    fa[i] = np.float32(qt[jj, i])
                    ha[i] = np.floor(fa[i] * sixteenth)
                for r in range(m):
                    x0, pr = x[r, 2 * jj], part[r]
                    ca = x[r, 2 * jj + 1] - sixteen * x0
                    for i in range(T):
                        pr[i] += fa[i] * x0 + ha[i] * ca
            sg, mg = st[g], mt[g]
            for r in range(m):
                ar, pr, xg = acc[r], part[r], xs[r, g]
                for i in range(T):
                    ar[i] += pr[i] * sg[i] + mg[i] * xg
        _store(acc, out, t * T)


@njit(parallel=True, fastmath=_FM, cache=True)
def _mv_bf16(x, q, out):  # pragma: no cover - compiled
    T = q.shape[2]
    for t in prange(q.shape[0]):
        acc = np.zeros((x.shape[0], T), np.float32)
        _accumulate_rows(x, q[t], 0, x.shape[1], np.empty((4, T), np.float32), acc, bf16_f32)
        _store(acc, out, t * T)


@njit(parallel=True, fastmath=_FM, cache=True)
def _mv_f32(w, x, out):  # pragma: no cover - compiled
    """``out = x @ w.T`` for a row-major f32 ``w [n, k]`` and decode rows ``x [m, k]``: four weight rows
    share each load of an input row; a thread streams 16 contiguous weight rows, applied to every input
    row in turn (each row's sums the same whatever m). torch's GEMV reached ~15 GB/s here with 1 or 2
    threads, this ~29."""
    n, k = w.shape
    m = x.shape[0]
    for b in prange((n + 15) // 16):
        r0, r1 = b * 16, min(n, b * 16 + 16)
        for i in range(m):
            xi, oi = x[i], out[i]
            r = r0
            while r + 4 <= r1:
                a0 = a1 = a2 = a3 = np.float32(0.0)
                w0, w1, w2, w3 = w[r], w[r + 1], w[r + 2], w[r + 3]
                for j in range(k):
                    a0 += w0[j] * xi[j]
                    a1 += w1[j] * xi[j]
                    a2 += w2[j] * xi[j]
                    a3 += w3[j] * xi[j]
                oi[r], oi[r + 1], oi[r + 2], oi[r + 3] = a0, a1, a2, a3
                r += 4
            for rr in range(r, r1):
                a = np.float32(0.0)
                for j in range(k):
                    a += w[rr, j] * xi[j]
                oi[rr] = a
