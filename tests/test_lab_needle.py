"""lab needle: prompt construction and a short real run."""

from __future__ import annotations

import pytest

from kvlens.engine.llm import LLM
from kvlens.lab.needle import ANSWER_TOKENS, NeedleConfig, build_prompt, recall_table, run_needle

pytestmark = pytest.mark.slow


def test_prompt_has_exact_length_and_depth(smol_f32):
    tok = smol_f32.tokenizer
    filler = tok.encode("The river runs through the old town and past the mill. " * 80, add_bos=False)
    for depth in (0.0, 0.5, 1.0):
        ids = build_prompt(smol_f32, filler, 300, depth, "12345")
        assert len(ids) == 300
        text = tok.decode(ids)
        assert text.count("12345") == 2 and text.rstrip().endswith("The special magic number is")
        frac = text.index("12345") / len(text)
        assert abs(frac - depth * 0.8) < 0.15  # the question takes the last fifth or so


def test_prompt_errors(smol_f32):
    filler = smol_f32.tokenizer.encode("word " * 50, add_bos=False)
    with pytest.raises(ValueError, match="too short"):
        build_prompt(smol_f32, filler, 30, 0.5, "12345")
    with pytest.raises(ValueError, match="filler corpus has"):
        build_prompt(smol_f32, filler, 400, 0.5, "12345")


def test_short_needle_run(smol_f32, monkeypatch):
    filler = open(__file__.replace("test_lab_needle.py", "data/excerpt.txt"), encoding="utf-8").read()
    capacities, starts = [], []
    new_cache, decode = LLM.new_cache, LLM.decode

    def spy_new_cache(self, capacity, *args, **kwargs):
        capacities.append(capacity)
        return new_cache(self, capacity, *args, **kwargs)

    def spy_decode(self, cache, logits, pos, *args, **kwargs):
        starts.append((cache.length, pos))
        yield from decode(self, cache, logits, pos, *args, **kwargs)

    monkeypatch.setattr(LLM, "new_cache", spy_new_cache)
    monkeypatch.setattr(LLM, "decode", spy_decode)
    rows = run_needle(
        smol_f32, filler, NeedleConfig(ctx=[328], depth=[0.3], sparse_budget=[64, 128], kv="q8")
    )
    assert [r.mode for r in rows] == ["f32 dense", "q8 dense", "q8 quest 64", "q8 quest 128"]
    # the prompt leaves room for the answer: prompt + answer tokens is the context, not more
    assert capacities == [328, 328]  # one cache per cache type: f32, then q8 (shared by three variants)
    # every variant decodes from the bare prefill: the one before it rewound the shared cache
    assert len(starts) == 4 and all(length == pos == 328 - ANSWER_TOKENS for length, pos in starts)
    assert rows[0].recalled  # the model finds a fact 200 tokens back
    table = recall_table(rows)
    assert (
        set(table) == {"f32 dense", "q8 dense", "q8 quest 64", "q8 quest 128"}
        and table["f32 dense"][328] == 1.0
    )


def test_bad_depth_and_empty_lists_are_refused():
    with pytest.raises(ValueError, match="must lie in"):
        NeedleConfig(ctx=[512], depth=[1.5], sparse_budget=[0.25])
    with pytest.raises(ValueError, match="at least one context"):
        NeedleConfig(ctx=[], depth=[0.5], sparse_budget=[0.25])
