"""The logprob fields of the engine's token events, against a float64 log-softmax of the logits the
event carries (``EngineConfig.keep_logits``): none where the request asked for none, the chosen
token's alone for ``logprobs=0``, and the chosen one's plus the N most likely, in order, for N."""

from __future__ import annotations

import pytest
import torch
from engine_loop import steps_until_done
from test_scheduler import budget, llm, req  # noqa: F401

from kvlens.engine.scheduler import Engine, EngineConfig


def events_of(llm, logprobs: int | None) -> list:  # noqa: F811
    engine = Engine(llm, EngineConfig(kv_budget_bytes=budget(llm, 4), keep_logits=True))
    r = req("r", 12, 3, seed=4)
    r.logprobs = logprobs
    engine.add_request(r)
    events = []
    for _ in steps_until_done(engine, limit=20):
        events += engine.step()
    assert len(events) == 3
    return events


def test_a_request_without_logprobs_gets_none(llm):  # noqa: F811
    assert all(ev.logprob is None and ev.top_logprobs is None for ev in events_of(llm, None))


@pytest.mark.parametrize("n", [0, 1, 4])
def test_logprobs_are_the_log_softmax_of_the_events_logits(llm, n):  # noqa: F811
    for ev in events_of(llm, n):
        lp = torch.log_softmax(ev.logits.double(), -1)
        # float32 log-softmax against float64: a few ulps of the logits' magnitude
        tol = 8 * torch.finfo(torch.float32).eps * max(1.0, ev.logits.abs().max().item())
        assert type(ev.logprob) is float and abs(ev.logprob - lp[ev.token_id].item()) <= tol
        assert len(ev.top_logprobs) == n
        want = torch.topk(lp, n)
        assert [i for i, _ in ev.top_logprobs] == want.indices.tolist()
        assert all(abs(v - w) <= tol for (_, v), w in zip(ev.top_logprobs, want.values.tolist(), strict=True))


def test_events_carry_no_logits_unless_asked(llm):  # noqa: F811
    """A server keeps no copy of every step's logits (a vocabulary of floats per token) unless its
    config asks (``keep_logits``, for tests and the lab)."""
    engine = Engine(llm, EngineConfig(kv_budget_bytes=budget(llm, 4)))
    engine.add_request(req("r", 12, 3, seed=4))
    events = []
    for _ in steps_until_done(engine, limit=20):
        events += engine.step()
    assert len(events) == 3 and all(ev.logits is None for ev in events)
