"""Scheduler paths the stream tests pass by (engine/scheduler.py): a prompt whose last chunk is a
single token, logprobs under a sampling temperature, and a waiting request that took cached prefix
blocks but could not be admitted.

References are independent of the scheduler: the contiguous cache's prefill and one-token forwards
(:meth:`LLM.prefill`, :meth:`LLM.forward`, cut by the same absolute chunks, so the logits are the
paged engine's bit for bit: test_prefix_cache), and plain block counting.
"""

from __future__ import annotations

import random

import torch
from test_prefix_cache import engine_bytes_per_token

import kvlens
from kvlens.engine.sampling import SamplingParams
from kvlens.engine.scheduler import Engine, EngineConfig, Request
from kvlens.kv.cache import BLOCK

CHUNK = 2 * BLOCK
TINY_MODEL = ("llama", 5)  # conftest's tiny_dir


def load(tiny_dir):
    return kvlens.load(tiny_dir, kv="q8", attn_backend="numba", prefill_chunk=CHUNK)


def run(engine: Engine, req: Request) -> list:
    engine.add_request(req)
    events = []
    for _ in range(200):
        events += engine.step()
        if not engine.has_unfinished():
            return events
    raise AssertionError("the request did not finish in 200 steps")


def greedy_reference(llm, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and the logits each was chosen from, on a contiguous cache."""
    cache = llm.new_cache(len(prompt) + n)
    logits, tokens = [llm.prefill(prompt, cache)], []
    for i in range(n):
        tokens.append(int(logits[-1].argmax()))
        if i + 1 < n:
            logits.append(llm.lm_head(llm.forward(tokens[-1:], cache, len(prompt) + i, prefill=False))[0])
    return tokens, logits


def test_a_prompt_whose_last_chunk_is_one_token_is_answered_after_all_of_it(tiny_dir):
    """Prompts of CHUNK + 1 and 2 CHUNK - 1 tokens (a chunk ending one token short of the prompt, or
    the last chunk one token long): the first token comes after the whole prompt, each token the
    contiguous cache's greedy choice, exactly max_tokens of them."""
    llm = load(tiny_dir)
    rng = random.Random(2)
    for n in (CHUNK + 1, 2 * CHUNK - 1):
        prompt = [rng.randrange(3, 320) for _ in range(n)]
        engine = Engine(
            llm, EngineConfig(kv_budget_bytes=8 * BLOCK * engine_bytes_per_token(llm), max_batch=2)
        )
        events = run(engine, Request("r", prompt, 4, stop_ids=frozenset()))
        want, _ = greedy_reference(llm, prompt, 4)
        assert [e.token_id for e in events] == want, n


def test_logprobs_are_the_models_whatever_the_temperature(tiny_dir):
    """A sampled request (temperature 0.7) asks for logprobs: each is the log-softmax of the model's
    own logits (TokenEvent.logprob: temperature-free), as OpenAI reports them, not of the tempered
    distribution the token was drawn from."""
    llm = load(tiny_dir)
    prompt = list(range(3, 40))
    engine = Engine(llm, EngineConfig(kv_budget_bytes=8 * BLOCK * engine_bytes_per_token(llm), max_batch=2))
    sampling = SamplingParams(temperature=0.7, seed=11)
    events = run(engine, Request("r", prompt, 3, sampling=sampling, stop_ids=frozenset(), logprobs=2))
    cache = llm.new_cache(len(prompt) + 3)
    logits = llm.prefill(prompt, cache)
    for i, ev in enumerate(events):
        lp = torch.log_softmax(logits.float(), dim=-1)
        assert ev.logprob == float(lp[ev.token_id]), f"token {i}"
        vals, idx = torch.topk(lp, 2)
        assert ev.top_logprobs == list(zip(idx.tolist(), vals.tolist(), strict=True)), f"token {i}"
        logits = llm.lm_head(llm.forward([ev.token_id], cache, len(prompt) + i, prefill=False))[0]


def test_a_request_refused_admission_gives_back_the_cached_blocks_it_took(tiny_dir):
    """A request whose system prompt is cached takes those blocks, then waits (the pool cannot hold
    its next chunk while another request runs): it gives them back while it waits, so after every
    step a waiting request holds no block and each block's refcount is the number of running
    sequences holding it; the outputs are the greedy reference's, and the engine's prompt and
    generated token counters (the /metrics counters) the requests' sums."""
    llm = load(tiny_dir)
    rng = random.Random(6)
    system = [rng.randrange(3, 320) for _ in range(CHUNK)]
    engine = Engine(
        llm,
        EngineConfig(kv_budget_bytes=6 * BLOCK * engine_bytes_per_token(llm), prefix_cache=True, max_batch=2),
    )
    warm = system + [rng.randrange(3, 320) for _ in range(5)]
    run(engine, Request("warm", warm, 1, stop_ids=frozenset()))  # publishes the system prompt's chunk
    long = Request("long", [rng.randrange(3, 320) for _ in range(3 * BLOCK + 5)], 20, stop_ids=frozenset())
    tail = [rng.randrange(3, 320) for _ in range(CHUNK)]
    late = Request("late", system + tail, 3, stop_ids=frozenset())
    engine.add_request(long)
    engine.step()
    engine.add_request(late)
    out: dict[str, list[int]] = {"long": [], "late": []}
    waited_with_a_hit = 0
    for _ in range(200):
        for ev in engine.step():
            out[ev.request_id].append(ev.token_id)
        held: dict[int, int] = {}
        for seq in engine.running:
            for b in seq.kv.blocks:
                held[b] = held.get(b, 0) + 1
        assert all(not s.kv.blocks for s in engine.waiting), "a waiting request holds blocks"
        assert all(engine.pool.refcount[b] == n for b, n in held.items())
        waited_with_a_hit += (
            any(s.req is late for s in engine.waiting) and engine.prefix.stats.hit_tokens == 0
        )
        if not engine.has_unfinished():
            break
    assert waited_with_a_hit, "premise: the late request waited while the long one ran"
    stats = engine.stats()
    assert stats.prefix_hit_tokens == CHUNK  # admitted at last, with its cached chunk
    assert stats.prompt_tokens == len(warm) + len(long.prompt_ids) + len(late.prompt_ids)
    assert stats.generated_tokens == 1 + 20 + 3
    assert out["long"] == greedy_reference(llm, long.prompt_ids, 20)[0]
    assert out["late"] == greedy_reference(llm, late.prompt_ids, 3)[0]
