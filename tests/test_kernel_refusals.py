"""The decode kernels' refusals at their exact edges, the same for the numba and the Triton kernel: a
selected block must start below the length, and a block table entry must name one of the store's
blocks (the last one is accepted, the one past it refused, before any row is read)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kvlens.kernels import cpu
from kvlens.kv.cache import BLOCK, KVCache
from kvlens.kv.modes import MODES

KERNELS = [
    pytest.param("numba", id="numba"),
    pytest.param(
        "triton",
        id="triton",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("triton") is None, reason="triton is not installed"
        ),
    ),
]


def _kernel(name: str):
    if name == "numba":
        return cpu.decode_attention
    from kvlens.kernels.gpu import decode_attention_triton  # conftest sets TRITON_INTERPRET=1 on CPU

    return decode_attention_triton


@pytest.fixture(scope="module")
def layer():
    g = torch.Generator().manual_seed(0)
    c = KVCache(1, 2, 32, 4 * BLOCK, MODES["q8"])  # four blocks of rows
    c.write(0, 0, torch.randn(2, 4 * BLOCK, 32, generator=g), torch.randn(2, 4 * BLOCK, 32, generator=g))
    return torch.randn(6, 32, generator=g), c.k[0], c.v[0]


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_selected_block_must_start_below_the_length(kernel, layer):
    q, k, v = layer
    run = _kernel(kernel)
    assert run(q, k, v, 2 * BLOCK, blocks=torch.tensor([[0, 1], [1, 1]], dtype=torch.int32)).isfinite().all()
    with pytest.raises(ValueError, match="block"):
        run(q, k, v, 2 * BLOCK, blocks=torch.tensor([[0, 2], [1, 1]], dtype=torch.int32))


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_table_entry_must_name_a_block_of_the_store(kernel, layer):
    q, k, v = layer
    run = _kernel(kernel)
    assert run(q, k, v, 2 * BLOCK, table=torch.tensor([3, 0, 1, 2], dtype=torch.int32)).isfinite().all()
    with pytest.raises(ValueError, match="outside the store's 4 blocks"):
        run(q, k, v, 2 * BLOCK, table=torch.tensor([0, 4, 1, 2], dtype=torch.int32))
