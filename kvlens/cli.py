"""The ``kvlens`` command. Each command declares its options (checked at parse time by
:mod:`kvlens.cli_args`), builds its config (:mod:`kvlens.cli_config`) and calls the body that lives
next to its module; :func:`main` turns any error into one ``error: …`` line (``--debug``: traceback)."""

from __future__ import annotations

import os

import typer
from typer import Argument, Option

from . import cli_args
from . import cli_args as cb  # option callbacks: values checked at parse time
from . import cli_config as opt  # options shared by several commands
from .cli_args import parse_floats, parse_sizes
from .cli_config import KV_HELP, MODEL_HELP, config_from, names, sparse_policy
from .corpus import corpus_app
from .engine.attention import BACKENDS

app = typer.Typer(
    add_completion=False,
    pretty_exceptions_enable=False,
    no_args_is_help=True,
    help="kvlens: LLM inference with an int8 KV cache, and the lab that measures its cost.",
)
lab_app = typer.Typer(no_args_is_help=True, help="Accuracy lab: what does KV quantization cost?")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that print ratios measured side by side.")
app.add_typer(lab_app, name="lab")
app.add_typer(bench_app, name="bench")
app.add_typer(corpus_app, name="corpus")  # its commands live with the corpus


@app.command()
def generate(
    prompt: str = Argument(..., help="The prompt text.", callback=cb.text_argument),
    model: str = Option("smollm2", help=opt.MODEL_HELP),
    kv: str = Option("q8", help=opt.KV_HELP),
    max_tokens: int = Option(64, "--max-tokens", min=1, help="New tokens to generate at most."),
    chat: bool = Option(False, help="Wrap the prompt in the model's chat template."),
    temperature: float = Option(0.0, help="0 = greedy.", callback=cb.finite_option(minimum=0.0)),
    top_k: int = Option(0, min=0),
    top_p: float = Option(1.0, callback=cb.finite_option(above=0.0, maximum=1.0)),
    seed: int | None = Option(None),
    prefill_chunk: int = Option(512, min=1, help="Prompt tokens per prefill chunk."),
    attn_backend: str = Option("auto", help=f"Attention backend: {', '.join(BACKENDS)}."),
    mirror_prefill: str = Option("exact", help="q8+mirror: prefill reads the 'exact' copy or 'q8' rows."),
    device: str | None = Option(None, help="cpu or cuda (default: cuda if any).", callback=cb.device_option),
    weights: str = Option("auto", help="f32, bf16, int8, int4 (kept quantized); auto: the file's own."),
    sparse: str | None = Option(None, help="Sparse decode: quest or probe (default: dense)."),
    sparse_budget: float = Option(
        2048, help="Tokens, or a context fraction (< 1).", callback=cb.budget_option
    ),
    sparse_dense_layers: int = Option(2, min=0, help="First layers kept dense under --sparse."),
    sparse_min_ctx: int = Option(1024, min=0, help="Below this context decode stays dense."),
) -> None:
    """Generate text, streaming it as it is produced."""
    from .engine import generate as gen

    sparse_cfg = sparse_policy(sparse, sparse_budget, sparse_dense_layers, sparse_min_ctx)
    gen.main(config_from(gen.GenerateConfig, locals(), sparse=sparse_cfg))


TOUR = [
    ["generate", "--kv", "q8", "--chat", "--max-tokens", "48", "What is the capital of France?"],
    ["lab", "unit"],
    ["lab", "unit", "--amplitude", "1,3"],
    ["lab", "ppl", "--ctx", "512", "--chunks", "4", "--kv", "q8,q8-k,q8-v"],
    ["lab", "greedy", "--prompts", "4", "--tokens", "24", "--kv", "q8"],
    ["lab", "layers", "--kv", "q8"],
]


@app.command()
def tour() -> None:
    """The main job: a q8-cache generation on the default model, a short pass through the lab, then
    the server under a few concurrent requests."""
    for args in TOUR:
        typer.secho(f"\n$ kvlens {' '.join(repr(a) if ' ' in a else a for a in args)}", bold=True)
        app(args, standalone_mode=False)
    from .serve.tour import HEADER, serving_step

    typer.secho(f"\n$ {HEADER}", bold=True)
    serving_step()


