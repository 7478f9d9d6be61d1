"""``kvlens bench serve --scenario multiturn`` and ``--vs-llama-server``: the conversation load, the
per-turn rows, the small pool of the disk arms, the llama-server driver (a stand-in script,
``tests/fake_llama_server.py``, speaking the OpenAI subset with a prompt cache), and one short real
multi-turn run against the real ``kvlens serve``."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

from kvlens.bench import llama_server, multiturn
from kvlens.bench.multiturn import MultiturnLoad, TurnSample
from kvlens.bench.multiturn_arms import run_arms, small_pool
from kvlens.bench.serve import (
    Load,
    RunResult,
    ServeBenchConfig,
    llama_server_runs,
    load_tokenizer,
    mode_ratios,
)

FAKE = Path(__file__).with_name("fake_llama_server.py")


@pytest.fixture(scope="module")
def tok(smol_path):
    return load_tokenizer(str(smol_path))


def fake_llama_server(tmp_path: Path, monkeypatch, fail: bool = False) -> tuple[Path, Path]:
    exe = tmp_path / "llama-server"
    exe.write_text(f"#!{sys.executable}\nimport runpy\nrunpy.run_path({str(FAKE)!r}, run_name='__main__')\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "argv.jsonl"
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(log))
    if fail:
        monkeypatch.setenv("FAKE_LLAMA_FAIL", "1")
    return exe, log


def test_conversations_share_the_system_prompt_and_cut_distinct_turns(tok):
    load = MultiturnLoad(users=3, turns=2, system_len=24, turn_len=10, output_len=4, concurrency=1)
    convs = multiturn.conversations(tok, None, load)
    assert len(convs) == 3 and all(len(c.user_turns) == 2 for c in convs)
    assert len({c.system for c in convs}) == 1 and convs[0].system.startswith(multiturn.SYSTEM_HEAD)
    turns = [t for c in convs for t in c.user_turns]
    assert len(set(turns)) == len(turns)
    assert all(8 <= len(tok.encode(t, add_bos=False)) <= 12 for t in turns)  # 10 tokens, re-tokenized


def test_small_pool_holds_a_third_of_the_conversations():
    # conversations up to 100 tokens in 32-position blocks: 4 + 1 for the reply's last = 5 blocks, of
    # which 1 (a 40-token system prefix) is shared: 1 + 6 x 4 = 25 distinct blocks, a third -> 9
    pool = small_pool([90, 100, 70, 100, 95, 99], 40, users=6, concurrency=1, block=32, bytes_per_token=1000)
    assert (pool.conversation_blocks, pool.blocks, pool.budget_bytes) == (5, 9, 9 * 32 * 1000)
    assert "holds the shared prefix + 2.0 of the 6 conversations (33%)" in pool.line
    # never fewer blocks than the in-flight conversations need
    assert small_pool([100] * 6, 0, users=6, concurrency=3, block=32, bytes_per_token=1).blocks == 15
    assert small_pool([100] * 6, 64, users=6, concurrency=3, block=32, bytes_per_token=1).blocks == 2 + 3 * 3


def test_turn_rows_and_na_when_cached_tokens_are_not_reported():
    load = MultiturnLoad(users=2, turns=2, system_len=1, turn_len=1, output_len=1, concurrency=2)
    samples = [
        TurnSample(0, 1, True, ttft=0.1, prompt_tokens=50, cached_tokens=0),
        TurnSample(1, 1, True, ttft=0.3, prompt_tokens=52, cached_tokens=32),
        TurnSample(0, 2, True, ttft=0.2, prompt_tokens=90, cached_tokens=None),
        TurnSample(1, 2, False, error="boom"),
    ]
    r1, r2 = multiturn.turn_rows("kvlens", "q8", "cache", load, samples)
    assert (r1.requests, r1.failed, r1.prompt_tokens, r1.cached_tokens, r1.computed_tokens) == (
        2,
        0,
        51,
        16,
        35,
    )
    assert r1.ttft_p50 == pytest.approx(0.2)
    assert (r2.requests, r2.failed, r2.cached_tokens, r2.computed_tokens) == (2, 1, None, None)
    assert multiturn.turn_table([r2])[0][-2:] == ["n/a", "n/a"]
    line = multiturn.counters_line("x", multiturn.counters_delta({}, {"kvlens_prompt_tokens_total": 10.0}))
    assert "hit tokens n/a of 10 prompt tokens (n/a)" in line and "spilled n/a, restored n/a" in line


def _row(arm: str, engine: str, ttfts: list[float]) -> list[multiturn.TurnRow]:
    return [
        multiturn.TurnRow(engine, "q8", arm, 2, t, 2, 0, x, x, 0, None, None) for t, x in enumerate(ttfts, 1)
    ]


def test_ratio_lines_use_the_followup_turns_only():
    rows = _row("no-cache", "kvlens", [1.0, 2.0, 4.0]) + _row("cache", "kvlens", [9.0, 0.3, 0.9])
    rows += _row("cache", "llama-server", [1.0, 1.2, 1.8])
    lines = multiturn.ratio_lines(rows)
    # turns >= 2: median(0.3, 0.9) = 0.6 over median(2, 4) = 3 -> 0.20x; llama 1.5 / 0.6 = 2.50x
    assert "q8, concurrency 2: turn >= 2 TTFT with prefix cache / without: 0.20x" in lines
    assert "q8, concurrency 2: turn >= 2 TTFT llama-server / kvlens (both caching): 2.50x" in lines
    assert not any("disk" in ln for ln in lines)


def test_llama_server_multiturn_through_the_stand_in(tmp_path, monkeypatch, tok, smol_path):
    exe, log = fake_llama_server(tmp_path, monkeypatch)
    cfg = ServeBenchConfig(
        model=str(smol_path), kv=["q8", "q8-k"], scenario="multiturn", users=3, turns=3, system_len=12,
        turn_len=6, output_len=3, arms=[], vs_llama_server=str(exe),
    )  # fmt: skip
    assert cfg.concurrency == [1]  # users / 3
    load = MultiturnLoad(3, 3, 12, 6, 3, 1)
    convs = multiturn.conversations(tok, None, load)
    notes: list[str] = []
    rows = run_arms(cfg, tok, convs, [load], notes.append)
    argv = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(argv) == 1  # q8 only: q8-k has no llama.cpp twin
    args = argv[0]
    for flag, value in [("-m", str(smol_path)), ("-ctk", "q8_0"), ("-ctv", "q8_0"), ("-fa", "on"), ("-np", "1"),
                        ("-t", str(llama_server.threads())), ("--host", "127.0.0.1")]:  # fmt: skip
        assert args[args.index(flag) + 1] == value, flag
    assert "--cache-prompt" in args
    assert [(r.engine, r.kv, r.arm, r.turn, r.requests, r.failed) for r in rows] == [
        ("llama-server", "q8", "cache", t, 3, 0) for t in (1, 2, 3)
    ]
    # follow-up turns compute only the new user message: "user:" + its words (the stand-in's tokens)
    # and each prompt is the whole conversation: the last prompt + "assistant:" and the reply + the new message
    for prev, r in zip(rows, rows[1:], strict=False):
        new = [1 + len(c.user_turns[r.turn - 1].split()) for c in convs]
        assert r.computed_tokens == pytest.approx(sum(new) / len(new))
        assert r.prompt_tokens == pytest.approx(prev.prompt_tokens + 1 + 3 + sum(new) / len(new))
    assert notes == [notes[0]] and notes[0].startswith(
        "[llama-server q8 cache conc. 1] prefix hit tokens n/a"
    )


def test_llama_server_throughput_rows_and_ratio(tmp_path, monkeypatch, tok, smol_path):
    exe, log = fake_llama_server(tmp_path, monkeypatch)
    cfg = ServeBenchConfig(model=str(smol_path), kv=["f16"], concurrency=[1, 2], vs_llama_server=str(exe))
    loads = [Load(3, 8, 5, c) for c in (1, 2)]
    results = llama_server_runs(cfg, tok, loads)
    assert [json.loads(x)[json.loads(x).index("-np") + 1] for x in log.read_text().splitlines()] == ["1", "2"]
    assert [(r.kv, r.concurrency, r.failed, r.output_tokens) for r in results] == [
        ("llama.cpp f16", 1, 0, 15),
        ("llama.cpp f16", 2, 0, 15),
    ]
    ours = RunResult("f16", 2, None, 3, 0, 1.0, 15, 2 * results[1].output_tok_s, 1, 0, 0, 0, 0, 0, 0, 0)
    assert mode_ratios([ours, *results]) == [
        "kvlens / llama-server, f16 KV, output tok/s at concurrency 2: 2.00x"
    ]


def test_llama_server_failures_are_clear(tmp_path, monkeypatch, smol_path):
    with pytest.raises(llama_server.LlamaServerError, match="not found"):
        ServeBenchConfig(vs_llama_server=str(tmp_path / "nope"))
    exe, _ = fake_llama_server(tmp_path, monkeypatch, fail=True)
    with pytest.raises(ValueError, match="--rate"):
        ServeBenchConfig(vs_llama_server=str(exe), rate=1.0)
    with pytest.raises(llama_server.LlamaServerError, match="GGUF"):
        llama_server.llama_server_args(tmp_path / "model", "q8", 1, 1)
    with pytest.raises(llama_server.LlamaServerError, match="no llama.cpp cache type"):
        llama_server.llama_server_args(smol_path, "q8-k", 1, 1)
    with pytest.raises(RuntimeError, match="(?s)llama-server exited with 1.*unknown model architecture"):
        llama_server.LlamaServerProcess(exe, llama_server.llama_server_args(smol_path, "q8", 1, 1))
    with pytest.raises(ValueError, match="unknown arm 'ram'"):
        ServeBenchConfig(scenario="multiturn", arms=["cache", "ram"])


@pytest.mark.slow
def test_real_multiturn_run_against_kvlens_serve(tok, smol_path):
    cfg = ServeBenchConfig(
        model=str(smol_path), kv=["q8"], weights="f32", scenario="multiturn", users=2, turns=2, system_len=40,
        turn_len=8, output_len=3, concurrency=[2], arms=["no-cache", "cache"], prefill_chunk=32,
    )  # fmt: skip
    load = MultiturnLoad(2, 2, 40, 8, 3, 2)
    convs = multiturn.conversations(tok, None, load)
    notes: list[str] = []
    rows = run_arms(cfg, tok, convs, [load], notes.append)
    cache = [r for r in rows if r.arm == "cache"]
    assert [(r.turn, r.requests, r.failed) for r in cache] == [(1, 2, 0), (2, 2, 0)]
    # each turn sends the whole conversation: turn 1 is the system prompt + the first user turn
    first = [
        len(tok.encode(tok.apply_chat_template([{"role": "system", "content": c.system},
                                                {"role": "user", "content": c.user_turns[0]}]), add_bos=False))
        for c in convs
    ]  # fmt: skip
    assert cache[0].prompt_tokens == pytest.approx(sum(first) / 2)
    assert cache[1].prompt_tokens > cache[0].prompt_tokens + 8  # + the reply and the second user turn
    # with a prefix cache (reported), turn 2 reuses turn 1's whole 32-token chunks
    if cache[1].cached_tokens is not None:
        assert cache[1].cached_tokens == pytest.approx(sum(32 * (f // 32) for f in first) / 2)
    no_cache = [r for r in rows if r.arm == "no-cache"]
    if no_cache:
        assert all(not r.cached_tokens for r in no_cache)
    else:
        assert any("n/a: this kvlens serve has no --no-prefix-cache" in n for n in notes)


def test_main_prints_the_tables_against_a_url(tmp_path, monkeypatch, smol_path, capsys):
    from kvlens.bench.serve import main

    exe, _ = fake_llama_server(tmp_path, monkeypatch)
    with llama_server.LlamaServerProcess(exe, llama_server.llama_server_args(smol_path, "q8", 2, 1)) as srv:
        common = {"url": srv.url, "model": str(smol_path), "output_len": 2}
        main(ServeBenchConfig(**common, scenario="multiturn", users=2, turns=2, system_len=8, turn_len=4))
        out = capsys.readouterr().out
        assert "bench serve --scenario multiturn" in out and "computed tok" in out
        assert sum(1 for line in out.splitlines() if line.lstrip("│| ").startswith("server")) == 2  # 2 turns
        main(ServeBenchConfig(**common, concurrency=[2], requests=3, prompt_len=4), json_out=True)
        run = json.loads(capsys.readouterr().out)["runs"][0]
        assert (run["kv"], run["concurrency"], run["failed"], run["output_tokens"]) == ("server", 2, 0, 6)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--scenario", "chat"], "unknown scenario 'chat'"),
        (["--scenario", "multiturn", "--arms", "cache,ram"], "unknown arm 'ram'"),
        (["--vs-llama-server", "/nonexistent/llama-server"], "llama-server not found"),
        (["--prefill-chunk", "0"], "--prefill-chunk must be ≥ 1, got 0"),
    ],
)
def test_bench_serve_bad_input_is_one_error_line(monkeypatch, capsys, args, needle):
    from kvlens import cli

    monkeypatch.setattr(sys, "argv", ["kvlens", "bench", "serve", *args])
    with pytest.raises(SystemExit) as e:
        cli.main()
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert e.value.code == 2 and out == "" and "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], err


def test_bench_serve_bad_concurrency_names_the_option(monkeypatch, capsys):
    from kvlens import cli

    monkeypatch.setattr(sys, "argv", ["kvlens", "bench", "serve", "--concurrency", "4,0"])
    with pytest.raises(SystemExit) as e:
        cli.main()
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == "" and "Invalid value for '--concurrency'" in err, err
