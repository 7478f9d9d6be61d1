"""The engine's and the KV layer's smaller public pieces refuse by name what they ran silently or
failed on with an IndexError / KeyError / AttributeError (thirty-eighth session's hostile sweep)."""

from __future__ import annotations

import pytest
import torch

from kvlens.engine.scheduler import Engine, EngineConfig, Request, run_alone
from kvlens.kv.cache import KVCache
from kvlens.kv.disk import DiskTier
from kvlens.kv.modes import CacheOptions, KVMode
from kvlens.kv.pool import BlockPool, PagedKV
from kvlens.kv.prefix import BLOCK, PrefixIndex, block_hashes, cache_salt
from kvlens.kv.quant import dequantize_q8, q8_step, quantize_q8

TINY_MODEL = ("llama", 3)
Q8 = KVMode.parse("q8")


@pytest.mark.parametrize(
    ("stop_ids", "error", "said"),
    [
        ("abc", TypeError, "stop_ids must be a set of token ids or None, got str"),
        (5, TypeError, "stop_ids must be a set of token ids or None, got int"),
        ([-1], ValueError, r"stop_ids\[0\] = -1 is outside the vocabulary"),
        ([2**70], ValueError, "is outside the vocabulary"),
        ([1.5], TypeError, r"stop_ids\[0\] must be an int, got float"),
    ],
)
def test_stop_ids_are_token_ids(tiny, stop_ids, error, said):
    # a string was a set of characters: the request never stopped on it
    with pytest.raises(error, match=said):
        run_alone(tiny, Request("a", [5, 6], 2, stop_ids=stop_ids))


def test_stop_ids_from_a_list_stop_the_request(tiny):
    first = next(iter(run_alone(tiny, Request("a", [5, 6], 4, stop_ids=frozenset())))).token_id
    events = list(run_alone(tiny, Request("b", [5, 6], 4, stop_ids=[first])))
    assert [e.token_id for e in events] == [first] and events[-1].finish_reason == "stop"


def test_an_engine_is_built_over_an_llm():
    with pytest.raises(TypeError, match="Engine takes an LLM .kvlens.load., got NoneType"):
        Engine(None)


def test_kv_disk_is_a_path():
    with pytest.raises(TypeError, match="kv_disk must be a directory path or None, got int"):
        EngineConfig(kv_disk=5, prefix_cache=True)


@pytest.fixture
def cache():
    return KVCache(2, 1, 64, 8, Q8)


@pytest.mark.parametrize(
    ("layer", "end", "error", "said"),
    [
        (5, 3, ValueError, "layer must be ≤ 1, got 5"),
        (-1, 3, ValueError, "layer must be ≥ 0, got -1"),  # read the last layer, silently
        (0, -1, ValueError, "end must be ≥ 0, got -1"),
        (0, 1000, ValueError, "end must be ≤ 32, got 1000"),  # came back with 32 rows, silently
        (0, 2.0, TypeError, "end must be an integer"),
    ],
)
def test_a_read_outside_the_cache_is_named(cache, layer, end, error, said):
    with pytest.raises(error, match=said):
        cache.read(layer, end)
    paged = PagedKV(BlockPool(2, 1, 64, Q8, 1 << 20))
    paged.grow(32)
    with pytest.raises(error, match=said):
        paged.read(layer, end)


def test_truncate_and_reserve_check_their_counts(cache):
    with pytest.raises(ValueError, match="length must be ≥ 0, got -5"):
        cache.truncate(-5)  # the length became -5
    with pytest.raises(TypeError, match="length must be an integer, got float"):
        cache.truncate(1.5)
    with pytest.raises(ValueError, match="capacity must be ≤ 2147483647"):
        cache.reserve(2**40)


def test_a_cache_that_cannot_grow_names_it(cache, monkeypatch):
    from kvlens.kv.stores import RowStore

    def refuse(self, cap):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(RowStore, "grow", refuse)
    with pytest.raises(ValueError, match="cannot grow the KV cache to 100 positions: DefaultCPU"):
        cache.reserve(100)


