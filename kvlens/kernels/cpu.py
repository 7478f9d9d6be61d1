"""Fused decode attention on the CPU (numba): one new query token, all heads of one layer.

The kernels read the cache exactly as :mod:`kvlens.kv.cache` stores it (``data [n_kv, cap, hd]``,
``scale [n_kv, cap]`` = fp32 ``max_abs`` for int8 rows) and never build a dequantized K or V:

* the K scale is folded into the score: ``s = dot(q, k_int8) * (k_max_abs / 127) / sqrt(hd)``;
* the V scale is folded into the softmax weight: ``acc += (p * v_max_abs / 127) * v_int8``;
* the softmax is online (running max ``m``, running sum ``l``, rescale when ``m`` grows), one
  pass over K and V, tile by tile (TILE positions, converted to f32 in an L1-resident scratch);
* one pass over a KV head serves all query heads of its GQA group (each K/V row is loaded once);
* the sequence is split (Flash-Decoding): ``prange`` over (kv_head, split) pairs, each split keeps
  ``(m, l, partial acc)``, merged exactly afterwards with the log-sum-exp rule.

Storage kinds share one kernel: the raw rows are passed as int8 (q8), or as their bit patterns —
uint16 for f16/bf16 (numba has no float16/bfloat16 arrays) and uint32 for f32 — and converted to
f32 in-register (bf16: ``bits << 16``; f16: the exact magic-multiply conversion below). So f32,
f16, bf16, q8 and the mixed modes (q8-k, q8-v) all run fused; nothing falls back to torch.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch
from numba import njit, prange

TILE = 32  # positions per online-softmax step: scratch K/V tile is TILE*hd*4 bytes (16 KiB at hd 128)
MIN_SPLIT = 256  # shortest split worth a thread: below it the merge and scheduling cost dominate
# Storage codes of the raw row arrays.
CODE_Q8, CODE_F16, CODE_BF16, CODE_F32 = 0, 1, 2, 3
_KIND_CODE = {"q8": CODE_Q8, "f16": CODE_F16, "bf16": CODE_BF16, "f32": CODE_F32}
# reassoc+contract let LLVM vectorize the dot-product / sum reductions (and use FMA). No nnan/ninf:
# -inf is the "no score yet" running max of an empty split, and the merge relies on exp(-inf) = 0.
_FM = {"reassoc", "contract", "nsz"}
_F16_MAGIC = np.float32(2.0**112)  # (h & 0x7fff) << 13 read as f32, times 2^112, is the f16 value (exact)


@njit(fastmath=_FM, cache=True)
def _stage(src, code, h, t0, nt, dst_u, dst_f):  # pragma: no cover - compiled
    """Convert rows src[h, t0:t0+nt] to float32 in dst_f (dst_u: the same buffer as uint32)."""
    hd = src.shape[2]
    if code == CODE_Q8:
        for j in range(nt):
            for d in range(hd):
                dst_f[j, d] = np.float32(src[h, t0 + j, d])
    elif code == CODE_F32:
        for j in range(nt):
            for d in range(hd):
                dst_u[j, d] = np.uint32(src[h, t0 + j, d])
    elif code == CODE_BF16:
        for j in range(nt):
            for d in range(hd):
                dst_u[j, d] = np.uint32(np.uint16(src[h, t0 + j, d])) << np.uint32(16)
    else:  # f16 bits; cache rows are finite by policy, so Inf/NaN patterns need no special case
        for j in range(nt):
            for d in range(hd):
                dst_u[j, d] = (np.uint32(np.uint16(src[h, t0 + j, d])) & np.uint32(0x7FFF)) << np.uint32(13)
            for d in range(hd):
                dst_f[j, d] *= _F16_MAGIC
            for d in range(hd):
                dst_u[j, d] |= (np.uint32(np.uint16(src[h, t0 + j, d])) & np.uint32(0x8000)) << np.uint32(16)


@njit(fastmath={"contract"}, cache=True)  # no reassoc: it would fold the two-step ln2 reduction
def _exp_inplace(x, n, e_u, e_f):  # pragma: no cover - compiled
    """x[:n] = exp(x[:n]) for x <= 0, vectorizable (libm expf is a scalar call, ~10x slower here).

    Cephes expf: Cody-Waite reduction x = k ln2 + r, degree-6 polynomial, times 2^k built in the
    exponent bits (e_u/e_f: one uint32/float32 scratch). Max error ~1 ulp; x < -87 gives ~1e-38, not 0.
    """
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


@njit(parallel=True, fastmath=_FM, cache=True)
def _decode_core(q, k, k_code, k_scale, v, v_code, v_scale, length, n_splits, out):  # pragma: no cover
    n_heads, hd = q.shape
    n_kv = k.shape[0]
    group = n_heads // n_kv
    split_len = (length + n_splits - 1) // n_splits
    n_items = n_kv * n_splits
    part_acc = np.zeros((n_items, group, hd), np.float32)
    part_m = np.full((n_items, group), -np.inf, np.float32)
    part_l = np.zeros((n_items, group), np.float32)
    # 1/sqrt(hd) goes into the query once; the int8 1/127 goes into each row's scale.
    qs = (q * np.float32(1.0 / math.sqrt(hd))).astype(np.float32)
    k_mul = np.float32(1.0 / 127.0) if k_code == CODE_Q8 else np.float32(1.0)
    v_mul = np.float32(1.0 / 127.0) if v_code == CODE_Q8 else np.float32(1.0)
    for item in prange(n_items):
        h = item // n_splits
        t_lo = (item % n_splits) * split_len
        t_hi = min(length, t_lo + split_len)
        tile_u = np.empty((TILE, hd), np.uint32)
        tile = tile_u.view(np.float32)
        sc = np.empty((group, TILE), np.float32)
        e_u = np.empty(TILE, np.uint32)
        e_f = e_u.view(np.float32)
        acc = part_acc[item]
        m = part_m[item]
        lsum = part_l[item]
        for t0 in range(t_lo, t_hi, TILE):
            nt = min(TILE, t_hi - t0)
            _stage(k, k_code, h, t0, nt, tile_u, tile)
            for j in range(nt):
                ks = k_scale[h, t0 + j] * k_mul if k_code == CODE_Q8 else k_mul
                for g in range(group):
                    s = np.float32(0.0)
                    for d in range(hd):
                        s += qs[h * group + g, d] * tile[j, d]
                    sc[g, j] = s * ks
            for g in range(group):
                m_new = m[g]
                for j in range(nt):
                    m_new = max(m_new, sc[g, j])
                alpha = np.float32(math.exp(m[g] - m_new))
                if alpha != 1.0:
                    for d in range(hd):
                        acc[g, d] *= alpha
                m[g] = m_new
                row = sc[g]
                for j in range(nt):
                    row[j] -= m_new
                _exp_inplace(row, nt, e_u, e_f)
                ps = np.float32(0.0)
                for j in range(nt):
                    ps += row[j]
                if v_code == CODE_Q8:
                    for j in range(nt):
                        row[j] *= v_scale[h, t0 + j] * v_mul
                lsum[g] = lsum[g] * alpha + ps
            _stage(v, v_code, h, t0, nt, tile_u, tile)
            for g in range(group):
                for j in range(nt):
                    w = sc[g, j]
                    for d in range(hd):
                        acc[g, d] += w * tile[j, d]
    # Exact merge of the splits: out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s.
    for hq in prange(n_heads):
        h = hq // group
        g = hq % group
        mx = np.float32(-np.inf)
        for s in range(n_splits):
            mx = max(mx, part_m[h * n_splits + s, g])
        den = np.float32(0.0)
        for d in range(hd):
            out[hq, d] = 0.0
        for s in range(n_splits):
            it = h * n_splits + s
            if part_l[it, g] == 0.0:
                continue  # empty split (n_splits > length)
            c = np.float32(math.exp(part_m[it, g] - mx))
            den += c * part_l[it, g]
            for d in range(hd):
                out[hq, d] += c * part_acc[it, g, d]
        inv = np.float32(1.0) / den
        for d in range(hd):
            out[hq, d] *= inv


def choose_splits(length: int, n_kv: int, n_threads: int | None = None) -> int:
    """Splits per KV head: enough (kv_head, split) items to keep every thread busy, none tiny."""
    n_threads = n_threads or numba.get_num_threads()
    want = max(1, -(-2 * n_threads // n_kv))  # ~2 items per thread evens out ragged last splits
    return max(1, min(want, length // MIN_SPLIT))


def _bits(a: np.ndarray) -> tuple[np.ndarray, int]:
    """A float cache array as the raw bits the core reads, and its storage code."""
    if a.dtype == np.float32:
        return a.view(np.uint32), CODE_F32
    if a.dtype == np.float16:
        return a.view(np.uint16), CODE_F16
    if a.dtype == np.int8:
        return a, CODE_Q8
    raise TypeError(f"unsupported cache dtype {a.dtype}")


_NO_SCALE = np.ones((1, 1), np.float32)


def _run(q, k, k_code, k_scale, v, v_code, v_scale, length, out, n_splits):
    n_heads, hd = q.shape
    n_kv = k.shape[0]
    if length < 1 or length > k.shape[1]:
        raise ValueError(f"length {length} outside [1, cap={k.shape[1]}]")
    if n_heads % n_kv or k.shape[2] != hd or v.shape[:3] != k.shape or out.shape != q.shape:
        raise ValueError(f"shape mismatch: q {q.shape}, k {k.shape}, v {v.shape}, out {out.shape}")
    n_splits = choose_splits(length, n_kv) if n_splits is None else int(n_splits)
    q = np.ascontiguousarray(q, dtype=np.float32)
    _decode_core(q, k, k_code, k_scale, v, v_code, v_scale, int(length), n_splits, out)
    return out


def decode_attention_q8(
    q: np.ndarray, k_q8: np.ndarray, k_max_abs: np.ndarray, v_q8: np.ndarray, v_max_abs: np.ndarray,
    length: int, out: np.ndarray, n_splits: int | None = None,
) -> np.ndarray:
    """Attention of ``q [n_heads, hd]`` over int8 K/V rows ``[n_kv, cap, hd]`` + ``max_abs [n_kv, cap]``."""
    return _run(q, k_q8, CODE_Q8, k_max_abs, v_q8, CODE_Q8, v_max_abs, length, out, n_splits)


def decode_attention_float(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, length: int, out: np.ndarray, n_splits: int | None = None
) -> np.ndarray:
    """The same over float32 or float16 K/V ``[n_kv, cap, hd]`` (bf16: see :func:`decode_attention`)."""
    kb, kc = _bits(k)
    vb, vc = _bits(v)
    return _run(q, kb, kc, _NO_SCALE, vb, vc, _NO_SCALE, length, out, n_splits)


def _store_arrays(store) -> tuple[np.ndarray, int, np.ndarray]:
    """Zero-copy numpy views of a RowStore: (raw rows, storage code, scales)."""
    data = store.data
    if store.kind == "bf16":
        return data.view(torch.int16).numpy().view(np.uint16), CODE_BF16, _NO_SCALE
    if store.kind == "q8":
        return data.numpy(), CODE_Q8, store.scale.numpy()
    raw, code = _bits(data.numpy())
    return raw, code, _NO_SCALE


def decode_attention(q: torch.Tensor, k_store, v_store, length: int, n_splits: int | None = None) -> torch.Tensor:
    """Decode attention of ``q [n_heads, hd]`` over the first ``length`` rows of a layer's K/V
    :class:`~kvlens.kv.cache.RowStore` (any kind, mixed K/V kinds included). Returns f32 ``[n_heads, hd]``."""
    k, kc, ks = _store_arrays(k_store)
    v, vc, vs = _store_arrays(v_store)
    qn = q.detach().to(torch.float32).contiguous().numpy()
    out = np.empty(qn.shape, np.float32)
    _run(qn, k, kc, ks, v, vc, vs, length, out, n_splits)
    return torch.from_numpy(out)
