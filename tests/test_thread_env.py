"""``NUMBA_NUM_THREADS`` that numba cannot start with: named by kvlens before numba's import fails on
it (0: numba's own traceback, naming no variable; a non-number: ignored with a warning)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvlens.kernels.threads import ThreadSettingError, check_thread_env


def run(code: str, value: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "NUMBA_NUM_THREADS": value}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("value", ["0", "-1", "abc", ""])
def test_the_command_line_prints_one_error_line(value):
    done = run(
        "import sys; from kvlens.cli import main; sys.argv = ['kvlens', 'generate', 'hi']; main()", value
    )
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        f"error: NUMBA_NUM_THREADS={value!r}: numba needs a whole number of threads ≥ 1 (unset it for one per CPU)"
    ]


def test_the_python_api_gets_a_value_error():
    done = run("try:\n    import kvlens\nexcept ValueError as e:\n    print(type(e).__name__, e)", "0")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ThreadSettingError NUMBA_NUM_THREADS='0'")


def test_a_count_numba_takes_passes(monkeypatch):
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    before = sys.excepthook
    for value in ("1", "2", "64"):
        check_thread_env({"NUMBA_NUM_THREADS": value})
    check_thread_env({})
    assert sys.excepthook is before


def test_only_this_error_is_shortened(monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda *args: seen.append(args[0]))
    with pytest.raises(ThreadSettingError):
        check_thread_env({"NUMBA_NUM_THREADS": "0"})
    sys.excepthook(RuntimeError, RuntimeError("other"), None)  # any other error: the hook before
    assert seen == [RuntimeError]
    sys.excepthook(ThreadSettingError, ThreadSettingError("x"), None)
    assert capsys.readouterr().err == "error: x\n" and seen == [RuntimeError]
