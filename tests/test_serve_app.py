"""The HTTP app's own paths (serve/app.py) in process: the real app, engine thread and engine over a
tiny model, driven through Starlette's TestClient (httpx). test_serve_http drives a real server
process; these are what a real server cannot be made to do on demand (a fault inside a step) and the
answers that need no model output (routes, the chat template, health).
"""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from test_serve_async_engine import new_engine

import kvlens
from kvlens.engine.scheduler import Engine
from kvlens.serve.app import AppConfig, build_app

TINY_MODEL = ("llama", 5)  # conftest's tiny_dir; its tokenizer has no chat template of its own
MODEL, KEY = "tiny", "key-123"
TEMPLATE = (  # ChatML, with the tiny tokenizer's specials
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHAT = [{"role": "user", "content": "the"}]


class FaultyStep:
    """``Engine.step`` that raises once after ``arm()`` (a fault of the scheduler's own), then steps
    on: an app that mishandles the fault answers wrongly rather than hanging the test."""

    def __init__(self, engine: Engine) -> None:
        self.armed, self._step = False, engine.step
        engine.step = self

    def arm(self) -> None:
        self.armed = True

    def __call__(self):
        if self.armed:
            self.armed = False
            raise RuntimeError("planted fault")
        return self._step()


@pytest.fixture(scope="module")
def llm(tiny_dir):
    llm = kvlens.load(tiny_dir, kv="q8", attn_backend="numba")
    llm.tokenizer.chat_template = TEMPLATE
    return llm


@pytest.fixture(scope="module")
def app_parts(llm):
    engine = new_engine(llm)
    fault = FaultyStep(engine)
    app = build_app(llm, engine, AppConfig(MODEL, api_key=KEY))
    with TestClient(app, headers={"Authorization": f"Bearer {KEY}"}) as client:
        yield client, fault


@pytest.fixture
def client(app_parts, llm):
    client, fault = app_parts
    fault.armed = False
    llm.tokenizer.chat_template = TEMPLATE
    return client


def completion(**extra) -> dict:
    """Greedy, and to ``max_tokens`` on any machine: whether the tiny random model picks its EOS is
    not what these tests are about."""
    body = {"model": MODEL, "prompt": [5, 17, 200, 33], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    return body | extra


def test_an_unknown_route_is_a_404_not_found_error(client):
    r = client.get("/v1/nothing-here")
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "not_found_error"


def test_a_fault_in_a_step_is_a_500_server_error_and_the_server_goes_on(app_parts, client):
    _, fault = app_parts
    fault.arm()
    r = client.post("/v1/completions", json=completion())
    assert r.status_code == 500
    error = r.json()["error"]
    assert error["type"] == "server_error" and "the engine failed while running request" in error["message"]
    r = client.post("/v1/completions", json=completion())
    assert r.status_code == 200 and len(r.json()["choices"][0]["text"]) > 0


def test_a_fault_in_a_streamed_request_is_an_error_event_then_done(app_parts, client):
    _, fault = app_parts
    fault.arm()
    with client.stream("POST", "/v1/completions", json=completion(stream=True)) as r:
        assert r.status_code == 200  # the stream had begun
        events = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["type"] == "server_error"


def sse_events(r) -> list[str]:
    return [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]


@pytest.mark.parametrize(
    "body, message, param",
    [
        ("{not json", "the request body is not valid JSON", None),
        (json.dumps(completion(colour="red")), "Unrecognized request argument supplied: colour", "colour"),
        (json.dumps({"prompt": "x"}), "missing required field: model", "model"),
    ],
)
def test_a_bad_body_names_what_is_wrong(client, body, message, param):
    r = client.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    error = r.json()["error"]
    assert (error["message"], error["param"], error["type"]) == (message, param, "invalid_request_error")


@pytest.mark.parametrize("header", ["Basic " + KEY, "Bearer x" + KEY, KEY, ""])
def test_only_the_bearer_key_itself_is_let_in(client, header):
    r = client.get("/v1/models", headers={"Authorization": header})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert client.get("/v1/models").status_code == 200


def test_usage_is_streamed_only_when_asked(client):
    with client.stream("POST", "/v1/completions", json=completion(stream=True)) as r:
        plain = sse_events(r)
    with client.stream(
        "POST", "/v1/completions", json=completion(stream=True, stream_options={"include_usage": True})
    ) as r:
        asked = sse_events(r)
    assert plain[-1] == asked[-1] == "[DONE]"
    assert all("usage" not in json.loads(e) for e in plain[:-1])
    last = json.loads(asked[-2])
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3


def test_a_streamed_chat_opens_with_the_role_and_ends_with_the_reason(client):
    """Greedy (OpenAI's default temperature is 1): the streamed text is the plain answer's."""
    full = client.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 3, "temperature": 0}
    ).json()
    with client.stream(
        "POST",
        "/v1/chat/completions",
        json={"model": MODEL, "messages": CHAT, "max_tokens": 3, "temperature": 0, "stream": True},
    ) as r:
        chunks = [json.loads(e) for e in sse_events(r)[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [
        full["choices"][0]["finish_reason"]
    ]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == full["choices"][0]["message"]["content"]


def test_chat_logprobs_are_in_the_chat_shape(client):
    """Greedy with ``ignore_eos``: exactly two tokens on any machine (sampled at OpenAI's default
    temperature, a stop token could end the reply after one, which then has one entry)."""
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 2, "logprobs": True, "top_logprobs": 2}
    body |= {"temperature": 0, "ignore_eos": True}
    lp = client.post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"]
    assert list(lp) == ["content"] and len(lp["content"]) == 2
    for entry in lp["content"]:
        assert {"token", "logprob", "bytes", "top_logprobs"} <= set(entry) and len(entry["top_logprobs"]) == 2


def test_a_model_without_a_chat_template_is_a_400_on_messages(client, llm):
    llm.tokenizer.chat_template = None
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 2})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "messages" and error["message"].startswith("cannot apply the chat template")


