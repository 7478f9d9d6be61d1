"""Content-addressed prefix cache over a :class:`~kvlens.kv.pool.BlockPool`.

A full block is named by a chained hash: ``h_j = sha256(h_{j-1} || token ids of block j)`` (the ids as
little-endian int32: the names a disk tier keeps across processes and machines), with
``h_{-1}`` a salt naming everything else its contents depend on (model file digest, KV mode, mirror
prefill source, prefill chunk). Two sequences that share their first ``j`` blocks of tokens share
``h_0 .. h_{j-1}`` and so the blocks themselves.

Exactness rule (docs/serve-engine.md): blocks are published a whole prefill *chunk* at a time, and only
chunks of exactly ``chunk`` positions cut at absolute multiples of ``chunk`` (the scheduler's chunk
rule). A hit therefore resumes at a chunk boundary, and every chunk after it runs with the same start,
length, tokens and earlier rows as in a fresh prefill: the logits are bit-identical. Rows written by
decode steps are never published (their arithmetic differs from prefill's).

The pool keeps the hash of each published block; a published block whose last reference goes is
*parked* (kept, evictable, LRU order) instead of freed. The pool evicts the least recently parked
block when it needs space; with a :class:`~kvlens.kv.disk.DiskTier`, evicted blocks are spilled to
disk first and restored from there on a later hit.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from ..checks import check_int, check_token_ids
from .cache import BLOCK
from .modes import KVMode


def cache_salt(model_digest: str, mode: KVMode, mirror_prefill: str, prefill_chunk: int) -> bytes:
    """What a block's contents depend on besides its tokens (the root of every hash chain)."""
    if not isinstance(mode, KVMode):
        raise TypeError(f"mode must be a KVMode, got {type(mode).__name__}")
    return f"kvlens-prefix-v1|{model_digest}|{mode.identity}|{mirror_prefill}|chunk={prefill_chunk}".encode()


def block_hashes(tokens: Sequence[int], n_blocks: int, salt: bytes) -> list[bytes]:
    """The chained hashes of the first ``n_blocks`` full blocks of ``tokens`` (token ids, < 2**31)."""
    if check_int(n_blocks, "n_blocks", minimum=0) * BLOCK > len(tokens):
        raise ValueError(f"{len(tokens)} tokens hold no {n_blocks} full blocks")
    h = hashlib.sha256(salt).digest()
    ids = np.asarray(check_token_ids(tokens[: n_blocks * BLOCK], 2**31, allow_empty=True), "<i4")
    out = []
    for j in range(n_blocks):
        h = hashlib.sha256(h + ids[j * BLOCK : (j + 1) * BLOCK].tobytes()).digest()
        out.append(h)
    return out


class PrefixIndex:
    """hash <-> physical block for published blocks, and the LRU of the unreferenced ones."""

    def __init__(self) -> None:
        self.block_of: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self._parked: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.evictions = 0

    def __len__(self) -> int:
        return len(self.block_of)

    @property
    def evictable(self) -> int:
        return len(self._parked)

    def is_parked(self, block: int) -> bool:
        return block in self._parked

    def publish(self, h: bytes, block: int) -> bool:
        """Name ``block`` by ``h``; False (nothing changes) if ``h`` or ``block`` already has a name."""
        if h in self.block_of or block in self.hash_of:
            return False
        self.block_of[h], self.hash_of[block] = block, h
        return True

    def park(self, block: int) -> None:
        """``block`` lost its last reference: keep it, most recently used last."""
        self._parked[block] = None

    def unpark(self, block: int) -> None:
        if block not in self._parked:
            raise ValueError(f"block {block} is not parked")
        del self._parked[block]

    def evict(self) -> tuple[int, bytes]:
        """Forget the least recently parked block; its number and former hash."""
        if not self._parked:
            raise ValueError("no parked block to evict")
        block, _ = self._parked.popitem(last=False)
        h = self.hash_of.pop(block)
        del self.block_of[h]
        self.evictions += 1
        return block, h
