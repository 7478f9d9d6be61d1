"""The KV cache: per layer, K and V rows stored head-major in blocks of 32 positions.

Layout of one layer (``cap`` = capacity, a multiple of BLOCK)::

    K.data  [n_kv_heads, cap, head_dim]   float32 / float16 / bfloat16 / int8
    K.scale [n_kv_heads, cap]             float32 max_abs per row (int8 stores only)
    V.*     the same

Modes (``mode`` string → how K and V are stored):

    f32, f16, bf16    both K and V in that float type
    q8                both int8 by the seed's rule (kvlens.kv.quant)
    q8-k, q8-v        only K (resp. V) int8, the other f32 — to split the cost between K and V
    q8+mirror         int8 rows *and* an exact f32 copy, like the seed's engine; decode reads int8,
                      prefill reads the exact copy when ``mirror_prefill="exact"`` (the seed's
                      default) or the int8 rows when ``mirror_prefill="q8"``

Attention over a quantized store always reads the quantized values of every cached position,
including earlier chunks of a chunked prefill. The only exceptions are explicit: the mirror option
above, and ``keep_sink`` / ``keep_recent`` (lab options that keep the first S / last R positions exact).

With ``track_blocks=True`` the cache also keeps, per block and KV head, the per-channel min/max of
the keys as read (``bounds``, see :mod:`kvlens.kv.blocks`) for sparse decode.

Non-finite policy: every write is checked; NaN/Inf in K or V raises :class:`NonFiniteKVError`
naming the layer and position, in every mode (a quantized NaN would be silent garbage).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .blocks import BlockBounds
from .quant import dequantize_q8, first_nonfinite, store_q8

BLOCK = 32
FLOAT_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
# mode -> (K storage, V storage, keeps an exact f32 mirror)
MODES: dict[str, tuple[str, str, bool]] = {
    "f32": ("f32", "f32", False),
    "f16": ("f16", "f16", False),
    "bf16": ("bf16", "bf16", False),
    "q8": ("q8", "q8", False),
    "q8-k": ("q8", "f32", False),
    "q8-v": ("f32", "q8", False),
    "q8+mirror": ("q8", "q8", True),
}


class NonFiniteKVError(ValueError):
    """NaN or Inf reached the KV cache."""


class UnknownKVModeError(ValueError):
    """A KV mode name that kvlens does not implement."""


def parse_mode(mode: str) -> tuple[str, str, bool]:
    if mode not in MODES:
        raise UnknownKVModeError(f"unknown KV cache mode {mode!r}; choose one of: {', '.join(MODES)}")
    return MODES[mode]


def check_kv_finite(layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise :class:`NonFiniteKVError` naming the layer and position if K or V holds NaN/Inf."""
    for name, rows in (("K", k), ("V", v)):
        bad = first_nonfinite(rows)
        if bad is not None:
            pos = start + bad // rows.shape[2] % rows.shape[1]  # rows are [n_kv, n, head_dim]
            raise NonFiniteKVError(
                f"non-finite {name} value at layer {layer}, position {pos}; refusing to store it in the KV cache"
            )


def row_bytes(kind: str, head_dim: int) -> int:
    """Bytes of one stored (token, head) row: int8 codes + one fp32 max_abs, or head_dim floats."""
    return head_dim + 4 if kind == "q8" else head_dim * torch.finfo(FLOAT_DTYPES[kind]).bits // 8


