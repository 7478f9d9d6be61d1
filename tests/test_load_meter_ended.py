"""The load meter counts the CPU of processes that start and end between its two readings (a test
run, a compile, a cron job): per-process readings never see them, the machine-wide busy time does.
This process's own time (and its reaped children's: a benchmark's helpers) is not "other"."""

from __future__ import annotations

import pytest

import kvlens.bench.spread as sp
from kvlens.bench.spread import GONE, Spread, spread_warning


def _meter(monkeypatch, before: dict, after: dict, busy: tuple[float, float], own: tuple[float, float]):
    clock, seconds, busy_s, own_s = iter([100.0, 104.0]), iter([before, after]), iter(busy), iter(own)
    monkeypatch.setattr(sp.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(sp, "_steal_seconds", lambda: 0.0)
    monkeypatch.setattr(sp, "_cpu_seconds", lambda: next(seconds))
    monkeypatch.setattr(sp, "_busy_seconds", lambda: next(busy_s))
    monkeypatch.setattr(sp, "_own_seconds", lambda: next(own_s))
    return sp.LoadMeter().read()


def test_a_process_gone_before_the_reading_still_counts(monkeypatch):
    # 4 s of wall: the machine was busy 7 CPU-seconds, 3 of them this process's: 1.0 CPU of others,
    # none of it in a process still there at the end
    load = _meter(monkeypatch, {}, {}, (1000.0, 1007.0), (50.0, 53.0))
    assert load.other_cpus == pytest.approx(1.0) and load.top == [(GONE, pytest.approx(1.0))]
    line = spread_warning("q8 tok/s", Spread(30.0, 40.0, 45.0), load)
    assert "likely cause: other load on the machine" in line and GONE in line


def test_the_named_processes_and_the_rest_are_listed_apart(monkeypatch):
    before, after = {7: ("cc1 7", 2.0)}, {7: ("cc1 7", 4.0)}  # 0.5 CPU still running at the end
    load = _meter(monkeypatch, before, after, (0.0, 8.0), (0.0, 4.0))  # 1.0 CPU of others in all
    assert load.other_cpus == pytest.approx(1.0)
    assert load.top == [("cc1 7", pytest.approx(0.5)), (GONE, pytest.approx(0.5))]


def test_own_time_and_a_small_rest_are_not_other_load(monkeypatch):
    load = _meter(monkeypatch, {}, {}, (0.0, 8.1), (0.0, 8.0))  # 0.025 CPU unaccounted: noise
    assert load.top == [] and load.other_cpus == pytest.approx(0.025)
    load = _meter(monkeypatch, {1: ("a 1", 0.0)}, {1: ("a 1", 2.0)}, (0.0, 1.0), (0.0, 1.0))
    assert load.other_cpus == pytest.approx(0.5) and load.top == [("a 1", 0.5)]  # per-process wins


def test_the_real_readings_see_time_pass():
    busy, own = sp._busy_seconds(), sp._own_seconds()
    sum(i * i for i in range(4_000_000))  # this process's own work
    assert sp._own_seconds() > own and sp._busy_seconds() >= busy


def test_own_time_holds_the_children_that_ended():
    """A benchmark's helper (llama-bench, a probe) is its own work, not other load: its CPU time, as
    the kernel reports it to this process once it is reaped, is in this process's own time."""
    import resource
    import subprocess
    import sys

    own, r0 = sp._own_seconds(), resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", "sum(i * i for i in range(10_000_000))"], check=True)
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    child = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    assert child > 0.1
    assert sp._own_seconds() - own >= child - 0.02  # psutil counts in 10 ms clock ticks
