"""One decode step's attention for one layer as one compiled call: the K/V row written (checks,
centers, rotation, quantization), the query turned into K's basis, Flash-Decoding over the stores,
the output turned back from V's basis (CPU, one token).

:func:`attend_row` is the middle of the fused step's layer (:func:`kvlens.kernels.decode_step.decode_layer`)
and, alone, what the engine's general path calls for layers the fused step does not run (Gemma-3's:
QK-norm, sliding windows, its own MLP): the same compiled kernels in the same order as the unfused
calls (``kv.quant``, ``kernels.cpu`` / ``cpu_int``), so its output and the stored rows are
bit-identical to theirs (tests/test_attend_step.py), without their ~6-10 Python-level calls per layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numba
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..kv.quant import rotation_signs
from . import flash
from .bits import absmax
from .cpu import _decode_core
from .cpu_int import _NO_KSUM, Q16_MAX
from .cpu_int import _core as _int_core
from .q4store import hadamard_rows
from .q8store import first_nonfinite_index, row_code
from .reference import sliding_window
from .step_kv import center_rows, quantize_query_q4, store_kv, to_basis
from .threads import split_threads

# attention kinds: the float kernel (numba), 16-bit integer scores (int8 K), 8-bit (4-bit K)
ATTN_FLOAT, ATTN_INT16, ATTN_INT8 = 0, 1, 2


# numba's own get/set_num_threads reach the threading layer through ctypes pointers, which numba
# cannot cache to disk (every process would recompile the step: ~20 s); these call the same C
# functions by the symbols numba registers when it starts its threads (:func:`start_threads`).
@intrinsic
def _get_threads(typingctx):
    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.IntType(32), []), "get_num_threads"
        )
        return builder.sext(builder.call(fn, []), ir.IntType(64))

    return types.int64(), codegen


@intrinsic
def _set_threads(typingctx, n):
    def codegen(context, builder, sig, args):
        fnty = ir.FunctionType(ir.VoidType(), [ir.IntType(32)])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "set_num_threads")
        builder.call(fn, [builder.trunc(args[0], ir.IntType(32))])
        return context.get_dummy_value()

    return types.void(types.int64), codegen


@njit(cache=True)
def _quantize_q16(q, inv_sqrt, q16, s16):  # pragma: no cover - compiled
    """cpu_int.quantize_query's 16-bit rule, the same f32 operations (no fastmath: no FMA)."""
    for hq in range(q.shape[0]):
        m = absmax(q[hq])
        if m < np.float32(1e-30):
            m = np.float32(1.0)
        r = np.float32(Q16_MAX) / m
        for d in range(q.shape[1]):
            q16[hq, d] = np.int16(row_code(q[hq, d], r, np.float32(Q16_MAX)))
        s16[hq] = m / np.float32(Q16_MAX) * inv_sqrt


@njit(cache=True)
def _attend(kind, path, q, ks, vs, at, buf, out, sink):  # pragma: no cover - compiled
    """Decode attention of ``q [H, d]`` (cpu / cpu_int's cores); ``at``: see :func:`attend_row`;
    ``sink``: the cores' sink argument (flash.sink_args: none, or a sliding window's first position).
    The cores' flags go in as np.int64 / np.bool_ values, not literal constants: a literal would type a
    second specialization of the core beside the one the Python callers use (docs/testing.md)."""
    k_code, v_code, inv_sqrt, length, n_splits, serial, tiles, table = at[:8]
    qs, q16, s16, no_q8, no_sc, no_ksum, no_i32, q8, qp, qoff, q4s = buf
    threads = _get_threads()
    if serial and threads > 1:
        _set_threads(1)
    k_raw, k_scale, k_bsc = ks[:3]  # row bytes, int8 max_abs, 4-bit fp16 scale bits (dummies if unused)
    v_raw, v_scale, v_bsc = vs[:3]
    if kind != ATTN_FLOAT and sink[2].shape[1] > 0:  # the integer cores' sink query, as cpu_int makes it
        root = np.float32(math.sqrt(q.shape[1]))
        for hq in range(q.shape[0]):
            for d in range(q.shape[1]):
                qs[hq, d] = q[hq, d] / root
    if kind == ATTN_FLOAT:
        for hq in range(q.shape[0]):
            for d in range(q.shape[1]):
                qs[hq, d] = q[hq, d] * inv_sqrt
        _decode_core(qs, no_q8, no_sc, np.bool_(False), k_raw, k_code, k_scale, k_bsc, v_raw, v_code, v_scale, v_bsc,
                     length, tiles, table, n_splits, out, sink)  # fmt: skip
    elif kind == ATTN_INT8:
        quantize_query_q4(q, inv_sqrt, q8, qp, qoff, q4s)
        codes = (no_q8.view(np.uint8), no_q8, q4s, no_sc, q16, s16, qp, qoff)
        _int_core(path, np.int64(8), np.int64(0), codes, k_raw, k_code, k_scale, k_bsc, no_ksum, v_raw, v_code, v_scale, v_bsc, length,
                  tiles, table, n_splits, out, sink)  # fmt: skip
    else:
        _quantize_q16(q, inv_sqrt, q16, s16)
        codes = (no_q8.view(np.uint8), no_q8, no_sc, no_sc, q16, s16, no_q8, no_i32)
        _int_core(path, np.int64(16), np.int64(0), codes, k_raw, k_code, k_scale, k_bsc, no_ksum, v_raw, v_code, v_scale, v_bsc, length,
                  tiles, table, n_splits, out, sink)  # fmt: skip
    if serial and threads > 1:
        _set_threads(threads)


