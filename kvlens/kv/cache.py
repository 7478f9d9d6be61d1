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
above, the sink store, and ``keep_recent`` (a lab option that keeps the last R positions exact).

Sink store: with a sink (:attr:`KVMode.keep_sink` of a recipe, or ``CacheOptions.keep_sink``; the
larger), the first S positions of every layer are also written, in the store's basis, to a small f16
store (``k_sink`` / ``v_sink``, S rows per KV head), and attention reads those positions from it:
:meth:`KVCache.read` splices them in, the fused kernels take them as :meth:`KVCache.sink_rows`. An f32
store is read as it is (its own rows are exact).

With ``track_blocks=True`` the cache also keeps, per block and KV head, the per-channel min/max of
the keys as read (``bounds``, see :mod:`kvlens.kv.blocks`) for sparse decode.

Non-finite policy: every write is checked; NaN/Inf in K or V raises :class:`NonFiniteKVError`
naming the layer and position, in every mode (a quantized NaN would be silent garbage).
"""

from __future__ import annotations

from typing import Any

import torch

from ..checks import MAX_POSITIONS, check_device, check_int, check_tensor
from .blocks import BlockBounds
from .modes import SINK_KIND, CacheOptions, KVMode, sink_positions
from .quant import first_nonfinite
from .stores import (  # noqa: F401 - store_basis, rotations, Rotation, layer_stores: imported from here too
    BLOCK,
    F32,
    HeadSplitStore,
    KVAllocationError,
    Rotation,
    RowStore,
    cache_stores,
    layer_stores,
    rotations,
    round_up,
    store_basis,
)


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


def sink_stores(
    n_layers: int, n_kv: int, rows: int, head_dim: int, device: torch.device
) -> tuple[list, list]:
    """Empty f16 sink stores of every layer, ``rows`` rows each (K, then V); none without rows."""
    if rows == 0:
        return [], []
    return tuple(
        [RowStore.empty(SINK_KIND, n_kv, rows, head_dim, device) for _ in range(n_layers)] for _ in "kv"
    )  # type: ignore[return-value]


def sink_rows_of(
    k_store, v_store, k_sink: RowStore, v_sink: RowStore, n: int, row: int = 0, sink_row: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``n`` sink positions of one layer as attention reads them, float32 ``[n_kv, n,
    head_dim]`` in the stores' basis, K then V: from the sink stores (from ``sink_row``), or from an
    f32 store itself (from ``row``, where position 0 is stored: its rows are exact)."""
    return tuple(  # type: ignore[return-value]
        store.read(row, row + n) if getattr(store, "kind", None) == F32 else sink.read(sink_row, sink_row + n)
        for store, sink in ((k_store, k_sink), (v_store, v_sink))
    )


