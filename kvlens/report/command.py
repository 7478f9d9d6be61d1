"""The skeleton every lab and bench command follows: (the caller loads) → progress → run → tables or
JSON → optional report files."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from .output import dump_json, progress

R = TypeVar("R")


@dataclass(frozen=True)
class CommandOutput(Generic[R]):
    """How a command shows its result: ``render`` prints tables, ``to_json`` gives what ``--json``
    prints, ``write_report(result, out_dir, command_line)`` writes Markdown + figures (optional)."""

    render: Callable[[R], None]
    to_json: Callable[[R], Any]
    write_report: Callable[[R, Path, str], Path] | None = None


def run_command(
    name: str,
    steps: int,
    run: Callable[[Callable[[str], None]], R],
    output: CommandOutput[R],
    json_out: bool = False,
    report: str | Path | None = None,
) -> R:
    """``run(step)`` under a progress bar of ``steps`` steps (stderr), then the result as tables or
    JSON (stdout), then the report files when ``report`` names a directory."""
    with progress(steps, name, enabled=steps > 0) as step:
        result = run(step)
    if json_out:
        print(dump_json(output.to_json(result)))
    else:
        output.render(result)
    if report is not None:
        if output.write_report is None:
            raise ValueError(f"{name} writes no report")
        path = output.write_report(result, Path(report), "kvlens " + " ".join(sys.argv[1:]))
        print(f"report: {path}", file=sys.stderr)
    return result
