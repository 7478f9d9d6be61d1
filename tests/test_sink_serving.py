"""The sink store in the serving engine: the paged pool keeps a recipe's first S positions (S <= one
block) in f16 rows attached to the physical block that holds a sequence's logical block 0, so they
are read in place of the codes, shared with the block by the prefix cache and spilled with it to the
disk tier. References: the contiguous KVCache with the same sink (its own tests: test_sink_store.py).
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from test_prefix_cache import run  # one request through an engine, its events

import kvlens
from kvlens.engine.scheduler import Engine, EngineConfig, Request, run_alone
from kvlens.kv.cache import BLOCK
from kvlens.kv.disk import DiskTier
from kvlens.kv.modes import MODES, CacheOptions
from kvlens.kv.pool import BlockPool, PagedKV

TINY_MODEL = ("llama", 5)  # conftest's tiny_dir: head_dim 16
CHUNK = 2 * BLOCK
SINK = dataclasses.replace(MODES["q8"], keep_sink=3)


def contiguous_steps(llm, prompt: list[int], tokens: list[int]) -> list[torch.Tensor]:
    """Logits of the prompt, then of each given token fed back, on a contiguous cache (the sink in a
    KVCache), one decode step each."""
    cache = llm.new_cache(len(prompt) + len(tokens))
    out = [llm.prefill(prompt, cache)]
    for i, tok in enumerate(tokens[:-1]):
        out.append(llm.model.logits(llm.forward([tok], cache, len(prompt) + i, prefill=False)))
    return out


def test_engine_serves_a_sink_recipe_like_the_contiguous_cache_with_prefix_reuse(tiny_dir):
    llm = kvlens.load(tiny_dir, kv=SINK, attn_backend="numba", prefill_chunk=CHUNK)
    assert llm.servable
    rng = random.Random(1)
    engine = Engine(llm, EngineConfig(kv_budget_bytes=1 << 22, prefix_cache=True, keep_logits=True))
    turn1 = [rng.randrange(3, 320) for _ in range(2 * CHUNK + 40)]
    first = run(engine, "t1", turn1)
    turn2 = turn1 + [e.token_id for e in first] + [rng.randrange(3, 320) for _ in range(40)]
    second = run(engine, "t2", turn2)
    assert second[0].cached_tokens == 2 * CHUNK  # block 0, with its sink rows, came from the cache
    want = contiguous_steps(llm, turn2, [e.token_id for e in second])
    for got, ref in zip(second, want, strict=True):
        assert torch.equal(got.logits, ref.reshape(got.logits.shape))  # the same kernels and splits
    plain = kvlens.load(tiny_dir, kv="q8", attn_backend="numba", prefill_chunk=CHUNK)
    assert not torch.equal(contiguous_steps(plain, turn2, [])[0], want[0])  # the sink changes the result


def test_pool_sink_rows_travel_with_the_block_to_disk_and_back(tmp_path):
    pool = BlockPool(2, 2, 16, SINK, 4 * (BLOCK * SINK.bytes_per_token(2, 2, 16) + SINK.sink_bytes(2, 2, 16)))
    assert pool.n_blocks == 4 and pool.k_sink[0].capacity == 4 * 3
    held = sum(t.numel() * t.element_size() for b in range(4) for t in pool.block_rows(b))
    assert held == pool.bytes_total == 4 * pool.block_bytes
    seq = PagedKV(pool)
    seq.grow(40)
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(2, 40, 16, generator=g) for _ in "kv")
    for layer in range(2):
        seq.write(layer, 0, k, v)
    rk, _ = seq.read(1, 40)
    assert torch.equal(rk[:, :3], k[:, :3].half().float()) and not torch.equal(rk[:, 3], k[:, 3])
    disk = DiskTier(tmp_path, 1 << 20, pool, "model-a")
    block0 = seq.blocks[0]
    before = [t.clone() for t in pool.block_rows(block0)]
    disk.spill(block0, b"h" * 32)
    other = next(b for b in range(4) if b not in seq.blocks)
    assert disk.restore(other, b"h" * 32)
    assert all(torch.equal(a, b) for a, b in zip(before, pool.block_rows(other), strict=True))
    for store in (*pool.k, *pool.v, *pool.k_sink, *pool.v_sink):  # the spilled block reused by another
        rows = (
            slice(block0 * 3, block0 * 3 + 3)
            if store.kind == "f16"
            else slice(block0 * BLOCK, (block0 + 1) * BLOCK)
        )
        store.data[:, rows] = 100
    seq.blocks[0] = other  # the sequence now reads its block 0, sink rows included, from the copy
    assert torch.equal(seq.read(1, 40)[0], rk)


def test_what_the_pool_cannot_keep_is_refused(tiny_dir):
    wide = kvlens.load(tiny_dir, kv=dataclasses.replace(MODES["q8"], keep_sink=BLOCK + 1))
    lab = kvlens.load(tiny_dir, kv="q8", cache_options=CacheOptions(keep_sink=2))
    for llm in (wide, lab):
        assert not llm.servable
        with pytest.raises(ValueError, match="keep-sink"):
            Engine(llm)
        assert list(llm.generate_ids([5, 6, 7], 2))  # the contiguous loop still runs them
    with pytest.raises(ValueError, match="at most 32"):
        BlockPool(1, 1, 16, dataclasses.replace(MODES["q8"], keep_sink=BLOCK + 1), 1 << 20)
    assert list(run_alone(kvlens.load(tiny_dir, kv=SINK), Request("r", [5, 6, 7], 2, stop_ids=frozenset())))
