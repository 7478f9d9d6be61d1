"""The KV cache: per layer, K and V rows stored head-major in blocks of 32 positions.

Layout of one layer (``cap`` = capacity, a multiple of BLOCK)::

    K.data  [n_kv_heads, cap, head_dim]     float32 / float16 / bfloat16 / int8 (q8, q8h)
            [n_kv_heads, cap, head_dim/2]   uint8, two 4-bit codes per byte (q4, q4h)
            [n_kv_heads, cap, head_dim*N/8] uint8, N-bit codes bit-packed (q7h, q6h, q5h: kv.nbit)
    K.scale [n_kv_heads, cap]               max_abs per row: float32 (q8, q8h), float16 (q7h, q6h, q5h)
            [n_kv_heads, cap, head_dim/32]  float16 scale per block of 32 (q4, q4h)
    K.ksum  [n_kv_heads, cap, head_dim/32]  int16 sum of each 32-code block (int8 K only: the integer
                                            attention kernels' +128 query-shift correction)
    V.*     the same, without ksum

Scales and key sums live out of line, in their own arrays, so the code rows stay plain rows (the
layout vLLM measured fastest for gathers).

K smoothing: a mode with K centers (:attr:`KVMode.k_center`, a recipe's ``k_center``) gives each
layer's K store its centers (``RowStore.center``); :meth:`RowStore.basis`, the one step every K row
takes from the model to a store (KVCache and the paged pool's writes, the mirror / kept-exact copy
too, since it is written in the store's basis), subtracts them before anything else: rotation and
quantization see ``k - c``. The fused decode step subtracts the same rows in its compiled store
(:mod:`kvlens.kernels.step_kv`). Reads are unchanged: every score of a query moves by ``q·c``.

Rotated kinds (q8h, q4h) hold every row of their layer's K (or V) in the rotated basis ``x @ R``
(:func:`kvlens.kv.quant.rotation`), the exact copy included: ``write`` takes rows as the model makes
them and rotates them, ``read`` returns the stored basis. Attention rotates the query by the same R
(K rotated) and its output back by ``R.T`` (V rotated): :func:`store_basis` and :func:`rotations`.

The mode (:class:`~kvlens.kv.modes.KVMode`) says how K and V are stored; :class:`~kvlens.kv.modes.CacheOptions`
holds the rest (mirror prefill, keep-sink / keep-recent, block tracking).

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

from ..checks import MAX_POSITIONS, check_int, check_tensor
from .blocks import BlockBounds
from .modes import Q4_BLOCK, CacheOptions, KVMode, StoreKind
from .nbit import dequantize_packed, store_packed
from .quant import (
    KSUM_BLOCK,
    dequantize_q4,
    dequantize_q8,
    first_nonfinite,
    rotate_rows,
    store_q4,
    store_q8,
)

BLOCK = 32
F32 = StoreKind.F32  # the exact copy's storage


class NonFiniteKVError(ValueError):
    """NaN or Inf reached the KV cache."""


def check_kv_finite(layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise :class:`NonFiniteKVError` naming the layer and position if K or V holds NaN/Inf."""
    for name, rows in (("K", k), ("V", v)):
        bad = first_nonfinite(rows)
        if bad is not None:
            pos = start + bad // rows.shape[2] % rows.shape[1]  # rows are [n_kv, n, head_dim]
            raise NonFiniteKVError(
                f"non-finite {name} value at layer {layer}, position {pos}; refusing to store it in the KV cache"
            )


def store_basis(kind: StoreKind, rows: torch.Tensor) -> torch.Tensor:
    """``rows [..., head_dim]`` in the basis a store of ``kind`` keeps them (rotated kinds: ``rows @ R``
    of the kind's span, as a fast Walsh–Hadamard transform: :func:`kvlens.kv.quant.rotate_rows`)."""
    span = kind.rotation_span(rows.shape[-1])
    return rotate_rows(rows, span) if span else rows


# the span of a layer's rotation (StoreKind.rotation_span), or one per KV head (HeadSplitStore)
Rotation = int | list[int | None] | None


def _rotation_of(store: RowStore | HeadSplitStore) -> Rotation:
    if isinstance(store, HeadSplitStore):
        per_head = [_rotation_of(part) for part in store.parts]
        return per_head if any(r is not None for r in per_head) else None
    return store.kind.rotation_span(store.head_dim) or None


