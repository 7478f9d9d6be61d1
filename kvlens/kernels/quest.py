"""Quest block selection for sparse decode, compiled (numba): the bound scan and the top-n in one
pass per KV head, parallel over KV heads, no torch ops.

The same selection as the torch reference (:func:`kvlens.kv.blocks.quest_scores` then
:func:`kvlens.kv.blocks.top_blocks`), on CPU arrays:

* score of block b for KV head h = max over the query heads g of its GQA group of
  Σ_d kmax[h, b, d]·q⁺[g, d] + kmin[h, b, d]·q⁻[g, d]  (= Σ_d max(q_d·kmin_d, q_d·kmax_d), Quest's
  upper bound of q·k over the block); a block whose bound is NaN for any of them scores -inf;
* block 0 (sink) and block nb-1 (most recent) are always kept; the other n_select - 2 are the
  highest-scoring middle blocks, equal scores going to the lower block index;
* the result is the sorted block indices per KV head, ``int32 [n_kv, n_select]`` — what the fused
  decode kernels (:mod:`.cpu`, :mod:`.cpu_int`) take as ``blocks``.

The top-n is a 3-way quickselect for the n-th largest score (linear on average, also when many
scores are equal), then one in-order pass that keeps the scores above it and the first of those
equal to it; so no sort. The scores are summed in f32 in a different order than torch's two
matrix products: blocks whose scores differ by less than that rounding can rank the other way.

Scratch (scores, the quickselect copy, the split query) lives in a per-thread workspace that grows
with the context; the only per-call allocation is the returned block list.
"""

from __future__ import annotations

import threading

import numpy as np
import torch
from numba import njit, prange

from .stage import _FM
from .threads import run_serial_if

SERIAL_MACS = 1 << 18  # below this many bound multiply-adds one thread runs the call (~50 µs of work)


@njit(fastmath=_FM, cache=True)
def _split_query(q, hq0, group, qpn):  # pragma: no cover - compiled
    """qpn[g] = max(q[hq0+g], 0), qpn[group+g] = min(q[hq0+g], 0)."""
    hd = q.shape[1]
    for g in range(group):
        for d in range(hd):
            x = q[hq0 + g, d]
            qpn[g, d] = max(x, np.float32(0.0))
            qpn[group + g, d] = min(x, np.float32(0.0))


@njit(fastmath=_FM, cache=True)
def _head_scores(kmin, kmax, h, nb, qpn, group, scores):  # pragma: no cover - compiled
    """scores[b] = max_g Σ_d kmax·q⁺ + kmin·q⁻ for blocks b < nb of KV head h; -inf where any head's
    bound is NaN (torch's max propagates the NaN, and top_blocks counts it as -inf). Four blocks per
    pass over d, so each query load feeds four pairs of FMAs (one block per pass is load-bound)."""
    hd = kmin.shape[2]
    n4 = nb - nb % 4
    scores[:nb] = -np.inf
    for g in range(group):
        for b in range(0, n4, 4):
            s0 = s1 = s2 = s3 = np.float32(0.0)
            for d in range(hd):
                qp, qn = qpn[g, d], qpn[group + g, d]
                s0 += kmax[h, b, d] * qp + kmin[h, b, d] * qn
                s1 += kmax[h, b + 1, d] * qp + kmin[h, b + 1, d] * qn
                s2 += kmax[h, b + 2, d] * qp + kmin[h, b + 2, d] * qn
                s3 += kmax[h, b + 3, d] * qp + kmin[h, b + 3, d] * qn
            _keep_max(scores, b, s0)
            _keep_max(scores, b + 1, s1)
            _keep_max(scores, b + 2, s2)
            _keep_max(scores, b + 3, s3)
        for b in range(n4, nb):
            s = np.float32(0.0)
            for d in range(hd):
                s += kmax[h, b, d] * qpn[g, d] + kmin[h, b, d] * qpn[group + g, d]
            _keep_max(scores, b, s)
    for b in range(nb):
        if scores[b] != scores[b]:
            scores[b] = -np.inf


@njit(inline="always")
def _keep_max(scores, b, s):  # pragma: no cover - compiled
    """scores[b] = max(scores[b], s), NaN sticky (a NaN stays NaN until _head_scores makes it -inf)."""
    if s != s or s > scores[b]:
        scores[b] = s


