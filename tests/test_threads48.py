"""``steady_others`` keeps its readings in the deque it is given, and in the process's own deque when
given none (the forty-eighth session's mutation run: a version that always used the process's deque
passed, since both started as [0, 0])."""

from __future__ import annotations

from collections import deque

from kvlens.kernels import threads


def test_steady_others_reads_the_deque_it_is_given(monkeypatch):
    process = deque([0, 0], maxlen=threads.RECENT_STEPS)
    monkeypatch.setattr(threads, "_recent_others", process)
    mine = deque([2, 2], maxlen=threads.RECENT_STEPS)
    assert threads.steady_others(0, mine) == 2  # the median of [2, 2, 0]
    assert list(mine) == [2, 2, 0] and list(process) == [0, 0]
    assert threads.steady_others(2) == 0  # the process's deque: the median of [0, 0, 2]
    assert list(process) == [0, 0, 2] and list(mine) == [2, 2, 0]


def test_own_running_counts_this_thread_and_not_the_sleeping_ones():
    """``_own_running`` counts the caller (running while it reads /proc) and none of three threads
    that sleep on an event: at most the process's threads less those three."""
    import os
    import threading
    import time

    def state(tid: int) -> str:
        with open(f"/proc/self/task/{tid}/stat", encoding="utf-8") as f:
            return f.read().rpartition(")")[2].split()[0]

    wake = threading.Event()
    sleepers = [threading.Thread(target=wake.wait) for _ in range(3)]
    for t in sleepers:
        t.start()
    try:
        # a thread just started may still be running on its way into wait(): wait until all three sleep
        deadline = time.monotonic() + 10
        while any(state(t.native_id) == "R" for t in sleepers) and time.monotonic() < deadline:
            time.sleep(0.01)
        total = len(os.listdir("/proc/self/task"))
        own = threads._own_running()
        assert 1 <= own <= total - 3
    finally:
        wake.set()
        for t in sleepers:
            t.join()


def test_read_loadavg_reads_the_machine_file():
    """The text :func:`others_running` parses (its parsing: test_steady, on given strings)."""
    with open("/proc/loadavg", encoding="utf-8") as f:
        fields = f.read().split()
    text = threads._read_loadavg().split()
    assert len(text) == len(fields) == 5 and threads._running(" ".join(text)) >= 1
