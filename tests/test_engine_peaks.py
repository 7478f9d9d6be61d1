"""The engine's high-water marks (``EngineStats.peak_running`` / ``peak_blocks_used``, exposed as
``kvlens_requests_running_peak`` / ``kvlens_kv_blocks_used_peak``) against an independent watch: the
running list's length after every append, and the referenced blocks (refcount > 0) after every pool
call that takes, shares or releases blocks. A poll between steps can miss a burst; these are exact."""

from __future__ import annotations

import numpy as np
import pytest
from test_scheduler import budget, req
from tiny_models import write_hf

import kvlens
from kvlens.engine.scheduler import Engine, EngineConfig, Request
from kvlens.kv.cache import BLOCK


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    out = tmp_path_factory.mktemp("peaks") / "hf"
    write_hf("qwen2", out, seed=5)
    return kvlens.load(out, kv="q8", attn_backend="numba", prefill_chunk=BLOCK)  # the prefix cache's unit


class WatchedList(list):
    """The engine's running list, noting its longest length at every append."""

    longest = 0

    def append(self, item) -> None:
        super().append(item)
        self.longest = max(self.longest, len(self))


def watch_pool(engine: Engine) -> list[int]:
    """Referenced blocks after each allocate / share / release, counted from the refcounts."""
    seen = [0]
    pool = engine.pool
    for name in ("allocate", "share", "release"):
        call = getattr(pool, name)

        def watched(*args, _call=call):
            out = _call(*args)
            seen.append(int(np.count_nonzero(pool.refcount > 0)))
            return out

        setattr(pool, name, watched)
    return seen


def run(engine: Engine, arrivals: dict[int, list[Request]]) -> None:
    for step in range(2000):
        for r in arrivals.get(step, []):
            engine.add_request(r)
        engine.step()
        if step >= max(arrivals) and not engine.has_unfinished():
            return
    raise AssertionError("the requests did not finish in 2000 steps")


def test_a_burst_over_max_batch_peaks_at_max_batch(llm):
    engine = Engine(llm, EngineConfig(kv_budget_bytes=budget(llm, 40), max_batch=2))
    assert (engine.stats().peak_running, engine.stats().peak_blocks_used) == (0, 0)
    run(engine, {0: [req(f"r{i}", 20, 3, seed=i) for i in range(3)]})
    s = engine.stats()
    assert (s.running, s.blocks_used) == (0, 0) and s.peak_running == 2
    # two 20-token prompts with 3 new tokens: 22 positions each are written, in ceil(22/BLOCK) blocks
    assert s.peak_blocks_used == 2 * -(-22 // BLOCK)


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_the_peaks_are_the_watched_maxima(llm, prefix_cache):
    """Staggered arrivals, a shared prefix (the cache's share path) and a pool small enough to preempt."""
    engine = Engine(llm, EngineConfig(kv_budget_bytes=budget(llm, 9), max_batch=4, prefix_cache=prefix_cache))
    engine.running = running = WatchedList()
    seen = watch_pool(engine)
    shared = req("p", 2 * BLOCK, 1).prompt_ids
    arrivals = {
        0: [req("a", 40, 20, seed=1), Request("s1", shared + [7, 8], 6, stop_ids=frozenset())],
        3: [Request("s2", shared + [9], 12, stop_ids=frozenset()), req("b", 30, 25, seed=2)],
        9: [req("c", 70, 10, seed=3)],
    }
    run(engine, arrivals)
    s = engine.stats()
    assert s.preemptions > 0, "premise: the pool is small enough to preempt"
    assert s.prefix_hit_tokens >= (BLOCK if prefix_cache else 0), "premise: s2 reuses s1's prefix"
    assert s.peak_running == running.longest >= 2
    assert s.peak_blocks_used == max(seen) <= engine.pool.n_blocks


def test_taking_parked_blocks_back_raises_the_peak():
    """``share`` alone, with no ``allocate`` after it: a published block parked when its last owner
    let go is referenced again (a prefix hit), which the high-water mark counts."""
    from kvlens.kv.modes import KVMode
    from kvlens.kv.pool import BlockPool, kv_block_bytes

    mode = KVMode.parse("q8")
    pool = BlockPool(2, 2, 16, mode, 4 * kv_block_bytes(mode, 2, 2, 16))
    index = pool.enable_prefix()
    a, b, c = pool.allocate(3)
    for n, block in enumerate((a, b, c)):
        index.publish(bytes([n]), block)
    pool.release([a, b, c])  # all three parked: 0 referenced, the peak 3
    pool.allocate(1)
    assert (pool.blocks_used, pool.peak_used) == (1, 3)
    pool.share([a, b, c])  # 4 referenced: the pool's every block
    assert (pool.blocks_used, pool.peak_used) == (4, 4)