def test_health_is_503_once_the_engine_thread_has_stopped(llm):
    client = TestClient(build_app(llm, new_engine(llm), AppConfig(MODEL)))
    with client:
        assert client.get("/health").status_code == 200
    r = client.get("/health")  # the lifespan ended: the engine thread is gone
    assert r.status_code == 503 and r.json() == {"status": "engine stopped"}


def test_a_stream_cut_by_a_stop_string_still_ends_with_its_reason(client):
    """The token that completes a stop string adds no text, so no text chunk can carry the finish:
    a closing chunk does (finish_reason "stop"), and the streamed text is the plain answer's."""
    for prompt in ([40, 41, 42], [5, 17, 200, 33], [7, 8, 9, 10]):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "logprobs": 0, "temperature": 0}
        tokens = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]["tokens"]
        if tokens[1] and tokens[1] not in tokens[0] and "\ufffd" not in "".join(tokens[:2]):
            break
    else:
        raise AssertionError(f"premise: no prompt whose second token can be a stop string ({tokens})")
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "stop": [tokens[1]]}
    plain = client.post("/v1/completions", json=body).json()["choices"][0]
    assert (plain["text"], plain["finish_reason"]) == (tokens[0], "stop")
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        chunks = [json.loads(e) for e in sse_events(r)[:-1]]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "stop"
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain["text"]


def test_a_template_that_writes_the_bos_gets_it_once(client, llm):
    """A tokenizer that adds a BOS to what it encodes, with a template that writes ``bos_token``
    itself (Llama 3's, Gemma's): the chat prompt holds that one BOS, not a second one."""
    tok = llm.tokenizer
    saved = tok.bos_id, tok.add_bos
    tok.bos_id, tok.add_bos, tok.chat_template = 1, True, "{{ bos_token }}" + TEMPLATE
    try:
        body = {"model": MODEL, "messages": CHAT, "max_tokens": 1, "temperature": 0}
        usage = client.post("/v1/chat/completions", json=body).json()["usage"]
        ids = tok.encode(tok.apply_chat_template(CHAT), add_bos=False)
        assert ids[:2] == [1, 1]  # the template's BOS, then the message's <|im_start|>
        assert usage["prompt_tokens"] == len(ids)
    finally:
        tok.bos_id, tok.add_bos = saved
