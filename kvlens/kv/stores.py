"""Row stores: one of K or V of one layer, as :mod:`kvlens.kv.cache` lays it out (its docstring has
the layout), and the builders of a cache's stores.

:class:`RowStore` writes rows in its kind (quantizing them) and reads them back as float32;
:class:`HeadSplitStore` holds a layer whose KV heads have different kinds (a per-head recipe).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .kinds import Q4_BLOCK, StoreKind
from .modes import KVMode
from .nbit import dequantize_packed, store_packed
from .quant import KSUM_BLOCK, dequantize_q4, dequantize_q8, rotate_rows, store_q4, store_q8

BLOCK = 32
F32 = StoreKind.F32  # the exact copy's storage


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


class KVAllocationError(ValueError):
    """KV stores larger than the memory this machine has free: refused before allocating, or refused
    by the allocator (a zero-filled pool past free memory would be killed by the system instead)."""


def available_memory(device: torch.device) -> int:
    """Bytes free now: the GPU's free memory, or the host's MemAvailable (Linux; else physical / 2)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def cache_stores(
    mode: KVMode, n_layers: int, n_kv: int, cap: int, head_dim: int, device: torch.device, exact: bool
) -> tuple[list[RowStore | HeadSplitStore], ...]:
    """``(k, v, k_exact, v_exact)``: the K and V stores of every layer in ``mode`` (:func:`layer_stores`)
    and, with ``exact``, their f32 copies (the mirror mode's, or the kept-exact rows'); else empty.
    :class:`KVAllocationError` when they need more than the device has free."""
    per_token = mode.bytes_per_token(n_layers, n_kv, head_dim)
    if exact and not mode.mirror:  # the mirror's copy is in bytes_per_token already
        per_token += 2 * F32.row_bytes(head_dim) * n_kv * n_layers
    need, free = per_token * cap, available_memory(device)
    if need > free:
        raise KVAllocationError(f"KV stores of {cap} positions need {need} bytes; {free} bytes are free")
    try:
        k, v = layer_stores(mode, n_layers, n_kv, cap, head_dim, device)
        f32 = KVMode("f32", F32, F32)
        k_exact, v_exact = layer_stores(f32, n_layers, n_kv, cap, head_dim, device) if exact else ([], [])
    except RuntimeError as e:  # the allocator's refusal
        raise KVAllocationError(f"cannot allocate KV stores of {cap} positions ({need} bytes): {e}") from None
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
        the K centers (K smoothing) where the store has some, then rotated (q8h, q4h, q7h / q6h / q5h)."""
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

    def write(self, start: int, rows: torch.Tensor) -> None:
        """Store ``rows [n_kv, n, head_dim]`` (already in the store's basis) at ``start``."""
        if self.kind.int8:
            store_q8(rows, self.data, self.scale, start, self.ksum)
        elif self.kind.int4:
            store_q4(rows, self.data, self.scale, start, self.kind.scale_search)
        elif self.kind.packed:
            store_packed(rows, self.data, self.scale, start, self.kind.bits)
        else:
            values = rows.to(self.data.dtype)
            if self.kind != StoreKind.F32 and torch.isinf(values).any():  # f16, bf16: past their range
                raise ValueError(
                    f"|x| up to {float(rows.abs().max()):.6g} overflows the {self.kind} store (largest "
                    f"finite value {torch.finfo(values.dtype).max:.5g})"
                )
            self.data[:, start : start + rows.shape[1]] = values

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