@njit(cache=True)
def attend_row(kind, path, q, k, v, ks, vs, pos, at, abuf, rbuf, o, sink):  # pragma: no cover - compiled
    """Store K and V ``[n_kv, d]`` (one position, f32) at row ``pos`` of store tuples ``ks``/``vs``,
    then attention of ``q [H, d]`` into ``o [H, d]`` (out of V's basis). Returns -1, or the flat index
    of the first non-finite value of K (``i``) or V (``K.size + i``), or ``step_kv.FP16_OVERFLOW``
    where a 4-bit block's scale overflows fp16: nothing is stored then.

    ``kind``, ``path``: literal attention kind and integer-kernel path (one specialization each).
    ``at``: (K code, V code, 1/sqrt(d) as f32, length, then flash.plan_call's splits, serial, tiles,
    table, then K's and V's rotation spans (0: not rotated), then the layer's K centers ``[n_kv, d]``
    (an empty array for none), then whether K's and V's 4-bit steps are searched (q4h)). ``abuf``:
    :func:`_attend`'s scratch (:func:`attend_buffers`); ``rbuf``: the rotation's (signs, ones, q, k, v,
    o in the stored bases, K less its centers: :func:`rotation_buffers`). ``sink``: as :func:`_attend`'s."""
    bad = first_nonfinite_index(k)
    if bad >= 0:
        return bad
    bad = first_nonfinite_index(v)
    if bad >= 0:
        return k.size + bad
    signs, ones, q_rot, k_rot, v_rot, o_rot, k_cen = rbuf
    k_span, v_span = at[8], at[9]
    kc = center_rows(k, at[10], k_cen)  # K smoothing: less the centers, before the rotation
    bad = store_kv(ks, vs, at[0], at[1], to_basis(kc, k_span, signs, ones, k_rot),
                   to_basis(v, v_span, signs, ones, v_rot), pos, at[11], at[12])  # fmt: skip
    if bad != -1:
        return bad
    _attend(kind, path, to_basis(q, k_span, signs, ones, q_rot), ks, vs, at, abuf, o, sink)
    if v_span:  # the output back from V's basis (kv.quant.unrotate_rows)
        hadamard_rows(o, ones, signs, v_span, o_rot)
        o[:] = o_rot
    return -1


