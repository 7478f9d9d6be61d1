"""A store that grows keeps what it held: every kind's rows, scales and K code sums after a grow
equal, bit for bit, those of a store made at the larger size and written the same way."""

import pytest
import torch

from kvlens.kv.kinds import StoreKind
from kvlens.kv.stores import RowStore

N_KV, HEAD_DIM, SMALL, LARGE = 2, 64, 4, 8


@pytest.mark.parametrize("kind", list(StoreKind), ids=lambda k: k.value)
def test_growing_a_store_is_invisible(kind):
    gen = torch.Generator().manual_seed(11)
    rows = torch.randn(N_KV, LARGE, HEAD_DIM, generator=gen) * 3
    grown, made = (
        RowStore.empty(kind, N_KV, cap, HEAD_DIM, torch.device("cpu"), with_ksum=True)
        for cap in (SMALL, LARGE)
    )
    for store in (grown, made):
        store.write(0, store.basis(rows[:, :SMALL]))
    grown.grow(LARGE)
    assert grown.capacity == LARGE
    for store in (grown, made):
        store.write(SMALL, store.basis(rows[:, SMALL:]))
    for part in ("data", "scale", "ksum"):
        a, b = getattr(grown, part), getattr(made, part)
        assert (a is None) == (b is None), part
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b), part
    assert torch.equal(grown.read(0, LARGE), made.read(0, LARGE))
