"""A sampler that fails on one request's logits ends that request alone (thirty-sixth session: the
sampler ran outside the per-sequence guard, so its error left ``Engine.step`` and the server ended
every request in flight). The fault is injected at the sampler's first call (the token a prefill
chunk emits) or its third (a batched decode row); the other request runs on to the tokens it gives
alone, and every block goes back to the pool."""

from __future__ import annotations

import pytest
import torch
from test_engine_failure import _drive, _engine, _load, _prompt, _tokens, model_dir  # noqa: F401

import kvlens.engine.scheduler
from kvlens.engine.sampling import Sampler, SamplingParams
from kvlens.engine.scheduler import Request, run_alone

FAULTY_SEED = 666


@pytest.mark.parametrize("fail_at", [1, 3])
def test_a_sampler_that_fails_ends_its_request_alone(model_dir, monkeypatch, fail_at):  # noqa: F811
    class FaultySampler(Sampler):
        def __init__(self, params: SamplingParams) -> None:
            super().__init__(params)
            self.calls = 0

        def __call__(self, logits: torch.Tensor) -> int:
            self.calls += 1
            if self.p.seed == FAULTY_SEED and self.calls == fail_at:
                raise RuntimeError("injected sampler fault")
            return super().__call__(logits)

    llm = _load(model_dir)
    a = Request("a", _prompt(21, 1), 6, stop_ids=frozenset())
    b = Request("b", _prompt(37, 2), 6, SamplingParams(temperature=1.0, seed=FAULTY_SEED), frozenset())
    want = _tokens(list(run_alone(llm, a)))
    monkeypatch.setattr(kvlens.engine.scheduler, "Sampler", FaultySampler)
    out = _drive(_engine(llm), [a, b])  # asserts every block freed
    assert _tokens(out["a"]) == want
    end = out["b"][-1]
    assert (end.finish_reason, str(end.error)) == ("error", "injected sampler fault")
    assert len(_tokens(out["b"])) == fail_at - 1
