"""The order of the two probes in ``others_running``: our own threads are counted before the load is
read the second time. A worker that spins through the first read and the count, then falls asleep
before the second read, makes the others' count too low by one at most (never below zero); read
before the count, the same worker would pass for another process."""

from __future__ import annotations

from test_steady import _loadavg

from kvlens.kernels import threads


def test_own_threads_are_counted_before_the_second_read():
    calls: list[str] = []
    awake = {"workers": 1}  # the main thread runs throughout; one worker still spins

    def probe(kind: str) -> int:
        running = 1 + awake["workers"]
        calls.append(kind)
        if len(calls) == 2:
            awake["workers"] = 0  # the worker falls asleep after the second probe of either kind
        return running

    others = threads.others_running(lambda: _loadavg(probe("load")), lambda: probe("own"))
    assert calls == ["load", "own", "load"]
    assert others == 0
