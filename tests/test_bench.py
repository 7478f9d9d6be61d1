"""``kvlens bench attention`` at toy sizes: the rows are complete and sane (no timing assertions)."""

from __future__ import annotations

import math

import pytest

from kvlens.bench import attention as ba
from kvlens.bench import prefill_read
from kvlens.bench.bandwidth import MachineProbe, MiB
from kvlens.bench.spread import MachineSpread, Spread, spread

KEYS = {"shape", "ctx", "mode", "backend", "us_per_call", "gb_per_s", "frac_of_copy_bw"}


@pytest.fixture(scope="module")
def probe():
    return MachineProbe(n_bytes=MiB, reps=1, arith_iters=1000, sync_reps=10)


@pytest.fixture(scope="module")
def bench(probe):
    return ba.run_attention_bench(
        [64],
        ["smollm2", "8b"],
        ["f32", "f16", "q8"],
        reps=2,
        bw_bytes=2**20,
        min_round_s=0.0,
        llc=1,
        probe=probe,
    )


def test_rows_carry_the_machine_probe_of_their_own_rounds(bench, probe, capsys):
    """Each (shape, ctx)'s rows carry the spread of the probe's samples taken after its own rounds (2
    rounds each: samples 0-1 for the first shape, 2-3 for the second), shown under the table."""
    rows, bw = bench
    assert len(probe.reads) == 4
    for shape, first in (("smollm2", 0), ("8b", 2)):
        window = slice(first, first + 2)
        expected = MachineSpread(*(spread(s[window]) for s in (probe.reads, probe.ariths, probe.syncs)))
        assert {r.machine for r in rows if r.shape == shape} == {expected}
    ba.render(rows, bw)
    out = capsys.readouterr().out
    assert "machine between the rounds" in out and "8b ctx 64: memory read" in out


def test_rows(bench):
    rows, bw = bench
    assert bw["cpu"].copy_gb_per_s > 0 and bw["cpu"].read_gb_per_s > 0
    cells = {(r.shape, r.mode, r.backend) for r in rows}
    for shape in ("smollm2", "8b"):
        assert {(shape, m, "numba") for m in ("f32", "f16", "q8")} <= cells
        assert {
            (shape, "f32", "torch-sdpa"),
            (shape, "q8", "dequant-sdpa"),
            (shape, "q8", "numba-intdot"),
        } <= cells
        assert (shape, "f32", "dequant-sdpa") not in cells and (shape, "f16", "numba-intdot") not in cells
    for r in rows:
        d = r.as_dict()
        assert KEYS <= d.keys()
        assert d["ctx"] == 64 and d["n_layers"] >= 1 and d["threads"] >= 1
        assert math.isfinite(d["us_per_call"]) and 0 < d["us_per_call"] <= d["us_median"] <= d["us_max"]
        assert d["spread"] == pytest.approx(d["us_max"] / d["us_per_call"] - 1)
        assert d["gb_per_s"] > 0 and d["frac_of_copy_bw"] > 0
        assert d["x_vs_sdpa_f32"] > 0 and d["x_vs_dequant_sdpa"] > 0
        n_heads, n_kv, hd = ba.SHAPES[r.shape]
        per_row = {"f32": 2 * 4 * hd, "f16": 2 * 2 * hd, "q8": 2 * (hd + 4)}[r.mode]
        assert d["bytes_read"] == n_kv * 64 * per_row
    sdpa = next(r for r in rows if r.backend == "torch-sdpa")
    assert sdpa.x_vs_sdpa_f32 == pytest.approx(1.0)


def test_plan_layers():
    llc = 32 * 2**20
    plan = ba.plan_layers(["f32", "q8"], 8, 1024, 128, llc, mem_gib=3)
    assert plan["f32"] * ba.layer_bytes("f32", 8, 1024, 128) >= 4 * llc  # working set beyond the LLC
    assert plan["q8"] > plan["f32"]
    big = ba.plan_layers(["f32", "f16", "q8"], 8, 65536, 128, llc, mem_gib=3)
    assert big == {"f32": 1, "f16": 1, "q8": 1}  # one 64K layer is already 512 MiB
    assert ba.llc_bytes() > 0


def test_bad_input():
    with pytest.raises(ValueError, match="unknown shape"):
        ba.run_attention_bench([64], ["70b"], ["q8"])
    with pytest.raises(ValueError, match="unknown backend"):
        ba.run_attention_bench([64], ["smollm2"], ["q8"], ["cuda-magic"])
    with pytest.raises(ValueError, match="q8\\+mirror"):
        ba.run_attention_bench([64], ["smollm2"], ["q8+mirror"])


def test_prefill_read():
    res = prefill_read.time_prefill_read("smollm2", history=64, chunk=8, reps=1)
    assert set(res) == {"f32", "f16", "q8"} and all(r > 0 and s > 0 for r, s in res.values())


