"""Fused decode attention on the CPU (numba): one new query token, all heads of one layer.

The kernels read the cache exactly as :mod:`kvlens.kv.cache` stores it (``data [n_kv, cap, hd]``,
``scale [n_kv, cap]`` = fp32 ``max_abs`` for int8 rows) and never build a dequantized K or V:

* the K scale is folded into the score: ``s = dot(q, k_int8) * (k_max_abs / 127) / sqrt(hd)``;
* the V scale is folded into the softmax weight: ``acc += (p * v_max_abs / 127) * v_int8``;
* 4-bit rows (q4, q4h: packed code pairs, an fp16 scale per block of 32) are unpacked and scaled
  per tile into the same f32 scratch the other kinds use (the block scale varies along the row, so
  it cannot be folded into one score or weight);
* packed N-bit rows (q7h, q6h, q5h) are extracted from their bytes and scaled by ``max_abs / qmax``
  per tile into that scratch too (:func:`.stage._stage_packed`);
* rotated kinds (q8h, q4h) are read as stored: the caller rotates the query and the output
  (:func:`kvlens.kv.cache.rotations`);
* the softmax is online (running max ``m``, running sum ``l``, rescale when ``m`` grows), one
  pass over K and V, tile by tile (TILE positions, converted to f32 in an L1-resident scratch);
* one pass over a KV head serves all query heads of its GQA group (each K/V row is loaded once);
* the sequence is split (Flash-Decoding): ``prange`` over (kv_head, split) pairs, each split keeps
  ``(m, l, partial acc)``, merged exactly afterwards with the log-sum-exp rule.

Every storage kind runs through one compiled kernel: rows arrive as raw bytes and are converted to
f32 per tile (int8 -> f32; bf16: ``bits << 16``; f16: an exact bit conversion, numba having no
float16 arrays). So f32, f16, bf16, q8 and the mixed modes (q8-k, q8-v) all run fused.

Threads: how many, and when one alone runs a small call, is decided in :mod:`.threads` (which also
sets the OpenMP wait policy when kvlens is imported; docs/decode.md, "Steady speed").
"""

from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit, prange

from ..kv.modes import StoreKind
from ..kv.quant import quantize_q8
from . import flash
from .flash import TILE, choose_splits  # noqa: F401 - choose_splits: part of this module's API
from .reference import sliding_window
from .stage import _FM, _KIND_CODE, CODE_PACKED, CODE_Q4, CODE_Q8, Q4B, _stage
from .threads import run_serial_if, split_threads

QBLOCK = 32  # query block of the int-dot variant (the seed: 32 values, one scale)


