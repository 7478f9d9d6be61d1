"""``kvlens bench attention --sparse``'s bookkeeping: what a variant's time holds (the selection and
the kernel), the warm-up left out, the median, the speed-up over dense and the selection's share,
which budgets get a variant, and the torch reference selection over a partial last block.
Stand-ins: a scripted clock and kernel; the cache and the selection are the real ones."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvlens.bench import sparse
from kvlens.bench.sparse import SparseRow
from kvlens.kv.blocks import SparseConfig
from kvlens.kv.cache import BLOCK


def _clock(monkeypatch, durations: list[tuple[float, float]]) -> None:
    """Each timed call reads the clock three times (start, selection done, kernel done): ``durations``
    holds (selection, kernel) seconds per call in call order."""
    ticks, now = [], 0.0
    for sel, kern in durations:
        ticks += [now, now + sel, now + sel + kern]
        now += sel + kern + 1.0
    it = iter(ticks)
    monkeypatch.setattr(sparse, "time", SimpleNamespace(perf_counter=lambda: next(it)))


def test_a_variant_times_its_selection_and_kernel_over_the_counted_rounds(monkeypatch):
    kernel_saw = []
    variants = {"dense q8": (None, 64), "quest 32": (lambda q, cache, ctx: "picked", 32)}
    # round 0 (warm-up) is slow; then dense 5, 1, 3 s; quest (selection, kernel) (1, 2), (2, 2), (3, 2)
    calls = [
        (0.0, 100.0),
        (50.0, 50.0),
        (0.0, 5.0),
        (1.0, 2.0),
        (0.0, 1.0),
        (2.0, 2.0),
        (0.0, 3.0),
        (3.0, 2.0),
    ]
    _clock(monkeypatch, calls)

    def kernel(q, k, v, ctx, blocks=None):
        kernel_saw.append(blocks)

    cache = SimpleNamespace(k=["K0"], v=["V0"])
    med = sparse._time_variants(variants, kernel, "q", cache, 64, reps=3)
    assert med == {"dense q8": (3.0, 0.0), "quest 32": (4.0, 2.0)}
    assert kernel_saw == [None, "picked"] * 4


def test_rows_give_microseconds_and_the_speed_up_over_dense(monkeypatch):
    def medians(
        variants, kernel, q, cache, ctx, reps
    ):  # dense 300 µs; each sparse 100 µs, 25 of them selecting
        return {n: (3e-4, 0.0) if n == "dense q8" else (1e-4, 2.5e-5) for n in variants}

    monkeypatch.setattr(sparse, "_time_variants", medians)
    rows = sparse.run_sparse_bench([1024], ["smollm2"], [256], ["quest"], reps=1)
    got = {r.variant: (r.budget, r.us_per_call, r.select_us, r.speedup_vs_dense) for r in rows}
    assert got == {
        "dense q8": (1024, pytest.approx(300.0), 0.0, pytest.approx(1.0)),
        "quest 256": (256, pytest.approx(100.0), pytest.approx(25.0), pytest.approx(3.0)),
        "quest 256 torch sel": (256, pytest.approx(100.0), pytest.approx(25.0), pytest.approx(3.0)),
    }
    assert next(r for r in rows if r.variant == "quest 256").select_share == pytest.approx(0.25)


def test_a_budget_that_covers_the_context_gets_no_variant():
    names = set(sparse._variants(["quest", "probe"], [256, 1024, 2048], 1024))
    assert names == {"dense q8", "quest 256", "quest 256 torch sel", "probe 256"}


def test_the_torch_selection_keeps_the_partial_last_block():
    ctx = 6 * BLOCK + 5  # 7 blocks, the last one partial: it holds the current position
    cache = sparse._cache("smollm2", ctx)
    q = torch.randn(9, 64, generator=torch.Generator().manual_seed(1))
    cfg = SparseConfig("quest", 3 * BLOCK, dense_layers=0, min_ctx=0)
    picked = sparse._torch_quest_select(cfg, q, cache, ctx)
    assert picked.shape == (3, 3) and bool((picked[:, 0] == 0).all()) and bool((picked[:, -1] == 6).all())


def test_select_share_is_of_the_whole_call():
    assert SparseRow("smollm2", 4096, "numba", "quest 1024", 1024, 200.0, 50.0, 2.0).select_share == 0.25
