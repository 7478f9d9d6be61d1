"""A cache that does not fit the model, rows that do not fit the cache, and f16 values past f16's
range: refused by name, never written (thirty-eighth session's hostile sweep of the Python API).

Before: ``LLM.forward`` over another model's ``PagedKV`` wrote past its stores (the process later
aborted); ``PagedKV.write`` with rows of the wrong head count corrupted the heap (glibc abort);
an f16 cache stored K*1e5 as infinity although the cache refuses non-finite values.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from test_decode_step import assert_layer_1_unstored, refusals_of_both_paths, tiny_dirs  # noqa: F401 - tiny_dirs: a fixture

import kvlens
from kvlens.kernels.stage import CODE_F16
from kvlens.kernels.step_kv import out_of_fp16
from kvlens.kv.cache import KVCache
from kvlens.kv.kinds import StoreKind
from kvlens.kv.modes import KVMode
from kvlens.kv.pool import BlockPool, PagedKV

Q8 = KVMode.parse("q8")


@pytest.fixture(scope="module")
def llm(tiny_dirs):  # noqa: F811
    return kvlens.load(tiny_dirs["llama"], kv="q8", attn_backend="numba")


def shape_of(llm):
    c = llm.config
    return c.n_layers, c.n_kv_heads, c.head_dim


@pytest.mark.parametrize("which", [0, 1, 2])
@pytest.mark.parametrize("paged", [False, True])
def test_a_cache_for_another_shape_is_refused_before_anything_runs(llm, which, paged):
    shape = list(shape_of(llm))
    shape[which] *= 2  # more layers, more KV heads or wider heads than the model has
    cache = PagedKV(BlockPool(*shape, Q8, 1 << 20)) if paged else KVCache(*shape, 64, Q8)
    if paged:
        cache.grow(4)
    with pytest.raises(ValueError, match=r"^the cache is for .*; this model has \d+ x \d+ x \d+$"):
        llm.forward([5, 6, 7], cache, 0)
    assert cache.length == 0


def test_generate_ids_names_a_foreign_cache(llm):
    n_layers, n_kv, hd = shape_of(llm)
    with pytest.raises(ValueError, match="the cache is for"):
        list(llm.generate_ids([5, 6], 2, cache=KVCache(n_layers + 1, n_kv, hd, 16, Q8)))


@pytest.mark.parametrize("kv", ["q8", "q4", "f16", "f32"])
@pytest.mark.parametrize(
    "rows", [(2, 3, 64), (1, 3, 32), (1, 3, 128), (1, 3), (1, 2, 3, 64)], ids=lambda s: "x".join(map(str, s))
)
def test_paged_rows_of_another_shape_are_refused_before_the_jit_write(kv, rows):
    pool = BlockPool(2, 1, 64, KVMode.parse(kv), 1 << 20)
    paged = PagedKV(pool)
    paged.grow(3)
    before = [s.data.clone() for s in pool.k + pool.v]
    k = torch.randn(*rows)
    with pytest.raises(ValueError, match=r"k must be \[n_kv_heads=1, n, head_dim=64\], got"):
        paged.write(0, 0, k, k)
    assert all(torch.equal(a, s.data) for a, s in zip(before, pool.k + pool.v, strict=True))


def test_paged_write_names_a_layer_it_does_not_have():
    paged = PagedKV(BlockPool(2, 1, 64, Q8, 1 << 20))
    paged.grow(3)
    k = torch.zeros(1, 1, 64)
    with pytest.raises(ValueError, match="layer must be ≤ 1, got 5"):
        paged.write(5, 0, k, k)


@pytest.mark.parametrize("kv", ["f16", "k=f16,v=q8", "k=q8,v=f16"])
@pytest.mark.parametrize(("big", "refused"), [(65519.0, False), (65520.0, True), (1e5, True), (3.0e38, True)])
def test_f16_values_past_its_range_are_refused(kv, big, refused):
    # numpy's float16 conversion (nearest even) is the reference: 65519 -> 65504, 65520 -> inf
    with np.errstate(over="ignore"):
        as_f16 = np.float16(np.float32(-big))
    assert np.isinf(as_f16) == refused
    cache = KVCache(1, 2, 64, 8, KVMode.parse(kv))
    rows = torch.zeros(2, 1, 64)
    rows[1, 0, 3] = -big
    if not refused:
        cache.write(0, 0, rows, rows)
        for kind, read in zip((cache.mode.k, cache.mode.v), cache.read(0, 1), strict=True):
            if kind == StoreKind.F16:
                assert read[1, 0, 3] == float(as_f16) == -65504.0
        return
    with pytest.raises(ValueError, match=r"overflows the f16 store \(largest finite value 65504\)"):
        cache.write(0, 0, rows, rows)


@given(st.floats(65000.0, 66000.0, width=32), st.integers(0, 1), st.integers(0, 63))
@example(65519.998046875, 0, 0)
@example(65520.0, 1, 63)
def test_the_compiled_step_refuses_exactly_what_converts_to_infinity(x, head, col):
    rows = np.zeros((2, 64), np.float32)
    rows[head, col] = x
    with np.errstate(over="ignore"):
        expected = bool(np.isinf(rows.astype(np.float16)).any())
    assert out_of_fp16(CODE_F16, rows, False) == expected


@pytest.mark.usefixtures("one_thread")
def test_the_fused_step_refuses_an_f16_overflow_like_the_general_path(tiny_dirs):  # noqa: F811
    llm = kvlens.load(tiny_dirs["llama"], kv="f16", attn_backend="numba")

    def spoil(norm: torch.Tensor) -> None:
        norm.mul_(1e6)  # layer 1's K and V far past 65504

    runs = refusals_of_both_paths(
        llm, "f16", list(range(3, 20)), spoil, ValueError, "overflows the f16 store"
    )
    assert_layer_1_unstored(llm, runs)
    for _, cache, _ in runs:
        assert not any(torch.isinf(s.data).any() for s in cache.k + cache.v)
