"""Where ``kvlens lab plan`` takes its calibration and held-out chunks: first and after (the default),
or spread evenly through the text (``--calib-spread``); the places written to the JSON, a reused
measurement refused when its calibration chunks are not this run's, and the doctor measuring on a
plan's own calibration chunks."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlens.lab.doctor as doctor
from kvlens.kv.modes import StoreKind
from kvlens.lab import plan
from kvlens.lab.doctor import DoctorConfig, run_doctor
from kvlens.lab.plan import PlanConfig, chunk_layout, plan_chunks, run_plan
from kvlens.lab.ppl import make_chunks

TINY_MODEL = ("qwen3", 5)  # conftest's tiny_dir / tiny: 2 layers, 2 KV heads, head_dim 32


@given(st.integers(1, 12), st.integers(0, 30), st.booleans())
@settings(max_examples=200, deadline=None)
def test_layout_is_disjoint_and_covers_the_chunks(calib, heldout, spread):
    first, held = chunk_layout(calib, heldout, spread)
    assert len(first) == calib and len(held) == heldout
    assert sorted(first + held) == list(range(calib + heldout))  # disjoint, every chunk used once
    assert first == sorted(first) and held == sorted(held)
    if not spread:
        assert first == list(range(calib))
    else:  # evenly: from chunk 0, steps of need // calib or one more
        steps = {b - a for a, b in zip(first, first[1:], strict=False)}
        need = calib + heldout
        assert first[0] == 0 and steps <= {need // calib, need // calib + 1}


def test_spread_layouts_by_hand():
    assert chunk_layout(4, 8, True) == ([0, 3, 6, 9], [1, 2, 4, 5, 7, 8, 10, 11])
    assert chunk_layout(2, 4, True) == ([0, 3], [1, 2, 4, 5])
    assert chunk_layout(3, 4, True) == ([0, 2, 4], [1, 3, 5, 6])
    assert chunk_layout(4, 8, False) == ([0, 1, 2, 3], list(range(4, 12)))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(" ".join(f"a {w} on the {w % 7} mat" for w in range(400)))
    return path


def test_spread_plan_measures_and_verifies_where_it_says(tmp_path, tiny, tiny_dir, corpus, monkeypatch):
    cfg = PlanConfig(
        model=str(tiny_dir), corpus=str(corpus), kld_budget=0.01, ctx=48, calib_chunks=2, heldout_chunks=3,
        out=str(tmp_path / "r.json"), kv="q8", calib_spread=True, smooth_k=False,
    )  # fmt: skip
    text = corpus.read_text()
    bos = tiny.tokenizer.bos_prefix[0] if tiny.tokenizer.bos_prefix else None
    chunks = make_chunks(tiny.tokenizer.encode(text), 48, None, bos)
    assert len(chunks) >= 5
    calib, held = plan_chunks(tiny, text, cfg)
    assert calib == [chunks[0], chunks[2]] and held == [chunks[1], chunks[3], chunks[4]]
    plan = run_plan(cfg)
    data = plan.to_json()
    assert data["calib_index"] == [0, 2] and data["heldout_index"] == [1, 3, 4]
    assert data["calib_chunks"] == 2 and data["heldout_chunks"] == 3
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    # reused only with the same calibration chunks
    with pytest.raises(ValueError, match=r"calibration chunks \[0, 2\]; this run's are \[0, 1\]"):
        run_plan(dataclasses.replace(cfg, reuse=str(path), calib_spread=False))
    again = run_plan(dataclasses.replace(cfg, reuse=str(path), verify=False))
    assert again.recipe.layers == plan.recipe.layers and again.heldout_index == []
    # the doctor, given the plan, measures on the plan's calibration chunks
    seen = []
    real = doctor.Sensitivity

    def recording(llm, chunks_, *args, **kwargs):
        seen.append(chunks_)
        return real(llm, chunks_, *args, **kwargs)

    monkeypatch.setattr(doctor, "Sensitivity", recording)
    run_doctor(DoctorConfig(model=str(tiny_dir), corpus=str(corpus), kld_budget=0.01, plan=str(path)))
    assert seen == [[chunks[0], chunks[2]]]


def test_old_plan_output_reads_as_the_first_chunks(tmp_path, tiny, tiny_dir, corpus):
    cfg = PlanConfig(
        model=str(tiny_dir), corpus=str(corpus), kld_budget=0.01, ctx=48, calib_chunks=2, heldout_chunks=1,
        out=str(tmp_path / "r.json"), kv="q8", verify=False, smooth_k=False,
    )  # fmt: skip
    data = run_plan(cfg).to_json()
    del data["calib_index"], data["heldout_index"]  # an output from before the places were written
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    run_plan(dataclasses.replace(cfg, reuse=str(path)))  # the first chunks: this run's
    with pytest.raises(ValueError, match="measured on calibration chunks"):
        run_plan(dataclasses.replace(cfg, reuse=str(path), calib_spread=True, heldout_chunks=2))
    data["calib_index"] = [0, 0]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="does not name distinct chunks"):
        run_plan(dataclasses.replace(cfg, reuse=str(path)))


def test_kept_positions_reach_every_measurement_of_the_plan(tmp_path, tiny_dir, corpus):
    """``keep_recent`` covering the whole chunk: every probe and every verified mode reads f32 rows
    only, so each costs no KLD (f32 rows through the same torch attention as the f32 base) and the
    choice takes the cheapest candidate everywhere. ``keep_sink`` covering it: every probe reads the
    same f16 rows whatever the candidate kind, so the kinds of a (layer, role) cost the same. Without
    either, the same plan measures real costs."""
    cfg = PlanConfig(
        model=str(tiny_dir), corpus=str(corpus), kld_budget=0.01, ctx=48, calib_chunks=1, heldout_chunks=2,
        out=str(tmp_path / "r.json"), kv="q8", smooth_k=False, per_head=False,
    )  # fmt: skip
    plain = run_plan(cfg)
    kept = run_plan(dataclasses.replace(cfg, keep_recent=48, out=str(tmp_path / "kept.json")))
    sink = run_plan(dataclasses.replace(cfg, keep_sink=48, out=str(tmp_path / "sink.json")))
    # without: q8h's smallest cost here ~3e-8, q8's held-out ~3e-7. With: only f32 rounding differs from
    # the base (the rotated kinds' turns, sub-chunked prefill), moving each logit by ~1e-7 of its size
    # (the tiny model's are O(1)): KLD ~ delta^2 / 2 <= ~1e-13 on any CPU (printed here: ~1e-15)
    assert min(plain.sensitivity.values()) > 1e-9 and min(r["kld_mean"] for r in plain.rows) > 1e-8
    assert max(kept.sensitivity.values()) < 1e-12
    assert max(r["kld_mean"] for r in kept.rows) < 1e-12  # the recipe and q8, f32 rows spliced in
    for result in (kept, sink):
        assert {k for layer in result.recipe.layers for k in layer} == {StoreKind.Q4H}
    groups: dict[str, set[float]] = {}
    for key, cost in sink.sensitivity.items():  # "layer.role.kind": the rotated kinds read one f16 row
        groups.setdefault(key.rsplit(".", 1)[0], set()).add(cost)
    assert all(len(costs) == 1 for costs in groups.values()), groups
    # f16 rounding (2^-11 of each row) moves the logits by ~1e-5 of their size: KLD ~1e-10 (printed ~6e-10)
    assert max(sink.sensitivity.values()) < 1e-8 and max(r["kld_mean"] for r in sink.rows) < 1e-8
    data, sink_data = kept.to_json(), sink.to_json()
    assert data["keep_recent"] == 48 and data["keep_sink"] == 0 and plain.to_json()["keep_recent"] == 0
    assert (
        sink_data["keep_sink"] == 48 and json.loads((tmp_path / "sink.json").read_text())["keep_sink"] == 48
    )
    assert "keep_sink" not in json.loads((tmp_path / "kept.json").read_text())


def test_the_verification_runs_through_the_named_decode_kernel(tmp_path, tiny_dir, corpus, monkeypatch):
    """``attn_backend``: the held-out verification's test modes run their scored positions as decode
    steps through that kernel (the calibration stays on torch); a bad name fails before any work."""
    seen = []
    real_init = plan._PplRun.__init__

    def spy(self, llm, cfg, *args):
        seen.append((cfg.attn_backend, len(cfg.kv)))
        real_init(self, llm, cfg, *args)

    monkeypatch.setattr(plan._PplRun, "__init__", spy)
    cfg = PlanConfig(
        model=str(tiny_dir), corpus=str(corpus), kld_budget=0.01, ctx=48, calib_chunks=1, heldout_chunks=1,
        out=str(tmp_path / "r.json"), kv="q8", smooth_k=False, per_head=False, attn_backend="numba",
    )  # fmt: skip
    result = run_plan(cfg)
    assert seen == [("numba", 2)] and result.attn_backend == "numba"  # the recipe and q8, verified once
    assert result.to_json()["attn_backend"] == "numba" and 0 < result.rows[1]["kld_mean"] < 1e-3
    with pytest.raises(ValueError, match="unknown attention backend"):
        PlanConfig(model=str(tiny_dir), attn_backend="numba-fast")


def test_the_doctor_refuses_kept_positions(tiny_dir, corpus):
    with pytest.raises(ValueError, match="keep_sink and keep_recent must be 0"):
        DoctorConfig(model=str(tiny_dir), corpus=str(corpus), keep_sink=1)
