"""Python API calls the thirty-sixth session's sweep found answered by an AttributeError from inside
(or taken, to fail at the first forward): each is a TypeError naming the argument now."""

from __future__ import annotations

import pytest

import kvlens
from kvlens.kv.blocks import SparseConfig
from kvlens.kv.modes import CacheOptions

TINY_MODEL = ("llama", 3)


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"bogus": 1}, "LLM has no setting 'bogus'"),
        ({"attn_backend": None}, "attn_backend must be a str, got NoneType"),
        ({"sparse": "quest"}, "sparse must be a SparseConfig or None, got str"),
        ({"cache_options": 5}, "cache_options must be a CacheOptions, got int"),
    ],
)
def test_variant_names_a_bad_setting(tiny, changes, named):
    with pytest.raises(TypeError, match=named):
        tiny.variant(**changes)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"attn_backend": None}, "attn_backend must be a str"),
        ({"cache_options": "x"}, "cache_options must be a CacheOptions, got str"),
        ({"sparse": "quest"}, "sparse must be a SparseConfig or None, got str"),
    ],
)
def test_load_names_a_bad_setting(tiny_dir, options, named):
    with pytest.raises(TypeError, match=named):
        kvlens.load(tiny_dir, **options)


def test_the_settings_of_the_right_types_are_taken(tiny):
    tiny.variant(sparse=SparseConfig("quest", 64), cache_options=CacheOptions(), attn_backend="torch")


@pytest.mark.parametrize("call", ["forward", "prefill"])
def test_a_cache_that_is_not_one_is_named(tiny, call):
    run = (
        (lambda: tiny.forward([1, 2], None, 0)) if call == "forward" else (lambda: tiny.prefill([1, 2], None))
    )
    with pytest.raises(TypeError, match="cache must be a KVCache"):
        run()
