"""The packed N-bit kinds (q7h, q6h, q5h): the q8 row rule at ``bits`` N, codes bit-packed.

A row of ``d`` values (d a multiple of 8) is quantized by :func:`kvlens.kv.quant.quantize_q8` with
``bits=N`` and ``fp16_scale`` (one fp16 ``max_abs`` per row, qmax ``2^(N-1) - 1``: llama.cpp keeps
its block scales in fp16 too; the rounding moves the scale by at most 2^-11 of itself, and the codes
are made with the rounded value) and stored as ``d * N / 8`` bytes:
code ``i`` as an N-bit two's-complement field in bits ``[i*N, i*N + N)`` of the row, little-endian
(bit ``b`` of the row is bit ``b % 8`` of byte ``b // 8``). Eight codes fill exactly N bytes, so the
packing works on groups of 8 codes held in one 64-bit word (8 * 7 = 56 bits at most).
"""

from __future__ import annotations

import numpy as np
import torch

from ..checks import check_tensor
from ..kernels.q8store import store_packed_rows
from .quant import dequantize_q8, fp16_overflow, quantize_q8

GROUP = 8  # codes per group of N whole bytes


def _checked_width(t: torch.Tensor, name: str, dtype: torch.dtype, bits: int) -> int:
    """The last dimension of ``t``, once ``bits`` is a packable width (2..8) and ``t`` a ``dtype``
    tensor of at least one dimension (the argument checks of :func:`pack_bits` and :func:`unpack_bits`)."""
    if not 2 <= bits <= 8:
        raise ValueError(f"packed codes are 2..8 bits wide, got {bits}")
    check_tensor(t, name, dtypes=(dtype,), min_dim=1)
    return t.shape[-1]


def _shifts(bits: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The packing layout as int64 shifts: ``(field, byte)``, code i's field at bit ``field[i]`` of its
    group's 64-bit word (i < GROUP) and byte j of that word at bit ``byte[j]`` (j < ``bits``)."""
    field = torch.arange(GROUP, device=device, dtype=torch.int64) * bits
    byte = torch.arange(bits, device=device, dtype=torch.int64) * 8
    return field, byte


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ``int8 [..., d]`` (each in ``-2^(N-1) .. 2^(N-1)-1``, d a multiple of 8) as
    ``uint8 [..., d * bits / 8]``: code i's two's-complement low ``bits`` bits at row bits [i*N, i*N+N)."""
    d = _checked_width(codes, "codes", torch.int8, bits)
    if d % GROUP:
        raise ValueError(f"pack_bits needs a last dimension divisible by {GROUP}, got {d}")
    half = 1 << (bits - 1)
    if bool(((codes < -half) | (codes >= half)).any()):
        raise ValueError(f"{bits}-bit codes must lie in {-half}..{half - 1}")
    shifts, byte_shifts = _shifts(bits, codes.device)
    u = codes.to(torch.int64) & ((1 << bits) - 1)
    words = (u.unflatten(-1, (d // GROUP, GROUP)) << shifts).sum(-1)  # disjoint bit fields: sum = or
    out = (words.unsqueeze(-1) >> byte_shifts) & 255
    return out.to(torch.uint8).flatten(-2)


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``uint8 [..., d * bits / 8]`` -> codes ``int8 [..., d]``."""
    n = _checked_width(packed, "packed", torch.uint8, bits)
    if n % bits:
        raise ValueError(f"a packed row of {bits}-bit codes is a multiple of {bits} bytes, got {n}")
    shifts, byte_shifts = _shifts(bits, packed.device)
    words = (packed.to(torch.int64).unflatten(-1, (n // bits, bits)) << byte_shifts).sum(-1)
    u = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    half = 1 << (bits - 1)
    return ((u ^ half) - half).to(torch.int8).flatten(-2)  # sign-extend the N-bit field


def store_packed(rows: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, start: int, bits: int) -> None:
    """Quantize ``rows [n_kv, n, d]`` by the row rule at ``bits`` with an fp16 max_abs into
    ``data[:, start:start+n]`` (packed uint8) and ``scale[:, start:start+n]`` (float16), in place;
    rows must be finite. A row whose max_abs exceeds the fp16 range is refused (ValueError) before
    anything is stored. On the CPU one JIT pass (:func:`kvlens.kernels.q8store.store_packed_rows`,
    bit-identical: the same float32 operations in the same order), elsewhere the torch ops."""
    if rows.device.type == "cpu":
        x = rows.detach().to(torch.float32).contiguous().numpy()
        bad = store_packed_rows(x, data.numpy(), scale.view(torch.int16).numpy().view(np.uint16), start, bits)
        if bad >= 0:
            row = x.reshape(-1, x.shape[-1])[bad]
            raise fp16_overflow(float(abs(row).max()), "max_abs of a row")
        return
    q, max_abs = quantize_q8(rows, check=False, bits=bits, fp16_scale=True)
    data[:, start : start + rows.shape[1]] = pack_bits(q, bits)
    scale[:, start : start + rows.shape[1]] = max_abs


def dequantize_packed(
    packed: torch.Tensor, max_abs: torch.Tensor, bits: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Packed rows ``[..., d * bits / 8]`` and their fp16 max_abs ``[...]`` as values ``[..., d]``:
    ``code * (max_abs / qmax)`` in float32, as :func:`kvlens.kv.quant.dequantize_q8`."""
    return dequantize_q8(unpack_bits(packed, bits), max_abs, dtype, bits=bits)


__all__ = ["GROUP", "dequantize_packed", "pack_bits", "store_packed", "unpack_bits"]