def test_pool_block_operations_check_their_arguments():
    pool = BlockPool(2, 1, 64, Q8, 1 << 20)
    with pytest.raises(ValueError, match="n must be ≥ 0, got -1"):
        pool.allocate(-1)  # returned [] silently
    for op in (pool.share, pool.release):
        with pytest.raises(ValueError, match=f"block must be ≤ {pool.n_blocks - 1}, got 1000000"):
            op([10**6])  # IndexError
    index = PrefixIndex()
    with pytest.raises(ValueError, match="no parked block to evict"):
        index.evict()  # KeyError
    with pytest.raises(ValueError, match="block 3 is not parked"):
        index.unpark(3)


def test_block_hashes_take_token_ids():
    salt = cache_salt("d", Q8, "exact", 32)
    with pytest.raises(TypeError, match=r"token ids\[0\] must be an int, got float"):
        block_hashes([1.7] * BLOCK, 1, salt)  # hashed as [1] * 32
    with pytest.raises(ValueError, match="outside the vocabulary"):
        block_hashes([2**40] * BLOCK, 1, salt)  # OverflowError
    with pytest.raises(ValueError, match="n_blocks must be ≥ 0, got -1"):
        block_hashes([1] * BLOCK, -1, salt)
    with pytest.raises(TypeError, match="mode must be a KVMode, got str"):
        cache_salt("d", "q8", "exact", 32)


@pytest.mark.parametrize(
    ("root", "budget", "error", "said"),
    [
        ("dir", float("inf"), TypeError, "KV disk budget .bytes. must be an integer, got float inf"),
        ("dir", 1.5, TypeError, "must be an integer, got float 1.5"),
        ("dir", True, TypeError, "must be an integer, got bool"),
        ("dir", 0, ValueError, "the KV disk budget must be more than 0 bytes"),
        ("", 1 << 20, ValueError, "the KV disk tier needs a directory path, got ''"),
        (None, 1 << 20, ValueError, "needs a directory path, got None"),
    ],
)
def test_a_disk_tier_checks_its_settings(tmp_path, root, budget, error, said):
    pool = BlockPool(2, 1, 64, Q8, 1 << 20)
    with pytest.raises(error, match=said):
        DiskTier(tmp_path / root if root else root, budget, pool, "m")
    with pytest.raises(TypeError, match="pool must be a BlockPool, got NoneType"):
        DiskTier(tmp_path, 1 << 20, None, "m")


def test_the_q8_helpers_name_what_they_cannot_use():
    with pytest.raises(ValueError, match="a last dimension > 0"):
        quantize_q8(torch.zeros(3, 0))  # IndexError from amax
    q = torch.zeros(2, 4, dtype=torch.int8)
    with pytest.raises(ValueError, match="max_abs holds NaN"):
        dequantize_q8(q, torch.full((2,), float("nan")))
    with pytest.raises(ValueError, match="max_abs must be ≥ 0, got -1.0"):
        dequantize_q8(q, torch.tensor([1.0, -1.0]))  # the codes' signs flipped, silently
    with pytest.raises(TypeError, match="max_abs must be a torch.Tensor, got list"):
        q8_step([1.0])


def test_kv_values_are_built_of_their_own_types():
    with pytest.raises(TypeError, match="KV mode x: k and v are StoreKinds"):
        KVMode("x", "q8", "q8")  # accepted; the first use was an AttributeError
    with pytest.raises(TypeError, match="mirror must be True or False, got str"):
        KVMode("x", Q8.k, Q8.v, mirror="no")
    with pytest.raises(TypeError, match="track_blocks must be True or False, got str 'no'"):
        CacheOptions(track_blocks="no")
    with pytest.raises(TypeError, match="PagedKV takes a BlockPool, got str"):
        PagedKV("x")


def test_sink_rows_and_grow_check_their_arguments():
    cache = KVCache(1, 1, 64, 8, Q8, options=CacheOptions(keep_sink=4))
    with pytest.raises(ValueError, match="layer must be ≤ 0, got 99"):
        cache.sink_rows(99, 3)  # IndexError
    paged = PagedKV(BlockPool(2, 1, 64, Q8, 1 << 20))
    with pytest.raises(ValueError, match="end must be ≥ 0, got -1"):
        paged.grow(-1)  # did nothing, silently
