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
