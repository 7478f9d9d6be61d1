"""A decode step advances every decoding sequence by one token.

Batch invariance alone does not show this: the scheduler re-runs a sequence whose cache did not grow
(``kv.length`` short of its tokens) on a later step, so a batched decode that served only its first
row still ends with each sequence's own tokens and logits, one sequence after another. Counting the
events of each step tells a batch from that serial replay."""

from __future__ import annotations

import pytest
import torch

import kvlens
from kvlens.engine.scheduler import Engine, EngineConfig, Request

TINY_MODEL = ("llama", 3)  # conftest's tiny_dir


@pytest.fixture(
    scope="module",
    params=[("q8", "numba"), ("f32", "numba"), ("q8", "torch")],
    ids=["q8-numba", "f32-numba", "q8-torch"],
)
def llm(request, tiny_dir):
    kv, backend = request.param
    return kvlens.load(tiny_dir, kv=kv, attn_backend=backend, prefill_chunk=16)


def test_every_decoding_sequence_gets_one_token_per_step(llm):
    g = torch.Generator().manual_seed(7)
    lengths, new = [5, 9, 13, 21], 6
    engine = Engine(llm, EngineConfig(kv_budget_bytes=1 << 22, prefill_token_budget=1024))
    for i, n in enumerate(lengths):
        engine.add_request(
            Request(str(i), torch.randint(5, 300, (n,), generator=g).tolist(), new, stop_ids=frozenset())
        )
    counts: dict[str, int] = {str(i): 0 for i in range(len(lengths))}
    for _ in range(100):
        if not engine.has_unfinished():
            break
        decoding = {s.req.request_id for s in engine.running if not s.in_prefill}
        events = engine.step()
        emitted = [e.request_id for e in events]
        assert len(emitted) == len(set(emitted)), "a sequence got two tokens in one step"
        missing = decoding - set(emitted)
        assert not missing, f"decoding sequences {sorted(missing)} got no token this step"
        for rid in emitted:
            counts[rid] += 1
    assert not engine.has_unfinished()
    assert counts == {str(i): new for i in range(len(lengths))}
