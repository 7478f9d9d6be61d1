"""``kvlens bench serve``'s bookkeeping, which every row and ratio of docs/serve.md rests on: the
prompts cut from the corpus, what one streamed request records (TTFT, the gaps between chunks, the
tokens), the concurrency gate and the Poisson gaps, the summary of a run, ``x conc. 1`` and the
ratio lines, the defaults the config and ``main`` fill in, and the preemptions counted per run.
Stand-ins: a scripted clock and stream, a recorder of the server calls; no server runs."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import numpy as np
import openai
import pytest
from test_bench_multiturn import tok  # noqa: F401  (the tokenizer fixture)

from kvlens.bench import serve
from kvlens.bench.serve import Load, RunResult, Sample, ServeBenchConfig


def test_prompts_are_windows_of_the_corpus_at_distinct_seeded_offsets(tok, tmp_path):  # noqa: F811
    text = " ".join(f"word{i} w{i % 7}" for i in range(3000))
    corpus = tmp_path / "c.txt"
    corpus.write_text(text)
    ids = tok.encode(text, add_bos=False)
    windows = {tuple(ids[s : s + 12]) for s in range(len(ids) - 11)}
    prompts = serve.corpus_prompts(tok, str(corpus), 8, 12, seed=3)
    assert len(prompts) == 8 and all(len(p) == 12 and tuple(p) in windows for p in prompts)
    assert len({tuple(p) for p in prompts}) == 8
    assert serve.corpus_prompts(tok, str(corpus), 8, 12, seed=3) == prompts
    assert serve.corpus_prompts(tok, str(corpus), 8, 12, seed=4) != prompts


def _chunk(text: str | None = None, usage: tuple[int, int] | None = None):
    choices = [] if text is None else [SimpleNamespace(text=text)]
    u = None if usage is None else SimpleNamespace(prompt_tokens=usage[0], completion_tokens=usage[1])
    return SimpleNamespace(choices=choices, usage=u)


def scripted(monkeypatch, module, chunks: list, times: list[float]) -> None:
    """``module``'s clock reads ``times`` in turn and its ``open_stream`` yields ``chunks`` (only the
    module's: numba, torch and asyncio keep their clocks)."""
    ticks = iter(times)
    monkeypatch.setattr(module, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))

    async def stream():
        for c in chunks:
            yield c

    async def open_stream(create, model, output_len, **request):
        return stream()

    monkeypatch.setattr(module, "open_stream", open_stream)


def test_one_request_records_ttft_gaps_and_the_reported_tokens(monkeypatch):
    # sent at 10; text at 11, 12, 14; an empty chunk at 14.5 (no text: not a token gap); usage at 15; done 16
    chunks = [_chunk("a"), _chunk("b"), _chunk("c"), _chunk(""), _chunk(usage=(7, 3))]
    scripted(monkeypatch, serve, chunks, [10.0, 11.0, 12.0, 14.0, 14.5, 15.0, 16.0])
    s = asyncio.run(serve._one(SimpleNamespace(completions=SimpleNamespace(create=None)), "m", [1, 2], 3))
    assert (s.ok, s.output_tokens, s.ttft, s.latency, s.itls) == (True, 3, 1.0, 6.0, [1.0, 2.0])


def test_a_request_the_server_refuses_is_a_failed_sample(monkeypatch):
    async def open_stream(create, model, output_len, **request):
        raise openai.APIConnectionError(request=httpx.Request("POST", "http://127.0.0.1:9/v1/completions"))

    monkeypatch.setattr(serve, "open_stream", open_stream)
    monkeypatch.setattr(serve, "time", SimpleNamespace(perf_counter=lambda: 0.0))
    s = asyncio.run(serve._one(SimpleNamespace(completions=SimpleNamespace(create=None)), "m", [1], 3))
    assert not s.ok and s.error.startswith("APIConnectionError") and s.output_tokens == 0


async def _no_peaks(url, peaks, stop, period_s):
    await stop.wait()


def _load_run(monkeypatch, load: Load, n: int) -> tuple[int, list[float]]:
    """run_load with a stand-in request that takes 10 ms; the most requests in flight at once and the
    scales the arrival gaps were drawn with."""
    live, most, scales = [0], [0], []

    async def one(client, model, prompt, output_len):
        live[0] += 1
        most[0] = max(most[0], live[0])
        await asyncio.sleep(0.01)
        live[0] -= 1
        return Sample(True, None, output_len)

    class Rng:
        def exponential(self, scale: float) -> float:
            scales.append(scale)
            return 0.0

    monkeypatch.setattr(serve, "_one", one)
    monkeypatch.setattr(serve, "watch_peaks", _no_peaks)
    monkeypatch.setattr(serve.np.random, "default_rng", lambda seed: Rng())
    samples, duration, _ = asyncio.run(serve.run_load("http://127.0.0.1:9", "m", [[1]] * n, load))
    assert len(samples) == n and duration > 0
    return most[0], scales


def test_the_gate_holds_the_concurrency_and_the_rate_draws_its_gaps(monkeypatch):
    assert _load_run(monkeypatch, Load(6, 1, 2, concurrency=2), 6) == (2, [])
    most, scales = _load_run(monkeypatch, Load(5, 1, 2, concurrency=None, rate=4.0), 5)
    assert most >= 1 and scales == [0.25] * 5  # mean gap 1 / rate


