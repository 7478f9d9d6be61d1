"""``kvlens lab plan``: a per-layer KV recipe chosen by measurement, then verified on held-out text.

1. Sensitivity (calibration chunks): for every layer and for K and V apart, the mean KL divergence
   from the f32 cache when only that layer's K (or V) is stored in a candidate kind (q8h, q4h, ...)
   and every other row stays f32 — llama-perplexity's protocol of :mod:`.ppl` (second half of each
   chunk scored), one forward per (layer, role, kind, chunk).
2. Choice: per (layer, role) the options are f16 (the fallback, counted as KLD 0) and the candidates;
   treating the layers' KLDs as additive (first order in small perturbations), a greedy
   multiple-choice knapsack takes, step by step, the downgrade saving the most bytes per unit of
   KLD that keeps the sum within the working budget. The recipe is then measured on the calibration
   chunks; while it exceeds the budget, the working budget shrinks by the excess (3 rounds at most).
3. Verification (held-out chunks, never seen by 1-2): the recipe and the comparison modes against
   f32, KLD mean ± its standard error, bytes per token against f16 and q8.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..engine.llm import LLM
from ..kv.modes import MODES, KVMode, StoreKind
from ..kv.recipe import recipe_mode, save_recipe
from ..report import print_table
from .common import CompareConfig, load_compare, model_name
from .ppl import BaseLogProbs, PplConfig, _PplRun, chunk_metrics, make_chunks, scored_logits, scored_span

F32, F16 = StoreKind.F32, StoreKind.F16
ROLES = ("k", "v")
SHRINK_ROUNDS = 3


@dataclass
class PlanConfig(CompareConfig):
    """``kvlens lab plan``: the budget, the chunks (calibration, then held-out), the candidate kinds
    and the recipe file; ``kv``: the modes the verification sets beside the recipe."""

    kld_budget: float = 0.002
    ctx: int = 512
    calib_chunks: int = 2
    heldout_chunks: int = 4
    candidates: list[StoreKind] | str = "q8h,q4h"
    out: str = "recipe.json"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.kld_budget > 0:
            raise ValueError(f"--kld-budget must be > 0, got {self.kld_budget}")
        if isinstance(self.candidates, str):
            self.candidates = [_kind(c) for c in self.candidates.split(",") if c.strip()]
        if not self.candidates:
            raise ValueError("--candidates names no KV kind")


def _kind(name: str) -> StoreKind:
    try:
        return StoreKind(name.strip())
    except ValueError:
        raise ValueError(
            f"unknown KV kind {name!r}; choose from: {', '.join(k.value for k in StoreKind)}"
        ) from None


def single_layer_mode(n_layers: int, layer: int, role: str, kind: StoreKind) -> KVMode:
    """Every row f32 except ``layer``'s K (``role="k"``) or V, stored as ``kind``."""
    layers = [(F32, F32)] * n_layers
    layers[layer] = (kind, F32) if role == "k" else (F32, kind)
    return recipe_mode(f"L{layer}.{role}={kind}", layers)


class Sensitivity:
    """Mean KLD per (layer, role, kind) over the calibration chunks (one forward each)."""

    def __init__(self, llm: LLM, chunks: list[list[int]], cfg: PlanConfig) -> None:
        self.llm, self.chunks, self.cfg = llm, chunks, cfg
        self.first = scored_span(cfg.ctx)[0]
        self.bases = [BaseLogProbs(scored_logits(llm, c, MODES["f32"], cfg.ctx, self.first)) for c in chunks]

    def kld(self, mode: KVMode) -> float:
        """Mean KLD of ``mode`` from f32 over the calibration chunks' scored tokens."""
        vals = []
        for chunk, base in zip(self.chunks, self.bases, strict=True):
            lq = scored_logits(self.llm, chunk, mode, self.cfg.prefill_chunk, self.first)
            targets = torch.tensor(chunk[self.first + 1 :], dtype=torch.long)
            vals.append(chunk_metrics(base, lq, targets)["kld"].numpy())
        return float(np.concatenate(vals).mean())

    def table(self) -> dict[tuple[int, str, StoreKind], float]:
        n = self.llm.config.n_layers
        out = {}
        for layer in range(n):
            for role in ROLES:
                for kind in self.cfg.candidates:
                    out[layer, role, kind] = self.kld(single_layer_mode(n, layer, role, kind))
            print(f"  sensitivity: layer {layer + 1}/{n}", file=sys.stderr, flush=True)
        return out


