"""The contiguous KV cache's bookkeeping, by hand: the exact copy grows with the cache, the mirror
is read only by prefill (and only with ``mirror_prefill="exact"``), the length moves when the last
layer is written, truncation never extends, and the mirror's bytes are counted once."""

from __future__ import annotations

import pytest
import torch
from test_lab_unit import _q8 as q8_codes_and_step

from kvlens.kv.cache import KVCache
from kvlens.kv.modes import CacheOptions, KVMode

N_LAYERS, N_KV, HD = 2, 2, 32


def rows(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(N_KV, n, HD, generator=torch.Generator().manual_seed(seed)) * 3


def q8_by_hand(x: torch.Tensor) -> torch.Tensor:
    """The seed's rule as ``test_lab_unit`` writes it out: code times step."""
    codes, step = q8_codes_and_step(x)
    return codes * step


def cache(mode: str, capacity: int = 32, **options) -> KVCache:
    return KVCache(N_LAYERS, N_KV, HD, capacity, KVMode.parse(mode), options=CacheOptions(**options))


def write_all_layers(c: KVCache, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
    for layer in range(N_LAYERS):
        c.write(layer, start, k, v)


@pytest.mark.parametrize(("mode", "options"), [("q8+mirror", {}), ("q8", {"keep_recent": 8})])
def test_the_exact_copy_grows_with_the_cache(mode, options):
    """Capacity 32, then 40 and 70 positions: the exact copy (mirror, or keep_recent's) keeps up."""
    c = cache(mode, **options)
    k, v = rows(70), rows(70, 1)
    write_all_layers(c, 0, k[:, :40], v[:, :40])
    write_all_layers(c, 40, k[:, 40:], v[:, 40:])
    assert c.capacity >= 70 and c.k_exact[1].capacity == c.capacity
    assert torch.equal(c.k_exact[1].read(0, 70), k) and torch.equal(c.v_exact[0].read(0, 70), v)
    rk, rv = c.read(1, 70, prefill=mode == "q8+mirror")
    if mode == "q8+mirror":
        assert torch.equal(rk, k) and torch.equal(rv, v)
    else:  # the last 8 exact, the rest q8
        assert torch.equal(rk[:, 62:], k[:, 62:]) and torch.allclose(
            rk[:, :62], q8_by_hand(k[:, :62]), rtol=0, atol=1e-6
        )


@pytest.mark.parametrize(("mirror_prefill", "prefill", "exact"), [
    ("exact", True, True), ("exact", False, False), ("q8", True, False), ("q8", False, False),
])  # fmt: skip
def test_the_mirror_is_read_only_by_an_exact_prefill(mirror_prefill, prefill, exact):
    c = cache("q8+mirror", mirror_prefill=mirror_prefill)
    k, v = rows(20), rows(20, 1)
    write_all_layers(c, 0, k, v)
    rk, rv = c.read(0, 20, prefill=prefill)
    if exact:
        assert torch.equal(rk, k) and torch.equal(rv, v)
    else:
        torch.testing.assert_close(rk, q8_by_hand(k), rtol=0, atol=1e-6)
        torch.testing.assert_close(rv, q8_by_hand(v), rtol=0, atol=1e-6)
        assert not torch.equal(rk, k)


def test_the_length_moves_when_the_last_layer_is_written_and_truncation_never_extends():
    c = cache("q8")
    k, v = rows(12), rows(12, 1)
    c.write(0, 0, k, v)
    assert c.length == 0  # layer 1 of 2 not written yet: position 11 is not whole
    c.write(1, 0, k, v)
    assert c.length == 12
    c.truncate(20)
    assert c.length == 12
    c.truncate(5)
    assert c.length == 5
    c.write(0, 5, k[:, :3], v[:, :3])
    c.write(1, 5, k[:, :3], v[:, :3])
    assert c.length == 8


def test_a_mirror_s_bytes_are_counted_once():
    """q8+mirror holds q8's rows and scales plus one f32 copy of K and V: 2 x 4 x head_dim bytes per
    KV head and layer more than q8; keep_recent's exact copy costs the same."""
    extra = 2 * 4 * HD * N_KV * N_LAYERS
    q8 = cache("q8").bytes_per_token()
    assert cache("q8+mirror").bytes_per_token() == q8 + extra
    assert cache("q8", keep_recent=4).bytes_per_token() == q8 + extra


def test_options_and_mode_must_be_their_types():
    with pytest.raises(TypeError, match="KVCache takes CacheOptions, got dict"):
        KVCache(1, 1, 32, 32, KVMode.parse("q8"), options={"keep_sink": 4})
    with pytest.raises(TypeError, match="KVCache takes a KVMode"):
        KVCache(1, 1, 32, 32, "q8")
