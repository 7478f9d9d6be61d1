"""Flash-Decoding on the CPU: the pieces every decode-attention core shares (:mod:`.cpu`, :mod:`.cpu_int`).

Compiled tile primitives (scores, online softmax, P.V, the exact merge of Flash-Decoding splits),
the split plan both cores start from (inline helpers, so the cores compile as if written out), and
the Python-level checks of sparse block lists and paged block tables.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit

from ..kv.cache import BLOCK
from .stage import _FM, CODE_Q8, Q4B
from .threads import split_threads

# positions per online-softmax step = the cache block, so sparse decode can pick tiles by block index;
# the scratch K/V tile is TILE*hd*4 bytes (16 KiB at hd 128)
TILE = BLOCK
SERIAL_ROWS = 2048  # below this many (kv_head, position) rows one thread runs it all (~0.1 ms of work)
MIN_SPLIT = 256  # shortest split worth a thread: below it the merge and scheduling cost dominate


@njit(fastmath={"contract"}, cache=True)  # no reassoc: it would fold the two-step ln2 reduction
def exp_inplace(x, n, e_u, e_f):  # pragma: no cover - compiled
    """x[:n] = exp(x[:n]) for x <= 88, vectorized (a libm expf call per score cost ~15 ns here). Cephes
    expf: x = k ln2 + r, degree-6 polynomial in r, times 2^k built in the exponent bits of e_u/e_f
    (one scratch). Max error ~1 ulp; x < -87 gives ~1e-38 instead of 0."""
    for j in range(n):
        xj = max(x[j], np.float32(-87.0))
        k = np.floor(xj * np.float32(1.4426950408889634) + np.float32(0.5))
        r = xj - k * np.float32(0.693359375) + k * np.float32(2.12194440e-4)
        y = np.float32(1.9875691500e-4) * r + np.float32(1.3981999507e-3)
        y = (y * r + np.float32(8.3334519073e-3)) * r + np.float32(4.1665795894e-2)
        y = ((y * r + np.float32(1.6666665459e-1)) * r + np.float32(5.0000001201e-1)) * (r * r)
        x[j] = y + r + np.float32(1.0)
        e_u[j] = np.uint32(np.int32(k) + 127) << np.uint32(23)
    for j in range(n):
        x[j] *= e_f[j]


@njit(fastmath=_FM, cache=True)
def dot_tile(qs, hq0, group, tile, nt, sc):  # pragma: no cover - compiled
    """sc[g, j] = dot(qs[hq0 + g], tile[j]); two query heads x four positions per pass, so each tile
    load feeds two FMAs and each query load four (an odd group's last head: four positions alone)."""
    hd = tile.shape[1]
    n4 = nt - nt % 4
    g2 = group - group % 2
    for j in range(0, n4, 4):
        for g in range(0, g2, 2):
            a, b = qs[hq0 + g], qs[hq0 + g + 1]
            a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = np.float32(0.0)
            for d in range(hd):
                t0, t1, t2, t3 = tile[j, d], tile[j + 1, d], tile[j + 2, d], tile[j + 3, d]
                a0 += a[d] * t0
                a1 += a[d] * t1
                a2 += a[d] * t2
                a3 += a[d] * t3
                b0 += b[d] * t0
                b1 += b[d] * t1
                b2 += b[d] * t2
                b3 += b[d] * t3
            sc[g, j], sc[g, j + 1], sc[g, j + 2], sc[g, j + 3] = a0, a1, a2, a3
            sc[g + 1, j], sc[g + 1, j + 1], sc[g + 1, j + 2], sc[g + 1, j + 3] = b0, b1, b2, b3
        for g in range(g2, group):
            a = qs[hq0 + g]
            a0 = a1 = a2 = a3 = np.float32(0.0)
            for d in range(hd):
                a0 += a[d] * tile[j, d]
                a1 += a[d] * tile[j + 1, d]
                a2 += a[d] * tile[j + 2, d]
                a3 += a[d] * tile[j + 3, d]
            sc[g, j], sc[g, j + 1], sc[g, j + 2], sc[g, j + 3] = a0, a1, a2, a3
    for j in range(n4, nt):
        for g in range(group):
            s = np.float32(0.0)
            for d in range(hd):
                s += qs[hq0 + g, d] * tile[j, d]
            sc[g, j] = s


@njit(fastmath=_FM, cache=True)
def axpy_tile(sc, tile, nt, group, acc):  # pragma: no cover - compiled
    """acc[g] += sum_j sc[g, j] * tile[j]; two heads x four positions per pass: each tile load feeds
    two heads, one acc load/store per four FMAs (an odd group's last head: four positions alone)."""
    hd = tile.shape[1]
    n4 = nt - nt % 4
    g2 = group - group % 2
    for g in range(0, g2, 2):
        a, b = acc[g], acc[g + 1]
        for j in range(0, n4, 4):
            w0, w1, w2, w3 = sc[g, j], sc[g, j + 1], sc[g, j + 2], sc[g, j + 3]
            u0, u1, u2, u3 = sc[g + 1, j], sc[g + 1, j + 1], sc[g + 1, j + 2], sc[g + 1, j + 3]
            for d in range(hd):
                t0, t1, t2, t3 = tile[j, d], tile[j + 1, d], tile[j + 2, d], tile[j + 3, d]
                a[d] += w0 * t0 + w1 * t1 + w2 * t2 + w3 * t3
                b[d] += u0 * t0 + u1 * t1 + u2 * t2 + u3 * t3
    for g in range(g2, group):
        a = acc[g]
        for j in range(0, n4, 4):
            w0, w1, w2, w3 = sc[g, j], sc[g, j + 1], sc[g, j + 2], sc[g, j + 3]
            for d in range(hd):
                a[d] += w0 * tile[j, d] + w1 * tile[j + 1, d] + w2 * tile[j + 2, d] + w3 * tile[j + 3, d]
    for g in range(group):
        for j in range(n4, nt):
            w = sc[g, j]
            for d in range(hd):
                acc[g, d] += w * tile[j, d]


# The running max moves only when a tile's max exceeds it by more than this (in score units): weights
# e^(s - m) then stay <= e^8 ~ 3e3 (no f32 overflow, l <= n e^8), and most tiles skip the rescale of
# acc and l and its exp. Exact: acc and l always share the same reference m (FlashAttention-3's trick).
LAZY_MAX = np.float32(8.0)


@njit(fastmath=_FM, cache=True)
def softmax_tile(sc, nt, group, m, lsum, acc, v_scale, v_q8, h, t0, e_u, e_f):  # pragma: no cover
    """Online-softmax step over a tile: update (m, l), rescale acc when m moves, leave the weights in
    sc (times the row's max_abs/127 for an int8 V, so V is never dequantized)."""
    hd = acc.shape[1]
    for g in range(group):
        row = sc[g]
        m_tile = row[0]
        for j in range(1, nt):
            m_tile = max(m_tile, row[j])
        if m_tile > m[g] + LAZY_MAX:  # first tile (m = -inf) or a much larger score: move m
            alpha = np.float32(math.exp(m[g] - m_tile))  # exp(-inf) = 0 on the first tile
            for d in range(hd):
                acc[g, d] *= alpha
            lsum[g] *= alpha
            m[g] = m_tile
        m_g = m[g]
        for j in range(nt):
            row[j] -= m_g
        exp_inplace(row, nt, e_u, e_f)
        ps = np.float32(0.0)
        for j in range(nt):
            ps += row[j]
        lsum[g] += ps
        if v_q8:
            for j in range(nt):
                row[j] *= v_scale[h, t0 + j] * np.float32(1.0 / 127.0)


@njit(fastmath=_FM, cache=True)
def merge(part_acc, part_m, part_l, n_splits, group, out):  # pragma: no cover - compiled
    """Exact log-sum-exp merge: out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s."""
    n_heads, hd = out.shape
    for hq in range(n_heads):
        h, g = hq // group, hq % group
        mx = np.float32(-np.inf)
        for s in range(n_splits):
            mx = max(mx, part_m[h * n_splits + s, g])
        den = np.float32(0.0)
        out[hq, :] = 0.0
        for s in range(n_splits):
            it = h * n_splits + s
            if part_l[it, g] == 0.0:
                continue  # empty split (more splits than positions)
            c = np.float32(math.exp(part_m[it, g] - mx))
            den += c * part_l[it, g]
            for d in range(hd):
                out[hq, d] += c * part_acc[it, g, d]
        inv = np.float32(1.0) / den
        for d in range(hd):
            out[hq, d] *= inv


@njit(inline="always")
def start_splits(length, tiles, table, n_splits, k, out, sink):  # pragma: no cover - compiled
    """The (kv_head, split) items of a core call over the K store ``k [n_kv, cap, ...]`` for the output
    ``out [n_heads, hd]``, and their partial (acc, m, l) arrays, each KV head's first split seeded
    with the sink's softmax state (:func:`seed_sink`).

    ``tiles [n_kv, n_tiles]``: the tiles each KV head attends (empty = dense, every tile); ``table``:
    a paged cache's block table (empty = contiguous). Returns ``(group, dense, paged, n_tiles,
    split_len, n_items, part_acc, part_m, part_l)``."""
    n_kv = k.shape[0]
    n_heads, hd = out.shape
    group = n_heads // n_kv
    dense = tiles.shape[1] == 0
    paged = table.shape[0] > 0
    n_tiles = (length + TILE - 1) // TILE if dense else tiles.shape[1]
    split_len = (n_tiles + n_splits - 1) // n_splits
    n_items = n_kv * n_splits
    part_acc = np.zeros((n_items, group, hd), np.float32)
    part_m = np.full((n_items, group), -np.inf, np.float32)
    part_l = np.zeros((n_items, group), np.float32)
    seed_sink(sink, part_acc, part_m, part_l, n_splits, group, dense, tiles)
    return group, dense, paged, n_tiles, split_len, n_items, part_acc, part_m, part_l


@njit(inline="always")
def item_setup(item, n_splits, split_len, n_tiles, group, hd):  # pragma: no cover - compiled
    """An item's KV head ``h``, its tile range ``[i_lo, i_hi)`` and its scratch: an L1-resident f32
    tile (``tile_u``: its bits; K then V), the scores, the exp scratch, and a 4-bit tile's block
    scales as f32 (``bs_u``: their bits). Returns ``(h, i_lo, i_hi, tile_u, tile, sc, e_u, e_f, bs_u,
    bs_f)``."""
    i_lo = (item % n_splits) * split_len
    tile_u = np.empty((TILE, hd), np.uint32)
    sc = np.empty((group, TILE), np.float32)
    e_u = np.empty(TILE, np.uint32)
    bs_u = np.empty(TILE * (hd // Q4B) + 1, np.uint32)
    return (
        item // n_splits, i_lo, min(n_tiles, i_lo + split_len),
        tile_u, tile_u.view(np.float32), sc, e_u, e_u.view(np.float32), bs_u, bs_u.view(np.float32),
    )  # fmt: skip


@njit(inline="always")
def tile_rows(ti, h, length, dense, tiles, paged, table, first):  # pragma: no cover - compiled
    """Tile ``ti`` of KV head ``h``: its row count and the store row where it starts. Positions below
    ``first`` (a sink read from its own store: :func:`seed_sink`) are left out, so a tile that holds
    only those has no rows (<= 0: the caller skips it)."""
    t_log = ti if dense else tiles[h, ti]
    lo = max(first - t_log * TILE, 0)
    return min(TILE, length - t_log * TILE) - lo, (table[t_log] if paged else t_log) * TILE + lo


@njit(inline="always")
def seed_sink(sink, part_acc, part_m, part_l, n_splits, group, dense, tiles):  # pragma: no cover - compiled
    """Start the first split of each KV head from the softmax state of the sink ``sink = (first, qs,
    k, v)``: the scaled float query ``[n_heads, hd]`` over the sink rows ``[n_kv, first, hd]`` (f32,
    the stores' basis), computed here in float64 (m, l, acc per query head; the torch form:
    :func:`kvlens.kernels.reference.sink_state`). A sparse KV head whose tiles leave out tile 0 does
    not see the sink, as the torch path's block mask does not. No sink: no rows (``first`` is 0, or
    a sliding window's first position: :func:`sink_args`)."""
    _, qs, sk, sv = sink
    first = sk.shape[1]  # a sliding window's tuple skips positions below its first but has no rows
    if first == 0:
        return
    hd = sk.shape[2]
    sc = np.empty(first, np.float64)
    acc = np.empty(hd, np.float64)
    for h in range(part_m.shape[0] // n_splits):
        seen = dense
        for j in range(0 if dense else tiles.shape[1]):
            seen = seen or tiles[h, j] == 0
        if not seen:
            continue
        it = h * n_splits
        for g in range(group):
            hq = h * group + g
            m = -np.inf
            for j in range(first):
                s = 0.0
                for d in range(hd):
                    s += np.float64(qs[hq, d]) * np.float64(sk[h, j, d])
                sc[j] = s
                m = max(m, s)
            lsum = 0.0
            acc[:] = 0.0
            for j in range(first):
                w = math.exp(sc[j] - m)
                lsum += w
                for d in range(hd):
                    acc[d] += w * np.float64(sv[h, j, d])
            part_m[it, g], part_l[it, g] = np.float32(m), np.float32(lsum)
            for d in range(hd):
                part_acc[it, g, d] = np.float32(acc[d])


@njit(inline="always")
def weigh_tile(
    sc, nt, group, k_scale, k_code, item, part_m, part_l, part_acc, v_scale, v_code, h, t0, e_u, e_f
):  # pragma: no cover
    """Scores to weights: fold an int8 K row scale (max_abs / 127) into the tile's scores, then the
    online-softmax step of the item (:func:`softmax_tile`; an int8 V's row scale goes into the weights)."""
    v_q8 = v_code == CODE_Q8
    if k_code == CODE_Q8:
        for g in range(group):
            for j in range(nt):
                sc[g, j] *= k_scale[h, t0 + j] * np.float32(1.0 / 127.0)
    softmax_tile(sc, nt, group, part_m[item], part_l[item], part_acc[item], v_scale, v_q8, h, t0, e_u, e_f)


_NO_ROWS = np.zeros((0, 0, 0), np.float32)
NO_SINK = (0, np.zeros((0, 0), np.float32), _NO_ROWS, _NO_ROWS)


def sink_args(qs: np.ndarray, sink, first: int = 0) -> tuple:
    """A core's ``sink`` argument: ``(first, qs, k, v)`` with the sink rows ``sink = (k, v)`` as
    contiguous float32 numpy (zero-copy for the cache's rows), or :data:`NO_SINK` for None. Without
    a sink, ``first``: a sliding window's first position (``reference.sliding_window``), the rows
    below it left out and nothing seeded."""
    if sink is None:
        return NO_SINK if first == 0 else (int(first), NO_SINK[1], _NO_ROWS, _NO_ROWS)
    k, v = (
        np.ascontiguousarray(
            x.detach().to(torch.float32).numpy() if isinstance(x, torch.Tensor) else x, np.float32
        )
        for x in sink
    )
    n_kv, n, hd = k.shape
    if v.shape != k.shape or qs.shape[1] != hd or qs.shape[0] % n_kv or n == 0:
        raise ValueError(
            f"sink rows must be [n_kv, s>0, {qs.shape[1]}] for K and V, got {k.shape} and {v.shape}"
        )
    return n, np.ascontiguousarray(qs, np.float32), k, v


def choose_splits(length: int, n_kv: int, n_threads: int | None = None) -> int:
    """Splits per KV head: enough (kv_head, split) items to keep every thread busy, none tiny."""
    n_threads = n_threads or split_threads()
    want = max(1, -(-2 * n_threads // n_kv))  # ~2 items per thread evens out ragged last splits
    return max(1, min(want, length // MIN_SPLIT))


_DENSE = np.zeros((1, 0), np.int32)  # the core's "every tile" table
_CONTIGUOUS = np.zeros(0, np.int32)  # the core's "no block table" (logical block = physical block)


def _tile_table(n_kv: int, length: int, blocks: np.ndarray | None) -> np.ndarray:
    """Tiles each KV head attends: the given sparse blocks, or :data:`_DENSE` (all of them)."""
    if blocks is None:
        return _DENSE
    blocks = np.ascontiguousarray(blocks, np.int32)
    if blocks.ndim != 2 or blocks.shape[0] != n_kv or blocks.shape[1] == 0:
        raise ValueError(f"blocks must be [n_kv={n_kv}, n_selected>0], got {blocks.shape}")
    if blocks.min() < 0 or blocks.max() * TILE >= length:
        raise ValueError(f"a selected block lies outside the {length} cached positions")
    return blocks


def _block_table(table: np.ndarray | None, length: int, cap: int) -> np.ndarray:
    """A paged cache's block table as the core takes it (:data:`_CONTIGUOUS` when there is none)."""
    if table is None:
        if not 1 <= length <= cap:
            raise ValueError(f"length {length} outside [1, cap={cap}]")
        return _CONTIGUOUS
    table = np.ascontiguousarray(table, np.int32)
    if table.ndim != 1 or not 1 <= length <= table.shape[0] * TILE:
        raise ValueError(f"length {length} outside the {table.shape[0]} blocks of the block table")
    used = table[: -(-length // TILE)]
    if used.min() < 0 or (int(used.max()) + 1) * TILE > cap:
        raise ValueError(f"a block table entry lies outside the store's {cap // TILE} blocks")
    return table


def plan_call(
    n_kv: int, cap: int, length: int, blocks, table, n_splits: int | None, n_threads: int
) -> tuple[np.ndarray, np.ndarray, bool, int]:
    """The Python-side plan of a core call: ``(tiles, table, serial, n_splits)`` from the sparse
    ``blocks`` and paged ``table`` (numpy or torch, or None) and the threads the splits are cut for;
    ``serial``: small enough that one thread runs it all."""
    table = _block_table(None if table is None else np.asarray(table), length, cap)
    tiles = _tile_table(n_kv, length, None if blocks is None else np.asarray(blocks))
    rows = tiles.shape[1] * TILE if blocks is not None else length  # positions each KV head reads
    serial = n_kv * rows < SERIAL_ROWS
    if n_splits is None:
        n_splits = 1 if serial else choose_splits(rows, n_kv, n_threads)
    return tiles, table, serial, max(1, int(n_splits))
