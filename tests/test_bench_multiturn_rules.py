"""``kvlens bench serve --scenario multiturn``'s bookkeeping beyond ``test_bench_multiturn``: the
system prompt's length, the conversation sizes the small pool is cut from, what one streamed chat
turn records, how a user's conversation grows and stops, the turn rows' p90 and unknown cached
counts, the counters gained, the ratio lines, each arm's server options, the skipped arms, and
llama-server's executable check. Stand-ins: a scripted clock and stream, recorders of the servers."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from test_bench_multiturn import tok  # noqa: F401  (the tokenizer fixture)
from test_bench_serve_rules import scripted

from kvlens.bench import llama_server, multiturn, multiturn_arms
from kvlens.bench.multiturn import Conversation, MultiturnLoad, TurnSample
from kvlens.bench.serve import ServeBenchConfig


def test_the_system_prompt_holds_system_len_corpus_tokens(tok):  # noqa: F811
    for system_len in (8, 40):
        load = MultiturnLoad(
            users=2, turns=1, system_len=system_len, turn_len=60, output_len=4, concurrency=1
        )
        system = multiturn.conversations(tok, None, load)[0].system
        body = system[len(multiturn.SYSTEM_HEAD) :]
        assert system_len - 3 <= len(tok.encode(body, add_bos=False)) <= system_len + 1  # re-tokenized


def test_conversation_size_counts_replies_cut_to_the_output_length(tok):  # noqa: F811
    conv = Conversation("Be brief.", ("alpha beta gamma delta", "one two three"))
    system = [{"role": "system", "content": "Be brief."}]
    first = [
        {"role": "user", "content": "alpha beta gamma delta"},
        {"role": "assistant", "content": "alpha beta"},
    ]

    def n(messages: list[dict]) -> int:
        return len(tok.encode(tok.apply_chat_template(messages, add_generation_prompt=False), add_bos=False))

    assert multiturn.conversation_tokens(tok, conv, 2, turns=0) == n(system)
    assert multiturn.conversation_tokens(tok, conv, 2, turns=1) == n(system + first)
    second = [{"role": "user", "content": "one two three"}, {"role": "assistant", "content": "one two"}]
    assert multiturn.conversation_tokens(tok, conv, 2) == n(system + first + second)


def _delta(content: str | None = None, usage: tuple[int, int, int | None] | None = None):
    choices = [] if content is None else [SimpleNamespace(delta=SimpleNamespace(content=content))]
    if usage is None:
        return SimpleNamespace(choices=choices, usage=None)
    details = None if usage[2] is None else SimpleNamespace(cached_tokens=usage[2])
    u = SimpleNamespace(prompt_tokens=usage[0], completion_tokens=usage[1], prompt_tokens_details=details)
    return SimpleNamespace(choices=choices, usage=u)


CLIENT = SimpleNamespace(chat=SimpleNamespace(completions=SimpleNamespace(create=None)))


@pytest.mark.parametrize(("cached", "want"), [(24, 24), (None, None)])
def test_a_chat_turn_records_its_first_text_and_the_usage(monkeypatch, cached, want):
    # sent at 5; an empty delta (no text: the clock is not read); the first text at 7, more at 9; usage
    chunks = [_delta(""), _delta("Hel"), _delta("lo"), _delta(usage=(40, 2, cached))]
    scripted(monkeypatch, multiturn, chunks, [5.0, 7.0, 9.0])
    sample, reply = asyncio.run(multiturn._chat_turn(CLIENT, "m", [], 2))
    assert (sample.ok, sample.ttft, sample.prompt_tokens, sample.output_tokens, reply) == (
        True,
        2.0,
        40,
        2,
        "Hello",
    )
    assert sample.cached_tokens == want


def test_a_conversation_grows_by_the_replies_and_stops_at_a_failure(monkeypatch):
    sent = []

    async def chat_turn(client, model, messages, output_len):
        sent.append([dict(m) for m in messages])
        ok = len(sent) < 2
        return TurnSample(0, 0, ok, None if ok else "APIError: boom"), f"reply {len(sent)}"

    monkeypatch.setattr(multiturn, "_chat_turn", chat_turn)
    conv = Conversation("S", ("u1", "u2", "u3"))
    samples = asyncio.run(multiturn._converse(CLIENT, "m", 4, conv, 2, asyncio.Semaphore(1)))
    assert [(s.user, s.turn, s.ok) for s in samples] == [(4, 1, True), (4, 2, False)]
    assert sent[1] == [{"role": "system", "content": "S"}, {"role": "user", "content": "u1"},
                       {"role": "assistant", "content": "reply 1"}, {"role": "user", "content": "u2"}]  # fmt: skip


def test_turn_rows_p90_and_a_cached_count_known_only_when_every_request_says():
    load = MultiturnLoad(users=5, turns=2, system_len=1, turn_len=1, output_len=1, concurrency=5)
    ttfts = [0.1, 0.2, 0.3, 0.4, 1.0]
    samples = [TurnSample(u, 1, True, ttft=t, prompt_tokens=10, cached_tokens=4) for u, t in enumerate(ttfts)]
    samples += [TurnSample(0, 2, True, ttft=0.1, prompt_tokens=20, cached_tokens=None),
                TurnSample(1, 2, True, ttft=0.1, prompt_tokens=30, cached_tokens=16)]  # fmt: skip
    r1, r2 = multiturn.turn_rows("kvlens", "q8", "cache", load, samples)
    # p90 by hand: rank 0.9 * 4 = 3.6 between 0.4 and 1.0
    assert r1.ttft_p90 == pytest.approx(0.4 + 0.6 * 0.6) and r1.ttft_p50 == pytest.approx(0.3)
    assert (r1.cached_tokens, r1.computed_tokens) == (4.0, 6.0)
    assert (r2.prompt_tokens, r2.cached_tokens, r2.computed_tokens) == (25.0, None, None)


def test_counters_are_what_the_run_added_and_the_share_is_of_the_prompt_tokens():
    hit, prompt, spilled, restored = multiturn.PREFIX_METRICS
    before = {hit: 100.0, prompt: 1000.0, spilled: 3.0}
    after = {hit: 130.0, prompt: 1120.0, spilled: 3.0}
    delta = multiturn.counters_delta(before, after)
    assert delta == {hit: 30.0, prompt: 120.0, spilled: 0.0, restored: None}
    line = multiturn.counters_line("kvlens q8 cache conc. 2", delta)
    assert line == ("[kvlens q8 cache conc. 2] prefix hit tokens 30 of 120 prompt tokens (25%); disk blocks "
                    "spilled 0, restored n/a")  # fmt: skip


def _rows(arm: str, ttfts: list[float]) -> list[multiturn.TurnRow]:
    return [
        multiturn.TurnRow("kvlens", "q8", arm, 2, t, 2, 0, x, x, 0, None, None)
        for t, x in enumerate(ttfts, 1)
    ]


def test_ratio_lines_put_each_arm_over_the_right_one():
    rows = (
        _rows("no-cache", [9.0, 2.0, 2.0]) + _rows("disk", [9.0, 1.0, 1.0]) + _rows("small", [9.0, 4.0, 4.0])
    )
    assert multiturn.ratio_lines(rows) == [
        "q8, concurrency 2: turn >= 2 TTFT disk tier / recompute: 0.50x",
        "q8, concurrency 2: turn >= 2 TTFT small pool, no disk / recompute: 2.00x",
        "q8, concurrency 2: turn >= 2 TTFT disk tier / small pool without it: 0.25x",
    ]


POOL = multiturn_arms.SmallPool(blocks=9, budget_bytes=12345, conversation_blocks=5, line="")
ALL_OPTIONS = {"--no-prefix-cache", "--kv-disk", "--prefill-chunk"}


def _args(arm: str, options: set[str] = ALL_OPTIONS, **cfg) -> list[str]:
    config = ServeBenchConfig(model="m", kv_budget="1GiB", kv_disk_budget="2GiB", **cfg)
    return multiturn_arms.kvlens_arm_args(config, "q8", arm, POOL, "/tmp/d", options)


def _flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_each_arm_gets_its_server_options():
    assert _flag(_args("cache"), "--kv-budget") == "1GiB" and "--no-prefix-cache" not in _args("cache")
    assert "--no-prefix-cache" in _args("no-cache") and _flag(_args("no-cache"), "--kv-budget") == "1GiB"
    disk = _args("disk")
    assert (_flag(disk, "--kv-budget"), _flag(disk, "--kv-disk"), _flag(disk, "--kv-disk-budget")) == (
        "12345", "/tmp/d", "2GiB",
    )  # fmt: skip
    small = _args("small")
    assert _flag(small, "--kv-budget") == "12345" and "--kv-disk" not in small
    assert _flag(_args("cache", prefill_chunk=32), "--prefill-chunk") == "32"
    assert "--prefill-chunk" not in _args("cache", options={"--kv-disk"}, prefill_chunk=32)


def test_an_arm_whose_flag_is_missing_is_skipped_and_the_pool_follows_the_mode(monkeypatch, tok):  # noqa: F811
    import kvlens.serve.process as process

    started = []

    class Server:
        url = "http://127.0.0.1:9"

        def __init__(self, args):
            started.append(args)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(process, "ServerProcess", Server)
    monkeypatch.setattr(multiturn_arms, "serve_options", lambda: {"--no-prefix-cache"})
    monkeypatch.setattr(
        multiturn_arms, "run_against", lambda url, engine, kv, arm, convs, load, key=None: ([], arm)
    )
    cfg = ServeBenchConfig(
        model="smollm2", kv=["q8"], scenario="multiturn", arms=["no-cache", "disk", "small"]
    )
    convs = [Conversation("Be brief.", ("alpha beta gamma delta",))] * 3
    notes: list[str] = []
    multiturn_arms.run_arms(cfg, tok, convs, [MultiturnLoad(3, 1, 4, 4, 8, 1)], notes.append)
    assert "[kvlens q8 disk] n/a: this kvlens serve has no --kv-disk" in notes
    assert [_flag(a, "--kv-budget") for a in started] == [None, _flag(started[1], "--kv-budget")]
    # SmolLM2 q8, by hand: 30 layers x 3 KV heads x (K: 64 codes + fp32 max_abs + 2 int16 code sums;
    # V: 64 codes + fp32 max_abs) = 12600 bytes a position; the pool is a whole number of 16-position blocks
    assert int(_flag(started[1], "--kv-budget")) % (12600 * 16) == 0


def test_a_llama_server_file_that_is_not_executable_is_refused(tmp_path):
    exe = tmp_path / "llama-server"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o644)
    with pytest.raises(llama_server.LlamaServerError, match="not executable"):
        llama_server.find_llama_server(exe)
    exe.chmod(0o755)
    assert llama_server.find_llama_server(exe) == exe
