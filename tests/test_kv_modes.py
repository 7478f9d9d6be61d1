"""KV mode names as the CLI's comma lists give them, and how a cache's sink and exact copy follow
from its mode and options (expected values written out, not computed by the code under test)."""

from __future__ import annotations

import dataclasses

import pytest

from kvlens.kv.cache import KVCache
from kvlens.kv.modes import MODES, CacheOptions, KVMode, UnknownKVModeError, split_mode_list


@pytest.mark.parametrize(
    "spec,names",
    [
        ("q8,k=q8h,v=q4h", ["q8", "k=q8h,v=q4h"]),
        ("k=q8h,v=q4h,q8", ["k=q8h,v=q4h", "q8"]),
        ("k=q8h,v=q4h,v=q8", ["k=q8h,v=q4h", "v=q8"]),  # a pair takes one v=, the next stands alone
        (" f16 , q8 ,", ["f16", "q8"]),
        ("k=q8,v=q8", ["k=q8,v=q8"]),
    ],
)
def test_a_comma_list_keeps_each_split_pair_whole(spec, names):
    assert split_mode_list(spec) == names


def test_a_lone_half_of_a_pair_is_refused():
    with pytest.raises(UnknownKVModeError, match="unknown KV cache mode 'v=q8'"):
        KVMode.parse(split_mode_list("k=q8h,v=q4h,v=q8")[1])


def test_a_split_naming_a_registered_mode_is_that_mode():
    assert KVMode.parse("k=q8,v=q8") is MODES["q8"]  # not q8+mirror, which stores the same kinds
    assert KVMode.parse("k=f32,v=q8") is MODES["q8-v"] and KVMode.parse("k=q8,v=f32") is MODES["q8-k"]


@pytest.mark.parametrize("in_mode,in_options,kept", [(3, 5, 5), (5, 3, 5), (0, 4, 4), (4, 0, 4), (0, 0, 0)])
def test_a_cache_keeps_the_larger_of_the_two_sinks(in_mode, in_options, kept):
    mode = dataclasses.replace(MODES["q8"], keep_sink=in_mode)
    cache = KVCache(3, 2, 64, 64, mode, options=CacheOptions(keep_sink=in_options))
    assert cache.sink == kept
    assert cache.sink_bytes() == kept * 2 * (64 * 2) * 2 * 3  # K and V f16 rows, 2 KV heads, 3 layers


def test_only_keep_recent_or_the_mirror_keeps_an_exact_copy_of_every_row():
    """q8 at head_dim 64: K 64 codes + 4-byte scale + 2 int16 code sums, V 64 + 4, per layer and KV
    head; an exact copy adds K and V in f32 (2 x 256 bytes)."""
    q8 = ((64 + 4 + 4) + (64 + 4)) * 2 * 3
    exact = 2 * 256 * 2 * 3
    cases = [(MODES["q8"], CacheOptions(keep_sink=4), q8, False), (MODES["q8"], CacheOptions(), q8, False),
             (MODES["q8"], CacheOptions(keep_recent=4), q8 + exact, True),
             (MODES["q8+mirror"], CacheOptions(), q8 + exact, True)]  # fmt: skip
    for mode, options, per_token, exact_copy in cases:
        cache = KVCache(3, 2, 64, 64, mode, options=options)
        assert (cache.bytes_per_token(), cache.has_mirror, bool(cache.k_exact)) == (
            per_token,
            exact_copy,
            exact_copy,
        )
