"""``kvlens lab …``: the accuracy lab's commands. Each declares its options, builds its config and
calls the body in :mod:`kvlens.lab`."""

from __future__ import annotations

import typer
from typer import Argument, Option

from . import cli_args as cb  # option callbacks: values checked at parse time
from . import cli_config as opt  # options shared by several commands
from .cli_args import parse_floats, parse_sizes
from .cli_config import config_from, sparse_policy

lab_app = typer.Typer(no_args_is_help=True, help="Accuracy lab: what does KV quantization cost?")


@lab_app.command("unit")
def lab_unit(
    seq_len: str = Option("256", help="Keys L (a list sweeps).", callback=cb.sizes_option(suffix=False)),
    head_dim: int | None = Option(None, "--head-dim", min=2, help="Default 128 (real: the model's)."),
    heads: int | None = Option(None, "--heads", min=1, help="Query heads (default 1; real: the model's)."),
    kv_heads: int | None = Option(None, "--kv-heads", min=1, help="KV heads, GQA (default 1)."),
    dist: str = Option("normal", help="normal, uniform, student-t:NU, outlier-channels[:F], real."),
    k_amp: float = Option(1.0, "--k-amp", help="Multiply K.", callback=cb.finite_option()),
    v_amp: float = Option(1.0, "--v-amp", help="Multiply V.", callback=cb.finite_option()),
    quantize: str = Option("kv", help="Which tensors go through the quantizer: k, v or kv."),
    scheme: str = Option("q8", help="q8 (seed), q8_0, q4, fp8, kivi (2-bit), kivi4."),
    trials: int = Option(1, min=1, help="Seeds seed..seed+N-1 (real: N text windows); mean ± std."),
    seed: int = Option(0, help="Seed of the synthetic data (real: first text window)."),
    amplitude: str | None = Option(None, help="Exercise A factors, e.g. 1,3.", callback=cb.floats_option()),
    model: str = Option("smollm2", help=opt.MODEL_HELP + " (--dist real)."),
    layer: int | None = Option(None, min=0, help="--dist real: layer (default: the middle one)."),
    head: int | None = Option(None, min=0, help="--dist real: one query head (default: all)."),
    text: str | None = Option(None, help="--dist real: corpus name or UTF-8 file (default corpus)."),
    attn_backend: str | None = opt.LAB_ATTN_BACKEND,
    json_out: bool = opt.JSON,
    plot: str | None = Option(None, help="PNG: error vs L, or Δ.", callback=cb.output_file_option),
) -> None:
    """The seed's unit experiment: fp32 K/V vs quantized K/V through the same attention code."""
    from .lab import unit

    seq, amp = unit.parse_list(seq_len, int), unit.parse_list(amplitude, float) if amplitude else None
    unit.main(config_from(unit.UnitConfig, locals(), seq_len=seq, amplitude=amp), json_out, plot)


# == lab ppl / greedy / layers (kvlens.lab.ppl_report, .greedy, .layers) ==
@lab_app.command("ppl")
@opt.compare_options
def lab_ppl(
    ctx: int = Option(512, min=4, help="Tokens per chunk; the second half of each is scored."),
    chunks: int | None = Option(None, min=1, help="Score at most this many chunks."),
    attn_backend: str | None = opt.LAB_ATTN_BACKEND,
    **shared,
) -> None:
    """Perplexity and llama-perplexity's KL-divergence report, per KV mode, against a baseline."""
    from .lab import ppl, ppl_report

    cfg = compare_config(ppl.PplConfig, shared, ctx=ctx, chunks=chunks, attn_backend=attn_backend)
    ppl_report.main(cfg, shared["json_out"], shared["report"])


