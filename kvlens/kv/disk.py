"""The disk tier of the prefix cache: evicted blocks spilled to files, restored on a later hit.

A block file holds the block exactly as it sits in the pool (int8 codes and fp32 scales for q8
stores, codes and fp16 scales for the 4-bit and packed ones, f16/bf16/f32 rows otherwise, every layer's K and V and mirror copies; no conversion)::

    MAGIC | header length (u32 LE) | header (JSON) | payload | sha256 of all before it

The header names the block's hash, the model file digest, the KV mode, block size, layer count and
head shapes, and the payload length. A file is written to a temporary name and ``os.replace``d into
place (a reader never sees half a file). On restore the checksum, the header and the length are all
checked before a byte reaches the pool; a file that fails is counted, deleted and the block is
recomputed. The directory is held to a byte budget by deleting the oldest files first.

The tier is a cache: a block it cannot write (disk full, the folder removed or made read-only) is
counted and logged, not raised, so the pool reuses the block as it would without a tier and no
request fails; a removed folder is made again at the next spill.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import json
import logging
import os
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..checks import check_int
from .cache import BLOCK
from .pool import BlockPool

log = logging.getLogger("kvlens.kv.disk")

MAGIC = b"KVLENS-BLOCK-4\n"  # 2: q4h rotates per 32-value block; 3: packed fp16 max_abs; 4: q4h searched
SUFFIX = ".kvb"
_LEN = struct.Struct("<I")
_DIGEST = hashlib.sha256().digest_size
# Seconds: one block of a small model is tens of KiB (page cache) to a few ms (cold SSD).
RESTORE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


@dataclass
class LatencyHistogram:
    """Cumulative-bucket latency counts (what a Prometheus histogram exposes)."""

    bounds: tuple[float, ...] = RESTORE_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(RESTORE_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.total += seconds

    def snapshot(self) -> LatencyHistogram:
        return LatencyHistogram(self.bounds, list(self.counts), self.total)


@dataclass
class DiskStats:
    spilled: int = 0
    restored: int = 0
    corrupt: int = 0  # files refused on restore (checksum, header, length) and deleted
    failed: int = 0  # blocks not spilled because their file could not be written
    bytes: int = 0  # on disk now
    restore_seconds: LatencyHistogram = field(default_factory=LatencyHistogram)


def _raw(t: torch.Tensor) -> bytes:
    """The stored bytes of ``t`` (any dtype, bf16 included)."""
    return t.contiguous().cpu().view(torch.uint8).numpy().tobytes()


class DiskTier:
    """Block files of one pool under ``root``, at most ``budget_bytes`` of them (oldest deleted first)."""

    def __init__(self, root: Path | str, budget_bytes: int, pool: BlockPool, model_digest: str) -> None:
        if check_int(budget_bytes, "the KV disk budget (bytes)") < 1:
            raise ValueError("the KV disk budget must be more than 0 bytes")
        if not isinstance(pool, BlockPool):
            raise TypeError(f"pool must be a BlockPool, got {type(pool).__name__}")
        if not isinstance(root, (str, os.PathLike)) or str(root) == "":
            raise ValueError(f"the KV disk tier needs a directory path, got {root!r}")
        self.root, self.budget, self.pool = Path(root), budget_bytes, pool
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"cannot use {self.root} as the KV disk tier: {e.strerror or e}") from None
        self._failing = False  # the last spill failed (its error logged once, until one succeeds)
        self.meta = {
            "model": model_digest, "mode": pool.mode.identity, "block": BLOCK, "layers": pool.n_layers,
            "kv_heads": pool.n_kv_heads, "head_dim": pool.head_dim, "mirror": pool.has_mirror,
            "payload": sum(t.numel() * t.element_size() for t in pool.block_rows(0)),
        }  # fmt: skip
        self.stats = DiskStats()
        self._files: OrderedDict[bytes, int] = OrderedDict()  # hash -> file bytes, oldest first
        for path in sorted(self.root.glob(f"*{SUFFIX}"), key=lambda p: p.stat().st_mtime):
            try:
                self._files[bytes.fromhex(path.stem)] = path.stat().st_size
            except ValueError:
                continue  # not one of ours
        self.stats.bytes = sum(self._files.values())
        self._trim(0)

    def path(self, h: bytes) -> Path:
        return self.root / f"{h.hex()}{SUFFIX}"

    def __contains__(self, h: bytes) -> bool:
        return h in self._files

    def spill(self, block: int, h: bytes) -> None:
        """Write ``block`` (about to be reused) as the file of hash ``h``; oldest files go to fit."""
        if h in self._files:
            return
        header = json.dumps(self.meta | {"hash": h.hex()}, sort_keys=True).encode()
        body = MAGIC + _LEN.pack(len(header)) + header
        blob = body + b"".join(_raw(t) for t in self.pool.block_rows(block))
        blob += hashlib.sha256(blob).digest()
        if len(blob) > self.budget:
            return
        self._trim(len(blob))
        if not self._write(h, blob):
            return
        self._files[h] = len(blob)
        self.stats.bytes += len(blob)
        self.stats.spilled += 1

    def _write(self, h: bytes, blob: bytes) -> bool:
        """Write the file of hash ``h`` (whole or not at all); False, counted and logged, if it cannot."""
        tmp = self.path(h).with_suffix(".tmp")
        try:
            self.root.mkdir(parents=True, exist_ok=True)  # removed under a running server: made again
            with open(tmp, "wb") as f:
                f.write(blob)
            os.replace(tmp, self.path(h))
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            self.stats.failed += 1
            if not self._failing:
                log.warning("KV disk tier: cannot write block files under %s (%s); blocks are dropped, "
                            "not spilled, until a write succeeds", self.root, e.strerror or e)  # fmt: skip
            self._failing = True
            return False
        self._failing = False
        return True

    def restore(self, block: int, h: bytes) -> bool:
        """Fill ``block`` from the file of hash ``h``; False (the file deleted if bad) when it cannot."""
        if h not in self._files:
            return False
        t0 = time.perf_counter()
        try:
            blob = self.path(h).read_bytes()
        except OSError:
            blob = b""
        payload = self._verified_payload(blob, h)
        if payload is None:
            self.stats.corrupt += 1
            self._drop(h)
            return False
        offset = 0
        for t in self.pool.block_rows(block):
            n = t.numel() * t.element_size()
            raw = torch.frombuffer(bytearray(payload[offset : offset + n]), dtype=torch.uint8)
            t.copy_(raw.view(t.dtype).view(t.shape))
            offset += n
        self._files.move_to_end(h)  # used again: last to be deleted (mtime keeps the order over restarts)
        with contextlib.suppress(OSError):  # deleted since the read: the block is already in the pool
            os.utime(self.path(h))
        self.stats.restored += 1
        self.stats.restore_seconds.observe(time.perf_counter() - t0)
        return True

    def _verified_payload(self, blob: bytes, h: bytes) -> bytes | None:
        """The payload of a well-formed file for hash ``h`` in this pool's layout, else None."""
        head = len(MAGIC) + _LEN.size
        if len(blob) < head + _DIGEST or not blob.startswith(MAGIC):
            return None
        body, digest = blob[:-_DIGEST], blob[-_DIGEST:]
        if hashlib.sha256(body).digest() != digest:
            return None
        (n_header,) = _LEN.unpack_from(body, len(MAGIC))
        try:
            header = json.loads(body[head : head + n_header])
        except ValueError:
            return None
        payload = body[head + n_header :]
        if header != self.meta | {"hash": h.hex()} or len(payload) != self.meta["payload"]:
            return None
        return payload

    def _drop(self, h: bytes) -> None:
        self.stats.bytes -= self._files.pop(h)
        with contextlib.suppress(OSError):  # a read-only folder: the file stays, no longer counted
            self.path(h).unlink(missing_ok=True)

    def _trim(self, room: int) -> None:
        """Delete the oldest files until ``room`` more bytes fit in the budget."""
        while self._files and self.stats.bytes + room > self.budget:
            self._drop(next(iter(self._files)))
