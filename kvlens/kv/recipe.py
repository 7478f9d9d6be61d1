"""KV recipes: a per-layer choice of K and V storage kinds, kept in a JSON file.

A recipe is a :class:`~kvlens.kv.modes.KVMode` with ``layers`` set; everything that takes a mode
takes a recipe (``kvlens.load(..., kv="recipe.json")``, ``--kv recipe.json`` in the CLI, the lab and
the server). The file::

    {
      "kvlens_recipe": 1,
      "layers": [{"k": "q8h", "v": "q4h"}, {"k": "f16", "v": "q8h"}, ...],   one entry per layer
      "model": "...", "note": "..."                                          optional, free text
      "k_center": [[[c0, c1, ...], ...], ...]          optional, per layer, per KV head, head_dim floats
      "keep_sink": S                                   optional, the first S positions kept in f16
    }

``keep_sink`` (:attr:`kvlens.kv.modes.KVMode.keep_sink`): the cache also keeps the first S positions
of every layer in an f16 sink store, and attention reads them from there (``kvlens lab plan
--keep-sink S`` writes it). The serving engine's paged pool keeps a sink of at most one block (32
positions) with each sequence's first block; ``kvlens serve`` refuses a longer one.

``k_center`` (K smoothing): the cache subtracts ``k_center[i][h]`` from every K row of layer ``i``,
KV head ``h`` before it stores the row (before the rotation and quantization, in every kind of the
layer: :attr:`kvlens.kv.modes.KVMode.k_center`). Attention is unchanged by it in exact arithmetic;
4-bit K's quantization error shrinks. ``kvlens lab plan --smooth-k`` writes the mean post-RoPE key of
the calibration text. A recipe without it stores keys as they are.

A layer may give its KV heads different kinds (a per-KV-head recipe): ``{"k": ["q8h", "q4h", "q8h"],
"v": "q4h"}`` lists one kind per KV head (a single kind applies to every head of the layer). The
cache then keeps that layer's heads in separate stores (:class:`kvlens.kv.cache.HeadSplitStore`); a
layer whose listed heads agree is stored as one pair, and a listed count the model lacks is refused.

``kvlens lab plan`` writes one (:mod:`kvlens.lab.plan`). A file that does not add up (not JSON, an
unknown kind, a missing key, a layer count the model does not have) is refused with one
``ValueError`` naming the problem; the layer count is checked when the model is known
(:meth:`KVMode.check_layout`), and so is the head count of a per-head layer.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import torch

from ..checks import read_json
from .modes import KVMode, StoreKind

RECIPE_VERSION = 1


class RecipeError(ValueError):
    """A KV recipe file that cannot be used."""


def _kind(value: Any, where: str) -> StoreKind:
    try:
        return StoreKind(value)
    except ValueError:
        choices = ", ".join(k.value for k in StoreKind)
        raise RecipeError(f"{where}: unknown KV kind {value!r}; choose one of: {choices}") from None


def recipe_mode(name: str, layers: list[tuple[StoreKind, StoreKind]]) -> KVMode:
    """A per-layer mode named ``name``; its ``k``/``v`` are the widest kinds it stores."""
    if not layers:
        raise RecipeError(f"KV recipe {name}: no layers")
    widest_k = max((k for k, _ in layers), key=lambda kind: kind.row_bytes(256))
    widest_v = max((v for _, v in layers), key=lambda kind: kind.row_bytes(256))
    return KVMode(name, widest_k, widest_v, layers=tuple(layers))


def head_recipe_mode(name: str, layers: list[list[tuple[StoreKind, StoreKind]]]) -> KVMode:
    """A per-KV-head mode: ``layers[i][h]`` is (K kind, V kind) of head ``h`` of layer ``i``; a layer
    whose heads agree is stored as one layer-wide pair."""
    if not layers or any(not heads for heads in layers):
        raise RecipeError(f"KV recipe {name}: every layer needs at least one KV head")
    pairs = [
        (
            max((k for k, _ in heads), key=lambda kind: kind.row_bytes(256)),
            max((v for _, v in heads), key=lambda kind: kind.row_bytes(256)),
        )
        for heads in layers
    ]
    split = tuple(() if len(set(heads)) == 1 else tuple(heads) for heads in layers)
    mode = recipe_mode(
        name, [heads[0] if not s else p for heads, s, p in zip(layers, split, pairs, strict=True)]
    )
    return dataclasses.replace(mode, heads=split) if any(split) else mode


def _layer_kinds(entry: Any, where: str) -> list[tuple[StoreKind, StoreKind]]:
    """One layer's entry as (K, V) per head (a single pair when neither role lists heads)."""
    if not isinstance(entry, dict) or set(entry) - {"k", "v"} or not {"k", "v"} <= set(entry):
        raise RecipeError(
            f'{where} must be {{"k": KIND, "v": KIND}} (KIND or a list of one per KV head), got {entry!r}'
        )
    lists = [entry[r] for r in ("k", "v") if isinstance(entry[r], list)]
    n_heads = len(lists[0]) if lists else 1
    if any(len(x) != n_heads for x in lists) or n_heads == 0:
        raise RecipeError(f"{where}: K and V list different numbers of KV heads (or none): {entry!r}")
    roles = []
    for r in ("k", "v"):
        names = entry[r] if isinstance(entry[r], list) else [entry[r]] * n_heads
        roles.append(
            [_kind(x, f"{where} {r.upper()}" + (f" head {h}" if lists else "")) for h, x in enumerate(names)]
        )
    return list(zip(*roles, strict=True))


