"""``kvlens bench attention --sparse``: dense q8 decode attention vs sparse q8, side by side.

One layer's q8 cache (with block bounds) per context; each call is one decode query. The sparse
time includes the block selection (scores + top-k), not only the kernel: that is what a decode step
pays. Variants are interleaved and repeated; the median of each is reported.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..engine.attention import select_blocks
from ..kernels.cpu import decode_attention
from ..kv.blocks import SparseConfig
from ..kv.cache import KVCache
from ..kv.modes import MODES, CacheOptions

SHAPES = {"smollm2": (9, 3, 64), "8b": (32, 8, 128)}


@dataclass
class SparseRow:
    shape: str
    ctx: int
    variant: str
    budget: int
    us_per_call: float
    speedup_vs_dense: float


def _cache(shape: str, ctx: int, seed: int = 0) -> KVCache:
    _, n_kv, d = SHAPES[shape]
    g = torch.Generator().manual_seed(seed)
    cache = KVCache(1, n_kv, d, ctx, MODES["q8"], options=CacheOptions(track_blocks=True))
    for s in range(0, ctx, 4096):  # write in slices: bounded temporary memory
        n = min(4096, ctx - s)
        cache.write(0, s, torch.randn(n_kv, n, d, generator=g), torch.randn(n_kv, n, d, generator=g))
    return cache


def _sparse_call(q: torch.Tensor, cache: KVCache, ctx: int, cfg: SparseConfig | None) -> None:
    """One decode attention call: block selection (if sparse) plus the kernel."""
    blocks = None if cfg is None else select_blocks(q, cache, 0, ctx, cfg)
    decode_attention(q, cache.k[0], cache.v[0], ctx, blocks=blocks)


def run_sparse_bench(
    contexts: list[int], shapes: list[str], budgets: list[int], methods: list[str], reps: int = 20
) -> list[SparseRow]:
    rows: list[SparseRow] = []
    for shape in shapes:
        if shape not in SHAPES:
            raise ValueError(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
        n_heads, _, d = SHAPES[shape]
        for ctx in contexts:
            cache = _cache(shape, ctx)
            q = torch.randn(n_heads, d)
            variants: dict[str, tuple[SparseConfig | None, int]] = {"dense q8": (None, ctx)}
            for m in methods:
                for b in budgets:
                    if b < ctx:
                        variants[f"{m} {b}"] = (SparseConfig(m, b, dense_layers=0, min_ctx=0), b)

            times: dict[str, list[float]] = {name: [] for name in variants}
            for cfg, _ in variants.values():
                _sparse_call(q, cache, ctx, cfg)  # warm-up (numba compile, caches)
            for _ in range(reps):
                for name, (cfg, _) in variants.items():
                    t0 = time.perf_counter()
                    _sparse_call(q, cache, ctx, cfg)
                    times[name].append(time.perf_counter() - t0)
            med = {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}
            for name, (_, budget) in variants.items():
                rows.append(SparseRow(shape, ctx, name, budget, 1e6 * med[name], med["dense q8"] / med[name]))
    return rows


def render(rows: list) -> None:
    """The rows as a rich table: µs per call and the speed-up over dense q8."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title="decode attention, one layer, q8 cache: dense vs sparse (selection + kernel), median µs")
    for col in ("shape", "ctx", "variant", "budget", "µs/call", "× dense"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(
            r.shape, str(r.ctx), r.variant, str(r.budget), f"{r.us_per_call:.0f}", f"{r.speedup_vs_dense:.2f}"
        )
    Console().print(t)


def run(cfg) -> list[SparseRow]:
    """``bench attention --sparse``: :class:`~kvlens.bench.attention.AttentionBenchConfig`'s contexts,
    shapes, methods and budgets (at least 5 rounds)."""
    return run_sparse_bench(cfg.ctx, cfg.shape, cfg.sparse_budget, cfg.sparse, reps=max(cfg.reps, 5))
