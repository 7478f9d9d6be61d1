"""``kvlens lab doctor``: what in a model's K and V makes low-bit caches risky, and what it costs.

From one forward of a corpus window through an f32 cache (post-RoPE Q, K, V of every layer, captured
by the same f32 pass that the KLD measurements resume from, :mod:`.sensitivity`), per layer and KV
head:

* outlier channels: a channel whose RMS over the window is ``OUTLIER_RATIO`` times the median
  channel's (K and V apart) — one such channel sets a whole row's or block's scale;
* constant offset (bias): ``|mean k| / RMS(k - mean k)`` over the window; above ``OFFSET_RATIO``
  the keys are mostly one vector (Qwen2-style ``k_proj`` biases), and low-bit codes spend their
  range on it;
* attention sinks: the mean attention weight the window's second half gives position 0, per query
  head (the reference softmax, float64);
* layout: head_dim not a power of two (no rotated kinds) or not a multiple of 32 (no 4-bit kinds).

For every flagged layer, the consequence is measured: the mean KLD (vs an f32 cache) when only that
layer's K and V are stored q8, and q4h where the layout allows it (llama-perplexity's protocol of
:mod:`.ppl`). The recommended recipe is :mod:`.plan`'s choice under ``kld_budget`` from per-layer
sensitivities measured on the same window, or from a ``lab plan --json`` output (``plan``: its
per-layer or per-head sensitivities, ctx and calibration chunks; nothing measured twice). The doctor
measures without K smoothing; a plan measured with ``--smooth-k`` gives a recipe with the K centers
of the same calibration chunks (the consequences stay unsmoothed: they show the keys as they are).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..checks import check_counts
from ..kernels.reference import reference_attention
from ..kv.modes import StoreKind
from ..kv.recipe import mix, recipe_json, recipe_mode
from ..report import md_table, print_table, write_markdown
from .common import LabConfig, load_lab, model_name
from .plan import KldBudget, PlanConfig, load_measurements, plan_chunks
from .recipe_search import choose_verified
from .sensitivity import Sensitivity

OUTLIER_RATIO = 6.0
OFFSET_RATIO = 1.0
SINK_WEIGHT = 0.3
F32 = StoreKind.F32


@dataclass
class DoctorConfig(KldBudget, LabConfig):
    """``plan``: a ``lab plan --json`` output of the same model and corpus whose per-layer (or per-head)
    sensitivities the doctor reuses (with its ctx and calibration chunks) instead of measuring them."""

    ctx: int = 512
    plan: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_counts(self, "ctx", minimum=4)
        if self.keep_sink or self.keep_recent:
            raise ValueError(
                "the doctor measures caches as the engine stores them: keep_sink and keep_recent must be 0"
            )


@dataclass
class Finding:
    kind: str  # outlier-k, outlier-v, offset-k, sink, layout
    layer: int | None
    head: int | None
    value: float
    detail: str
    kld: dict[str, float] = field(default_factory=dict)  # mode -> KLD of that layer alone


def channel_findings(layer: int, role: str, rows: torch.Tensor) -> list[Finding]:
    """Outlier channels (and for K the constant offset) of ``rows [KV, n, d]``."""
    out = []
    x = rows.double()
    rms = x.pow(2).mean(1).sqrt()  # [KV, d]
    for h in range(x.shape[0]):
        ratio = rms[h] / rms[h].median().clamp_min(1e-12)
        c = int(ratio.argmax())
        if ratio[c] >= OUTLIER_RATIO:
            out.append(
                Finding(
                    f"outlier-{role}",
                    layer,
                    h,
                    float(ratio[c]),
                    f"channel {c}: RMS {float(ratio[c]):.1f}x the median channel",
                )
            )
        if role == "k":
            mean = x[h].mean(0)
            spread = (x[h] - mean).pow(2).sum(-1).mean().sqrt()
            offset = float(mean.norm() / spread.clamp_min(1e-12))
            if offset >= OFFSET_RATIO:
                out.append(
                    Finding(
                        "offset-k", layer, h, offset, f"|mean k| = {offset:.2f}x the RMS spread around it"
                    )
                )
    return out


def sink_findings(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[Finding]:
    n = q.shape[1]
    pos = torch.arange(n)
    _, w = reference_attention(q.double(), k.double(), v.double(), pos, return_weights=True)
    to_first = w[:, n // 2 :, 0].mean(1)  # [H]
    return [
        Finding(
            "sink", layer, h, float(s), f"query head {h}: {100 * float(s):.0f}% of attention on position 0"
        )
        for h, s in enumerate(to_first)
        if s >= SINK_WEIGHT
    ]


def layout_findings(head_dim: int) -> list[Finding]:
    out = []
    if head_dim & (head_dim - 1):
        out.append(
            Finding("layout", None, None, head_dim, f"head_dim {head_dim} is not a power of two: no q8h/q4h")
        )
    if head_dim % 32:
        out.append(
            Finding("layout", None, None, head_dim, f"head_dim {head_dim} is not a multiple of 32: no q4/q4h")
        )
    return out


def usable(kinds: list[StoreKind], head_dim: int) -> list[StoreKind]:
    ok = []
    for kind in kinds:
        try:
            kind.check_head_dim(head_dim)
            ok.append(kind)
        except ValueError:
            pass
    return ok


@dataclass
class DoctorResult:
    model: str
    corpus: str
    ctx: int
    head_dim: int
    findings: list[Finding]
    recipe: dict[str, Any]
    recipe_kld: float
    recipe_mix: str
    seconds: float
    passes: int  # KLD passes (consequences, sensitivities, recipe), f32 base passes excluded

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "findings"} | {
            "findings": [f.__dict__ for f in self.findings]
        }


def consequences(sens: Sensitivity, findings: list[Finding], kinds: list[StoreKind]) -> None:
    """Fill each layer finding's ``kld``: the KLD when only that layer's K and V are each kind."""
    c = sens.llm.config
    measured: dict[tuple[int, StoreKind], float] = {}
    for f in findings:
        if f.layer is None:
            continue
        for kind in kinds:
            if (f.layer, kind) not in measured:
                layers = [(F32, F32)] * c.n_layers
                layers[f.layer] = (kind, kind)
                measured[f.layer, kind] = sens.kld(recipe_mode(f"L{f.layer}={kind}", layers))
            f.kld[str(kind)] = measured[f.layer, kind]


def run_doctor(cfg: DoctorConfig) -> DoctorResult:
    """Findings from one f32 pass over the window, their measured cost, a recommended recipe."""
    llm, text, label = load_lab(cfg.model, cfg.corpus, "f32")
    c = llm.config
    t0 = time.perf_counter()
    ctx, calib, table, smooth = cfg.ctx, [0], None, False
    if cfg.plan:  # the plan's sensitivities (its ctx, calibration chunks, K smoothing): none measured
        table, calib, ctx, smooth = load_measurements(cfg.plan, model_name(llm), label, None)
    candidates = usable([StoreKind.Q8H, StoreKind.Q4H], c.head_dim) or [StoreKind.Q8]
    pcfg = PlanConfig(model=cfg.model, corpus=cfg.corpus, kv="f32", ctx=ctx, calib_chunks=len(calib), heldout_chunks=0,
                      kld_budget=cfg.kld_budget, candidates=candidates)  # fmt: skip
    chunks = plan_chunks(llm, text, pcfg, (calib, []))[0]
    # the f32 pass also captures the window's Q, K, V (and, for a smoothed plan's recipe, mean keys)
    sens = Sensitivity(llm, chunks, ctx, capture=True, smooth_k=smooth)
    findings = layout_findings(c.head_dim)
    for layer, (q, k, v) in enumerate(sens.qkv):
        findings += channel_findings(layer, "k", k) + channel_findings(layer, "v", v)
        findings += sink_findings(layer, q, k, v)
    consequences(sens, findings, usable([StoreKind.Q8, StoreKind.Q4H], c.head_dim))
    if table is None:
        table = sens.table(candidates, per_head=False)
    recipe, _, measured, _ = choose_verified(sens, table, cfg.kld_budget, "doctor")
    return DoctorResult(
        model_name(llm), label, ctx, c.head_dim, findings,
        recipe_json(recipe, c.n_layers, model=model_name(llm), kld_budget=cfg.kld_budget),
        measured, mix(recipe, c.n_layers, c.n_kv_heads), time.perf_counter() - t0, sens.passes,
    )  # fmt: skip


HEADERS = ["finding", "layer", "head", "value", "detail", "KLD q8 (layer alone)", "KLD q4h (layer alone)"]


def table_rows(r: DoctorResult) -> list[list[str]]:
    def fmt(x):
        return "" if x is None else str(x)

    return [
        [f.kind, fmt(f.layer), fmt(f.head), f"{f.value:.3g}", f.detail,
         f"{f.kld['q8']:.3g}" if "q8" in f.kld else "", f"{f.kld['q4h']:.3g}" if "q4h" in f.kld else ""]
        for f in r.findings
    ]  # fmt: skip


def recipe_line(r: DoctorResult) -> str:
    return (
        f"recommended recipe (budget {r.recipe['kld_budget']:g}, measured KLD {r.recipe_kld:.3g} on the "
        f"calibration text), per (layer, KV head): {r.recipe_mix}; {r.passes} KLD passes, {r.seconds:.0f} s"
    )


def main(cfg: DoctorConfig, json_out: bool = False, report: str | None = None) -> None:
    """The body of ``kvlens lab doctor``."""
    r = run_doctor(cfg)
    title = f"doctor: {r.model}, {r.ctx}-token window of {r.corpus}"  # a reused plan's ctx, not --ctx
    if json_out:
        print(json.dumps(r.to_json(), indent=1))
    else:
        print_table(title, HEADERS, table_rows(r), width=160)
        print(recipe_line(r))
    if report:
        md = f"# kvlens lab {title}\n\n" + md_table(HEADERS, table_rows(r)) + "\n\n" + recipe_line(r) + "\n"
        write_markdown(report, "doctor.md", md)
        Path(report, "recipe.json").write_text(json.dumps(r.recipe, indent=1) + "\n", encoding="utf-8")
