"""The shared output helpers (kvlens.report) on hand-written cases: Markdown tables whose cells hold
``|``, JSON that strict readers accept (no NaN anywhere, numpy numbers as numbers), report folders
that do not exist yet, and the command skeleton's split of stdout (tables or JSON only) and stderr."""

from __future__ import annotations

import dataclasses
import json
import sys

import numpy as np
import pytest

from kvlens.report import CommandOutput, dump_json, md_table, run_command, write_markdown


def test_md_table_escapes_pipes_in_headers_and_cells():
    text = md_table(["mode", "a|b"], [["q8|f16", 1.5], ["f32", "x"]])
    assert text == "| mode | a\\|b |\n|---|---|\n| q8\\|f16 | 1.5 |\n| f32 | x |\n"


@dataclasses.dataclass
class _Row:
    name: str
    value: float


def test_dump_json_is_strict_json_everywhere():
    obj = {
        "nested": [(1.0, float("nan")), {"inf": float("-inf")}],
        "np": [np.float32(0.5), np.int64(7), np.float64(np.inf)],
        "row": _Row("q8", float("nan")),
    }
    text = dump_json(obj)
    back = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    assert back == {
        "nested": [[1.0, None], {"inf": None}],
        "np": [0.5, 7, None],
        "row": {"name": "q8", "value": None},
    }
    assert isinstance(back["np"][1], int)


def test_dump_json_keeps_text_readable():
    assert dump_json({"kld": "KL(w ‖ ŵ)"}, indent=0) == '{\n"kld": "KL(w ‖ ŵ)"\n}'


def test_write_markdown_creates_missing_folders(tmp_path):
    path = write_markdown(tmp_path / "a" / "b", "report.md", "# ü\n")
    assert path == tmp_path / "a" / "b" / "report.md"
    assert path.read_bytes() == "# ü\n".encode()


def _output(calls: list, with_report: bool = True) -> CommandOutput:
    def write_report(result, out_dir, command):
        calls.append((result, out_dir, command))
        return out_dir / "report.md"

    return CommandOutput(
        render=lambda r: print(f"table {r}"),
        to_json=lambda r: {"result": r, "bad": float("nan")},
        write_report=write_report if with_report else None,
    )


def test_run_command_json_alone_on_stdout_report_line_on_stderr(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["kvlens", "lab", "ppl", "--json"])
    calls: list = []
    seen_steps: list = []

    def run(step):
        step("first")
        seen_steps.append(1)
        return 42

    assert run_command("lab ppl", 1, run, _output(calls), json_out=True, report=tmp_path / "r") == 42
    out, err = capsys.readouterr()
    assert json.loads(out) == {"result": 42, "bad": None}
    assert err.strip().endswith(f"report: {tmp_path / 'r' / 'report.md'}")
    assert calls == [(42, tmp_path / "r", "kvlens lab ppl --json")]
    assert seen_steps == [1]


def test_run_command_tables_without_json(capsys):
    run_command("bench", 0, lambda step: "x", _output([]))
    out, err = capsys.readouterr()
    assert out == "table x\n" and err == ""


def test_run_command_refuses_a_report_it_cannot_write(tmp_path, capsys):
    with pytest.raises(ValueError, match="bench writes no report"):
        run_command("bench", 0, lambda step: 1, _output([], with_report=False), report=tmp_path)
