"""``kvlens lab needle``: can the model still find a fact in a long context — exact, q8, sparse q8?

A short fact ("The special magic number is 48213.") is placed at a chosen depth of real-text
filler, a question ends the prompt, and the model answers greedily. Recall = the number appears in
the answer. For every (context, depth) the prompt is prefilled once per cache type (f32, q8 with
block bounds); dense q8 and every sparse budget then decode from the same q8 prefill (the cache is
rewound between them), so the only variable is how decode attends the history.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..checks import check_counts, check_field_types, check_float, check_list_fields
from ..engine.llm import LLM
from ..kv.blocks import SparseConfig
from ..kv.modes import MODES, CacheOptions, KVMode
from ..models.loader import check_weights_mode
from ..report import CommandOutput, figure, print_table, run_command, save_figure

QUESTION = "\n\nQuestion: What is the special magic number mentioned in the text above?\nAnswer: The special magic number is"
ANSWER_TOKENS = 8


@dataclass
class NeedleRow:
    ctx: int
    depth: float
    mode: str
    recalled: bool
    answer: str
    needle: str


def build_prompt(
    llm: LLM, filler_ids: list[int], ctx: int, depth: float, secret: str, reserved: int = 0
) -> list[int]:
    """``ctx - reserved`` tokens (``reserved``: the answer's, which count in the context): filler with
    the fact inserted at ``depth`` (0 = start, 1 = just before the question)."""
    tok = llm.tokenizer
    fact = tok.encode(f" The special magic number is {secret}. Remember it: {secret}. ", add_bos=False)
    question = tok.encode(QUESTION, add_bos=False)
    bos = tok.bos_prefix
    n_filler = ctx - reserved - len(fact) - len(question) - len(bos)
    # name the context the user gave, and the least that holds the prompt, 16 filler tokens and the answer
    if n_filler < 16:
        raise ValueError(
            f"context {ctx} is too short for the needle prompt: it needs at least {ctx - n_filler + 16}"
        )
    if len(filler_ids) < n_filler:
        raise ValueError(f"the filler corpus has {len(filler_ids)} tokens; context {ctx} needs {n_filler}")
    at = round(depth * n_filler)
    return bos + filler_ids[:at] + fact + filler_ids[at:n_filler] + question


def answer(llm: LLM, cache, logits: torch.Tensor, pos: int) -> str:
    ids = list(llm.decode(cache, logits, pos, ANSWER_TOKENS))
    cache.truncate(pos)
    return llm.tokenizer.decode(ids, skip_special=True)


@dataclass
class NeedleConfig:
    """``kvlens lab needle``: contexts ``ctx`` × needle depths, f32 dense vs ``kv`` dense vs ``kv``
    sparse (``sparse`` method) at each of ``sparse_budget``; ``seed`` picks the secret numbers; the
    model runs with ``weights`` (default: the file's own precision)."""

    model: str = "smollm2"
    weights: str = "auto"
    corpus: str | None = None
    kv: KVMode | str = "q8"
    ctx: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192])
    depth: list[float] = field(default_factory=lambda: [0.1, 0.5, 0.9])
    sparse: str = "quest"
    sparse_budget: list[float] = field(default_factory=lambda: [0.125, 0.25])
    dense_layers: int = 2
    seed: int = 0
    plot: str | None = None

    def __post_init__(self) -> None:
        check_field_types(self)
        check_list_fields(
            self, {"ctx": int, "depth": float, "sparse_budget": float}, may_be_empty=("sparse_budget",)
        )
        check_counts(self, "ctx")
        check_counts(self, "dense_layers", minimum=0)
        for budget in self.sparse_budget:  # tokens (≥ 1) or a fraction of the context, as the CLI's
            check_float(budget, "--sparse-budget", above=0.0)
        SparseConfig(self.sparse)  # a method it knows
        self.kv = KVMode.parse(self.kv)
        check_weights_mode(self.weights)  # before the (slow) load
        for d in self.depth:
            if not 0 <= d <= 1:
                raise ValueError(f"depth {d} must lie in [0, 1]")