def parse_recipe(data: Any, name: str) -> KVMode:
    """The mode of a recipe's parsed JSON ``data`` (``name``: the file, for messages and the mode)."""
    if not isinstance(data, dict) or data.get("kvlens_recipe") != RECIPE_VERSION:
        raise RecipeError(f'{name} is not a kvlens KV recipe (expected an object with "kvlens_recipe": 1)')
    layers = data.get("layers")
    if not isinstance(layers, list) or not layers:
        raise RecipeError(f'{name}: "layers" must be a non-empty list of {{"k": KIND, "v": KIND}}')
    mode = head_recipe_mode(
        name, [_layer_kinds(entry, f"{name} layer {i}") for i, entry in enumerate(layers)]
    )
    listed = tuple(next((len(e[r]) for r in ("k", "v") if isinstance(e[r], list)), 0) for e in layers)
    mode = dataclasses.replace(mode, listed_kv_heads=listed)  # a layer whose listed heads agree folds
    if "keep_sink" in data:
        try:
            mode = dataclasses.replace(mode, keep_sink=data["keep_sink"])
        except ValueError as e:
            raise RecipeError(f"{name}: {e}") from None
    if "k_center" not in data:
        return mode
    return dataclasses.replace(mode, k_center=parse_k_center(data["k_center"], len(layers), name))


def _center_row(row: Any, where: str) -> list[float]:
    if not isinstance(row, list) or not row:
        raise RecipeError(f"{where} must be a non-empty list of numbers, got {str(row)[:60]}")
    for j, x in enumerate(row):
        if isinstance(x, bool) or not isinstance(x, int | float):
            raise RecipeError(f"{where} value {j} is {x!r}, not a number")
        if not math.isfinite(x) or abs(x) > 3.4e38:
            raise RecipeError(f"{where} value {j} is {x!r}, not a finite float32")
    return [float(x) for x in row]


