"""``kvlens lab plan``: a per-layer (or per-KV-head) KV recipe chosen by measurement, then verified
on held-out text.

1. Sensitivity (calibration chunks, :mod:`.sensitivity`): for every layer (``per_head``: every KV
   head of every layer) and for K and V apart, the mean KL divergence from the f32 cache when only
   that layer's (head's) K or V is stored in a candidate kind (q8h, q4h, ...) and every other row
   stays f32 — llama-perplexity's scoring of :mod:`.ppl` (second half of each chunk), one pass per
   (item, kind, chunk), resumed at the probed layer from the f32 pass's residual.
2. Choice (aiming at ``calib_target`` x the budget, leaving room for the calibration text to
   under-predict other text): per item the options are f16 (the fallback, counted as KLD 0) and the candidates;
   treating the items' KLDs as additive (first order in small perturbations), a greedy
   multiple-choice knapsack takes, step by step, the downgrade saving the most bytes per unit of
   KLD that keeps the sum within the working budget. The recipe is then measured on the calibration
   chunks and the working budget searched (the sum does not add exactly: shrink while over, grow
   while under, then bisect; 6 checks at most) for the fewest bytes measured within the budget.
3. Verification (held-out chunks, never seen by 1-2): the recipe and the comparison modes against
   f32, KLD mean ± its standard error, bytes per token against f16 and q8. ``verify=False`` skips
   it: with ``reuse`` a choice then costs only the calibration checks, so a bytes-vs-budget curve
   takes one run per budget and only the chosen point needs the held-out passes.

``calib_spread`` (``--calib-spread``): the calibration chunks are spread evenly through the first
``calib + heldout`` chunks of the text (every third of twelve: 0, 3, 6, 9) and the held-out ones are
the rest, so both samples cover the whole text; by default the calibration chunks come first and the
held-out ones after them. Either way the two sets are disjoint. A text whose later parts are harder
than its opening makes the first-chunks layout under-predict the held-out KLD.

``smooth_k`` (``--smooth-k``): K smoothing (:attr:`kvlens.kv.modes.KVMode.k_center`). The f32 passes
over the calibration chunks give the mean post-RoPE key per (layer, KV head); every probe of 1, the
choice's checks in 2 and the recipe verified in 3 carry those centers, and the recipe file holds them
(``k_center``). A reused measurement must have been taken the same way (its ``smooth_k``).

``keep_sink`` / ``keep_recent`` (``--keep-sink``, ``--keep-recent``): the first S positions in the
cache's f16 sink store, the last R exact (:class:`~kvlens.kv.modes.CacheOptions`), in every probe of
1, every check of 2 and every test mode of 3. ``keep_sink`` is also written to the recipe file (the
engine keeps a recipe's sink: :attr:`kvlens.kv.modes.KVMode.keep_sink`); ``keep_recent``, a lab
measurement only, to the plan's JSON alone. A reused measurement keeps its own sensitivities; only 2
and 3 then run with this run's kept positions.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ..checks import check_counts, check_float, check_not_special
from ..engine.attention import check_backend_name
from ..engine.llm import LLM
from ..kv.modes import MODES, KVMode, StoreKind
from ..kv.recipe import layer_json, mix, save_recipe
from ..report import print_table
from .common import CompareConfig, kept_exact_line, load_compare, model_name
from .ppl import PplConfig, _PplRun, make_chunks
from .recipe_search import choose_verified
from .sensitivity import Sensitivity

F32, F16 = StoreKind.F32, StoreKind.F16


@dataclass
class KldBudget:
    """The ``--kld-budget`` of a command that chooses a recipe (plan, doctor): the mean KLD (vs an f32
    cache) it may cost. A mixin before a :class:`~.common.LabConfig` in the bases."""

    kld_budget: float = 0.002

    def __post_init__(self) -> None:
        super().__post_init__()  # the LabConfig after this mixin in the MRO
        # the CLI refuses nan and inf at parse time; a config built in Python gets the same check
        self.kld_budget = check_float(self.kld_budget, "--kld-budget", above=0.0)


@dataclass
class PlanConfig(KldBudget, CompareConfig):
    """``kvlens lab plan``: the budget, the chunks (calibration, then held-out), the candidate kinds
    and the recipe file; ``kv``: the modes the verification sets beside the recipe."""

    ctx: int = 512
    calib_chunks: int = 2
    heldout_chunks: int = 4
    candidates: list[StoreKind] | str = "q8h,q4h"
    out: str = "recipe.json"
    per_head: bool = True
    calib_target: float = 1.0  # the share of the budget the recipe may cost on the calibration chunks
    reuse: str | None = None  # a earlier ``lab plan --json`` output: its sensitivities, not measured again
    verify: bool = True  # run the held-out verification (False: choose and check on calibration text only)
    smooth_k: bool = True  # K smoothing: subtract the calibration's mean key per (layer, KV head)
    calib_spread: bool = False  # calibration chunks spread through the text (else the first ones)
    attn_backend: str | None = (
        None  # the verification's test modes: scored positions as decode steps through it
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.attn_backend is not None:
            check_backend_name(self.attn_backend)  # before minutes of calibration, not after
        if isinstance(self.candidates, str):
            self.candidates = [c for c in self.candidates.split(",") if c.strip()]
        if not isinstance(self.candidates, (list, tuple)):
            raise TypeError(f"--candidates must be a list of KV kinds, got {type(self.candidates).__name__}")
        self.candidates = [c if isinstance(c, StoreKind) else _kind(c) for c in self.candidates]
        if not self.candidates:
            raise ValueError("--candidates names no KV kind")
        if len(set(self.candidates)) < len(self.candidates):
            raise ValueError(f"--candidates names a kind twice: {', '.join(map(str, self.candidates))}")
        check_float(self.calib_target, "--calib-target", above=0.0, maximum=1.0)
        check_counts(self, "calib_chunks")
        check_counts(self, "ctx", minimum=4)
        check_counts(self, "heldout_chunks", minimum=0)  # 0: the doctor's plan (the CLI asks for ≥ 1)


def _kind(name: str) -> StoreKind:
    if not isinstance(name, str):
        raise TypeError(f"--candidates must name KV kinds, got {type(name).__name__} {name!r}")
    try:
        return StoreKind(name.strip())
    except ValueError:
        raise ValueError(
            f"unknown KV kind {name!r}; choose from: {', '.join(k.value for k in StoreKind)}"
        ) from None


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
    n_kv_heads: int
    bytes_per_token: int  # the recipe's, as stored
    vs_q8: float  # bytes_per_token / q8's
    rows: list[dict[str, Any]] = field(default_factory=list)  # held-out verification, recipe first
    sensitivity: dict[str, float] = field(default_factory=dict)  # "layer[.head].role.kind" -> KLD
    seconds: dict[str, float] = field(default_factory=dict)  # wall time of each stage
    passes: int = 0  # calibration passes (sensitivity and choice), f32 base passes excluded
    smooth_k: bool = False  # K centers (the calibration's mean key) in every probe and the recipe
    calib_index: list[int] = field(default_factory=list)  # the calibration chunks' places in the text
    heldout_index: list[int] = field(default_factory=list)
    keep_sink: int = 0  # positions in the sink store in the choice's checks, the verification and the recipe
    keep_recent: int = 0  # positions kept exact (the lab's) in the choice's checks and the verification
    sink_bytes: int = 0  # the recipe's sink store, a constant per sequence beside bytes_per_token
    attn_backend: str | None = None  # the verification's decode kernel (None: the torch prefill path)

    def to_json(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "recipe"}
        d["recipe"] = self.recipe.name
        d["layers"] = [layer_json(self.recipe, i) for i in range(len(self.recipe.layers))]
        return d


def sensitivity_key(text: str) -> tuple:
    """``"3.k.q8h"`` / ``"3.1.k.q8h"`` (layer[.head].role.kind) back to its table key."""
    parts = text.split(".")
    return (*map(int, parts[:-2]), parts[-2], StoreKind(parts[-1]))


class Measurements(NamedTuple):
    """What a ``lab plan --json`` output measured: the sensitivity table, the calibration chunks'
    places in the text (an output from before they were written: the first ``calib_chunks``), the
    ctx, and whether with K smoothing (an output from before it: without)."""

    table: dict[tuple, float]
    calib_index: list[int]
    ctx: int
    smooth_k: bool


def load_measurements(path: str, model: str, corpus: str, ctx: int | None) -> Measurements:
    """A ``lab plan --json`` output's :class:`Measurements`, refused when it was measured on another
    model or corpus, or (``ctx`` given) another ctx."""
    try:
        check_not_special(path, ValueError)
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        table = {sensitivity_key(k): float(v) for k, v in data["sensitivity"].items()}
        got = (data["model"], data["corpus"], int(data["ctx"]))
        index = [int(i) for i in data.get("calib_index") or range(int(data["calib_chunks"]))]
        if not index or min(index) < 0 or len(set(index)) != len(index):
            raise ValueError(f"calib_index {index} does not name distinct chunks")
        smooth = data.get("smooth_k", False)
        if not isinstance(smooth, bool):
            raise ValueError(f"smooth_k is {smooth!r}, not true or false")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a readable `kvlens lab plan --json` output ({e})") from None
    if got[:2] != (model, corpus) or ctx not in (None, got[2]):
        raise ValueError(
            f"{path} was measured on {got[0]}, {got[1]}, ctx {got[2]}; this run is {model}, {corpus}, ctx {ctx}"
        )
    return Measurements(table, index, got[2], smooth)


def chunk_layout(calib: int, heldout: int, spread: bool) -> tuple[list[int], list[int]]:
    """The calibration and held-out chunks' places among the text's first ``calib + heldout`` chunks:
    the calibration ones first, or (``spread``) evenly through them; the held-out ones are the rest."""
    need = calib + heldout
    first = [i * need // calib for i in range(calib)] if spread else list(range(calib))
    return first, [i for i in range(need) if i not in first]


def plan_chunks(
    llm: LLM, text: str, cfg: PlanConfig, layout: tuple[list[int], list[int]] | None = None
) -> tuple[list[list[int]], list[list[int]]]:
    """Calibration chunks and held-out chunks of the text (disjoint) at the places ``layout`` names
    (calibration, held-out), by default :func:`chunk_layout`'s for ``cfg``."""
    tok = llm.tokenizer
    bos = tok.bos_prefix[0] if tok.bos_prefix else None
    chunks = make_chunks(tok.encode(text), cfg.ctx, None, bos)
    calib_index, held_index = layout or chunk_layout(cfg.calib_chunks, cfg.heldout_chunks, cfg.calib_spread)
    need = max(calib_index + held_index) + 1
    if len(chunks) < need:
        raise ValueError(f"the corpus holds {len(chunks)} chunks of {cfg.ctx} tokens; the plan needs {need}")
    return [chunks[i] for i in calib_index], [chunks[i] for i in held_index]