def run_needle(
    llm: LLM, filler: str, cfg: NeedleConfig, progress: Callable[[int, float], None] | None = None
) -> list[NeedleRow]:
    contexts, depths, budgets, method, kv = cfg.ctx, cfg.depth, cfg.sparse_budget, cfg.sparse, cfg.kv
    seed, dense_layers = cfg.seed, cfg.dense_layers
    filler_ids = llm.tokenizer.encode(filler, add_bos=False)
    rng = random.Random(seed)
    rows: list[NeedleRow] = []
    for ctx in contexts:
        llm.check_fits(ctx)
        for depth in depths:
            secret = str(rng.randint(10_000, 99_999))
            # the answer's tokens count in the context: the prompt takes the rest
            ids = build_prompt(llm, filler_ids, ctx, depth, secret, reserved=ANSWER_TOKENS)
            runs: list[tuple[str, LLM, KVMode]] = [
                ("f32 dense", llm.variant(kv=MODES["f32"], sparse=None), MODES["f32"]),
                (f"{kv} dense", llm.variant(kv=kv, sparse=None), kv),
            ]
            runs += [
                (
                    f"{kv} {method} {b:g}",
                    llm.variant(kv=kv, sparse=SparseConfig(method, b, dense_layers, 0)),
                    kv,
                )
                for b in budgets
            ]
            prefilled: dict[KVMode, tuple] = {}
            for name, variant, mode in runs:
                if mode not in prefilled:  # one prefill per cache type; decode variants share it
                    cache = variant.new_cache(len(ids) + ANSWER_TOKENS, mode, CacheOptions(track_blocks=True))
                    prefilled[mode] = (cache, variant.prefill(ids, cache))
                cache, logits = prefilled[mode]
                text = answer(variant, cache, logits, len(ids))
                rows.append(NeedleRow(ctx, depth, name, secret in text, text.strip(), secret))
            if progress:
                progress(ctx, depth)
    return rows


def recall_table(rows: list[NeedleRow]) -> dict[str, dict[int, float]]:
    """mode → context → recall over depths."""
    out: dict[str, dict[int, list[bool]]] = {}
    for r in rows:
        out.setdefault(r.mode, {}).setdefault(r.ctx, []).append(r.recalled)
    return {m: {c: sum(v) / len(v) for c, v in by_ctx.items()} for m, by_ctx in out.items()}


def plot_heatmap(rows: list[NeedleRow], path: str) -> None:
    """One panel per mode: depth × context → recalled (1) or not (0)."""
    plt = figure()
    modes = list(dict.fromkeys(r.mode for r in rows))
    ctxs = sorted({r.ctx for r in rows})
    depths = sorted({r.depth for r in rows})
    fig, axes = plt.subplots(1, len(modes), figsize=(2.2 * len(modes) + 1, 2.8), squeeze=False)
    for ax, mode in zip(axes[0], modes, strict=True):
        grid = torch.zeros(len(depths), len(ctxs))
        for r in rows:
            if r.mode == mode:
                grid[depths.index(r.depth), ctxs.index(r.ctx)] = float(r.recalled)
        ax.imshow(grid.numpy(), vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_title(mode, fontsize=8)
        ax.set_xticks(range(len(ctxs)), [str(c) for c in ctxs], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=7)
        ax.set_xlabel("context", fontsize=7)
    axes[0][0].set_ylabel("needle depth", fontsize=7)
    save_figure(fig, path, dpi=120)


def render(rows: list[NeedleRow], cfg: NeedleConfig, label: str, source: str, weights: str) -> None:
    table = recall_table(rows)
    ctxs = sorted({r.ctx for r in rows})
    depths = ",".join(f"{d:g}" for d in cfg.depth)
    print_table(
        f"needle recall over depths {depths} — filler: {label}, {source}, weights {weights}",
        ["mode", *(f"ctx {c}" for c in ctxs)],
        [[mode, *(f"{100 * by_ctx[c]:.0f}%" for c in ctxs)] for mode, by_ctx in table.items()],
        width=0,
    )


def main(cfg: NeedleConfig, json_out: bool = False) -> list[NeedleRow]:
    """The body of ``kvlens lab needle``."""
    import kvlens

    from ..corpus import load_corpus

    llm = kvlens.load(cfg.model, kv=cfg.kv, weights=cfg.weights)
    text, label = load_corpus(cfg.corpus)
    output = CommandOutput(
        lambda rows: render(rows, cfg, label, llm.source.name, llm.weights_mode),
        lambda rows: {"weights": llm.weights_mode, "rows": rows, "recall": recall_table(rows)},
    )

    def run(step: Callable[[str], None]) -> list[NeedleRow]:
        rows = run_needle(llm, text, cfg, progress=lambda c, d: step(f"ctx {c} depth {d:g}"))
        if cfg.plot:
            plot_heatmap(rows, cfg.plot)
            print(f"wrote {cfg.plot}", file=sys.stderr)
        return rows

    return run_command("lab needle", len(cfg.ctx) * len(cfg.depth), run, output, json_out)
