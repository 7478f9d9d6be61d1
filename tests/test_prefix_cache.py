"""Prefix cache: a reused prefix gives exactly the logits of a fresh prefill (the chunk rule), the
pool's refcounts and LRU stay consistent under random streams, and concurrent requests sharing a
prefix produce what each produces alone.

The reference for "fresh" is :meth:`LLM.prefill` on a new contiguous cache (not the paged engine),
cut by the same absolute chunks; "alone" is ``run_alone`` without the prefix cache.
"""

from __future__ import annotations

import random

import pytest
import torch
from engine_loop import steps_until_done
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlens
from kvlens.engine.scheduler import Engine, EngineConfig, Request, run_alone
from kvlens.kv.cache import BLOCK
from kvlens.kv.modes import KVMode
from kvlens.kv.pool import BlockPool, PagedKV, PoolExhaustedError
from kvlens.kv.prefix import block_hashes, cache_salt

CHUNK = 2 * BLOCK  # a chunk of two blocks: a hit must round down to whole chunks


TINY_MODEL = ("llama", 5)  # conftest's tiny_dir


@pytest.fixture(scope="module", params=["q8", "f16"])
def llm(request, tiny_dir):
    return kvlens.load(tiny_dir, kv=request.param, attn_backend="numba", prefill_chunk=CHUNK)


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 320) for _ in range(n)]


def run(engine: Engine, rid: str, prompt: list[int], n: int = 3) -> list:
    engine.add_request(Request(rid, prompt, n, stop_ids=frozenset()))
    events = []
    for _ in steps_until_done(engine):
        events += engine.step()
    return events


def fresh_logits(llm, prompt: list[int]) -> torch.Tensor:
    return llm.prefill(prompt, llm.new_cache(len(prompt)))


def test_second_turn_reuses_whole_chunks_and_matches_a_fresh_prefill(llm):
    rng = random.Random(1)
    engine = Engine(llm, EngineConfig(kv_budget_bytes=1 << 22, prefix_cache=True, keep_logits=True))
    turn1 = ids(rng, 2 * CHUNK + 40)  # its last, partial chunk holds a full block
    first = run(engine, "t1", turn1)
    assert first[0].cached_tokens == 0
    # named: the 2 whole chunks' 4 blocks; not the full block inside the partial chunk (its rows
    # came from a shorter chunk than a longer prompt's prefill runs there)
    assert len(engine.prefix.index) == 2 * CHUNK // BLOCK
    turn2 = turn1 + [e.token_id for e in first] + ids(rng, 40)
    second = run(engine, "t2", turn2)
    # the first turn published its 2 whole chunks (not its partial one, not the decoded tokens)
    assert second[0].cached_tokens == 2 * CHUNK
    assert [e.cached_tokens for e in second[1:]] == [0, 0]  # on the first token's event only
    assert torch.equal(second[0].logits, fresh_logits(llm, turn2))
    alone = list(run_alone(llm, Request("x", turn2, 3, stop_ids=frozenset()), EngineConfig(keep_logits=True)))
    assert [e.token_id for e in alone] == [e.token_id for e in second]
    assert all(torch.equal(a.logits, b.logits) for a, b in zip(alone, second, strict=True))
    s = engine.stats()
    assert (s.prefix_hit_tokens, s.blocks_used) == (2 * CHUNK, 0)


def test_same_prompt_again_leaves_its_last_chunk_to_compute(llm):
    rng = random.Random(2)
    engine = Engine(llm, EngineConfig(kv_budget_bytes=1 << 22, prefix_cache=True, keep_logits=True))
    prompt = ids(rng, 2 * CHUNK)  # ends on a chunk boundary: the last chunk must run for its logits
    run(engine, "a", prompt)
    again = run(engine, "b", prompt)
    assert again[0].cached_tokens == CHUNK
    assert torch.equal(again[0].logits, fresh_logits(llm, prompt))


def test_concurrent_requests_sharing_a_prefix_match_each_alone(llm):
    rng = random.Random(3)
    system = ids(rng, 2 * CHUNK + 5)
    prompts = [system + ids(rng, n) for n in (7, 40, 75)]
    engine = Engine(llm, EngineConfig(kv_budget_bytes=1 << 22, prefix_cache=True, max_batch=3))
    warm = run(engine, "warm", system + ids(rng, 3))
    assert warm and engine.stats().prefix_cached_blocks == 2 * CHUNK // BLOCK
    for i, p in enumerate(prompts):
        engine.add_request(Request(f"r{i}", p, 6, stop_ids=frozenset()))
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    cached = {}
    for _ in steps_until_done(engine):
        for ev in engine.step():
            got[ev.request_id].append(ev.token_id)
            cached.setdefault(ev.request_id, ev.cached_tokens)
    assert set(cached.values()) == {2 * CHUNK}
    for i, p in enumerate(prompts):
        alone = [e.token_id for e in run_alone(llm, Request("x", p, 6, stop_ids=frozenset()))]
        assert got[f"r{i}"] == alone


