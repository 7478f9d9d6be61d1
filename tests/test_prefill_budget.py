"""Chunked prefill under ``EngineConfig.prefill_token_budget`` (engine/scheduler.py): per step, the
prompt tokens prefilled stay within the budget, spent in whole chunks, running sequences' next chunks
first, then waiting requests in arrival order while their first chunk fits; a step's first chunk
always runs. The outputs cannot show this (a step's schedule never changes a token); a step that
overspends is a latency spike for every request decoding beside it."""

from __future__ import annotations

import random

import pytest
from engine_loop import steps_until_done
from test_scheduler import budget, llm, req  # noqa: F401

from kvlens.engine.scheduler import Engine, EngineConfig


def prefill_schedule(
    model, requests, token_budget: int, prefix_cache: bool = False, before=()
) -> list[list[int]]:
    """The chunk lengths each step prefilled (the model runner's prefill calls, step by step), after
    the ``before`` requests ran to their end."""
    config = EngineConfig(
        kv_budget_bytes=budget(model, 64), prefill_token_budget=token_budget, prefix_cache=prefix_cache
    )
    engine = Engine(model, config)
    for r in before:
        engine.add_request(r)
    for _ in steps_until_done(engine):
        engine.step()
    steps: list[list[int]] = []
    prefill = engine.runner.prefill

    def watched(kv, ids, start):
        steps[-1].append(len(ids))
        return prefill(kv, ids, start)

    engine.runner.prefill = watched
    for r in requests:
        engine.add_request(r)
    for _ in steps_until_done(engine, limit=500):
        steps.append([])
        engine.step()
    return [s for s in steps if s]


def test_a_worked_schedule(llm):  # noqa: F811
    """Chunks of 16, budget 40: A (40 tokens: 16 + 16 + 8), B (20: 16 + 4), C (10), D (16).
    Step 1: A's and B's first chunks (32; C's 10 would make 42). Step 2: the running first, A 16 and
    B 4, then C 10 (30; D's 16 would make 46). Step 3: A's last 8, then D 16 (24)."""
    assert llm.prefill_chunk == 16
    reqs = [req("A", 40, 2, 1), req("B", 20, 2, 2), req("C", 10, 2, 3), req("D", 16, 2, 4)]
    assert prefill_schedule(llm, reqs, 40) == [[16, 16], [16, 4, 10], [8, 16]]


def test_a_chunk_that_fills_the_budget_exactly_runs_in_that_step(llm):  # noqa: F811
    """Waiting requests' first chunks, then running sequences' next ones, filling a budget of 32."""
    assert prefill_schedule(llm, [req(str(i), 16, 2, i) for i in range(3)], 32) == [[16, 16], [16]]
    assert prefill_schedule(llm, [req(str(i), 48, 2, i) for i in range(2)], 32) == [[16, 16]] * 3


def test_a_prompt_resumed_from_the_prefix_cache_spends_only_what_it_computes(llm):  # noqa: F811
    """Chunks of 32, budget 64. P (65 tokens) ran before, so its two whole chunks are cached; the same
    prompt again computes its last token only (1), and R's 32 fits beside it in either order."""
    llm = llm.variant(prefill_chunk=32)
    p = req("P", 65, 1, 7)
    again = req("again", 65, 1, 7)
    assert prefill_schedule(llm, [again, req("R", 32, 1, 8)], 64, prefix_cache=True, before=[p]) == [[1, 32]]
    # the other order: R's 32 first, then the resumed prompt's 1 still fits
    assert prefill_schedule(llm, [req("R", 32, 1, 8), again], 64, prefix_cache=True, before=[p]) == [[32, 1]]


@pytest.mark.parametrize("seed", range(6))
def test_no_step_spends_more_than_the_budget_unless_it_ran_one_chunk(llm, seed):  # noqa: F811
    rng = random.Random(seed)
    token_budget = rng.choice([16, 20, 33, 48, 64])
    reqs = [
        req(str(i), rng.randrange(1, 70), rng.randrange(1, 4), seed * 100 + i)
        for i in range(rng.randrange(2, 7))
    ]
    steps = prefill_schedule(llm, reqs, token_budget)
    assert sum(map(sum, steps)) == sum(len(r.prompt_ids) for r in reqs)  # every prompt token once
    assert all(sum(s) <= token_budget or len(s) == 1 for s in steps), steps
    assert all(n <= llm.prefill_chunk for s in steps for n in s)
