"""The compile notice's timer on a stand-in ``threading.Timer`` that the test fires by hand (no real
time passes): one timer per outermost compile, cancelled when that compile ends; a timer that fires
after its compile ended writes nothing; the line is written once."""

from __future__ import annotations

from test_compile_notice import _event, _Lines

from kvlens import cli_notice
from kvlens.cli_notice import CompileNotice

START, END = _event(cli_notice.numba_event.EventStatus.START), _event(cli_notice.numba_event.EventStatus.END)


class _Timer:
    made: list[_Timer] = []

    def __init__(self, delay: float, fire) -> None:
        self.delay, self.fire, self.started, self.cancelled = delay, fire, False, False
        _Timer.made.append(self)

    def start(self) -> None:
        self.started = True

    def cancel(self) -> None:
        self.cancelled = True


def _notice(monkeypatch, after_s: float = 2.0):
    _Timer.made = []
    monkeypatch.setattr(cli_notice.threading, "Timer", _Timer)
    lines = _Lines()
    return CompileNotice(lines, after_s), lines


def test_one_timer_per_outermost_compile(monkeypatch):
    notice, lines = _notice(monkeypatch, after_s=1.5)
    notice.on_start(START)
    notice.on_start(START)  # a kernel compiling a kernel it calls
    notice.on_end(END)
    assert len(_Timer.made) == 1 and _Timer.made[0].delay == 1.5 and _Timer.made[0].started
    assert not _Timer.made[0].cancelled
    notice.on_end(END)
    assert _Timer.made[0].cancelled and lines == []


def test_a_timer_firing_after_its_compile_writes_nothing(monkeypatch):
    notice, lines = _notice(monkeypatch)
    notice.on_start(START)
    notice.on_end(END)
    _Timer.made[0].fire()  # cancel() lost the race with the timer thread
    assert lines == [] and not notice.written.is_set()


def test_the_line_is_written_once(monkeypatch):
    notice, lines = _notice(monkeypatch)
    notice.on_start(START)
    _Timer.made[0].fire()
    _Timer.made[0].fire()
    notice.on_end(END)
    notice.on_start(START)  # a later compile starts no timer once the line is out
    assert len(lines) == 1 and len(_Timer.made) == 1


def test_announce_compiles_takes_its_delay(monkeypatch):
    registered = []
    monkeypatch.setattr(
        cli_notice.numba_event, "register", lambda kind, listener: registered.append(listener)
    )
    listener = cli_notice.announce_compiles(lambda line: None, after_s=0.25)
    assert registered == [listener] and listener._after_s == 0.25
    assert cli_notice.announce_compiles(lambda line: None)._after_s == cli_notice.AFTER_S
