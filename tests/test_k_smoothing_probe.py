"""scripts/k_smoothing_probe.py refuses bad input with one argparse error line (exit 2)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "k_smoothing_probe.py"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--test-ctx", "0"], "argument --test-ctx: must be a positive integer, got 0"),
        (["--calib-ctx", "x"], "argument --calib-ctx: invalid positive_int value: 'x'"),
        (["--model", "no-such-model"], "model not found: no-such-model"),
    ],
)
def test_bad_input_is_one_error_line(args, message):
    r = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("k_smoothing_probe.py: error: ") and message in last
