"""µs per call of the pieces of a Gemma-3 q4h decode step: one row's 4-bit store (searched and q4_0),
the q8 store, the rotation of 4 query rows, and the Python-side plan of a windowed layer's attention;
then the q4h search's candidate sums, one function call per candidate against all candidates in
lanes (the alternative tried and not kept), µs per block of 32."""

import time

import numpy as np
from numba import njit

from kvlens.kernels.attend_step import StepPlan
from kvlens.kernels.q4store import Q4_SEARCH, _candidate_sums, hadamard_rows, store_q4_rows
from kvlens.kernels.q8store import store_q8_rows


def per_call(f, n: int = 3000) -> float:
    for _ in range(50):
        f()
    t = time.perf_counter()
    for _ in range(n):
        f()
    return 1e6 * (time.perf_counter() - t) / n


@njit(fastmath={"contract"})
def _lane_sums(iscales, xb, lx, l2):
    lx[:] = 0.0
    l2[:] = 0.0
    for i in range(32):
        xi = xb[i]
        for c in range(iscales.size):
            q = np.float64(min(max(np.rint(iscales[c] * xi), np.float32(-8.0)), np.float32(7.0)))
            lx[c] += q * np.float64(xi)
            l2[c] += q * q


@njit
def per_candidate(x):
    s = 0.0
    for r in range(x.shape[0]):
        for c in range(Q4_SEARCH.size):
            lx, l2 = _candidate_sums(-Q4_SEARCH[c] / x[r, 0], x[r])
            s += lx * lx / l2
    return s


@njit
def in_lanes(x):
    s = 0.0
    isc, lx, l2 = np.empty(Q4_SEARCH.size, np.float32), np.empty(Q4_SEARCH.size), np.empty(Q4_SEARCH.size)
    for r in range(x.shape[0]):
        for c in range(Q4_SEARCH.size):
            isc[c] = -Q4_SEARCH[c] / x[r, 0]
        _lane_sums(isc, x[r], lx, l2)
        for c in range(Q4_SEARCH.size):
            s += lx[c] * lx[c] / l2[c]
    return s


rng = np.random.default_rng(0)
row = rng.standard_normal((1, 1, 256)).astype(np.float32) * 3
data, bits = np.zeros((1, 16, 128), np.uint8), np.zeros((1, 16, 8), np.uint16)
print(f"store_q4_rows, 1 x 256, searched: {per_call(lambda: store_q4_rows(row, data, bits, 3, True)):.2f} µs")
print(
    f"store_q4_rows, 1 x 256, q4_0:     {per_call(lambda: store_q4_rows(row, data, bits, 3, False)):.2f} µs"
)
d8, s8, ksum = np.zeros((1, 16, 256), np.int8), np.zeros((1, 16), np.float32), np.zeros((1, 16, 8), np.int16)
print(f"store_q8_rows, 1 x 256:           {per_call(lambda: store_q8_rows(row, d8, s8, 3, ksum)):.2f} µs")
q = rng.standard_normal((4, 256)).astype(np.float32)
out, signs, ones = (
    np.empty_like(q),
    np.sign(rng.standard_normal(256)).astype(np.float32),
    np.ones(256, np.float32),
)
print(f"hadamard_rows, 4 x 256, span 32:  {per_call(lambda: hadamard_rows(q, signs, ones, 32, out)):.2f} µs")
print(f"StepPlan.of, 8K, window 512:      {per_call(lambda: StepPlan.of(1, 8192, 8000, 512, None)):.2f} µs")
print(f"StepPlan.of, 8K, no window:       {per_call(lambda: StepPlan.of(1, 8192, 8000, None, None)):.2f} µs")
blocks = (rng.standard_normal((20000, 32)) * 3).astype(np.float32)
for f in (per_candidate, in_lanes):
    f(blocks[:10])
    t = time.perf_counter()
    f(blocks)
    print(f"candidate sums, {f.__name__}: {1e6 * (time.perf_counter() - t) / len(blocks):.3f} µs per block")
