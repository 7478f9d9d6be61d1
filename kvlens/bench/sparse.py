"""``kvlens bench attention --sparse``: dense q8 decode attention vs sparse q8, side by side.

One layer's q8 cache (with block bounds) per context; each call is one decode query. The sparse
time includes the block selection, not only the kernel: that is what a decode step pays; the
selection's own time is reported beside it. quest runs twice: with the compiled selection the
engine uses on CPU (:mod:`kvlens.kernels.quest`) and with the torch reference selection
(``torch sel``, :mod:`kvlens.kv.blocks`), so the two are compared in one run. Every variant runs
through the same fused kernel (``--backend``: numba, or an integer ``numba-int*``). Variants are
interleaved and repeated; the median of each is reported.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..engine.attention import decode_kernel, select_blocks
from ..kv.blocks import SparseConfig, quest_scores, top_blocks
from ..kv.cache import BLOCK, KVCache
from ..kv.modes import MODES, CacheOptions

SHAPES = {"smollm2": (9, 3, 64), "8b": (32, 8, 128)}
COLUMNS = ("shape", "ctx", "backend", "variant", "budget", "µs/call", "select µs", "select %", "× dense")
Select = Callable[[torch.Tensor, KVCache, int], torch.Tensor | None]


@dataclass
class SparseRow:
    shape: str
    ctx: int
    backend: str
    variant: str
    budget: int
    us_per_call: float
    select_us: float  # median of the selection alone (0 for dense)
    speedup_vs_dense: float

    @property
    def select_share(self) -> float:
        return self.select_us / self.us_per_call


def _cache(shape: str, ctx: int, seed: int = 0) -> KVCache:
    _, n_kv, d = SHAPES[shape]
    g = torch.Generator().manual_seed(seed)
    cache = KVCache(1, n_kv, d, ctx, MODES["q8"], options=CacheOptions(track_blocks=True))
    for s in range(0, ctx, 4096):  # write in slices: bounded temporary memory
        n = min(4096, ctx - s)
        cache.write(0, s, torch.randn(n_kv, n, d, generator=g), torch.randn(n_kv, n, d, generator=g))
    return cache


def _engine_select(cfg: SparseConfig, q: torch.Tensor, cache: KVCache, ctx: int) -> torch.Tensor | None:
    return select_blocks(q, cache, 0, ctx, cfg)


def _torch_quest_select(cfg: SparseConfig, q: torch.Tensor, cache: KVCache, ctx: int) -> torch.Tensor | None:
    nb = -(-ctx // BLOCK)
    scores = quest_scores(q, cache.bounds.kmin[0][:, :nb], cache.bounds.kmax[0][:, :nb])
    return top_blocks(scores, cfg.budget_blocks(ctx, BLOCK))


def _variants(methods: list[str], budgets: list[int], ctx: int) -> dict[str, tuple[Select | None, int]]:
    """Name -> (selection, budget in tokens); the dense variant has no selection."""
    variants: dict[str, tuple[Select | None, int]] = {"dense q8": (None, ctx)}
    for m in methods:
        for b in budgets:
            if b < ctx:
                cfg = SparseConfig(m, b, dense_layers=0, min_ctx=0)
                variants[f"{m} {b}"] = (functools.partial(_engine_select, cfg), b)
                if m == "quest":
                    variants[f"quest {b} torch sel"] = (functools.partial(_torch_quest_select, cfg), b)
    return variants


def _time_variants(variants, kernel, q: torch.Tensor, cache: KVCache, ctx: int, reps: int):
    """Median (call, selection) seconds per variant, the variants interleaved round by round."""
    total: dict[str, list[float]] = {name: [] for name in variants}
    select: dict[str, list[float]] = {name: [] for name in variants}
    for rnd in range(reps + 1):  # round 0 warms up (numba compile, caches)
        for name, (sel, _) in variants.items():
            t0 = time.perf_counter()
            blocks = None if sel is None else sel(q, cache, ctx)
            t1 = time.perf_counter()
            kernel(q, cache.k[0], cache.v[0], ctx, blocks=blocks)
            t2 = time.perf_counter()
            if rnd:
                total[name].append(t2 - t0)
                select[name].append(t1 - t0)

    def median(ts: list[float]) -> float:
        return sorted(ts)[len(ts) // 2]

    return {name: (median(total[name]), median(select[name])) for name in variants}


def run_sparse_bench(
    contexts: list[int],
    shapes: list[str],
    budgets: list[int],
    methods: list[str],
    reps: int = 20,
    backends: list[str] | None = None,
) -> list[SparseRow]:
    rows: list[SparseRow] = []
    for shape in shapes:
        if shape not in SHAPES:
            raise ValueError(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
    kernels = {b: decode_kernel(b) for b in backends or ["numba"]}  # BackendError for one not here
    for shape in shapes:
        n_heads, _, d = SHAPES[shape]
        for ctx in contexts:
            cache = _cache(shape, ctx)
            q = torch.randn(n_heads, d, generator=torch.Generator().manual_seed(ctx))
            variants = _variants(methods, budgets, ctx)
            for backend, kernel in kernels.items():
                med = _time_variants(variants, kernel, q, cache, ctx, reps)
                dense = med["dense q8"][0]
                for name, (_, budget) in variants.items():
                    t, t_sel = med[name]
                    rows.append(SparseRow(shape, ctx, backend, name, budget, 1e6 * t, 1e6 * t_sel, dense / t))
    return rows


def render(rows: list) -> None:
    """The rows as a rich table: µs per call, the selection's µs and share, the speed-up over dense."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title="decode attention, one layer, q8 cache: dense vs sparse (selection + kernel), median µs")
    for col in COLUMNS:
        t.add_column(col, justify="right")
    for r in rows:
        sel = (f"{r.select_us:.0f}", f"{100 * r.select_share:.0f}") if r.select_us else ("", "")
        t.add_row(
            r.shape, str(r.ctx), r.backend, r.variant, str(r.budget), f"{r.us_per_call:.0f}", *sel,
            f"{r.speedup_vs_dense:.2f}",
        )  # fmt: skip
    Console(width=max(Console().width, 130)).print(t)


def run(cfg) -> list[SparseRow]:
    """``bench attention --sparse``: :class:`~kvlens.bench.attention.AttentionBenchConfig`'s contexts,
    shapes, methods, budgets and backends (default numba; at least 5 rounds)."""
    return run_sparse_bench(
        cfg.ctx, cfg.shape, cfg.sparse_budget, cfg.sparse, reps=max(cfg.reps, 5), backends=cfg.backend
    )
