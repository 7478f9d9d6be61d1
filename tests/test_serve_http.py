"""The real ``kvlens serve`` (subprocess, 127.0.0.1, a free port) driven by the real ``openai`` client
and raw httpx: completions and chat, streamed and not, every bad-input case, auth, a client that
disconnects mid-stream, overload (wait, then 429), SIGTERM; blocks_used back to 0 after all.

Expected texts come from the same prompt run alone through ``LLM.generate`` in this process.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from kvlens.serve.process import ServerProcess

pytestmark = pytest.mark.slow

KEY = "test-key-123"
KV = "q8"
MAX_BATCH, MAX_WAITING = 2, 6  # a burst: 2 run, the other admitted ones wait
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


class Server(ServerProcess):
    def wait_blocks_freed(self, timeout: float = 20.0) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m["kvlens_kv_blocks_used"] == 0 and m["kvlens_requests_running"] == 0:
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"blocks still used after {timeout} s: {m['kvlens_kv_blocks_used']}")
            time.sleep(0.1)


@pytest.fixture(scope="module")
def server(smol_path):
    srv = Server(
        ["--model", str(smol_path), "--kv", KV, "--weights", "f32", "--kv-budget", "64MiB",
         "--max-batch", str(MAX_BATCH), "--max-waiting", str(MAX_WAITING), "--api-key", KEY,
         "--graceful-s", "30"],
        start_timeout=420,  # a cold cache: the warm-up compiles the kernels before /health answers
    )  # fmt: skip
    yield srv
    try:
        if srv.proc.poll() is None:
            srv.wait_blocks_freed()  # after every test above, whatever it did
    finally:  # the server never outlives the module
        code, output = srv.stop(), srv.output()
        srv.close()
    assert code == 0, output


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def ref(smol_loaded):
    """The same model (f32 weights, as served) and KV mode, run alone in this process: the reference."""
    import kvlens

    return kvlens.LLM(smol_loaded, kv=KV)


def _assert_verified(ref, record: dict) -> None:
    """The record re-runs alone, with the same settings, to the same output ids."""
    from kvlens.engine.verify import verify_record

    result = verify_record(ref, record)
    assert result.ok and not result.mismatched, result.message


def _ref_text(ref, prompt: str, n: int, chat: bool = False) -> str:
    return ref.generate(prompt, n, chat=chat)


def test_a_started_server_has_served_nothing(server):
    """Its warm-up ran on a throwaway engine: the served one's counters and pool start at zero."""
    assert "warm-up:" in server.output()
    m = server.metrics()
    assert m["kvlens_prompt_tokens_total"] == 0 and m["kvlens_generation_tokens_total"] == 0
    assert m["kvlens_kv_blocks_used"] == 0 and m["kvlens_time_to_first_token_seconds_count"] == 0


def test_models_lists_the_served_model(client, smol_path):
    assert [m.id for m in client.models.list().data] == [smol_path.stem]


