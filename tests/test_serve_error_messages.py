"""What a refused request is told, in process (the real app over the tiny model, Starlette's TestClient):
for each kind of bad body, the exact message and ``param`` of OpenAI's error object, so a client can
act on it. test_serve_http sends a few of these to a real server; the forty-second session's mutation
run found the rest of the message paths (a union that fails on the input's type, the Content-Type
note, each refused feature) unasserted (docs/testing.md, "Mutation testing of the HTTP service")."""

from __future__ import annotations

import json

import pytest
from test_serve_app import CHAT, KEY, MODEL, TINY_MODEL, app_parts, client, llm  # noqa: F401

OK = {"model": MODEL, "prompt": "hi"}
JSON = "application/json"
NOT_AN_OBJECT = "the request body must be a JSON object sent as Content-Type: application/json"

COMPLETION_CASES = [
    # (body, Content-Type or None for none, param, message)
    (b"[]", JSON, None, NOT_AN_OBJECT),
    (b'"hi"', "Application/JSON; charset=utf-8", None, NOT_AN_OBJECT),
    (json.dumps(OK).encode(), "text/plain", None, NOT_AN_OBJECT + " (it was sent as text/plain)"),
    (json.dumps(OK).encode(), None, None, NOT_AN_OBJECT + " (it was sent as no Content-Type)"),
    (OK | {"temperature": "nan"}, JSON, "temperature", "temperature: Input should be a finite number"),
    (OK | {"max_tokens": True}, JSON, "max_tokens", "max_tokens: Input should be a number, not a boolean"),
    (OK | {"prompt": ["a", "b"]}, JSON, "prompt",
     "prompt: a list of prompts (a batch) is not supported: send one prompt per request"),
    (OK | {"stop": ["a", "b", "c", "d", "e"]}, JSON, "stop", "stop: at most 4 stop sequences"),
    (OK | {"stream_options": {"include_usage": True, "x": 1}, "stream": True}, JSON, "stream_options.x",
     "Unrecognized request argument supplied: stream_options.x"),
    (OK | {"n": 2}, JSON, None, "only n=1 is supported"),
    (OK | {"presence_penalty": 0.5}, JSON, None,
     "presence_penalty and frequency_penalty are not supported (use 0)"),
    (OK | {"logit_bias": {"5": 1.0}}, JSON, None, "logit_bias is not supported"),
    (OK | {"stream_options": {"include_usage": True}}, JSON, None,
     "stream_options is only allowed when stream is true"),
    (OK | {"echo": True}, JSON, None, "echo is not supported"),
    (OK | {"best_of": 2}, JSON, None, "only best_of=1 is supported"),
    (OK | {"suffix": "!"}, JSON, None, "suffix is not supported"),
]  # fmt: skip

CHAT_OK = {"model": MODEL, "messages": CHAT}
CHAT_CASES = [
    (CHAT_OK | {"top_logprobs": 2}, "top_logprobs requires logprobs to be true", None),
    # content is a str or a list of parts: a list whose part lacks its text is blamed on the part (the
    # branch the input's type took), not on "Input should be a valid string" from the str branch
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]},
     "messages.0.content.0.text: Input should be a valid string", "messages.0.content.0.text"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "missing required field: messages.0.content.0.text", "messages.0.content.0.text"),
    ({"model": MODEL, "messages": [{"role": "user"}]},
     "missing required field: messages.0.content", "messages.0.content"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]},
     "messages.0.role: Input should be 'system', 'developer', 'user' or 'assistant'", "messages.0.role"),
]  # fmt: skip


@pytest.mark.parametrize("body, content_type, param, message", COMPLETION_CASES)
def test_a_bad_completion_request_is_told_what_is_wrong(client, body, content_type, param, message):  # noqa: F811
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {KEY}"} | ({"Content-Type": content_type} if content_type else {})
    r = client.post("/v1/completions", content=data, headers=headers)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["message"], error["param"], error["type"]) == (message, param, "invalid_request_error")


@pytest.mark.parametrize("body, message, param", CHAT_CASES)
def test_a_bad_chat_request_is_told_what_is_wrong(client, body, message, param):  # noqa: F811
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["message"], error["param"], error["type"]) == (message, param, "invalid_request_error")