def rotations(
    k_store: RowStore | HeadSplitStore, v_store: RowStore | HeadSplitStore
) -> tuple[Rotation, Rotation]:
    """The rotation attention applies to the query (K rotated) and, transposed, to its output (V
    rotated) for one layer's stores; None where the kind is not rotated, a list of one per KV head
    (None for a head not rotated) for a layer split per head."""
    return _rotation_of(k_store), _rotation_of(v_store)


def layer_stores(
    mode: KVMode, n_layers: int, n_kv: int, cap: int, head_dim: int, device: torch.device
) -> tuple[list[RowStore | HeadSplitStore], list[RowStore | HeadSplitStore]]:
    """Empty K and V stores of every layer, each of the kind ``mode`` gives that layer (a layer whose
    KV heads differ: one store per head, :class:`HeadSplitStore`)."""
    k: list[RowStore | HeadSplitStore] = []
    v: list[RowStore | HeadSplitStore] = []
    for i in range(n_layers):
        heads, center = mode.head_kinds(i), mode.layer_center(i)
        center = None if center is None else center.to(device)
        if heads is None:
            kk, vk = mode.kinds(i)
            # int8 K keeps its code sums per 32-block for the integer attention kernels
            k.append(RowStore.empty(kk, n_kv, cap, head_dim, device, with_ksum=True, center=center))
            v.append(RowStore.empty(vk, n_kv, cap, head_dim, device))
        else:
            k.append(
                HeadSplitStore(
                    [
                        RowStore.empty(
                            kk, 1, cap, head_dim, device, True, None if center is None else center[h : h + 1]
                        )
                        for h, (kk, _) in enumerate(heads)
                    ]
                )
            )
            v.append(HeadSplitStore([RowStore.empty(vk, 1, cap, head_dim, device) for _, vk in heads]))
    return k, v


def cache_stores(
    mode: KVMode, n_layers: int, n_kv: int, cap: int, head_dim: int, device: torch.device, exact: bool
) -> tuple[list[RowStore | HeadSplitStore], ...]:
    """``(k, v, k_exact, v_exact)``: the K and V stores of every layer in ``mode`` (:func:`layer_stores`)
    and, with ``exact``, their f32 copies (the mirror mode's, or the kept-exact rows'); else empty."""
    k, v = layer_stores(mode, n_layers, n_kv, cap, head_dim, device)
    f32 = KVMode("f32", F32, F32)
    k_exact, v_exact = layer_stores(f32, n_layers, n_kv, cap, head_dim, device) if exact else ([], [])
    return k, v, k_exact, v_exact


