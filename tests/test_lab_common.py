"""What the lab commands share (kvlens.lab.common), on hand-written cases: the mode-list rules, the
configs' refusals at construction, which mode runs the base's own path, the header and label lines,
and what the loaders ask the engine for (a stand-in ``kvlens.load`` records the calls)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import kvlens
from kvlens.kv.modes import MODES, KVMode
from kvlens.lab import common
from kvlens.lab.common import CompareConfig, LabConfig, parse_modes
from kvlens.report import save_figure

Q8, F32, F16 = (KVMode.parse(n) for n in ("q8", "f32", "f16"))


def test_mode_lists():
    assert parse_modes("all") == list(MODES.values())
    assert parse_modes("q8,f16,q8") == [Q8, F16]  # a comma list is de-duplicated, in order
    assert parse_modes(["q8", "q8"]) == [Q8, Q8]  # a list is kept as given
    for spec, msg in [
        ("q8,all", "unknown KV cache mode 'all'"),
        (" ", "no KV mode given"),
        ("", "no KV mode"),
    ]:
        with pytest.raises(ValueError, match=msg):
            parse_modes(spec)


@pytest.mark.parametrize(
    "cls,kw,msg",
    [
        (LabConfig, {"keep_sink": -1}, "keep_sink"),
        (LabConfig, {"keep_recent": -1}, "keep_recent"),
        (CompareConfig, {"prefill_chunk": 0}, "--prefill-chunk must be at least 1"),
        (CompareConfig, {"base": "q9"}, "unknown KV cache mode"),
    ],
)
def test_configs_refuse_at_construction(cls, kw, msg):
    with pytest.raises(ValueError, match=msg):
        cls(**kw)


def test_same_as_base_only_without_kept_positions():
    assert CompareConfig(kv="f32").same_as_base(F32)
    assert not CompareConfig(kv="q8").same_as_base(Q8)
    assert not CompareConfig(kv="f32", keep_sink=4).same_as_base(F32)
    assert not CompareConfig(kv="f32", keep_recent=4).same_as_base(F32)


def _result(**kw):
    fields = {"weights": "int8", "base": F32, "keep_sink": 0, "keep_recent": 0, "vs_f32_weights": []}
    return SimpleNamespace(**(fields | kw))


def test_labels_and_header_lines():
    base_row, q8_row = SimpleNamespace(mode=F32), SimpleNamespace(mode=Q8)
    r = _result(vs_f32_weights=[base_row, q8_row])
    assert common.weights_label(r, base_row) == "weights int8 · KV f32 (base)"
    assert common.weights_label(r, q8_row, short=True) == "int8 · q8"
    assert common.vs_f32_json(r, lambda m: {"kld": 0.5}) == [
        {"label": "weights int8 · KV f32 (base)", "weights": "int8", "kv": "f32", "kld": 0.5},
        {"label": "weights int8 · KV q8", "weights": "int8", "kv": "q8", "kld": 0.5},
    ]
    assert common.kept_exact_line(_result()) == []
    assert common.kept_exact_line(_result(keep_sink=4, keep_recent=16)) == [
        "kept in test modes: first 4 positions in the f16 sink store, last 16 exact"
    ]
    assert common.header_notes(_result(keep_recent=2), "KLD of") == [
        "kept in test modes: first 0 positions in the f16 sink store, last 2 exact"
    ]
    notes = common.header_notes(r, "KLD of", "; same corpus")
    assert notes == [
        "weights int8 for the base and every mode (KLD of the base with the same weights); reference for "
        "'cost vs f32 weights + f32 KV': a second model with f32 weights, KV f32; same corpus"
    ]


def test_loaders_ask_for_the_torch_path_and_an_f32_reference(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(
        kvlens, "load", lambda model, **kw: calls.append((model, kw)) or SimpleNamespace(**kw)
    )
    text = tmp_path / "t.txt"
    text.write_text("some text", encoding="utf-8")
    llm, got, label = common.load_lab("m", str(text), "f16", "int8")
    assert (got, label) == ("some text", str(text))
    assert calls == [("m", {"kv": F16, "attn_backend": "torch", "weights": "int8"})]
    assert common.load_reference("m", SimpleNamespace(weights_mode="f32")) is None
    common.load_reference("m", SimpleNamespace(weights_mode="int8"))
    assert calls[-1] == ("m", {"kv": "f32", "attn_backend": "torch", "weights": "f32"})


def test_an_unknown_weights_mode_is_refused_before_any_load(monkeypatch):
    monkeypatch.setattr(kvlens, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(ValueError, match="unknown weights mode 'int3'"):
        common.load_lab("m", None, "f32", "int3")


def test_kld_plot_draws_an_exact_mode(tmp_path, monkeypatch):
    """A mode with KLD 0 everywhere (exact) is drawn at 10^-12, with finite bins for every mode."""
    drawn = []

    def keep(fig, path):
        drawn.extend(p.get_xy() for p in fig.axes[0].patches)
        return save_figure(fig, path)

    monkeypatch.setattr(common, "save_figure", keep)
    path = common.plot_kld({"f16": np.zeros(50), "q8": np.full(50, 1e-3)}, tmp_path / "kld.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(drawn) == 2 and all(np.isfinite(xy).all() for xy in drawn)
    assert min(xy[:, 0].min() for xy in drawn) == -12.0