@app.command()
def serve(
    model: str = typer.Option("smollm2", help=MODEL_HELP),
    kv: str = typer.Option("q8", help=KV_HELP),
    weights: str = typer.Option("auto", help="Weights: auto, f32, bf16, int8, int4."),
    kv_budget: str = typer.Option(None, help="KV pool bytes, e.g. 512MiB (default: a share of free memory)."),
    max_batch: int = typer.Option(16, min=1, help="Running sequences per step."),
    max_waiting: int = typer.Option(64, min=0, help="Waiting-queue bound (beyond it: 429)."),
    host: str = typer.Option("127.0.0.1"),
    port: int = typer.Option(8000, min=0, max=65535),
    api_key: str = typer.Option(None, help="Require 'Authorization: Bearer KEY' on /v1/*."),
    graceful_s: float = typer.Option(10.0, help="On SIGTERM: seconds in-flight requests get to finish."),
) -> None:
    """An OpenAI-compatible HTTP server (completions, chat, SSE streaming) with continuous batching."""
    from .serve.cli import serve as run

    run(model, kv, weights, kv_budget, max_batch, max_waiting, host, port, api_key, graceful_s)


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
    json_out: bool = opt.JSON,
    plot: str | None = Option(None, help="PNG: error vs L, or Δ.", callback=cb.output_file_option),
) -> None:
    """The seed's unit experiment: fp32 K/V vs quantized K/V through the same attention code."""
    from .lab import unit

    seq, amp = unit.parse_list(seq_len, int), unit.parse_list(amplitude, float) if amplitude else None
    unit.main(config_from(unit.UnitConfig, locals(), seq_len=seq, amplitude=amp), json_out, plot)


# == lab ppl / greedy / layers (kvlens.lab.ppl_report, .greedy, .layers) ==
@lab_app.command("ppl")
def lab_ppl(
    model: str = opt.MODEL,
    corpus: str | None = opt.CORPUS,
    ctx: int = Option(512, min=4, help="Tokens per chunk; the second half of each is scored."),
    kv: str = opt.KV,
    base: str = opt.BASE,
    weights: str = opt.WEIGHTS,
    chunks: int | None = Option(None, min=1, help="Score at most this many chunks."),
    prefill_chunk: int = opt.PREFILL,
    keep_sink: int = opt.SINK,
    keep_recent: int = opt.RECENT,
    json_out: bool = opt.JSON,
    report: str | None = opt.REPORT,
    sparse: str | None = opt.SPARSE,
    sparse_budget: float = opt.BUDGET,
    sparse_dense_layers: int = opt.DENSE,
) -> None:
    """Perplexity and llama-perplexity's KL-divergence report, per KV mode, against a baseline."""
    from .lab import ppl, ppl_report

    sparse_cfg = sparse_policy(sparse, sparse_budget, sparse_dense_layers, 0)
    ppl_report.main(config_from(ppl.PplConfig, locals(), sparse=sparse_cfg), json_out, report)


@lab_app.command("greedy")
def lab_greedy(
    model: str = opt.MODEL,
    corpus: str | None = opt.CORPUS,
    ctx: int = Option(64, min=2, help="Prompt length in tokens."),
    kv: str = opt.KV,
    base: str = opt.BASE,
    weights: str = opt.WEIGHTS,
    prompts: int = Option(16, "--prompts", "--chunks", min=1, help="Prompts cut from the corpus."),
    tokens: int = Option(32, min=1, help="Greedy tokens per prompt."),
    prefill_chunk: int = opt.PREFILL,
    keep_sink: int = opt.SINK,
    keep_recent: int = opt.RECENT,
    show: int = Option(3, min=0, help="Diverging continuations shown per mode."),
    json_out: bool = opt.JSON,
    report: str | None = opt.REPORT,
    sparse: str | None = opt.SPARSE,
    sparse_budget: float = opt.BUDGET,
    sparse_dense_layers: int = opt.DENSE,
) -> None:
    """Greedy continuations under the baseline and each KV mode: agreement and first divergence."""
    from .lab import greedy

    sparse_cfg = sparse_policy(sparse, sparse_budget, sparse_dense_layers, 0)
    greedy.main(config_from(greedy.GreedyConfig, locals(), sparse=sparse_cfg), json_out, report)


