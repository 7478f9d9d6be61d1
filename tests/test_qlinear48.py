"""The dequantize-then-GEMM path of a quantized layer over several tile steps with a ragged last
one, and inputs with more than one leading dimension: the forty-eighth session's mutation run found
both unchecked (every earlier shape fit in one step, every input was 2-D)."""

from __future__ import annotations

import pytest
import torch

from kvlens.models.qlinear import SMALL_M, TILE, TILE_ELEMS, BF16Linear, Int4Linear, Int8Linear

EPS = 2.0**-24
LAYERS = [Int8Linear, Int4Linear, BF16Linear]


def within_f32_of_float64(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> bool:
    """|y - x·wᵀ - b| within f32 accumulation of k products (k·eps·Σ|x||w|) and the bias add."""
    k = x.shape[-1]
    mag = x.abs().double() @ w.abs().double().T + b.abs().double()
    return bool(
        ((y.double() - (x.double() @ w.double().T + b.double())).abs() <= 2 * (k + 1) * EPS * mag).all()
    )


@pytest.mark.parametrize("kind", LAYERS)
def test_gemm_path_over_several_tile_steps_with_a_ragged_end(kind):
    n, k = 600, 4096
    step_rows = TILE_ELEMS // (k * TILE) * TILE
    assert step_rows < n and n % step_rows and n % TILE  # three steps, the last one ragged
    g = torch.Generator().manual_seed(5)
    layer = kind.from_float(torch.randn(n, k, generator=g))
    x, b = torch.randn(SMALL_M + 1, k, generator=g), torch.randn(n, generator=g)
    assert within_f32_of_float64(layer(x, b), x, layer.dequantize(), b)


@pytest.mark.parametrize("kind", LAYERS)
@pytest.mark.parametrize("lead", [(2, 3), (2, 3 * SMALL_M)])  # the row kernel, the GEMM path
def test_leading_dimensions_are_kept(kind, lead):
    g = torch.Generator().manual_seed(6)
    layer = kind.from_float(torch.randn(40, 70, generator=g))
    x, b = torch.randn(*lead, 70, generator=g), torch.randn(40, generator=g)
    y = layer(x, b)
    assert y.shape == (*lead, 40)
    assert within_f32_of_float64(y.reshape(-1, 40), x.reshape(-1, 70), layer.dequantize(), b)