def check_rows(cache: Any, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """ValueError / TypeError unless ``k`` and ``v`` are rows ``[n_kv_heads, n, head_dim]`` of
    ``cache`` (a :class:`KVCache` or a pool's ``PagedKV``) for a layer it has: the JIT writes index
    the stores with these shapes unchecked."""
    check_int(layer, "layer", minimum=0, maximum=cache.n_layers - 1)
    check_int(start, "start", minimum=0)
    for name, rows in (("k", k), ("v", v)):
        check_tensor(rows, name, floating=True)
        if rows.dim() != 3 or rows.shape[0] != cache.n_kv_heads or rows.shape[2] != cache.head_dim:
            raise ValueError(
                f"{name} must be [n_kv_heads={cache.n_kv_heads}, n, head_dim={cache.head_dim}], "
                f"got {tuple(rows.shape)}"
            )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")


def check_span(cache: Any, layer: int, end: int) -> None:
    """ValueError / TypeError unless ``layer`` is one of ``cache``'s and ``[0, end)`` lies in its
    capacity (a read past it came back short, without a word)."""
    check_int(layer, "layer", minimum=0, maximum=cache.n_layers - 1)
    check_int(end, "end", minimum=0, maximum=cache.capacity)


def check_fits_model(cache: Any, n_layers: int, n_kv_heads: int, head_dim: int) -> None:
    """ValueError unless ``cache`` holds ``n_layers`` layers of ``n_kv_heads`` heads of ``head_dim``
    (a model run over another model's cache would index past its stores)."""
    got = (cache.n_layers, cache.n_kv_heads, cache.head_dim)
    if got != (n_layers, n_kv_heads, head_dim):
        raise ValueError(
            f"the cache is for {got[0]} layers x {got[1]} KV heads x head_dim {got[2]}; this model has "
            f"{n_layers} x {n_kv_heads} x {head_dim}"
        )


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
        mode.check_layout(n_layers, head_dim, n_kv_heads)  # the counts too
        check_int(capacity, "capacity", minimum=0, maximum=MAX_POSITIONS)
        self.mode, self.options = mode, options
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        self.device = check_device(device)
        # An exact copy is kept for the mirror mode and for the lab's keep-recent option.
        self.has_mirror = mode.mirror or options.keeps_exact
        cap = round_up(max(capacity, 1))

        self.k, self.v, self.k_exact, self.v_exact = cache_stores(
            mode, n_layers, n_kv_heads, cap, head_dim, self.device, exact=self.has_mirror
        )
        self.sink = sink_positions(mode, options)
        self.k_sink, self.v_sink = sink_stores(n_layers, n_kv_heads, self.sink, head_dim, self.device)
        self.length = 0  # positions written in every layer
        # per-block key min/max for sparse decode's block selection (kv.blocks)
        self.bounds = (
            BlockBounds(n_layers, n_kv_heads, head_dim, BLOCK, self.device) if options.track_blocks else None
        )

    @property
    def capacity(self) -> int:
        return self.k[0].capacity

    def sink_bytes(self) -> int:
        """Bytes of the sink store (a constant per sequence, beside :meth:`bytes_per_token`)."""
        return self.mode.sink_bytes(self.n_layers, self.n_kv_heads, self.head_dim, self.sink)

    def bytes_per_token(self) -> int:
        """Stored KV bytes per token position over all layers (mirror and kept-exact copy included)."""
        exact = 2 * F32.row_bytes(self.head_dim) * self.n_kv_heads * self.n_layers
        stored = self.mode.bytes_per_token(self.n_layers, self.n_kv_heads, self.head_dim)
        return stored + (exact if self.has_mirror and not self.mode.mirror else 0)

    def reserve(self, capacity: int) -> None:
        """Grow every layer's storage (block by block) to hold at least ``capacity`` positions."""
        if check_int(capacity, "capacity", minimum=0, maximum=MAX_POSITIONS) <= self.capacity:
            return
        cap = round_up(capacity)
        try:
            for store in (*self.k, *self.v, *self.k_exact, *self.v_exact):
                store.grow(cap)
        except RuntimeError as e:  # the allocator's refusal
            raise KVAllocationError(f"cannot grow the KV cache to {capacity} positions: {e}") from None

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V rows ``[n_kv, n, head_dim]`` for positions ``start .. start+n-1`` of ``layer``."""
        check_rows(self, layer, start, k, v)
        check_kv_finite(layer, start, k, v)
        end = start + k.shape[1]
        self.reserve(end)
        k, v = self.k[layer].basis(k), self.v[layer].basis(v)
        self.k[layer].write(start, k)
        self.v[layer].write(start, v)
        if self.has_mirror:
            self.k_exact[layer].write(start, k)
            self.v_exact[layer].write(start, v)
        if start < self.sink:
            n = min(end, self.sink) - start
            self.k_sink[layer].write(start, k[:, :n])
            self.v_sink[layer].write(start, v[:, :n])
        if self.bounds is not None:
            first = start - start % BLOCK
            self.bounds.update(layer, self.k[layer].read(first, end), first, end)
        if layer == self.n_layers - 1:
            self.length = max(self.length, end)

    def read(self, layer: int, end: int, prefill: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions ``[0, end)`` as float32 ``[n_kv, end, head_dim]`` — what attention sees."""
        check_span(self, layer, end)
        if prefill and self.mode.mirror and self.options.mirror_prefill == "exact":
            return self.k_exact[layer].read(0, end), self.v_exact[layer].read(0, end)
        k, v = self.k[layer].read(0, end), self.v[layer].read(0, end)
        sink = self.sink_rows(layer, end)
        if sink is not None:
            k[:, : sink[0].shape[1]], v[:, : sink[1].shape[1]] = sink
        recent = self.options.keep_recent
        if recent:
            lo = max(end - recent, 0)
            k[:, lo:end] = self.k_exact[layer].read(lo, end)
            v[:, lo:end] = self.v_exact[layer].read(lo, end)
        return k, v

    def sink_rows(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """K and V of the sink positions below ``end`` as attention reads them, float32 ``[n_kv, s,
        head_dim]`` in the stores' basis (an f32 store's own rows), or None without a sink."""
        check_span(self, layer, end)
        n = min(self.sink, end)
        if n == 0:
            return None
        return sink_rows_of(self.k[layer], self.v[layer], self.k_sink[layer], self.v_sink[layer], n)

    def truncate(self, length: int) -> None:
        """Forget positions ≥ length (they are overwritten by the next write)."""
        self.length = min(self.length, check_int(length, "length", minimum=0))
