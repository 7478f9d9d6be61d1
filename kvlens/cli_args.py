"""Validated parsers for the command line's option values, applied at parse time.

Each ``parse_*`` function is plain (``ValueError`` on bad input, usable anywhere); the ``*_option``
factories wrap one as a typer callback, so a bad value is a usage error (exit 2, with the usage
line) before the command prints or loads anything. Comma lists are validated here and parsed again
by the command body with the same function.
"""

from __future__ import annotations

import os
import re
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from .checks import MAX_POSITIONS, check_api_key, check_device, check_float, check_text, check_url

MAX_SIZE = MAX_POSITIONS
_SIZE = re.compile(r"([0-9]{1,12})([kK]?)")


def parse_sizes(text: str, minimum: int = 1, maximum: int = MAX_SIZE, suffix: bool = True) -> list[int]:
    """``"512,2k,4K"`` → ``[512, 2048, 4096]``: positive integers, ``k`` = ×1024 when ``suffix``.

    Refuses empty lists and items, signs, fractions (``1.5k``), a bare ``k`` and values outside
    ``[minimum, maximum]``.
    """
    items = [item.strip() for item in str(text).split(",")]
    if items == [""]:
        raise ValueError("expected a comma-separated list of sizes (e.g. 512,2k,4k), got an empty value")
    out = []
    for item in items:
        m = _SIZE.fullmatch(item)
        if m is None or (m.group(2) and not suffix):
            example = "512,2k,4k" if suffix else "64,256"
            raise ValueError(f"bad item {item!r} in {text!r}: expected positive integers like {example}")
        value = int(m.group(1)) * (1024 if m.group(2) else 1)
        if not minimum <= value <= maximum:
            raise ValueError(f"item {item!r} in {text!r} is {value}, outside [{minimum}, {maximum}]")
        out.append(value)
    return out


def parse_floats(
    text: str, minimum: float | None = None, maximum: float | None = None, above: float | None = None
) -> list[float]:
    """``"0.1,0.5"`` → ``[0.1, 0.5]``: finite numbers within the bounds, no empty items."""
    items = [item.strip() for item in str(text).split(",")]
    out = []
    for item in items:
        try:
            value = float(item)
        except ValueError:
            raise ValueError(
                f"bad item {item!r} in {text!r}: expected a comma-separated list of numbers"
            ) from None
        out.append(check_float(value, f"item {item!r} in {text!r}", minimum, maximum, above))
    return out


def _option(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A typer callback: ``check(value)`` must not raise; the option keeps its value as given."""

    def callback(value: Any) -> Any:
        if value is None:
            return value
        try:
            check(value)
        except (TypeError, ValueError) as e:
            raise typer.BadParameter(str(e)) from None
        return value

    return callback


def finite_option(minimum: float | None = None, maximum: float | None = None, above: float | None = None):
    """A float option that must be finite and within the bounds (click's ranges let nan/inf through)."""
    return _option(lambda v: check_float(v, "value", minimum, maximum, above))


def backend_option(value: str | None) -> str | None:
    """An attention backend name, checked when the command line is parsed (before any model loads)."""
    from .engine.attention import check_backend_name

    return _option(check_backend_name)(value)


def byte_size_option(value: str | None) -> str | None:
    """A byte size such as ``512MiB`` (the server's parser), checked when the command line is parsed:
    an empty or malformed one would otherwise reach a started server."""
    from .serve.cli import parse_size

    return _option(parse_size)(value)


def weights_option(value: str | None) -> str | None:
    """A weights mode (auto, f32, bf16, int8, int4); an empty one is not "auto"."""
    from .models.loader import check_weights_mode

    return _option(check_weights_mode)(value)


def sizes_option(minimum: int = 1, maximum: int = MAX_SIZE, suffix: bool = True):
    """A comma list of sizes, checked by :func:`parse_sizes`."""
    return _option(lambda v: parse_sizes(v, minimum, maximum, suffix))


def floats_option(minimum: float | None = None, maximum: float | None = None, above: float | None = None):
    """A comma list of finite numbers, checked by :func:`parse_floats`."""
    return _option(lambda v: parse_floats(v, minimum, maximum, above))


def check_output_path(value: str, directory: bool) -> Path:
    """A path the command can write to later: a directory (``directory``) or a file, checked now so
    a run does not print its results and then fail to save them."""
    path = Path(value).expanduser()
    if path.exists() and path.is_dir() != directory:
        raise ValueError(f"{path} exists and is {'not ' if directory else ''}a directory")
    ancestor = path if directory else path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ValueError(f"cannot create {path}: {ancestor} is not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ValueError(f"cannot write to {ancestor} (permission denied)")
    return path


def nonempty_text(value: str) -> str:
    if not check_text(value):
        raise ValueError("the prompt is empty")
    return value


# A sparse budget is a token count (≥ 1) or a fraction of the context (0 < b < 1).
budget_option = finite_option(above=0.0)
budgets_option = floats_option(above=0.0)
text_argument = _option(nonempty_text)
output_dir_option = _option(lambda v: check_output_path(v, directory=True))
output_file_option = _option(lambda v: check_output_path(v, directory=False))
device_option = _option(check_device)
url_option = _option(check_url)
api_key_option = _option(check_api_key)


# == the error boundary of the ``kvlens`` command ==
# Bad input the user can fix: exit 2. Anything else is a kvlens failure: exit 1.
INPUT_ERRORS = (ValueError, OSError, ImportError)
DEBUG_ENV = "KVLENS_DEBUG"


def debug_wanted() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def report_error(e: BaseException) -> int:
    """Print ``e`` as one ``error: ...`` line on stderr (its traceback first under --debug); the exit code."""
    if debug_wanted():
        traceback.print_exception(e)
    message = " ".join(str(e).split()) or type(e).__name__
    if isinstance(e, INPUT_ERRORS):
        print(f"error: {message}", file=sys.stderr)
        return 2
    hint = "" if debug_wanted() else "; rerun with --debug for the traceback"
    print(f"error: internal error ({type(e).__name__}: {message}){hint}", file=sys.stderr)
    return 1


def run_guarded(app: Callable[[], Any]) -> None:
    """Run the typer ``app`` (which reports usage errors itself, exit 2) and turn anything else it
    raises into :func:`report_error`'s line and exit code; Ctrl-C exits 130 without a word."""
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:
        sys.exit(report_error(e))
