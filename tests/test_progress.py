"""Progress where stderr is not a terminal (a pipe, a log file): a rich live bar shows nothing there,
so a long run writes a plain line now and then, and a short one stays silent."""

from __future__ import annotations

import io

import kvlens.report.output as output
from kvlens.report.output import plain_progress, progress


def _run(times: list[float], total: int, interval: float = 30.0) -> list[str]:
    """Steps at the clock readings ``times[1:]`` (``times[0]``: the start); the lines written."""
    clock, out = iter(times), io.StringIO()
    step = plain_progress(total, "lab ppl", interval, clock=lambda: next(clock), out=out)
    for i in range(len(times) - 1):
        step(f"q{i}")
    return out.getvalue().splitlines()


def test_a_line_once_the_interval_has_passed_and_at_the_end():
    assert _run([100.0, 110.0, 135.0, 150.0, 170.0, 171.0], total=5) == [
        "lab ppl q1: 2/5 after 35 s",
        "lab ppl q3: 4/5 after 70 s",
        "lab ppl q4: 5/5 after 71 s",
    ]


def test_a_short_run_stays_silent():
    assert _run([0.0, 1.0, 2.0, 29.9], total=3) == []


def test_progress_on_a_stream_that_is_not_a_terminal(monkeypatch, capsys):
    monkeypatch.setattr(output, "PLAIN_PROGRESS_SECONDS", 0.0)  # every step writes its line
    with progress(2, "bench decode") as step:
        step("f16")
        step("")
    err = capsys.readouterr().err.splitlines()
    assert [line.rsplit(" after ", 1)[0] for line in err] == ["bench decode f16: 1/2", "bench decode: 2/2"]
    with progress(2, "off", enabled=False) as step:
        step("x")
    assert capsys.readouterr().err == ""
