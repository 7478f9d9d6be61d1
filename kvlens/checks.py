"""Argument checks shared by every public edge: the Python API, the model loaders and the CLI parsers.

Each check returns the value in its canonical form or raises ``TypeError`` (wrong kind of value) or
``ValueError`` (right kind, bad value) whose message names the argument. This module imports nothing
from kvlens, so every layer may use it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import stat
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch

MAX_POSITIONS = 2**31 - 1  # contexts and token counts index int32 tensors in the kernels


def _kind(value: Any) -> str:
    return type(value).__name__


def check_int(value: Any, name: str, minimum: int | None = None, maximum: int | None = None) -> int:
    """An integer (not a bool, not a float) in ``[minimum, maximum]``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {_kind(value)} {value!r}")
    return _in_range(int(value), name, minimum, maximum)


def check_instance(value: Any, kind: type, name: str, what: str) -> Any:
    """``value``, a ``kind``; else a TypeError: ``name`` must be ``what`` (the words for one)."""
    if not isinstance(value, kind):
        raise TypeError(f"{name} must be {what}, got {_kind(value)} {value!r}")
    return value


def check_bool(value: Any, name: str) -> bool:
    """A bool (not 0/1, not a string such as "no", which would read as true)."""
    return check_instance(value, bool, name, "True or False")


def check_float(
    value: Any,
    name: str,
    minimum: float | None = None,
    maximum: float | None = None,
    above: float | None = None,
) -> float:
    """A finite real number (ints accepted, bools not) in ``[minimum, maximum]`` and ``> above``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {_kind(value)} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    if above is not None and value <= above:
        raise ValueError(f"{name} must be > {above:g}, got {value:g}")
    return _in_range(value, name, minimum, maximum)


def option_name(field: str) -> str:
    """A config field as its CLI option: ``prefill_chunk`` -> ``--prefill-chunk``."""
    return f"--{field.replace('_', '-')}"


def check_counts(
    config: Any, *names: str, minimum: int | None = 1, maximum: int | None = MAX_POSITIONS
) -> None:
    """Each named field of a command's config (each item of a list field; None skipped) is an integer
    in ``[minimum, maximum]`` (by default at most :data:`MAX_POSITIONS`, the CLI's bound on sizes),
    named as its CLI option: the range the CLI checks at parse time, so a config built from Python
    refuses what the command line refuses (tests/test_config_ranges.py)."""
    for name in names:
        value = getattr(config, name)
        items = [] if value is None else value if isinstance(value, list) else [value]
        for item in items:
            check_int(item, option_name(name), minimum=minimum, maximum=maximum)


_SCALARS: dict[str, Callable[[Any, str], Any]] = {
    "bool": check_bool,
    "int": check_int,
    "float": check_float,  # finite: the CLI's numeric options refuse nan and inf at parse time
    "str": lambda value, name: check_instance(value, str, name, "a string"),
}


def check_field_types(config: Any) -> None:
    """Every field of a command's config dataclass annotated ``bool``, ``int``, ``float`` or ``str``
    (or one of them ``| None``, None allowed) holds that type, named as its CLI option: ``"no"`` for a
    flag (read as true), ``1.5`` for a count, nan for a rate or ``5`` for a URL are refused as the CLI
    refuses them. Lists and ranges are the config's own checks (:func:`check_list_fields`,
    :func:`check_counts`)."""
    for f in dataclasses.fields(config):
        kind = str(f.type).replace(" ", "")
        optional = kind.endswith("|None")
        check = _SCALARS.get(kind.removesuffix("|None"))
        value = getattr(config, f.name)
        if check is not None and not (optional and value is None):
            check(value, option_name(f.name))


def check_finite_fields(config: Any, *names: str, **bounds: float | None) -> None:
    """Each named field of a command's config is a finite number within ``bounds`` (check_float's
    ``minimum``, ``maximum``, ``above``), named as its CLI option."""
    for name in names:
        check_float(getattr(config, name), option_name(name), **bounds)


def _in_range(value: Any, name: str, minimum: Any, maximum: Any) -> Any:
    def show(x: Any) -> str:  # an int in full (2147483647, not 2.14748e+09), a float short
        return str(x) if isinstance(x, int) else f"{x:g}"

    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be ≥ {show(minimum)}, got {show(value)}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be ≤ {show(maximum)}, got {show(value)}")
    return value


_LIST_ITEMS = {int: "whole numbers", float: "numbers", str: "names"}


def _is_item(value: Any, kind: type) -> bool:
    if kind is str:
        return isinstance(value, str)
    integral = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    return integral or (kind is float and isinstance(value, numbers.Real) and not isinstance(value, bool))


def check_list(
    value: Any, name: str, kind: type, optional: bool = False, split: Callable[[str], list] | None = None
) -> list | None:
    """``value`` as a list of ``kind`` items (int: whole numbers, not bools; float: any real number; str:
    names), from a list or tuple, or from one string through ``split`` where given (the CLI's comma
    lists); None where ``optional``. A bare string or number would otherwise be iterated letter by
    letter or fail mid-run: TypeError naming ``name``. Ranges are the caller's to check."""
    if value is None and optional:
        return None
    if isinstance(value, str) and split is not None:
        return split(value)
    if isinstance(value, (list, tuple)) and all(_is_item(v, kind) for v in value):
        return list(value)
    string = " or a comma-separated string" if split is not None else ""
    raise TypeError(f"{name} must be a list of {_LIST_ITEMS[kind]}{string}, got {_kind(value)} {value!r}")


