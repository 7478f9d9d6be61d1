"""The read-bandwidth probe of the benchmarks (:mod:`kvlens.bench.bandwidth`): a pure read stream."""

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
