"""The sweep spec (TOML) and its cells.

A spec names the grid; every combination of model × weights × corpus × context × KV mode × measurement
is one **cell**, and a cell is one run of the lab's own code (``run_ppl``, ``run_greedy``,
``run_layers``, ``run_needle``) with that single KV mode. Example (``docs/sweep/smollm2.toml``)::

    [sweep]
    models = ["smollm2"]                 # 'smollm2', 'gemma3-270m', a .gguf file or an HF directory
    kv = ["f16", "q8", "q8-k", "q8-v"]   # KV modes (each against the measurement's base)
    weights = ["f32"]                    # f32, bf16, int8, int4, auto
    corpora = ["britannica", "hamlet_gut"]   # `kvlens corpus list` names or UTF-8 files
    ctx = [512]
    measurements = ["ppl"]               # ppl, greedy, layers, needle

    [ppl]                                # optional: the measurement's own settings
    chunks = 4

Relative file paths (models, corpora) are resolved against the spec file's directory. A measurement
section may set its own ``ctx`` list (e.g. greedy's prompt length). Every error names its key.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..checks import check_not_special
from ..kv.modes import KVMode

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

MEASUREMENTS = ("ppl", "greedy", "layers", "needle")


class SpecError(ValueError):
    """A sweep spec that cannot be run; the message names the file and the key."""


# Each measurement's settings: name -> (type, default). The defaults are the lab CLI's.
SECTION_KEYS: dict[str, dict[str, tuple[type, Any]]] = {
    "ppl": {
        "ctx": (list, None), "chunks": (int, 4), "base": (str, "f32"), "prefill_chunk": (int, 32),
        "keep_sink": (int, 0), "keep_recent": (int, 0),
    },
    "greedy": {
        "ctx": (list, None), "prompts": (int, 8), "tokens": (int, 32), "base": (str, "f32"),
        "prefill_chunk": (int, 32), "keep_sink": (int, 0), "keep_recent": (int, 0),
    },
    "layers": {"ctx": (list, None), "chunks": (int, 1), "keep_sink": (int, 0), "keep_recent": (int, 0)},
    "needle": {
        "ctx": (list, None), "depths": (list, [0.1, 0.5, 0.9]), "budgets": (list, [0.125, 0.25]),
        "method": (str, "quest"), "dense_layers": (int, 2), "seed": (int, 0),
    },
}  # fmt: skip
SWEEP_KEYS: dict[str, tuple[type, Any]] = {
    "models": (list, None),
    "kv": (list, None),
    "weights": (list, ["f32"]),
    "corpora": (list, ["britannica"]),
    "ctx": (list, [512]),
    "measurements": (list, ["ppl"]),
}


@dataclass(frozen=True)
class Cell:
    """One run of one lab measurement. ``params`` are the measurement's settings (sorted items)."""

    measurement: str
    model: str
    weights: str
    kv: KVMode
    corpus: str
    ctx: int
    params: tuple[tuple[str, Any], ...]

    def config(self) -> dict[str, Any]:
        fixed = {k: getattr(self, k) for k in ("measurement", "model", "weights", "corpus", "ctx")}
        fixed["kv"] = self.kv.name
        return fixed | {k: list(v) if isinstance(v, tuple) else v for k, v in self.params}

    def config_json(self) -> str:
        """Canonical JSON: sorted keys, no whitespace (the key hash is taken over it)."""
        return json.dumps(self.config(), sort_keys=True, separators=(",", ":"))

    @property
    def key(self) -> str:
        return hashlib.sha256(self.config_json().encode()).hexdigest()

    @property
    def label(self) -> str:
        return cell_label(self.config())


def cell_label(config: dict[str, Any]) -> str:
    """A cell in a few words: ``ppl smollm2 weights f32 kv q8 britannica ctx 512``."""
    c = config
    return (
        f"{c['measurement']} {Path(c['model']).name} weights {c['weights']} kv {c['kv']} "
        f"{Path(c['corpus']).name} ctx {c['ctx']}"
    )


@dataclass(frozen=True)
class Spec:
    path: Path
    text: str
    cells: list[Cell]


def _type_name(t: type) -> str:
    return {list: "a list", int: "an integer", str: "a string", float: "a number"}[t]


def _check_type(where: str, value: Any, t: type) -> Any:
    ok = isinstance(value, t) and not (t is int and isinstance(value, bool))
    if not ok:
        raise SpecError(f"{where} must be {_type_name(t)} (got {type(value).__name__} {value!r})")
    return value


def _list_of(where: str, value: Any, item: type, check: Callable[[str, Any], Any] | None = None) -> list:
    _check_type(where, value, list)
    if not value:
        raise SpecError(f"{where} is empty")
    out = []
    for i, v in enumerate(value):
        v = _check_type(f"{where}[{i}]", float(v) if item is float and isinstance(v, int) else v, item)
        out.append(check(f"{where}[{i}]", v) if check else v)
    dup = next((x for x in out if out.count(x) > 1), None)
    if dup is not None:
        raise SpecError(f"{where} lists {str(dup)!r} more than once")
    return out


def _table(where: str, raw: Any, allowed: dict[str, tuple[type, Any]]) -> dict[str, Any]:
    """The keys of one TOML table, checked for unknown names and types; missing ones take defaults."""
    _check_type(where, raw, dict)
    for k in raw:
        if k not in allowed:
            raise SpecError(f"unknown key {where}.{k} (allowed: {', '.join(allowed)})")
    out = {}
    for k, (t, default) in allowed.items():
        if k not in raw:
            if default is None and k != "ctx":
                raise SpecError(f"{where}.{k} is required")
            out[k] = default
        elif t is not list:
            out[k] = _check_type(f"{where}.{k}", raw[k], t)
        else:
            out[k] = raw[k]  # lists are checked item by item below
    return out


