"""KV-cache modes as typed values: how K and V are stored, and the cache's options.

A mode name (``"q8"``, ``"q8-k"``, ...) is parsed once, at a public edge (``kvlens.load``, ``LLM``,
the CLI), into a :class:`KVMode`; everything inside takes the parsed value.

    f32, f16, bf16    both K and V in that float type
    q8                both int8 by the seed's rule (kvlens.kv.quant)
    q8-k, q8-v        only K (resp. V) int8, the other f32 — to split the cost between K and V
    q8+mirror         int8 rows *and* an exact f32 copy, like the seed's engine; decode reads int8,
                      prefill reads the exact copy when ``mirror_prefill="exact"`` (the seed's
                      default) or the int8 rows when ``mirror_prefill="q8"``
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

MIRROR_PREFILL = ("exact", "q8")


class StoreKind(str, Enum):
    """How one of K or V is stored: a float type, or int8 codes plus one fp32 max_abs per row."""

    F32 = "f32"
    F16 = "f16"
    BF16 = "bf16"
    Q8 = "q8"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def quantized(self) -> bool:
        return self is StoreKind.Q8

    @property
    def dtype(self) -> torch.dtype:
        """The element type of the stored rows (int8 codes for q8)."""
        return _DTYPES[self]

    def row_bytes(self, head_dim: int) -> int:
        """Bytes of one stored (token, head) row: int8 codes + one fp32 max_abs, or head_dim floats."""
        return head_dim + 4 if self.quantized else head_dim * self.dtype.itemsize


_DTYPES = {
    StoreKind.F32: torch.float32,
    StoreKind.F16: torch.float16,
    StoreKind.BF16: torch.bfloat16,
    StoreKind.Q8: torch.int8,
}


class UnknownKVModeError(ValueError):
    """A KV mode name that kvlens does not implement."""


@dataclass(frozen=True)
class KVMode:
    """A KV-cache mode: the storage of K and of V, and whether an exact f32 mirror is kept."""

    name: str
    k: StoreKind
    v: StoreKind
    mirror: bool = False

    def __str__(self) -> str:
        return self.name

    def __format__(self, spec: str) -> str:
        return format(self.name, spec)

    @property
    def quantized(self) -> bool:
        return self.k.quantized or self.v.quantized

    @property
    def label(self) -> str:
        """What the mode stores, e.g. ``K q8 / V f32``."""
        return f"K {self.k} / V {self.v}" + (" + exact f32 mirror" if self.mirror else "")

    @classmethod
    def parse(cls, mode: str | KVMode) -> KVMode:
        """The mode named ``mode`` (a :class:`KVMode` is returned as is)."""
        if isinstance(mode, KVMode):
            return mode
        if isinstance(mode, str) and mode in MODES:
            return MODES[mode]
        raise UnknownKVModeError(f"unknown KV cache mode {mode!r}; choose one of: {', '.join(MODES)}")


_F32, _F16, _BF16, _Q8 = StoreKind.F32, StoreKind.F16, StoreKind.BF16, StoreKind.Q8
MODES: dict[str, KVMode] = {
    m.name: m
    for m in (
        KVMode("f32", _F32, _F32),
        KVMode("f16", _F16, _F16),
        KVMode("bf16", _BF16, _BF16),
        KVMode("q8", _Q8, _Q8),
        KVMode("q8-k", _Q8, _F32),
        KVMode("q8-v", _F32, _Q8),
        KVMode("q8+mirror", _Q8, _Q8, mirror=True),
    )
}


@dataclass(frozen=True)
class CacheOptions:
    """Options of one cache beyond its mode.

    ``mirror_prefill``: q8+mirror only — prefill reads the ``"exact"`` copy or the ``"q8"`` rows.
    ``keep_sink`` / ``keep_recent``: lab options, keep the first S / last R positions exact.
    ``track_blocks``: keep per-block key bounds for sparse decode (:mod:`kvlens.kv.blocks`).
    """

    mirror_prefill: str = "exact"
    keep_sink: int = 0
    keep_recent: int = 0
    track_blocks: bool = False

    def __post_init__(self) -> None:
        if self.mirror_prefill not in MIRROR_PREFILL:
            raise ValueError(f"mirror_prefill must be 'exact' or 'q8', got {self.mirror_prefill!r}")
        for name in ("keep_sink", "keep_recent"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")

    @property
    def keeps_exact(self) -> bool:
        """Whether some positions are spliced in from the exact copy (keep_sink / keep_recent)."""
        return self.keep_sink > 0 or self.keep_recent > 0