def parse_k_center(value: Any, n_layers: int, name: str) -> torch.Tensor:
    """A recipe's ``k_center`` as float32 ``[n_layers, n_kv_heads, head_dim]``: one list per layer of
    one list per KV head of head_dim numbers, the same counts in every layer; else one RecipeError
    naming the layer and head."""
    if not isinstance(value, list) or len(value) != n_layers:
        got = f"{len(value)} entries" if isinstance(value, list) else repr(value)[:40]
        raise RecipeError(f'{name}: "k_center" must list one entry per layer ({n_layers}), got {got}')
    rows: list[list[list[float]]] = []
    for i, heads in enumerate(value):
        if not isinstance(heads, list) or not heads:
            raise RecipeError(f"{name} k_center layer {i} must be a list of one list per KV head")
        rows.append([_center_row(r, f"{name} k_center layer {i} head {h}") for h, r in enumerate(heads)])
        n_kv, d = len(rows[0]), len(rows[0][0])
        if len(rows[i]) != n_kv:
            raise RecipeError(f"{name} k_center layer {i} has {len(rows[i])} KV heads; layer 0 has {n_kv}")
        for h, r in enumerate(rows[i]):
            if len(r) != d:
                raise RecipeError(  # which length is right is the model's to say (KVMode.check_layout)
                    f"{name} k_center layer {i} head {h} has {len(r)} values, layer 0 head 0 has {d}: "
                    "every row holds head_dim values"
                )
    return torch.tensor(rows, dtype=torch.float32)


def with_k_center(mode: KVMode, center: torch.Tensor | None) -> KVMode:
    """``mode`` with the K centers ``center`` (float32 [n_layers, n_kv, head_dim]; None: without)."""
    if center is not None:
        center = center.detach().to("cpu", torch.float32).clone()  # its own copy: the digest stays true
    return dataclasses.replace(mode, k_center=center)


def load_recipe(path: str | Path) -> KVMode:
    """The recipe in the JSON file ``path`` as a :class:`KVMode` named by the path."""
    return parse_recipe(read_json(path, RecipeError, "KV recipe"), str(path))


def layer_json(mode: KVMode, layer: int) -> dict[str, str | list[str]]:
    """The recipe entry of ``layer``: a kind per role, or a list per KV head where the heads differ."""
    heads = mode.head_kinds(layer)
    if heads is None:
        k, v = mode.kinds(layer)
        return {"k": str(k), "v": str(v)}
    out: dict[str, str | list[str]] = {}
    for role, kinds in zip(("k", "v"), zip(*heads, strict=True), strict=True):
        out[role] = str(kinds[0]) if len(set(kinds)) == 1 else [str(x) for x in kinds]
    return out


def mix(mode: KVMode, n_layers: int, n_kv: int) -> str:
    """How many (layer, KV head) pairs store each (K, V) pair, e.g. ``60x K q8h / V q8h, 30x K q8h / V q4h``."""
    counts: dict[str, int] = {}
    for i in range(n_layers):
        for k, v in mode.head_kinds(i) or (mode.kinds(i),) * n_kv:
            counts[f"K {k} / V {v}"] = counts.get(f"K {k} / V {v}", 0) + 1
    return ", ".join(f"{n}x {pair}" for pair, n in sorted(counts.items(), key=lambda x: -x[1]))


def recipe_json(mode: KVMode, n_layers: int, **meta: Any) -> dict[str, Any]:
    """The JSON object of ``mode`` over ``n_layers`` layers (a uniform mode is written out per layer)."""
    layers = [layer_json(mode, i) for i in range(n_layers)]
    out = {"kvlens_recipe": RECIPE_VERSION, **meta, "layers": layers}
    if mode.keep_sink:
        out["keep_sink"] = mode.keep_sink
    if mode.k_center is not None:  # float32 values print as the shortest double that reads back exactly
        out["k_center"] = mode.k_center.tolist()
    return out


def save_recipe(mode: KVMode, n_layers: int, path: str | Path, **meta: Any) -> None:
    """Write ``mode`` as a recipe file (``meta``: extra keys such as the model and the budget)."""
    data = recipe_json(mode, n_layers, **meta)
    center = data.pop("k_center", None)
    text = json.dumps(data, indent=1)
    if center is not None:  # one line per layer, not one per float
        rows = ",\n".join(f"  {json.dumps(layer)}" for layer in center)
        text = text.removesuffix("\n}") + ',\n "k_center": [\n' + rows + "\n ]\n}"
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)  # --out was checked writable (cli_args.check_output_path)
    path.write_text(text + "\n", encoding="utf-8")
