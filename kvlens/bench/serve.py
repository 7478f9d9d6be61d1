"""``kvlens bench serve``: a load generator for ``kvlens serve`` (in the spirit of vLLM's
benchmark_serving.py).

N streamed completions through the async ``openai`` client, prompts of a fixed token length cut
from the corpus at seeded offsets, ``ignore_eos`` so every request produces exactly its output
length; a fixed concurrency or Poisson arrivals at a rate. Reports output tokens/s, requests/s,
time to first token and inter-token latency (gaps between streamed chunks) p50/p99, and the peak
running / waiting sequences seen on ``/metrics`` (sampled every 0.2 s). With ``--kv a,b`` one
server per cache mode is started in turn, the modes compared in the same run.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from ..checks import check_counts, check_field_types, check_float, check_list_fields, check_url
from ..kv.modes import split_mode_list
from ..models.loader import resolve_model
from ..models.tokenizer import Tokenizer
from ..serve.process import scrape_metrics, served_model, watch_peaks
from .openai_stream import open_stream

METRICS_PERIOD_S = 0.2


@dataclass(frozen=True)
class Load:
    requests: int
    prompt_len: int
    output_len: int
    concurrency: int | None  # None: no cap (with a rate)
    rate: float | None = None  # requests/s, Poisson arrivals; None: all at once (capped by concurrency)
    seed: int = 0


@dataclass
class Sample:
    """One request as the client saw it."""

    ok: bool
    error: str | None = None
    output_tokens: int = 0
    ttft: float = float("nan")
    latency: float = float("nan")
    itls: list[float] = field(default_factory=list)


@dataclass
class RunResult:
    kv: str
    concurrency: int | None
    rate: float | None
    requests: int
    failed: int
    duration_s: float
    output_tokens: int
    output_tok_s: float
    req_s: float
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float
    peak_running: int
    peak_waiting: int
    preemptions: int
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def load_tokenizer(model: str) -> Tokenizer:
    """The model's tokenizer alone (no weights)."""
    from ..models.gguf_loader import open_gguf

    path = resolve_model(model)
    return Tokenizer.from_hf_dir(path) if path.is_dir() else Tokenizer.from_gguf_metadata(open_gguf(path)[1])