def round_up(n: int, multiple: int = BLOCK) -> int:
    return -(-n // multiple) * multiple


@dataclass
class RowStore:
    """One of K or V of one layer."""

    kind: str
    data: torch.Tensor
    scale: torch.Tensor | None  # max_abs per row, int8 stores only

    @classmethod
    def empty(cls, kind: str, n_kv: int, cap: int, head_dim: int, device: torch.device) -> RowStore:
        if kind == "q8":
            return cls(
                kind,
                torch.zeros(n_kv, cap, head_dim, dtype=torch.int8, device=device),
                torch.ones(n_kv, cap, dtype=torch.float32, device=device),
            )
        return cls(kind, torch.zeros(n_kv, cap, head_dim, dtype=FLOAT_DTYPES[kind], device=device), None)

    def grow(self, cap: int) -> None:
        n_kv, old, d = self.data.shape
        data = self.data.new_zeros(n_kv, cap, d)
        data[:, :old] = self.data
        self.data = data
        if self.scale is not None:
            scale = self.scale.new_ones(n_kv, cap)
            scale[:, :old] = self.scale
            self.scale = scale

    def write(self, start: int, rows: torch.Tensor) -> None:
        if self.kind == "q8":
            store_q8(rows, self.data, self.scale, start)
        else:
            self.data[:, start : start + rows.shape[1]] = rows

    def read_index(self, pos: torch.Tensor) -> torch.Tensor:
        """Rows at positions ``pos`` as float32 [n_kv, len(pos), head_dim]."""
        if self.kind == "q8":
            return dequantize_q8(self.data[:, pos], self.scale[:, pos])
        return self.data[:, pos].to(torch.float32)

    def read(self, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) as float32 — the values attention sees."""
        if self.kind == "q8":
            return dequantize_q8(self.data[:, start:end], self.scale[:, start:end])
        return self.data[:, start:end].to(torch.float32)


class KVCache:
    """KV cache for all layers of one sequence."""

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        capacity: int,
        mode: str = "q8",
        device: torch.device | str = "cpu",
        mirror_prefill: str = "exact",
        keep_sink: int = 0,
        keep_recent: int = 0,
        track_blocks: bool = False,
    ) -> None:
        k_kind, v_kind, mirror = parse_mode(mode)
        if mirror_prefill not in ("exact", "q8"):
            raise ValueError("mirror_prefill must be 'exact' or 'q8'")
        self.mode, self.n_layers, self.n_kv_heads, self.head_dim = mode, n_layers, n_kv_heads, head_dim
        self.device = torch.device(device)
        self.mirror_prefill, self.keep_sink, self.keep_recent = mirror_prefill, keep_sink, keep_recent
        # An exact copy is kept for the mirror mode and for the lab's keep-sink / keep-recent options.
        self.has_mirror = mirror or keep_sink > 0 or keep_recent > 0
        cap = round_up(max(capacity, 1))
        self.k = [RowStore.empty(k_kind, n_kv_heads, cap, head_dim, self.device) for _ in range(n_layers)]
        self.v = [RowStore.empty(v_kind, n_kv_heads, cap, head_dim, self.device) for _ in range(n_layers)]
        self.k_exact = (
            [RowStore.empty("f32", n_kv_heads, cap, head_dim, self.device) for _ in range(n_layers)]
            if self.has_mirror
            else []
        )
        self.v_exact = (
            [RowStore.empty("f32", n_kv_heads, cap, head_dim, self.device) for _ in range(n_layers)]
            if self.has_mirror
            else []
        )
        self.length = 0  # positions written in every layer
        # per-block key min/max for sparse decode's block selection (kv.blocks)
        self.bounds = (
            BlockBounds(n_layers, n_kv_heads, head_dim, BLOCK, self.device) if track_blocks else None
        )

    @property
    def capacity(self) -> int:
        return self.k[0].data.shape[1]

    @property
    def quantized(self) -> bool:
        return "q8" in (self.k[0].kind, self.v[0].kind)

    def bytes_per_token(self) -> int:
        """Stored KV bytes per token position over all layers (mirror included)."""
        per_layer = row_bytes(self.k[0].kind, self.head_dim) + row_bytes(self.v[0].kind, self.head_dim)
        if self.has_mirror:
            per_layer += 2 * row_bytes("f32", self.head_dim)
        return per_layer * self.n_kv_heads * self.n_layers

    def reserve(self, capacity: int) -> None:
        """Grow every layer's storage (block by block) to hold at least ``capacity`` positions."""
        if capacity <= self.capacity:
            return
        cap = round_up(capacity)
        for store in (*self.k, *self.v, *self.k_exact, *self.v_exact):
            store.grow(cap)

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V rows ``[n_kv, n, head_dim]`` for positions ``start .. start+n-1`` of ``layer``."""
        check_kv_finite(layer, start, k, v)
        self.reserve(start + k.shape[1])
        self.k[layer].write(start, k)
        self.v[layer].write(start, v)
        if self.has_mirror:
            self.k_exact[layer].write(start, k)
            self.v_exact[layer].write(start, v)
        if self.bounds is not None:
            first = start - start % BLOCK
            self.bounds.update(
                layer, self.k[layer].read(first, start + k.shape[1]), first, start + k.shape[1]
            )
        if layer == self.n_layers - 1:
            self.length = max(self.length, start + k.shape[1])

    def read(self, layer: int, end: int, prefill: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions ``[0, end)`` as float32 ``[n_kv, end, head_dim]`` — what attention sees."""
        if prefill and self.mode == "q8+mirror" and self.mirror_prefill == "exact":
            return self.k_exact[layer].read(0, end), self.v_exact[layer].read(0, end)
        k, v = self.k[layer].read(0, end), self.v[layer].read(0, end)
        if self.keep_sink or self.keep_recent:
            for lo, hi in ((0, min(self.keep_sink, end)), (max(end - self.keep_recent, 0), end)):
                if hi > lo:
                    k[:, lo:hi] = self.k_exact[layer].read(lo, hi)
                    v[:, lo:hi] = self.v_exact[layer].read(lo, hi)
        return k, v

    def truncate(self, length: int) -> None:
        """Forget positions ≥ length (they are overwritten by the next write)."""
        self.length = min(self.length, length)