@lab_app.command("greedy")
@opt.compare_options
def lab_greedy(
    ctx: int = Option(64, min=2, help="Prompt length in tokens."),
    prompts: int = Option(16, "--prompts", "--chunks", min=1, help="Prompts cut from the corpus."),
    tokens: int = Option(32, min=1, help="Greedy tokens per prompt."),
    show: int = Option(3, min=0, help="Diverging continuations shown per mode."),
    **shared,
) -> None:
    """Greedy continuations under the baseline and each KV mode: agreement and first divergence."""
    from .lab import greedy

    cfg = compare_config(greedy.GreedyConfig, shared, ctx=ctx, prompts=prompts, tokens=tokens, show=show)
    greedy.main(cfg, shared["json_out"], shared["report"])


def compare_config(cls: type, shared: dict, **own) -> object:
    """A compare command's config: its own options, the shared ones and their sparse policy."""
    sparse = sparse_policy(shared["sparse"], shared["sparse_budget"], shared["sparse_dense_layers"], 0)
    return config_from(cls, shared | own, sparse=sparse)


@lab_app.command("layers")
def lab_layers(
    model: str = opt.MODEL,
    corpus: str | None = opt.CORPUS,
    ctx: int = Option(512, min=4, help="Corpus window length in tokens."),
    kv: str = opt.KV,
    chunks: int = Option(1, min=1, help="Windows (ppl-protocol chunks) to pool."),
    weights: str = Option(
        "f32", help="Weights of the model: f32, bf16, int8, int4 or auto (the file's own)."
    ),
    keep_sink: int = opt.SINK,
    keep_recent: int = opt.RECENT,
    json_out: bool = opt.JSON,
    report: str | None = opt.REPORT,
) -> None:
    """Relative attention-output error per layer and KV head for each mode, with flagged outliers."""
    from .lab import layers

    layers.main(config_from(layers.LayersConfig, locals()), json_out, report)


@lab_app.command("plan")
def lab_plan(
    kld_budget: float = Option(
        0.002, help="Mean KLD (vs an f32 cache) the recipe may cost.", callback=cb.finite_option(above=0.0)
    ),
    out: str = Option("recipe.json", help="Recipe file to write.", callback=cb.output_file_option),
    model: str = opt.MODEL,
    corpus: str | None = opt.CORPUS,
    ctx: int = Option(512, min=4, help="Tokens per chunk; the second half of each is scored."),
    calib_chunks: int = Option(2, min=1, help="Chunks measuring per-layer sensitivity."),
    heldout_chunks: int = Option(4, min=1, help="Other chunks verifying the recipe (after, or between)."),
    calib_spread: bool = Option(
        False, "--calib-spread/--calib-first", help="Calibration chunks spread through the text, or first."
    ),
    candidates: str = Option("q8h,q4h", help="Kinds tried per layer for K and V (f16 is the fallback)."),
    per_head: bool = Option(True, "--per-head/--per-layer", help="Choose kinds per KV head or per layer."),
    calib_target: float = Option(1.0, help="Share of the budget the recipe may cost on calibration text."),
    reuse: str | None = Option(None, help="A `lab plan --json` output whose sensitivities to reuse."),
    kv: str = Option("q8,f16", help="Modes verified beside the recipe."),
    verify: bool = Option(True, "--verify/--no-verify", help="Verify the recipe on the held-out chunks."),
    smooth_k: bool = Option(
        True, "--smooth-k/--no-smooth-k", help="Subtract the calibration's mean key per layer and KV head."
    ),
    keep_sink: int = opt.SINK,
    keep_recent: int = opt.RECENT,
    prefill_chunk: int = opt.PREFILL,
    attn_backend: str | None = Option(
        None,
        help="Verify through a decode kernel (numba, numba-int, numba-int16): scored positions as decode steps.",
        callback=cb.backend_option,
    ),
    json_out: bool = opt.JSON,
) -> None:
    """A per-layer (per-KV-head) KV recipe under a KLD budget: measure, choose, verify on held-out text."""
    from .lab import plan

    plan.main(config_from(plan.PlanConfig, locals()), json_out)


