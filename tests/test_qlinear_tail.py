"""The weight decode kernels' tails. The f32 GEMV takes weight rows four at a time, then the last
ones of a 16-row block singly. The int4 kernel takes packed rows two at a time; a group whose packed
rows are odd in number ends in a single-row pass. With an odd ``k`` that row's high nibble is the
zero padding code, so only an even ``k`` with ``k / 2`` odd in the last group (38, 46) makes the
tail multiply a real high nibble."""

from __future__ import annotations

import pytest
import torch
from test_qlinear import EPS, LAYERS
from test_qlinear import test_layer_equals_its_dequantized_reference as layer_matches_reference

from kvlens.models.qlinear import linear, linear_rows


@pytest.mark.parametrize("kind", list(LAYERS))
@pytest.mark.parametrize("k", [38, 46])
@pytest.mark.parametrize("m", [1, 3])  # the decode kernel (the dequantize + GEMM path has no tail)
def test_an_odd_packed_row_at_a_group_end(kind, k, m):
    layer_matches_reference(kind, 37, k, m)


@pytest.mark.parametrize("n", [3, 37, 50])  # a block of 16 rows ending in 3, 1 and 2 single rows
def test_f32_rows_kernel_ragged_rows(n):
    """One f32 row (``linear``) and a batch of rows (``linear_rows``) through the JIT GEMV, whose last
    rows of a 16-row block that do not fill a group of four take a single-row pass."""
    g = torch.Generator().manual_seed(n)
    k = 45
    w, x, b = torch.randn(n, k, generator=g), torch.randn(3, k, generator=g), torch.randn(n, generator=g)
    ref = x.double() @ w.double().T + b.double()
    mag = x.abs().double() @ w.abs().double().T
    bound = 2 * k * EPS * mag + 1e-6  # f32 accumulation of k products
    assert ((linear(x[:1], w, b).double() - ref[:1]).abs() <= bound[:1]).all()
    assert ((linear_rows(x, w, b).double() - ref).abs() <= bound).all()
