"""``cli.main`` registers its compile notice with numba once per process, however often it runs (a
program or a test may call it many times; each listener would write its own notice)."""

from __future__ import annotations

import pytest
from test_bad_input_cli import run_main

from kvlens import cli_notice


@pytest.fixture
def registered(monkeypatch):
    seen: list[tuple[str, object]] = []
    monkeypatch.setattr(
        cli_notice.numba_event, "register", lambda kind, listener: seen.append((kind, listener))
    )
    forget = getattr(cli_notice.announce_compiles_once, "cache_clear", lambda: None)
    forget()
    yield seen
    forget()  # the next main registers with numba itself again


def test_main_run_three_times_registers_one_listener(monkeypatch, capsys, registered):
    for _ in range(3):
        code, out, _ = run_main(monkeypatch, capsys, "--help")
        assert code == 0 and "bench" in out
    assert len(registered) == 1
    kind, listener = registered[0]
    assert kind == "numba:compile" and isinstance(listener, cli_notice.CompileNotice)
    assert listener._after_s == cli_notice.AFTER_S
