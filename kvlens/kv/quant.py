"""The seed's int8 KV rule: one fp32 ``max_abs`` per row, round half up, clamp to ±127.

For a row ``x`` of ``head_dim`` values (one token, one KV head, K or V separately)::

    max_abs = max |x|            (a row with max_abs < 1e-6 uses 1.0)
    q       = clamp(floor(x * (127 / max_abs) + 0.5), -127, 127)   as int8
    x'      = q * (max_abs / 127)

The arithmetic is done in float32 exactly as written (multiply by the reciprocal, not divide),
so results are bit-identical with the seed's C engine.
"""

from __future__ import annotations

import torch

from ..checks import check_tensor
from ..kernels.q8store import KSUM_BLOCK, NO_KSUM, first_nonfinite_index, store_q8_rows

Q8_MAX = 127.0
TINY_MAX_ABS = 1e-6


class NonFiniteError(ValueError):
    """K/V contained NaN or Inf; quantizing it would silently produce garbage codes."""


def check_finite(x: torch.Tensor, what: str = "input") -> None:
    """Raise :class:`NonFiniteError` if ``x`` holds NaN or Inf."""
    if not bool(torch.isfinite(x).all()):
        bad = (~torch.isfinite(x)).nonzero()[0].tolist()
        raise NonFiniteError(f"non-finite value in {what} at index {tuple(bad)}; refusing to quantize it")


def row_max_abs(x: torch.Tensor) -> torch.Tensor:
    """Per-row max |x| over the last dimension, with the seed's 1e-6 floor replaced by 1.0."""
    m = x.abs().amax(dim=-1)
    return torch.where(m < TINY_MAX_ABS, torch.ones_like(m), m)


def quantize_q8(x: torch.Tensor, *, check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize over the last dimension. Returns ``(q int8, max_abs float32)``; max_abs lacks the last dim."""
    x = check_tensor(x, "x", floating=True, min_dim=1).to(torch.float32)
    if check:
        check_finite(x)
    max_abs = row_max_abs(x)
    # float32 127/max_abs once per row, as the C engine does. Not ``Q8_MAX / max_abs``: torch computes a
    # scalar over a tensor as reciprocal(max_abs) * 127, which is an ulp off in ~1 row of 4 and then flips
    # a code now and then against the JIT store (kernels/q8store.py), which divides.
    inv = torch.full_like(max_abs, Q8_MAX).div_(max_abs)
    q = torch.floor(x * inv.unsqueeze(-1) + 0.5).clamp_(-Q8_MAX, Q8_MAX).to(torch.int8)
    return q, max_abs


def dequantize_q8(q: torch.Tensor, max_abs: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_q8`: ``q * (max_abs / 127)`` in float32."""
    check_tensor(q, "q", dtypes=(torch.int8,), min_dim=1)
    check_tensor(max_abs, "max_abs", floating=True, shape=q.shape[:-1])
    step = (max_abs.to(torch.float32) / Q8_MAX).unsqueeze(-1)
    return (q.to(torch.float32) * step).to(dtype)


def q8_step(max_abs: torch.Tensor) -> torch.Tensor:
    """The quantization step (distance between adjacent codes) of each row."""
    return max_abs.to(torch.float32) / Q8_MAX


def first_nonfinite(x: torch.Tensor) -> int | None:
    """Flat index of the first NaN/Inf in ``x``, or None (one pass; a JIT loop for CPU float32)."""
    if x.device.type == "cpu" and x.dtype == torch.float32:
        i = first_nonfinite_index(x.detach().contiguous().numpy())
        return None if i < 0 else int(i)
    bad = ~torch.isfinite(x)
    return int(bad.reshape(-1).nonzero()[0, 0]) if bool(bad.any()) else None


def block_sums(q: torch.Tensor) -> torch.Tensor:
    """Sum of int8 codes ``[..., d]`` per block of :data:`KSUM_BLOCK`: ``[..., d // 32]`` int16."""
    return q.to(torch.int32).unflatten(-1, (-1, KSUM_BLOCK)).sum(-1).to(torch.int16)


def store_q8(
    rows: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, start: int, ksum: torch.Tensor | None = None
) -> None:
    """Quantize ``rows [n_kv, n, d]`` by the rule above into ``data[:, start:start+n]`` (int8) and
    ``scale[:, start:start+n]`` (max_abs), in place; rows must be finite (the caller checks). With
    ``ksum [n_kv, cap, d // 32]`` (int16), also the codes' sum per 32-block (:func:`block_sums`)."""
    if rows.device.type == "cpu":
        ks = NO_KSUM if ksum is None else ksum.numpy()
        store_q8_rows(
            rows.detach().to(torch.float32).contiguous().numpy(), data.numpy(), scale.numpy(), start, ks
        )
        return
    q, max_abs = quantize_q8(rows, check=False)
    data[:, start : start + rows.shape[1]] = q
    scale[:, start : start + rows.shape[1]] = max_abs
    if ksum is not None:
        ksum[:, start : start + rows.shape[1]] = block_sums(q)