def verify(llm: LLM, chunks: list[list[int]], cfg: PlanConfig, recipe: KVMode) -> list[dict[str, Any]]:
    """Held-out rows (recipe, then ``cfg.kv``): KLD mean ± error, PPL ratio, same-top, bytes/token."""
    modes = list(dict.fromkeys([recipe, *cfg.kv]))
    shared = ("model", "weights", "prefill_chunk", "ctx", "keep_sink", "keep_recent", "attn_backend")
    ppl_cfg = PplConfig(kv=modes, base="f32", **{name: getattr(cfg, name) for name in shared})
    run = _PplRun(llm, ppl_cfg, None, None)
    for chunk in chunks:
        run.score(chunk)
    f16, q8 = (_bytes(MODES[name], llm) for name in ("f16", "q8"))
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


def _bytes(mode: KVMode, llm: LLM) -> int:
    c = llm.config
    return mode.bytes_per_token(c.n_layers, c.n_kv_heads, c.head_dim)


def run_plan(cfg: PlanConfig) -> PlanResult:
    """Measure, choose, write ``cfg.out``, verify on held-out chunks (unless ``cfg.verify`` is off)."""
    llm, _, text, label = load_compare(cfg)
    c = llm.config
    calib_index, heldout_index = chunk_layout(cfg.calib_chunks, cfg.heldout_chunks, cfg.calib_spread)
    calib, held = plan_chunks(llm, text, cfg, (calib_index, heldout_index))
    t0 = time.perf_counter()
    if cfg.reuse:
        table, reused_index, _, smooth = load_measurements(cfg.reuse, model_name(llm), label, cfg.ctx)
        if reused_index != calib_index:
            raise ValueError(
                f"{cfg.reuse} was measured on calibration chunks {reused_index}; this run's are {calib_index} "
                "(--calib-chunks, --heldout-chunks, --calib-spread)"
            )
        if smooth != cfg.smooth_k:
            said = ("with", "--smooth-k") if smooth else ("without", "--no-smooth-k")
            raise ValueError(f"{cfg.reuse} was measured {said[0]} K smoothing: reuse it with {said[1]}")
    sens = Sensitivity(llm, calib, cfg.ctx, smooth_k=cfg.smooth_k, options=cfg.cache_options)
    if not cfg.reuse:
        table = sens.table(cfg.candidates, cfg.per_head)
    t1 = time.perf_counter()
    target = cfg.kld_budget * cfg.calib_target
    recipe, predicted, measured, rounds = choose_verified(sens, table, target, cfg.out)
    meta = {"model": model_name(llm), "kld_budget": cfg.kld_budget, "calibration_kld": measured}
    recipe = dataclasses.replace(recipe, keep_sink=cfg.keep_sink)  # as measured: the engine keeps it too
    save_recipe(recipe, c.n_layers, cfg.out, **meta)
    t2 = time.perf_counter()
    bpt = _bytes(recipe, llm)
    result = PlanResult(
        model_name(llm), label, cfg.kld_budget, cfg.ctx, len(calib), len(held) if cfg.verify else 0, recipe,
        predicted, measured, rounds, c.n_kv_heads, bpt, bpt / _bytes(MODES["q8"], llm),
        sensitivity={".".join(map(str, key)): v for key, v in table.items()}, passes=sens.passes,
        smooth_k=cfg.smooth_k, calib_index=calib_index, heldout_index=heldout_index if cfg.verify else [],
        keep_sink=cfg.keep_sink, keep_recent=cfg.keep_recent,
        sink_bytes=recipe.sink_bytes(c.n_layers, c.n_kv_heads, c.head_dim), attn_backend=cfg.attn_backend,
    )  # fmt: skip
    result.seconds = {"sensitivity": t1 - t0, "choice": t2 - t1}
    if cfg.verify:
        result.rows = verify(llm, held, cfg, recipe)
        result.seconds["verify"] = time.perf_counter() - t2
    return result


