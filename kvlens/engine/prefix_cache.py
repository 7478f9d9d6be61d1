"""The scheduler's side of the prefix cache: find a prompt's cached chunks, publish computed ones.

See :mod:`kvlens.kv.prefix` for the hashing and the exactness rule (whole chunks only), and
:mod:`kvlens.kv.disk` for the disk tier.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..kv.cache import BLOCK
from ..kv.disk import DiskTier
from ..kv.pool import BlockPool, PagedKV
from ..kv.prefix import block_hashes, cache_salt


@dataclass
class PrefixStats:
    hit_tokens: int = 0  # prompt tokens of admitted requests served from the cache (memory or disk)


class PrefixCache:
    def __init__(
        self,
        pool: BlockPool,
        model_digest: str,
        prefill_chunk: int,
        disk_dir: Path | str | None = None,
        disk_budget: int = 0,
    ) -> None:
        if prefill_chunk % BLOCK:
            raise ValueError(
                f"the prefix cache reuses whole prefill chunks of whole blocks: prefill_chunk must be a "
                f"multiple of {BLOCK} (got {prefill_chunk})"
            )
        self.pool, self.chunk_blocks = pool, prefill_chunk // BLOCK
        self.salt = cache_salt(model_digest, pool.mode, pool.mirror_prefill, prefill_chunk)
        self.disk = DiskTier(disk_dir, disk_budget, pool, model_digest) if disk_dir is not None else None
        self.index = pool.enable_prefix(self.disk.spill if self.disk else None)
        self.stats = PrefixStats()

    def acquire(self, kv: PagedKV, prompt: list[int]) -> int:
        """Give an empty ``kv`` the longest run of cached whole chunks that leaves at least one prompt
        token to compute (memory hits shared, disk hits restored into fresh blocks); tokens reused."""
        assert not kv.blocks
        n_chunks = (len(prompt) - 1) // (self.chunk_blocks * BLOCK)
        hashes = block_hashes(prompt, n_chunks * self.chunk_blocks, self.salt)
        memory: list[int] = []
        for h in hashes:
            block = self.index.block_of.get(h)
            if block is None:
                break
            memory.append(block)
        self.pool.share(memory)  # first: restores below must not evict these
        kv.blocks = memory
        self._restore(kv, hashes[len(memory) :])
        keep = len(kv.blocks) // self.chunk_blocks * self.chunk_blocks
        self.pool.release(kv.blocks[keep:])
        del kv.blocks[keep:]
        kv.length = keep * BLOCK
        return kv.length

    def _restore(self, kv: PagedKV, hashes: list[bytes]) -> None:
        """Append blocks restored from disk for ``hashes`` (in order, while they last)."""
        if self.disk is None:
            return
        for h in hashes:
            if h not in self.disk or self.pool.blocks_free == 0:
                break
            (block,) = self.pool.allocate(1)
            if not self.disk.restore(block, h):
                self.pool.release([block])
                break
            self.index.publish(h, block)
            kv.blocks.append(block)

    def publish(self, kv: PagedKV, prompt: list[int], start: int, end: int) -> None:
        """Name the blocks of prefill chunk ``[start, end)`` if it is a whole chunk (the exactness rule)."""
        if end - start != self.chunk_blocks * BLOCK:
            return
        first, last = start // BLOCK, end // BLOCK
        hashes = block_hashes(prompt, last, self.salt)
        for j in range(first, last):
            self.index.publish(hashes[j], kv.blocks[j])
