"""The wire format of kvlens' HTTP answers, in process (the real app, engine thread and engine over the
tiny model, through Starlette's TestClient): every answer parses as the ``openai`` package's own types
(an independent description of OpenAI's API), usage adds up, a stream is one completion cut in chunks
that carry the plain answer's text and logprobs once each, and a refused request counts under its
status. The forty-second session's mutation run found each of these unasserted in process
(docs/testing.md, "Mutation testing of the HTTP service")."""

from __future__ import annotations

import json
import threading
import time

import pytest
from fastapi.testclient import TestClient
from openai.types import Completion, CompletionUsage
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from test_prefix_cache import engine_bytes_per_token
from test_serve_app import CHAT, KEY, MODEL, TINY_MODEL, app_parts, client, completion, llm, sse_events  # noqa: F401
from test_serve_async_engine import WAIT_S, new_engine
from test_serve_metrics import parse_samples, samples

import kvlens
from kvlens.engine.scheduler import Engine, EngineConfig
from kvlens.kv.cache import BLOCK
from kvlens.serve.app import AppConfig, build_app
from kvlens.serve.metrics import ServeMetrics

COMPLETION_LOGPROB_KEYS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


def chat_body(**extra) -> dict:
    """Greedy, two tokens on any machine (``ignore_eos``), with logprobs and two alternatives."""
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    return body | {"logprobs": True, "top_logprobs": 2} | extra


def check_usage(raw: dict, prompt: int, completion_tokens: int) -> None:
    usage = CompletionUsage.model_validate(raw)
    assert (usage.prompt_tokens, usage.completion_tokens) == (prompt, completion_tokens)
    assert usage.total_tokens == prompt + completion_tokens
    cached = usage.prompt_tokens_details.cached_tokens
    assert isinstance(cached, int) and 0 <= cached <= prompt


def chat_prompt_tokens(llm) -> int:  # noqa: F811
    tok = llm.tokenizer
    return len(tok.encode(tok.apply_chat_template(CHAT), add_bos=False))


def test_a_completion_is_openais_completion_object(client):  # noqa: F811
    t0 = int(time.time())
    body = client.post("/v1/completions", json=completion(logprobs=2)).json()
    c = Completion.model_validate(body)
    assert (c.object, c.model) == ("text_completion", MODEL) and c.id.startswith("cmpl-")
    assert t0 <= c.created <= time.time()
    (choice,) = c.choices
    assert (choice.index, choice.finish_reason) == (0, "length")
    check_usage(body["usage"], prompt=4, completion_tokens=3)
    lp = body["choices"][0]["logprobs"]
    assert tuple(lp) == COMPLETION_LOGPROB_KEYS and all(len(lp[k]) == 3 for k in lp)
    for logprob, top in zip(lp["token_logprobs"], lp["top_logprobs"], strict=True):
        # two alternatives, keyed by their text (two tokens of one text share a key)
        assert 1 <= len(top) <= 2 and all(isinstance(text, str) for text in top)
        assert logprob <= 0 and logprob == max(top.values())  # greedy: the chosen token is the likeliest
    assert body["kvlens"]["prompt_ids"] == completion()["prompt"]  # the engine's record rides along


def test_two_answers_have_their_own_ids(client):  # noqa: F811
    ids = {client.post("/v1/completions", json=completion()).json()["id"] for _ in range(2)}
    assert len(ids) == 2


def test_a_chat_completion_is_openais_chat_completion_object(client, llm):  # noqa: F811
    t0 = int(time.time())
    body = client.post("/v1/chat/completions", json=chat_body()).json()
    c = ChatCompletion.model_validate(body)
    assert (c.object, c.model) == ("chat.completion", MODEL) and c.id.startswith("chatcmpl-")
    assert t0 <= c.created <= time.time()
    (choice,) = c.choices
    assert (choice.index, choice.finish_reason, choice.message.role) == (0, "length", "assistant")
    check_usage(body["usage"], prompt=chat_prompt_tokens(llm), completion_tokens=2)
    entries = choice.logprobs.content  # each parsed as a ChatCompletionTokenLogprob
    assert len(entries) == 2
    for entry in entries:
        assert len(entry.top_logprobs) == 2 and entry.bytes is not None
        assert entry.logprob == max(t.logprob for t in entry.top_logprobs)  # greedy
    assert "kvlens" in body


