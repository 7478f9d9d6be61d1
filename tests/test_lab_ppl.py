"""`kvlens lab ppl`: llama-perplexity's protocol (by hand and against HF transformers) per KV mode."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from bounds import f32_forward_tol

from kvlens.kv.modes import MODES
from kvlens.lab.common import parse_modes
from kvlens.lab.ppl import (
    MIRROR_NOTE,
    BaseLogProbs,
    PplConfig,
    chunk_metrics,
    make_chunks,
    run_ppl,
    scored_logits,
    scored_span,
)
from kvlens.lab.stats import token_metrics

EXCERPT = Path(__file__).parent / "data" / "excerpt.txt"


# -- protocol, no model --------------------------------------------------------------------------------
def test_chunks_are_non_overlapping_and_drop_the_tail() -> None:
    assert make_chunks(list(range(11)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_bos_overwrites_the_first_token_of_every_chunk() -> None:
    assert make_chunks(list(range(1, 9)), 4, bos_id=99) == [[99, 2, 3, 4], [99, 6, 7, 8]]


def test_chunk_limit_and_cap() -> None:
    assert len(make_chunks(list(range(40)), 4, n_chunks=3)) == 3
    assert len(make_chunks(list(range(40)), 4, n_chunks=50)) == 10  # capped like llama-perplexity
    with pytest.raises(ValueError, match="at least 1"):
        make_chunks(list(range(40)), 4, n_chunks=0)


def test_too_short_corpus_says_how_many_tokens() -> None:
    with pytest.raises(ValueError, match=r"has 5 tokens; ctx 8 needs at least 8"):
        make_chunks(list(range(5)), 8)
    with pytest.raises(ValueError, match="has 0 tokens"):
        make_chunks([], 8)


def test_second_half_is_scored() -> None:
    assert scored_span(512) == (256, 511)  # 255 tokens per chunk, as llama-perplexity scores
    assert scored_span(7) == (3, 6)


def test_modes_come_from_the_cache_module() -> None:
    assert parse_modes("all") == list(MODES.values())
    assert [m.name for m in parse_modes("q8, f16,q8")] == ["q8", "f16"]
    with pytest.raises(ValueError, match="unknown KV cache mode"):
        parse_modes("q3")


def test_chunk_metrics_equal_stats_token_metrics() -> None:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 50, generator=g) * 8
    base[0, 3] = 900.0  # a near-one-hot row: most base probabilities underflow to 0
    q = base + torch.randn(6, 50, generator=g) * 0.3
    t = torch.randint(0, 50, (6,), generator=g)
    ours, ref = chunk_metrics(BaseLogProbs(base), q, t), token_metrics(base, q, t)
    for k in ref:
        assert torch.allclose(ours[k].double(), ref[k].double(), rtol=1e-12, atol=1e-15), k
    q[:, 7] = base.max(dim=1).values + 1.0  # every row's top token moves to 7, where base's is not
    ours = chunk_metrics(BaseLogProbs(base), q, t)
    assert torch.equal(ours["top_q"], torch.full((6,), 7)) and not torch.any(ours["top_base"] == 7)
    assert torch.equal(ours["top_base"], base.argmax(dim=-1))
    same = chunk_metrics(BaseLogProbs(base), base.clone(), t)
    assert torch.all(same["kld"] == 0)  # identical logits: exactly 0, as llama.cpp's "base vs base"


class _FakeLLM:
    """Token ids are the text's integers; logits at chunk position p = [p + shift(kv) + wshift, 0, 0, 0]
    (``wshift``: what the fake's weights add)."""

    def __init__(self, add_bos: bool, weights: str = "f32", wshift: float = 0.0) -> None:
        self.tokenizer = SimpleNamespace(bos_prefix=[7] if add_bos else [], encode=self._encode)
        self.config = SimpleNamespace(name="fake")
        self.weights_mode, self.wshift = weights, wshift
        self.seen: list[tuple[str, int, list[int]]] = []

    def _encode(self, text: str) -> list[int]:
        ids = [int(t) for t in text.split()]
        return self.tokenizer.bos_prefix + ids

    def check_fits(self, n: int) -> None:
        pass

    def new_cache(self, capacity: int, kv, options=None):
        return SimpleNamespace(kv=str(kv), bytes_per_token=lambda: 1)

    def prefill(self, ids, cache, chunk, on_hidden):
        self.seen.append((cache.kv, chunk, list(ids)))
        shift = (0.5 if cache.kv == "q8" else 0.0) + self.wshift
        for s in range(0, len(ids), chunk):
            n = len(ids[s : s + chunk])
            on_hidden(s, torch.arange(s, s + n, dtype=torch.float64)[:, None] + shift)

    @staticmethod
    def lm_head(h: torch.Tensor) -> torch.Tensor:
        return torch.cat([h, torch.zeros(h.shape[0], 3, dtype=h.dtype)], dim=1)


def _nll0(x: float) -> float:
    """-ln p(token 0) for logits [x, 0, 0, 0]."""
    return math.log(math.exp(x) + 3) - x


def test_protocol_by_hand_with_a_fake_model() -> None:
    llm = _FakeLLM(add_bos=True)
    # BOS + 13 zeros = 14 tokens -> 2 chunks of 6 (tail of 2 dropped); positions 3, 4 of each chunk scored
    r = run_ppl(llm, " ".join(["0"] * 13), PplConfig(ctx=6, kv=["q8"], prefill_chunk=2))
    assert r.chunks == 2 and r.tokens_scored == 4 and r.bos_id == 7
    base_calls = [s for s in llm.seen if s[0] == "f32"]
    q8_calls = [s for s in llm.seen if s[0] == "q8"]
    assert [c[1] for c in base_calls] == [6, 6]  # f32 base: one pass per chunk
    assert [c[1] for c in q8_calls] == [2, 2]  # test mode: the sub-chunk size
    assert all(c[2] == [7, 0, 0, 0, 0, 0] for c in llm.seen)  # BOS first in every chunk
    nll_b = np.array([_nll0(3), _nll0(4)] * 2)
    nll_q = np.array([_nll0(3.5), _nll0(4.5)] * 2)
    s = r.modes[0].stats
    assert s["ppl_base"] == pytest.approx(math.exp(nll_b.mean()), rel=1e-12)
    assert s["ppl_q"] == pytest.approx(math.exp(nll_q.mean()), rel=1e-12)
    # se of the mean = sqrt(population var / (n - 1)); err(PPL) = PPL * se
    se = math.sqrt(nll_b.var() / 3)
    assert s["ppl_base_err"] == pytest.approx(math.exp(nll_b.mean()) * se, rel=1e-12)
    assert s["n_tokens"] == 4 and s["same_top_p"] == 100.0 and s["kld_mean"] > 0


def test_no_bos_when_the_tokenizer_adds_none() -> None:
    llm = _FakeLLM(add_bos=False)
    r = run_ppl(llm, " ".join(str(i % 3) for i in range(12)), PplConfig(ctx=6, kv=["f16"]))
    assert r.bos_id is None and llm.seen[0][2] == [0, 1, 2, 0, 1, 2]


def test_non_f32_base_uses_the_sub_chunks_too() -> None:
    llm = _FakeLLM(add_bos=False)
    run_ppl(llm, " ".join(["0"] * 6), PplConfig(ctx=6, kv=["q8"], base="f16", prefill_chunk=3))
    assert {(kv, c) for kv, c, _ in llm.seen} == {("f16", 3), ("q8", 3)}


def test_f32_weights_add_no_rows() -> None:
    r = run_ppl(_FakeLLM(add_bos=False), " ".join(["0"] * 12), PplConfig(ctx=6, kv=["q8"]))
    assert r.weights == "f32" and r.vs_f32_weights == [] and r.ref_seconds == 0.0
    assert r.to_json()["vs_f32_weights"] == [] and r.to_json()["weights"] == "f32"


def test_weights_cost_rows_by_hand_with_a_fake_model() -> None:
    # int8 "weights" add 0.25 to every logit of token 0; the reference (f32 weights) adds nothing
    llm, ref = _FakeLLM(add_bos=False, weights="int8", wshift=0.25), _FakeLLM(add_bos=False)
    r = run_ppl(llm, " ".join(["0"] * 12), PplConfig(ctx=6, kv=["f32", "q8"], prefill_chunk=2), ref_llm=ref)
    assert r.weights == "int8"
    assert ref.seen == [("f32", 6, [0] * 6)] * 2  # the reference: f32 KV, one pass, once per chunk
    # KV rows are measured against the base with the same (int8) weights: f32 is exact, q8 costs
    f32, q8 = r.modes
    assert f32.stats["kld_mean"] == 0.0 and q8.stats["kld_mean"] > 0
    assert q8.stats["ppl_base"] == pytest.approx(math.exp(np.mean([_nll0(3.25), _nll0(4.25)])), rel=1e-12)
    # vs f32 weights + f32 KV: the base (weights alone), then q8 (combined); the f32 mode is the base's path
    w, wq8 = r.vs_f32_weights
    assert [m.mode.name for m in r.vs_f32_weights] == ["f32", "q8"]
    assert w.stats["ppl_base"] == pytest.approx(math.exp(np.mean([_nll0(3), _nll0(4)])), rel=1e-12)
    assert w.stats["ppl_q"] == pytest.approx(q8.stats["ppl_base"], rel=1e-12)  # the int8-weights base
    assert wq8.stats["ppl_q"] == pytest.approx(q8.stats["ppl_q"], rel=1e-12)  # the same q8 logits
    assert 0 < w.stats["kld_mean"] < wq8.stats["kld_mean"]  # shifts 0.25 < 0.75 from the reference
    assert w.note == "cost of the weights alone" and wq8.note == "cost of the weights and KV q8 combined"
    rows = r.to_json()["vs_f32_weights"]
    assert [x["label"] for x in rows] == ["weights int8 · KV f32 (base)", "weights int8 · KV q8"]
    assert rows[1]["kv"] == "q8" and rows[1]["weights"] == "int8" and rows[1]["kld_mean"] > 0


# -- the real model ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def text() -> str:
    return EXCERPT.read_text(encoding="utf-8")


@pytest.mark.slow
def test_f32_equals_float64_hf_perplexity(smol_f32, hf_smol, text) -> None:
    ctx, n = 64, 2
    r = run_ppl(smol_f32, text, PplConfig(ctx=ctx, kv=["f32"], chunks=n))
    tok = smol_f32.tokenizer
    chunks = make_chunks(tok.encode(text), ctx, n, tok.bos_id if tok.add_bos else None)
    nll = []
    with torch.no_grad():
        for c in chunks:
            logp = torch.log_softmax(hf_smol(torch.tensor([c])).logits[0].double(), dim=-1)
            pos = torch.arange(ctx // 2, ctx - 1)
            nll.append(-logp[pos, torch.tensor(c)[pos + 1]])
    ppl_hf = math.exp(torch.cat(nll).mean().item())
    s = r.modes[0].stats
    assert s["n_tokens"] == n * (ctx - 1 - ctx // 2)
    assert abs(s["ppl_base"] / ppl_hf - 1) < 1e-3
    # mode == base: the same path, so KLD is exactly 0 and the top token always agrees
    assert s["kld_mean"] == 0.0 and s["kld_max"] == 0.0 and s["same_top_p"] == 100.0
    assert s["ppl_q"] == s["ppl_base"]


@pytest.mark.slow
def test_q8_is_read_and_sub_chunk_size_leaves_f32_alone(smol_f32, text) -> None:
    # The engine writes each sub-chunk to the cache before attending it, so every query reads int8
    # rows at any sub-chunk size. (Whether two q8 runs at different sub-chunk sizes differ depends on
    # the CPU's GEMM blocking — f32 rounding flips int8 codes — so nothing is asserted about that.)
    a = run_ppl(smol_f32, text, PplConfig(ctx=32, kv=["q8", "q8+mirror"], chunks=2, prefill_chunk=8))
    b = run_ppl(smol_f32, text, PplConfig(ctx=32, kv=["q8"], chunks=2, prefill_chunk=32))
    q8, mirror = a.modes
    assert q8.stats["kld_mean"] > 1e-5 and b.modes[0].stats["kld_mean"] > 1e-5  # the int8 rows were read
    assert a.modes[0].stats["ppl_base"] == b.modes[0].stats["ppl_base"]
    # the seed's mirror: prefill reads the exact copy, so nothing of q8 shows
    assert mirror.stats["kld_mean"] < 1e-9 and mirror.note == MIRROR_NOTE
    # f32 as a test mode (base q8) is chunk-invariant up to f32 rounding: ln PPL moves by at most
    # 2 max|Δlogit|, and Δlogit <= 2 f32_forward_tol (SmolLM2's logits stay below 60 in magnitude)
    c = run_ppl(smol_f32, text, PplConfig(ctx=32, kv=["f32"], base="q8", chunks=1, prefill_chunk=8))
    d = run_ppl(smol_f32, text, PplConfig(ctx=32, kv=["f32"], base="q8", chunks=1, prefill_chunk=32))
    tol = 4 * f32_forward_tol(smol_f32.config, torch.tensor(60.0))
    assert abs(math.log(c.modes[0].stats["ppl_q"] / d.modes[0].stats["ppl_q"])) <= tol


@pytest.mark.slow
def test_scored_logits_f32_invariant_and_one_pass_reads_int8(smol_f32, text) -> None:
    chunk = smol_f32.tokenizer.encode(text)[:48]
    f8, f48 = (scored_logits(smol_f32, chunk, "f32", pc, 24) for pc in (8, 48))
    q48 = scored_logits(smol_f32, chunk, "q8", 48, 24)
    assert f8.shape == (23, smol_f32.config.vocab)
    assert (f8 - f48).abs().max().item() <= 2 * f32_forward_tol(smol_f32.config, f48)  # two f32 passes
    assert (q48 - f48).abs().max().item() > 1e-3  # one pass still reads int8: rows are written first


@pytest.mark.slow
def test_too_short_corpus_through_run_ppl(smol_f32) -> None:
    with pytest.raises(ValueError, match=r"needs at least 512 tokens"):
        run_ppl(smol_f32, "A short text.", PplConfig(ctx=512, kv=["q8"]))


@pytest.fixture(scope="module")
def smol_int8(smol_path):
    import kvlens
    from kvlens.models.loader import load_model

    return kvlens.LLM(load_model(smol_path, weights="int8"), kv="f32", attn_backend="torch")


@pytest.fixture
def fake_load(monkeypatch, smol_f32, smol_int8):
    """``kvlens.load`` returns the session's models (int8 or f32 weights); the calls are recorded."""
    import kvlens

    calls: list[str] = []

    def load(*a, weights="auto", **k):
        calls.append(weights)
        return smol_int8 if weights == "int8" else smol_f32

    monkeypatch.setattr(kvlens, "load", load)
    return calls


@pytest.mark.slow
def test_int8_weights_kv_rows_use_an_int8_base_and_reference_rows_use_f32(smol_f32, smol_int8, text) -> None:
    r = run_ppl(smol_int8, text, PplConfig(ctx=32, kv=["f32", "q8"], chunks=1), ref_llm=smol_f32)
    f32, q8 = r.modes
    # a KV mode equal to the base, with the same int8 weights: exactly 0 (the base is the int8 run)
    assert f32.stats["kld_mean"] == 0.0 and f32.stats["ppl_q"] == f32.stats["ppl_base"]
    assert q8.stats["kld_mean"] > 0
    w, wq8 = r.vs_f32_weights
    assert (r.weights, w.mode.name, wq8.mode.name) == ("int8", "f32", "q8")
    assert w.stats["kld_mean"] > 0 and wq8.stats["kld_mean"] > 0  # int8 weights (and q8 KV) cost something
    assert w.stats["ppl_q"] == f32.stats["ppl_base"] and wq8.stats["ppl_q"] == q8.stats["ppl_q"]
    # the reference is f32 weights + f32 KV: the f32 lab's base
    plain = run_ppl(smol_f32, text, PplConfig(ctx=32, kv=["f32"], chunks=1))
    assert w.stats["ppl_base"] == pytest.approx(plain.modes[0].stats["ppl_base"], rel=1e-9)


@pytest.mark.slow
def test_cli_json_and_report(fake_load, tmp_path) -> None:
    from typer.testing import CliRunner

    from kvlens.cli import app

    args = ["lab", "ppl", "--corpus", str(EXCERPT), "--ctx", "32", "--chunks", "1", "--kv", "q8,q8-v"]
    res = CliRunner().invoke(app, [*args, "--json", "--report", str(tmp_path)])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    for key in ("ppl", "ppl_base", "ppl_ratio", "kld_mean", "kld_p99", "same_top_p", "tokens_scored"):
        assert key in out["modes"]["q8"] and key in out["modes"]["q8-v"]
    assert out["modes"]["q8"]["tokens_scored"] == 15
    # default --weights f32: one model load, no weights rows
    assert fake_load == ["f32"] and out["weights"] == "f32" and out["vs_f32_weights"] == []
    md = (tmp_path / "ppl.md").read_text()
    assert "Mean PPL(Q)/PPL(base)" in md and "prefill sub-chunk 32" in md
    assert "cost vs f32 weights" not in md
    assert (tmp_path / "ppl_kld.png").stat().st_size > 1000


@pytest.mark.slow
def test_cli_int8_weights_json_text_and_report(fake_load, tmp_path) -> None:
    from typer.testing import CliRunner

    from kvlens.cli import app

    args = [
        "lab",
        "ppl",
        "--corpus",
        str(EXCERPT),
        "--ctx",
        "32",
        "--chunks",
        "1",
        "--kv",
        "q8",
        "--weights",
        "int8",
    ]
    res = CliRunner().invoke(app, [*args, "--json", "--report", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert fake_load == ["int8", "f32"]  # the lab's model, then the f32-weights reference
    out = json.loads(res.stdout)
    assert out["weights"] == "int8" and out["modes"]["q8"]["kld_mean"] > 0
    rows = out["vs_f32_weights"]
    assert [(x["label"], x["kv"]) for x in rows] == [
        ("weights int8 · KV f32 (base)", "f32"),
        ("weights int8 · KV q8", "q8"),
    ]
    assert rows[0]["kld_mean"] > 0 and rows[1]["kld_mean"] > 0 and rows[1]["tokens_scored"] == 15
    md = (tmp_path / "ppl.md").read_text()
    assert "## cost vs f32 weights + f32 KV" in md and "int8 · q8" in md
    text_out = CliRunner().invoke(app, args)
    assert text_out.exit_code == 0, text_out.output
    assert "cost vs f32 weights + f32 KV" in text_out.stdout and "(reference)" in text_out.stdout


class _FakeDecodeLLM(_FakeLLM):
    """The fake with an attention backend: ``forward`` is one decode step (logit = position + shift)."""

    attn_backend = "torch"

    def __init__(self) -> None:
        super().__init__(add_bos=True)
        self.steps: list[tuple[str, int, bool]] = []
        self.fed: list[tuple[int, list[int]]] = []  # (position, ids) of each decode step

    def variant(self, **changes):
        other = copy.copy(self)
        other.__dict__.update(changes)
        return other

    def forward(self, ids, cache, pos, prefill):
        self.steps.append((cache.kv, pos, prefill))
        self.fed.append((pos, list(ids)))
        return torch.tensor([[pos + (0.5 if cache.kv == "q8" else 0.0)]], dtype=torch.float64)


def test_attn_backend_scores_test_modes_as_decode_steps() -> None:
    """--attn-backend: the test mode prefills up to the first scored position, then one decode step
    per scored position through that backend; the base keeps its one-pass torch prefill."""
    llm = _FakeDecodeLLM()
    cfg = PplConfig(ctx=6, kv=["q8"], prefill_chunk=2, attn_backend="numba-int16")
    r = run_ppl(llm, " ".join(["0"] * 13), cfg)
    assert [c[:2] for c in llm.seen] == [("f32", 6), ("q8", 2)] * 2  # base whole chunk, q8 prefix
    assert [len(c[2]) for c in llm.seen if c[0] == "q8"] == [4, 4]  # positions 0..3 (3 = first scored)
    assert llm.steps == [("q8", 4, False)] * 2  # position 4 as a decode step
    assert r.modes[0].stats["ppl_q"] == pytest.approx(math.exp(np.mean([_nll0(3.5), _nll0(4.5)])), rel=1e-12)
    assert "numba-int16" in r.modes[0].note and "decode steps" in r.modes[0].note


def test_decode_steps_feed_each_scored_position_its_own_token() -> None:
    """Teacher forcing: the decode step at position p is fed the chunk's token p (its logits then
    score token p + 1), after a prefill of positions 0 .. first."""
    llm = _FakeDecodeLLM()
    llm.attn_backend = "numba"
    logits = scored_logits(llm, [7, 11, 12, 13, 14, 15, 16], "q8", 2, 3)
    assert llm.seen == [("q8", 2, [7, 11, 12, 13])] and llm.fed == [(4, [14]), (5, [15])]
    assert logits[:, 0].tolist() == [3.5, 4.5, 5.5]  # positions 3 (prefill), 4 and 5 (decode steps)