def attend_buffers(n_heads: int, head_dim: int) -> tuple[np.ndarray, ...]:
    """:func:`_attend`'s scratch: the scaled float query, the 16-bit query and scales, dummies, the
    8-bit query over 4-bit K (codes, permuted codes, lane offsets, lane scales)."""
    f32, h, d = np.float32, n_heads, head_dim
    return (np.empty((h, d), f32), np.empty((h, d), np.int16), np.empty(h, f32), np.zeros((1, 1), np.int8),
            np.ones((1, 1), f32), _NO_KSUM, np.zeros((1, 1), np.int32), np.empty((h, d), np.int8),
            np.empty((h, d), np.int8), np.empty((h, d // 8), np.int32), np.empty((h, d // 8), f32))  # fmt: skip


def rotation_buffers(n_heads: int, n_kv: int, head_dim: int) -> tuple[np.ndarray, ...]:
    """(signs, ones, q, k, v, o) of the rotated kinds' turns (kv.quant.rotate_rows, unrotate_rows),
    then K less its centers (K smoothing); dummy signs where head_dim is no power of two (no rotated
    kind there)."""
    d, f32 = head_dim, np.float32
    signs = rotation_signs(d).numpy() if d & (d - 1) == 0 else np.ones(d, f32)
    return (signs, np.ones(d, f32), np.empty((n_heads, d), f32), np.empty((n_kv, d), f32),
            np.empty((n_kv, d), f32), np.empty((n_heads, d), f32), np.empty((n_kv, d), f32))  # fmt: skip


def start_threads() -> None:
    """Start numba's threads (once): registers the symbols :func:`_get_threads` / :func:`_set_threads`
    call, before a compiled entry point that uses them is looked up."""
    numba.get_num_threads()


def literal_signature(args: tuple) -> tuple:
    """The compile signature of ``args`` whose first two (attention kind, path) are literals."""
    return (types.literal(args[0]), types.literal(args[1]), *(numba.typeof(a) for a in args[2:]))


def head_scale(head_dim: int) -> np.float32:
    """1/sqrt(head_dim) as the kernels fold it into the query (as cpu._run computes it)."""
    return np.float32(1.0 / math.sqrt(head_dim))


@dataclass(frozen=True)
class StepPlan:
    """The Python-side plan of one position's attention: flash.plan_call's (tiles, table, serial,
    n_splits), the store row written (physical, in a paged cache), the length attended and a sliding
    window's first position (0: none)."""

    tiles: np.ndarray
    table: np.ndarray
    serial: bool
    n_splits: int
    row: int
    length: int
    first: int

    @classmethod
    def of(cls, n_kv: int, cap: int, pos: int, window: int | None, table: np.ndarray | None) -> StepPlan:
        length = pos + 1
        blocks, first = sliding_window(n_kv, length, window, None, None, flash.TILE)
        # split_threads: the splits, hence the sums, never vary with the load (as cpu.decode_attention)
        tiles, table, serial, n_splits = flash.plan_call(
            n_kv, cap, length, blocks, table, None, split_threads()
        )
        row = pos if table.shape[0] == 0 else int(table[pos // flash.TILE]) * flash.TILE + pos % flash.TILE
        return cls(tiles, table, serial, n_splits, row, length, first)

    def layer_args(self, layer: tuple, inv_sqrt: np.float32) -> tuple:
        """:func:`attend_row`'s ``at`` for a layer's fused store tuple
        (:func:`kvlens.kernels.decode_step.fused_stores`)."""
        _, _, k_code, v_code, k_span, v_span, center, k_search, v_search = layer
        return (k_code, v_code, inv_sqrt, self.length, self.n_splits, self.serial, self.tiles, self.table,
                k_span, v_span, center, k_search, v_search)  # fmt: skip


class AttendStep:
    """:func:`attend_row` from Python for one model shape: scratch allocated once, the compiled
    specialization of each (attention kind, path) looked up once (calling the dispatcher would re-type
    every argument, and literals, on each call). One step at a time."""

    def __init__(self, n_heads: int, n_kv: int, head_dim: int) -> None:
        self.abuf = attend_buffers(n_heads, head_dim)
        self.rbuf = rotation_buffers(n_heads, n_kv, head_dim)
        self.out = np.empty((n_heads, head_dim), np.float32)
        self.inv_sqrt = head_scale(head_dim)
        self.shape = (n_heads, n_kv, head_dim)
        self._entry: dict[tuple[int, int], object] = {}
        self._head: AttendStep | None = None

    @property
    def head_step(self) -> AttendStep:
        """The step of one KV head and its query group (a layer stored per KV head runs it per head)."""
        if self._head is None:
            n_heads, n_kv, head_dim = self.shape
            self._head = AttendStep(n_heads // n_kv, 1, head_dim)
        return self._head

    def run(
        self, attn: tuple[int, int], q: np.ndarray, k: np.ndarray, v: np.ndarray, layer: tuple, pos: int,
        window: int | None, table: np.ndarray | None, sink_rows: tuple | None = None,
    ) -> int:  # fmt: skip
        """Write K/V ``[n_kv, d]`` at position ``pos`` of ``layer`` (a fused store tuple:
        :func:`kvlens.kernels.decode_step.layer_entry`; ``table``: a paged cache's block table) and
        attend ``q [H, d]`` over positions ``[0, pos]`` (the last ``window`` of them) into :attr:`out`;
        returns :func:`attend_row`'s answer. Arrays are C-contiguous float32. ``sink_rows``: K and V
        ``[n_kv, s, d]`` of the first s positions (the cache's sink store, in the stores' basis), read
        in place of the stores' rows there, their softmax state seeded from the scaled query
        :func:`_attend` leaves in ``abuf[0]`` (as ``cpu.decode_attention`` / ``cpu_int`` scale it)."""
        plan = StepPlan.of(k.shape[0], layer[0][0].shape[1], pos, window, table)
        sink = flash.sink_args(self.abuf[0], sink_rows, plan.first)  # abuf[0]: _attend's scaled query
        args = (*attn, q, k, v, layer[0], layer[1], plan.row, plan.layer_args(layer, self.inv_sqrt),
                self.abuf, self.rbuf, self.out, sink)  # fmt: skip
        entry = self._entry.get(attn)
        if entry is None:
            start_threads()
            entry = self._entry[attn] = attend_row.compile(literal_signature(args))
        return entry(*args)