def test_completion_plain_and_streamed_match_a_lone_run(client, ref, smol_path):
    ids = ref.tokenizer.encode(PROMPT)
    want_ids = list(ref.generate_ids(ids, 12))
    r = client.completions.create(model=smol_path.stem, prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.choices[0].text == ref.tokenizer.decode(want_ids, skip_special=True)
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 12)
    record = r.model_extra["kvlens"]
    assert (record["prompt_ids"], record["output_ids"]) == (ids, want_ids)
    _assert_verified(ref, record)

    chunks = list(
        client.completions.create(
            model=smol_path.stem, prompt=PROMPT, max_tokens=12, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert chunks[-1].model_extra["kvlens"]["output_ids"] == want_ids


def test_sampled_completion_is_reproducible_from_its_record(client, ref, smol_path):
    r = client.completions.create(model=smol_path.stem, prompt=PROMPT, max_tokens=8, temperature=0.9)
    record = r.model_extra["kvlens"]
    assert record["sampling"]["seed"] is not None  # the engine drew one and recorded it
    _assert_verified(ref, record)
    again = client.completions.create(
        model=smol_path.stem, prompt=PROMPT, max_tokens=8, temperature=0.9, seed=record["sampling"]["seed"]
    )
    assert again.choices[0].text == r.choices[0].text


def test_chat_plain_and_streamed_match_a_lone_run(client, ref, smol_path):
    want = _ref_text(ref, CHAT[0]["content"], 24, chat=True)
    r = client.chat.completions.create(model=smol_path.stem, messages=CHAT, max_tokens=24, temperature=0)
    msg = r.choices[0].message
    assert (msg.role, msg.content) == ("assistant", want)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert "kvlens" in r.model_extra

    stream = client.chat.completions.create(
        model=smol_path.stem, messages=CHAT, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == r.choices[0].finish_reason
    assert finals[0].model_extra["kvlens"]["prompt_ids"] == r.model_extra["kvlens"]["prompt_ids"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_stop_string_cuts_the_text_plain_and_streamed(client, ref, smol_path):
    full = _ref_text(ref, PROMPT, 10)
    stop = full.strip().split()[1][:3]  # a few characters from inside the continuation
    want = full[: full.index(stop)]
    for stream in (False, True):
        r = client.completions.create(
            model=smol_path.stem, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop], stream=stream
        )
        chunks = list(r) if stream else [r]
        assert "".join(c.choices[0].text for c in chunks) == want
        assert chunks[-1].choices[0].finish_reason == "stop"
    _assert_verified(ref, chunks[-1].model_extra["kvlens"])  # a re-run of its record stops there too


def test_a_stop_string_ends_the_requests_generation(server, client, ref, smol_path):
    """Cut by a stop string, the request stops generating: it does not run on to max_tokens behind
    the client's back (ignore_eos: nothing but the cut can end it early)."""
    full = _ref_text(ref, PROMPT, 10)
    stop = full.strip().split()[1][:3]
    before = server.wait_blocks_freed()["kvlens_generation_tokens_total"]
    r = client.completions.create(
        model=smol_path.stem, prompt=PROMPT, max_tokens=1000, temperature=0, stop=[stop],
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == full[: full.index(stop)]
    generated = server.wait_blocks_freed(timeout=60)["kvlens_generation_tokens_total"] - before
    # the engine may run steps ahead of the cut until the abort lands (more of them on a loaded
    # machine); a request that ran on behind the client's back would reach max_tokens, 1000
    assert r.usage.completion_tokens <= generated < 500


def _ends_early(ref) -> str:
    """A chat message the model answers, greedily, with EOS within 12 tokens on this machine (the
    premise of the test below, checked rather than assumed: a near-tie can differ between CPUs)."""
    for text in ("Hi!", "What is 2+2? Answer with a number only.", "Say hello."):
        if len(list(ref.generate_ids(ref.encode_prompt(text, chat=True), 12))) < 12:
            return text
    pytest.fail("premise: none of the chat messages ends with EOS within 12 tokens on this machine")


def test_no_max_tokens_runs_to_eos_and_ignore_eos_runs_past_it(client, ref, smol_path):
    """Without max_tokens a request may fill the room the pool and the context leave (it is not
    refused for asking the default) and ends at EOS; with ignore_eos it runs past EOS to max_tokens."""
    text = _ends_early(ref)
    msgs = [{"role": "user", "content": text}]
    r = client.chat.completions.create(model=smol_path.stem, messages=msgs, temperature=0)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens <= 12
    assert r.choices[0].message.content == _ref_text(ref, text, 16, chat=True)
    r = client.chat.completions.create(
        model=smol_path.stem, messages=msgs, temperature=0, max_tokens=16, extra_body={"ignore_eos": True}
    )
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("length", 16)


def test_logprobs_are_the_models_log_softmax(client, ref, smol_path):
    import torch

    r = client.completions.create(
        model=smol_path.stem, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    ids = ref.tokenizer.encode(PROMPT)
    expect = torch.log_softmax(ref.logits(ids)[-1].double(), -1)
    top = torch.topk(expect, 3)
    got = lp.top_logprobs[0]
    want = {ref.tokenizer.decode([int(i)]): float(v) for v, i in zip(top.values, top.indices, strict=True)}
    assert got.keys() == want.keys()
    # f32 logits through log-softmax: agreement to well under 1e-3 whatever the batch path
    assert all(abs(got[k] - want[k]) < 1e-3 for k in want)
    assert lp.token_logprobs[0] == pytest.approx(max(got.values()), abs=1e-6)  # greedy took the top one


def test_streamed_logprobs_are_the_plain_ones_each_token_once(client, smol_path):
    kwargs = dict(model=smol_path.stem, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    plain = client.completions.create(**kwargs).choices[0].logprobs
    chunks = list(client.completions.create(**kwargs, stream=True))
    got = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
    assert [t for lp in got for t in lp.tokens] == plain.tokens and len(plain.tokens) == 6
    assert [v for lp in got for v in lp.token_logprobs] == plain.token_logprobs


def test_chat_logprobs_without_top_logprobs_and_max_completion_tokens(client, smol_path):
    """logprobs=true alone gives each token's logprob with no alternatives (OpenAI's default of
    top_logprobs); max_completion_tokens, the newer name, wins over max_tokens."""
    r = client.chat.completions.create(
        model=smol_path.stem, messages=CHAT, temperature=0, logprobs=True, max_tokens=2,
        max_completion_tokens=5, extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = r.choices[0].logprobs.content
    assert r.usage.completion_tokens == len(content) == 5
    assert all(e.logprob <= 0 and e.top_logprobs == [] for e in content)


def test_top_p_near_zero_keeps_only_the_top_token_and_four_stops_are_allowed(client, ref, smol_path):
    """Sampling at temperature 1 from the smallest top-p prefix is greedy decoding; OpenAI allows up
    to 4 stop sequences."""
    greedy = client.completions.create(model=smol_path.stem, prompt=PROMPT, max_tokens=8, temperature=0)
    r = client.completions.create(
        model=smol_path.stem, prompt=PROMPT, max_tokens=8, temperature=1.0, top_p=1e-6, seed=3,
        stop=["#1#", "#2#", "#3#", "#4#"],
    )  # fmt: skip
    assert r.choices[0].text == greedy.choices[0].text and r.choices[0].finish_reason == "length"


BAD_COMPLETIONS = {
    "malformed JSON": b'{"model": "m", "prompt": "hi"',
    "not an object": b"[1, 2]",
    "missing prompt": {"model": "$M"},
    "missing model": {"prompt": "hi"},
    "prompt wrong type": {"model": "$M", "prompt": 5},
    "max_tokens wrong type": {"model": "$M", "prompt": "hi", "max_tokens": "ten"},
    "negative max_tokens": {"model": "$M", "prompt": "hi", "max_tokens": -1},
    "seed past int64": {"model": "$M", "prompt": "hi", "seed": 2**63},
    "zero max_tokens": {"model": "$M", "prompt": "hi", "max_tokens": 0},
    "absurd max_tokens": {"model": "$M", "prompt": "hi", "max_tokens": 10**12},
    "temperature < 0": {"model": "$M", "prompt": "hi", "temperature": -0.5},
    "top_p 0": {"model": "$M", "prompt": "hi", "top_p": 0},
    "empty prompt": {"model": "$M", "prompt": ""},
    "empty token list": {"model": "$M", "prompt": []},
    "token id outside the vocabulary": {"model": "$M", "prompt": [1, 10**9]},
    "prompt longer than the context": {"model": "$M", "prompt": "$LONG", "max_tokens": 1},
    "unknown field": {"model": "$M", "prompt": "hi", "frobnicate": True},
    "n > 1": {"model": "$M", "prompt": "hi", "n": 2},
    "too many logprobs": {"model": "$M", "prompt": "hi", "logprobs": 50},
    "empty stop string": {"model": "$M", "prompt": "hi", "stop": [""]},
    # JSON's \ud800 escape decodes to a lone surrogate, which no tokenizer can encode (was a 500)
    "lone surrogate in the prompt": {"model": "$M", "prompt": "hi \ud800"},
    "lone surrogate in a stop string": {"model": "$M", "prompt": "hi", "stop": ["\udc00"]},
    "max_tokens a boolean": {"model": "$M", "prompt": "hi", "max_tokens": True},  # pydantic read 1
    "temperature a boolean": {"model": "$M", "prompt": "hi", "temperature": False},
    # an int past float's range: the finite check's float() raised OverflowError, a 500
    "temperature a 400-digit int": {"model": "$M", "prompt": "hi", "temperature": int("9" * 400)},
}
BAD_CHAT = {
    "no messages": {"model": "$M", "messages": []},
    "unknown role": {"model": "$M", "messages": [{"role": "wizard", "content": "hi"}]},
    "message without content": {"model": "$M", "messages": [{"role": "user"}]},
    "unknown field": {"model": "$M", "messages": CHAT, "tools_please": 1},
    "top_logprobs without logprobs": {"model": "$M", "messages": CHAT, "top_logprobs": 2},
    "lone surrogate in a message": {"model": "$M", "messages": [{"role": "user", "content": "\ud83d"}]},
    "lone surrogate in a text part": {
        "model": "$M",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "a\udfff"}]}],
    },
}


def _materialize(body, model: str, ctx: int):
    if isinstance(body, bytes):
        return body
    text = json.dumps(body).replace('"$M"', json.dumps(model)).replace('"$LONG"', json.dumps("hello " * ctx))
    return text.encode()


def _assert_openai_error(r: httpx.Response, status: int | None = None) -> dict:
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    if status is not None:
        assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    assert "code" in err
    return err


@pytest.mark.parametrize(
    "path,case,body",
    [("completions", k, v) for k, v in BAD_COMPLETIONS.items()]
    + [("chat/completions", k, v) for k, v in BAD_CHAT.items()],
)
def test_bad_input_gets_a_4xx_openai_error(server, smol_path, ref, path, case, body):
    data = _materialize(body, smol_path.stem, ref.config.max_ctx)
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    r = httpx.post(f"{server.url}/v1/{path}", content=data, headers=headers, timeout=60)
    _assert_openai_error(r, 400)


def test_a_bad_character_names_its_field(server, smol_path):
    body = _materialize({"model": "$M", "prompt": "hi \ud800"}, smol_path.stem, 0)
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    err = _assert_openai_error(httpx.post(f"{server.url}/v1/completions", content=body, headers=headers), 400)
    assert (
        err["param"] == "prompt"
        and "prompt is not valid UTF-8 text (bad character at index 3)" in err["message"]
    )
    body = _materialize({"model": "$M", "prompt": "hi", "stop": ["ok", "a\udc00"]}, smol_path.stem, 0)
    err = _assert_openai_error(httpx.post(f"{server.url}/v1/completions", content=body, headers=headers), 400)
    assert (
        err["param"] == "stop"
        and "a stop sequence is not valid UTF-8 text (bad character at index 1)" in err["message"]
    )
    part = {"role": "user", "content": [{"type": "text", "text": "a\udfff"}]}
    body = _materialize({"model": "$M", "messages": [part]}, smol_path.stem, 0)
    err = _assert_openai_error(
        httpx.post(f"{server.url}/v1/chat/completions", content=body, headers=headers), 400
    )
    assert err["param"] == "messages.0.content.0.text" and "bad character at index 1" in err["message"]


@pytest.mark.parametrize(
    "data,content_type,param,message",
    [
        # NaN (a JSON literal Python's json reads, or the string "nan") once failed "less than or
        # equal to 2"; a validator's message once came with pydantic's "Value error, " before it
        (b'{"model": "$M", "prompt": "hi", "temperature": NaN}', "application/json", "temperature",
         "temperature: Input should be a finite number"),
        (b'{"model": "$M", "prompt": "hi", "top_p": "inf"}', "application/json", "top_p",
         "top_p: Input should be a finite number"),
        (b'{"model": "$M", "prompt": "hi", "n": 2}', "application/json", None, "only n=1 is supported"),
        # a body that is not an object, or not sent as JSON, once read "Input should be a valid dictionary"
        (b"[]", "application/json", None, "the request body must be a JSON object sent as Content-Type: "
         "application/json"),
        (b'{"model": "$M", "prompt": "hi"}', "text/plain", None, "the request body must be a JSON object "
         "sent as Content-Type: application/json (it was sent as text/plain)"),
    ],
)  # fmt: skip
def test_the_error_message_says_what_is_wrong(server, smol_path, data, content_type, param, message):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": content_type}
    data = data.replace(b"$M", smol_path.stem.encode())
    err = _assert_openai_error(httpx.post(f"{server.url}/v1/completions", content=data, headers=headers), 400)
    assert (err["param"], err["message"]) == (param, message)


def test_a_body_over_the_limit_is_a_413_and_the_server_goes_on(server, smol_path, client):
    """Declared (Content-Length) and chunked: refused without being held, answered after the client
    has sent it all, counted; a body within the limit is served as before."""
    from kvlens.serve.body_limit import DEFAULT_MAX_BODY_BYTES

    big = b'{"model": "m", "prompt": "' + b"a" * DEFAULT_MAX_BODY_BYTES + b'"}'
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    url = f"{server.url}/v1/completions"

    def pieces():
        for i in range(0, len(big), 1 << 20):
            yield big[i : i + (1 << 20)]

    for content in (big, pieces()):
        err = _assert_openai_error(httpx.post(url, content=content, headers=headers, timeout=60), 413)
        assert "over this server's limit of 16 MiB" in err["message"]
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert 'kvlens_request_errors_total{status="413"} 2.0' in metrics, metrics
    after = client.completions.create(model=smol_path.stem, prompt="The sea", max_tokens=2, temperature=0)
    assert after.choices[0].text


def test_unknown_model_is_404_model_not_found(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=1)
    assert e.value.body["code"] == "model_not_found"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
def test_api_key_required(server, smol_path, headers):
    body = {"model": smol_path.stem, "prompt": "hi", "max_tokens": 1}
    for method, path in (("POST", "completions"), ("POST", "chat/completions"), ("GET", "models")):
        r = httpx.request(method, f"{server.url}/v1/{path}", json=body, headers=headers, timeout=30)
        assert _assert_openai_error(r, 401)["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()


def _counter(m: dict[str, float], name: str, **labels: str) -> float:
    key = name + "".join(f"|{k}={v}" for k, v in sorted(labels.items()))
    return m.get(key, 0.0)


def test_client_disconnect_mid_stream_frees_its_blocks(server, client, smol_path):
    before = server.metrics()
    stream = client.completions.create(
        model=smol_path.stem, prompt=PROMPT, max_tokens=4000, temperature=0, stream=True,
        extra_body={"ignore_eos": True},  # it cannot end early by itself
    )  # fmt: skip
    for i, _ in enumerate(stream):
        if i == 2:
            break
    assert server.metrics()["kvlens_kv_blocks_used"] > 0  # it holds blocks while it runs
    stream.close()
    # 4000 tokens would take minutes here: blocks freed within seconds means it was cancelled
    after = server.wait_blocks_freed(timeout=20)
    time.sleep(0.5)
    assert server.metrics()["kvlens_generation_tokens_total"] == after["kvlens_generation_tokens_total"]
    cancelled = _counter(after, "kvlens_requests_total", endpoint="completions", finish_reason="cancelled")
    assert (
        cancelled
        == _counter(before, "kvlens_requests_total", endpoint="completions", finish_reason="cancelled") + 1
    )
    assert "finish=cancelled" in server.output()


def test_a_client_gone_before_a_plain_answer_frees_its_blocks(server, smol_path):
    """Not streamed, the server only learns the client left by asking the connection (once a second):
    a gone client's request is cancelled all the same, it does not run on to max_tokens."""
    before = server.wait_blocks_freed()
    body = {"model": smol_path.stem, "prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=2.0,
                   headers={"Authorization": f"Bearer {KEY}"})  # fmt: skip
    after = server.wait_blocks_freed(timeout=20)  # 4000 tokens would take minutes here
    cancelled = {"endpoint": "completions", "finish_reason": "cancelled"}
    assert (
        _counter(after, "kvlens_requests_total", **cancelled)
        == _counter(before, "kvlens_requests_total", **cancelled) + 1
    )


async def _flood(url: str, model: str, n: int, max_tokens: int) -> list[httpx.Response]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    headers = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(timeout=300) as http:
        return await asyncio.gather(
            *(http.post(f"{url}/v1/completions", json=body, headers=headers) for _ in range(n))
        )


def test_overload_waits_then_429_with_retry_after(server, smol_path):
    n, max_tokens = 3 * (MAX_BATCH + MAX_WAITING), 24
    responses = asyncio.run(_flood(server.url, smol_path.stem, n, max_tokens))
    ok = [r for r in responses if r.status_code == 200]
    busy = [r for r in responses if r.status_code == 429]
    assert len(ok) + len(busy) == n, [r.status_code for r in responses]  # nothing else, nothing lost
    assert len(ok) >= MAX_WAITING  # the whole queue was admitted and served (more than one batch)
    assert busy, "more requests than batch + queue, all at once: some must be refused"
    for r in busy:
        assert _assert_openai_error(r, 429)["code"] == "rate_limit_exceeded"
        assert int(r.headers["Retry-After"]) >= 1
    for r in ok:  # every admitted request ran to its end
        body = r.json()
        assert body["choices"][0]["finish_reason"] in ("length", "stop")
        assert body["usage"]["completion_tokens"] >= 1
    server.wait_blocks_freed()


def test_metrics_exposes_pool_queue_tokens_and_latency(server):
    m = server.wait_blocks_freed()
    for name in ("kvlens_kv_blocks_total", "kvlens_requests_waiting", "kvlens_prompt_tokens_total",
                 "kvlens_generation_tokens_total", "kvlens_time_to_first_token_seconds_count",
                 "kvlens_inter_token_latency_seconds_count"):  # fmt: skip
        assert name in m, name
    assert m["kvlens_kv_blocks_total"] > 0 and m["kvlens_requests_waiting"] == 0
    assert m["kvlens_generation_tokens_total"] > 0 and m["kvlens_time_to_first_token_seconds_count"] > 0


def test_metrics_count_each_request_its_tokens_and_each_refusal(server, client, smol_path):
    """One answered request: one time to first token, one inter-token gap per later token, one
    request by endpoint and finish reason; one 400 and one 404 counted by status."""
    before = server.wait_blocks_freed()
    r = client.completions.create(model=smol_path.stem, prompt=PROMPT, max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    for body in (
        {"model": smol_path.stem, "prompt": "hi", "max_tokens": -1},
        {"model": "nope", "prompt": "hi"},
    ):
        httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    after = server.wait_blocks_freed()

    def moved(name: str, **labels: str) -> float:
        return _counter(after, name, **labels) - _counter(before, name, **labels)

    assert r.usage.completion_tokens == 5
    assert moved("kvlens_time_to_first_token_seconds_count") == 1
    assert moved("kvlens_inter_token_latency_seconds_count") == 4
    assert moved("kvlens_requests_total", endpoint="completions", finish_reason="length") == 1
    assert moved("kvlens_request_errors_total", status="400") == 1
    assert moved("kvlens_request_errors_total", status="404") == 1


def test_bench_serve_load_gets_exact_output_lengths(server, ref):
    from kvlens.bench.serve import Load, runs_against

    corpus = str(Path(__file__).parent / "data" / "excerpt.txt")
    load = Load(requests=3, prompt_len=24, output_len=5, concurrency=3)
    [res] = runs_against(server.url, KV, ref.tokenizer, [load], corpus, KEY)
    assert (res.requests, res.failed, res.output_tokens) == (3, 0, 15), res.errors  # ignore_eos: 5 each
    assert res.output_tok_s == pytest.approx(15 / res.duration_s)
    assert 0 < res.ttft_p50 <= res.ttft_p99 < res.duration_s
    assert res.peak_running <= MAX_BATCH


def test_sigterm_finishes_in_flight_then_exits_0(server, client, smol_path):
    """Last in this module: it stops the server."""
    stream = client.completions.create(
        model=smol_path.stem,
        prompt=PROMPT,
        max_tokens=16,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = [next(iter(stream))]
    server.proc.send_signal(signal.SIGTERM)
    chunks += list(stream)  # the in-flight request still runs to its end
    assert chunks[-1].choices[0].finish_reason == "length"
    assert server.proc.wait(timeout=60) == 0, server.output()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/health", timeout=5)
    assert "kvlens serve: stopped" in server.output()
