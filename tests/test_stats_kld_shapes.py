"""``token_kld`` takes the KL divergence over the last dimension whatever the leading ones, as its
docstring says: one distribution ``[V]`` and a batch of chunks ``[B, n, V]`` against the float64 numpy
rule of ``test_stats``, row by row."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_stats import numpy_kld

from kvlens.lab.stats import token_kld


def test_one_distribution() -> None:
    g = torch.Generator().manual_seed(1)
    base, q = torch.randn(40, generator=g) * 3, torch.randn(40, generator=g) * 3
    got = token_kld(base, q)
    assert got.shape == () and float(got) == pytest.approx(
        float(numpy_kld(base.double().numpy(), q.double().numpy())), rel=1e-12
    )


def test_a_batch_of_chunks() -> None:
    g = torch.Generator().manual_seed(2)
    base, q = torch.randn(3, 5, 32, generator=g) * 4, torch.randn(3, 5, 32, generator=g) * 4
    got = token_kld(base, q)
    assert got.shape == (3, 5)
    want = numpy_kld(base.numpy().astype(np.float64), q.numpy().astype(np.float64))
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12)
