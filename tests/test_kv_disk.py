"""The disk tier: blocks round-trip bit for bit in their stored form, a corrupt or truncated file is
refused (counted, deleted) and the block recomputed with the same logits as a fresh prefill, and the
byte budget deletes the oldest files first."""

from __future__ import annotations

import random

import pytest
import torch
from engine_loop import steps_until_done
from tiny_models import write_hf

import kvlens
from kvlens.engine.scheduler import Engine, EngineConfig, Request
from kvlens.kv.cache import BLOCK
from kvlens.kv.disk import DiskTier
from kvlens.kv.modes import KVMode
from kvlens.kv.pool import BlockPool, kv_bytes_per_token
from kvlens.kv.prefix import block_hashes

CHUNK = 2 * BLOCK


def random_pool(mode: str, seed: int, head_dim: int = 16) -> BlockPool:
    """A 2-layer pool whose every stored tensor (codes, scales, int8 K's code sums, mirror and sink
    rows) holds random values."""
    m = KVMode.parse(mode)
    pool = BlockPool(2, 2, head_dim, m, 4 * BLOCK * kv_bytes_per_token(m, 2, 2, head_dim))
    g = torch.Generator().manual_seed(seed)
    for t in stored_tensors(pool):
        if t.dtype in (torch.int8, torch.int16, torch.uint8):
            t.copy_(torch.randint(-127 if t.is_signed() else 0, 128, t.shape, generator=g, dtype=t.dtype))
        else:
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    return pool


def stored_tensors(pool: BlockPool) -> list[torch.Tensor]:
    """Every tensor the pool stores, found from its stores' fields (not through ``block_rows``, the
    list the disk tier writes, which is what is under test)."""
    out = []
    for store in (*pool.k, *pool.v, *pool.k_exact, *pool.v_exact):
        out += [t for t in (store.data, store.scale, store.ksum) if t is not None]
    return out + [store.data for store in (*pool.k_sink, *pool.v_sink)]


def block_tensors(pool: BlockPool, block: int) -> list[torch.Tensor]:
    """``block``'s rows of each of :func:`stored_tensors` (BLOCK rows a block; S of a sink store)."""
    out = []
    for t in stored_tensors(pool):
        rows = BLOCK if t.shape[1] == pool.n_blocks * BLOCK else pool.sink
        out.append(t[:, block * rows : (block + 1) * rows])
    return out


@pytest.mark.parametrize("mode", ["q8", "f16", "bf16", "q8+mirror", "q6h"])
def test_round_trip_is_bit_exact_in_the_stored_form(tmp_path, mode):
    pool = random_pool(mode, 0, head_dim=64)  # int8 K keeps code sums from head_dim 32 on
    disk = DiskTier(tmp_path, 1 << 20, pool, "model-a")
    before = [t.clone() for t in block_tensors(pool, 1)]
    assert any(t.dtype == torch.int16 for t in before) == (mode in ("q8", "q8+mirror"))  # the code sums
    disk.spill(1, b"h" * 32)
    assert disk.stats.spilled == 1 and disk.stats.bytes == disk.path(b"h" * 32).stat().st_size
    assert disk.restore(3, b"h" * 32)  # into another block
    assert all(torch.equal(a, b) for a, b in zip(before, block_tensors(pool, 3), strict=True))
    after = pool.block_rows(3)
    if mode == "q8":  # no conversion: int8 codes + fp32 scales, exactly their bytes on disk
        assert [t.dtype for t in after[:2]] == [torch.int8, torch.float32]
        payload = sum(t.numel() * t.element_size() for t in after)
        assert payload == BLOCK * pool.bytes_per_token
    assert disk.stats.restored == 1 and disk.stats.restore_seconds.counts != [0] * 13


def test_file_of_another_model_or_mode_is_refused(tmp_path):
    pool = random_pool("q8", 1)
    DiskTier(tmp_path, 1 << 20, pool, "model-a").spill(0, b"x" * 32)
    other = DiskTier(tmp_path, 1 << 20, pool, "model-b")  # finds the file, header says model-a
    assert b"x" * 32 in other
    assert not other.restore(1, b"x" * 32)
    assert other.stats.corrupt == 1 and not other.path(b"x" * 32).exists()


