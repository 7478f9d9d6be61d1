"""q4h's searched step at fp16's edge: a block whose step is exactly 65504 (fp16's largest finite
value) is stored, bit for bit, by the torch rule and by the compiled store; the next float32 up is
refused by both. A constant block of 8 x 65504 = 524032 searches to codes -8 and step -65504 (every
candidate fits a constant block exactly; the first, 8 / max, wins the tie)."""

import numpy as np
import pytest
import torch

from kvlens.kv.kinds import StoreKind
from kvlens.kv.quant import quantize_q4
from kvlens.kv.stores import RowStore

EDGE = 8 * 65504.0
PAST = float(np.nextafter(np.float32(EDGE), np.float32(np.inf)))


def test_the_torch_rule_stores_a_step_of_65504_and_refuses_past_it():
    q, d16 = quantize_q4(torch.full((1, 32), EDGE), search=True)
    assert q.unique().tolist() == [-8] and d16.tolist() == [[-65504.0]]
    with pytest.raises(ValueError, match="fp16"):
        quantize_q4(torch.full((1, 32), PAST), search=True)


def test_the_compiled_store_agrees_at_the_edge():
    store = RowStore.empty(StoreKind("q4h"), 1, 2, 32, torch.device("cpu"))
    store.write(0, torch.full((1, 1, 32), EDGE))  # rows already in the store's basis
    assert torch.equal(store.read(0, 1), torch.full((1, 1, 32), EDGE))
    with pytest.raises(ValueError, match="fp16"):
        store.write(1, torch.full((1, 1, 32), PAST))
