"""A server process that fails to start leaves no log file behind: its error carries the output, and
the caller has no object to ``close()`` (the forty-seventh session found one temporary file per
failed start in /tmp)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest

from kvlens.serve.process import ServerProcess

CHILD = """
import sys, time
print("loading the model", flush=True)
if sys.argv[1] == "exit":
    sys.exit(3)
time.sleep(120)
"""


class Failing(ServerProcess):
    """A child that prints one line, then exits (``exit``) or never serves /health (``hang``)."""

    name = "failing"

    def command(self, args: list[str], host: str, port: int) -> list[str]:
        return [sys.executable, "-c", CHILD, args[0]]


@pytest.fixture
def temp_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize(
    ("mode", "timeout", "words"),
    [("exit", 30.0, "failing exited with 3"), ("hang", 1.0, "failing was not healthy after 1 s")],
)
def test_a_failed_start_reports_the_output_and_leaves_no_log(temp_dir, mode, timeout, words):
    with pytest.raises(RuntimeError, match=words) as err:
        Failing([mode], start_timeout=timeout)
    assert "loading the model" in str(err.value)
    assert list(temp_dir.glob("kvlens-serve-*.log")) == []
