"""Per-block key metadata and block selection for sparse decode.

Metadata (written with the cache): for every block of BLOCK positions and KV head, the
per-channel min and max of the keys as attention sees them (dequantized for int8 rows).

Selection, for one decode query of one layer:
    quest   block score = Σ_d max(q_d·min_d, q_d·max_d) — an upper bound of q·k for every key of
            the block (Quest); max over the query heads of a GQA group.
    probe   the seed engine's probe: max of q·k over 8 evenly spaced keys of the block.
The first (sink) block and the most recent block are always kept; the rest of the budget goes to the
top-scoring blocks (equal scores: the lower block index). The result is sorted block indices per KV
head, what the kernels take. These torch functions are the reference (and the CUDA path); on CPU
the engine selects with the compiled :mod:`kvlens.kernels.quest`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..checks import check_float, check_int

METHODS = ("quest", "probe")
PROBES = 8  # keys per block the probe looks at


class BlockBounds:
    """Per-channel key min/max per (KV head, block) for every layer."""

    def __init__(self, n_layers: int, n_kv: int, head_dim: int, block: int, device: torch.device) -> None:
        self.block = block
        self.kmin = [torch.zeros(n_kv, 0, head_dim, device=device) for _ in range(n_layers)]
        self.kmax = [torch.zeros(n_kv, 0, head_dim, device=device) for _ in range(n_layers)]

    def update(self, layer: int, keys: torch.Tensor, first: int, end: int) -> None:
        """Recompute the blocks holding positions [first, end); ``keys`` = K rows [n_kv, end-first, d]
        as attention reads them, ``first`` a multiple of the block size."""
        b0, b1 = first // self.block, -(-end // self.block)
        kmin, kmax = self.kmin[layer], self.kmax[layer]
        if b1 > kmin.shape[1]:  # grow geometrically: decode adds a block every BLOCK tokens
            pad = kmin.new_zeros(kmin.shape[0], max(b1, 2 * kmin.shape[1]) - kmin.shape[1], kmin.shape[2])
            kmin = self.kmin[layer] = torch.cat([kmin, pad], 1)
            kmax = self.kmax[layer] = torch.cat([kmax, pad.clone()], 1)
        for b in range(b0, b1):
            rows = keys[:, (b - b0) * self.block : min((b + 1) * self.block, end) - first]
            kmin[:, b] = rows.amin(dim=1)
            kmax[:, b] = rows.amax(dim=1)


@dataclass
class SparseConfig:
    """Sparse decode policy. ``budget``: tokens (≥ 1) or a fraction of the context (< 1)."""

    method: str = "quest"
    budget: float = 2048
    dense_layers: int = 2
    min_ctx: int = 1024

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown sparse method {self.method!r}; choose one of: {', '.join(METHODS)}")
        # tokens (≥ 1) or a fraction of the context (< 1); inf would overflow the block count
        self.budget = check_float(self.budget, "the sparse budget", above=0.0)
        self.dense_layers = check_int(self.dense_layers, "dense_layers", minimum=0)
        self.min_ctx = check_int(self.min_ctx, "min_ctx", minimum=0)

    def budget_blocks(self, length: int, block: int) -> int:
        tokens = self.budget * length if self.budget < 1 else self.budget
        return max(2, math.ceil(tokens / block))

    def applies(self, layer: int, length: int) -> bool:
        return layer >= self.dense_layers and length >= self.min_ctx


def quest_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Upper bound of q·k per (KV head, block): q [H, d], kmin/kmax [KV, nb, d] → [KV, nb]."""
    n_kv = kmin.shape[0]
    qg = q.view(n_kv, -1, q.shape[-1]).transpose(1, 2)  # [KV, d, G]
    # Σ_d max(q_d·min_d, q_d·max_d) = max·q⁺ + min·q⁻ (q⁺ = max(q, 0), q⁻ = min(q, 0))
    bound = torch.bmm(kmax, qg.clamp(min=0)) + torch.bmm(kmin, qg.clamp(max=0))
    return bound.amax(dim=-1)


def probe_positions(length: int, block: int) -> torch.Tensor:
    """PROBES evenly spaced positions per block (clamped into a partial last block)."""
    nb = -(-length // block)
    offsets = torch.arange(PROBES) * (block // PROBES)
    return (torch.arange(nb)[:, None] * block + offsets[None, :]).clamp(max=length - 1).flatten()


def probe_scores(q: torch.Tensor, probes: torch.Tensor) -> torch.Tensor:
    """Max of q·k over each block's probe keys: probes [KV, nb*PROBES, d] (rows at
    :func:`probe_positions`) → [KV, nb]."""
    n_kv, d = probes.shape[0], probes.shape[-1]
    nb = probes.shape[1] // PROBES
    qg = q.view(n_kv, -1, d).transpose(1, 2)
    return torch.bmm(probes, qg).amax(dim=-1).view(n_kv, nb, PROBES).amax(dim=-1)


def top_blocks(scores: torch.Tensor, n_select: int) -> torch.Tensor | None:
    """Sorted block indices [KV, n_select]: block 0, the last block, and the best of the rest —
    equal scores go to the lower block index, a NaN score counts as -inf (the rule the compiled
    selection, :mod:`kvlens.kernels.quest`, follows too).

    None when the budget covers every block (the caller then runs dense attention).
    """
    n_kv, nb = scores.shape
    if n_select >= nb:
        return None
    middle = scores[:, 1 : nb - 1]
    middle = torch.where(middle.isnan(), float("-inf"), middle)
    # a stable descending sort keeps equal scores in index order (topk's tie order is unspecified)
    best = torch.sort(middle, dim=1, descending=True, stable=True).indices[:, : n_select - 2] + 1
    ends = torch.tensor([0, nb - 1], device=scores.device).expand(n_kv, 2)
    return torch.sort(torch.cat([ends, best], dim=1), dim=1).values.to(torch.int32)