@lab_app.command("layers")
def lab_layers(
    model: str = opt.MODEL,
    corpus: str | None = opt.CORPUS,
    ctx: int = Option(512, min=4, help="Corpus window length in tokens."),
    kv: str = opt.KV,
    chunks: int = Option(1, min=1, help="Windows (ppl-protocol chunks) to pool."),
    keep_sink: int = opt.SINK,
    keep_recent: int = opt.RECENT,
    json_out: bool = opt.JSON,
    report: str | None = opt.REPORT,
) -> None:
    """Relative attention-output error per layer and KV head for each mode, with flagged outliers."""
    from .lab import layers

    layers.main(config_from(layers.LayersConfig, locals()), json_out, report)


@lab_app.command("needle")
def lab_needle(
    model: str = opt.MODEL,
    corpus: str | None = Option(None, help="Filler text: built-in corpus name or a UTF-8 file."),
    ctx: str = Option("1024,2048,4096,8192", help="Contexts (4k = 4096).", callback=cb.sizes_option()),
    depth: str = Option("0.1,0.5,0.9", help="Depths in [0, 1].", callback=cb.floats_option(0.0, 1.0)),
    kv: str = Option("q8", help="Quantized cache mode compared with f32."),
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
    db: str | None = Option(None, help="Results store, SQLite (default: SPEC with suffix .sqlite)."),
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
    out: str = Option(..., help="Directory for the Markdown report and PNG plots."),
) -> None:
    """Markdown + PNG report of a sweep store: accuracy/memory frontier, KLD vs context, K vs V."""
    from .lab.sweep_report import cli

    cli(db, out)


# == bench attention / decode (kvlens.bench) ==
@bench_app.command("attention")
def bench_attention(
    ctx: str = Option("1k,4k,16k,64k", help="Contexts (4k = 4096).", callback=cb.sizes_option()),
    shape: str = Option("smollm2,8b", help="Head shapes: smollm2 (9/3, hd 64), 8b (32/8, hd 128)."),
    kv: str = Option("f32,f16,q8", help="Cache modes (f32, f16, bf16, q8, q8-k, q8-v)."),
    backend: str | None = Option(None, help="numba, numba-intdot, torch-sdpa, dequant-sdpa, triton (all)"),
    threads: int | None = Option(None, min=1, help="numba and torch threads (default: all cores)."),
    reps: int = Option(5, min=1, help="Interleaved timing rounds (min and median reported)."),
    mem_gib: float = Option(3.0, help="Layer caches cap, GiB.", callback=cb.finite_option(above=0.0)),
    prefill: bool = Option(False, help="Also time the prefill path's whole-history read at 4K."),
    sparse: str | None = Option(None, help="Dense vs sparse q8: quest,probe."),
    sparse_budget: str = Option("1024,2048", help="--sparse: budgets in tokens.", callback=cb.sizes_option()),
    json_out: bool = Option(False, "--json", help="Print the rows as JSON."),
) -> None:
    """One layer's decode attention per call: µs, GB/s vs the measured copy bandwidth, × torch SDPA."""
    from .bench import attention

    if sparse and ctx == "1k,4k,16k,64k":
        ctx = "4k,16k,64k"
    lists = {"ctx": parse_sizes(ctx), "shape": names(shape), "kv": names(kv), "backend": names(backend)}
    lists |= {"sparse": names(sparse), "sparse_budget": parse_sizes(sparse_budget)}
    attention.main(config_from(attention.AttentionBenchConfig, locals(), **lists), json_out)


