"""What `run_cell` hands on and records (mutmut survivors of the forty-sixth session): the cell's
weights to the loader, the reference and the label to the measurement, the git commit, and times that
hold when the load fails."""

from __future__ import annotations

import json
from types import SimpleNamespace

from kvlens import corpus
from kvlens.lab import common, sweep_cell


def test_run_cell_hands_on_the_cells_weights_reference_and_label(monkeypatch):
    llm = SimpleNamespace(loaded=SimpleNamespace(file_sha256="cd" * 32),
                          new_cache=lambda n, kv: SimpleNamespace(bytes_per_token=lambda: 7))  # fmt: skip
    ref, calls = object(), []
    monkeypatch.setattr(sweep_cell, "_models", lambda m, w: calls.append(("models", m, w)) or (llm, ref, 1.5))
    monkeypatch.setattr(corpus, "load_corpus", lambda name: ("the text", "the label"))

    def measure(c, got_llm, got_ref, text, label):
        calls.append(("measure", got_llm is llm, got_ref is ref, text, label))
        return {}

    monkeypatch.setattr(sweep_cell, "_measure", measure)
    c = {"measurement": "layers", "model": "m.gguf", "weights": "int4", "corpus": "c", "kv": "q8"}
    out = sweep_cell.run_cell("k", json.dumps(c), "local")
    assert out.status == "done" and calls == [
        ("models", "m.gguf", "int4"),
        ("measure", True, True, "the text", "the label"),
    ]
    assert (out.load_seconds, out.git_commit, out.kvlens_version) == (1.5, *reversed(sweep_cell.provenance()))


def test_a_failed_load_is_recorded_with_its_times(monkeypatch):
    def fail(model, weights):
        raise FileNotFoundError("gone")

    monkeypatch.setattr(sweep_cell, "_models", fail)
    out = sweep_cell.run_cell("k", json.dumps({"model": "m.gguf", "weights": "f32"}), "local")
    assert out.status == "failed" and out.error.startswith("FileNotFoundError: gone (at ")
    assert 0 <= out.run_seconds < 60 and out.git_commit == sweep_cell.provenance()[1]


def test_the_reference_is_loaded_beside_the_cells_own_model(monkeypatch):
    import kvlens

    monkeypatch.setattr(
        kvlens, "load", lambda m, kv, attn_backend, weights: SimpleNamespace(weights_mode=weights)
    )
    seen = []
    monkeypatch.setattr(common, "load_reference", lambda m, llm: seen.append((m, llm.weights_mode)) or "ref")
    monkeypatch.setitem(sweep_cell._LOADED, "model", None)
    monkeypatch.setitem(sweep_cell._LOADED, "llms", {})
    llm, ref, seconds = sweep_cell._models("m.gguf", "int8")
    assert (llm.weights_mode, ref, seen) == ("int8", "ref", [("m.gguf", "int8")]) and 0 <= seconds < 60
