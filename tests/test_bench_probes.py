"""The benchmarks' machine probes compute what they claim, so that their timings time that work: the
read stream sums every element (sizes that do not split evenly among the pieces included), and each
fork/join round reaches every thread's own row."""

from __future__ import annotations

import numpy as np
import pytest

from kvlens.kernels.probes import fork_joins, parallel_sum


@pytest.mark.parametrize(("size", "n_chunks"), [(1000, 3), (1001, 2), (7, 4), (64, 1)])
def test_parallel_sum_reads_every_element(size, n_chunks):
    a = np.arange(1, size + 1, dtype=np.float32)  # integer sums below 2^24: exact in f32
    assert parallel_sum(a, n_chunks) == size * (size + 1) // 2


def test_fork_joins_reach_every_row():
    lines = np.zeros((5, 16))
    fork_joins(lines, 7)
    assert (lines[:, 0] == 7).all() and (lines[:, 1:] == 0).all()