def print_plan(r: PlanResult) -> None:
    split = sum(1 for h in r.recipe.heads if h)
    print(
        f"recipe {r.recipe.name} for {r.model} ({r.n_kv_heads} KV heads per layer, {split} layers split per "
        f"head); per (layer, KV head): {mix(r.recipe, len(r.recipe.layers), r.n_kv_heads)}"
    )
    sink = f", plus a sink store of {r.sink_bytes} bytes per sequence" if r.sink_bytes else ""
    print(f"recipe bytes/token {r.bytes_per_token} ({r.vs_q8:.3f}x q8's){sink}")
    for line in kept_exact_line(r):
        recent = "; the last ones are the lab's alone, not in the recipe file" if r.keep_recent else ""
        print(f"{line} (measured and verified so{recent})")
    print(
        f"budget {r.budget:g}: predicted (sum of items) {r.predicted_kld:.3g}, calibration "
        f"{r.calib_kld:.3g} ({r.calib_chunks} chunks, {r.rounds} round(s), {r.passes} passes); held-out: "
        f"{r.heldout_chunks} chunks of {r.ctx} on {r.corpus}"
        + (f" (scored positions as decode steps through {r.attn_backend})" if r.attn_backend else "")
        + "; seconds: "
        + ", ".join(f"{k} {v:.0f}" for k, v in r.seconds.items())
    )
    if not r.rows:
        print("held-out verification not run (--no-verify)")
        return
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
