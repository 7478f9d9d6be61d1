"""A FIFO, a device or a socket where kvlens reads a file is refused by name, never opened: opening a
FIFO for reading waits for a writer (the thirty-sixth session's hostile sweep: `verify FIFO`,
`generate --kv FIFO.json`, `lab doctor --plan FIFO`, `lab sweep FIFO` and `lab plan --reuse FIFO`
hung), and a device such as /dev/zero never ends. Each reader runs in a thread that is given 10 s:
one that waits on the FIFO fails the test (and is then let go by a writer that opens and closes)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from test_bad_input_cli import assert_one_error_line

from kvlens.checks import read_json
from kvlens.corpus import CorpusError, load_corpus
from kvlens.engine.verify import verify_file
from kvlens.kv.recipe import RecipeError, load_recipe
from kvlens.lab.plan import load_measurements
from kvlens.lab.sweep_spec import SpecError, load_spec
from kvlens.models.config import ModelLoadError, check_readable


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "pipe.json"
    os.mkfifo(path)
    return path


def refusal(read: Callable[[Path], object], path: Path) -> Exception:
    box: dict = {}

    def run() -> None:
        try:
            read(path)
        except Exception as e:  # the refusal under test
            box["error"] = e

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(10)
    if worker.is_alive():
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))  # a writer comes and goes: the open returns
        worker.join(10)
        raise AssertionError(f"reading {path} waited on the FIFO")
    assert "error" in box, f"reading {path} was not refused"
    return box["error"]


READERS = [
    ("json", lambda p: read_json(p, ValueError), ValueError),
    ("recipe", load_recipe, RecipeError),
    ("record", verify_file, ValueError),
    ("model file", check_readable, ModelLoadError),
    ("sweep spec", load_spec, SpecError),
    ("corpus", load_corpus, CorpusError),
]


@pytest.mark.parametrize(("what", "read", "error"), READERS, ids=[r[0] for r in READERS])
def test_a_fifo_is_refused_not_opened(fifo, what, read, error):
    e = refusal(read, fifo)
    assert isinstance(e, error) and "not a regular file" in str(e), (what, e)


def test_plan_measurements_from_a_fifo_are_refused(fifo):
    e = refusal(lambda p: load_measurements(str(p), "smollm2", "shakespeare", None), fifo)
    assert "is a FIFO (named pipe), not a regular file" in str(e)


def test_a_device_and_a_socket_are_refused(tmp_path):
    assert "/dev/zero is a device" in str(refusal(lambda p: read_json(p, ValueError), Path("/dev/zero")))
    path = tmp_path / "s.json"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        assert "is a socket" in str(refusal(lambda p: read_json(p, ValueError), path))


def test_the_cli_names_the_fifo_in_one_line(fifo):
    """In a subprocess with a time limit: a CLI that opened the FIFO would wait for good."""
    run = subprocess.run(
        [sys.executable, "-c", "from kvlens.cli import main; main()", "verify", str(fifo)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    needle = f"the record {fifo} is a FIFO (named pipe), not a regular file"
    assert_one_error_line(run.returncode, run.stdout, run.stderr, needle)
