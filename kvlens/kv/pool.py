"""A paged KV block pool: one fixed byte budget per cache mode, shared by many sequences.

Storage is the cache's own :class:`~kvlens.kv.cache.RowStore` per layer (so every mode works paged:
f32, f16, bf16, q8, q8-k, q8-v and q8+mirror with its exact copy, and recipes; a layer that a
per-head recipe splits keeps a :class:`~kvlens.kv.cache.HeadSplitStore`, one RowStore per KV head),
sized ``n_blocks * BLOCK`` positions. Physical block ``b`` is rows ``[b * BLOCK, (b + 1) * BLOCK)`` of every layer's K and V
(and mirror) store. A sequence owns a *block table*: its logical block ``j`` (positions
``j * BLOCK ..``) lives in physical block ``table[j]``. The fused decode kernels read through the table
in place (no gather copy); prefill's torch path gathers the rows it attends.

A mode with a sink (:attr:`~kvlens.kv.modes.KVMode.keep_sink`, at most one block) also gives every
physical block S f16 sink rows per layer (``k_sink`` / ``v_sink``, rows ``[b * S, (b + 1) * S)``):
the block that holds a sequence's logical block 0 keeps that sequence's first S positions there, so
they travel with the block when the prefix cache shares it and the disk tier spills it.

Blocks carry reference counts so that the prefix cache (:mod:`kvlens.kv.prefix`) can share full
blocks between sequences: ``allocate`` hands out blocks at count 1, ``share`` adds a reference,
``release`` drops one and returns a block to the free list when none is left, or, if the block is
published in the prefix index, parks it there (evictable; ``allocate`` evicts the least recently
parked block, after handing it to ``spill`` when a disk tier is attached).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import numpy as np
import torch

from ..checks import MAX_POSITIONS, check_device, check_int
from .cache import (
    BLOCK,
    HeadSplitStore,
    RowStore,
    cache_stores,
    check_kv_finite,
    check_rows,
    check_span,
    sink_rows_of,
    sink_stores,
)
from .modes import MIRROR_PREFILL, CacheOptions, KVMode
from .prefix import PrefixIndex


def kv_bytes_per_token(mode: KVMode, n_layers: int, n_kv_heads: int, head_dim: int) -> int:
    """Stored KV bytes per token position over all layers in ``mode`` (the mirror copy included)."""
    return mode.bytes_per_token(n_layers, n_kv_heads, head_dim)


def kv_block_bytes(mode: KVMode, n_layers: int, n_kv_heads: int, head_dim: int) -> int:
    """Bytes of one pool block of BLOCK positions in ``mode``: its rows, and its sink rows if any."""
    return kv_bytes_per_token(mode, n_layers, n_kv_heads, head_dim) * BLOCK + mode.sink_bytes(
        n_layers, n_kv_heads, head_dim
    )


class PoolExhaustedError(RuntimeError):
    """More blocks were asked for than the pool has free (the scheduler checks before asking)."""


class BlockPool:
    """``n_blocks`` blocks of BLOCK positions for every layer, in one KV mode."""

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        mode: KVMode,
        budget_bytes: int,
        device: torch.device | str = "cpu",
        mirror_prefill: str = "exact",
    ) -> None:
        if not isinstance(mode, KVMode):
            raise TypeError(f"BlockPool takes a KVMode (KVMode.parse(name)), got {type(mode).__name__}")
        if mirror_prefill not in MIRROR_PREFILL:
            raise ValueError("mirror_prefill must be 'exact' or 'q8'")
        check_int(budget_bytes, "budget_bytes", minimum=1)
        self.mode, self.n_layers, self.n_kv_heads, self.head_dim = mode, n_layers, n_kv_heads, head_dim
        self.mirror_prefill, self.has_mirror = mirror_prefill, mode.mirror
        self.device = check_device(device)
        self.bytes_per_token = kv_bytes_per_token(mode, n_layers, n_kv_heads, head_dim)
        if mode.keep_sink > BLOCK:
            raise ValueError(
                f"the paged pool keeps a sink of at most {BLOCK} positions (one block), not {mode.keep_sink}"
            )
        self.sink = mode.keep_sink
        self.block_bytes = kv_block_bytes(mode, n_layers, n_kv_heads, head_dim)
        self.n_blocks = int(budget_bytes) // self.block_bytes
        if self.n_blocks < 1:
            raise ValueError(
                f"a KV budget of {budget_bytes} bytes holds no block of {BLOCK} positions "
                f"({self.block_bytes} bytes in mode {mode})"
            )
        cap = self.n_blocks * BLOCK
        if cap > MAX_POSITIONS:  # positions index int32 tensors in the kernels
            raise ValueError(
                f"a KV budget of {budget_bytes} bytes is {cap} positions in mode {mode}; a pool holds at most "
                f"{MAX_POSITIONS}"
            )

        self.k, self.v, self.k_exact, self.v_exact = cache_stores(
            mode, n_layers, n_kv_heads, cap, head_dim, self.device, exact=mode.mirror
        )
        self.k_sink, self.v_sink = sink_stores(
            n_layers, n_kv_heads, self.n_blocks * self.sink, head_dim, self.device
        )
        self.refcount = np.zeros(self.n_blocks, np.int32)
        self._free: deque[int] = deque(range(self.n_blocks))
        self.peak_used = 0  # the most blocks referenced by sequences at once (blocks_used's high-water mark)
        self.index: PrefixIndex | None = None  # set by enable_prefix
        self.spill: Callable[[int, bytes], None] | None = None  # told each evicted block before reuse

    def enable_prefix(self, spill: Callable[[int, bytes], None] | None = None) -> PrefixIndex:
        """Keep published blocks after their last reference (prefix cache); ``spill(block, hash)`` sees
        each one before eviction reuses it."""
        self.index, self.spill = PrefixIndex(), spill
        return self.index

    # -- accounting ------------------------------------------------------------------------------
    @property
    def blocks_free(self) -> int:
        """Blocks ``allocate`` can hand out: free ones and parked (evictable) cached ones."""
        return len(self._free) + (self.index.evictable if self.index else 0)

    @property
    def blocks_used(self) -> int:
        """Blocks referenced by sequences."""
        return self.n_blocks - self.blocks_free

    @property
    def blocks_cached(self) -> int:
        """Parked cached blocks (unreferenced, kept for later hits)."""
        return self.index.evictable if self.index else 0

    @property
    def bytes_total(self) -> int:
        return self.n_blocks * self.block_bytes

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks, each now referenced once: free ones first, then evicted least recently parked."""
        if check_int(n, "n", minimum=0) > self.blocks_free:
            raise PoolExhaustedError(f"asked for {n} blocks, {self.blocks_free} free")
        blocks = [self._take() for _ in range(n)]
        self.refcount[blocks] = 1
        self.peak_used = max(self.peak_used, self.blocks_used)
        return blocks

    def _take(self) -> int:
        if self._free:
            return self._free.popleft()
        assert self.index is not None
        block, h = self.index.evict()
        if self.spill is not None:
            self.spill(block, h)
        return block

    def share(self, blocks: list[int]) -> None:
        """One more reference to each of ``blocks`` (prefix sharing; a parked block is taken back)."""
        self._check_ids(blocks)
        for b in blocks:
            if self.refcount[b] == 0:
                if self.index is None or not self.index.is_parked(b):
                    raise ValueError(f"cannot share free block {b}")
                self.index.unpark(b)
            self.refcount[b] += 1
        self.peak_used = max(self.peak_used, self.blocks_used)

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each block; blocks left unreferenced go back to the free list."""
        self._check_ids(blocks)
        for b in blocks:
            if self.refcount[b] < 1:
                raise ValueError(f"block {b} released more often than it was referenced")
            self.refcount[b] -= 1
            if self.refcount[b] == 0:
                if self.index is not None and b in self.index.hash_of:
                    self.index.park(b)
                else:
                    self._free.append(b)

    def _check_ids(self, blocks: list[int]) -> None:
        for b in blocks:
            check_int(b, "block", minimum=0, maximum=self.n_blocks - 1)

    def block_rows(self, block: int) -> list[torch.Tensor]:
        """Views of every stored tensor of ``block`` (each layer's K, V, mirror copies; codes then
        scales of quantized stores, int8 K's code sums) in a fixed order: what the disk tier writes and
        reads back."""
        rows = slice(block * BLOCK, (block + 1) * BLOCK)
        out = []
        for store in (*self.k, *self.v, *self.k_exact, *self.v_exact):
            for part in store.parts if isinstance(store, HeadSplitStore) else [store]:
                out += self._rows_of(part, rows)
        sink = slice(block * self.sink, (block + 1) * self.sink)
        return out + [store.data[:, sink] for store in (*self.k_sink, *self.v_sink)]

    @staticmethod
    def _rows_of(store: RowStore, rows: slice) -> list[torch.Tensor]:
        """One store's tensors of a block (a layer split per KV head: each head's store in turn)."""
        out = [store.data[:, rows]]
        if store.scale is not None:
            out.append(store.scale[:, rows])
        if store.ksum is not None:  # the integer kernels read them: a restored block needs its own
            out.append(store.ksum[:, rows])
        return out


class PagedKV:
    """One sequence's view of a :class:`BlockPool`: the KV-cache interface attention uses
    (``write`` / ``read`` / stores ``k``, ``v``) over the sequence's block table."""

    bounds = None  # no sparse-decode block metadata in the pool

    def __init__(self, pool: BlockPool) -> None:
        if not isinstance(pool, BlockPool):
            raise TypeError(f"PagedKV takes a BlockPool, got {type(pool).__name__}")
        self.pool = pool
        self.mode, self.n_layers, self.head_dim = pool.mode, pool.n_layers, pool.head_dim
        self.n_kv_heads = pool.n_kv_heads
        self.options = CacheOptions(mirror_prefill=pool.mirror_prefill)  # what attention asks a cache
        self.k, self.v = pool.k, pool.v
        self.has_mirror, self.mirror_prefill = pool.has_mirror, pool.mirror_prefill
        self.sink = pool.sink
        self.blocks: list[int] = []
        self.length = 0  # positions written in every layer
        self._table: np.ndarray | torch.Tensor | None = None

    @property
    def capacity(self) -> int:
        return len(self.blocks) * BLOCK

    @property
    def table(self) -> np.ndarray | torch.Tensor:
        """The block table as the decode kernel takes it (int32; a tensor on the pool's device off the CPU)."""
        if self._table is None or len(self._table) != len(self.blocks):
            t = np.asarray(self.blocks, np.int32)
            self._table = t if self.pool.device.type == "cpu" else torch.from_numpy(t).to(self.pool.device)
        return self._table

    def blocks_needed(self, end: int) -> int:
        """Blocks to add so that positions ``[0, end)`` are covered."""
        return max(0, -(-end // BLOCK) - len(self.blocks))

    def grow(self, end: int) -> None:
        """Take the blocks that positions ``[0, end)`` need from the pool."""
        check_int(end, "end", minimum=0)
        self.blocks += self.pool.allocate(self.blocks_needed(end))

    def free(self) -> None:
        """Give every block back to the pool (the sequence keeps no KV); last block first, so that a
        prefix cache evicts the tails of cached prefixes before their heads."""
        self.pool.release(self.blocks[::-1])
        self.blocks, self.length, self._table = [], 0, None

    def _segments(self, start: int, end: int):
        """(physical row, offset into the rows, count) runs of positions ``[start, end)``."""
        pos = start
        while pos < end:
            n = min(end, (pos // BLOCK + 1) * BLOCK) - pos
            yield self.blocks[pos // BLOCK] * BLOCK + pos % BLOCK, pos - start, n
            pos += n

    def _physical(self, end: int) -> torch.Tensor:
        pos = torch.arange(end)
        table = torch.as_tensor(self.blocks, dtype=torch.long)
        return (table[pos // BLOCK] * BLOCK + pos % BLOCK).to(self.pool.device)

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V rows ``[n_kv, n, head_dim]`` for positions ``start ..`` of ``layer`` (blocks must be held)."""
        check_rows(self, layer, start, k, v)
        end = start + k.shape[1]
        if end > self.capacity:
            raise ValueError(
                f"positions up to {end} need blocks the sequence does not hold ({self.capacity})"
            )
        check_kv_finite(layer, start, k, v)
        k, v = self.k[layer].basis(k), self.v[layer].basis(v)
        stores = [(self.k, k), (self.v, v)]
        if self.has_mirror:
            stores += [(self.pool.k_exact, k), (self.pool.v_exact, v)]
        for phys, off, n in self._segments(start, end):
            for store, rows in stores:
                store[layer].write(phys, rows[:, off : off + n])
        if start < self.sink:  # the sink rows of the block that holds logical block 0
            at, n = self.blocks[0] * self.sink + start, min(end, self.sink) - start
            self.pool.k_sink[layer].write(at, k[:, :n])
            self.pool.v_sink[layer].write(at, v[:, :n])
        if layer == self.n_layers - 1:
            self.length = max(self.length, end)

    def sink_rows(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """As :meth:`kvlens.kv.cache.KVCache.sink_rows`, from the sink rows of the sequence's block 0."""
        if min(self.sink, end) == 0:
            return None
        b0, pool = self.blocks[0], self.pool
        return sink_rows_of(
            self.k[layer], self.v[layer], pool.k_sink[layer], pool.v_sink[layer], min(self.sink, end),
            row=b0 * BLOCK, sink_row=b0 * self.sink,
        )  # fmt: skip

    def read(self, layer: int, end: int, prefill: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions ``[0, end)`` as float32 ``[n_kv, end, head_dim]`` (gathered)."""
        check_span(self, layer, end)
        k, v = self.k, self.v
        if prefill and self.has_mirror and self.mirror_prefill == "exact":
            k, v = self.pool.k_exact, self.pool.v_exact
        phys = self._physical(end)
        k_rows, v_rows = k[layer].read_index(phys), v[layer].read_index(phys)
        sink = self.sink_rows(layer, end)
        if sink is not None:
            k_rows[:, : sink[0].shape[1]], v_rows[:, : sink[1].shape[1]] = sink
        return k_rows, v_rows

    def bytes_per_token(self) -> int:
        return self.pool.bytes_per_token
