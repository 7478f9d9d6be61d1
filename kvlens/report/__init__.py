"""Output shared by the lab and bench commands: terminal tables and progress, JSON, Markdown, figures,
and the command skeleton (load → progress → run → tables or JSON → report)."""

from .command import CommandOutput, run_command
from .output import (
    dump_json,
    figure,
    label_axes,
    md_table,
    print_table,
    progress,
    save_figure,
    write_markdown,
)

__all__ = [
    "CommandOutput",
    "dump_json",
    "figure",
    "label_axes",
    "md_table",
    "print_table",
    "progress",
    "run_command",
    "save_figure",
    "write_markdown",
]
