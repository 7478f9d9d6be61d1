"""The quantized-weight decode kernels' tail: a group whose packed int4 rows are odd in number ends in a
single-row pass. With an odd ``k`` that row's high nibble is the zero padding code, so only an even
``k`` with ``k / 2`` odd in the last group (38, 46) makes the tail multiply a real high nibble."""

from __future__ import annotations

import pytest
from test_qlinear import LAYERS
from test_qlinear import test_layer_equals_its_dequantized_reference as layer_matches_reference


@pytest.mark.parametrize("kind", list(LAYERS))
@pytest.mark.parametrize("k", [38, 46])
@pytest.mark.parametrize("m", [1, 3])  # the decode kernel (the dequantize + GEMM path has no tail)
def test_an_odd_packed_row_at_a_group_end(kind, k, m):
    layer_matches_reference(kind, 37, k, m)