def test_random_stream_under_eviction_pressure_matches_alone(tiny_dir):
    """Conversations that share system prompts, through a pool that holds about two of them:
    blocks are shared, parked, evicted and recomputed, preemption happens; every output equals the
    same request run alone without a cache, and every block comes back at the end."""
    llm = kvlens.load(tiny_dir, kv="q8", attn_backend="numba", prefill_chunk=CHUNK)
    rng = random.Random(4)
    systems = [ids(rng, CHUNK + rng.randrange(0, 3 * CHUNK)) for _ in range(3)]
    reqs = [
        Request(f"q{i}", rng.choice(systems) + ids(rng, rng.randrange(1, 50)), rng.randrange(1, 8),
                stop_ids=frozenset())
        for i in range(14)
    ]  # fmt: skip
    budget = 14 * BLOCK * engine_bytes_per_token(llm)
    engine = Engine(llm, EngineConfig(kv_budget_bytes=budget, prefix_cache=True, max_batch=3))
    out: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    pending = list(reqs)
    for _ in steps_until_done(engine, pending=pending):
        if pending and rng.random() < 0.5:
            engine.add_request(pending.pop(0))
        for ev in engine.step():
            out[ev.request_id].append(ev.token_id)
    s = engine.stats()
    assert s.prefix_hit_tokens > 0 and s.prefix_evictions > 0
    assert s.blocks_used == 0 and (engine.pool.refcount == 0).all()
    for r in reqs:
        alone = Request("x", r.prompt_ids, r.max_tokens, stop_ids=frozenset())
        assert out[r.request_id] == [e.token_id for e in run_alone(llm, alone)], r.request_id


def engine_bytes_per_token(llm) -> int:
    from kvlens.kv.pool import kv_bytes_per_token

    c = llm.config
    return kv_bytes_per_token(llm.kv, c.n_layers, c.n_kv_heads, c.head_dim)


def test_prefix_cache_needs_a_chunk_of_whole_blocks(tiny_dir):
    llm = kvlens.load(tiny_dir, kv="q8", prefill_chunk=48)
    with pytest.raises(ValueError, match="multiple of 32"):
        Engine(llm, EngineConfig(kv_budget_bytes=1 << 20, prefix_cache=True))
    with pytest.raises(ValueError, match="needs prefix_cache"):
        EngineConfig(kv_disk="/tmp/x")


def test_eviction_takes_free_blocks_first_then_the_least_recently_parked():
    pool = BlockPool(1, 1, 8, KVMode.parse("q8"), 5 * BLOCK * 24)
    index = pool.enable_prefix()
    blocks = pool.allocate(4)
    for i, b in enumerate(blocks):
        index.publish(bytes([i]) * 4, b)
    pool.release([blocks[2], blocks[0], blocks[3], blocks[1]])  # parked in this order
    assert (pool.blocks_free, pool.blocks_cached, pool.blocks_used) == (5, 4, 0)
    assert pool.allocate(3) == [4, blocks[2], blocks[0]]  # the never-used block, then the oldest parked
    assert index.evictions == 2 and set(index.hash_of) == {blocks[3], blocks[1]}


def test_block_hashes_chain_and_salt():
    a = list(range(3 * BLOCK))
    b = a[:BLOCK] + [7] + a[BLOCK + 1 :]  # differs in block 1 only
    ha, hb = block_hashes(a, 3, b"s"), block_hashes(b, 3, b"s")
    assert ha[0] == hb[0] and ha[1] != hb[1] and ha[2] != hb[2]  # the chain carries the difference
    assert block_hashes(a, 3, b"t")[0] != ha[0]


def test_the_salt_names_everything_a_block_depends_on_besides_its_tokens():
    """Model file and weights, KV mode, mirror prefill source and prefill chunk each change the salt,
    so every hash: a disk folder shared by servers that differ in any of them hands none of them
    another's rows."""
    q8, f16 = KVMode.parse("q8"), KVMode.parse("f16")
    settings_ = [
        ("model-a", q8, "exact", 64),
        ("model-b", q8, "exact", 64),
        ("model-a", f16, "exact", 64),
        ("model-a", q8, "q8", 64),
        ("model-a", q8, "exact", 32),
    ]
    assert len({block_hashes(list(range(BLOCK)), 1, cache_salt(*s))[0] for s in settings_}) == len(settings_)


