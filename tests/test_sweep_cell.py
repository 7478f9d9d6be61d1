"""A sweep cell hands the lab run exactly the cell's settings, loads each model once and the f32
reference only for other weights, and records the machine's ISA flags as /proc/cpuinfo lists them.
The lab's run functions and the loader are spies here: what is checked is what reaches them."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest

import kvlens
from kvlens.lab import common, greedy, layers, needle, ppl, sweep_cell
from kvlens.lab.needle import NeedleRow

LLM, REF = object(), object()


def cell(measurement: str, **over: object) -> dict:
    c = {
        "measurement": measurement, "kv": "q8-k", "ctx": 96, "chunks": 3, "base": "f16",
        "prefill_chunk": 8, "prompts": 5, "tokens": 7, "depths": [0.25, 0.75], "method": "probe",
        "budgets": [64.0, 0.5], "dense_layers": 3, "seed": 11, "weights": "int8",
    }  # fmt: skip
    return c | over


@pytest.fixture
def runs(monkeypatch):
    """Each lab run function replaced by a spy recording (llm, cfg, ref)."""
    seen = []

    def spy(name):
        def run(llm, text, cfg, *args, ref_llm=None, **kw):
            seen.append((name, llm, cfg, ref_llm))
            if name == "needle":
                return [NeedleRow(96, 0.25, "dense", True, "12345", "12345")]
            return SimpleNamespace(to_json=lambda: {"ran": name})

        return run

    for module, name in (
        (ppl, "run_ppl"),
        (greedy, "run_greedy"),
        (layers, "run_layers"),
        (needle, "run_needle"),
    ):
        monkeypatch.setattr(module, name, spy(name.removeprefix("run_")))
    return seen


def measured(runs, c: dict):
    sweep_cell._measure(c, LLM, REF, "text", "label")
    (name, llm, cfg, ref), *_ = runs
    assert llm is LLM
    return name, cfg, ref


def test_ppl_cell_settings(runs):
    name, cfg, ref = measured(runs, cell("ppl", keep_sink=4, keep_recent=16))
    assert (name, ref) == ("ppl", REF) and [m.name for m in cfg.kv] == ["q8-k"] and cfg.base.name == "f16"
    assert (cfg.ctx, cfg.chunks, cfg.prefill_chunk, cfg.keep_sink, cfg.keep_recent) == (96, 3, 8, 4, 16)


def test_greedy_cell_settings(runs):
    name, cfg, ref = measured(runs, cell("greedy", keep_recent=16))
    assert (name, ref) == ("greedy", REF) and cfg.base.name == "f16"
    assert (cfg.ctx, cfg.prompts, cfg.tokens, cfg.prefill_chunk, cfg.keep_recent) == (96, 5, 7, 8, 16)


def test_layers_cell_settings(runs):
    name, cfg, _ = measured(runs, cell("layers", keep_sink=4, keep_recent=16))
    assert name == "layers" and [m.name for m in cfg.kv] == ["q8-k"]
    assert (cfg.ctx, cfg.chunks, cfg.keep_sink, cfg.keep_recent, cfg.weights) == (96, 3, 4, 16, "int8")


def test_needle_cell_settings(runs):
    out = sweep_cell._measure(cell("needle"), LLM, REF, "text", "label")
    ((name, _, cfg, _),) = runs
    assert name == "needle" and cfg.kv.name == "q8-k" and cfg.weights == "int8"
    assert (cfg.ctx, cfg.depth, cfg.sparse, cfg.sparse_budget) == ([96], [0.25, 0.75], "probe", [64.0, 0.5])
    assert (cfg.dense_layers, cfg.seed) == (3, 11)
    assert out["recall"] == {"dense": 1.0}


def test_models_load_once_per_model_and_the_reference_only_for_other_weights(monkeypatch):
    loads, refs = [], []

    def load(model, kv, attn_backend, weights):
        loads.append((model, weights))
        return SimpleNamespace(model=model, weights_mode=weights)

    def reference(model, llm):
        refs.append(model)
        return SimpleNamespace(model=model, weights_mode="f32")

    monkeypatch.setattr(kvlens, "load", load)
    monkeypatch.setattr(common, "load_reference", reference)
    monkeypatch.setitem(sweep_cell._LOADED, "model", None)
    monkeypatch.setitem(sweep_cell._LOADED, "llms", {})
    f32, ref, _ = sweep_cell._models("a.gguf", "f32")
    assert f32.model == "a.gguf" and ref is None and not refs
    assert sweep_cell._models("a.gguf", "f32")[0] is f32  # kept loaded
    llm, ref, _ = sweep_cell._models("a.gguf", "int8")  # the f32 model loaded already is its reference
    assert llm.weights_mode == "int8" and ref is f32 and not refs
    llm, ref, _ = sweep_cell._models("b.gguf", "int8")  # a new model evicts the old one
    assert (llm.model, ref.model) == ("b.gguf", "b.gguf") and refs == ["b.gguf"]
    sweep_cell._models("a.gguf", "f32")
    assert loads == [("a.gguf", "f32"), ("a.gguf", "int8"), ("b.gguf", "int8"), ("a.gguf", "f32")]


def test_isa_flags_are_those_cpuinfo_lists():
    text = "processor\t: 0\nmodel name\t: Some CPU @ 2.0GHz\nflags\t\t: fpu sse2 avx2 fma avx512f amx_tile\n"
    assert sweep_cell.cpu_of(text) == ("Some CPU @ 2.0GHz", ["avx2", "fma", "avx512f", "amx_tile"])
    assert sweep_cell.cpu_of("model name\t: X\nflags\t: fpu sse2\n") == ("X", [])


def test_a_cell_stores_its_modes_bytes_per_token_or_its_failure(runs, monkeypatch):
    """A done cell's result carries the KV bytes per token of the cell's own mode; a cell whose run
    raises is stored failed, with the exception and where it was raised."""
    import json

    from kvlens import corpus

    engine = SimpleNamespace(
        new_cache=lambda n, kv: SimpleNamespace(bytes_per_token=lambda: {"q8-k": 123}[kv]),
        loaded=SimpleNamespace(file_sha256="ab" * 32),
    )
    monkeypatch.setattr(sweep_cell, "_models", lambda model, weights: (engine, None, 0.5))
    monkeypatch.setattr(corpus, "load_corpus", lambda name: ("text", "label"))
    out = sweep_cell.run_cell("key", json.dumps(cell("layers", model="m.gguf", corpus="c")), "local")
    assert (out.status, out.error, out.load_seconds) == ("done", None, 0.5)
    inputs = {"model_sha256": "ab" * 32, "corpus_sha256": hashlib.sha256(b"text").hexdigest()}
    assert out.result == {"ran": "layers", "kv_bytes_per_token": 123, "inputs": inputs} and out.metrics == {}
    out = sweep_cell.run_cell("key", json.dumps(cell("perplexity", model="m.gguf", corpus="c")), "local")
    assert out.status == "failed" and out.result is None
    assert out.error.startswith("ValueError: unknown measurement 'perplexity' (at sweep_cell.py:")
