"""``kvlens bench …``: benchmarks that print ratios measured side by side in one run."""

from __future__ import annotations

import typer
from typer import Option

from . import cli_args as cb  # option callbacks: values checked at parse time
from . import cli_config as opt  # options shared by several commands
from .cli_args import parse_sizes
from .cli_config import config_from, names
from .engine.attention import BACKENDS

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that print ratios measured side by side.")


# == bench attention / decode (kvlens.bench) ==
@bench_app.command("attention")
def bench_attention(
    ctx: str = Option("1k,4k,16k,64k", help="Contexts (4k = 4096).", callback=cb.sizes_option()),
    shape: str = Option(
        "smollm2,8b", help="Head shapes: smollm2 (9/3, hd 64), 8b (32/8, hd 128), gemma3 (4/1, hd 256)."
    ),
    kv: str = Option(
        "f32,f16,q8", help="Cache modes (f32, f16, bf16, q8, q8-k, q8-v, q8h, q4, q4h, q7h, q6h, q5h)."
    ),
    backend: str | None = Option(
        None, help="numba, numba-intdot, numba-int[16][:PATH], torch-sdpa, dequant-sdpa, triton"
    ),
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
    model: str = opt.MODEL,
    ctx: str = Option("512,2048,4096", help="Contexts (4k = 4096).", callback=cb.sizes_option()),
    kv: str = Option("f32,f16,q8", help="Cache modes to compare (comma list)."),
    weights: str = Option("auto", help="Comma list of auto, f32, bf16, int8, int4."),
    steps: int = Option(12, min=3, help="Timed decode steps per round (5 rounds)."),
    attn_backend: str = Option(
        "auto", help=f"Attention backends (comma list: every KV mode each runs): {', '.join(BACKENDS)}."
    ),
    hf: bool = Option(True, help="Also time HF generate (f32 weights, ctx ≤ --hf-max-ctx)."),
    hf_max_ctx: int = Option(2048, min=0, help="Largest context at which to run HF transformers."),
    vs_llama_cpp: str = Option(None, metavar="BIN", help="Also run this llama-bench binary."),
    step: str = Option("fused", help="Decode step: fused (one call per layer), general, or both."),
    json_out: bool = Option(False, "--json", help="Print the rows as JSON."),
) -> None:
    """Full-model decode tokens/s per weights, cache mode and context; the step's time split; HF
    transformers (and llama.cpp's llama-bench with --vs-llama-cpp) beside it."""
    from .bench import decode

    lists = {
        "ctx": parse_sizes(ctx),
        "kv": names(kv),
        "weights": names(weights),
        "attn_backend": names(attn_backend),
    }
    decode.main(config_from(decode.DecodeBenchConfig, locals(), **lists), json_out)


@bench_app.command("engine")
def bench_engine(
    model: str = opt.MODEL,
    kv: str = Option("q8,f16", help="Cache modes to compare (comma list; ratios are over the first)."),
    weights: str = Option("auto", help="Weights: auto, f32, bf16, int8 or int4."),
    batches: str = Option(
        "1,4,8,16", help="Batch sizes: sequences decoding together.", callback=cb.sizes_option(suffix=False)
    ),
    prompt_len: int = Option(64, min=1, help="Prompt tokens per sequence, cut from the corpus."),
    steps: int = Option(16, min=1, help="Timed decode steps per round."),
    rounds: int = Option(5, min=1, help="Interleaved timing rounds (after one warm-up round)."),
    loop: bool = Option(True, help="Also time the LLM's own one-sequence loop over a contiguous cache."),
    corpus: str | None = opt.CORPUS,
    seed: int = Option(0, help="Seed of the prompts' offsets in the corpus."),
    json_out: bool = opt.JSON,
) -> None:
    """The serving engine's aggregate decode tokens/s per cache mode and batch size, in process (no HTTP)."""
    from .bench import engine_decode

    lists = {"kv": names(kv), "batches": parse_sizes(batches)}
    engine_decode.main(config_from(engine_decode.EngineBenchConfig, locals(), **lists), json_out)


@bench_app.command("serve")
def bench_serve(
    url: str = typer.Option(
        None, help="Load an already running server instead of starting one per --kv.", callback=cb.url_option
    ),
    model: str = opt.MODEL,
    kv: str = typer.Option("q8,f16", help="Cache modes: one server each, compared in one run."),
    weights: str = typer.Option("auto", help="Weights of the started servers.", callback=cb.weights_option),
    kv_budget: str = typer.Option(
        None, help="KV pool bytes of the started servers (e.g. 512MiB).", callback=cb.byte_size_option
    ),
    max_batch: int = typer.Option(16, min=1, help="Running sequences per step of the started servers."),
    concurrency: str = typer.Option(
        None,
        help="Fixed concurrencies, comma list (default 1,4,8,16; multiturn: users/3).",
        callback=cb.sizes_option(suffix=False),
    ),
    rate: float = typer.Option(
        None, help="Poisson arrival rate (requests/s) instead.", callback=cb.finite_option(minimum=0.001)
    ),
    requests: int = typer.Option(0, min=0, help="Requests per run (0: 2 x concurrency, at least 4)."),
    prompt_len: int = typer.Option(128, min=1, help="Prompt tokens, cut from the corpus."),
    output_len: int = typer.Option(64, min=1, help="Output tokens per request (ignore_eos)."),
    corpus: str = typer.Option(None, help="Corpus name or UTF-8 file (default: the default corpus)."),
    seed: int = typer.Option(0),
    json_out: bool = typer.Option(False, "--json", help="Print the runs as JSON."),
    api_key: str = typer.Option(None, help="With --url: the server's API key."),
    scenario: str = typer.Option(
        "throughput", help="throughput (fixed prompts) or multiturn (growing chats)."
    ),
    users: int = typer.Option(6, min=1, help="multiturn: conversations (users)."),
    turns: int = typer.Option(4, min=1, help="multiturn: turns per conversation."),
    system_len: int = typer.Option(128, min=0, help="multiturn: corpus tokens in the shared system prompt."),
    turn_len: int = typer.Option(64, min=1, help="multiturn: tokens per user turn."),
    arms: str = typer.Option(
        "no-cache,cache,disk", help="multiturn: no-cache, cache, disk, small (see docs/serve.md)."
    ),
    kv_disk_budget: str = typer.Option(
        "4GiB", help="multiturn: --kv-disk-budget of the disk arm.", callback=cb.byte_size_option
    ),
    prefill_chunk: int = typer.Option(
        None,
        help="multiturn: the kvlens servers' --prefill-chunk (their prefix reuse unit), if they have it.",
    ),
    vs_llama_server: str = typer.Option(
        None, metavar="BIN", help="Also run llama.cpp's llama-server under the same load."
    ),
) -> None:
    """Load generator for kvlens serve: output tokens/s, requests/s, TTFT and inter-token latency;
    --scenario multiturn: per-turn TTFT and computed prefill with/without the prefix cache and disk tier."""
    from .bench.serve import ServeBenchConfig, main

    lists = {"kv": names(kv), "arms": names(arms)}
    lists["concurrency"] = parse_sizes(concurrency) if concurrency else None
    main(config_from(ServeBenchConfig, locals(), **lists), json_out)