def test_a_freed_sequence_parks_its_tail_first_so_eviction_keeps_its_head():
    """A hit takes a prompt's cached blocks from its first one on, so a cached prefix is worth only
    its unbroken head: freeing parks the last block first, and eviction (oldest parked first) takes
    tails before heads."""
    pool = BlockPool(1, 1, 8, KVMode.parse("q8"), 4 * BLOCK * 24)
    index = pool.enable_prefix()
    kv = PagedKV(pool)
    kv.grow(4 * BLOCK)
    head_to_tail = list(kv.blocks)
    for j, b in enumerate(head_to_tail):
        index.publish(bytes([j]) * 4, b)
    kv.free()
    assert pool.allocate(2) == head_to_tail[:1:-1]  # the last block, then the one before it
    assert set(index.hash_of) == set(head_to_tail[:2])


def test_a_recompute_that_takes_back_its_own_chunks_is_no_prefix_hit(tiny_dir):
    """Preemption frees a sequence's blocks while its published chunks stay cached, so its recompute
    takes them back. That is the request's own work, not reuse: cached_tokens (usage) and the hit
    counter count first admissions only, and every output is the lone run's."""
    llm = kvlens.load(tiny_dir, kv="q8", attn_backend="numba", prefill_chunk=CHUNK)
    rng = random.Random(9)
    reqs = [Request(f"p{i}", ids(rng, CHUNK + 10 + 7 * i), 40, stop_ids=frozenset()) for i in range(3)]
    budget = 9 * BLOCK * engine_bytes_per_token(llm)
    engine = Engine(llm, EngineConfig(kv_budget_bytes=budget, prefix_cache=True, max_batch=3))
    reused: list[int] = []
    acquire = engine.prefix.acquire
    engine.prefix.acquire = lambda kv, prompt: reused.append(acquire(kv, prompt)) or reused[-1]
    for r in reqs:
        engine.add_request(r)
    out: dict[str, list] = {r.request_id: [] for r in reqs}
    for _ in range(500):
        for ev in engine.step():
            out[ev.request_id].append(ev)
        if not engine.has_unfinished():
            break
    s = engine.stats()
    assert s.preemptions > 0 and any(reused), "premise: a recompute took back its own cached chunks"
    assert s.prefix_hit_tokens == 0 and all(out[r.request_id][0].cached_tokens == 0 for r in reqs)
    for r in reqs:
        alone = run_alone(llm, Request("x", r.prompt_ids, r.max_tokens, stop_ids=frozenset()))
        assert [e.token_id for e in out[r.request_id]] == [e.token_id for e in alone]


# -- pool invariants under random operations (hypothesis), against a plain model of the pool ------------
OPS = st.lists(
    st.tuples(st.sampled_from(["alloc", "publish", "release", "share"]), st.integers(0, 1000)),
    max_size=80,
)


@settings(max_examples=60, deadline=None)
@given(OPS)
def test_pool_refcounts_parking_and_lru_eviction(ops):
    pool = BlockPool(1, 1, 8, KVMode.parse("q8"), 6 * BLOCK * 16)
    n = pool.n_blocks
    index = pool.enable_prefix()
    refs = [0] * n  # the model: references per block, published names, parked order
    named: dict[int, bytes] = {}
    parked: list[int] = []
    for op, x in ops:
        held = [b for b in range(n) if refs[b] > 0]
        if op == "alloc":
            k = x % 3 + 1
            if k > n - len(held):
                with pytest.raises(PoolExhaustedError):
                    pool.allocate(k)
                continue
            plain_free = sum(1 for b in range(n) if refs[b] == 0 and b not in parked)
            evicted = parked[: max(0, k - plain_free)]  # free blocks first, then least recently parked
            got = pool.allocate(k)
            assert all(refs[b] == 0 for b in got), "handed out a referenced block"
            assert set(got) & set(parked) == set(evicted)
            for b in got:
                if b in evicted:  # its name is dropped with it
                    parked.remove(b)
                    named.pop(b)
                refs[b] = 1
        elif op == "publish" and held:
            b = held[x % len(held)]
            h = bytes([x % 7]) * 4
            assert index.publish(h, b) == (b not in named and h not in named.values())
            if b not in named and h not in named.values():
                named[b] = h
        elif op == "release" and held:
            b = held[x % len(held)]
            pool.release([b])
            refs[b] -= 1
            if refs[b] == 0 and b in named:
                parked.append(b)
        elif op == "share":
            cands = held + parked
            if cands:
                b = cands[x % len(cands)]
                pool.share([b])
                if refs[b] == 0:
                    parked.remove(b)
                refs[b] += 1
        assert [int(r) for r in pool.refcount] == refs
        assert pool.blocks_free == n - sum(r > 0 for r in refs)
        assert pool.blocks_cached == len(parked)
        assert {b: h for h, b in index.block_of.items()} == named == index.hash_of
    unparked_free = [b for b in range(n) if refs[b] == 0 and b not in parked]
    if unparked_free:
        with pytest.raises(ValueError, match="cannot share free block"):
            pool.share(unparked_free[:1])
