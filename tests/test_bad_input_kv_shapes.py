"""The KV containers' constructors refuse what does not add up, by name (thirty-eighth session).

``BlockPool`` (the serving engine's pool) took any counts: ``n_layers=0`` ended in a
ZeroDivisionError, ``head_dim=0`` built a pool of 1024 empty blocks, ``n_layers=True`` ran as one
layer, and a budget of 1e30 bytes reached torch as an overflow. ``KVCache`` checked its counts
itself; both now go through ``KVMode.check_layout``, which checks them once for every caller.
"""

from __future__ import annotations

import pytest
from test_recipe_heads import write

from kvlens.kv.cache import KVCache
from kvlens.kv.modes import KVMode
from kvlens.kv.pool import BlockPool

Q8 = KVMode.parse("q8")
SHAPE = {"n_layers": 2, "n_kv_heads": 2, "head_dim": 64}


def pool(**changes):
    args = {**SHAPE, "mode": Q8, "budget_bytes": 1 << 20, **changes}
    return BlockPool(**args)


def cache(**changes):
    args = {**SHAPE, "capacity": 64, "mode": Q8, **changes}
    return KVCache(**args)


@pytest.mark.parametrize("make", [pool, cache])
@pytest.mark.parametrize("name", sorted(SHAPE))
@pytest.mark.parametrize(
    ("value", "error", "said"),
    [
        (0, ValueError, "must be ≥ 1, got 0"),
        (-3, ValueError, "must be ≥ 1, got -3"),
        (True, TypeError, "must be an integer, got bool True"),
        (2.0, TypeError, "must be an integer, got float 2.0"),
        ("2", TypeError, "must be an integer, got str '2'"),
    ],
)
def test_a_count_that_is_not_a_positive_integer_is_named(make, name, value, error, said):
    with pytest.raises(error, match=f"^{name} {said}$"):
        make(**{name: value})


@pytest.mark.parametrize(
    ("value", "error", "said"),
    [
        (0, ValueError, "budget_bytes must be ≥ 1, got 0"),
        (float("nan"), TypeError, "budget_bytes must be an integer, got float nan"),
        (1e30, TypeError, "budget_bytes must be an integer, got float 1e\\+30"),
        ("1GiB", TypeError, "budget_bytes must be an integer, got str '1GiB'"),
        (
            10**30,
            ValueError,
            "a KV budget of 10{30} bytes is \\d+ positions in mode q8; a pool holds at most 2147483647",
        ),
    ],
)
def test_a_pool_budget_that_is_not_a_usable_byte_count_is_named(value, error, said):
    with pytest.raises(error, match=f"^{said}$"):
        pool(budget_bytes=value)


def test_the_largest_pool_in_the_position_limit_is_not_refused_for_it(monkeypatch):
    # 2**31 - 1 positions is the limit; a budget of exactly floor(limit / 32) blocks passes the check
    # (the stores are not allocated: the allocation is replaced, the check is what is tested).
    from kvlens.kv import pool as pool_module

    seen = {}

    def record(mode, n_layers, n_kv, cap, head_dim, device, exact):
        seen["cap"] = cap
        raise RuntimeError("stop before allocating")

    block_bytes = pool().block_bytes
    monkeypatch.setattr(pool_module, "cache_stores", record)
    with pytest.raises(RuntimeError, match="stop before allocating"):
        pool(budget_bytes=((2**31 - 1) // 32) * block_bytes)
    assert seen["cap"] == ((2**31 - 1) // 32) * 32
    with pytest.raises(ValueError, match="a pool holds at most 2147483647"):
        pool(budget_bytes=((2**31 - 1) // 32 + 1) * block_bytes)


@pytest.mark.parametrize("make", [pool, cache])
@pytest.mark.parametrize(
    ("device", "error", "said"),
    [
        ("bogus", ValueError, "unknown device 'bogus'"),
        ("meta", ValueError, "unsupported device 'meta'"),
        (0, TypeError, "device must be a str or torch.device, got int"),
    ],
)
def test_a_device_that_is_not_one_here_is_named(make, device, error, said):
    with pytest.raises(error, match=said):
        make(device=device)


def test_a_cache_the_machine_cannot_allocate_is_named(monkeypatch):
    from kvlens.kv import stores

    def refuse(*_args, **_kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(stores, "layer_stores", refuse)
    with pytest.raises(
        ValueError, match=r"^cannot allocate KV stores of 64 positions \(\d+ bytes\): DefaultCPU"
    ):
        cache()


@pytest.mark.parametrize("make", [pool, cache])
def test_stores_past_free_memory_are_refused_before_allocating(monkeypatch, make):
    # a pool that is zero-filled past free memory is killed by the system, not refused by torch
    from kvlens.kv import stores

    def no_allocation(*_args, **_kwargs):
        raise AssertionError("allocated")

    built = make()  # its bytes, as the stores are sized
    per_token = Q8.bytes_per_token(2, 2, 64)
    need = per_token * (built.k[0].capacity)
    monkeypatch.setattr(stores, "layer_stores", no_allocation)
    monkeypatch.setattr(stores, "available_memory", lambda device: need - 1)
    with pytest.raises(
        ValueError, match=f"^KV stores of \\d+ positions need {need} bytes; {need - 1} bytes are free$"
    ):
        make()
    monkeypatch.setattr(stores, "available_memory", lambda device: need)
    with pytest.raises(AssertionError, match="allocated"):  # exactly enough: it goes on to allocate
        make()


def test_a_cache_of_2_40_layers_is_refused_at_once(monkeypatch):
    # its byte count is a product, not a loop over the layers; then free memory refuses it
    with pytest.raises(ValueError, match=r"^KV stores of 64 positions need \d+ bytes; \d+ bytes are free$"):
        cache(n_layers=2**40)


def test_a_recipe_for_other_layers_is_refused_by_the_pool_as_by_the_cache(tmp_path):
    # a per-layer recipe names 3 layers; the model has 2
    mode = KVMode.parse(write(tmp_path / "r.json", [{"k": "q8", "v": "q8"}] * 2 + [{"k": "f16", "v": "f16"}]))
    for make in (pool, cache):
        with pytest.raises(ValueError, match="has 3 layers; the model has 2"):
            make(mode=mode)


@pytest.mark.parametrize("kv", ["q8", "q8+mirror", "f16", "q4h"])
@pytest.mark.parametrize("keep_recent", [0, 4])
def test_the_free_memory_check_counts_what_the_stores_hold(monkeypatch, kv, keep_recent):
    # the bytes asked of free memory are the bytes the stores then hold (the exact copies included)
    from test_kv_bytes import held_bytes

    from kvlens.kv import stores
    from kvlens.kv.modes import CacheOptions

    options = CacheOptions(keep_recent=keep_recent)
    built = cache(mode=KVMode.parse(kv), options=options)
    held = held_bytes((*built.k, *built.v, *built.k_exact, *built.v_exact))
    monkeypatch.setattr(stores, "available_memory", lambda device: held)
    cache(mode=KVMode.parse(kv), options=options)
    monkeypatch.setattr(stores, "available_memory", lambda device: held - 1)
    with pytest.raises(ValueError, match=f"need {held} bytes; {held - 1} bytes are free"):
        cache(mode=KVMode.parse(kv), options=options)
