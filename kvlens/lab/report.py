"""Shared output of the lab commands: loading, progress bars, rich tables, Markdown + PNG reports.

Terminal output goes to stdout (tables, llama-perplexity blocks) and stderr (progress), so that
``--json`` can print nothing but JSON on stdout.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from ..kv.modes import MODES, KVMode


def parse_modes(spec: str | Sequence[str | KVMode]) -> list[KVMode]:
    """KV modes from a comma list (``all`` = every mode of kvlens.kv.modes.MODES; de-duplicated) or a
    list (kept as given)."""
    if not isinstance(spec, str):
        return [KVMode.parse(m) for m in spec]
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if names == ["all"]:
        return list(MODES.values())
    if not names:
        raise ValueError(f"no KV mode given; choose from: {', '.join(MODES)}")
    return list(dict.fromkeys(KVMode.parse(n) for n in names))


def load_lab(model: str, corpus: str | None, base: str | KVMode, weights: str = "f32"):
    """(llm, corpus text, corpus label): one model load for every mode; the torch (reference) backend.

    By default weights are dequantized to f32 (what HF transformers runs): the lab isolates the KV
    cache, and the f32 GEMMs are the fastest CPU path for the batched prefills it runs. ``weights``
    (auto, bf16, int8, int4) keeps them quantized instead, for the base and every mode alike.
    """
    import kvlens

    from ..models.loader import check_weights_mode
    from .corpus import load_corpus

    base = KVMode.parse(base)
    check_weights_mode(weights)
    llm = kvlens.load(model, kv=base, attn_backend="torch", weights=weights)
    text, label = load_corpus(corpus)
    return llm, text, label


def load_reference(model: str, llm: Any):
    """The f32-weights model beside ``llm`` (None when ``llm`` already has f32 weights): the reference,
    with an f32 cache, that the weights' own cost is measured against."""
    if getattr(llm, "weights_mode", "f32") == "f32":
        return None
    import kvlens

    return kvlens.load(model, kv="f32", attn_backend="torch", weights="f32")


def model_name(llm: Any) -> str:
    return getattr(llm.config, "name", None) or str(getattr(llm, "source", "model"))


# -- terminal --------------------------------------------------------------------------------------
@contextmanager
def progress(total: int, description: str, enabled: bool = True) -> Iterator[Callable[[str], None]]:
    """A rich progress bar on stderr; yields ``step(label)`` that advances it by one."""
    if not enabled:
        yield lambda _label="": None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*cols, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=total)

        def step(label: str = "") -> None:
            bar.update(task, advance=1, description=f"{description} {label}".rstrip())

        yield step


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]], width: int = 120) -> None:
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


def dump_json(obj: Any) -> str:
    """JSON with NaN/Inf as null (strict JSON readers reject NaN)."""

    def clean(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        if isinstance(x, (float, np.floating)):
            return float(x) if math.isfinite(x) else None
        if isinstance(x, np.integer):
            return int(x)
        return x

    return json.dumps(clean(obj), indent=2, ensure_ascii=False)


# -- report files ------------------------------------------------------------------------------------
def write_markdown(out_dir: str | Path, name: str, text: str) -> Path:
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    path = d / name
    path.write_text(text, encoding="utf-8")
    return path


def _figure():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    return plt


def plot_kld(kld_by_mode: dict[str, np.ndarray], path: Path) -> Path:
    """Distribution of per-token KLD, one step histogram per mode, log10 x axis (0 clipped to 1e-12)."""
    plt = _figure()
    fig, ax = plt.subplots(figsize=(7, 4))
    logs = {m: np.log10(np.maximum(k, 1e-12)) for m, k in kld_by_mode.items()}
    lo = min(float(v.min()) for v in logs.values())
    hi = max(float(v.max()) for v in logs.values())
    bins = np.linspace(lo, hi + 1e-9, 60)
    for m, v in logs.items():
        ax.hist(v, bins=bins, histtype="step", linewidth=1.5, label=f"{m} (mean {kld_by_mode[m].mean():.2e})")
    ax.set_xlabel("log10 KLD(base ‖ mode) per scored token (≤ 1e-12 drawn at -12)")
    ax.set_ylabel("tokens")
    ax.legend(fontsize=8)
    ax.set_title("Per-token KL divergence from the base")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_layers(err_by_mode: dict[str, np.ndarray], path: Path) -> Path:
    """Per-layer relative attention-output error (one line per mode, worst KV head dotted), log y."""
    plt = _figure()
    fig, ax = plt.subplots(figsize=(7, 4))
    for (
        m,
        e,
    ) in err_by_mode.items():  # e: [layers, kv_heads]; all heads 0 (exact mode) cannot be drawn on log y
        if not np.any(e > 0):
            continue
        (line,) = ax.plot(
            np.sqrt((e**2).mean(axis=1)), marker="o", markersize=3, label=f"{m} (RMS over heads)"
        )
        ax.plot(e.max(axis=1), linestyle=":", color=line.get_color(), linewidth=1)
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("relative attention-output error")
    ax.set_title("Per-layer error (dotted: worst KV head)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_divergence(first_div: dict[str, list[int]], n_tokens: int, path: Path) -> Path:
    """Histogram of the first diverging greedy token per mode; bar at n_tokens = never diverged."""
    plt = _figure()
    fig, ax = plt.subplots(figsize=(7, 4))
    bins = np.arange(n_tokens + 2) - 0.5
    ax.hist(list(first_div.values()), bins=bins, label=list(first_div), histtype="bar")
    ax.set_xlabel(f"first diverging generated token (index; {n_tokens} = identical)")
    ax.set_ylabel("prompts")
    ax.set_title("Greedy: where each mode first leaves the base's continuation")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
