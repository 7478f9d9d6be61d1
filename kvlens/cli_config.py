"""From command-line options to the commands' config values: name lists, sparse policies, and a
config dataclass filled from the options of the same names (numbers: :mod:`kvlens.cli_args`)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

from typer import Option

from . import cli_args as cb


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


def names(text: str | None) -> list[str] | None:
    """A comma list of names (None stays None); a KV mode ``k=KIND,v=KIND`` stays one name."""
    from .kv.modes import split_mode_list

    return None if text is None else split_mode_list(text)


MODEL_HELP = "'smollm2' (the embedded default), 'gemma3-270m', a .gguf file, or an HF model directory"
KV_HELP = (
    "KV cache mode: f32, f16, bf16, q8, q8-k, q8-v, q8+mirror, q8h, q4, q4h, k=KIND,v=KIND, or a recipe .json"
)
# -- options shared by several commands (typer copies an Option object for each command) ----------------
LAB_KV_HELP = "Comma list of KV modes to test (or 'all'): " + KV_HELP.split(": ", 1)[1]
LAB_CORPUS_HELP = "Built-in corpus name or a UTF-8 file (default: britannica)."
LAB_WEIGHTS_HELP = (
    "Weights for the base and all KV modes: f32, bf16, int8, int4 or auto (the file's own). Not f32: "
    "also measured against f32 weights + f32 KV (a second model)."
)
MODEL = Option("smollm2", help=MODEL_HELP)
CORPUS = Option(None, help=LAB_CORPUS_HELP)
KV = Option("q8,q8-k,q8-v,f16", help=LAB_KV_HELP)
BASE = Option("f32", help="Baseline KV mode, computed in the same run.")
WEIGHTS = Option("f32", help=LAB_WEIGHTS_HELP)
PREFILL = Option(32, min=1, help="Prefill sub-chunk size in tokens (see the command's output).")
SINK = Option(0, min=0, help="Keep the first S positions (the attention sink) in an f16 sink store.")
RECENT = Option(0, min=0, help="Keep the last R positions exact.")
JSON = Option(False, "--json", help="Print JSON instead of tables.")
REPORT = Option(None, help="Write Markdown + PNG plots here.", callback=cb.output_dir_option)
SPARSE = Option(None, help="Sparse decode for the test modes: quest or probe (default: dense).")
BUDGET = Option(0.25, help="Sparse budget: tokens, or a context fraction (< 1).", callback=cb.budget_option)
DENSE = Option(2, min=0, help="First layers kept dense under --sparse.")
LAB_ATTN_BACKEND = Option(
    None,
    help="Test side's attention through a decode kernel: numba, numba-int, numba-int16 (:PATH: CPU path).",
    callback=cb.backend_option,
)


# The options of every command that compares KV modes against a base (lab ppl, greedy; lab.common's
# CompareConfig): declared once here and appended to each such command by :func:`compare_options`.
COMPARE_OPTIONS: dict[str, tuple[Any, Any]] = {
    "model": (str, MODEL),
    "corpus": (str | None, CORPUS),
    "kv": (str, KV),
    "base": (str, BASE),
    "weights": (str, WEIGHTS),
    "prefill_chunk": (int, PREFILL),
    "keep_sink": (int, SINK),
    "keep_recent": (int, RECENT),
    "json_out": (bool, JSON),
    "report": (str | None, REPORT),
    "sparse": (str | None, SPARSE),
    "sparse_budget": (float, BUDGET),
    "sparse_dense_layers": (int, DENSE),
}


def compare_options(command: Callable[..., None]) -> Callable[..., None]:
    """Append :data:`COMPARE_OPTIONS` to a command's own options; the command takes them as
    ``**shared``. typer reads the parameters from ``__signature__`` and the types from
    ``__annotations__``, so both are extended."""
    sig = inspect.signature(command, eval_str=True)
    own = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
    shared = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=kind)
        for name, (kind, option) in COMPARE_OPTIONS.items()
    ]

    @functools.wraps(command)
    def run(**options: Any) -> None:
        command(**options)

    run.__signature__ = sig.replace(parameters=own + shared)
    run.__annotations__ = {p.name: p.annotation for p in own + shared} | {"return": None}
    return run
