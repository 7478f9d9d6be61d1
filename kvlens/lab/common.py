"""What the lab commands share: KV-mode lists, the lab config, model and corpus loading, figures.

Generic output (tables, progress, JSON, Markdown, the command skeleton) is :mod:`kvlens.report`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..checks import check_counts, check_field_types
from ..kv.blocks import SparseConfig
from ..kv.modes import MODES, CacheOptions, KVMode, split_mode_list
from ..models.loader import check_weights_mode
from ..report import figure, label_axes, save_figure


def parse_modes(spec: str | Sequence[str | KVMode]) -> list[KVMode]:
    """KV modes from a comma list (``all`` = every mode of kvlens.kv.modes.MODES; de-duplicated) or a
    list (kept as given)."""
    if not isinstance(spec, str):
        if not isinstance(spec, (list, tuple)):
            raise TypeError(f"kv must be a comma list or a list of modes, got {type(spec).__name__} {spec!r}")
        if not spec:  # a run of no mode would return no rows
            raise ValueError(f"no KV mode given; choose from: {', '.join(MODES)}")
        return [KVMode.parse(m) for m in spec]
    names = split_mode_list(spec)
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

    from ..corpus import load_corpus

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


# -- figures ---------------------------------------------------------------------------------------
def plot_kld(kld_by_mode: dict[str, np.ndarray], path: Path) -> Path:
    """Distribution of per-token KLD, one step histogram per mode, log10 x axis (0 clipped to 1e-12)."""
    plt = figure()
    fig, ax = plt.subplots(figsize=(7, 4))
    logs = {m: np.log10(np.maximum(k, 1e-12)) for m, k in kld_by_mode.items()}
    lo = min(float(v.min()) for v in logs.values())
    hi = max(float(v.max()) for v in logs.values())
    bins = np.linspace(lo, hi + 1e-9, 60)
    for m, v in logs.items():
        ax.hist(v, bins=bins, histtype="step", linewidth=1.5, label=f"{m} (mean {kld_by_mode[m].mean():.2e})")
    label_axes(
        ax, "log10 KLD(base ‖ mode) per scored token (≤ 1e-12 drawn at -12)", "tokens",
        "Per-token KL divergence from the base",
    )  # fmt: skip
    return save_figure(fig, path)


def plot_layers(err_by_mode: dict[str, np.ndarray], path: Path) -> Path:
    """Per-layer relative attention-output error (one line per mode, worst KV head dotted), log y."""
    plt = figure()
    fig, ax = plt.subplots(figsize=(7, 4))
    for m, e in err_by_mode.items():  # e: [layers, kv_heads]; all 0 (exact mode) cannot be drawn on log y
        if not np.any(e > 0):
            continue
        (line,) = ax.plot(
            np.sqrt((e**2).mean(axis=1)), marker="o", markersize=3, label=f"{m} (RMS over heads)"
        )
        ax.plot(e.max(axis=1), linestyle=":", color=line.get_color(), linewidth=1)
    ax.set_yscale("log")
    label_axes(ax, "layer", "relative attention-output error", "Per-layer error (dotted: worst KV head)")
    return save_figure(fig, path)


def plot_divergence(first_div: dict[str, list[int]], n_tokens: int, path: Path) -> Path:
    """Histogram of the first diverging greedy token per mode; bar at n_tokens = never diverged."""
    plt = figure()
    fig, ax = plt.subplots(figsize=(7, 4))
    bins = np.arange(n_tokens + 2) - 0.5
    ax.hist(list(first_div.values()), bins=bins, label=list(first_div), histtype="bar")
    label_axes(
        ax, f"first diverging generated token (index; {n_tokens} = identical)", "prompts",
        "Greedy: where each mode first leaves the base's continuation",
    )  # fmt: skip
    return save_figure(fig, path)


# -- configs -----------------------------------------------------------------------------------------
@dataclass
class LabConfig:
    """Options of every lab command that runs a model over a corpus (built by the CLI, passed whole).

    ``kv``: the KV modes under test (a comma list or names are parsed into :class:`KVMode`);
    ``keep_sink`` / ``keep_recent``: positions kept exact in the test modes' caches."""

    model: str = "smollm2"
    corpus: str | None = None
    kv: list[KVMode] | str = "q8"
    keep_sink: int = 0
    keep_recent: int = 0

    def __post_init__(self) -> None:
        check_field_types(self)
        self.kv = parse_modes(self.kv)
        self.cache_options  # noqa: B018 - validates keep_sink / keep_recent now

    @property
    def cache_options(self) -> CacheOptions:
        """The test modes' cache options."""
        return CacheOptions(keep_sink=self.keep_sink, keep_recent=self.keep_recent)