@njit(cache=True)
def _kth_largest(w, m, k):  # pragma: no cover - compiled
    """The k-th largest (1 ≤ k ≤ m) of w[:m], permuting w: 3-way quickselect, median-of-3 pivot."""
    lo, hi, target = 0, m, k - 1
    while True:
        a, b, c = w[lo], w[(lo + hi) // 2], w[hi - 1]
        pivot = max(min(a, b), min(max(a, b), c))
        lt, i, gt = lo, lo, hi  # w[lo:lt] > pivot, w[lt:i] == pivot, w[gt:hi] < pivot
        while i < gt:
            x = w[i]
            if x > pivot:
                w[i], w[lt] = w[lt], x
                lt += 1
                i += 1
            elif x < pivot:
                gt -= 1
                w[i], w[gt] = w[gt], x
            else:
                i += 1
        if target < lt:
            hi = lt
        elif target >= gt:
            lo = gt
        else:
            return pivot


@njit(cache=True)
def _pick(scores, nb, n_select, work, out):  # pragma: no cover - compiled
    """out[:n_select] = 0, the best n_select-2 of blocks 1..nb-2 (ties: lower index), nb-1; sorted."""
    k, m = n_select - 2, nb - 2
    out[0] = 0
    n = 1
    if k > 0:
        for i in range(m):
            work[i] = scores[i + 1]
        t = _kth_largest(work, m, k)
        n_ties = k  # how many blocks scoring exactly t make the cut: k less those scoring above
        for b in range(1, nb - 1):
            if scores[b] > t:
                n_ties -= 1
        for b in range(1, nb - 1):
            s = scores[b]
            if s > t or (s == t and n_ties > 0):
                if s == t:
                    n_ties -= 1
                out[n] = b
                n += 1
    out[n] = nb - 1


@njit(parallel=True, fastmath=_FM, cache=True)
def _select(q, kmin, kmax, nb, n_select, scores, work, qpn, out):  # pragma: no cover - compiled
    n_kv = kmin.shape[0]
    group = q.shape[0] // n_kv
    for h in prange(n_kv):
        _split_query(q, h * group, group, qpn[h])
        _head_scores(kmin, kmax, h, nb, qpn[h], group, scores[h])
        _pick(scores[h], nb, n_select, work[h], out[h])


class _Workspace(threading.local):
    """Scratch of :func:`quest_select`, one per thread, grown (doubling) as the context grows."""

    def __init__(self) -> None:
        self.scores = self.work = np.zeros((0, 0), np.float32)
        self.qpn = np.zeros((0, 0, 0), np.float32)

    def get(self, n_kv: int, group: int, hd: int, nb: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self.scores.shape[0] != n_kv or self.scores.shape[1] < nb:
            cap = max(nb, 2 * self.scores.shape[1]) if self.scores.shape[0] == n_kv else nb
            self.scores = np.empty((n_kv, cap), np.float32)
            self.work = np.empty((n_kv, cap), np.float32)
        if self.qpn.shape != (n_kv, 2 * group, hd):
            self.qpn = np.empty((n_kv, 2 * group, hd), np.float32)
        return self.scores, self.work, self.qpn


_workspace = _Workspace()


def _as_f32(a: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        a = a.detach().numpy() if a.dtype == torch.float32 else a.detach().float().numpy()
    return a if a.dtype == np.float32 and a.flags.c_contiguous else np.ascontiguousarray(a, np.float32)


def quest_select(
    q: np.ndarray | torch.Tensor,
    kmin: np.ndarray | torch.Tensor,
    kmax: np.ndarray | torch.Tensor,
    nb: int,
    n_select: int,
) -> torch.Tensor | None:
    """Quest's block choice for one decode query ``q [n_heads, hd]`` over the first ``nb`` blocks of
    the bounds ``kmin``/``kmax [n_kv, ≥ nb, hd]`` (CPU): sorted int32 indices ``[n_kv, n_select]``, or
    None when ``n_select ≥ nb`` (the budget covers every block: dense attention)."""
    if n_select < 2:
        raise ValueError(f"n_select must be ≥ 2 (the sink and the most recent block), got {n_select}")
    if n_select >= nb:
        return None
    qn, lo, hi = _as_f32(q), _as_f32(kmin), _as_f32(kmax)
    n_heads, hd = qn.shape
    n_kv = lo.shape[0]
    if lo.ndim != 3 or lo.shape != hi.shape or lo.shape[1] < nb or lo.shape[2] != hd or n_heads % n_kv:
        raise ValueError(f"shape mismatch: q {qn.shape}, kmin {lo.shape}, kmax {hi.shape}, {nb} blocks")
    group = n_heads // n_kv
    scores, work, qpn = _workspace.get(n_kv, group, hd, nb)
    out = np.empty((n_kv, n_select), np.int32)
    small = 2 * nb * n_heads * hd < SERIAL_MACS
    run_serial_if(small, _select, qn, lo, hi, nb, n_select, scores, work, qpn, out)
    return torch.from_numpy(out)
