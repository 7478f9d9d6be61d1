"""A layer split per KV head whose heads are all rotated, each by its own kind (what `lab plan
--per-head` makes from its default candidates q8h,q4h): the query and output rotations still apply,
head by head. test_recipe_heads covers layers that mix rotated and unrotated heads."""

import pytest
from test_recipe_heads import engine_logits, reference_logits, write

from kvlens.kv.cache import HeadSplitStore
from kvlens.kv.modes import StoreKind
from kvlens.kv.stores import rotations

Q8H, Q4H = StoreKind("q8h"), StoreKind("q4h")
HEADS = [[(Q8H, Q4H), (Q4H, Q8H)], [(Q8H, Q8H), (Q8H, Q8H)]]  # layer 0: both heads rotated, kinds differ
LAYERS = [{"k": ["q8h", "q4h"], "v": ["q4h", "q8h"]}, {"k": "q8h", "v": "q8h"}]

TINY_MODEL = ("qwen3", 5)  # conftest's tiny: 2 layers, 2 KV heads, head_dim 32


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_all_rotated_heads_match_a_per_head_reference(tmp_path, tiny, backend):
    ids = list(range(5, 46))
    ref = reference_logits(tiny, ids, HEADS)
    llm = tiny.variant(kv=write(tmp_path / "r.json", LAYERS), attn_backend=backend)
    cache = llm.new_cache(len(ids))  # what the run below makes: the stores of a split, rotated layer
    assert isinstance(cache.k[0], HeadSplitStore)
    assert rotations(cache.k[0], cache.v[0]) == ([32, 32], [32, 32])
    got = engine_logits(llm, ids)
    # f32 engine vs f64 reference on the same quantized values: f32 rounding only, as in test_recipe_heads
    assert (got - ref).abs().max() < 2e-3 * ref.abs().max()
