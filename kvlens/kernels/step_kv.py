"""The KV write of the fused decode step (:mod:`.decode_step`) and the query codes its 4-bit integer
attention reads: each the same float32 operations, in the same order, as the general path's
(``kv.quant`` / ``kernels.q4store`` / ``kernels.cpu_int``; no fastmath), so the stored rows and the
logits are bit-identical to it (tests/test_decode_step.py).

Store tuples (zero-copy numpy views of a RowStore; :func:`kvlens.kernels.decode_step.store_tuple`):
(row bytes, int8 max_abs, fp16 scale bits: a 4-bit store's per block, a packed store's per row as
``[n_kv, cap, 1]``, int8 code sums), one numba type for every kind (the unused members are dummies),
with the storage code beside them read at run time. A rotated kind (q8h, q4h, q7h, q6h, q5h) is
stored like its plain rule after the rows' rotation (:func:`to_basis`).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .bits import FP16_ROUNDS_TO_INF, absmax
from .q4store import first_fp16_overflow, hadamard_rows, store_q4_rows
from .q8store import first_row_past_fp16, row_code, row_scale, store_packed_rows, store_q8_rows
from .stage import CODE_F16, CODE_PACKED, CODE_Q4, CODE_Q8

Q_BLOCK = 32  # the 8-bit query's block (cpu_int's 8-bit rule: kernels.cpu.QBLOCK)
FP16_OVERFLOW = -2  # store_kv's answer when a value or scale would overflow fp16 (4-bit, packed, f16)


@njit(cache=True)
def store_row(code, s, rows, pos, search):  # pragma: no cover - compiled
    """Store one position's K or V rows ``[n_kv, 1, d]`` (f32) at row ``pos`` of store tuple ``s`` of
    storage ``code`` (``search``: a 4-bit store's step is q4h's searched one). The code is read at run
    time, so one compiled step serves every mix of stored kinds."""
    if code == CODE_Q8:  # int8 codes, max_abs scale, code sums per 32-block (empty: none)
        store_q8_rows(rows, s[0].view(np.int8), s[1], pos, s[3])
    elif code == CODE_Q4:  # packed code pairs, fp16 block-scale bits (range checked: store_kv)
        store_q4_rows(rows, s[0], s[2], pos, search)
    elif code > CODE_PACKED:  # N-bit codes packed along the row, an fp16 max_abs (range checked: store_kv)
        store_packed_rows(rows, s[0], s[2][:, :, 0], pos, code - CODE_PACKED)
    elif code == CODE_F16:
        _store_f16(rows, s[0].view(np.uint16), pos)
    else:
        _store_f32(rows, s[0].view(np.float32), pos)


@njit(cache=True)
def _store_f32(rows, data, pos):  # pragma: no cover - compiled
    for h in range(rows.shape[0]):
        data[h, pos, :] = rows[h, 0, :]


@njit(cache=True)
def f32_to_f16_bits(x):  # pragma: no cover - compiled
    """IEEE f32 → f16 bits, round to nearest even (numpy's and torch's conversion) for finite ``x``."""
    f = np.uint32(np.float32(x).view(np.uint32))
    sign = np.uint16((f >> np.uint32(16)) & np.uint32(0x8000))
    f_exp = f & np.uint32(0x7F800000)
    if f_exp >= np.uint32(0x47800000):  # |x| >= 65536: infinity
        return np.uint16(sign | np.uint16(0x7C00))
    if f_exp <= np.uint32(0x38000000):  # an f16 subnormal (or zero)
        if f_exp < np.uint32(0x33000000):
            return sign
        sig = np.uint32(0x00800000) + (f & np.uint32(0x007FFFFF))
        sig = sig >> (np.uint32(113) - (f_exp >> np.uint32(23)))
        if (sig & np.uint32(0x3FFF)) != np.uint32(0x1000) or (f & np.uint32(0x7FF)) != 0:
            sig += np.uint32(0x1000)
        return np.uint16(sign + np.uint16(sig >> np.uint32(13)))
    h_exp = np.uint16((f_exp - np.uint32(0x38000000)) >> np.uint32(13))
    sig = f & np.uint32(0x007FFFFF)
    if (sig & np.uint32(0x3FFF)) != np.uint32(0x1000):
        sig += np.uint32(0x1000)
    return np.uint16(sign + np.uint16(np.uint16(sig >> np.uint32(13)) + h_exp))  # a carry rounds up


@njit(cache=True)
def _store_f16(rows, data, pos):  # pragma: no cover - compiled
    for h in range(rows.shape[0]):
        for d in range(rows.shape[2]):
            data[h, pos, d] = f32_to_f16_bits(rows[h, 0, d])


@njit(cache=True)
def center_rows(rows, center, out):  # pragma: no cover - compiled
    """K smoothing (kv.cache.RowStore.basis): ``out = rows - center`` (``[n, d]``, the same f32
    subtraction as torch's) where ``center`` has rows, else ``rows`` itself (an uncentered layer passes
    an empty center: nothing is computed)."""
    if center.shape[0] == 0:
        return rows
    for h in range(rows.shape[0]):
        for d in range(rows.shape[1]):
            out[h, d] = rows[h, d] - center[h, d]
    return out


@njit(cache=True)
def to_basis(rows, span, signs, ones, out):  # pragma: no cover - compiled
    """``rows [n, d]`` in a store's basis: ``out`` = the rotation of that ``span``
    (kv.quant.rotate_rows: the same JIT pass on the same values), or ``rows`` itself where ``span`` is
    0 (not rotated)."""
    if span == 0:
        return rows
    hadamard_rows(rows, signs, ones, span, out)
    return out


@njit(cache=True)
def out_of_fp16(code, rows, search):  # pragma: no cover - compiled
    """Whether rows ``[n, d]`` of storage ``code`` would need an fp16 value past its range: a 4-bit
    block's step (:func:`~.q4store.first_fp16_overflow`), a packed row's max_abs
    (:func:`~.q8store.first_row_past_fp16`, the packer's own check), an f16 store's values."""
    if code == CODE_Q4:
        return first_fp16_overflow(rows, search) >= 0
    if code > CODE_PACKED:
        return first_row_past_fp16(rows.reshape(rows.shape[0], 1, rows.shape[1])) >= 0
    if code == CODE_F16:  # a value that would be stored as infinity (the general path refuses it too)
        for h in range(rows.shape[0]):
            if absmax(rows[h]) >= FP16_ROUNDS_TO_INF:
                return True
    return False


@njit(cache=True)
def store_kv(ks, vs, k_code, v_code, k, v, pos, k_search, v_search):  # pragma: no cover - compiled
    """Store one position's K and V rows ``[n_kv, d]`` (finite, in the stores' bases) at row ``pos``
    of store tuples ``ks``/``vs`` of storage codes ``k_code``/``v_code`` (``k_search``/``v_search``: that side's 4-bit step is q4h's searched one); returns -1, or
    :data:`FP16_OVERFLOW` (nothing stored) where a 4-bit or packed store's fp16 scale would overflow
    (``kv.quant.store_q4`` / ``kv.nbit.store_packed`` raise then; the caller does)."""
    if out_of_fp16(k_code, k, k_search) or out_of_fp16(v_code, v, v_search):
        return FP16_OVERFLOW
    store_row(k_code, ks, k.reshape(k.shape[0], 1, k.shape[1]), pos, k_search)
    store_row(v_code, vs, v.reshape(v.shape[0], 1, v.shape[1]), pos, v_search)
    return -1


@njit(cache=True)
def quantize_query_q4(q, inv_sqrt, q8, qp, qoff, qs):  # pragma: no cover - compiled
    """``cpu_int.quantize_query(q, 8, path, k4=True)``: int8 codes per 32-block by the q8 rule
    (``kv.quant.quantize_q8``: f32 ``127 / max_abs``, ``floor(x * inv + 0.5)``), permuted for
    ``intdot.score4`` (``qp``), its lane offsets (``qoff``) and lane scales (``qs``, ``max_abs *
    (1/127) * inv_sqrt``)."""
    n_heads, hd = q.shape
    for hq in range(n_heads):
        for b in range(hd // Q_BLOCK):
            m, inv = row_scale(q[hq, b * Q_BLOCK : (b + 1) * Q_BLOCK], np.float32(127.0))
            for i in range(b * Q_BLOCK, (b + 1) * Q_BLOCK):
                q8[hq, i] = np.int8(row_code(q[hq, i], inv, np.float32(127.0)))
            s = m * np.float32(1.0 / 127.0) * inv_sqrt
            for lane in range(4 * b, 4 * b + 4):
                qs[hq, lane] = s
        for c in range(hd // 64):  # per 64 values: the low halves of both blocks, then the high halves
            for half in range(2):
                for blk in range(2):
                    for i in range(16):
                        qp[hq, 64 * c + 32 * half + 16 * blk + i] = q8[hq, 64 * c + 32 * blk + 16 * half + i]
        for lane in range(hd // 8):
            c, r = lane // 8, lane % 8
            t = np.int32(0)
            for i in range(4):
                t += np.int32(qp[hq, 64 * c + 4 * r + i]) + np.int32(qp[hq, 64 * c + 32 + 4 * r + i])
            qoff[hq, lane] = np.int32(8) * t