@lab_app.command("doctor")
def lab_doctor(
    model: str = opt.MODEL,
    corpus: str | None = opt.CORPUS,
    ctx: int = Option(512, min=4, help="Window of corpus tokens the statistics come from."),
    kld_budget: float = Option(
        0.002, help="KLD budget of the recommended recipe.", callback=cb.finite_option(above=0.0)
    ),
    plan: str | None = Option(None, help="A `lab plan --json` output whose measurements to reuse."),
    json_out: bool = opt.JSON,
    report: str | None = opt.REPORT,
) -> None:
    """K/V outlier channels, key offsets, attention sinks, layout risks, each with its measured cost."""
    from .lab import doctor

    doctor.main(config_from(doctor.DoctorConfig, locals()), json_out, report)


@lab_app.command("needle")
def lab_needle(
    model: str = opt.MODEL,
    corpus: str | None = Option(None, help="Filler text: built-in corpus name or a UTF-8 file."),
    ctx: str = Option("1024,2048,4096,8192", help="Contexts (4k = 4096).", callback=cb.sizes_option()),
    depth: str = Option("0.1,0.5,0.9", help="Depths in [0, 1].", callback=cb.floats_option(0.0, 1.0)),
    kv: str = Option("q8", help="Quantized cache mode compared with f32."),
    weights: str = Option(
        "auto", help="Weights of the model: auto (the file's own), f32, bf16, int8 or int4."
    ),
    sparse: str = Option("quest", help="Sparse selection: quest or probe."),
    sparse_budget: str = Option(
        "0.125,0.25", help="Tokens, or context fractions.", callback=cb.budgets_option
    ),
    dense_layers: int = Option(2, min=0, help="First layers kept dense."),
    seed: int = Option(0, help="Seed of the secret numbers."),
    json_out: bool = Option(False, "--json", help="Print the rows as JSON."),
    plot: str | None = Option(None, help="PNG heat map of recall.", callback=cb.output_file_option),
) -> None:
    """Needle in a haystack: recall of f32 dense, q8 dense and q8 sparse at several budgets."""
    from .lab import needle

    lists = {
        "ctx": parse_sizes(ctx),
        "depth": parse_floats(depth),
        "sparse_budget": parse_floats(sparse_budget),
    }
    needle.main(config_from(needle.NeedleConfig, locals(), **lists), json_out)


# == lab sweep / sweep-report (kvlens.lab.sweep, .sweep_report) ==
@lab_app.command("sweep")
def lab_sweep(
    spec: str = Argument(..., help="Sweep spec (TOML): see docs/sweep/README.md."),
    db: str | None = Option(
        None,
        help="Results store, SQLite (default: SPEC with suffix .sqlite).",
        callback=cb.output_file_option,
    ),
    workers: int | None = Option(None, min=0, help="Local worker processes (0: in-process)."),
    threads: int | None = Option(None, min=1, help="Torch threads per cell (default: cores/workers)."),
    ray: bool = Option(False, "--ray", help="Run the cells as Ray tasks (local Ray)."),
    ray_address: str | None = Option(None, help="Ray cluster address (implies --ray)."),
    force: bool = Option(False, "--force", help="Redo cells already done."),
    quiet: bool = Option(False, "--quiet", help="No progress bar."),
) -> None:
    """Run a spec's grid of lab cells into a SQLite store; rerunning resumes (done cells are skipped)."""
    from .lab.sweep import cli

    cli(spec, db, workers, threads, ray, ray_address, force, quiet)


@lab_app.command("sweep-report")
def lab_sweep_report(
    db: str = Argument(..., help="A sweep's results store."),
    out: str = Option(
        ..., help="Directory for the Markdown report and PNG plots.", callback=cb.output_dir_option
    ),
) -> None:
    """Markdown + PNG report of a sweep store: accuracy/memory frontier, KLD vs context, K vs V."""
    from .lab.sweep_report import cli

    cli(db, out)
