"""Prefix-cache paths the stream tests pass by (kv/prefix.py, engine/prefix_cache.py): every token
of a block in its hash, a memory hit that ends inside a chunk, a disk hit while the pool has no
block to restore into, a restored block found again in memory (test_kv_disk_files: the tier's files).

References: the exactness rule (whole chunks only, docs/serve.md), a fresh prefill on a contiguous
cache (its logits are the paged engine's bit for bit: test_prefix_cache), the files on disk.
"""

from __future__ import annotations

import random

import torch

import kvlens
from kvlens.engine.prefix_cache import PrefixCache
from kvlens.engine.scheduler import Engine, EngineConfig, Request
from kvlens.kv.cache import BLOCK
from kvlens.kv.disk import SUFFIX
from kvlens.kv.modes import KVMode
from kvlens.kv.pool import BlockPool, PagedKV, kv_bytes_per_token
from kvlens.kv.prefix import block_hashes

CHUNK = 2 * BLOCK
TINY_MODEL = ("llama", 6)  # conftest's tiny_dir


def test_every_token_of_a_block_is_in_its_hash_and_every_later_one():
    """Changing the token at any position p of three blocks changes the hashes of p's block and of
    every block after it (the chain), and of no block before it."""
    rng = random.Random(1)
    tokens = [rng.randrange(3, 320) for _ in range(3 * BLOCK)]
    base = block_hashes(tokens, 3, b"salt")
    for p in range(3 * BLOCK):
        changed = list(tokens)
        changed[p] += 1
        hashes = block_hashes(changed, 3, b"salt")
        assert [a == b for a, b in zip(base, hashes, strict=True)] == [j < p // BLOCK for j in range(3)], p


def test_a_memory_hit_that_ends_inside_a_chunk_reuses_only_whole_chunks():
    """Three of a prompt's blocks cached (a chunk is two): the hit is the first chunk, 2 blocks and
    their 64 positions; the third block goes back to the cache untouched."""
    pool = BlockPool(1, 1, 8, KVMode.parse("q8"), 6 * BLOCK * 24)
    cache = PrefixCache(pool, "model", prefill_chunk=CHUNK)
    prompt = list(range(3, 3 + 4 * BLOCK + 1))
    blocks = pool.allocate(3)
    for h, b in zip(block_hashes(prompt, 3, cache.salt), blocks, strict=True):
        cache.index.publish(h, b)
    pool.release(blocks)
    kv = PagedKV(pool)
    assert cache.acquire(kv, prompt) == CHUNK
    assert (kv.length, kv.blocks) == (CHUNK, blocks[:2])
    assert pool.refcount[blocks[2]] == 0 and cache.index.is_parked(blocks[2])


def run(engine: Engine, rid: str, prompt: list[int], n: int = 2) -> list:
    """``rid``'s events, the engine stepped until every request is done."""
    engine.add_request(Request(rid, prompt, n, stop_ids=frozenset()))
    events = []
    for _ in range(300):
        events += [e for e in engine.step() if e.request_id == rid]
        if not engine.has_unfinished():
            return events
    raise AssertionError("the requests did not finish in 300 steps")


def test_a_disk_hit_waits_for_a_block_and_is_then_found_in_memory(tmp_path, tiny_dir):
    """A history spilled to disk is asked for while another request holds every block of the pool:
    the engine steps on (nothing to restore into yet), the request waits, then restores its three
    chunks and gives a fresh prefill's logits. A third request with the same history finds those
    blocks in memory: no file is read again. The byte count is the folder's throughout."""
    llm = kvlens.load(tiny_dir, kv="q8", attn_backend="numba", prefill_chunk=CHUNK)
    c = llm.config
    per_token = kv_bytes_per_token(llm.kv, c.n_layers, c.n_kv_heads, c.head_dim)
    config = EngineConfig(
        kv_budget_bytes=8 * BLOCK * per_token, prefix_cache=True, kv_disk=tmp_path, keep_logits=True
    )
    engine = Engine(llm, config)
    disk = engine.prefix.disk
    rng = random.Random(7)
    history = [rng.randrange(3, 320) for _ in range(3 * CHUNK + 9)]
    run(engine, "turn1", history)
    run(engine, "filler", [rng.randrange(3, 320) for _ in range(7 * BLOCK)])  # spills the history
    assert disk.stats.spilled == 6
    engine.add_request(Request("all-blocks", [rng.randrange(3, 320) for _ in range(8 * BLOCK - 5)], 4))
    while engine.pool.blocks_free:  # its prefill takes the whole pool
        engine.step()
    free_at_acquire = []
    acquire = engine.prefix.acquire
    engine.prefix.acquire = lambda kv, ids: (
        free_at_acquire.append(engine.pool.blocks_free) or acquire(kv, ids)
    )
    prompt = history + [rng.randrange(3, 320) for _ in range(20)]
    events = run(engine, "turn2", prompt)
    assert free_at_acquire[0] == 0, "premise: the first look found the pool full"
    assert events[0].cached_tokens == 3 * CHUNK and disk.stats.restored == 6
    assert torch.equal(events[0].logits, llm.prefill(prompt, llm.new_cache(len(prompt))))
    again = history + [rng.randrange(3, 320) for _ in range(5)]
    events = run(engine, "turn3", again)
    assert events[0].cached_tokens == 3 * CHUNK and disk.stats.restored == 6  # from memory
    assert torch.equal(events[0].logits, llm.prefill(again, llm.new_cache(len(again))))
    assert disk.stats.bytes == sum(p.stat().st_size for p in tmp_path.glob(f"*{SUFFIX}"))
