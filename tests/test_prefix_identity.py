"""What the prefix cache's reuse is keyed by, at the scheduler's side (``engine/prefix_cache.py``):
the model and the mirror's prefill source reach the salt of every block hash, the disk tier refuses a
file another model wrote under the same hash, and a prompt reuses every whole cached chunk that leaves
one token to compute (``kv/prefix.py``'s own salt test checks ``cache_salt`` alone)."""

from __future__ import annotations

import random

import pytest
from test_kv_disk import random_pool
from test_scheduler import budget, llm  # noqa: F401

from kvlens.engine.prefix_cache import PrefixCache
from kvlens.engine.scheduler import Engine, EngineConfig, Request
from kvlens.kv.cache import BLOCK
from kvlens.kv.modes import KVMode
from kvlens.kv.pool import BlockPool

CHUNK = 2 * BLOCK


def test_the_salt_names_the_model_and_the_mirrors_prefill_source():
    mode = KVMode.parse("q8+mirror")
    exact, q8 = (BlockPool(1, 1, 8, mode, 4 * BLOCK * 64, mirror_prefill=m) for m in ("exact", "q8"))
    salts = {
        PrefixCache(exact, "model-a", CHUNK).salt,
        PrefixCache(exact, "model-b", CHUNK).salt,
        PrefixCache(q8, "model-a", CHUNK).salt,
    }
    assert len(salts) == 3


def test_a_file_another_model_spilled_is_not_restored(tmp_path):
    """Two servers of other weights over one folder: even under the same hash (the salt differs, so
    this needs a forged hash), the file's header names its model and the other server refuses it."""
    pool_a, pool_b = random_pool("q8", 3), random_pool("q8", 4)
    a = PrefixCache(pool_a, "model-a", CHUNK, tmp_path, 1 << 20)
    h = bytes(range(32))
    a.disk.spill(1, h)
    assert a.disk.restore(2, h)  # the premise: the file is good for the model that wrote it
    b = PrefixCache(pool_b, "model-b", CHUNK, tmp_path, 1 << 20)
    assert h in b.disk  # it sees the file
    assert not b.disk.restore(1, h)


@pytest.mark.parametrize(
    ("whole_chunks", "extra", "reused_chunks"), [(2, 1, 2), (2, 0, 1), (1, 5, 1), (3, 1, 3)]
)
def test_a_prompt_reuses_every_cached_chunk_that_leaves_a_token_to_compute(
    llm, whole_chunks, extra, reused_chunks
):  # noqa: F811
    """The first run publishes the prompt's whole chunks; the same prompt again reuses all of them if
    a token is left after them, else all but the last (its last token's logits must be computed)."""
    llm = llm.variant(prefill_chunk=CHUNK)
    engine = Engine(llm, EngineConfig(kv_budget_bytes=budget(llm, 16), prefix_cache=True))
    rng = random.Random(whole_chunks * 10 + extra)
    prompt = [rng.randrange(5, 300) for _ in range(whole_chunks * CHUNK + extra)]
    first = [
        Request("first", prompt, 1, stop_ids=frozenset()),
        Request("again", prompt, 1, stop_ids=frozenset()),
    ]
    cached = {}
    for r in first:
        engine.add_request(r)
        for _ in range(100):
            if not engine.has_unfinished():
                break
            for ev in engine.step():
                cached.setdefault(ev.request_id, ev.cached_tokens)
    assert cached == {"first": 0, "again": reused_chunks * CHUNK}