def choose(
    sens: dict[tuple[int, str, StoreKind], float], n_layers: int, head_dim: int, budget: float
) -> tuple[list[tuple[StoreKind, StoreKind]], float]:
    """The greedy choice under ``budget`` (sum of per-layer KLDs): per-layer kinds and the predicted KLD."""
    kinds = sorted({k for _, _, k in sens}, key=lambda k: -k.row_bytes(head_dim))
    choice = {(layer, role): F16 for layer in range(n_layers) for role in ROLES}

    def cost(item, kind):
        return 0.0 if kind == F16 else sens[(*item, kind)]

    total = 0.0
    while True:
        best, best_ratio = None, -1.0
        for item, cur in choice.items():
            for kind in kinds:
                saved = cur.row_bytes(head_dim) - kind.row_bytes(head_dim)
                added = cost(item, kind) - cost(item, cur)
                if saved <= 0 or total + added > budget:
                    continue
                ratio = saved / max(added, 1e-15)
                if ratio > best_ratio:
                    best, best_ratio = (item, kind, added), ratio
        if best is None:
            break
        item, kind, added = best
        choice[item] = kind
        total += added
    return [(choice[layer, "k"], choice[layer, "v"]) for layer in range(n_layers)], total


@dataclass
class PlanResult:
    model: str
    corpus: str
    budget: float
    ctx: int
    calib_chunks: int
    heldout_chunks: int
    recipe: KVMode
    predicted_kld: float
    calib_kld: float
    rounds: int
    rows: list[dict[str, Any]] = field(default_factory=list)  # held-out verification, recipe first
    sensitivity: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "recipe"}
        d["recipe"] = self.recipe.name
        d["layers"] = [{"k": str(k), "v": str(v)} for k, v in self.recipe.layers]
        return d


def plan_chunks(llm: LLM, text: str, cfg: PlanConfig) -> tuple[list[list[int]], list[list[int]]]:
    """Calibration chunks, then the held-out chunks after them (disjoint text)."""
    tok = llm.tokenizer
    bos = tok.bos_prefix[0] if tok.bos_prefix else None
    chunks = make_chunks(tok.encode(text), cfg.ctx, None, bos)
    need = cfg.calib_chunks + cfg.heldout_chunks
    if len(chunks) < need:
        raise ValueError(f"the corpus holds {len(chunks)} chunks of {cfg.ctx} tokens; the plan needs {need}")
    return chunks[: cfg.calib_chunks], chunks[cfg.calib_chunks : need]


