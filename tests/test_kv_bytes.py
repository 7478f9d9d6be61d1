"""Bytes per token reported = bytes the cache holds, in every mode: the tensors of a real cache and
of a paged pool are summed (codes, scales, int8 K's code sums, exact copies) and compared with
``bytes_per_token`` — an independent count, not the formula."""

from __future__ import annotations

import pytest
import torch

from kvlens.kv.cache import BLOCK, KVCache
from kvlens.kv.modes import MODES, CacheOptions, KVMode, StoreKind
from kvlens.kv.pool import BlockPool

S = StoreKind
MIXED = KVMode("mixed", S.Q8, S.Q4H, layers=((S.Q8, S.F16), (S.Q8H, S.Q4H), (S.F32, S.Q8)))
ALL_MODES = [*MODES.values(), KVMode.parse("k=q8h,v=q4h"), KVMode.parse("k=bf16,v=q8"), MIXED]


def held_bytes(stores) -> int:
    total = 0
    for store in stores:
        for t in (store.data, store.scale, store.ksum):
            total += 0 if t is None else t.numel() * t.element_size()
    return total


def fits(mode: KVMode, head_dim: int) -> bool:
    try:
        mode.check_layout(3, head_dim)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("head_dim", [32, 64, 48])
@pytest.mark.parametrize("mode", ALL_MODES, ids=str)
def test_cache_bytes_per_token_is_what_it_holds(mode, head_dim):
    if not fits(mode, head_dim):
        pytest.skip(f"{mode} cannot store head_dim {head_dim}")
    for options in (CacheOptions(), CacheOptions(keep_sink=4)):
        cache = KVCache(3, 2, head_dim, 64, mode, options=options)
        stores = (*cache.k, *cache.v, *cache.k_exact, *cache.v_exact)
        assert held_bytes(stores) == cache.bytes_per_token() * cache.capacity
        # the sink store: S f16 rows of K and V per layer and KV head, whatever the capacity
        assert (
            held_bytes((*cache.k_sink, *cache.v_sink))
            == cache.sink_bytes()
            == options.keep_sink * 2 * (2 * head_dim) * 2 * 3
        )


@pytest.mark.parametrize("mode", ALL_MODES, ids=str)
def test_pool_bytes_per_token_is_what_it_holds(mode):
    if not fits(mode, 64):
        pytest.skip(f"{mode} cannot store head_dim 64")
    pool = BlockPool(3, 2, 64, mode, budget_bytes=1 << 20)
    stores = (*pool.k, *pool.v, *pool.k_exact, *pool.v_exact)
    assert held_bytes(stores) == pool.bytes_per_token * pool.n_blocks * BLOCK


def test_int8_keys_count_their_code_sums():
    """q8 at head_dim 64, 1 layer, 1 head: K 64 codes + fp32 scale + 2 int16 sums, V 64 + 4."""
    assert MODES["q8"].bytes_per_token(1, 1, 64) == (64 + 4 + 4) + (64 + 4)
    assert KVCache(1, 1, 64, 32, MODES["q8"]).k[0].ksum.dtype == torch.int16
