"""`kvlens lab greedy` and `kvlens lab layers`: helpers by hand, then the real model on a short text."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kvlens.kv.modes import MODES
from kvlens.lab.greedy import (
    GreedyConfig,
    compare,
    cut_prompts,
    first_divergence,
    greedy_continuation,
    run_greedy,
)
from kvlens.lab.layers import LayersConfig, channel_ratio, flag_heads, run_layers

EXCERPT = Path(__file__).parent / "data" / "excerpt.txt"


# -- helpers, no model ---------------------------------------------------------------------------------
def test_prompts_are_evenly_spaced_windows() -> None:
    assert cut_prompts(list(range(30)), 3, 4) == [[0, 1, 2, 3], [10, 11, 12, 13], [20, 21, 22, 23]]
    assert cut_prompts(list(range(30)), 2, 4, bos_id=99) == [[99, 0, 1, 2], [99, 15, 16, 17]]


def test_too_short_corpus_for_prompts() -> None:
    with pytest.raises(ValueError, match=r"has 10 tokens; 3 prompts of 4 tokens need at least 12"):
        cut_prompts(list(range(10)), 3, 4)


def test_compare_agreement_and_divergence_by_hand() -> None:
    tokens, ref = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]], [[1, 2, 0, 4], [5, 6, 7, 8], [9, 9, 9, 1]]
    m = compare("q8", tokens, ref, 2.0)
    # the third prompt differs at its last token only: not identical
    assert m.agreement == 10 / 12 and m.first_div == [2, 4, 3] and m.identical == 1
    assert m.to_json(4)["tokens_per_s"] == 6.0 and m.to_json(4)["first_divergence_median"] == 3.0


def test_first_divergence() -> None:
    assert first_divergence([1, 2, 3], [1, 2, 3]) == 3
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2, 3], [0, 2, 3]) == 0


def test_channel_ratio_by_hand() -> None:
    x = torch.tensor([[[1.0, -2.0, 3.0, 40.0], [0.5, 1.0, -1.0, 1.0]]])  # [KV=1, n=2, d=4]
    # per-channel max |x| = [1, 2, 3, 40]; median (torch: lower middle) = 2 -> 20
    assert channel_ratio(x).tolist() == [20.0]


def _arrays():
    err = np.full((4, 2), 0.01)
    err[2, 1] = 0.05  # 5x the median
    k_ratio, v_ratio, sink = np.full((4, 2), 4.0), np.full((4, 2), 3.0), np.full((4, 2), 0.1)
    return err, k_ratio, v_ratio, sink


def test_flags_outlier_channels_and_sinks() -> None:
    err, k_ratio, v_ratio, sink = _arrays()
    k_ratio[2, 1] = 20.0
    sink[2, 1] = 0.9
    (f,) = flag_heads(err, k_ratio, v_ratio, sink, "q8", "q8")
    assert (f["layer"], f["kv_head"]) == (2, 1) and f["times_median"] == pytest.approx(5.0)
    assert any("outlier K channels" in c for c in f["causes"])
    assert any("attention sink" in c for c in f["causes"])


def test_flags_do_not_blame_an_unquantized_tensor() -> None:
    err, k_ratio, v_ratio, sink = _arrays()
    k_ratio[2, 1] = 20.0  # K outliers, but this mode stores K in f32
    (f,) = flag_heads(err, k_ratio, v_ratio, sink, "f32", "q8")
    assert f["causes"] == ["no single cause found (not outlier channels, not a sink)"]
    err[2, 1] = 0.02  # 2x the median: not flagged
    assert flag_heads(err, k_ratio, v_ratio, sink, "q8", "q8") == []
    assert flag_heads(np.zeros((4, 2)), k_ratio, v_ratio, sink, "f32", "f32") == []


# -- the real model ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def text() -> str:
    return EXCERPT.read_text(encoding="utf-8")


@pytest.mark.slow
def test_greedy_base_equals_engine_generation_and_base_mode_agrees(smol_f32, text) -> None:
    r = run_greedy(smol_f32, text, GreedyConfig(kv=["f32", "q8"], base="f32", prompts=2, ctx=24, tokens=6))
    f32, q8 = r.modes
    assert f32.agreement == 1.0 and f32.first_div == [6, 6] and f32.identical == 2
    assert [len(t) for t in q8.tokens] == [6, 6]
    # agreement and first divergence written out from the recorded tokens
    pairs = [
        (a, b) for qa, ba in zip(q8.tokens, r.base_tokens, strict=True) for a, b in zip(qa, ba, strict=True)
    ]
    assert q8.agreement == pytest.approx(sum(a == b for a, b in pairs) / 12, rel=1e-12)
    assert q8.first_div == [
        next((i for i, (a, b) in enumerate(zip(qa, ba, strict=True)) if a != b), 6)
        for qa, ba in zip(q8.tokens, r.base_tokens, strict=True)
    ]
    # the lab's loop is the engine's greedy generation
    engine = list(smol_f32.generate_ids(r.prompts[1], 6, stop_at_eos=False))
    assert r.base_tokens[1] == engine
    # a continuation computed on its own is the one the run recorded (fresh cache per prompt)
    assert q8.tokens[0] == greedy_continuation(smol_f32, r.prompts[0], 6, "q8", 32)


@pytest.mark.slow
def test_layers_f32_exact_q8_not_and_mirror_decode_reads_int8(smol_f32, text) -> None:
    r = run_layers(smol_f32, text, LayersConfig(kv=["f32", "q8", "q8-k", "q8-v", "q8+mirror"], ctx=48))
    assert r.median(MODES["q8"]) < 0.2  # a few percent, not garbage
    r.err = {m.name: e for m, e in r.err.items()}
    r.flagged = {m.name: f for m, f in r.flagged.items()}
    cfg = smol_f32.config
    assert r.err["q8"].shape == (cfg.n_layers, cfg.n_kv_heads)
    assert np.all(r.err["f32"] == 0) and r.flagged["f32"] == []
    assert np.all(r.err["q8"] > 0) and np.all(r.err["q8-k"] > 0) and np.all(r.err["q8-v"] > 0)
    assert np.array_equal(r.err["q8+mirror"], r.err["q8"])
    assert np.all((r.sink >= 0) & (r.sink <= 1)) and np.all(r.k_ratio >= 1)


@pytest.mark.slow
def test_capture_of_one_layer_equals_that_layer_of_a_whole_capture(smol_f32, text) -> None:
    ids = smol_f32.tokenizer.encode(text)[:20]
    layer = smol_f32.config.n_layers // 2
    ((q, k, v),) = smol_f32.capture_qkv(ids, [layer])
    q2, k2, v2 = smol_f32.capture_qkv(ids)[layer]
    assert torch.equal(q, q2) and torch.equal(k, k2) and torch.equal(v, v2)


@pytest.mark.slow
@pytest.mark.parametrize("command", ["greedy", "layers"])
def test_cli_json_and_report(smol_f32, monkeypatch, tmp_path, command) -> None:
    from typer.testing import CliRunner

    import kvlens
    from kvlens.cli import app

    monkeypatch.setattr(kvlens, "load", lambda *a, **k: smol_f32)  # reuse the session's model
    args = ["lab", command, "--corpus", str(EXCERPT), "--kv", "q8,f16", "--json", "--report", str(tmp_path)]
    args += ["--ctx", "16", "--prompts", "2", "--tokens", "4"] if command == "greedy" else ["--ctx", "32"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert set(out["modes"]) == {"q8", "f16"}
    png = "greedy_divergence.png" if command == "greedy" else "layers_error.png"
    assert (tmp_path / f"{command}.md").is_file() and (tmp_path / png).stat().st_size > 1000


@pytest.fixture(scope="module")
def smol_int8(smol_path):
    import kvlens
    from kvlens.models.loader import load_model

    return kvlens.LLM(load_model(smol_path, weights="int8"), kv="f32", attn_backend="torch")


@pytest.mark.slow
def test_greedy_int8_weights_vs_its_own_base_and_vs_f32_weights(smol_f32, smol_int8, text) -> None:
    cfg = GreedyConfig(kv=["f32", "q8"], base="f32", prompts=2, ctx=16, tokens=4)
    r = run_greedy(smol_int8, text, cfg, ref_llm=smol_f32)
    f32, q8 = r.modes
    assert r.weights == "int8" and f32.agreement == 1.0  # the KV rows' base is the int8-weights run
    # the reference is f32 weights + f32 KV, continued on its own
    assert r.ref_tokens == [greedy_continuation(smol_f32, p, 4, "f32", 32) for p in r.prompts]
    w, wq8 = r.vs_f32_weights
    assert (w.mode.name, wq8.mode.name) == ("f32", "q8")
    assert w.tokens == r.base_tokens and wq8.tokens == q8.tokens
    assert w.first_div == [first_divergence(a, b) for a, b in zip(r.ref_tokens, r.base_tokens, strict=True)]
    out = r.to_json()
    assert out["weights"] == "int8" and [x["label"] for x in out["vs_f32_weights"]] == [
        "weights int8 · KV f32 (base)",
        "weights int8 · KV q8",
    ]
    n_tok = sum(len(t) for t in r.ref_tokens)
    agree = sum(
        a == b for qa, ra in zip(q8.tokens, r.ref_tokens, strict=True) for a, b in zip(qa, ra, strict=True)
    )
    assert out["vs_f32_weights"][1]["agreement"] == pytest.approx(agree / n_tok, rel=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["f32", "int8"])
def test_greedy_cli_weights(smol_f32, smol_int8, monkeypatch, tmp_path, weights) -> None:
    from typer.testing import CliRunner

    import kvlens
    from kvlens.cli import app

    calls: list[str] = []

    def load(*a, weights="auto", **k):
        calls.append(weights)
        return smol_int8 if weights == "int8" else smol_f32

    monkeypatch.setattr(kvlens, "load", load)
    args = ["lab", "greedy", "--corpus", str(EXCERPT), "--kv", "q8", "--ctx", "16", "--prompts", "2"]
    res = CliRunner().invoke(
        app, [*args, "--tokens", "4", "--weights", weights, "--json", "--report", str(tmp_path)]
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    md = (tmp_path / "greedy.md").read_text()
    assert out["weights"] == weights and set(out["modes"]) == {"q8"}
    if weights == "f32":  # nothing changes: one model, no weights rows
        assert calls == ["f32"] and out["vs_f32_weights"] == [] and "cost vs f32 weights" not in md
    else:
        assert calls == ["int8", "f32"]
        assert [x["kv"] for x in out["vs_f32_weights"]] == ["f32", "q8"]
        assert "cost vs f32 weights + f32 KV" in md