def verify(llm: LLM, chunks: list[list[int]], cfg: PlanConfig, recipe: KVMode) -> list[dict[str, Any]]:
    """Held-out rows (recipe, then ``cfg.kv``): KLD mean ± error, PPL ratio, same-top, bytes/token."""
    modes = list(dict.fromkeys([recipe, *cfg.kv]))
    ppl_cfg = PplConfig(
        model=cfg.model,
        kv=modes,
        base="f32",
        weights=cfg.weights,
        prefill_chunk=cfg.prefill_chunk,
        ctx=cfg.ctx,
    )
    run = _PplRun(llm, ppl_cfg, None, None)
    for chunk in chunks:
        run.score(chunk)
    cfg_ = llm.config
    f16 = MODES["f16"].bytes_per_token(cfg_.n_layers, cfg_.n_kv_heads, cfg_.head_dim)
    q8 = MODES["q8"].bytes_per_token(cfg_.n_layers, cfg_.n_kv_heads, cfg_.head_dim)
    rows = []
    for r in run.mode_results(len(chunks) * cfg.ctx):
        s = r.stats
        rows.append(
            {
                "kv": r.mode.name,
                "bytes_per_token": r.bytes_per_token,
                "vs_f16": r.bytes_per_token / f16,
                "vs_q8": r.bytes_per_token / q8,
                "kld_mean": s["kld_mean"],
                "kld_mean_err": s["kld_mean_err"],
                "ppl_ratio": s["ppl_ratio"],
                "same_top_p": s["same_top_p"],
                "within_budget": s["kld_mean"] <= cfg.kld_budget,
            }
        )
    return rows


def run_plan(cfg: PlanConfig) -> PlanResult:
    """Measure, choose, write ``cfg.out``, verify on held-out chunks."""
    llm, _, text, label = load_compare(cfg)
    c = llm.config
    calib, held = plan_chunks(llm, text, cfg)
    sens = Sensitivity(llm, calib, cfg)
    table = sens.table()
    working, rounds = cfg.kld_budget, 0
    while True:
        rounds += 1
        layers, predicted = choose(table, c.n_layers, c.head_dim, working)
        recipe = recipe_mode(cfg.out, layers)
        measured = sens.kld(recipe)
        if measured <= cfg.kld_budget or rounds >= SHRINK_ROUNDS:
            break
        working *= 0.9 * cfg.kld_budget / measured  # the sum under-predicted: shrink by the excess
    meta = {"model": model_name(llm), "kld_budget": cfg.kld_budget, "calibration_kld": measured}
    save_recipe(recipe, c.n_layers, cfg.out, **meta)
    sensitivity = {f"{layer}.{role}.{kind}": v for (layer, role, kind), v in table.items()}
    result = PlanResult(
        model_name(llm), label, cfg.kld_budget, cfg.ctx, len(calib), len(held), recipe, predicted, measured,
        rounds, sensitivity=sensitivity,
    )  # fmt: skip
    result.rows = verify(llm, held, cfg, recipe)
    return result


def print_plan(r: PlanResult) -> None:
    counts: dict[str, int] = {}
    for k, v in r.recipe.layers:
        counts[f"K {k} / V {v}"] = counts.get(f"K {k} / V {v}", 0) + 1
    print(
        f"recipe {r.recipe.name} for {r.model}: " + ", ".join(f"{n}x {p}" for p, n in sorted(counts.items()))
    )
    print(
        f"budget {r.budget:g}: predicted (sum of layers) {r.predicted_kld:.3g}, calibration "
        f"{r.calib_kld:.3g} ({r.calib_chunks} chunks, {r.rounds} round(s)); held-out: {r.heldout_chunks} "
        f"chunks of {r.ctx} on {r.corpus}"
    )
    headers = ["KV", "bytes/token", "x f16", "x q8", "KLD mean ± err", "PPL ratio", "same top", "<= budget"]
    rows = [
        [
            x["kv"], str(x["bytes_per_token"]), f"{x['vs_f16']:.3f}", f"{x['vs_q8']:.3f}",
            f"{x['kld_mean']:.3g} ± {x['kld_mean_err']:.2g}", f"{x['ppl_ratio']:.4f}",
            f"{x['same_top_p']:.3f}", "yes" if x["within_budget"] else "NO",
        ]
        for x in r.rows
    ]  # fmt: skip
    print_table("held-out verification (vs f32 cache)", headers, rows)


def main(cfg: PlanConfig, json_out: bool = False) -> None:
    """The body of ``kvlens lab plan``."""
    result = run_plan(cfg)
    if json_out:
        print(json.dumps(result.to_json(), indent=1))
    else:
        print_plan(result)
