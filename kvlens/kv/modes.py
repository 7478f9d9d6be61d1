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

import torch

from ..checks import MAX_POSITIONS, check_bool, check_int
from .kinds import _PACKED, StoreKind  # StoreKind: the kinds a mode is made of, imported from here too

MIRROR_PREFILL = ("exact", "q8")
SINK_KIND = StoreKind.F16  # the sink store's rows (KVMode.keep_sink)


def check_positions(value: object, name: str) -> None:
    """ValueError unless ``value`` is an integer count of positions in [0, MAX_POSITIONS]."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_POSITIONS:
        raise ValueError(f"{name} must be an integer in [0, {MAX_POSITIONS}], got {value!r}")


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
    equal to (nor shares cached blocks with, :attr:`identity`) an uncentered one of the same name.

    ``keep_sink``: the first S positions of every layer are also kept in an f16 sink store and
    attention reads them from there, not from the quantized rows (a recipe's ``keep_sink``; the
    attention sink is the one row that most of the attention weight lands on). It costs a constant
    ``S`` rows per layer and KV head (:meth:`sink_bytes`), not bytes per token."""

    name: str
    k: StoreKind
    v: StoreKind
    mirror: bool = False
    layers: tuple[tuple[StoreKind, StoreKind], ...] = ()
    heads: tuple[tuple[tuple[StoreKind, StoreKind], ...], ...] = ()
    k_center: torch.Tensor | None = field(default=None, compare=False, repr=False)
    k_center_digest: str = field(default="", init=False)
    keep_sink: int = 0
    # per layer, how many KV heads a recipe listed (0: none listed); kept apart from ``heads``, which
    # folds a layer whose heads agree into one pair, so a wrong count is refused either way
    listed_kv_heads: tuple[int, ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        check_positions(self.keep_sink, f"KV mode {self.name}: keep_sink")
        pairs = [(self.k, self.v), *self.layers, *(p for layer in self.heads for p in layer)]
        if not all(isinstance(kind, StoreKind) for pair in pairs for kind in pair):
            raise TypeError(f"KV mode {self.name}: k and v are StoreKinds (KVMode.parse('q8') builds a mode)")
        check_bool(self.mirror, "mirror")
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
        sink = f"|keep_sink={self.keep_sink}" if self.keep_sink else ""
        centers = f"|k_center={self.k_center_digest}" if self.k_center is not None else ""
        return self.name + centers + sink

    def layer_center(self, layer: int) -> torch.Tensor | None:
        """The K centers of ``layer`` as ``[n_kv_heads, 1, head_dim]`` (float32), or None."""
        return None if self.k_center is None else self.k_center[layer].unsqueeze(1)

    def __str__(self) -> str:
        return self.name

    def __format__(self, spec: str) -> str:
        return format(self.name, spec)

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
        given, ``n_kv_heads`` KV heads: a per-head layer must name that many); TypeError when a count is
        not an integer."""
        for name, count in (("n_layers", n_layers), ("head_dim", head_dim), ("n_kv_heads", n_kv_heads)):
            if count is not None:
                check_int(count, name, minimum=1)
        if self.layers and len(self.layers) != n_layers:
            raise ValueError(f"KV recipe {self.name} has {len(self.layers)} layers; the model has {n_layers}")
        listed = self.listed_kv_heads or tuple(len(per_head) for per_head in self.heads)
        for i, count in enumerate(listed):
            if count and n_kv_heads is not None and count != n_kv_heads:
                raise ValueError(
                    f"KV recipe {self.name} gives layer {i} kinds for {count} KV heads; the model has {n_kv_heads}"
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
        if not self.layers and not self.heads:  # every layer alike (n_layers unbounded: no loop over it)
            k, v = self.k, self.v
            return (
                n_layers
                * n_kv_heads
                * (k.row_bytes(head_dim, with_ksum=True) + v.row_bytes(head_dim) + mirror)
            )
        rows = 0
        for i in range(n_layers):
            pairs = self.head_kinds(i) or (self.kinds(i),) * n_kv_heads
            rows += sum(k.row_bytes(head_dim, with_ksum=True) + v.row_bytes(head_dim) for k, v in pairs)
        return rows + mirror * n_layers * n_kv_heads

    def sink_bytes(self, n_layers: int, n_kv_heads: int, head_dim: int, sink: int | None = None) -> int:
        """Bytes of the f16 sink store (``sink`` positions, default :attr:`keep_sink`), K and V of every
        layer and KV head: a constant per sequence, beside :meth:`bytes_per_token`."""
        sink = self.keep_sink if sink is None else sink
        return sink * 2 * SINK_KIND.row_bytes(head_dim) * n_kv_heads * n_layers

    @property
    def label(self) -> str:
        """What the mode stores, e.g. ``K q8 / V f32`` (a recipe: its distinct per-layer pairs)."""
        if self.layers:
            pairs = sorted({f"{k}/{v}" for k, v in self.layers})
            split = sum(1 for h in self.heads if h)
            per_head = f", {split} split per KV head" if split else ""
            centered = ", K centered" if self.k_center is not None else ""
            sink = f", first {self.keep_sink} kept in f16" if self.keep_sink else ""
            return f"recipe, {len(self.layers)} layers{per_head}, K/V {' '.join(pairs)}{centered}{sink}"
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
    ``keep_sink``: keep the first S positions in the f16 sink store (as :attr:`KVMode.keep_sink` does;
    a cache keeps the larger of the two). ``keep_recent``: a lab option, keep the last R positions
    exact (an f32 copy of every row, spliced in where attention reads them).
    ``track_blocks``: keep per-block key bounds for sparse decode (:mod:`kvlens.kv.blocks`).
    """

    mirror_prefill: str = "exact"
    keep_sink: int = 0
    keep_recent: int = 0
    track_blocks: bool = False

    def __post_init__(self) -> None:
        if self.mirror_prefill not in MIRROR_PREFILL:
            raise ValueError(f"mirror_prefill must be 'exact' or 'q8', got {self.mirror_prefill!r}")
        check_positions(self.keep_sink, "keep_sink")
        check_positions(self.keep_recent, "keep_recent")
        check_bool(self.track_blocks, "track_blocks")

    @property
    def keeps_exact(self) -> bool:
        """Whether some positions are spliced in from the exact copy (keep_recent)."""
        return self.keep_recent > 0


def sink_positions(mode: KVMode, options: CacheOptions) -> int:
    """Positions a cache of ``mode`` with ``options`` keeps in its sink store: the larger of the two."""
    return max(mode.keep_sink, options.keep_sink)
