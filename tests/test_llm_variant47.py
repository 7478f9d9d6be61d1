"""``LLM.variant`` checks the settings it changes as ``kvlens.load`` and ``LLM`` do: a sparse policy of
the wrong type, and a per-head recipe written for another number of KV heads, were taken by variant
without a word (a mutation run, forty-seventh session) and failed, or ran, later."""

from __future__ import annotations

import pytest

import kvlens
from kvlens.kv.modes import StoreKind
from kvlens.kv.recipe import head_recipe_mode

TINY_MODEL = ("qwen3", 5)  # conftest's tiny: 2 layers, 2 KV heads, head_dim 32
Q8, Q4 = StoreKind("q8"), StoreKind("q4")


def test_variant_refuses_a_sparse_policy_that_is_not_a_sparse_config(tiny):
    with pytest.raises(TypeError, match="^sparse must be a SparseConfig or None, got str"):
        tiny.variant(sparse="quest")
    with pytest.raises(TypeError, match="^sparse must be a SparseConfig or None, got str"):
        kvlens.LLM(tiny.loaded, sparse="quest")  # the same words as where the LLM is built


PAIRS = [(Q8, Q4), (Q4, Q8), (Q8, Q8), (Q4, Q4)]  # heads that differ: the recipe stays per head


@pytest.mark.parametrize("heads", [3, 4])
def test_variant_refuses_a_recipe_for_another_number_of_kv_heads(tiny, heads):
    assert tiny.config.n_kv_heads == 2
    mode = head_recipe_mode("r", [PAIRS[:heads], PAIRS[:heads]])
    message = f"gives layer 0 kinds for {heads} KV heads; the model has 2"
    with pytest.raises(ValueError, match=message):
        tiny.variant(kv=mode)
    with pytest.raises(ValueError, match=message):
        kvlens.LLM(tiny.loaded, kv=mode)
    two = tiny.variant(kv=head_recipe_mode("r", [PAIRS[:2], PAIRS[:2]]))
    assert two.kv.per_head
