"""The probe scripts (k_smoothing_probe.py, rotation_span_probe.py, v_centering_probe.py) refuse bad
input with one argparse error line (exit 2)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.mark.parametrize(
    ("script", "args", "message"),
    [
        (
            "k_smoothing_probe.py",
            ["--test-ctx", "0"],
            "argument --test-ctx: must be a positive integer, got 0",
        ),
        (
            "k_smoothing_probe.py",
            ["--calib-ctx", "x"],
            "argument --calib-ctx: invalid positive_int value: 'x'",
        ),
        ("k_smoothing_probe.py", ["--model", "no-such-model"], "model not found: no-such-model"),
        ("rotation_span_probe.py", ["--ctx", "-3"], "argument --ctx: must be a positive integer, got -3"),
        ("rotation_span_probe.py", ["--corpus", "no-such-corpus"], "no-such-corpus"),
        ("v_centering_probe.py", ["--keep-sink", "-1"], "argument --keep-sink: must be 0 or more, got -1"),
        (
            "v_centering_probe.py",
            ["--keep-sink", "512"],
            "--keep-sink 512 leaves no calibration row (--calib-ctx 512)",
        ),
        ("v_centering_probe.py", ["--model", "no-such-model"], "model not found: no-such-model"),
    ],
)
def test_bad_input_is_one_error_line(script, args, message):
    r = subprocess.run(
        [sys.executable, str(SCRIPTS / script), *args], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2 and r.stdout == ""
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{script}: error: ") and message in last
