"""The list fields of the bench configs, checked where a config is built from Python: the CLI hands
them lists already, a program may hand a bare string or number, which would otherwise be iterated
letter by letter (``kv="q8"`` read as modes ``q`` and ``8``) or fail mid-run."""

from __future__ import annotations

from typing import Any

from ..kv.modes import split_mode_list


def name_list(value: Any, field: str, optional: bool = False) -> list[str] | None:
    """``value`` as a list of names: a list or tuple of strings, or one comma list as the CLI takes
    (``"q8,f16"``); None where ``optional``. TypeError naming ``field`` otherwise."""
    if value is None and optional:
        return None
    if isinstance(value, str):
        return split_mode_list(value)
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return list(value)
    raise TypeError(
        f"{field} must be a list of names or a comma-separated string, got {type(value).__name__} {value!r}"
    )


def size_list(value: Any, field: str, optional: bool = False) -> list[int] | None:
    """``value`` as a list of whole numbers (a list or tuple of ints, not bools); None where
    ``optional``. TypeError naming ``field`` otherwise (the range is the config's to check)."""
    if value is None and optional:
        return None
    if isinstance(value, (list, tuple)) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return list(value)
    raise TypeError(f"{field} must be a list of whole numbers, got {type(value).__name__} {value!r}")


def check_list_fields(
    config: Any, names: tuple[str, ...] = (), sizes: tuple[str, ...] = (), optional: tuple[str, ...] = ()
) -> None:
    """A config dataclass's list fields in place: :func:`name_list` for ``names``, :func:`size_list`
    for ``sizes``; those in ``optional`` may be None."""
    for field in names:
        setattr(config, field, name_list(getattr(config, field), field, field in optional))
    for field in sizes:
        setattr(config, field, size_list(getattr(config, field), field, field in optional))