def check_list_fields(
    config: Any,
    kinds: dict[str, type],
    optional: Sequence[str] = (),
    split: Callable[[str], list] | None = None,
    may_be_empty: Sequence[str] = (),
) -> None:
    """A config dataclass's list fields in place through :func:`check_list`: ``kinds`` maps each field
    to its item type; ``split`` reads a string given to a name field; those in ``optional`` may be None.
    A list names what a run compares, so it must not be empty (a run of nothing would exit 0 with an
    empty table) unless named in ``may_be_empty``, nor name one value twice (ValueError naming it)."""
    for field, kind in kinds.items():
        value = getattr(config, field)
        items = check_list(value, field, kind, field in optional, split if kind is str else None)
        named = f"{field} ({option_name(field)})"  # the config field and the CLI option
        if items is not None and not items and field not in may_be_empty:
            raise ValueError(f"{named} is empty: give at least one value")
        twice = next((v for i, v in enumerate(items or ()) if v in items[:i]), None)
        if twice is not None:
            raise ValueError(f"{named} gives {twice!r} twice")
        setattr(config, field, items)


def check_token_ids(
    ids: Any, vocab: int | None, name: str = "token ids", allow_empty: bool = False
) -> list[int]:
    """Token ids as a list of ints in ``[0, vocab)`` (``None``: ≥ 0): a sequence of ints or a 1-D
    integer tensor."""
    if isinstance(ids, torch.Tensor):
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor, got dtype {ids.dtype}")
        if ids.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got a tensor of shape {tuple(ids.shape)}")
        ids = ids.tolist()
    elif isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise TypeError(f"{name} must be a list of ints, got {_kind(ids)}")
    if not ids and not allow_empty:
        raise ValueError(f"{name} must not be empty")
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise TypeError(f"{name}[{i}] must be an int, got {_kind(t)} {t!r}")
        if vocab is None and t < 0:
            raise ValueError(f"{name}[{i}] = {t} is negative")
        if vocab is not None and not 0 <= t < vocab:
            raise ValueError(f"{name}[{i}] = {t} is outside the vocabulary [0, {vocab})")
    return [int(t) for t in ids]


def check_tensor(
    x: Any,
    name: str,
    dtypes: Sequence[torch.dtype] | None = None,
    floating: bool = False,
    shape: Sequence[int | None] | None = None,
    min_dim: int = 0,
    no_nan: bool = False,
) -> torch.Tensor:
    """A torch tensor of one of ``dtypes`` (or any floating dtype), with ``shape`` (None: any size on
    that axis) or ≥ ``min_dim`` dims, and with ``no_nan`` no NaN (±inf stays: a masked logit is one)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {_kind(x)}")
    if dtypes is not None and x.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {' or '.join(map(str, dtypes))}, got {x.dtype}")
    if floating and not x.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if shape is not None and (
        x.dim() != len(shape) or any(w is not None and g != w for g, w in zip(x.shape, shape, strict=True))
    ):
        want = ", ".join("n" if w is None else str(w) for w in shape)
        raise ValueError(f"{name} must have shape ({want}), got {tuple(x.shape)}")
    if x.dim() < min_dim:
        raise ValueError(f"{name} must have at least {min_dim} dimension(s), got shape {tuple(x.shape)}")
    if no_nan and bool(torch.isnan(x).any()):
        raise ValueError(f"{name} holds NaN")
    return x


def check_text(text: Any, name: str = "prompt") -> str:
    """A str that is valid Unicode (a command line's undecodable bytes arrive as lone surrogates)."""
    if not isinstance(text, str):
        raise TypeError(f"{name} must be a str, got {_kind(text)}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} is not valid UTF-8 text (bad character at index {e.start})") from None
    return text


def check_device(device: Any) -> torch.device:
    """A torch device that exists here: ``cuda`` on a build or machine without CUDA is refused."""
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str or torch.device, got {_kind(device)}")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"unknown device {device!r}; expected cpu or cuda[:N]") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            built = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise ValueError(f"device {device!r} is not available: {built}")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r} does not exist: {torch.cuda.device_count()} CUDA GPU(s)")
    elif dev.type != "cpu":
        raise ValueError(f"unsupported device {device!r}; expected cpu or cuda[:N]")
    return dev


def check_url(value: str) -> str:
    """An http(s) URL with a host (a server's base URL, as ``http://127.0.0.1:8000``)."""
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"expected an http:// or https:// URL with a host, got {value!r}")
    return value


def check_api_key(value: str) -> str:
    """A key a client can send: not empty (``--api-key "$KEY"`` with KEY unset must not serve an
    open server) and printable ASCII without spaces (what an HTTP header carries as sent)."""
    if not value:
        raise ValueError("the API key is empty; omit --api-key to serve without one")
    if not value.isascii() or any(c.isspace() or not c.isprintable() for c in value):
        raise ValueError("the API key must be printable ASCII without spaces")
    return value


def check_not_special(path: str | os.PathLike[str], error: type[Exception], what: str = "") -> None:
    """``error`` when ``path`` exists and is a FIFO, a device or a socket: opening a FIFO blocks until a
    writer comes, and a device may never end (``/dev/zero``), so a file kvlens reads must be a regular
    file (or a directory where one is expected). Links are followed; a missing path is left to the open."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return
    kinds = [(stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")]
    for test, kind in [*kinds, (stat.S_ISSOCK, "a socket")]:
        if test(mode):
            raise error(f"{what + ' ' if what else ''}{path} is {kind}, not a regular file")


def read_json(path: str | Path, error: type[Exception], what: str = "") -> Any:
    """The JSON value in ``path`` (UTF-8); ``error`` naming the file (``what`` it should be, e.g.
    ``"KV recipe"``) when it cannot be read or is not valid JSON."""
    name = f"{what} {path}" if what else str(path)
    check_not_special(path, error, what)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise error(f"{name} is not valid JSON: not UTF-8 text") from None
    except OSError as e:
        raise error(f"cannot read {name}: {e.strerror or e}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{name} is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})") from None
