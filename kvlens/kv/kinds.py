"""Storage kinds: how one of K or V is stored (a float type, or codes with their scales).

:class:`StoreKind` and its constants; a :class:`~kvlens.kv.modes.KVMode` pairs a K kind and a V
kind (per layer, per KV head in a recipe).
"""

from __future__ import annotations

from enum import StrEnum

import torch


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
