"""The serving engine's counters (``Engine.stats``), each against what it counts: the preemptions that
happened, the KV bytes of the mode from the model's shape, and zeros where there is no prefix cache.
``/metrics`` shows these numbers to an operator; a counter that drifts from the events is a wrong
dashboard, not a wrong answer, which is why the output tests cannot see it."""

from __future__ import annotations

import pytest
from engine_loop import steps_until_done
from test_scheduler import budget, drive, llm, req  # noqa: F401

import kvlens
from kvlens.engine.sampling import SamplingParams
from kvlens.engine.scheduler import Engine, EngineConfig, Request

TINY_MODEL = ("llama", 5)  # conftest's tiny_dir


def test_preemptions_count_each_sequence_sent_back_to_wait(llm, monkeypatch):  # noqa: F811
    """Four requests in a 6-block pool (``test_scheduler``'s recompute case): every preemption the
    scheduler makes (seen by wrapping ``Engine._preempt``) moves a running sequence to the waiting
    queue, and the counter is their number."""
    engine = Engine(llm, EngineConfig(kv_budget_bytes=budget(llm, 6)))
    sent_back: list[str] = []
    preempt = engine._preempt

    def watched(seq) -> None:
        assert seq in engine.running
        preempt(seq)
        assert seq not in engine.running and engine.waiting[0] is seq
        sent_back.append(seq.req.request_id)

    monkeypatch.setattr(engine, "_preempt", watched)
    drive(engine, {0: [req(str(i), 20 + 9 * i, 30, seed=i) for i in range(4)]}, {})
    assert len(sent_back) >= 2, "premise: the pool is small enough to preempt more than once"
    assert engine.stats().preemptions == len(sent_back)


@pytest.mark.parametrize(("kv", "value_bytes"), [("f16", 2), ("f32", 4)])
def test_bytes_per_token_and_the_f16_equivalent_follow_from_the_shape(tiny_dir, kv, value_bytes):
    """Unquantized modes: K and V of every layer and KV head, ``head_dim`` values each. The f16 figure
    is a whole number of positions: what an f16 pool of the same bytes would hold."""
    model = kvlens.load(tiny_dir, kv=kv, attn_backend="numba")
    c = model.config
    per_token = c.n_layers * c.n_kv_heads * c.head_dim * 2 * value_bytes
    engine = Engine(model, EngineConfig(kv_budget_bytes=10 * 32 * per_token))
    s = engine.stats()
    assert s.bytes_per_token == per_token
    f16_per_token = c.n_layers * c.n_kv_heads * c.head_dim * 2 * 2
    assert type(s.f16_tokens_same_bytes) is int
    assert s.f16_tokens_same_bytes == engine.pool.bytes_total // f16_per_token
    assert s.f16_tokens_same_bytes == s.tokens_capacity * value_bytes // 2


def test_q8_f16_equivalent_is_a_whole_number_of_positions(llm):  # noqa: F811
    c = llm.config
    engine = Engine(llm, EngineConfig(kv_budget_bytes=budget(llm, 7)))
    f16_per_token = c.n_layers * c.n_kv_heads * c.head_dim * 4
    s = engine.stats()
    assert type(s.f16_tokens_same_bytes) is int
    assert s.f16_tokens_same_bytes == engine.pool.bytes_total // f16_per_token
    # int8 codes are half an f16 row; their scale and sums add less than the other half at head_dim 16
    assert s.tokens_capacity / 2 < s.f16_tokens_same_bytes < s.tokens_capacity


def test_without_a_prefix_cache_its_counters_are_zero(llm):  # noqa: F811
    """Requests that share a prompt, run with the prefix cache off: nothing is reused, cached or
    evicted, and there is no disk tier to report."""
    engine = Engine(llm, EngineConfig(kv_budget_bytes=budget(llm, 8), prefix_cache=False))
    r = req("a", 40, 3, seed=1)
    drive(engine, {0: [r], 3: [req("b", 40, 3, seed=1)]}, {})
    s = engine.stats()
    assert (s.prefix_hit_tokens, s.prefix_evictions, s.prefix_cached_blocks, s.disk) == (0, 0, 0, None)
    assert s.prompt_tokens == 80  # the premise: both prompts ran


def test_a_prefix_cache_without_a_disk_tier_reports_no_disk(llm):  # noqa: F811
    engine = Engine(
        llm.variant(prefill_chunk=32), EngineConfig(kv_budget_bytes=budget(llm, 8), prefix_cache=True)
    )
    engine.add_request(req("a", 40, 2, seed=1))
    for _ in steps_until_done(engine, limit=20):
        engine.step()
    assert not engine.has_unfinished() and engine.stats().prefix_cached_blocks == 1  # its one whole chunk
    assert engine.stats().disk is None


def test_the_disk_stats_are_a_copy_taken_at_the_call(llm, tmp_path):  # noqa: F811
    """The HTTP thread reads the stats while the engine thread restores blocks: it gets a copy whose
    restore-time histogram does not move under it."""
    config = EngineConfig(kv_budget_bytes=budget(llm, 8), prefix_cache=True, kv_disk=tmp_path / "tier")
    engine = Engine(llm.variant(prefill_chunk=32), config)
    live = engine.prefix.disk.stats.restore_seconds
    live.observe(0.01)
    seen = engine.stats().disk.restore_seconds
    assert seen is not live and (seen.bounds, seen.counts, seen.total) == (
        live.bounds,
        live.counts,
        live.total,
    )
    live.observe(0.02)
    assert sum(seen.counts) == 1 and seen.total == 0.01


def test_the_newest_running_sequence_is_the_one_preempted(llm, monkeypatch):  # noqa: F811
    """vLLM's rule, and the docstring's: a short pool sends back the sequence admitted last, so the
    oldest requests keep their progress."""
    engine = Engine(llm, EngineConfig(kv_budget_bytes=budget(llm, 6)))
    newest: list[bool] = []
    preempt = engine._preempt

    def watched(seq) -> None:
        newest.append(seq is engine.running[-1] and len(engine.running) >= 2)
        preempt(seq)

    monkeypatch.setattr(engine, "_preempt", watched)
    drive(engine, {0: [req(str(i), 20 + 9 * i, 30, seed=i) for i in range(4)]}, {})
    assert newest and all(newest)


def test_a_drawn_seed_fits_a_signed_64_bit_integer(llm):  # noqa: F811
    """A sampled request without a seed gets one drawn for its record (verify re-runs it); records go
    to JSON and SQLite, whose integers are signed 64-bit. 64 draws: a 64-bit draw would exceed 2**63 - 1
    in one of them with probability 1 - 2**-64."""
    engine = Engine(llm, EngineConfig(kv_budget_bytes=budget(llm, 8), max_waiting=64))
    seeds = []
    for i in range(64):
        r = Request(str(i), [5, 6, 7], 1, SamplingParams(temperature=1.0), frozenset())
        engine.add_request(r)
        seeds.append(r.sampling.seed)
    assert all(isinstance(s, int) and 0 <= s < 2**63 for s in seeds)
    assert len(set(seeds)) == 64


def test_a_negative_logprobs_count_is_refused_at_admission(llm):  # noqa: F811
    engine = Engine(llm, EngineConfig(kv_budget_bytes=budget(llm, 8)))
    with pytest.raises(ValueError, match="logprobs"):
        engine.add_request(Request("r", [5, 6, 7], 1, logprobs=-1))
