"""Scheduler invariants under random request streams (hypothesis), preemption by recompute, abort,
and the engine's refusals. A tiny random model; the pool is made small enough to force preemption."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import write_hf

import kvlens
from kvlens.engine.scheduler import Engine, EngineConfig, QueueFullError, Request, run_alone
from kvlens.kv.cache import BLOCK
from kvlens.kv.pool import kv_bytes_per_token


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    out = tmp_path_factory.mktemp("sched") / "hf"
    write_hf("qwen2", out, seed=5)
    return kvlens.load(out, kv="q8", attn_backend="numba", prefill_chunk=16)


def budget(llm, blocks: int) -> int:
    cfg = llm.config
    return blocks * BLOCK * kv_bytes_per_token(llm.kv, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim)


def req(rid: str, n: int, new: int, seed: int = 0) -> Request:
    ids = torch.randint(5, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    return Request(rid, ids, new, stop_ids=frozenset())


def check_blocks(engine: Engine) -> None:
    """No block owned twice; owned blocks referenced once; owned + free = all."""
    owned = [b for s in (*engine.running, *engine.waiting) for b in s.kv.blocks]
    assert len(owned) == len(set(owned)), "a block is owned twice"
    assert all(engine.pool.refcount[b] == 1 for b in owned)
    assert sorted(owned + list(engine.pool._free)) == list(range(engine.pool.n_blocks))
    assert all(not s.kv.blocks for s in engine.waiting)  # waiting (or preempted) hold nothing


def drive(engine: Engine, arrivals: dict[int, list[Request]], aborts: dict[int, str]) -> dict[str, list]:
    out: dict[str, list] = {}
    step = 0
    while engine.has_unfinished() or step <= max(arrivals, default=0):
        for r in arrivals.get(step, []):
            engine.add_request(r)
            out[r.request_id] = []
        if step in aborts:
            engine.abort(aborts[step])
        for ev in engine.step():
            out[ev.request_id].append(ev)
        check_blocks(engine)
        step += 1
        assert step < 5000
    assert engine.stats().blocks_used == 0
    return out


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    stream=st.lists(
        st.tuples(st.integers(0, 12), st.integers(1, 50), st.integers(1, 12)), min_size=1, max_size=8
    ),
    pool_blocks=st.integers(4, 12),
    abort_at=st.none() | st.tuples(st.integers(0, 15), st.integers(0, 7)),
)
def test_random_streams_keep_block_invariants(llm, stream, pool_blocks, abort_at):
    engine = Engine(llm, EngineConfig(kv_budget_bytes=budget(llm, pool_blocks), max_batch=4))
    arrivals: dict[int, list[Request]] = {}
    for i, (at, n, new) in enumerate(stream):
        if -(-(n + new) // BLOCK) <= pool_blocks:
            arrivals.setdefault(at, []).append(req(str(i), n, new, seed=i))
    aborts = {abort_at[0]: str(abort_at[1])} if abort_at else {}
    out = drive(engine, arrivals, aborts)
    for r in (r for rs in arrivals.values() for r in rs):
        evs = out[r.request_id]
        assert evs and evs[-1].finished and sum(e.finished for e in evs) == 1
        if evs[-1].finish_reason != "abort":
            assert evs[-1].finish_reason == "length" and len(evs) == r.max_tokens


def test_preemption_recompute_equals_uninterrupted(llm):
    reqs = [req(str(i), 20 + 9 * i, 30, seed=i) for i in range(4)]
    engine = Engine(llm, EngineConfig(kv_budget_bytes=budget(llm, 6), keep_logits=True))
    out = drive(engine, {0: reqs}, {})
    assert engine.stats().preemptions > 0  # the tiny pool really forced recomputation
    for r in reqs:
        alone = list(run_alone(llm, r, EngineConfig(kv_budget_bytes=budget(llm, 8), keep_logits=True)))
        assert [e.token_id for e in out[r.request_id]] == [e.token_id for e in alone]
        for a, b in zip(alone, out[r.request_id], strict=True):
            assert torch.equal(a.logits, b.logits)


def test_abort_frees_blocks_at_once(llm):
    engine = Engine(llm, EngineConfig(kv_budget_bytes=budget(llm, 10)))
    engine.add_request(req("a", 40, 20))
    engine.add_request(req("b", 10, 20))
    engine.step()
    engine.step()
    assert engine.stats().blocks_used > 0
    engine.abort("a")
    engine.abort("b")
    engine.abort("unknown")  # no-op
    assert engine.stats().blocks_used == 0 and engine.stats().running == 0
    events = engine.step()
    assert {(e.request_id, e.token_id, e.finish_reason) for e in events} == {
        ("a", None, "abort"),
        ("b", None, "abort"),
    }
    assert not engine.has_unfinished()


def test_stop_id_is_reported_and_frees(llm):
    (first,) = [e.token_id for e in run_alone(llm, req("x", 12, 1))]
    r = req("x", 12, 50)
    r.stop_ids = frozenset({first})
    events = list(run_alone(llm, r))
    assert [(e.token_id, e.finish_reason) for e in events] == [(first, "stop")]


def test_queue_bound_counts_only_requests_that_must_wait(llm):
    """A burst on an idle engine fills the free running slots first; max_waiting bounds the rest."""
    engine = Engine(llm, EngineConfig(kv_budget_bytes=budget(llm, 8), max_batch=3, max_waiting=1))
    for i in range(4):  # 3 free slots + 1 waiting
        engine.add_request(req(f"r{i}", 5, 4))
    with pytest.raises(QueueFullError):
        engine.add_request(req("r4", 5, 4))
    engine.step()  # admits 3: the running slots are full, one request waits
    assert (len(engine.running), len(engine.waiting)) == (3, 1)
    with pytest.raises(QueueFullError):
        engine.add_request(req("r5", 5, 4))


def test_refusals(llm):
    engine = Engine(llm, EngineConfig(kv_budget_bytes=budget(llm, 3), max_batch=1, max_waiting=1))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request(Request("e", [], 4))
    with pytest.raises(ValueError, match="context"):
        engine.add_request(req("c", 10, llm.config.max_ctx))
    with pytest.raises(ValueError, match="never fit"):
        engine.add_request(req("f", 90, 10))
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request(Request("v", [llm.config.vocab], 4))
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request(Request("m", [5], 0))
    engine.add_request(req("a", 5, 4))
    with pytest.raises(ValueError, match="duplicate"):
        engine.add_request(req("a", 5, 4))
    engine.add_request(req("b", 5, 4))
    with pytest.raises(QueueFullError):
        engine.add_request(req("c", 5, 4))
    s = engine.stats()
    assert (s.blocks_total, s.block_size, s.waiting, s.blocks_used) == (3, BLOCK, 2, 0)
    assert s.f16_tokens_same_bytes < s.tokens_capacity  # q8 holds more than f16 in the same bytes


def test_a_chunk_larger_than_the_prefill_budget_still_runs_one_per_step(llm):
    """The first chunk of a step always runs: a budget below the chunk size slows prefill to one
    chunk per step, it never stalls it, and the output is the lone run's."""
    r = req("big", 40, 3, seed=9)  # chunks [0, 16), [16, 32), [32, 40) at prefill_chunk=16
    engine = Engine(llm, EngineConfig(kv_budget_bytes=budget(llm, 4), prefill_token_budget=4))
    engine.add_request(r)
    steps = []
    for step in range(12):  # bounded: a stalled prefill fails here, it does not hang
        steps += [(step, ev.token_id) for ev in engine.step()]
        if not engine.has_unfinished():
            break
    assert [s for s, _ in steps] == [2, 3, 4]  # one chunk per step; the third one's logits give token 1
    alone = run_alone(llm, req("big", 40, 3, seed=9))
    assert [t for _, t in steps] == [e.token_id for e in alone]
