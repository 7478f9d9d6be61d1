"""``lab sweep-report --out`` naming a file, not a folder: refused when the command line is parsed
(test_bad_input_cli's rule: exit 2, typer's usage error naming the option, nothing on stdout), and
``write_report`` from Python raises a ValueError naming it before it writes anything. Before: the
command failed with "[Errno 17] File exists"."""

from __future__ import annotations

import pytest
from test_bad_input_cli import test_bad_option_values_are_usage_errors_before_anything_runs as refused

from kvlens.lab.store import Store
from kvlens.lab.sweep_report import write_report


def test_an_out_file_is_refused_by_the_cli(monkeypatch, capsys, tmp_path):
    Store(tmp_path / "s.db").close()
    (tmp_path / "taken").write_text("mine")
    monkeypatch.chdir(tmp_path)
    refused(monkeypatch, capsys, ["lab", "sweep-report", "s.db", "--out", "taken"], "--out")
    assert (tmp_path / "taken").read_text() == "mine"


def test_an_out_file_is_refused_by_write_report(tmp_path):
    Store(tmp_path / "s.db").close()
    (tmp_path / "taken").write_text("mine")
    with pytest.raises(ValueError, match="taken exists and is not a directory"):
        write_report(tmp_path / "s.db", tmp_path / "taken", "kvlens lab sweep-report")
    assert (tmp_path / "taken").read_text() == "mine"