@dataclass
class CompareConfig(LabConfig):
    """A lab command comparing test modes with a ``base`` mode on one model: ``weights`` for the base
    and every mode, test modes prefilled in sub-chunks of ``prefill_chunk`` tokens, optionally with
    sparse decode (``sparse``)."""

    base: KVMode | str = "f32"
    weights: str = "f32"
    prefill_chunk: int = 32
    sparse: SparseConfig | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.base = KVMode.parse(self.base)
        check_weights_mode(self.weights)
        check_counts(self, "prefill_chunk", minimum=None)  # an int (the range is said below)
        if self.prefill_chunk < 1:
            raise ValueError(f"--prefill-chunk must be at least 1 (got {self.prefill_chunk})")

    def same_as_base(self, mode: KVMode) -> bool:
        """A mode equal to the base, with no kept-exact positions, runs the base's own path."""
        return mode == self.base and not (self.keep_sink or self.keep_recent)


def weights_label(r: Any, m: Any, short: bool = False) -> str:
    """A row of a compare result's vs-f32-weights table (``r``: ppl's or greedy's result, ``m`` one of
    its modes): ``weights int8 · KV q8`` (short: ``int8 · q8``)."""
    label = f"{r.weights} · {m.mode}" if short else f"weights {r.weights} · KV {m.mode}"
    return label + (" (base)" if m.mode == r.base else "")


def vs_f32_json(r: Any, mode_json: Any) -> list[dict[str, Any]]:
    """A compare result's vs-f32-weights rows as JSON (``mode_json(m)``: one mode's own fields)."""
    return [
        {"label": weights_label(r, m), "weights": r.weights, "kv": m.mode.name} | mode_json(m)
        for m in r.vs_f32_weights
    ]


def kept_exact_line(r: Any) -> list[str]:
    """The header line naming the kept-exact positions of the test modes (none: no line)."""
    if not (r.keep_sink or r.keep_recent):
        return []
    return [
        f"kept in test modes: first {r.keep_sink} positions in the f16 sink store, last {r.keep_recent} exact"
    ]


REF_KV = MODES["f32"]  # the KV mode of the f32-weights reference model
VS_F32_TITLE = "cost vs f32 weights + f32 KV"


def header_notes(r: Any, compared: str, reference_tail: str = "") -> list[str]:
    """The header lines shared by the compare commands' results ``r``: the kept-exact positions and,
    with an f32-weights reference, what it is (``compared``: what the base with the same weights is
    compared by)."""
    lines = kept_exact_line(r)
    if r.vs_f32_weights:
        lines.append(
            f"weights {r.weights} for the base and every mode ({compared} the base with the same weights); "
            f"reference for '{VS_F32_TITLE}': a second model with f32 weights, KV {REF_KV}{reference_tail}"
        )
    return lines


def load_compare(cfg: CompareConfig):
    """(llm, f32-weights reference or None, corpus text, corpus label) for a :class:`CompareConfig`."""
    llm, text, label = load_lab(cfg.model, cfg.corpus, cfg.base, cfg.weights)
    return llm, load_reference(cfg.model, llm), text, label
