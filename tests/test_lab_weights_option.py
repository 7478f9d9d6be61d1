"""`lab layers --weights` and `lab needle --weights` reach the model load (the sweep report's
commands name them to reproduce a cell's weights)."""

from __future__ import annotations

import json

import pytest

import kvlens
from kvlens.lab import layers, needle


class Loaded(Exception):
    """Raised by the spies once the load's arguments are seen: nothing runs past the load."""


def test_lab_layers_loads_the_weights_it_is_given(monkeypatch):
    def load_lab(model, corpus, base, weights="f32"):
        raise Loaded(model, base, weights)

    monkeypatch.setattr(layers, "load_lab", load_lab)
    with pytest.raises(Loaded) as seen:
        layers.main(layers.LayersConfig(model="m.gguf", kv="q8", weights="int8"))
    assert seen.value.args == ("m.gguf", "f32", "int8")
    with pytest.raises(Loaded) as seen:
        layers.main(layers.LayersConfig(model="m.gguf", kv="q8"))
    assert seen.value.args[2] == "f32"


def test_lab_needle_loads_the_weights_it_is_given(monkeypatch):
    def load(model, kv, weights=None):
        raise Loaded(model, kv.name, weights)

    monkeypatch.setattr(kvlens, "load", load)
    for weights in ("int8", "auto"):
        with pytest.raises(Loaded) as seen:
            needle.main(needle.NeedleConfig(model="m.gguf", ctx=[256], depth=[0.5], weights=weights))
        assert seen.value.args == ("m.gguf", "q8", weights)
    assert needle.NeedleConfig().weights == "auto"  # the file's own, as before the option existed


TINY_MODEL = ("llama", 3)  # conftest's tiny_dir


@pytest.mark.parametrize("weights", ["f32", "int8"])
def test_lab_layers_and_needle_name_the_weights_they_ran(tiny_dir, weights, capsys):
    """The weights measured are in each command's header and JSON, not only in its command line."""
    llm = kvlens.load(tiny_dir, kv="f32", attn_backend="torch", weights=weights)
    r = layers.run_layers(
        llm, "the cat sat on the mat. " * 20, layers.LayersConfig(kv="q8", ctx=32, chunks=1)
    )
    assert r.weights == r.to_json()["weights"] == weights
    assert f"weights {weights};" in layers.describe(r)[0]

    cfg = needle.NeedleConfig(model=str(tiny_dir), ctx=[256], depth=[0.5], weights=weights)
    needle.main(cfg, json_out=True)
    assert json.loads(capsys.readouterr().out)["weights"] == weights
    needle.main(cfg)
    assert f"weights {weights}" in capsys.readouterr().out
