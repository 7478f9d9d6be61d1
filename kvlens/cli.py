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
from .cli_bench import bench_app
from .cli_config import KV_HELP, config_from, sparse_policy
from .cli_lab import lab_app
from .corpus import corpus_app
from .engine.attention import BACKENDS

app = typer.Typer(
    add_completion=False,
    pretty_exceptions_enable=False,
    no_args_is_help=True,
    help="kvlens: LLM inference with an int8 KV cache, and the lab that measures its cost.",
)
app.add_typer(lab_app, name="lab")
app.add_typer(bench_app, name="bench")
app.add_typer(corpus_app, name="corpus")  # its commands live with the corpus


@app.command()
def generate(
    prompt: str = Argument(..., help="The prompt text.", callback=cb.text_argument),
    model: str = opt.MODEL,
    kv: str = Option("q8", help=opt.KV_HELP),
    max_tokens: int = Option(64, "--max-tokens", min=1, help="New tokens to generate at most."),
    chat: bool = Option(False, help="Wrap the prompt in the model's chat template."),
    temperature: float = Option(0.0, help="0 = greedy.", callback=cb.finite_option(minimum=0.0)),
    top_k: int = Option(0, min=0),
    top_p: float = Option(1.0, callback=cb.finite_option(above=0.0, maximum=1.0)),
    seed: int | None = Option(None),
    prefill_chunk: int = Option(512, min=1, help="Prompt tokens per prefill chunk."),
    attn_backend: str = Option(
        "auto", help=f"Attention backend: {', '.join(BACKENDS)}.", callback=cb.backend_option
    ),
    mirror_prefill: str = Option("exact", help="q8+mirror: prefill reads the 'exact' copy or 'q8' rows."),
    device: str | None = Option(None, help="cpu or cuda (default: cuda if any).", callback=cb.device_option),
    weights: str = Option(
        "auto",
        help="f32, bf16, int8, int4 (kept quantized); auto: the file's own.",
        callback=cb.weights_option,
    ),
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
    model: str = opt.MODEL,
    kv: str = typer.Option("q8", help=KV_HELP),
    weights: str = typer.Option(
        "auto", help="Weights: auto, f32, bf16, int8, int4.", callback=cb.weights_option
    ),
    kv_budget: str = typer.Option(
        None,
        help="KV pool bytes, e.g. 512MiB (default: a share of free memory).",
        callback=cb.byte_size_option,
    ),
    max_batch: int = typer.Option(16, min=1, help="Running sequences per step."),
    max_waiting: int = typer.Option(
        64, min=0, help="Requests that may wait beyond the free --max-batch slots (more: 429)."
    ),
    prefill_chunk: int = typer.Option(
        512, min=1, help="Prompt tokens per prefill chunk: the prefix reuse unit."
    ),
    prefix_cache: bool = typer.Option(True, help="Reuse the KV of repeated prompt prefixes (exact)."),
    kv_disk: str = typer.Option(
        None,
        help="Directory where evicted prefix blocks are spilled and restored.",
        callback=cb.output_dir_option,
    ),
    kv_disk_budget: str = typer.Option(
        "4GiB", help="Bytes of block files kept under --kv-disk.", callback=cb.byte_size_option
    ),
    host: str = typer.Option("127.0.0.1"),
    port: int = typer.Option(8000, min=0, max=65535),
    api_key: str = typer.Option(
        None, help="Require 'Authorization: Bearer KEY' on /v1/*.", callback=cb.api_key_option
    ),
    graceful_s: float = typer.Option(
        10.0,
        help="On SIGTERM: seconds in-flight requests get to finish.",
        callback=cb.finite_option(minimum=0),
    ),
    warmup: bool = typer.Option(True, help="Run tiny requests before listening (compiles the kernels)."),
) -> None:
    """An OpenAI-compatible HTTP server (completions, chat, SSE streaming) with continuous batching."""
    from .serve.cli import ServeConfig
    from .serve.cli import serve as run

    run(config_from(ServeConfig, locals()))


@app.callback()
def _root(debug: bool = Option(False, "--debug", help="Print the traceback of an error.")) -> None:
    if debug:
        os.environ[cli_args.DEBUG_ENV] = "1"


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
    from .cli_notice import announce_compiles_once

    announce_compiles_once()  # a cold kernel cache compiles for minutes before any output: say so
    cli_args.run_guarded(app)


if __name__ == "__main__":
    main()