def round_up(n: int, multiple: int = BLOCK) -> int:
    return -(-n // multiple) * multiple


@dataclass
class RowStore:
    """One of K or V of one layer."""

    kind: StoreKind
    data: torch.Tensor
    scale: torch.Tensor | None  # max_abs per row (q8: fp32, packed: fp16); q4: fp16 per block of 32
    ksum: torch.Tensor | None = None  # code sums per 32-block, int8 K stores only (integer kernels)
    center: torch.Tensor | None = None  # K smoothing: [n_kv, 1, head_dim] f32 subtracted by basis()

    @classmethod
    def empty(
        cls,
        kind: StoreKind,
        n_kv: int,
        cap: int,
        head_dim: int,
        device: torch.device,
        with_ksum: bool = False,
        center: torch.Tensor | None = None,
    ) -> RowStore:
        kind.check_head_dim(head_dim)
        data = torch.zeros(n_kv, cap, kind.row_width(head_dim), dtype=kind.dtype, device=device)
        scale = ksum = None
        if kind.row_scaled:  # max_abs per row: fp32 for int8 (the seed's rule), fp16 packed
            scale = torch.ones(
                n_kv, cap, dtype=torch.float16 if kind.packed else torch.float32, device=device
            )
            if with_ksum and kind.ksum_bytes(head_dim):
                ksum = torch.zeros(n_kv, cap, head_dim // KSUM_BLOCK, dtype=torch.int16, device=device)
        elif kind.int4:
            scale = torch.ones(n_kv, cap, head_dim // Q4_BLOCK, dtype=torch.float16, device=device)
        if center is not None and tuple(center.shape) != (n_kv, 1, head_dim):
            raise ValueError(f"a store's K centers are [{n_kv}, 1, {head_dim}], got {list(center.shape)}")
        return cls(kind, data, scale, ksum, center)

    @property
    def head_dim(self) -> int:
        return self.data.shape[2] * 8 * self.kind.dtype.itemsize // self.kind.bits

    @property
    def capacity(self) -> int:
        return self.data.shape[1]

    def basis(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows [n_kv, n, head_dim]`` as the model makes them, in the basis this store keeps: less
        the K centers (K smoothing) where the store has some, then rotated (q8h, q4h)."""
        if self.center is not None:
            rows = rows.to(torch.float32) - self.center
        return store_basis(self.kind, rows)

    def grow(self, cap: int) -> None:
        n_kv, old, d = self.data.shape
        data = self.data.new_zeros(n_kv, cap, d)
        data[:, :old] = self.data
        self.data = data
        if self.scale is not None:
            scale = self.scale.new_ones(n_kv, cap, *self.scale.shape[2:])
            scale[:, :old] = self.scale
            self.scale = scale
        if self.ksum is not None:
            ksum = self.ksum.new_zeros(n_kv, cap, self.ksum.shape[2])
            ksum[:, :old] = self.ksum
            self.ksum = ksum

    def span(self, start: int, end: int) -> RowStore:
        """Positions ``[start, end)`` as a store of their own, contiguous (a view when there is one
        KV head, else a copy of the span): a windowed layer's decode step hands the kernels just its
        window."""

        def cut(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[:, start:end].contiguous()

        return RowStore(self.kind, self.data[:, start:end], cut(self.scale), cut(self.ksum), self.center)

    def write(self, start: int, rows: torch.Tensor) -> None:
        """Store ``rows [n_kv, n, head_dim]`` (already in the store's basis) at ``start``."""
        if self.kind.int8:
            store_q8(rows, self.data, self.scale, start, self.ksum)
        elif self.kind.int4:
            store_q4(rows, self.data, self.scale, start, self.kind.scale_search)
        elif self.kind.packed:
            store_packed(rows, self.data, self.scale, start, self.kind.bits)
        else:
            self.data[:, start : start + rows.shape[1]] = rows

    def _values(self, data: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        if self.kind.int8:
            return dequantize_q8(data, scale)
        if self.kind.int4:
            return dequantize_q4(data, scale)
        if self.kind.packed:
            return dequantize_packed(data, scale, self.kind.bits)
        return data.to(torch.float32)

    def read_index(self, pos: torch.Tensor) -> torch.Tensor:
        """Rows at positions ``pos`` as float32 [n_kv, len(pos), head_dim] (the store's basis)."""
        return self._values(self.data[:, pos], None if self.scale is None else self.scale[:, pos])

    def read(self, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) as float32 — the values attention sees (in the store's basis)."""
        return self._values(self.data[:, start:end], None if self.scale is None else self.scale[:, start:end])


@dataclass
class HeadSplitStore:
    """One of K or V of a layer whose KV heads are stored in different kinds (a per-head recipe):
    one :class:`RowStore` of one head per KV head. Reads and writes take and give all heads at once,
    like a RowStore; the fused kernels run per head on ``parts`` (:mod:`kvlens.engine.attention`)."""

    parts: list[RowStore]

    @property
    def kind(self) -> StoreKind | None:
        """The kind every head shares, or None (they differ)."""
        kinds = {p.kind for p in self.parts}
        return kinds.pop() if len(kinds) == 1 else None

    @property
    def head_dim(self) -> int:
        return self.parts[0].head_dim

    @property
    def capacity(self) -> int:
        return self.parts[0].capacity

    def basis(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.cat([p.basis(rows[h : h + 1]) for h, p in enumerate(self.parts)])

    def grow(self, cap: int) -> None:
        for p in self.parts:
            p.grow(cap)

    def write(self, start: int, rows: torch.Tensor) -> None:
        for h, p in enumerate(self.parts):
            p.write(start, rows[h : h + 1])

    def read_index(self, pos: torch.Tensor) -> torch.Tensor:
        return torch.cat([p.read_index(pos) for p in self.parts])

    def read(self, start: int, end: int) -> torch.Tensor:
        return torch.cat([p.read(start, end) for p in self.parts])


class KVCache:
    """KV cache for all layers of one sequence."""

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        capacity: int,
        mode: KVMode,
        device: torch.device | str = "cpu",
        options: CacheOptions | None = None,
    ) -> None:
        options = CacheOptions() if options is None else options
        if not isinstance(mode, KVMode):
            raise TypeError(f"KVCache takes a KVMode (KVMode.parse(name)), got {type(mode).__name__}")
        if not isinstance(options, CacheOptions):
            raise TypeError(f"KVCache takes CacheOptions, got {type(options).__name__}")
        for name, value in (("n_layers", n_layers), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim)):
            check_int(value, name, minimum=1)
        check_int(capacity, "capacity", minimum=0, maximum=MAX_POSITIONS)
        self.mode, self.options = mode, options
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        self.device = torch.device(device)
        # An exact copy is kept for the mirror mode and for the lab's keep-sink / keep-recent options.
        self.has_mirror = mode.mirror or options.keeps_exact
        cap = round_up(max(capacity, 1))

        mode.check_layout(n_layers, head_dim, n_kv_heads)
        self.k, self.v, self.k_exact, self.v_exact = cache_stores(
            mode, n_layers, n_kv_heads, cap, head_dim, self.device, exact=self.has_mirror
        )
        self.length = 0  # positions written in every layer
        # per-block key min/max for sparse decode's block selection (kv.blocks)
        self.bounds = (
            BlockBounds(n_layers, n_kv_heads, head_dim, BLOCK, self.device) if options.track_blocks else None
        )

    @property
    def capacity(self) -> int:
        return self.k[0].capacity

    def bytes_per_token(self) -> int:
        """Stored KV bytes per token position over all layers (mirror and kept-exact copy included)."""
        exact = 2 * F32.row_bytes(self.head_dim) * self.n_kv_heads * self.n_layers
        stored = self.mode.bytes_per_token(self.n_layers, self.n_kv_heads, self.head_dim)
        return stored + (exact if self.has_mirror and not self.mode.mirror else 0)

    def reserve(self, capacity: int) -> None:
        """Grow every layer's storage (block by block) to hold at least ``capacity`` positions."""
        if capacity <= self.capacity:
            return
        cap = round_up(capacity)
        for store in (*self.k, *self.v, *self.k_exact, *self.v_exact):
            store.grow(cap)

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V rows ``[n_kv, n, head_dim]`` for positions ``start .. start+n-1`` of ``layer``."""
        self._check_rows(layer, start, k, v)
        check_kv_finite(layer, start, k, v)
        end = start + k.shape[1]
        self.reserve(end)
        k, v = self.k[layer].basis(k), self.v[layer].basis(v)
        self.k[layer].write(start, k)
        self.v[layer].write(start, v)
        if self.has_mirror:
            self.k_exact[layer].write(start, k)
            self.v_exact[layer].write(start, v)
        if self.bounds is not None:
            first = start - start % BLOCK
            self.bounds.update(layer, self.k[layer].read(first, end), first, end)
        if layer == self.n_layers - 1:
            self.length = max(self.length, end)

    def _check_rows(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        check_int(layer, "layer", minimum=0, maximum=self.n_layers - 1)
        check_int(start, "start", minimum=0)
        for name, rows in (("k", k), ("v", v)):
            check_tensor(rows, name, floating=True)
            if rows.dim() != 3 or rows.shape[0] != self.n_kv_heads or rows.shape[2] != self.head_dim:
                raise ValueError(
                    f"{name} must be [n_kv_heads={self.n_kv_heads}, n, head_dim={self.head_dim}], "
                    f"got {tuple(rows.shape)}"
                )
        if k.shape != v.shape:
            raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")

    def read(self, layer: int, end: int, prefill: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions ``[0, end)`` as float32 ``[n_kv, end, head_dim]`` — what attention sees."""
        if prefill and self.mode.mirror and self.options.mirror_prefill == "exact":
            return self.k_exact[layer].read(0, end), self.v_exact[layer].read(0, end)
        k, v = self.k[layer].read(0, end), self.v[layer].read(0, end)
        sink, recent = self.options.keep_sink, self.options.keep_recent
        if sink or recent:
            for lo, hi in ((0, min(sink, end)), (max(end - recent, 0), end)):
                if hi > lo:
                    k[:, lo:hi] = self.k_exact[layer].read(lo, hi)
                    v[:, lo:hi] = self.v_exact[layer].read(lo, hi)
        return k, v

    def truncate(self, length: int) -> None:
        """Forget positions ≥ length (they are overwritten by the next write)."""
        self.length = min(self.length, length)
