"""KV-cache modes as typed values: how K and V are stored, and the cache's options.

A mode name (``"q8"``, ``"q8-k"``, ...) is parsed once, at a public edge (``kvlens.load``, ``LLM``,
the CLI), into a :class:`KVMode`; everything inside takes the parsed value.

    f32, f16, bf16    both K and V in that float type
    q8                both int8 by the seed's rule (kvlens.kv.quant)
    q8-k, q8-v        only K (resp. V) int8, the other f32 — to split the cost between K and V
    q8+mirror         int8 rows *and* an exact f32 copy, like the seed's engine; decode reads int8,
                      prefill reads the exact copy when ``mirror_prefill="exact"`` (the seed's
                      default) or the int8 rows when ``mirror_prefill="q8"``
    q8h               q8 after a fixed randomized Hadamard rotation of each row (kvlens.kv.quant)
    q4, q4h           llama.cpp's q4_0: 4-bit codes -8..7 in blocks of 32 along head_dim, fp16 scale
                      per block, two codes per byte (the lab's ``q4`` scheme rule); q4h rotated first
                      within each block, its step searched (llama.cpp's make_qx_quants)
    q7h, q6h, q5h     the q8 rule with qmax 2^(N-1)-1 (63, 31, 15) after q8h's rotation: N-bit two's-
                      complement codes bit-packed little-endian (code i in bits [iN, iN+N) of the
                      row), head_dim*N/8 bytes + one fp16 max_abs per row (kvlens.kv.nbit)
    k=KIND,v=KIND     separate K and V kinds, e.g. ``k=q8h,v=q4h`` (K is the sensitive one)
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from enum import StrEnum

import torch

MIRROR_PREFILL = ("exact", "q8")


class StoreKind(StrEnum):
    """How one of K or V is stored: a float type; int8 codes plus one fp32 max_abs per row (q8, q8h);
    packed 4-bit codes plus one fp16 scale per block of 32 values (q4, q4h); or N-bit codes (N = 7,
    6, 5) bit-packed plus one fp16 max_abs per row (q7h, q6h, q5h: the q8 rule at a narrower width).
    ``h``: the row is rotated (randomized Hadamard) before it is quantized. Printed and formatted as
    its value."""

    F32 = "f32"
    F16 = "f16"
    BF16 = "bf16"
    Q8 = "q8"
    Q8H = "q8h"
    Q4 = "q4"
    Q4H = "q4h"
    Q7H = "q7h"
    Q6H = "q6h"
    Q5H = "q5h"

    @property
    def quantized(self) -> bool:
        return self in _QUANTIZED

    @property
    def bits(self) -> int:
        """Bits per stored value (codes for the quantized kinds, scales not counted)."""
        return _DTYPE_BITS[self][1]

    @property
    def packed(self) -> bool:
        """N-bit codes bit-packed along the row with one fp16 max_abs per row (q7h, q6h, q5h)."""
        return self in _PACKED

    @property
    def row_scaled(self) -> bool:
        """One max_abs per row, codes by the q8 rule with :attr:`qmax` (q8, q8h: fp32; the packed kinds: fp16)."""
        return self.int8 or self.packed

    @property
    def qmax(self) -> int:
        """The largest code of a row-scaled kind, :func:`row_qmax` of its bits (127 for q8)."""
        if not self.row_scaled:
            raise ValueError(f"KV kind {self} has no per-row qmax")
        return row_qmax(self.bits)

    @property
    def int8(self) -> bool:
        """int8 codes with one fp32 max_abs per row (q8, q8h)."""
        return self in (StoreKind.Q8, StoreKind.Q8H)

    @property
    def int4(self) -> bool:
        """packed 4-bit codes with one fp16 scale per block of Q4_BLOCK values (q4, q4h)."""
        return self in (StoreKind.Q4, StoreKind.Q4H)

    @property
    def scale_search(self) -> bool:
        """The 4-bit step is searched (llama.cpp's make_qx_quants, least squares: q4h), not |max| / 8."""
        return self == StoreKind.Q4H

    @property
    def rotated(self) -> bool:
        """Rows are rotated (kvlens.kv.quant.rotation) before they are quantized."""
        return self in (StoreKind.Q8H, StoreKind.Q4H) or self.packed

    def rotation_span(self, head_dim: int) -> int:
        """How many values one Hadamard block of the rotation mixes (kvlens.kv.quant.rotation's
        ``span``), 0 where the kind is not rotated: q4h within each 32-value block, so each block keeps
        its own scale (why: docs/beyond-q8.md); the row-scaled kinds (one max_abs per row) the whole row."""
        if not self.rotated:
            return 0
        return Q4_BLOCK if self.int4 else head_dim

    @property
    def dtype(self) -> torch.dtype:
        """The element type of the stored rows (int8 codes for q8, uint8 code pairs for q4, uint8
        packed bytes for q7h/q6h/q5h)."""
        return _DTYPE_BITS[self][0]

    def row_width(self, head_dim: int) -> int:
        """Elements of ``dtype`` in one stored row (q4: two codes per byte; packed: head_dim*N/8 bytes)."""
        if self.packed:
            return head_dim * self.bits // 8
        return head_dim // 2 if self.int4 else head_dim

    def row_bytes(self, head_dim: int, *, with_ksum: bool = False) -> int:
        """Bytes of one stored (token, head) row, scales included: q8 codes + one fp32 max_abs, q4
        code pairs + one fp16 scale per block of 32, packed N-bit codes + one fp16 max_abs, or
        head_dim floats; ``with_ksum``: plus the code sums a K store keeps (:meth:`ksum_bytes`)."""
        self.check_head_dim(head_dim)
        extra = self.ksum_bytes(head_dim) if with_ksum else 0
        if self.row_scaled:
            return self.row_width(head_dim) + (2 if self.packed else 4) + extra
        if self.int4:
            return head_dim // 2 + 2 * (head_dim // Q4_BLOCK)
        return head_dim * self.dtype.itemsize

    def ksum_bytes(self, head_dim: int) -> int:
        """Bytes per row of the int16 code sums per block of KSUM_BLOCK that an int8 K store keeps
        for the integer attention kernels (kvlens.kv.cache); 0 for other kinds or head_dims."""
        return 2 * (head_dim // KSUM_BLOCK) if self.int8 and head_dim % KSUM_BLOCK == 0 else 0

    def check_head_dim(self, head_dim: int) -> None:
        """ValueError when this kind cannot store rows of ``head_dim`` values."""
        if self.packed and head_dim % 8:
            raise ValueError(
                f"KV kind {self} packs 8 codes per {self.bits} bytes: head_dim must be a multiple of 8, got {head_dim}"
            )
        if self.int4 and head_dim % Q4_BLOCK:
            raise ValueError(f"KV kind {self} needs head_dim divisible by {Q4_BLOCK}, got {head_dim}")
        if self.rotated and (head_dim < 2 or head_dim & (head_dim - 1)):
            raise ValueError(
                f"KV kind {self} rotates rows by a Hadamard transform, which needs head_dim a power of "
                f"two (64, 128, 256), got {head_dim}"
            )


def row_qmax(bits: int) -> int:
    """The largest code of the row rule (kvlens.kv.quant.quantize_q8) at ``bits`` per value:
    ``2^(bits-1) - 1`` (127 at 8 bits)."""
    if not 2 <= bits <= 8:
        raise ValueError(f"the row rule stores 2..8 bits per value, got {bits}")
    return (1 << (bits - 1)) - 1


Q4_BLOCK = 32  # values per fp16 scale of the 4-bit kinds
KSUM_BLOCK = 32  # codes per int16 sum of an int8 K store (kvlens.kernels.q8store.KSUM_BLOCK)
_PACKED = frozenset({StoreKind.Q7H, StoreKind.Q6H, StoreKind.Q5H})
_QUANTIZED = frozenset({StoreKind.Q8, StoreKind.Q8H, StoreKind.Q4, StoreKind.Q4H}) | _PACKED
_DTYPE_BITS = {  # the stored element type, and bits per value (codes for the quantized kinds)
    StoreKind.F32: (torch.float32, 32),
    StoreKind.F16: (torch.float16, 16),
    StoreKind.BF16: (torch.bfloat16, 16),
    StoreKind.Q8: (torch.int8, 8),
    StoreKind.Q8H: (torch.int8, 8),
    StoreKind.Q4: (torch.uint8, 4),
    StoreKind.Q4H: (torch.uint8, 4),
    StoreKind.Q7H: (torch.uint8, 7),
    StoreKind.Q6H: (torch.uint8, 6),
    StoreKind.Q5H: (torch.uint8, 5),
}


class UnknownKVModeError(ValueError):
    """A KV mode name that kvlens does not implement."""


@dataclass(frozen=True)
class KVMode:
    """A KV-cache mode: the storage of K and of V, and whether an exact f32 mirror is kept.

    ``layers``: a per-layer mode (a recipe, :mod:`kvlens.kv.recipe`) gives each layer its own
    ``(K kind, V kind)``; ``k`` and ``v`` are then the widest kinds it uses. Empty: every layer
    stores ``k`` and ``v``. Ask :meth:`kinds` for a layer's kinds.

    ``heads``: a per-KV-head recipe gives, per layer, either ``()`` (the layer stores
    ``layers[i]`` in every head) or one ``(K kind, V kind)`` per KV head; ``layers[i]`` is then the
    widest pair of the layer. Ask :meth:`head_kinds`.

    ``k_center``: a recipe's K centers, float32 ``[n_layers, n_kv_heads, head_dim]`` (post-RoPE basis)
    or None. The cache subtracts layer i's row of head h from every K row it stores there, before any
    rotation or quantization ("K smoothing": every score of a query moves by the same ``q·c``, which
    softmax ignores). Compared and hashed through ``k_center_digest``, so a centered mode is never
    equal to (nor shares cached blocks with, :attr:`identity`) an uncentered one of the same name."""

    name: str
    k: StoreKind
    v: StoreKind
    mirror: bool = False
    layers: tuple[tuple[StoreKind, StoreKind], ...] = ()
    heads: tuple[tuple[tuple[StoreKind, StoreKind], ...], ...] = ()
    k_center: torch.Tensor | None = field(default=None, compare=False, repr=False)
    k_center_digest: str = field(default="", init=False)

    def __post_init__(self) -> None:
        if self.k_center is not None:
            c = self.k_center
            if not isinstance(c, torch.Tensor) or c.dtype != torch.float32 or c.dim() != 3:
                raise TypeError("k_center must be a float32 tensor [n_layers, n_kv_heads, head_dim]")
            if not bool(torch.isfinite(c).all()):
                raise ValueError(f"KV mode {self.name}: k_center holds a non-finite value")
            digest = hashlib.sha256(c.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]
            object.__setattr__(self, "k_center_digest", digest)

    @property
    def identity(self) -> str:
        """The name, plus the K centers' digest where there are some: what cached blocks are keyed by
        (kvlens.kv.prefix.cache_salt, the disk tier's header)."""
        return f"{self.name}|k_center={self.k_center_digest}" if self.k_center is not None else self.name

    def layer_center(self, layer: int) -> torch.Tensor | None:
        """The K centers of ``layer`` as ``[n_kv_heads, 1, head_dim]`` (float32), or None."""
        return None if self.k_center is None else self.k_center[layer].unsqueeze(1)

    def __str__(self) -> str:
        return self.name

    def __format__(self, spec: str) -> str:
        return format(self.name, spec)

    @property
    def quantized(self) -> bool:
        pairs = [*(self.layers or ((self.k, self.v),)), *(p for layer in self.heads for p in layer)]
        return any(k.quantized or v.quantized for k, v in pairs)

    @property
    def per_head(self) -> bool:
        """Some layer gives its KV heads different kinds (a per-KV-head recipe)."""
        return any(self.heads)

    def kinds(self, layer: int) -> tuple[StoreKind, StoreKind]:
        """(K kind, V kind) of ``layer`` (a per-head layer: its widest kinds)."""
        return self.layers[layer] if self.layers else (self.k, self.v)

    def head_kinds(self, layer: int) -> tuple[tuple[StoreKind, StoreKind], ...] | None:
        """(K kind, V kind) per KV head of ``layer``, or None when every head stores :meth:`kinds`."""
        return self.heads[layer] if self.heads and self.heads[layer] else None

    def check_layout(self, n_layers: int, head_dim: int, n_kv_heads: int | None = None) -> None:
        """ValueError when this mode cannot store a model of ``n_layers`` layers of ``head_dim`` (and,
        given, ``n_kv_heads`` KV heads: a per-head layer must name that many)."""
        if self.layers and len(self.layers) != n_layers:
            raise ValueError(f"KV recipe {self.name} has {len(self.layers)} layers; the model has {n_layers}")
        for i, per_head in enumerate(self.heads):
            if per_head and n_kv_heads is not None and len(per_head) != n_kv_heads:
                raise ValueError(
                    f"KV recipe {self.name} gives layer {i} kinds for {len(per_head)} KV heads; the model "
                    f"has {n_kv_heads}"
                )
        for k, v in [*(self.layers or ((self.k, self.v),)), *(p for layer in self.heads for p in layer)]:
            k.check_head_dim(head_dim)
            v.check_head_dim(head_dim)
        if self.k_center is not None:
            got, want = tuple(self.k_center.shape), (n_layers, n_kv_heads, head_dim)
            names = ("layers", "KV heads", "head_dim")
            for name, g, w in zip(names, got, want, strict=True):
                if w is not None and g != w:
                    raise ValueError(
                        f"KV recipe {self.name}: k_center is [layers, KV heads, head_dim] = {list(got)}; the "
                        f"model has {w} {name}"
                    )

    def bytes_per_token(self, n_layers: int, n_kv_heads: int, head_dim: int) -> int:
        """Stored KV bytes per token position over all layers: what the stores hold (scales, K's code
        sums and the mirror copy included)."""
        self.check_layout(n_layers, head_dim, n_kv_heads)
        mirror = 2 * StoreKind.F32.row_bytes(head_dim) if self.mirror else 0
        rows = 0
        for i in range(n_layers):
            pairs = self.head_kinds(i) or (self.kinds(i),) * n_kv_heads
            rows += sum(k.row_bytes(head_dim, with_ksum=True) + v.row_bytes(head_dim) for k, v in pairs)
        return rows + mirror * n_layers * n_kv_heads

    @property
    def label(self) -> str:
        """What the mode stores, e.g. ``K q8 / V f32`` (a recipe: its distinct per-layer pairs)."""
        if self.layers:
            pairs = sorted({f"{k}/{v}" for k, v in self.layers})
            split = sum(1 for h in self.heads if h)
            per_head = f", {split} split per KV head" if split else ""
            centered = ", K centered" if self.k_center is not None else ""
            return f"recipe, {len(self.layers)} layers{per_head}, K/V {' '.join(pairs)}{centered}"
        return f"K {self.k} / V {self.v}" + (" + exact f32 mirror" if self.mirror else "")

    @classmethod
    def parse(cls, mode: str | KVMode) -> KVMode:
        """The mode named ``mode`` (a :class:`KVMode` is returned as is), or ``k=KIND,v=KIND``."""
        if isinstance(mode, KVMode):
            return mode
        if isinstance(mode, str) and mode in MODES:
            return MODES[mode]
        if isinstance(mode, str) and mode.replace(" ", "").startswith("k="):
            return cls._parse_split(mode.replace(" ", ""))
        if isinstance(mode, str) and mode.endswith(".json"):
            from .recipe import load_recipe

            return load_recipe(mode)
        raise UnknownKVModeError(
            f"unknown KV cache mode {mode!r}; choose one of: {', '.join(MODES)}, k=KIND,v=KIND, or a "
            "recipe .json file"
        )

    @classmethod
    def _parse_split(cls, spec: str) -> KVMode:
        parts = dict(p.split("=", 1) for p in spec.split(",") if "=" in p)
        if spec.count(",") != 1 or set(parts) != {"k", "v"}:
            raise UnknownKVModeError(f"a split KV mode reads k=KIND,v=KIND, got {spec!r}")
        kinds = []
        for role in ("k", "v"):
            try:
                kinds.append(StoreKind(parts[role]))
            except ValueError:
                choices = ", ".join(k.value for k in StoreKind)
                raise UnknownKVModeError(
                    f"unknown {role.upper()} kind {parts[role]!r} in {spec!r}; choose one of: {choices}"
                ) from None
        k, v = kinds
        for m in MODES.values():  # a split naming a registered mode is that mode (one name per mode)
            if (m.k, m.v, m.mirror) == (k, v, False):
                return m
        return cls(f"k={k},v={v}", k, v)


_F32, _F16, _BF16, _Q8 = StoreKind.F32, StoreKind.F16, StoreKind.BF16, StoreKind.Q8
_Q8H, _Q4, _Q4H = StoreKind.Q8H, StoreKind.Q4, StoreKind.Q4H
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
        KVMode("q8h", _Q8H, _Q8H),
        KVMode("q4", _Q4, _Q4),
        KVMode("q4h", _Q4H, _Q4H),
        *(KVMode(str(kind), kind, kind) for kind in sorted(_PACKED, key=lambda k: -k.bits)),
    )
}


def split_mode_list(spec: str) -> list[str]:
    """Names in a comma list, a ``k=KIND,v=KIND`` pair kept as one name (``"q8,k=q8h,v=q4h"`` ->
    ``["q8", "k=q8h,v=q4h"]``)."""
    names: list[str] = []
    for item in (s.strip() for s in spec.split(",")):
        if item.startswith("v=") and names and names[-1].startswith("k=") and "," not in names[-1]:
            names[-1] += "," + item
        elif item:
            names.append(item)
    return names


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
