"""lab needle: prompt construction and a short real run."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvlens.engine import attention
from kvlens.engine.llm import LLM
from kvlens.kv.blocks import SparseConfig
from kvlens.kv.modes import CacheOptions
from kvlens.lab import needle
from kvlens.lab.needle import ANSWER_TOKENS, NeedleConfig, NeedleRow, build_prompt, recall_table, run_needle

EXCERPT = __file__.replace("test_lab_needle.py", "data/excerpt.txt")


@pytest.mark.slow
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


@pytest.mark.slow
def test_prompt_errors(smol_f32):
    filler = smol_f32.tokenizer.encode("word " * 50, add_bos=False)
    with pytest.raises(ValueError, match="too short"):
        build_prompt(smol_f32, filler, 30, 0.5, "12345")
    with pytest.raises(ValueError, match="filler corpus has"):
        build_prompt(smol_f32, filler, 400, 0.5, "12345")


@pytest.mark.slow
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
    with pytest.raises(ValueError, match=r"ctx \(--ctx\) is empty: give at least one value"):
        NeedleConfig(ctx=[], depth=[0.5], sparse_budget=[0.25])


class _ByteTokenizer:
    """One token per byte, BOS 1 (as Llama 3 and Gemma have; SmolLM2 has none)."""

    bos_prefix = [1]

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return (self.bos_prefix if add_bos else []) + list(text.encode())


def test_the_prompt_counts_the_bos_token_in_its_length():
    llm = SimpleNamespace(tokenizer=_ByteTokenizer())
    filler = list(range(100, 100 + 400))
    ids = build_prompt(llm, filler, 300, 0.0, "12345")
    assert len(ids) == 300 and ids[0] == 1 and ids[1:3] == list(b" T")  # the fact at depth 0
    assert ids[-len(needle.QUESTION) :] == list(needle.QUESTION.encode())


def test_recall_table_averages_over_depths_by_hand():
    rows = [NeedleRow(512, d, "q8 dense", ok, "", "1") for d, ok in ((0.1, True), (0.5, False), (0.9, True))]
    rows += [
        NeedleRow(1024, 0.1, "q8 dense", False, "", "1"),
        NeedleRow(512, 0.1, "f32 dense", True, "", "1"),
    ]
    assert recall_table(rows) == {"q8 dense": {512: 2 / 3, 1024: 0.0}, "f32 dense": {512: 1.0}}


def test_depths_at_both_ends_are_accepted():
    assert NeedleConfig(ctx=[512], depth=[0.0, 1.0]).depth == [0.0, 1.0]


@pytest.mark.slow
def test_a_sparse_llm_refuses_a_cache_without_block_bounds(smol_f32):
    sparse = smol_f32.variant(kv="q8", sparse=SparseConfig("quest", 64, 2, 0))
    dense_cache = smol_f32.variant(kv="q8").new_cache(64, "q8", CacheOptions())
    assert dense_cache.bounds is None
    logits = sparse.prefill(list(range(40, 80)), dense_cache)
    with pytest.raises(ValueError, match="track_blocks=True"):
        list(sparse.decode(dense_cache, logits, 40, 2))


@pytest.mark.slow
def test_sparse_rows_select_blocks_and_dense_rows_do_not(smol_f32, monkeypatch):
    """Each sparse variant selects blocks in every layer past the dense ones at each decode step after
    the first token (which comes from the prefill's logits); the dense variants never do. The secret
    of each (context, depth) is drawn from the seed: different for each depth, the same again."""
    calls, secrets = [], []
    select, build = attention.select_blocks, needle.build_prompt

    def spy_select(q, cache, layer, length, sparse):
        calls.append(sparse.budget)
        return select(q, cache, layer, length, sparse)

    def spy_build(llm, filler_ids, ctx, depth, secret, **kwargs):
        secrets.append(secret)
        return build(llm, filler_ids, ctx, depth, secret, **kwargs)

    monkeypatch.setattr(attention, "select_blocks", spy_select)
    monkeypatch.setattr(needle, "build_prompt", spy_build)
    filler = open(EXCERPT, encoding="utf-8").read()
    cfg = NeedleConfig(ctx=[200], depth=[0.2, 0.8], sparse_budget=[64], kv="q8", dense_layers=3)
    run_needle(smol_f32, filler, cfg)
    per_variant = (smol_f32.config.n_layers - 3) * (ANSWER_TOKENS - 1)
    assert calls == [64] * (2 * per_variant)  # one sparse variant, two depths
    run_needle(smol_f32, filler, NeedleConfig(ctx=[200], depth=[0.2, 0.8], sparse_budget=[], kv="q8"))
    assert len(calls) == 2 * per_variant and len(secrets) == 4
    assert secrets[0] != secrets[1] and secrets[2:] == secrets[:2]