@bench_app.command("decode")
def bench_decode(
    model: str = Option("smollm2", help=opt.MODEL_HELP),
    ctx: str = Option("512,2048,4096", help="Contexts (4k = 4096).", callback=cb.sizes_option()),
    kv: str = Option("f32,f16,q8", help="Cache modes to compare (comma list)."),
    weights: str = Option("auto", help="Comma list of auto, f32, bf16, int8, int4."),
    steps: int = Option(12, min=3, help="Timed decode steps per round (5 rounds)."),
    attn_backend: str = Option("auto", help=f"Attention backend: {', '.join(BACKENDS)}."),
    hf: bool = Option(True, help="Also time HF generate (f32 weights, ctx ≤ --hf-max-ctx)."),
    hf_max_ctx: int = Option(2048, min=0, help="Largest context at which to run HF transformers."),
    vs_llama_cpp: str = Option(None, metavar="BIN", help="Also run this llama-bench binary."),
    json_out: bool = Option(False, "--json", help="Print the rows as JSON."),
) -> None:
    """Full-model decode tokens/s per weights, cache mode and context; the step's time split; HF
    transformers (and llama.cpp's llama-bench with --vs-llama-cpp) beside it."""
    from .bench import decode

    lists = {"ctx": parse_sizes(ctx), "kv": names(kv), "weights": names(weights)}
    decode.main(config_from(decode.DecodeBenchConfig, locals(), **lists), json_out)


@app.callback()
def _root(debug: bool = Option(False, "--debug", help="Print the traceback of an error.")) -> None:
    if debug:
        os.environ[cli_args.DEBUG_ENV] = "1"


@bench_app.command("serve")
def bench_serve(
    url: str = typer.Option(None, help="Load an already running server instead of starting one per --kv."),
    model: str = typer.Option("smollm2", help=MODEL_HELP),
    kv: str = typer.Option("q8,f16", help="Cache modes: one server each, compared in one run."),
    weights: str = typer.Option("auto", help="Weights of the started servers."),
    kv_budget: str = typer.Option(None, help="KV pool bytes of the started servers (e.g. 512MiB)."),
    max_batch: int = typer.Option(16, min=1, help="Running sequences per step of the started servers."),
    concurrency: str = typer.Option("1,4,8,16", help="Fixed concurrencies (comma list)."),
    rate: float = typer.Option(None, min=0.001, help="Poisson arrival rate (requests/s) instead."),
    requests: int = typer.Option(0, min=0, help="Requests per run (0: 2 x concurrency, at least 4)."),
    prompt_len: int = typer.Option(128, min=1, help="Prompt tokens, cut from the corpus."),
    output_len: int = typer.Option(64, min=1, help="Output tokens per request (ignore_eos)."),
    corpus: str = typer.Option(None, help="Corpus name or UTF-8 file (default: the default corpus)."),
    seed: int = typer.Option(0),
    json_out: bool = typer.Option(False, "--json", help="Print the runs as JSON."),
    api_key: str = typer.Option(None, help="With --url: the server's API key."),
) -> None:
    """Load generator for kvlens serve: output tokens/s, requests/s, TTFT and inter-token latency."""
    from .bench.serve import cli

    kvs = [m for m in kv.split(",") if m]
    cli(url, model, kvs, weights, kv_budget, max_batch, parse_sizes(concurrency), rate, requests,
        prompt_len, output_len, corpus, seed, json_out, api_key)  # fmt: skip


@app.command()
def verify(
    record: str = typer.Argument(..., help="A kvlens record (JSON), or a server response holding one."),
    model: str | None = typer.Option(None, help="Model to re-run with (default: the record's source)."),
) -> None:
    """Re-run a recorded request alone and confirm its output bit for bit, or say where it diverges."""
    from .engine.verify import verify_file

    result = verify_file(record, model)
    typer.echo(result.message)
    raise typer.Exit(0 if result.ok else 1)


def main() -> None:
    cli_args.run_guarded(app)


if __name__ == "__main__":
    main()
