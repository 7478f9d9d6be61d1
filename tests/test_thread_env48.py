"""``NUMBA_NUM_THREADS`` is refused exactly where numba cannot start with it: the reference is numba's
own import in a child process (a value it cannot parse: a RuntimeWarning and its default count; 0 or
less: an error). Before, "²" (a digit to ``str.isdigit``, not to ``int``) ended in a traceback, and
"3_0", which numba reads as 30, was refused."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvlens.kernels.threads import ThreadSettingError, check_thread_env

NUMBA_READS = """
import warnings
warnings.simplefilter("error", RuntimeWarning)
try:
    from numba.core import config
    print(config.NUMBA_NUM_THREADS)
except Exception as e:
    print("refused", type(e).__name__)
"""


def numba_takes(value: str) -> bool:
    """Whether numba, imported with ``NUMBA_NUM_THREADS=value``, starts with that count."""
    env = {**os.environ, "NUMBA_NUM_THREADS": value}
    out = subprocess.run(
        [sys.executable, "-c", NUMBA_READS], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return not out.stdout.startswith("refused")


@pytest.mark.parametrize("value", ["²", "¹", "3_0", " 2 ", "2.0", "0x2", "+2", "٢"])
def test_refused_exactly_where_numba_cannot_start(value, monkeypatch):
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    if numba_takes(value):
        check_thread_env({"NUMBA_NUM_THREADS": value})
    else:
        with pytest.raises(ThreadSettingError, match="numba needs a whole number of threads"):
            check_thread_env({"NUMBA_NUM_THREADS": value})


def test_a_superscript_digit_is_one_error_line_on_the_command_line():
    env = {**os.environ, "NUMBA_NUM_THREADS": "²"}
    code = "import sys; from kvlens.cli import main; sys.argv = ['kvlens', 'generate', 'hi']; main()"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr.splitlines() == [
        "error: NUMBA_NUM_THREADS='²': numba needs a whole number of threads ≥ 1 (unset it for one per CPU)"
    ]


def test_any_other_error_reaches_the_previous_hook_whole(monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda *args: seen.append(args))
    with pytest.raises(ThreadSettingError):
        check_thread_env({"NUMBA_NUM_THREADS": "0"})
    error, tb = RuntimeError("other"), object()
    sys.excepthook(RuntimeError, error, tb)
    assert seen == [(RuntimeError, error, tb)]