def test_gemma3_shape_times_4bit_k_with_the_8bit_query_kernel():
    rows, _ = ba.run_attention_bench(
        [64], ["gemma3"], ["q8", "q4h"], ["numba", "numba-int", "numba-int16"], reps=1, bw_bytes=2**20,
        min_round_s=0.0, llc=1,
    )  # fmt: skip
    cells = {(r.mode, r.backend) for r in rows}
    # the 16-bit query scores int8 K only; the 8-bit one int8 or 4-bit K
    assert cells == {
        ("q8", "numba"),
        ("q8", "numba-int"),
        ("q8", "numba-int16"),
        ("q4h", "numba"),
        ("q4h", "numba-int"),
    }
    # one KV head, 64 rows of K and V: q8 codes + f32 max_abs (as test_rows), q4h code pairs + an fp16
    # scale per 32 values
    hd = 256
    per_row = {"q8": 2 * (hd + 4), "q4h": 2 * (hd // 2 + 2 * hd // 32)}
    assert {r.mode: r.bytes_read for r in rows} == {m: 64 * b for m, b in per_row.items()}


def test_llc_size_is_read_in_binary_units(tmp_path):
    from kvlens.bench.bandwidth import DEFAULT_LLC, llc_bytes

    f = tmp_path / "size"
    for text, want in (("32768K\n", 32 * MiB), ("480M", 480 * MiB), ("1G", 2**30), ("512", 512)):
        f.write_text(text)
        assert llc_bytes(f) == want, text
    f.write_text("lots")
    assert llc_bytes(f) == DEFAULT_LLC
    assert llc_bytes(tmp_path / "missing") == DEFAULT_LLC


def test_bandwidth_figures_are_bytes_over_seconds(monkeypatch):
    """On a clock where every timed call takes exactly one second: copy moves 2 x the buffer (read
    and write), read moves it once; the probe's read is its buffer's bytes, its arithmetic rate the
    threads' multiply-adds, its fork/join the mean over its regions."""
    import numba

    from kvlens.bench import bandwidth
    from kvlens.kernels.probes import ARITH_CHAINS

    ticks = iter(range(10**6))
    monkeypatch.setattr(bandwidth.time, "perf_counter", lambda: float(next(ticks)))
    bw = bandwidth.measure_bandwidth(n_bytes=MiB, reps=2)
    assert (bw.copy_gb_per_s, bw.read_gb_per_s) == (2 * MiB / 1e9, MiB / 1e9)
    p = bandwidth.MachineProbe(n_bytes=MiB, reps=2, arith_iters=1000, sync_reps=10)
    read, arith, sync = p.sample()
    n = numba.get_num_threads()
    assert (read, arith, sync) == (MiB / 1e9, n * 1000 * ARITH_CHAINS / 1e9, 1e6 / 10)


def test_the_probe_reads_each_working_set_it_is_given(monkeypatch):
    """Sized reads: each size read once a sample over exactly that many bytes (the buffer grows to
    hold the largest, the main read keeps its size), kept with the sample's index; a run's spread takes
    the reads of its own size from its own samples."""
    from kvlens.bench import bandwidth

    ticks = iter(range(10**6))
    monkeypatch.setattr(bandwidth.time, "perf_counter", lambda: float(next(ticks)))
    p = bandwidth.MachineProbe(n_bytes=MiB, reps=2, arith_iters=1000, sync_reps=10)
    read_sizes = []
    real_sum = bandwidth.parallel_sum
    monkeypatch.setattr(bandwidth, "parallel_sum", lambda a, n: read_sizes.append(a.nbytes) or real_sum(a, n))
    p.sample()
    p.sample([2 * MiB, MiB // 2, 2 * MiB])
    p.sample([MiB // 2])
    assert read_sizes == [MiB] * 2 + [MiB] * 2 + [MiB // 2] * 2 + [2 * MiB] * 2 + [MiB] * 2 + [MiB // 2] * 2
    assert p.nbytes == 2 * MiB and p.reads == [MiB / 1e9] * 3
    assert p.sized == {2 * MiB: [(1, 2 * MiB / 1e9)], MiB // 2: [(1, MiB / 2e9), (2, MiB / 2e9)]}
    assert p.spread(0, MiB // 2).own_read == Spread(MiB / 2e9, MiB / 2e9, MiB / 2e9)
    assert p.spread(2, 2 * MiB).own_read is None and p.spread(2, 2 * MiB).own_bytes == 0
    assert p.spread(1, 2 * MiB).own_bytes == 2 * MiB and p.spread(0).own_read is None
    with pytest.raises(ValueError, match="at least 4 bytes"):
        p.sample([2])
