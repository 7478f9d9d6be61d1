"""The sweep spec's rules that ``test_sweep`` leaves open, on specs written here: every measurement
setting's range, needle's lists, paths relative to the spec's folder, the cell's label, and the
results store's schema version and status filter. (No cell runs: only the spec is parsed.)"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from kvlens.lab.store import CellOutcome, Store, StoreError
from kvlens.lab.sweep_spec import SpecError, parse_spec


def spec(
    tmp_path: Path,
    body: str = "",
    measurements: str = '["ppl"]',
    model: str = "model.gguf",
    corpus: str = "text.txt",
) -> list:
    """Parse a spec in ``tmp_path/specs`` naming ``model`` and ``corpus``; a model file and a corpus
    file (model.gguf, text.txt) are written beside it."""
    folder = tmp_path / "specs"
    folder.mkdir(exist_ok=True)
    (folder / "model.gguf").write_bytes(b"GGUF")  # only its existence is checked when parsing
    (folder / "text.txt").write_text("some text\n", encoding="utf-8")
    head = (
        f'[sweep]\nmodels = ["{model}"]\nkv = ["q8"]\ncorpora = ["{corpus}"]\n'
        f"ctx = [64]\nmeasurements = {measurements}\n"
    )
    return parse_spec(head + body, folder / "spec.toml")


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ("[ppl]\nkeep_sink = -1\n", "ppl.keep_sink must be >= 0 (got -1)"),
        ("[ppl]\nkeep_recent = -2\n", "ppl.keep_recent must be >= 0 (got -2)"),
        ("[ppl]\nprefill_chunk = 0\n", "ppl.prefill_chunk must be at least 1 (got 0)"),
        ("[greedy]\ntokens = 0\n", "greedy.tokens must be at least 1 (got 0)"),
        ("[greedy]\nprompts = 0\n", "greedy.prompts must be at least 1 (got 0)"),
        ("[layers]\nchunks = 0\n", "layers.chunks must be at least 1 (got 0)"),
        ("[needle]\ndense_layers = -1\n", "needle.dense_layers must be >= 0 (got -1)"),
        ("[needle]\ndepths = [0.5, 1.5]\n", "needle.depths: every depth must lie in [0, 1]"),
        ("[needle]\ndepths = [-0.1]\n", "needle.depths: every depth must lie in [0, 1]"),
        ("[needle]\nbudgets = [0.25, 0]\n", "needle.budgets: budgets must be finite and > 0"),
        ("[needle]\nbudgets = [nan]\n", "needle.budgets: budgets must be finite and > 0"),
        ("[needle]\nbudgets = [inf]\n", "needle.budgets: budgets must be finite and > 0"),
        ("[needle]\nmethod = 'topk'\n", "needle.method must be quest or probe (got 'topk')"),
        ("[needle]\nbudgets = [0.25, 0.25]\n", "needle.budgets lists '0.25' more than once"),
        ("[needle]\nseed = true\n", "needle.seed must be an integer (got bool True)"),
    ],
)
def test_every_setting_is_checked_where_it_is_given(tmp_path, body, words):
    measurement = body.split("]")[0][1:]
    with pytest.raises(SpecError) as e:
        spec(tmp_path, body, f'["{measurement}"]')
    assert words in str(e.value) and str(tmp_path / "specs" / "spec.toml") in str(e.value)


def test_needle_lists_take_whole_numbers_as_floats(tmp_path):
    (cell,) = spec(tmp_path, "[needle]\ndepths = [0, 1]\nbudgets = [1]\n", '["needle"]')
    params = dict(cell.params)
    assert params["depths"] == (0.0, 1.0) and params["budgets"] == (1.0,)
    assert all(isinstance(x, float) for x in params["depths"] + params["budgets"])


def test_paths_are_relative_to_the_spec_s_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # elsewhere: a path relative to here would not exist
    (cell,) = spec(tmp_path)
    assert cell.model == str((tmp_path / "specs" / "model.gguf").resolve())
    assert cell.corpus == str((tmp_path / "specs" / "text.txt").resolve())
    with pytest.raises(SpecError, match="sweep.models\\[0\\]: model file 'other.gguf' does not exist"):
        spec(tmp_path, model="other.gguf")


def test_a_corpus_reached_through_a_link_is_stored_by_its_real_path(tmp_path):
    """Two spellings of one file are one corpus: the cell (and its key) holds the resolved path."""
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "text.txt").write_text("x\n", encoding="utf-8")
    (tmp_path / "specs").mkdir()
    (tmp_path / "specs" / "alias.txt").symlink_to(tmp_path / "real" / "text.txt")
    (cell,) = spec(tmp_path, corpus="alias.txt")
    assert cell.corpus == str((tmp_path / "real" / "text.txt").resolve())


def test_a_cell_s_label_names_files_by_their_names(tmp_path):
    (cell,) = spec(tmp_path)
    assert cell.label == "ppl model.gguf weights f32 kv q8 text.txt ctx 64"


def outcome(key: str, status: str) -> CellOutcome:
    config = '{"corpus":"c","ctx":64,"kv":"q8","measurement":"ppl","model":"m","weights":"f32"}'
    return CellOutcome(
        key, config, status, None if status == "done" else "ValueError: x", {} if status == "done" else None
    )


def test_the_store_filters_by_status_and_refuses_another_schema(tmp_path):
    db = tmp_path / "s.sqlite"
    with Store(db) as store:
        store.record(outcome("a", "done"), None)
        store.record(outcome("b", "failed"), None)
        assert [r["cell_key"] for r in store.rows("failed")] == ["b"]
        assert [r["cell_key"] for r in store.rows("done")] == ["a"]
        assert [r[0] for r in store.done_with("$.x")] == ["a"]
        assert [r["cell_key"] for r in store.rows()] == ["a", "b"]
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE meta SET value = '2' WHERE key = 'schema_version'")
    with pytest.raises(StoreError, match="sweep store schema 2, expected 1"):
        Store(db)
