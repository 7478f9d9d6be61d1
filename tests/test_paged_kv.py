"""The paged block pool: rows land where the block table says; the decode kernels read through it.

Every mode: a sequence written into scattered pool blocks (another sequence's blocks interleaved,
free blocks full of garbage) reads back exactly as the same rows in a contiguous KVCache, and the
fused kernels give over the pool, through the block table, bit for bit what they give over the
contiguous cache — and both agree with the float64 reference attention.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kvlens.kernels import cpu
from kvlens.kernels.reference import reference_attention
from kvlens.kv.cache import BLOCK, KVCache
from kvlens.kv.modes import MODES
from kvlens.kv.pool import BlockPool, PagedKV, PoolExhaustedError, kv_bytes_per_token

N_KV, N_HEADS, HD = 2, 6, 64


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny problems run on one thread


def filled(mode: str, length: int, seed: int = 0):
    """A pool sequence and a contiguous cache holding the same rows [0, length) of one layer."""
    mode = MODES[mode]
    pool = BlockPool(1, N_KV, HD, mode, 12 * BLOCK * kv_bytes_per_token(mode, 1, N_KV, HD))
    for store in (*pool.k, *pool.v):  # garbage everywhere a sequence has not written
        store.data.fill_(127 if store.kind.int8 else 0xFF if store.kind.int4 or store.kind.packed else 3e4)
        if store.scale is not None:
            store.scale.fill_(6e4 if store.scale.dtype == torch.float16 else 1e6)  # fp16: near its largest
    seq, other = PagedKV(pool), PagedKV(pool)
    cache = KVCache(1, N_KV, HD, length, mode)
    gen = torch.Generator().manual_seed(seed)
    for start in range(0, length, 13):  # chunks that cross block boundaries
        end = min(length, start + 13)
        other.grow(end + BLOCK)  # interleave another sequence's blocks: the table is not contiguous
        seq.grow(end)
        k, v = (torch.randn(N_KV, end - start, HD, generator=gen) * 3 for _ in range(2))
        seq.write(0, start, k, v)
        cache.write(0, start, k, v)
    gaps = [b1 - b0 for b0, b1 in zip(seq.blocks, seq.blocks[1:], strict=False)]
    assert all(g != 1 for g in gaps)  # logical neighbours are never physical neighbours
    return pool, seq, other, cache


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("length", [1, 32, 75])
def test_paged_reads_and_kernel_equal_contiguous_and_reference(mode, length):
    pool, seq, _, cache = filled(mode, length)
    k_pool, v_pool = seq.read(0, length)
    k_ref, v_ref = cache.read(0, length)
    assert torch.equal(k_pool, k_ref) and torch.equal(v_pool, v_ref)
    if pool.has_mirror:
        for paged, contiguous in zip(seq.read(0, length, True), cache.read(0, length, True), strict=True):
            assert torch.equal(paged, contiguous)  # the exact copy that mirror prefill reads
    q = torch.randn(N_HEADS, HD, generator=torch.Generator().manual_seed(length))
    ref = reference_attention(q.double()[:, None], k_ref.double(), v_ref.double())[:, 0]
    for n_splits in (1, 3):
        paged = cpu.decode_attention(q, pool.k[0], pool.v[0], length, n_splits, table=seq.table)
        contiguous = cpu.decode_attention(q, cache.k[0], cache.v[0], length, n_splits)
        assert torch.equal(paged, contiguous)
        torch.testing.assert_close(paged.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def test_sparse_blocks_through_the_table():
    pool, seq, _, cache = filled("q8", 150)
    q = torch.randn(N_HEADS, HD)
    blocks = torch.tensor([[0, 2, 4], [1, 3, 4]], dtype=torch.int32)  # logical blocks per KV head
    paged = cpu.decode_attention(q, pool.k[0], pool.v[0], 150, 2, blocks=blocks, table=seq.table)
    assert torch.equal(paged, cpu.decode_attention(q, cache.k[0], cache.v[0], 150, 2, blocks=blocks))


def test_kernel_refuses_a_table_that_does_not_cover_the_length():
    pool, seq, _, _ = filled("q8", 40)
    q = torch.randn(N_HEADS, HD)
    with pytest.raises(ValueError, match="block table"):
        cpu.decode_attention(q, pool.k[0], pool.v[0], 3 * BLOCK, table=seq.table)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("mode", ["q8", "f16", "q8-k", "q6h"])
def test_triton_reads_through_the_table(monkeypatch, mode):
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    from kvlens.kernels.gpu import decode_attention_triton

    pool, seq, _, cache = filled(mode, 75)
    q = torch.randn(N_HEADS, HD)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    k_ref, v_ref = cache.read(0, 75)
    ref = reference_attention(q.double()[:, None], k_ref.double(), v_ref.double())[:, 0]
    moved = [
        type(s)(s.kind, s.data.to(dev), None if s.scale is None else s.scale.to(dev))
        for s in (pool.k[0], pool.v[0])
    ]
    out = decode_attention_triton(q.to(dev), *moved, 75, n_splits=2, table=torch.tensor(seq.blocks))
    torch.testing.assert_close(out.cpu().double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def test_pool_accounting_and_refcounts():
    pool = BlockPool(2, N_KV, HD, MODES["q8"], 5 * BLOCK * kv_bytes_per_token(MODES["q8"], 2, N_KV, HD) + 7)
    assert pool.n_blocks == 5 and pool.blocks_used == 0
    a, b = PagedKV(pool), PagedKV(pool)
    a.grow(70)  # 3 blocks
    b.grow(32)
    assert pool.blocks_used == 4 and not set(a.blocks) & set(b.blocks)
    with pytest.raises(PoolExhaustedError):
        b.grow(3 * BLOCK)
    pool.share(a.blocks[:1])  # a second owner (prefix sharing) keeps the block out of the free list
    a.free()
    assert pool.blocks_used == 2
    with pytest.raises(ValueError, match="released"):
        pool.release([pool._free[0]])
    b.free()
    assert pool.blocks_used == 1
    with pytest.raises(ValueError, match="no block"):
        BlockPool(1, N_KV, HD, MODES["f32"], 100)


@pytest.mark.parametrize("backend", ["numba-int:portable", "numba-int16:portable", "numba-int"])
def test_integer_kernels_read_through_the_table(backend):
    """The integer-score kernels over the pool (its K stores keep the 32-block code sums) equal
    themselves over the contiguous cache, through make_attend as the engine calls them."""
    from kvlens.engine.attention import make_attend
    from kvlens.kernels.cpu_int import IntAttn, decode_attention_int

    pool, seq, _, cache = filled("q8", 75)
    assert pool.k[0].ksum is not None and pool.v[0].ksum is None
    q = torch.randn(N_HEADS, HD, generator=torch.Generator().manual_seed(5))
    spec = IntAttn.parse(backend)
    want = decode_attention_int(q, cache.k[0], cache.v[0], 75, 2, spec=spec)
    assert torch.equal(decode_attention_int(q, pool.k[0], pool.v[0], 75, 2, spec=spec, table=seq.table), want)
    k_new, v_new = (torch.randn(N_KV, 1, HD, generator=torch.Generator().manual_seed(i)) for i in (6, 7))
    seq.grow(76)
    out = make_attend(seq, prefill=False, backend=backend)(0, q[:, None], k_new, v_new, 75)
    cache.reserve(76)
    cache.write(0, 75, k_new, v_new)
    assert torch.equal(out[:, 0], decode_attention_int(q, cache.k[0], cache.v[0], 76, spec=spec))
