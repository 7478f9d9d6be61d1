"""KV recipes: a per-layer choice of K and V storage kinds, kept in a JSON file.

A recipe is a :class:`~kvlens.kv.modes.KVMode` with ``layers`` set; everything that takes a mode
takes a recipe (``kvlens.load(..., kv="recipe.json")``, ``--kv recipe.json`` in the CLI, the lab and
the server). The file::

    {
      "kvlens_recipe": 1,
      "layers": [{"k": "q8h", "v": "q4h"}, {"k": "f16", "v": "q8h"}, ...],   one entry per layer
      "model": "...", "note": "..."                                          optional, free text
    }

``kvlens lab plan`` writes one (:mod:`kvlens.lab.plan`). A file that does not add up (not JSON, an
unknown kind, a missing key, a layer count the model does not have) is refused with one
``ValueError`` naming the problem; the layer count is checked when the model is known
(:meth:`KVMode.check_layout`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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


def parse_recipe(data: Any, name: str) -> KVMode:
    """The mode of a recipe's parsed JSON ``data`` (``name``: the file, for messages and the mode)."""
    if not isinstance(data, dict) or data.get("kvlens_recipe") != RECIPE_VERSION:
        raise RecipeError(f'{name} is not a kvlens KV recipe (expected an object with "kvlens_recipe": 1)')
    layers = data.get("layers")
    if not isinstance(layers, list) or not layers:
        raise RecipeError(f'{name}: "layers" must be a non-empty list of {{"k": KIND, "v": KIND}}')
    out = []
    for i, entry in enumerate(layers):
        if not isinstance(entry, dict) or set(entry) - {"k", "v"} or not {"k", "v"} <= set(entry):
            raise RecipeError(f'{name}: layer {i} must be {{"k": KIND, "v": KIND}}, got {entry!r}')
        out.append((_kind(entry["k"], f"{name} layer {i} K"), _kind(entry["v"], f"{name} layer {i} V")))
    return recipe_mode(name, out)


def load_recipe(path: str | Path) -> KVMode:
    """The recipe in the JSON file ``path`` as a :class:`KVMode` named by the path."""
    name = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise RecipeError(f"cannot read KV recipe {name}: {e.strerror or e}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise RecipeError(f"KV recipe {name} is not valid JSON ({e.msg}, line {e.lineno})") from None
    return parse_recipe(data, name)


def recipe_json(mode: KVMode, n_layers: int, **meta: Any) -> dict[str, Any]:
    """The JSON object of ``mode`` over ``n_layers`` layers (a uniform mode is written out per layer)."""
    layers = [{"k": str(k), "v": str(v)} for k, v in (mode.kinds(i) for i in range(n_layers))]
    return {"kvlens_recipe": RECIPE_VERSION, **meta, "layers": layers}


def save_recipe(mode: KVMode, n_layers: int, path: str | Path, **meta: Any) -> None:
    """Write ``mode`` as a recipe file (``meta``: extra keys such as the model and the budget)."""
    Path(path).write_text(json.dumps(recipe_json(mode, n_layers, **meta), indent=1) + "\n", encoding="utf-8")
