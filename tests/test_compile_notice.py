"""The CLI's one-line notice while numba compiles (kvlens/cli_notice.py)."""

from __future__ import annotations

import time

import numba
import numba.core.event as numba_event
import pytest

from kvlens import cli, cli_args
from kvlens import cli_notice as compile_notice
from kvlens.cli_notice import CompileNotice


class _Lines(list):
    def __call__(self, line: str) -> None:
        self.append(line)


def _event(status: numba_event.EventStatus) -> numba_event.Event:
    return numba_event.Event("numba:compile", status)


def test_a_compile_still_running_after_the_delay_gets_one_line():
    lines = _Lines()
    notice = CompileNotice(lines, after_s=0.05)
    notice.on_start(_event(numba_event.EventStatus.START))
    assert notice.written.wait(5.0)
    notice.on_end(_event(numba_event.EventStatus.END))
    for _ in range(2):  # later long compiles: no second line
        notice.on_start(_event(numba_event.EventStatus.START))
        time.sleep(0.15)
        notice.on_end(_event(numba_event.EventStatus.END))
    assert len(lines) == 1 and lines[0].startswith("kvlens: compiling kernels for this CPU")


def test_compiles_that_end_within_the_delay_stay_silent():
    lines = _Lines()
    notice = CompileNotice(lines, after_s=0.3)
    for _ in range(3):
        notice.on_start(_event(numba_event.EventStatus.START))
        notice.on_end(_event(numba_event.EventStatus.END))
    assert not notice.written.wait(0.6) and lines == []


def test_an_inner_compile_ending_does_not_silence_the_outer_one():
    lines = _Lines()
    notice = CompileNotice(lines, after_s=0.2)
    notice.on_start(_event(numba_event.EventStatus.START))  # a kernel ...
    notice.on_start(_event(numba_event.EventStatus.START))  # ... compiling a kernel it calls
    notice.on_end(_event(numba_event.EventStatus.END))
    assert notice.written.wait(5.0) and len(lines) == 1
    notice.on_end(_event(numba_event.EventStatus.END))


class _HoldingNotice(CompileNotice):
    """Holds the first compile until the notice is out, so the test does not race the timer
    against however fast this machine compiles; counts the compiles numba reports."""

    def __init__(self, write, after_s: float) -> None:
        super().__init__(write, after_s)
        self.starts = 0

    def on_start(self, event: numba_event.Event) -> None:
        super().on_start(event)
        self.starts += 1
        if self.starts == 1:
            self.written.wait(5.0)


def test_numba_reports_a_real_compile_and_not_a_compiled_call():
    @numba.njit(cache=False)
    def fresh(n):  # defined here, so never in any cache
        total = 0.0
        for i in range(n):
            total += (i % 7) * 0.5
        return total

    lines = _Lines()
    notice = _HoldingNotice(lines, after_s=0.0)
    numba_event.register("numba:compile", notice)
    try:
        fresh(10)
        assert notice.starts >= 1 and notice.written.is_set() and len(lines) == 1
        starts = notice.starts
        fresh(11)  # the same signature: already compiled, no event
        assert notice.starts == starts and len(lines) == 1
    finally:
        numba_event.unregister("numba:compile", notice)


def test_the_cli_entry_point_writes_the_notice_to_stderr(monkeypatch, capsys, tmp_path):
    registered = []
    monkeypatch.setattr(compile_notice, "AFTER_S", 0.0)
    real_register = numba_event.register

    def register(kind: str, listener: numba_event.Listener) -> None:
        if isinstance(listener, CompileNotice):  # numba registers its own timers through here too
            registered.append(listener)
        real_register(kind, listener)

    monkeypatch.setattr(numba_event, "register", register)
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))

    def a_command_that_compiles(app) -> None:
        # a compile as numba reports it, lasting until the notice is out (no race with the timer)
        with numba_event.trigger_event("numba:compile"):
            assert registered[0].written.wait(5.0)

    monkeypatch.setattr(cli_args, "run_guarded", a_command_that_compiles)
    compile_notice.announce_compiles_once.cache_clear()  # an earlier main in this worker registered one
    try:
        cli.main()
    finally:
        for listener in registered:
            numba_event.unregister("numba:compile", listener)
        compile_notice.announce_compiles_once.cache_clear()  # the next main registers a live one again
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == compile_notice.notice_text(str(tmp_path)) + "\n"


@pytest.mark.parametrize("cache", [None, "/some/where"])
def test_the_notice_names_the_cache_folder_when_there_is_one(cache):
    text = compile_notice.notice_text(cache)
    assert ("/some/where" in text) == (cache is not None) and "\n" not in text
