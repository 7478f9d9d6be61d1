"""``bench attention``'s bookkeeping, on hand-made inputs and a stand-in clock (no timing is asserted):
the bytes a mixed-kind layer reads, how many layer copies fit the memory cap, that the copies are
distinct memory, time per *call*, and each row's figures from its rounds and the bandwidths."""

from __future__ import annotations

import statistics
from types import SimpleNamespace

import pytest
import torch

from kvlens.bench import attention as ba
from kvlens.bench.bandwidth import Bandwidth

CPU = torch.device("cpu")


def test_layer_bytes_of_mixed_kinds():
    n_kv, ctx, hd = 3, 100, 64
    q8_row, f32_row = hd + 4, 4 * hd  # int8 codes + an f32 scale; f32 values
    assert ba.layer_bytes("q8-k", n_kv, ctx, hd) == n_kv * ctx * (q8_row + f32_row)
    assert ba.layer_bytes("q8-v", n_kv, ctx, hd) == n_kv * ctx * (f32_row + q8_row)


def test_plan_layers_under_the_memory_cap():
    llc, args = 32 * 2**20, (8, 1024, 128)
    free = ba.plan_layers(["f32", "q8"], *args, llc, mem_gib=64)
    capped = ba.plan_layers(["f32", "q8"], *args, llc, mem_gib=0.125)
    assert sum(capped[m] * ba.layer_bytes(m, *args) for m in capped) <= 0.125 * 2**30
    assert all(1 <= capped[m] < free[m] for m in free)
    assert ba.plan_layers(["f32", "q8"], *args, llc, mem_gib=1e-6) == {"f32": 1, "q8": 1}  # never below one


def test_layer_copies_are_distinct_memory_with_equal_rows():
    layers = ba.build_layers("q8", 3, 2, 40, 32, CPU)
    for part in ("data", "scale"):
        tensors = [getattr(store, part) for pair in layers for store in pair]
        assert len({t.data_ptr() for t in tensors}) == len(tensors) == 6
        for i in (1, 2):
            assert torch.equal(getattr(layers[i][0], part), getattr(layers[0][0], part))


def test_time_cells_gives_seconds_per_call(monkeypatch):
    clock = {"now": 0.0}
    monkeypatch.setattr(ba, "time", SimpleNamespace(perf_counter=lambda: clock["now"]))

    def call(i):
        clock["now"] += 0.001 * (i + 1)  # layer i takes (i + 1) ms on the stand-in clock

    times = ba.time_cells({"cell": call}, {"cell": 4}, reps=3, device_of={"cell": CPU}, min_round_s=0.0)
    assert times["cell"] == pytest.approx([0.0025] * 3)  # (1 + 2 + 3 + 4) ms over 4 calls


def test_row_figures_from_the_rounds_and_bandwidths():
    times = {("f32", "numba"): [2e-6, 1e-6, 4e-6], ("f32", "torch-sdpa"): [3e-6, 5e-6]}
    timed = ba._Timed(times, {k: 1 for k in times}, {k: CPU for k in times})
    bw = {"cpu": Bandwidth(copy_gb_per_s=10.0, read_gb_per_s=20.0, device="cpu")}
    rows = ba._rows("smollm2", 64, ["f32"], timed, bw, threads=2)
    row = next(r for r in rows if r.backend == "numba")
    nbytes = ba.layer_bytes("f32", 3, 64, 64)
    assert row.bytes_read == nbytes
    assert (row.us_per_call, row.us_median, row.us_max) == pytest.approx((1.0, 2.0, 4.0))
    assert row.gb_per_s == pytest.approx(nbytes / 1e-6 / 1e9)
    assert row.frac_of_copy_bw == pytest.approx(row.gb_per_s / 10.0)
    assert row.frac_of_read_bw == pytest.approx(row.gb_per_s / 20.0)
    assert row.x_vs_sdpa_f32 == pytest.approx(3.0) and row.x_vs_dequant_sdpa == pytest.approx(3.0)
    assert statistics.median(times["f32", "numba"]) * 1e6 == pytest.approx(row.us_median)


def test_the_f32_sdpa_baseline_is_timed_when_f32_is_not_listed():
    rows, _ = ba.run_attention_bench(
        [64], ["smollm2"], ["q8"], ["numba", "torch-sdpa"], reps=1, bw_bytes=2**20, min_round_s=0.0, llc=1
    )
    assert {(r.mode, r.backend) for r in rows} == {("q8", "numba")}  # f32 is timed, not shown
    assert rows[0].x_vs_sdpa_f32 is not None and rows[0].x_vs_sdpa_f32 > 0
