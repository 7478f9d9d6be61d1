"""llama.cpp's symmetric block rule, shared by the int8 weights (:mod:`.qlinear`) and the lab's block
schemes (:mod:`kvlens.kv.schemes`): per group of values, ``d = absmax / qmax`` and
``q = roundf(x * (1/d))`` with C ``roundf`` (half away from zero), as ``quantize_row_q8_0_ref`` does
for Q8_0 (qmax 127); an all-zero group gets ``1/d = 0``, so all-zero codes."""

from __future__ import annotations

import torch


def roundf(y: torch.Tensor) -> torch.Tensor:
    """C ``roundf``: round half away from zero. (``floor(|y| + 0.5)`` is wrong for 0.49999997.)"""
    t = torch.trunc(y)
    return t + torch.where((y - t).abs() >= 0.5, torch.sign(y), torch.zeros_like(y))


def symmetric_blocks(xg: torch.Tensor, qmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (float, in [-qmax, qmax]) and scales ``d`` (f32) of groups ``xg [..., G]`` along the last
    dimension: ``codes * d[..., None]`` approximates ``xg``."""
    d = xg.abs().amax(dim=-1) / qmax
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))  # llama.cpp: id = d ? 1/d : 0
    return roundf(xg * inv.unsqueeze(-1)).clamp_(-qmax, qmax), d
