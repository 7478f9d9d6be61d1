"""From command-line options to the commands' config values: comma lists, sparse policies, and a
config dataclass filled from the options of the same names."""

from __future__ import annotations

import dataclasses
from typing import Any


def sparse_policy(method: str | None, budget: float, dense_layers: int, min_ctx: int = 0):
    """The sparse-decode policy of the command-line options (None: dense)."""
    if method is None:
        return None
    from .kv.blocks import SparseConfig

    return SparseConfig(method, budget, dense_layers, min_ctx)


def config_from(cls: type, options: dict[str, Any], **given: Any) -> Any:
    """A command's config dataclass from its options: each field takes the option of the same name,
    or ``given`` (options that the CLI converts first, e.g. comma lists)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in options.items() if k in names} | given)


def comma_list(s: str | None, kind: type = str) -> list | None:
    """A comma list (None stays None); ints accept a k suffix (4k = 4096)."""
    if s is None:
        return None
    if kind is not int:
        return [kind(x) for x in s.split(",") if x]
    try:
        return [
            int(x.lower().removesuffix("k")) * (1024 if x.lower().endswith("k") else 1)
            for x in s.split(",")
            if x
        ]
    except ValueError as e:
        raise ValueError(f"expected a comma-separated list of integers (e.g. 512,2k,4k), got {s!r}") from e