def _mode(where: str, name: str) -> KVMode:
    try:
        return KVMode.parse(name)
    except ValueError as e:
        raise SpecError(f"{where}: {e}") from None


def _weights(where: str, name: str) -> str:
    from ..models.loader import check_weights_mode

    try:
        return check_weights_mode(name)
    except ValueError as e:
        raise SpecError(f"{where}: {e}") from None


def _ctx(where: str, n: int) -> int:
    if n < 4:
        raise SpecError(f"{where}: a context must be at least 4 tokens (got {n})")
    return n


def _model(root: Path) -> Callable[[str, str], str]:
    def check(where: str, name: str) -> str:
        from ..models.loader import PACKAGED_MODELS, resolve_model

        if name in PACKAGED_MODELS:
            try:
                resolve_model(name)
            except ValueError as e:
                raise SpecError(f"{where}: {e}") from None
            return name
        path = (root / name).expanduser().resolve()
        if not path.exists():
            raise SpecError(f"{where}: model file {name!r} does not exist (looked for {path})")
        return str(path)

    return check


def _corpus(root: Path) -> Callable[[str, str], str]:
    def check(where: str, name: str) -> str:
        path = (root / name).expanduser()
        if path.is_file():
            return str(path.resolve())
        if "/" in name or path.suffix:
            raise SpecError(f"{where}: corpus file {name!r} does not exist (looked for {path.resolve()})")
        from ..corpus import list_corpora

        names = list_corpora()
        if name not in names:
            raise SpecError(f"{where}: unknown corpus {name!r} (see `kvlens corpus list`, or give a file)")
        return name

    return check


def _section(name: str, raw: dict[str, Any], where: str) -> dict[str, Any]:
    s = _table(where, raw, SECTION_KEYS[name])
    if s["ctx"] is not None:
        s["ctx"] = _list_of(f"{where}.ctx", s["ctx"], int, _ctx)
    for k in ("chunks", "prompts", "tokens", "prefill_chunk"):
        if k in s and s[k] < 1:
            raise SpecError(f"{where}.{k} must be at least 1 (got {s[k]})")
    for k in ("keep_sink", "keep_recent", "dense_layers"):
        if k in s and s[k] < 0:
            raise SpecError(f"{where}.{k} must be >= 0 (got {s[k]})")
    if "base" in s:
        _mode(f"{where}.base", s["base"])
    if name == "needle":
        s["depths"] = _list_of(f"{where}.depths", s["depths"], float)
        if any(not 0 <= d <= 1 for d in s["depths"]):
            raise SpecError(f"{where}.depths: every depth must lie in [0, 1] (got {s['depths']})")
        s["budgets"] = _list_of(f"{where}.budgets", s["budgets"], float)
        if not all(0 < b < math.inf for b in s["budgets"]):  # TOML has nan and inf
            raise SpecError(f"{where}.budgets: budgets must be finite and > 0 (got {s['budgets']})")
        if s["method"] not in ("quest", "probe"):
            raise SpecError(f"{where}.method must be quest or probe (got {s['method']!r})")
    return s


def parse_spec(text: str, path: Path) -> list[Cell]:
    """Validate a spec's TOML text and expand it into cells (model-major order: one model load per run)."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"{path}: not valid TOML: {e}") from None
    for k in raw:
        if k != "sweep" and k not in MEASUREMENTS:
            raise SpecError(f"{path}: unknown key {k!r} (allowed: sweep, {', '.join(MEASUREMENTS)})")
    if "sweep" not in raw:
        raise SpecError(f"{path}: no [sweep] table")
    try:
        return _expand(raw, path.parent)
    except SpecError as e:
        raise SpecError(f"{path}: {e}") from None


def _expand(raw: dict[str, Any], root: Path) -> list[Cell]:
    g = _table("sweep", raw["sweep"], SWEEP_KEYS)
    measurements = _list_of("sweep.measurements", g["measurements"], str)
    for i, m in enumerate(measurements):
        if m not in MEASUREMENTS:
            raise SpecError(
                f"sweep.measurements[{i}]: unknown measurement {m!r} (choose from {', '.join(MEASUREMENTS)})"
            )
    for name in MEASUREMENTS:
        if name in raw and name not in measurements:
            raise SpecError(f"[{name}] is given but {name!r} is not in sweep.measurements")
    models = _list_of("sweep.models", g["models"], str, _model(root))
    kvs = _list_of("sweep.kv", g["kv"], str, _mode)
    weights = _list_of("sweep.weights", g["weights"], str, _weights)
    corpora = _list_of("sweep.corpora", g["corpora"], str, _corpus(root))
    contexts = _list_of("sweep.ctx", g["ctx"], int, _ctx)
    cells = []
    for model in models:
        for w in weights:
            for m in measurements:
                s = _section(m, raw.get(m, {}), m)
                params = tuple(
                    sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in s.items() if k != "ctx")
                )
                for corpus in corpora:
                    for ctx in s["ctx"] or contexts:
                        cells += [Cell(m, model, w, kv, corpus, ctx, params) for kv in kvs]
    return cells


def load_spec(path: str | Path) -> Spec:
    p = Path(path)
    check_not_special(p, SpecError, "the sweep spec")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError(f"cannot read the sweep spec {p}: {e}") from None
    return Spec(p, text, parse_spec(text, p))
