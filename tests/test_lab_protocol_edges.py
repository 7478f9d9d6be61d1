"""Edges of the lab's ppl and greedy protocols that the planted-bug campaign of the thirty-third
session found untested: the smallest ctx and token counts, what a row counts as tokens run, and
notes that must keep every fact they carry."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from test_lab_ppl import _FakeDecodeLLM, _FakeLLM

from kvlens.kv.blocks import SparseConfig
from kvlens.kv.modes import KVMode
from kvlens.lab.greedy import GreedyConfig, GreedyResult, compare, divergences, run_greedy
from kvlens.lab.ppl import PplConfig, make_chunks, run_ppl

SPARSE = SparseConfig(method="quest", budget=64, dense_layers=1, min_ctx=0)  # from the first position


def test_ctx_4_is_the_smallest_chunk() -> None:
    """ctx 4: positions 2 .. 2 scored (one token); ctx 3 is refused (its 'half' would be one token)."""
    assert make_chunks(list(range(8)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="ctx must be at least 4 tokens \\(got 3\\)"):
        make_chunks(list(range(9)), 3)


def test_a_rows_tokens_are_the_tokens_the_model_ran() -> None:
    """``ModeResult.tokens`` (tokens/s) counts every token prefilled, the unscored half included."""
    llm = _FakeLLM(add_bos=False)
    r = run_ppl(llm, " ".join(["0"] * 13), PplConfig(ctx=6, kv=["q8"], prefill_chunk=4))
    ran = sum(len(ids) for kv, _, ids in llm.seen if kv == "q8")
    assert ran == 12 and r.modes[0].tokens == ran
    assert r.modes[0].tokens_per_s == pytest.approx(ran / r.modes[0].seconds, rel=1e-12)


def test_sparse_and_a_backend_both_named_in_the_note() -> None:
    llm = _FakeDecodeLLM()
    cfg = PplConfig(ctx=6, kv=["q8"], prefill_chunk=2, sparse=SPARSE, attn_backend="numba")
    note = run_ppl(llm, " ".join(["0"] * 13), cfg).modes[0].note
    assert note.startswith("sparse decode: quest, budget 64, first 1 layers dense")
    assert "; attention numba: scored positions run as decode steps" in note


def test_greedy_needs_at_least_one_token() -> None:
    assert GreedyConfig(tokens=1).tokens == 1
    with pytest.raises(ValueError, match="--tokens must be at least 1 \\(got 0\\)"):
        GreedyConfig(tokens=0)


class _FakeGreedyLLM:
    """Greedy continuations are ``[sparse?] * n``: 1 under a sparse variant, else 0."""

    def __init__(self, sparse=None) -> None:
        self.sparse = sparse
        self.config = SimpleNamespace(name="fake")
        self.tokenizer = SimpleNamespace(
            bos_prefix=[], encode=lambda text, add_bos: [int(t) for t in text.split()]
        )
        self.runs: list[tuple[object, str]] = []  # (sparse policy, kv) of every continuation

    def variant(self, sparse=None):
        other = _FakeGreedyLLM(sparse)
        other.runs = self.runs
        return other

    def new_cache(self, capacity: int, kv, options=None):
        return SimpleNamespace(kv=str(kv))

    def generate_ids(self, prompt, n, stop_at_eos, cache, prefill_chunk):
        self.runs.append((self.sparse, cache.kv))
        return [int(self.sparse is not None)] * n


def test_greedy_test_modes_decode_sparse_and_the_base_dense() -> None:
    llm = _FakeGreedyLLM()
    cfg = GreedyConfig(ctx=4, prompts=2, tokens=3, kv=["q8"], sparse=SPARSE)
    r = run_greedy(llm, " ".join(["5"] * 8), cfg)
    assert llm.runs == [(None, "f32")] * 2 + [(SPARSE, "q8")] * 2
    assert r.base_tokens == [[0, 0, 0]] * 2 and r.modes[0].tokens == [[1, 1, 1]] * 2
    assert r.modes[0].agreement == 0.0 and r.modes[0].first_div == [0, 0]


def test_divergences_show_at_most_show_prompts_per_mode() -> None:
    """Three prompts diverge; ``show=2`` prints the first two (five lines each), a prompt that never
    diverged is skipped, and a mode with none says so."""
    base = [[1, 2, 3]] * 4
    diverged = compare(KVMode.parse("q8"), [[1, 9, 9], [1, 2, 3], [9, 9, 9], [1, 2, 9]], base, 1.0)
    same = compare(KVMode.parse("f16"), base, base, 1.0)
    r = GreedyResult(
        "fake", "text", KVMode.parse("f32"), 4, 3, 3, 2, 0, 0, [[0, 0, 0]] * 4, base, 1.0, [diverged, same]
    )
    tok = SimpleNamespace(decode=lambda ids: " ".join(map(str, ids)))
    lines = divergences(r, tok, show=2)
    assert [x for x in lines if x.startswith("[")] == [
        "[q8] prompt 0, first divergence at generated token 1",
        "[q8] prompt 2, first divergence at generated token 0",
        "[f16] no prompt diverged",
    ]
    assert len(lines) == 11