def test_summary_counts_the_failed_apart_and_pools_the_gaps():
    ok = [Sample(True, None, 10, ttft, 2.0, itls) for ttft, itls in
          [(0.1, [0.01, 0.03]), (0.2, [0.02]), (0.3, []), (0.6, [0.05, 0.07, 0.09])]]  # fmt: skip
    samples = [*ok, Sample(False, "APIError: boom"), Sample(False, "APIError: boom")]
    r = serve.summarize("q8", Load(6, 4, 10, 2), samples, 2.0, {"kvlens_requests_running": 2.0,
                        "kvlens_requests_waiting": 1.0}, 3)  # fmt: skip
    assert (r.requests, r.failed, r.output_tokens, r.output_tok_s, r.req_s) == (6, 2, 40, 20.0, 2.0)
    # linear-interpolated percentiles by hand, rank p/100 * (n - 1) between the sorted neighbours:
    # TTFTs 0.1, 0.2, 0.3, 0.6 (the failed have none); gaps of all requests 0.01, 0.02, 0.03, 0.05, 0.07, 0.09
    assert r.ttft_p50 == pytest.approx(0.25) and r.ttft_p99 == pytest.approx(0.3 + 0.97 * 0.3)
    assert r.itl_p50 == pytest.approx(0.04) and r.itl_p99 == pytest.approx(0.07 + 0.95 * 0.02)
    assert (r.peak_running, r.peak_waiting, r.preemptions, r.errors) == (2, 1, 3, ["APIError: boom"])


def _result(kv: str, conc: int | None, tok_s: float, rate: float | None = None) -> RunResult:
    return RunResult(kv, conc, rate, 4, 0, 1.0, 0, tok_s, 1.0, 0, 0, 0, 0, 0, 0, 0)


def test_x_conc_1_is_over_the_same_mode_and_ratios_pair_the_same_load():
    results = [
        _result("q8", 1, 10.0),
        _result("q8", 4, 30.0),
        _result("f16", 1, 20.0),
        _result("f16", 4, 40.0),
    ]
    assert [row[6] for row in serve.table_rows(results)] == ["1.00", "3.00", "1.00", "2.00"]
    assert serve.mode_ratios(results) == [
        "q8 / f16 output tok/s at concurrency 1: 0.50x",
        "q8 / f16 output tok/s at concurrency 4: 0.75x",
    ]
    rated = [_result("q8", None, 9.0, rate=2.0), _result("f16", None, 12.0, rate=2.0)]
    assert serve.mode_ratios(rated) == ["q8 / f16 output tok/s at rate 2.0/s: 0.75x"]
    assert serve.table_rows(rated)[0][6] == "-"


@pytest.mark.parametrize(("users", "conc"), [(1, 1), (3, 1), (4, 2), (6, 2), (7, 3)])
def test_multiturn_concurrency_defaults_to_a_third_of_the_users_rounded_up(users, conc):
    assert ServeBenchConfig(scenario="multiturn", users=users).concurrency == [conc]


def test_server_args_carry_the_budget_only_when_given():
    base = ["--model", "m", "--kv", "q8", "--weights", "auto", "--max-batch", "8"]
    assert serve.server_args("m", "q8", "auto", None, 8) == base
    assert serve.server_args("m", "q8", "auto", "64MiB", 8) == [*base, "--kv-budget", "64MiB"]


def test_main_fills_the_request_counts_and_strips_the_url(monkeypatch, capsys, smol_path):
    seen = []

    def runs_against(url, label, tok, loads, corpus, api_key=None):  # noqa: F811
        seen.append((url, loads))
        return [_result(label, ld.concurrency, 1.0, ld.rate) for ld in loads]

    monkeypatch.setattr(serve, "runs_against", runs_against)
    serve.main(ServeBenchConfig(url="http://127.0.0.1:9/", model=str(smol_path), concurrency=[1, 3, 4]))
    serve.main(ServeBenchConfig(url="http://127.0.0.1:9", model=str(smol_path), rate=2.0, seed=5))
    capsys.readouterr()
    (url1, loads1), (url2, loads2) = seen
    assert url1 == url2 == "http://127.0.0.1:9"
    assert [(ld.requests, ld.concurrency) for ld in loads1] == [(4, 1), (6, 3), (8, 4)]  # 2 x conc., >= 4
    assert [(ld.requests, ld.concurrency, ld.rate, ld.seed) for ld in loads2] == [(8, None, 2.0, 5)]


def test_preemptions_are_counted_per_run(monkeypatch, tok):  # noqa: F811
    scraped = iter([{"kvlens_preemptions_total": 5.0}, {"kvlens_preemptions_total": 7.0},
                    {"kvlens_preemptions_total": 7.0}, {"kvlens_preemptions_total": 7.0}])  # fmt: skip

    async def run_load(url, model, prompts, load, api_key=None):
        return [Sample(True, None, load.output_len, 0.1, 0.2, [])] * len(prompts), 1.0, {
            "kvlens_requests_running": 1.0, "kvlens_requests_waiting": 0.0}  # fmt: skip

    monkeypatch.setattr(serve, "served_model", lambda url, key=None: "m")
    monkeypatch.setattr(serve, "scrape_metrics", lambda url: next(scraped))
    monkeypatch.setattr(serve, "run_load", run_load)
    results = serve.runs_against("http://x", "q8", tok, [Load(2, 4, 3, 1), Load(2, 4, 3, 2)], None)
    assert [(r.preemptions, r.output_tokens) for r in results] == [(2, 6), (0, 6)]
    assert np.isfinite(results[0].ttft_p50)
