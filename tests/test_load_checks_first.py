"""``kvlens.load`` checks every argument of its own before it reads the model: an unknown attention
backend, a bad prefill chunk and settings of the wrong type cost a whole model load before they were
named (4–9 s for SmolLM2, minutes for a large model). An empty model name was "``.`` is a directory
without config.json"."""

from __future__ import annotations

import pytest

import kvlens
from kvlens.engine import loading
from kvlens.engine.attention import BackendError
from kvlens.models.config import ModelLoadError


@pytest.fixture
def no_read(monkeypatch):
    """A model read is a test failure: the refusal has to come first."""

    def read(*args, **kwargs):
        raise AssertionError("the model was read before the arguments were checked")

    monkeypatch.setattr(loading, "load_model", read)


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"attn_backend": "bogus"}, BackendError, "unknown attention backend 'bogus'"),
        ({"attn_backend": 5}, TypeError, "attn_backend must be a str, got int 5"),
        ({"attn_backend": "numba", "device": "meta"}, ValueError, "unsupported device 'meta'"),
        ({"prefill_chunk": 0}, ValueError, "prefill_chunk must be ≥ 1, got 0"),
        ({"prefill_chunk": 1.5}, TypeError, "prefill_chunk must be an integer, got float 1.5"),
        ({"cache_options": "x"}, TypeError, "cache_options must be a CacheOptions, got str"),
        ({"sparse": "quest"}, TypeError, "sparse must be a SparseConfig or None, got str"),
        ({"kv": "q9"}, ValueError, "unknown KV cache mode 'q9'"),
        ({"weights": "int3"}, ValueError, "unknown weights mode 'int3'"),
    ],
)
def test_a_bad_argument_is_named_before_the_model_is_read(no_read, kwargs, error, words):
    with pytest.raises(error, match=words):
        kvlens.load("smollm2", **kwargs)


@pytest.mark.parametrize("name", ["", "   "])
def test_an_empty_model_name_is_called_empty(name):
    with pytest.raises(ModelLoadError, match="the model name is empty; give 'smollm2' or 'gemma3-270m'"):
        kvlens.load(name)


def test_good_arguments_reach_the_read(no_read):
    with pytest.raises(AssertionError, match="the model was read"):
        kvlens.load("smollm2", kv="f32", attn_backend="torch", prefill_chunk=7, weights="f32")
