"""A recipe layer that lists its KV heads names how many the model must have, whether or not the
listed kinds agree: a layer of three agreeing heads folds into one pair (``KVMode.heads``), and
before, that fold dropped the count, so the recipe ran on a 2-KV-head model while the same recipe
with one head's kind changed was refused. The fold itself still holds: the mode equals the one
written without lists."""

from __future__ import annotations

import pytest
from test_recipe_heads import write

import kvlens
from kvlens.kv.modes import KVMode

TINY_MODEL = ("qwen3", 5)  # conftest's tiny_dir / tiny: 2 layers, 2 KV heads, head_dim 32


@pytest.mark.parametrize(
    "layers,bad_layer,count",
    [
        ([{"k": ["q8"] * 3, "v": "q8"}] * 2, 0, 3),  # agreeing heads, one role listed
        ([{"k": "q8", "v": "q8"}, {"k": ["q4"], "v": ["q4"]}], 1, 1),  # one listed head, the second layer
        ([{"k": ["q8", "q8"], "v": ["q8", "q8"]}, {"k": ["q8"] * 3, "v": ["q4"] * 3}], 1, 3),
    ],
)
def test_a_listed_head_count_the_model_lacks_is_refused(tmp_path, tiny, tiny_dir, layers, bad_layer, count):
    recipe = write(tmp_path / "r.json", layers)
    msg = f"gives layer {bad_layer} kinds for {count} KV heads; the model has 2"
    with pytest.raises(ValueError, match=msg):
        tiny.variant(kv=recipe)
    with pytest.raises(ValueError, match=msg):
        kvlens.load(tiny_dir, kv=recipe)


def test_the_right_listed_count_folds_and_runs(tmp_path, tiny):
    listed = KVMode.parse(write(tmp_path / "listed.json", [{"k": ["q8", "q8"], "v": ["q4", "q4"]}] * 2))
    plain = KVMode.parse(write(tmp_path / "plain.json", [{"k": "q8", "v": "q4"}] * 2))
    assert listed.heads == () and listed.layers == plain.layers and listed.listed_kv_heads == (2, 2)
    ids = [5, 17, 200, 33]
    runs = [
        list(tiny.variant(kv=str(tmp_path / f)).generate_ids(ids, 3, stop_at_eos=False))
        for f in ("listed.json", "plain.json")
    ]
    assert runs[0] == runs[1] and len(runs[0]) == 3
