"""Terminal output (rich tables on stdout, progress on stderr), JSON, Markdown files and figures.

Tables go to stdout and progress to stderr, so that ``--json`` can print nothing but JSON on stdout.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

import numpy as np

PLAIN_PROGRESS_SECONDS = 30.0  # a non-terminal stderr gets a progress line at most this often


@contextmanager
def progress(total: int, description: str, enabled: bool = True) -> Iterator[Callable[[str], None]]:
    """A rich progress bar on stderr; yields ``step(label)`` that advances it by one. Where stderr is
    not a terminal (a pipe, a log file), where a live bar shows nothing: :func:`plain_progress`."""
    if not enabled:
        yield lambda _label="": None
        return
    if not sys.stderr.isatty():
        yield plain_progress(total, description, PLAIN_PROGRESS_SECONDS)
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*cols, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=total)

        def step(label: str = "") -> None:
            bar.update(task, advance=1, description=f"{description} {label}".rstrip())

        yield step


def plain_progress(
    total: int,
    description: str,
    interval: float = PLAIN_PROGRESS_SECONDS,
    clock: Callable[[], float] = time.monotonic,
    out: TextIO | None = None,
) -> Callable[[str], None]:
    """``step(label)`` writing ``description label: done/total after N s`` to ``out`` (stderr) once
    ``interval`` seconds have passed since the start or the last line, and at the last step if it
    wrote any before: a run shorter than ``interval`` stays silent, a long one shows it is alive."""
    start = last = clock()
    done, wrote = 0, False

    def step(label: str = "") -> None:
        nonlocal done, last, wrote
        done += 1
        now = clock()
        if now - last >= interval or (done == total and wrote):
            head = f"{description} {label}".rstrip()
            print(f"{head}: {done}/{total} after {now - start:.0f} s", file=out or sys.stderr, flush=True)
            last, wrote = now, True

    return step


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]], width: int = 120) -> None:
    """A rich table on stdout: first column left-aligned, the others right-aligned."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for i, h in enumerate(headers):
        table.add_column(h, justify="left" if i == 0 else "right")
    for r in rows:
        table.add_row(*(str(c) for c in r))
    Console(width=max(width, Console().width)).print(table)


def md_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    out = ["| " + " | ".join(str(h).replace("|", "\\|") for h in headers) + " |"]
    out.append("|" + "|".join("---" for _ in headers) + "|")
    out += ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]
    return "\n".join(out) + "\n"


def dump_json(obj: Any, indent: int = 2) -> str:
    """JSON with NaN/Inf as null (strict JSON readers reject NaN), numpy scalars as numbers and
    dataclass instances as objects."""

    def clean(x: Any) -> Any:
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            return clean(dataclasses.asdict(x))
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        if isinstance(x, (float, np.floating)):
            return float(x) if math.isfinite(x) else None
        if isinstance(x, np.integer):
            return int(x)
        return x

    return json.dumps(clean(obj), indent=indent, ensure_ascii=False)


def write_markdown(out_dir: str | Path, name: str, text: str) -> Path:
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    path = d / name
    path.write_text(text, encoding="utf-8")
    return path


def figure():
    """``matplotlib.pyplot`` on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def label_axes(
    ax: Any, xlabel: str | None = None, ylabel: str | None = None, title: str | None = None, legend: int = 8
) -> None:
    """Axis labels, title and a legend of the given font size (0: none), as every lab plot has them."""
    if xlabel is not None:
        ax.set_xlabel(xlabel)
    if ylabel is not None:
        ax.set_ylabel(ylabel)
    if title is not None:
        ax.set_title(title)
    if legend:
        ax.legend(fontsize=legend)


def save_figure(fig: Any, path: str | Path, dpi: int = 110) -> Path:
    """Lay out, write and close ``fig``."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    figure().close(fig)
    return Path(path)