def test_file_under_another_blocks_name_is_refused(tmp_path):
    """A file's name is its block's hash; one renamed (or copied) to another hash's name holds other
    tokens' rows, and is refused by the hash in its header."""
    pool = random_pool("q8", 1)
    disk = DiskTier(tmp_path, 1 << 20, pool, "model-a")
    disk.spill(0, b"x" * 32)
    disk.path(b"x" * 32).rename(disk.path(b"y" * 32))
    again = DiskTier(tmp_path, 1 << 20, pool, "model-a")  # a restart finds it under the new name
    target = [t.clone() for t in block_tensors(pool, 1)]
    assert b"y" * 32 in again and not again.restore(1, b"y" * 32)
    assert all(torch.equal(a, b) for a, b in zip(target, block_tensors(pool, 1), strict=True))
    assert again.stats.corrupt == 1 and not again.path(b"y" * 32).exists()


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
def test_damaged_file_is_refused_and_deleted(tmp_path, damage):
    pool = random_pool("q8", 2)
    disk = DiskTier(tmp_path, 1 << 20, pool, "m")
    disk.spill(0, b"d" * 32)
    path = disk.path(b"d" * 32)
    blob = bytearray(path.read_bytes())
    if damage == "flip":
        blob[len(blob) // 2] ^= 0x10  # one bit of the payload
    path.write_bytes(
        bytes(blob[: len(blob) // 2] if damage == "truncate" else b"" if damage == "empty" else blob)
    )
    target = [t.clone() for t in pool.block_rows(2)]
    assert not disk.restore(2, b"d" * 32)
    assert all(torch.equal(a, b) for a, b in zip(target, pool.block_rows(2), strict=True)), "fed to the pool"
    assert (disk.stats.corrupt, disk.stats.bytes, path.exists()) == (1, 0, False)


def test_budget_deletes_the_oldest_files_first(tmp_path):
    pool = random_pool("q8", 3)
    one = len(_spilled_size(tmp_path / "probe", pool))
    disk = DiskTier(tmp_path / "d", 3 * one, pool, "m")
    names = [bytes([i]) * 32 for i in range(5)]
    for i, h in enumerate(names[:3]):
        disk.spill(i % 4, h)
    assert disk.restore(0, names[0])  # used again: now the newest
    disk.spill(3, names[3])
    disk.spill(0, names[4])
    kept = {h for h in names if disk.path(h).exists()}
    assert kept == {names[0], names[3], names[4]}  # names[1], then names[2] went, oldest first
    assert disk.stats.bytes == 3 * one <= disk.budget
    # a restart finds the files and their order (mtime)
    again = DiskTier(tmp_path / "d", 3 * one, pool, "m")
    assert again.stats.bytes == 3 * one and all(h in again for h in kept)


def _spilled_size(root, pool) -> bytes:
    d = DiskTier(root, 1 << 20, pool, "m")
    d.spill(0, b"p" * 32)
    return d.path(b"p" * 32).read_bytes()


# -- through the engine: spill on eviction, restore on a hit, recompute a damaged block -------------
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("disk") / "hf"
    write_hf("llama", out, seed=6)
    return out


def _engine(llm, disk_dir, blocks: int) -> Engine:
    c = llm.config
    per_token = kv_bytes_per_token(llm.kv, c.n_layers, c.n_kv_heads, c.head_dim)
    config = EngineConfig(
        kv_budget_bytes=blocks * BLOCK * per_token, prefix_cache=True, kv_disk=disk_dir, keep_logits=True
    )
    return Engine(llm, config)


def _run(engine: Engine, rid: str, prompt: list[int]) -> list:
    engine.add_request(Request(rid, prompt, 2, stop_ids=frozenset()))
    events = []
    for _ in steps_until_done(engine):
        events += engine.step()
    return events


@pytest.mark.parametrize("mode", ["q8", "f16"])
@pytest.mark.parametrize("damage", [None, "flip", "truncate"])
def test_restored_prefix_gives_the_logits_of_a_fresh_prefill(tmp_path, tiny_dir, mode, damage):
    llm = kvlens.load(tiny_dir, kv=mode, attn_backend="numba", prefill_chunk=CHUNK)
    rng = random.Random(7)
    history = [rng.randrange(3, 320) for _ in range(3 * CHUNK + 9)]
    engine = _engine(llm, tmp_path, blocks=8)  # 8 blocks: the filler evicts the whole history
    _run(engine, "turn1", history)
    _run(engine, "filler", [rng.randrange(3, 320) for _ in range(7 * BLOCK)])
    disk, hashes = engine.prefix.disk, block_hashes(history, 6, engine.prefix.salt)
    assert disk.stats.spilled == 6 and not set(hashes) & set(engine.prefix.index.block_of)  # all on disk
    if damage is not None:  # damage the file of the history's block 3 (chunk 1): chunk 0 still reused
        victim = disk.path(hashes[3])
        blob = victim.read_bytes()
        victim.write_bytes(blob[:-40] if damage == "truncate" else blob[:100] + b"\xff" + blob[101:])
    prompt = history + [rng.randrange(3, 320) for _ in range(20)]
    events = _run(engine, "turn2", prompt)
    assert events[0].cached_tokens == (CHUNK if damage else 3 * CHUNK)
    assert disk.stats.corrupt == (1 if damage else 0)
    assert disk.stats.restored >= (2 if damage else 6)
    fresh = llm.prefill(prompt, llm.new_cache(len(prompt)))
    assert torch.equal(events[0].logits, fresh)
    assert engine.stats().disk.restored == disk.stats.restored
    assert engine.stats().blocks_used == 0 and (engine.pool.refcount == 0).all()  # a refused file's block too


def test_blocks_spilled_under_another_prefill_chunk_are_not_reused(tmp_path, tiny_dir):
    """A server restarted with another prefill chunk over the same folder: the files it finds were
    computed in other chunks, so reusing them would not give a fresh prefill's logits. The chunk is
    part of every block's hash: the new server neither finds nor restores them."""
    rng = random.Random(9)
    history = [rng.randrange(3, 320) for _ in range(3 * CHUNK + 9)]
    before = _engine(kvlens.load(tiny_dir, kv="q8", attn_backend="numba", prefill_chunk=CHUNK), tmp_path, 8)
    _run(before, "turn1", history)
    _run(before, "filler", [rng.randrange(3, 320) for _ in range(7 * BLOCK)])
    assert before.prefix.disk.stats.spilled == 6
    llm = kvlens.load(tiny_dir, kv="q8", attn_backend="numba", prefill_chunk=BLOCK)
    after = _engine(llm, tmp_path, 8)
    assert after.prefix.disk.stats.bytes == before.prefix.disk.stats.bytes  # it sees the files
    prompt = history + [5, 6, 7]
    events = _run(after, "turn2", prompt)
    assert events[0].cached_tokens == 0 and after.prefix.disk.stats.restored == 0
    assert torch.equal(events[0].logits, llm.prefill(prompt, llm.new_cache(len(prompt))))


# -- a tier it cannot write to: refused at start, or (once running) counted, never raised ----------
def test_folder_that_cannot_be_made_is_refused_at_start(tmp_path):
    (tmp_path / "a_file").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"cannot use .*a_file/tier as the KV disk tier"):
        DiskTier(tmp_path / "a_file" / "tier", 1 << 20, random_pool("q8", 4), "m")


def test_removed_folder_is_made_again_at_the_next_spill(tmp_path):
    pool = random_pool("q8", 5)
    disk = DiskTier(tmp_path / "tier", 1 << 20, pool, "m")
    (tmp_path / "tier").rmdir()
    disk.spill(1, b"r" * 32)
    assert disk.path(b"r" * 32).exists() and (disk.stats.spilled, disk.stats.failed) == (1, 0)


def test_block_it_cannot_write_is_counted_not_raised(tmp_path, caplog):
    pool = random_pool("q8", 6)
    disk = DiskTier(tmp_path / "tier", 1 << 20, pool, "m")
    disk.spill(0, b"a" * 32)
    (tmp_path / "tier" / (b"a" * 32).hex()).with_suffix(".kvb").unlink()
    (tmp_path / "tier").rmdir()
    (tmp_path / "tier").write_bytes(b"not a folder")  # every write now fails (ENOTDIR / EEXIST)
    with caplog.at_level("WARNING", logger="kvlens.kv.disk"):
        disk.spill(1, b"b" * 32)
        disk.spill(2, b"c" * 32)
    assert (disk.stats.spilled, disk.stats.failed) == (1, 2)
    assert b"b" * 32 not in disk and b"c" * 32 not in disk and not disk.restore(3, b"b" * 32)
    assert len([r for r in caplog.records if "cannot write block files" in r.message]) == 1  # once


def test_engine_keeps_serving_when_the_tier_cannot_be_written(tmp_path, tiny_dir):
    """The folder replaced by a file while the engine runs: every eviction's spill fails, yet every
    request completes with the tokens of a run without a disk tier, and no pool block is lost."""
    llm = kvlens.load(tiny_dir, kv="q8", attn_backend="numba", prefill_chunk=CHUNK)
    rng = random.Random(8)
    prompts = [[rng.randrange(3, 320) for _ in range(3 * CHUNK + 9)] for _ in range(3)]
    engine = _engine(llm, tmp_path / "tier", blocks=8)
    (tmp_path / "tier").rmdir()
    (tmp_path / "tier").write_bytes(b"not a folder")
    got = [[e.token_id for e in _run(engine, f"r{i}", p)] for i, p in enumerate(prompts)]
    plain = Engine(llm, EngineConfig(kv_budget_bytes=engine.config.kv_budget_bytes, prefix_cache=True))
    want = [[e.token_id for e in _run(plain, f"r{i}", p)] for i, p in enumerate(prompts)]
    assert got == want
    disk = engine.stats().disk
    assert disk.failed > 0 and disk.spilled == 0 and disk.bytes == 0
    pool = engine.pool
    parked = len(engine.prefix.index.block_of)
    assert pool.blocks_free == pool.n_blocks and parked <= pool.n_blocks  # every block back: free or parked
