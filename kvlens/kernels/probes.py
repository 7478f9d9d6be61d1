"""The benchmarks' machine probes (:mod:`kvlens.bench.bandwidth`): a pure read stream and pure
arithmetic, each timed between a benchmark's rounds to tell a machine that changed speed from code."""

from __future__ import annotations

import numpy as np
from numba import njit, prange


@njit(parallel=True, fastmath=True, cache=True)
def parallel_sum(a, n_chunks):  # pragma: no cover - compiled
    """Sum of a flat f32 array in ``n_chunks`` contiguous pieces (one per thread): a pure read stream.
    Each piece is a slice walked from 0 (with ``min`` in the loop bound LLVM did not vectorize it)."""
    part = np.zeros(n_chunks, np.float32)
    step = (a.size + n_chunks - 1) // n_chunks
    for c in prange(n_chunks):
        x = a[c * step : min(a.size, (c + 1) * step)]
        s = np.float32(0.0)
        for i in range(x.size):
            s += x[i]
        part[c] = s
    return part.sum()


ARITH_CHAINS = 8  # independent multiply-add chains per thread: enough to be bound by throughput, not latency


@njit(parallel=True, cache=True)
def arith_chains(n_iter, n_chunks):  # pragma: no cover - compiled
    """``n_iter`` steps of :data:`ARITH_CHAINS` independent ``a = a * m + b`` chains in each of
    ``n_chunks`` pieces (one per thread), all in registers: no memory access, so its time moves only
    with the cores' own speed (clocks, a co-tenant on the physical core). No fastmath: the chains
    must not be reassociated away."""
    part = np.zeros(n_chunks, np.float32)
    for c in prange(n_chunks):
        m, b = np.float32(0.999), np.float32(1e-3)
        a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(c)
        for _ in range(n_iter):
            a0, a1, a2, a3 = a0 * m + b, a1 * m + b, a2 * m + b, a3 * m + b
            a4, a5, a6, a7 = a4 * m + b, a5 * m + b, a6 * m + b, a7 * m + b
        part[c] = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7
    return part.sum()


@njit(parallel=True, cache=True)
def fork_joins(lines, reps):  # pragma: no cover - compiled
    """``reps`` parallel regions in turn, each thread adding 1 to its own row of ``lines [threads, 16]``
    (f64: a row = two cache lines): the time of one is the threads' fork/join round trip (wake, hand
    out, wait for all), which moves with how far apart the machine places its cores (one die or two)."""
    for _ in range(reps):
        for c in prange(lines.shape[0]):
            lines[c, 0] += 1.0
    return lines[0, 0]
