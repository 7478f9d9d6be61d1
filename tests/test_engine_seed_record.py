"""Every sampled request gets a recorded seed when it is added (so `verify` can re-run it), whatever
its temperature; a greedy one gets none. The recorded seed reproduces the sampled tokens."""

from dataclasses import replace

import pytest
from engine_loop import steps_until_done
from test_scheduler import budget, req

from kvlens.engine.sampling import SamplingParams
from kvlens.engine.scheduler import Engine, EngineConfig, run_batch

TINY_MODEL = ("llama", 5)


@pytest.mark.parametrize("temperature", [5e-324, 0.5, 1.0, 1.5])
def test_a_sampled_request_gets_a_seed_that_reproduces_it(tiny, temperature):
    first = replace(req("a", 20, 6), sampling=SamplingParams(temperature=temperature))
    engine = Engine(tiny, EngineConfig(kv_budget_bytes=budget(tiny, 8)))
    engine.add_request(first)
    seed = first.sampling.seed
    assert isinstance(seed, int)
    tokens = []
    for _ in steps_until_done(engine):
        tokens += [e.token_id for e in engine.step() if e.token_id is not None]
    again = replace(req("b", 20, 6), sampling=SamplingParams(temperature=temperature, seed=seed))
    assert run_batch(tiny, [again])["b"] == tokens


def test_a_greedy_request_gets_no_seed(tiny):
    greedy = req("g", 20, 2)
    Engine(tiny, EngineConfig(kv_budget_bytes=budget(tiny, 8))).add_request(greedy)
    assert greedy.sampling.seed is None