@njit(fastmath=_FM, cache=True)
def _dot_tile_int(q8, qsc, hq0, group, k, h, t0, nt, prod, sc):  # pragma: no cover - compiled
    """The seed's integer dot: per 32-block int32 sum of q8 * k8, times the block's query scale. An int32
    product pass then block sums: the only form LLVM vectorized (numba types the fused loop int64)."""
    hd = k.shape[2]
    for g in range(group):
        hq = hq0 + g
        for j in range(nt):
            for d in range(hd):
                prod[d] = np.int32(q8[hq, d]) * np.int32(k[h, t0 + j, d])
            s = np.float32(0.0)
            for b in range(hd // QBLOCK):
                acc = np.int32(0)
                for d in range(b * QBLOCK, (b + 1) * QBLOCK):
                    acc += prod[d]
                s += np.float32(acc) * qsc[hq, b]
            sc[g, j] = s


@njit(parallel=True, fastmath=_FM, cache=True)
def _decode_core(
    qs,
    q8,
    qsc,
    int_dot,
    k,
    k_code,
    k_scale,
    k_bsc,
    v,
    v_code,
    v_scale,
    v_bsc,
    length,
    tiles,
    table,
    n_splits,
    out,
    sink,
):  # pragma: no cover
    """Flash-Decoding over (kv_head, split) items; ``int_dot`` selects the seed's int8-query scores.

    ``tiles [n_kv, n_tiles]``: the TILE-position tiles each KV head attends (sparse decode: the
    selected blocks); empty (``n_tiles = 0``) = dense, every tile. Splits divide this list.
    ``table [n_blocks]``: the block table of a paged cache (logical block j lives in physical block
    ``table[j]`` of the store); empty = contiguous (logical = physical). ``k_bsc``/``v_bsc``: the
    fp16 scale bits of a 4-bit or packed K/V store (unread otherwise). ``sink``: the query and the
    sink positions' rows, read from their own store (:func:`flash.sink_args`, :func:`flash.seed_sink`)."""
    hd = out.shape[1]
    k8 = k.view(np.int8)
    group, dense, paged, n_tiles, split_len, n_items, part_acc, part_m, part_l = flash.start_splits(
        length, tiles, table, n_splits, k, out, sink
    )
    for item in prange(n_items):
        h, i_lo, i_hi, tile_u, tile, sc, e_u, e_f, bs_u, bs_f = flash.item_setup(
            item, n_splits, split_len, n_tiles, group, hd
        )
        prod = np.empty(hd, np.int32)
        for ti in range(i_lo, i_hi):
            nt, t0 = flash.tile_rows(ti, h, length, dense, tiles, paged, table, sink[0])
            if nt <= 0:
                continue
            if int_dot:
                _dot_tile_int(q8, qsc, h * group, group, k8, h, t0, nt, prod, sc)
            else:
                _stage(k, k_code, k_bsc, h, t0, nt, tile_u, tile, bs_u, bs_f)
                flash.dot_tile(qs, h * group, group, tile, nt, sc)
            flash.weigh_tile(sc, nt, group, k_scale, k_code, item, part_m, part_l, part_acc, v_scale, v_code, h, t0,
                             e_u, e_f)  # fmt: skip
            _stage(v, v_code, v_bsc, h, t0, nt, tile_u, tile, bs_u, bs_f)
            flash.axpy_tile(sc, tile, nt, group, part_acc[item])
    flash.merge(part_acc, part_m, part_l, n_splits, group, out)


def quantize_query_blocks(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The seed's query quantization for the int-dot kernel: int8 per block of 32, by the KV rule.

    Returns ``(q8 [n_heads, hd] int8, max_abs [n_heads, hd // 32] f32)``; ``q8 * max_abs/127`` is the
    query the int-dot kernel actually uses (so it is *not* exact, unlike the other kernels).
    """
    n_heads, hd = q.shape
    if hd % QBLOCK:
        raise ValueError(f"int-dot kernel needs head_dim divisible by {QBLOCK}, got {hd}")
    q8, max_abs = quantize_q8(torch.from_numpy(np.ascontiguousarray(q, np.float32)).view(n_heads, -1, QBLOCK))
    return q8.view(n_heads, hd).numpy(), max_abs.numpy()


_NO_SCALE = np.ones((1, 1), np.float32)
_NO_BLOCK_SCALE = np.ones((1, 1, 1), np.uint16)
_NO_Q8 = np.zeros((1, 1), np.int8)
_ROW_BYTES_PER_VALUE = {_KIND_CODE[kind]: kind.row_width(8) * kind.dtype.itemsize / 8 for kind in StoreKind}


def _run(
    q, k, k_code, k_scale, v, v_code, v_scale, length, out, n_splits, int_dot=False, blocks=None, table=None,
    k_bsc=_NO_BLOCK_SCALE, v_bsc=_NO_BLOCK_SCALE, sink=None, first=0,
):  # fmt: skip
    n_heads, hd = q.shape
    n_kv, cap = k.shape[:2]
    if n_heads % n_kv or v.shape[:2] != (n_kv, cap) or out.shape != q.shape:
        raise ValueError(f"shape mismatch: q {q.shape}, k {k.shape}, v {v.shape}, out {out.shape}")
    if k.shape[2] != hd * _ROW_BYTES_PER_VALUE[k_code] or v.shape[2] != hd * _ROW_BYTES_PER_VALUE[v_code]:
        raise ValueError(f"head_dim mismatch: q has {hd}")
    for code, bsc in ((k_code, k_bsc), (v_code, v_bsc)):
        if code == CODE_Q4 or code > CODE_PACKED:
            per_row = hd // Q4B if code == CODE_Q4 else 1
            if bsc.shape != (n_kv, cap, per_row) or bsc.dtype != np.uint16:
                raise ValueError(f"fp16 scales must be uint16 bits [n_kv, cap, {per_row}], got {bsc.shape}")
    if out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError("out must be a C-contiguous float32 array")
    # split_threads, not the step's count: the splits, hence the sums, never vary with load
    tiles, table, serial, n_splits = flash.plan_call(
        n_kv, cap, length, blocks, table, n_splits, split_threads()
    )
    qs = np.ascontiguousarray(q, np.float32) * np.float32(1.0 / math.sqrt(hd))  # 1/sqrt(d) once, in q
    q8, qsc = _NO_Q8, _NO_SCALE
    if int_dot:
        q8, q_max = quantize_query_blocks(q)
        qsc = q_max * np.float32(1.0 / (127.0 * math.sqrt(hd)))
    if k_scale.dtype != np.float32 or not k_scale.flags.c_contiguous:
        k_scale = np.ascontiguousarray(k_scale, np.float32)
    if v_scale.dtype != np.float32 or not v_scale.flags.c_contiguous:
        v_scale = np.ascontiguousarray(v_scale, np.float32)
    args = (
        qs, q8, qsc, int_dot, k, k_code, k_scale, k_bsc, v, v_code, v_scale, v_bsc, int(length), tiles, table,
        n_splits, out, flash.sink_args(qs, sink, first),
    )  # fmt: skip
    run_serial_if(serial, _decode_core, *args)  # waking the thread pool would cost more than the work
    return out


def store_arrays(store) -> tuple[np.ndarray, int, np.ndarray, np.ndarray]:
    """Zero-copy numpy views of a RowStore: (row bytes, storage code, row scales, block-scale bits),
    memoized on the store for as long as its tensors are the same objects (a cache that grows gets
    new ones)."""
    memo = store.__dict__.get("_numba_views")
    if memo is not None and memo[0] is store.data and memo[1] is store.scale:
        return memo[2]
    raw = store.data.view(torch.uint8).numpy()  # bf16 too: numpy has no bfloat16, the kernel shifts bits
    scale = store.scale.numpy() if store.kind.int8 else _NO_SCALE
    # fp16 scales as their bits (numba has no float16 arrays, the kernel converts them exactly): a
    # 4-bit store's per block of 32, a packed store's max_abs per row as [n_kv, cap, 1]
    bsc = _NO_BLOCK_SCALE
    if store.kind.int4 or store.kind.packed:
        bsc = store.scale.view(torch.int16).numpy().view(np.uint16)
        bsc = bsc if store.kind.int4 else bsc[:, :, None]
    views = (raw, _KIND_CODE[store.kind], scale, bsc)
    store.__dict__["_numba_views"] = (store.data, store.scale, views)
    return views


def decode_attention(
    q: torch.Tensor,
    k_store,
    v_store,
    length: int,
    n_splits: int | None = None,
    int_dot: bool = False,
    blocks: np.ndarray | torch.Tensor | None = None,
    table: np.ndarray | torch.Tensor | None = None,
    sink: tuple[torch.Tensor, torch.Tensor] | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Decode attention of ``q [n_heads, hd]`` over the first ``length`` rows of one layer's K and V
    :class:`~kvlens.kv.cache.RowStore` (CPU; every kind, mixed K/V kinds included; rotated kinds are
    read as stored, so ``q`` must be in K's stored basis and the result is in V's).

    Returns a new float32 ``[n_heads, hd]`` tensor. ``int_dot`` picks the seed's int8-query variant
    (K must be q8). ``n_splits`` defaults to :func:`choose_splits`. ``blocks [n_kv, n_sel]`` (block
    indices of TILE = 32 positions, per KV head) restricts attention to those blocks (sparse decode:
    the kernel reads only them, no gather copy; the softmax runs over the selected set).
    ``table [n_blocks]`` (int32): a paged cache's block table, logical block j of the sequence stored
    at physical block ``table[j]`` of the stores (``blocks`` then name logical blocks); read in place.
    ``sink``: K and V of the first s positions ``[n_kv, s, hd]`` (f32, the stores' basis;
    :meth:`kvlens.kv.cache.KVCache.sink_rows`), read in place of the stores' rows there.
    ``window``: a sliding window, the last ``window`` positions attended, read in place
    (:func:`kvlens.kernels.reference.sliding_window`; not with ``blocks`` or ``sink`` once reached).
    """
    k, kc, ks, kb = store_arrays(k_store)
    v, vc, vs, vb = store_arrays(v_store)
    blocks, first = sliding_window(k.shape[0], length, window, blocks, sink, flash.TILE)
    if int_dot and kc != CODE_Q8:
        raise ValueError("int_dot needs an int8 K store")
    qn = q.detach().numpy() if q.dtype == torch.float32 else q.detach().float().numpy()
    out = np.empty(qn.shape, np.float32)
    _run(qn, k, kc, ks, v, vc, vs, length, out, n_splits, int_dot, blocks, table, kb, vb, sink, first)
    return torch.from_numpy(out)
