"""Integer-score decode attention on the CPU: the :mod:`kvlens.kernels.cpu` kernel with the Q·K scores
computed as integer dot products by the CPU's own instructions (:mod:`kvlens.kernels.intdot`).

The query is quantized once per call, then every K row is read as its int8 codes:

* ``qbits=8``: int8 per block of 32 values (the seed's rule, one scale per block). VNNI paths
  shift it by +128 (``vpdpbusd`` is u8 x i8) and subtract ``128 * sum_b s_b * ksum_b`` — ``ksum``
  being the K store's per-block code sums, written with the codes — so the integer part is exact.
* ``qbits=16``: int16 with one scale per query head (error ~1/258 of the 8-bit query's per value).

The K row scale is folded into the score, then softmax and P·V run as in the float kernel (same
online softmax, V scale folded into the weights, Flash-Decoding splits and exact merge). Only the
scores are integer; P·V stays f32 unless ``pv8`` (weights as u8 per tile, exact int32 sums).

A kernel family: one compiled core per path — a compile-time constant of the same source, cached
on disk (``qbits`` and ``pv8`` are read at run time) — built on first use: a path whose instructions
the CPU lacks is never compiled (LLVM would fail with "Cannot select").
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch
from numba import literally, njit, prange, types

from ..kv.modes import StoreKind
from . import flash, intdot, q4int
from .cpu import quantize_query_blocks, store_arrays
from .q4int import lane_offsets, lane_scales, permute_query
from .q8store import KSUM_BLOCK
from .reference import sliding_window
from .stage import CODE_Q4, _stage
from .threads import run_serial_if, split_threads

PATH_ENV = "KVLENS_INT_PATH"  # forces the CPU path of the integer kernels (vnni512|vnni256|avx2|portable)
Q16_MAX = 32767.0
BACKEND_QBITS = {"numba-int": 8, "numba-int16": 16}  # attention backend name -> query bits
PV8_SUFFIX = "+pv8"  # backend name suffix: integer P.V too (u8 weights per tile x int8 V codes)
_FM = {"reassoc", "contract", "nsz"}


@dataclass(frozen=True)
class IntAttn:
    """Which integer kernel: query bits (8 or 16) and CPU path (``None``: the host's best)."""

    qbits: int = 8
    path: str | None = None
    pv8: bool = False  # P.V in integers too: each tile's weights as u8 (scale per tile, query head)

    def __post_init__(self) -> None:
        if self.qbits not in (8, 16):
            raise ValueError(f"integer attention query bits must be 8 or 16, got {self.qbits}")
        if self.path is not None and self.path not in intdot.PATHS:
            raise ValueError(
                f"unknown integer attention path {self.path!r}; choose one of: {', '.join(intdot.PATHS)}"
            )

    @classmethod
    def parse(cls, backend: str) -> IntAttn | None:
        """``numba-int`` (8-bit query) / ``numba-int16``, optionally ``+pv8`` and ``:PATH``; None for
        another name."""
        name, _, path = backend.partition(":")
        pv8 = name.endswith(PV8_SUFFIX)
        name = name.removesuffix(PV8_SUFFIX)
        if name not in BACKEND_QBITS:
            return None
        return cls(BACKEND_QBITS[name], path or None, pv8)

    def scores(self, k_kind: StoreKind | None) -> bool:
        """Whether this kernel scores a K store of ``k_kind``: int8, or 4-bit with the 8-bit query
        (scalar P.V); None (a layer split per KV head into different kinds) is not."""
        return k_kind is not None and (k_kind.int8 or k_kind.int4 and self.qbits == 8 and not self.pv8)

    @property
    def backend(self) -> str:
        name = next(n for n, b in BACKEND_QBITS.items() if b == self.qbits) + PV8_SUFFIX * self.pv8
        return f"{name}:{self.path}" if self.path else name

    def resolved_path(self, features: dict[str, bool] | set[str] | frozenset[str] | None = None) -> str:
        """The path to run: this one, else ``$KVLENS_INT_PATH``, else the best the CPU supports.
        Raises ValueError for a forced path the CPU cannot run."""
        feats = intdot.host_features() if features is None else features
        path = self.path or os.environ.get(PATH_ENV) or intdot.choose_path(feats)
        if path not in intdot.PATHS:
            raise ValueError(f"{PATH_ENV}={path!r}: choose one of: {', '.join(intdot.PATHS)}")
        if not intdot.path_supported(path, feats):
            raise ValueError(f"integer attention path {path!r} needs CPU features this CPU lacks")
        return path


_D_U8, _D_I8, _D_F1, _D_F2, _D_I16, _D_I32 = (np.zeros(1, np.uint8).reshape(1, 1), np.zeros((1, 1), np.int8),
                                              np.zeros(1, np.float32), np.zeros((1, 1), np.float32),
                                              np.zeros((1, 1), np.int16), np.zeros((1, 1), np.int32))  # fmt: skip


@dataclass
class QueryCodes:
    """A quantized query as every path reads it (arrays a path does not use are 1-element dummies)."""

    qu: np.ndarray  # [H, hd] u8: q + 128 (VNNI) or |q| (avx2)
    q8: np.ndarray  # [H, hd] i8 signed codes (avx2 sign source, portable)
    lane_scale: np.ndarray  # [H, hd // 4] f32: block scale / sqrt(hd) per 4-value lane (4-bit K: hd // 8)
    block_scale: np.ndarray  # [H, hd // 32] f32: the same per block (the ksum correction)
    q16: np.ndarray  # [H, hd] i16
    scale16: np.ndarray  # [H] f32: row scale / sqrt(hd)
    q4_codes: np.ndarray = field(default_factory=lambda: _D_I8)  # [H, hd] i8: q8 in score4's order (4-bit K)
    q4_offset: np.ndarray = field(default_factory=lambda: _D_I32)  # [H, hd // 8] i32: q4int.lane_offsets

    @property
    def arrays(self) -> tuple[np.ndarray, ...]:
        """The codes as the compiled cores take them (one tuple type for every kind)."""
        return (self.qu, self.q8, self.lane_scale, self.block_scale, self.q16, self.scale16, self.q4_codes,
                self.q4_offset)  # fmt: skip


def quantize_query(q: np.ndarray, qbits: int, path: str, k4: bool = False) -> QueryCodes:
    """Quantize ``q [n_heads, hd]`` f32 for ``path``; 1/sqrt(hd) goes into the scales. ``k4``: for a
    4-bit K store (8-bit query only; :mod:`.q4int`)."""
    n_heads, hd = q.shape
    inv_sqrt = np.float32(1.0 / math.sqrt(hd))
    if qbits == 16:
        m = np.abs(q).max(axis=1).astype(np.float32)
        m = np.where(m < 1e-30, np.float32(1.0), m)
        q16 = np.clip(np.floor(q * (np.float32(Q16_MAX) / m)[:, None] + 0.5), -Q16_MAX, Q16_MAX).astype(
            np.int16
        )
        return QueryCodes(
            _D_U8, _D_I8, _D_F2, _D_F2, q16, (m / np.float32(Q16_MAX) * inv_sqrt).astype(np.float32)
        )
    q8, q_max = quantize_query_blocks(q)
    block_scale = (q_max * np.float32(1.0 / 127.0) * inv_sqrt).astype(np.float32)
    lane_scale = np.ascontiguousarray(np.repeat(block_scale, KSUM_BLOCK // 4, axis=1))
    if k4:  # the 4-bit scorer reads its own order of the codes, and no shifted or |q| copy
        qp = permute_query(q8)
        qs = lane_scales(block_scale)
        return QueryCodes(_D_U8, _D_I8, qs, block_scale, _D_I16, _D_F1, qp, lane_offsets(qp))
    if path in ("vnni512", "vnni256"):
        qu = (q8.astype(np.int16) + intdot.SHIFT).astype(np.uint8)
    else:
        qu = np.abs(q8).astype(np.uint8)  # avx2's |q| (portable reads q8)
    return QueryCodes(qu, q8, lane_scale, block_scale, _D_I16, _D_F1)


@njit(fastmath=_FM, cache=True)
def _score_tile(path, qbits, qc, k8, ksum, h, t0, nt, hq0, group, sc):  # pragma: no cover - compiled
    """Raw scores (f32, 1/sqrt(hd) in) of tile rows t0..t0+nt for query heads hq0..hq0+group-1.
    ``path``: a compile-time constant (one specialization per path: see :func:`_core`); ``qbits`` 8 or 16."""
    qu, q8, ls, bs, q16, s16, _, _ = qc
    hd = k8.shape[2]
    shifted = path <= 1  # vnni512 / vnni256: the query went in as q + 128
    for j in range(nt):
        k_at = k8[h, t0 + j].ctypes.data
        for g in range(group):
            hq = hq0 + g
            if qbits == 16:
                sc[g, j] = np.float32(intdot.dot16(path, q16[hq].ctypes.data, k_at, hd)) * s16[hq]
                continue
            sc[g, j] = intdot.dot8(path, qu[hq].ctypes.data, q8[hq].ctypes.data, k_at, ls[hq].ctypes.data, hd)
    if shifted and qbits == 8:  # sum (q+128) k - 128 sum k, block by block with the block's scale
        for g in range(group):
            for b in range(bs.shape[1]):
                c = np.float32(intdot.SHIFT) * bs[hq0 + g, b]
                for j in range(nt):
                    sc[g, j] -= c * np.float32(ksum[h, t0 + j, b])


@njit(fastmath=_FM, cache=True)
def _pv8_tile(path, w, v, h, t0, nt, group, vt, p8, acc8, acc):  # pragma: no cover - compiled
    """acc[g] += sum_j w[g, j] v[j] with the weights (V scale folded in, >= 0) quantized to u8 per
    query head over the tile (step = max / 255, round half up) and exact int32 sums (intdot.pv8)."""
    hd = acc.shape[1]
    v8 = v.view(np.int8)
    n4 = (nt + 3) // 4
    for j in range(n4 * 4):
        for d in range(hd):
            vt[j >> 2, d, j & 3] = v8[h, t0 + j, d] if j < nt else np.int8(0)
    for g in range(group):
        m = np.float32(0.0)
        for j in range(nt):
            m = max(m, w[g, j])
        if m == 0.0:
            continue
        inv = np.float32(255.0) / m
        for j in range(nt):
            p8[g, j] = np.uint8(min(np.floor(w[g, j] * inv + np.float32(0.5)), np.float32(255.0)))
        for j in range(nt, n4 * 4):
            p8[g, j] = 0
        acc8[g, :] = 0
        intdot.pv8(path, acc8[g].ctypes.data, p8[g].ctypes.data, vt.ctypes.data, n4, hd)
        step = m * np.float32(1.0 / 255.0)
        for d in range(hd):
            acc[g, d] += step * np.float32(acc8[g, d])


@njit(parallel=True, fastmath=_FM, cache=True)
def _core(
    path, qbits, pv8, qc, k, k_code, k_scale, k_bsc, ksum, v, v_code, v_scale, v_bsc, length, tiles, table,
    n_splits, out, sink,
):  # pragma: no cover  # fmt: skip
    """cpu._decode_core with integer scores (and with ``pv8``, integer P.V); compiled once per
    literal ``path`` (its instructions); ``qbits`` and ``pv8`` are read at run time, one branch per
    tile, so a path is one specialization, not four. ``tiles`` and ``table`` (a paged cache's block
    table; empty = contiguous) as there. ``k_code``: CODE_Q8, or CODE_Q4 (scores by :func:`.q4int.score_tile_q4`,
    ``k_bsc`` its fp16 block-scale bits; 8-bit query only). ``sink``: as there."""
    path = literally(path)
    hd = out.shape[1]
    k8 = k.view(np.int8)
    group, dense, paged, n_tiles, split_len, n_items, part_acc, part_m, part_l = flash.start_splits(
        length, tiles, table, n_splits, k, out, sink
    )
    qp, qoff, q4s = qc[6], qc[7], qc[2]
    for item in prange(n_items):
        h, i_lo, i_hi, tile_u, tile, sc, e_u, e_f, bs_u, bs_f = flash.item_setup(
            item, n_splits, split_len, n_tiles, group, hd
        )
        vt = np.zeros((flash.TILE // 4, hd, 4), np.int8)  # pv8: V codes interleaved by 4 rows
        p8 = np.zeros((group, flash.TILE), np.uint8)
        acc8 = np.empty((group, hd), np.int32)
        for ti in range(i_lo, i_hi):
            nt, t0 = flash.tile_rows(ti, h, length, dense, tiles, paged, table, sink[0])
            if nt <= 0:
                continue
            if k_code == CODE_Q4:
                hq0 = h * group
                q4int.score_tile_q4(path, qp, qoff, q4s, k, k_bsc, h, t0, nt, hq0, group, sc, bs_u, bs_f)
            else:
                _score_tile(path, qbits, qc, k8, ksum, h, t0, nt, h * group, group, sc)
            flash.weigh_tile(sc, nt, group, k_scale, k_code, item, part_m, part_l, part_acc, v_scale, v_code, h, t0,
                             e_u, e_f)  # fmt: skip
            if pv8:
                _pv8_tile(path, sc, v, h, t0, nt, group, vt, p8, acc8, part_acc[item])
            else:
                _stage(v, v_code, v_bsc, h, t0, nt, tile_u, tile, bs_u, bs_f)
                flash.axpy_tile(sc, tile, nt, group, part_acc[item])
    flash.merge(part_acc, part_m, part_l, n_splits, group, out)


_ENTRY: dict[int, object] = {}


def _compiled_core(args: tuple):
    """The compiled specialization of :func:`_core` for ``args``' literal path. Calling the
    dispatcher itself would re-run literal typing on every call (~0.1 s); the entry point does not."""
    path = args[0]
    if path not in _ENTRY:
        _core(*args)  # compiles (or loads from the disk cache) the specialization, and runs it once
        for sig, cres in _core.overloads.items():
            # the one typed from Python: qbits and pv8 plain integers (a jitted caller's constants
            # may have typed others with literal values folded in)
            if sig[0].literal_value == path and not isinstance(sig[1], types.Literal):
                _ENTRY[path] = cres.entry_point
    return _ENTRY[path]


_NO_KSUM = np.zeros((1, 1, 1), np.int16)


def packed_kind(stores: Iterable) -> StoreKind | None:
    """The first packed N-bit kind (q7h, q6h, q5h) among ``stores``' row stores, or None: the integer
    kernels read int8 / 4-bit codes only, so their callers refuse such a store by this one test."""
    return next((store.kind for store in stores if store.kind.packed), None)


def decode_attention_int(
    q: torch.Tensor,
    k_store,
    v_store,
    length: int,
    n_splits: int | None = None,
    blocks: np.ndarray | torch.Tensor | None = None,
    spec: IntAttn = IntAttn(),
    table: np.ndarray | torch.Tensor | None = None,
    sink: tuple[torch.Tensor, torch.Tensor] | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Decode attention of ``q [n_heads, hd]`` over the first ``length`` rows of an int8 K store (with
    its ``ksum``) or, with the 8-bit query, a 4-bit one (q4, q4h), and any V store, integer scores per
    ``spec``. Same contract as :func:`kvlens.kernels.cpu.decode_attention`; returns a new float32
    ``[n_heads, hd]`` tensor."""
    path = spec.resolved_path()
    k4 = k_store.kind.int4
    packed = packed_kind((k_store, v_store))
    if packed is not None:
        raise ValueError(f"integer attention ({spec.backend}) cannot read {packed} rows (packed codes)")
    if not spec.scores(k_store.kind):
        raise ValueError(f"integer attention ({spec.backend}) needs an int8 K store, or 4-bit with an 8-bit "
                         f"query, got {k_store.kind}")  # fmt: skip
    if spec.pv8 and not v_store.kind.int8:
        raise ValueError(f"integer P.V ({spec.backend}) needs an int8 V store, got {v_store.kind}")
    if q.shape[-1] % KSUM_BLOCK:  # before the path's own needs: the same words on every CPU
        raise ValueError(f"integer attention needs head_dim divisible by {KSUM_BLOCK}, got {q.shape[-1]}")
    shifted = spec.qbits == 8 and path in ("vnni512", "vnni256") and not k4
    if shifted and k_store.ksum is None:
        raise ValueError("integer attention with an 8-bit query on a VNNI path needs the K store's ksum")
    k, kc, ks, k_bsc = store_arrays(k_store)
    v, vc, vs, v_bsc = store_arrays(v_store)
    n_kv, cap = k.shape[:2]
    blocks, first = sliding_window(n_kv, length, window, blocks, sink, flash.TILE)
    qn = q.detach().to(torch.float32).numpy()
    n_heads, hd = qn.shape
    if k.shape[2] != (hd // 2 if k4 else hd) or n_heads % n_kv or v.shape[:2] != (n_kv, cap):
        raise ValueError(f"shape mismatch: q {tuple(qn.shape)}, k {k.shape}, v {v.shape}")
    tiles, table, serial, n_splits = flash.plan_call(  # split_threads: splits independent of the load
        n_kv, cap, length, blocks, table, n_splits, split_threads()
    )
    qc = quantize_query(qn, spec.qbits, path, k4)
    ksum = k_store.ksum.numpy() if shifted else _NO_KSUM
    out = np.empty((n_heads, hd), np.float32)
    args = (intdot.PATHS.index(path), spec.qbits, int(spec.pv8), qc.arrays, k, kc, ks, k_bsc, ksum, v, vc, vs, v_bsc,
            int(length), tiles, table, n_splits, out,
            flash.sink_args(qn / np.float32(math.sqrt(hd)), sink, first))  # fmt: skip
    run_serial_if(serial, _compiled_core(args), *args)
    return torch.from_numpy(out)