def test_a_token_whose_bytes_the_tokenizer_does_not_know_has_null_bytes(client, llm, monkeypatch):  # noqa: F811
    monkeypatch.setattr(llm.tokenizer, "token_bytes", lambda token_id: None)
    r = client.post("/v1/chat/completions", json=chat_body())
    assert r.status_code == 200, r.text
    for entry in r.json()["choices"][0]["logprobs"]["content"]:
        assert entry["bytes"] is None and all(t["bytes"] is None for t in entry["top_logprobs"])


def stream(client, path: str, body: dict) -> list[dict]:  # noqa: F811
    with client.stream("POST", path, json=body | {"stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def envelope_of(chunks: list[dict]) -> tuple:
    (one,) = {(c["id"], c["object"], c["created"], c["model"]) for c in chunks}
    return one


def test_a_completion_stream_is_the_plain_answer_in_chunks(client):  # noqa: F811
    t0 = int(time.time())
    plain = client.post("/v1/completions", json=completion(max_tokens=8, logprobs=1)).json()
    body = completion(max_tokens=8, logprobs=1, stream_options={"include_usage": True})
    *chunks, last = stream(client, "/v1/completions", body)
    assert len(chunks) >= 3  # the premise: text in several pieces (some tokens are part of a character)
    rid, kind, created, model = envelope_of([*chunks, last])
    assert (kind, model) == ("text_completion", MODEL) and rid.startswith("cmpl-") and rid != plain["id"]
    assert t0 <= created <= time.time()
    choices = [c["choices"] for c in chunks]
    assert all(len(ch) == 1 and ch[0]["index"] == 0 for ch in choices)
    assert [ch[0]["finish_reason"] for ch in choices] == [None] * (len(chunks) - 1) + ["length"]
    Completion.model_validate(chunks[-1])  # the closing chunk is a whole completion object
    assert "".join(ch[0]["text"] for ch in choices) == plain["choices"][0]["text"]
    lps = [ch[0]["logprobs"] for ch in choices if ch[0]["logprobs"]]
    for key in COMPLETION_LOGPROB_KEYS:  # each token's entry once, in order: the plain answer's
        assert sum((lp[key] for lp in lps), []) == plain["choices"][0]["logprobs"][key]
    assert not any("kvlens" in c for c in chunks[:-1])
    record = chunks[-1]["kvlens"]  # the engine's record, on the closing chunk only
    assert record["prompt_ids"] == body["prompt"] and len(record["output_ids"]) == 8
    assert last["choices"] == [] and "kvlens" not in last
    check_usage(last["usage"], prompt=4, completion_tokens=8)


def test_a_chat_stream_is_the_plain_answer_in_chunks(client, llm):  # noqa: F811
    plain = client.post("/v1/chat/completions", json=chat_body(max_tokens=8)).json()
    raw = stream(
        client, "/v1/chat/completions", chat_body(max_tokens=8, stream_options={"include_usage": True})
    )
    assert len(raw) >= 5  # the premise: the opening chunk, several text chunks, the usage chunk
    *chunks, last = [ChatCompletionChunk.model_validate(c) for c in raw]
    rid, kind, _, model = envelope_of(raw)
    assert (kind, model) == ("chat.completion.chunk", MODEL) and rid.startswith("chatcmpl-")
    first = chunks[0].choices[0]
    assert (first.delta.role, first.delta.content, first.logprobs) == ("assistant", "", None)
    assert all(c.choices[0].delta.role is None for c in chunks[1:])  # the role once, at the start
    assert [c.choices[0].index for c in chunks] == [0] * len(chunks)
    assert [c.choices[0].finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == plain["choices"][0]["message"]["content"]
    entries = [e.model_dump() for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert entries == plain["choices"][0]["logprobs"]["content"]
    assert "kvlens" in raw[-2] and not any("kvlens" in c for c in raw[:-2]) and "kvlens" not in raw[-1]
    assert last.choices == []
    check_usage(last.usage.model_dump(), prompt=chat_prompt_tokens(llm), completion_tokens=8)


def test_a_fault_in_a_stream_is_told_as_an_error_event(app_parts, client):  # noqa: F811
    _, fault = app_parts
    fault.arm()
    events = stream(client, "/v1/completions", completion())
    error = events[-1]["error"]
    assert error["type"] == "server_error"
    assert error["message"].startswith("the engine failed while running request cmpl-")


def errors_by_status(client) -> dict[str, float]:  # noqa: F811
    got = parse_samples(client.get("/metrics").text)
    return {
        dict(labels)["status"]: v
        for (name, labels), v in got.items()
        if name == "kvlens_request_errors_total"
    }


def test_an_unknown_model_is_openais_404(client):  # noqa: F811
    before = errors_by_status(client)
    r = client.post("/v1/completions", json=completion(model="gpt-9"))
    assert r.status_code == 404
    assert r.json()["error"] == {
        "message": f"The model 'gpt-9' does not exist; this server has '{MODEL}'",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }
    assert errors_by_status(client)["404"] == before.get("404", 0) + 1


@pytest.mark.parametrize("sent", [False, True])
def test_a_missing_key_is_openais_401(client, sent):  # noqa: F811
    before = errors_by_status(client)
    key = client.headers.pop("Authorization")  # the fixture's client sends the key with every request
    try:
        r = client.get("/v1/models", headers={"Authorization": ""} if sent else {})
    finally:
        client.headers["Authorization"] = key
    assert r.status_code == 401
    assert r.json()["error"] == {
        "message": "invalid or missing API key",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_api_key",
    }
    assert errors_by_status(client)["401"] == before.get("401", 0) + 1
    assert client.get("/v1/models").status_code == 200


@pytest.fixture(scope="module")
def small_body_client(llm):  # noqa: F811
    """An app whose body limit is 1.5 MiB (no API key)."""
    app = build_app(llm, new_engine(llm), AppConfig(MODEL, max_body_bytes=3 << 19))
    with TestClient(app) as c:
        yield c


def test_a_body_over_the_limit_is_a_413_json_answer_counted_under_413(small_body_client):
    before = errors_by_status(small_body_client)
    r = small_body_client.post(
        "/v1/completions", content=b" " * ((3 << 19) + 1), headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 413
    assert r.headers["content-type"] == "application/json"
    assert int(r.headers["content-length"]) == len(r.content)
    error = r.json()["error"]
    assert error["message"] == "the request body is over this server's limit of 1.5 MiB"
    assert errors_by_status(small_body_client)["413"] == before.get("413", 0) + 1
    assert small_body_client.get("/v1/models").status_code == 200  # no key set: no key asked


class GatedStep:
    """``Engine.step`` that does nothing until ``gate`` opens: a request stays in the engine while the
    test acts, and the engine thread still takes in new requests between these empty steps (a gate
    never opened fails the step, so the test fails instead of hanging)."""

    def __init__(self, engine: Engine) -> None:
        self.gate, self._step = threading.Event(), engine.step
        self._deadline = time.monotonic() + WAIT_S
        engine.step = self

    def __call__(self):
        if self.gate.is_set():
            return self._step()
        assert time.monotonic() < self._deadline, "the test never opened the gate"
        time.sleep(0.001)
        return []


def test_a_full_queue_is_a_429_with_retry_after(llm):  # noqa: F811
    budget = 16 * BLOCK * engine_bytes_per_token(llm)
    engine = Engine(llm, EngineConfig(kv_budget_bytes=budget, max_batch=1, max_waiting=0))
    gated = GatedStep(engine)
    with TestClient(build_app(llm, engine, AppConfig(MODEL, retry_after_s=7))) as c:
        first: dict = {}
        thread = threading.Thread(target=lambda: first.update(r=c.post("/v1/completions", json=completion())))
        thread.start()
        for _ in range(int(WAIT_S / 0.01)):  # until the first request holds the only slot
            if engine.has_unfinished():
                break
            time.sleep(0.01)
        r = c.post("/v1/completions", json=completion())
        gated.gate.set()
        thread.join(WAIT_S)
    assert r.status_code == 429 and r.headers["retry-after"] == "7"
    error = r.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
    assert error["message"].startswith("the server is busy (the waiting queue is full")
    assert first["r"].status_code == 200


def test_latency_histograms_resolve_cpu_prefills_and_fast_tokens(llm):  # noqa: F811
    """A first token tens of seconds after arrival (a long prompt on a CPU) lands in a finite bucket, not
    only in +Inf as with Prometheus' default buckets (largest 10 s); a 1 ms gap between tokens does too."""
    metrics = ServeMetrics(new_engine(llm).stats, lambda: 0)
    metrics.ttft.observe(25.0)
    metrics.itl.observe(0.0008)
    got = samples(metrics)
    assert got["kvlens_time_to_first_token_seconds_bucket", (("le", "10.0"),)] == 0
    assert got["kvlens_time_to_first_token_seconds_bucket", (("le", "30.0"),)] == 1
    assert got["kvlens_inter_token_latency_seconds_bucket", (("le", "0.001"),)] == 1


CHUNK = 2 * BLOCK  # the prefix cache reuses whole prefill chunks of whole blocks


@pytest.fixture(scope="module")
def prefix_client(tiny_dir):
    """An app whose engine caches whole prefill chunks of CHUNK tokens."""
    chunked = kvlens.load(tiny_dir, kv="q8", attn_backend="numba", prefill_chunk=CHUNK)
    budget = 16 * BLOCK * engine_bytes_per_token(chunked)
    engine = Engine(chunked, EngineConfig(kv_budget_bytes=budget, prefix_cache=True))
    with TestClient(build_app(chunked, engine, AppConfig(MODEL))) as c:
        yield c


def test_usage_counts_the_prompt_tokens_served_from_the_prefix_cache(prefix_client):
    """A prompt of 2 chunks + 8 tokens, sent again: its 2 whole chunks come from the cache, plain and
    streamed alike; the first time, none do."""
    prompt = [(7 * i) % 200 + 3 for i in range(2 * CHUNK + 8)]
    body = completion(prompt=prompt, max_tokens=2)
    first = prefix_client.post("/v1/completions", json=body).json()["usage"]
    again = prefix_client.post("/v1/completions", json=body).json()["usage"]
    *_, streamed = stream(
        prefix_client, "/v1/completions", body | {"stream_options": {"include_usage": True}}
    )
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    for usage in (again, streamed["usage"]):
        check_usage(usage, prompt=len(prompt), completion_tokens=2)
        assert usage["prompt_tokens_details"]["cached_tokens"] == 2 * CHUNK


def test_a_plain_answer_slower_than_the_disconnect_poll_still_comes(llm):  # noqa: F811
    """A non-streamed request asks every second whether its client is gone; one held in the engine
    for longer than that (its steps held 1.5 s) is still answered in full."""
    engine = new_engine(llm)
    gated = GatedStep(engine)
    with TestClient(build_app(llm, engine, AppConfig(MODEL))) as c:
        threading.Timer(1.5, gated.gate.set).start()
        r = c.post("/v1/completions", json=completion())
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_a_chat_stream_cut_by_a_stop_string_closes_with_an_empty_delta(client):  # noqa: F811
    """A stop string that begins a token leaves no text to send with the finish: a closing chunk
    carries it, with an empty delta (the role only ever opens a stream) and no logprobs repeated."""
    for message in ("a", "the", "in the"):
        body = chat_body(messages=[{"role": "user", "content": message}], max_tokens=8, top_logprobs=1)
        reply = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        tokens = [e["token"] for e in reply["logprobs"]["content"]]
        stops = [
            t
            for i, t in enumerate(tokens[1:], 1)
            # a whole character; none before it held back (a byte of a character the decoder awaits)
            if t.isascii()
            and t.isprintable()
            and t.strip()
            and t not in (before := "".join(tokens[:i]))
            and "\ufffd" not in before
        ]
        if stops:
            break
    else:
        raise AssertionError(f"premise: no reply with a token that can be a stop string ({tokens})")
    body |= {"stop": [stops[0]]}
    plain = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    raw = stream(client, "/v1/chat/completions", body)
    chunks = [ChatCompletionChunk.model_validate(c).choices[0] for c in raw]
    assert plain["finish_reason"] == "stop" and chunks[-1].finish_reason == "stop"
    assert chunks[-1].delta.content == "" and chunks[-1].delta.role is None  # the closing chunk
    assert all(c.delta.role is None for c in chunks[1:])
    assert "".join(c.delta.content or "" for c in chunks) == plain["message"]["content"]
    entries = [e.model_dump() for c in chunks if c.logprobs for e in c.logprobs.content]
    assert entries == plain["logprobs"]["content"]