def corpus_prompts(tok: Tokenizer, corpus: str | None, n: int, prompt_len: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``prompt_len`` token ids, cut from the corpus at seeded offsets."""
    from ..corpus import load_corpus

    text, label = load_corpus(corpus)
    ids = tok.encode(text[: max(200_000, 8 * prompt_len * n)], add_bos=False)
    if len(ids) < prompt_len + 1:
        raise ValueError(f"corpus {label!r} has {len(ids)} tokens, fewer than --prompt-len {prompt_len}")
    rng = random.Random(seed)
    starts = [rng.randrange(0, len(ids) - prompt_len) for _ in range(n)]
    return [ids[s : s + prompt_len] for s in starts]


async def _one(client, model: str, prompt: list[int], output_len: int) -> Sample:
    import openai

    t0 = time.perf_counter()
    first = last = None
    itls: list[float] = []
    tokens = 0
    try:
        stream = await open_stream(client.completions.create, model, output_len, prompt=prompt)
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].text:
                if first is None:
                    first = now
                else:
                    itls.append(now - last)
                last = now
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
    except openai.APIError as e:
        return Sample(False, f"{type(e).__name__}: {e}")
    end = time.perf_counter()
    return Sample(True, None, tokens, (first or end) - t0, end - t0, itls)


async def run_load(
    url: str, model: str, prompts: list[list[int]], load: Load, api_key: str | None = None
) -> tuple[list[Sample], float, dict]:
    """Send the requests; returns the samples, the wall time and the peaks seen on /metrics."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key or "none", max_retries=0, timeout=3600)
    gate = asyncio.Semaphore(load.concurrency or len(prompts))
    rng = np.random.default_rng(load.seed)
    peaks = {"kvlens_requests_running": 0.0, "kvlens_requests_waiting": 0.0}
    stop = asyncio.Event()
    watcher = asyncio.create_task(watch_peaks(url, peaks, stop, METRICS_PERIOD_S))

    async def gated(prompt: list[int]) -> Sample:
        async with gate:
            return await _one(client, model, prompt, load.output_len)

    t0 = time.perf_counter()
    tasks = []
    for prompt in prompts:
        tasks.append(asyncio.create_task(gated(prompt)))
        if load.rate:
            await asyncio.sleep(float(rng.exponential(1.0 / load.rate)))
    samples = await asyncio.gather(*tasks)
    duration = time.perf_counter() - t0
    stop.set()
    await watcher
    await client.close()
    return list(samples), duration, peaks


def summarize(
    kv: str, load: Load, samples: list[Sample], duration: float, peaks: dict, preempt: int
) -> RunResult:
    ok = [s for s in samples if s.ok]
    ttfts = np.array([s.ttft for s in ok]) if ok else np.array([np.nan])
    itls = np.array([g for s in ok for g in s.itls]) if any(s.itls for s in ok) else np.array([np.nan])
    out = sum(s.output_tokens for s in ok)
    return RunResult(
        kv, load.concurrency, load.rate, len(samples), len(samples) - len(ok), duration, out,
        out / duration, len(ok) / duration,
        float(np.percentile(ttfts, 50)), float(np.percentile(ttfts, 99)),
        float(np.percentile(itls, 50)), float(np.percentile(itls, 99)),
        int(peaks["kvlens_requests_running"]), int(peaks["kvlens_requests_waiting"]), preempt,
        sorted({s.error for s in samples if s.error}),
    )  # fmt: skip


def server_args(model: str, kv: str, weights: str, kv_budget: str | None, max_batch: int) -> list[str]:
    args = ["--model", model, "--kv", kv, "--weights", weights, "--max-batch", str(max_batch)]
    return args + (["--kv-budget", kv_budget] if kv_budget else [])


def runs_against(
    url: str, label: str, tok: Tokenizer, loads: list[Load], corpus: str | None, api_key: str | None = None
) -> list[RunResult]:
    """Each load in turn against a running server (after one short warm-up request)."""
    model = served_model(url, api_key)
    warm = corpus_prompts(tok, corpus, 1, 16, seed=12345)  # compiles the kernels before timing
    asyncio.run(run_load(url, model, warm, Load(1, 16, 4, 1), api_key))
    results = []
    for load in loads:
        prompts = corpus_prompts(tok, corpus, load.requests, load.prompt_len, load.seed)
        before = scrape_metrics(url).get("kvlens_preemptions_total", 0.0)
        samples, duration, peaks = asyncio.run(run_load(url, model, prompts, load, api_key))
        preempt = int(scrape_metrics(url).get("kvlens_preemptions_total", 0.0) - before)
        results.append(summarize(label, load, samples, duration, peaks, preempt))
    return results


TABLE_HEADERS = ["KV", "conc.", "rate", "requests", "failed", "out tok/s", "x conc. 1", "req/s",
                 "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "peak run", "peak wait", "preempt"]  # fmt: skip


def table_rows(results: list[RunResult]) -> list[list]:
    single = {r.kv: r.output_tok_s for r in results if r.concurrency == 1 and not r.rate}
    rows = []
    for r in results:
        base = single.get(r.kv)
        rows.append([
            r.kv, r.concurrency or "-", r.rate or "-", r.requests, r.failed, f"{r.output_tok_s:.1f}",
            f"{r.output_tok_s / base:.2f}" if base else "-", f"{r.req_s:.2f}",
            f"{1e3 * r.ttft_p50:.0f}", f"{1e3 * r.ttft_p99:.0f}", f"{1e3 * r.itl_p50:.1f}",
            f"{1e3 * r.itl_p99:.1f}", r.peak_running, r.peak_waiting, r.preemptions,
        ])  # fmt: skip
    return rows


def mode_ratios(results: list[RunResult]) -> list[str]:
    """First kvlens mode's output tok/s over each other's, and kvlens over llama-server with the same
    KV type, at the same load."""
    kinds = [k for k in dict.fromkeys(r.kv for r in results) if not k.startswith(LLAMA_LABEL)]
    pairs = [(kinds[0], other, f"{kinds[0]} / {other}") for other in kinds[1:]]
    pairs += [(k, f"{LLAMA_LABEL} {k}", f"kvlens / llama-server, {k} KV,") for k in kinds]
    lines = []
    for first, other, what in pairs:
        for a in (r for r in results if r.kv == first):
            b = next(
                (r for r in results if r.kv == other and (r.concurrency, r.rate) == (a.concurrency, a.rate)),
                None,
            )
            if b and b.output_tok_s > 0:
                load = f"concurrency {a.concurrency}" if not a.rate else f"rate {a.rate}/s"
                lines.append(f"{what} output tok/s at {load}: {a.output_tok_s / b.output_tok_s:.2f}x")
    return lines


SCENARIOS = ("throughput", "multiturn")
LLAMA_LABEL = "llama.cpp"


@dataclass
class ServeBenchConfig:
    """``kvlens bench serve``: one server per KV mode (or ``url``), the load of ``scenario`` at each
    concurrency; with ``vs_llama_server`` llama.cpp's server under the same load in the same run."""

    url: str | None = None
    model: str = "smollm2"
    kv: list[str] = field(default_factory=lambda: ["q8", "f16"])
    weights: str = "auto"
    kv_budget: str | None = None
    max_batch: int = 16
    concurrency: list[int] | None = None  # None: 1,4,8,16 (throughput), ceil(users / 3) (multiturn)
    rate: float | None = None
    requests: int = 0
    prompt_len: int = 128
    output_len: int = 64
    corpus: str | None = None
    seed: int = 0
    api_key: str | None = None
    scenario: str = "throughput"
    users: int = 6
    turns: int = 4
    system_len: int = 128
    turn_len: int = 64
    arms: list[str] = field(default_factory=lambda: ["no-cache", "cache", "disk"])
    kv_disk_budget: str = "4GiB"
    prefill_chunk: int | None = None  # multiturn: the kvlens servers' --prefill-chunk (prefix reuse unit)
    vs_llama_server: str | None = None

    def __post_init__(self) -> None:
        check_field_types(self)
        from ..kv.modes import KVMode
        from ..models.loader import check_weights_mode
        from ..serve.cli import check_sizes
        from .llama_server import find_llama_server
        from .multiturn import ARMS

        kinds = {"kv": str, "arms": str, "concurrency": int}
        check_list_fields(
            self, kinds, optional=("concurrency",), split=split_mode_list, may_be_empty=("arms",)
        )
        if not self.arms and self.scenario == "multiturn" and not self.vs_llama_server:
            raise ValueError("arms (--arms) is empty: give at least one arm, or --vs-llama-server")
        for m in self.kv:
            KVMode.parse(m)
        if self.scenario not in SCENARIOS:
            raise ValueError(f"unknown scenario {self.scenario!r}; choose from {', '.join(SCENARIOS)}")
        if bad := [a for a in self.arms if a not in ARMS]:
            raise ValueError(f"unknown arm {bad[0]!r}; choose from {', '.join(ARMS)}")
        check_counts(
            self, "max_batch", "prompt_len", "output_len", "users", "turns", "turn_len", "prefill_chunk"
        )
        check_counts(self, "requests", "system_len", minimum=0)
        if self.concurrency is not None and not self.concurrency:
            raise ValueError("--concurrency must list numbers >= 1")
        check_counts(self, "concurrency")
        if self.rate is not None:
            check_float(self.rate, "--rate", minimum=0.001)  # the CLI's floor: a slower rate sleeps for days
        if self.url is not None:
            check_url(self.url)
        check_weights_mode(self.weights)
        check_sizes(self, "kv_budget", "kv_disk_budget")
        if self.concurrency is None:
            self.concurrency = [1, 4, 8, 16] if self.scenario == "throughput" else [-(-self.users // 3)]
        if self.vs_llama_server:
            if self.rate:
                raise ValueError("--vs-llama-server needs fixed concurrencies (its -np), not --rate")
            find_llama_server(self.vs_llama_server)  # fail before the long run


def main(cfg: ServeBenchConfig, json_out: bool = False) -> None:
    """The body of ``kvlens bench serve``."""
    tok = load_tokenizer(cfg.model)
    if cfg.scenario == "multiturn":
        from .multiturn_arms import main as multiturn_main

        multiturn_main(cfg, tok, json_out)
        return
    import json

    from ..report import print_table
    from ..serve.process import ServerProcess

    concs: list[int | None] = [None] if cfg.rate else list(cfg.concurrency or [])
    loads = [
        Load(cfg.requests or max(4, 2 * (c or 4)), cfg.prompt_len, cfg.output_len, c, cfg.rate, cfg.seed)
        for c in concs
    ]
    results, budgets = [], {}
    if cfg.url:
        results = runs_against(cfg.url.rstrip("/"), "server", tok, loads, cfg.corpus, cfg.api_key)
    for mode in [] if cfg.url else cfg.kv:
        with ServerProcess(server_args(cfg.model, mode, cfg.weights, cfg.kv_budget, cfg.max_batch)) as srv:
            budgets[mode] = srv.budget_line()
            results += runs_against(srv.url, mode, tok, loads, cfg.corpus)
    results += llama_server_runs(cfg, tok, loads)
    if json_out:
        print(json.dumps({"budgets": budgets, "runs": [r.as_dict() for r in results]}, indent=1))
        return
    for line in budgets.values():
        print(line)
    title = f"bench serve: {cfg.model}, weights {cfg.weights}, prompt {cfg.prompt_len} + output {cfg.output_len} tokens"
    print_table(title, TABLE_HEADERS, table_rows(results), width=170)
    for line in mode_ratios(results):
        print(line)
    for r in results:
        for err in r.errors:
            print(f"[{r.kv}] error: {err}")


def llama_server_runs(cfg: ServeBenchConfig, tok: Tokenizer, loads: list[Load]) -> list[RunResult]:
    """With ``--vs-llama-server``: each load against llama-server (``-np`` = its concurrency) per KV mode
    that has a llama.cpp twin."""
    from .llama_cpp import KV_TYPES
    from .llama_server import LlamaServerProcess, llama_server_args, threads

    if not cfg.vs_llama_server:
        return []
    gguf = resolve_model(cfg.model)
    results = []
    for mode in (m for m in cfg.kv if m in KV_TYPES):
        for load in loads:
            args = llama_server_args(gguf, mode, load.concurrency or 1, threads())
            with LlamaServerProcess(cfg.vs_llama_server, args) as srv:
                results += runs_against(srv.url, f"{LLAMA_LABEL} {mode}", tok, [load], cfg.corpus)
    return results
