"""Requests a hostile sweep of the real server found mishandled (thirty-sixth session), each through
the real app, engine thread and engine over the tiny model (Starlette's TestClient):

- a valid but tiny ``temperature`` or ``top_p`` made the sampler fail, a 500 for it and for every
  request in flight; in the limit both are greedy, so the reply must be the greedy one;
- a lone surrogate as ``model`` (echoed in the 404) and an empty body were a 500 and "missing
  required field: None"; a gzip body was "error parsing the body";
- HEAD on the GET routes was a 405; a lowercase ``bearer`` scheme a 401;
- a chat ``max_tokens`` past the context was blamed on ``prompt`` (a field chat has not);
- tokenizing a long prompt held the event loop: nothing else was answered meanwhile.
"""

from __future__ import annotations

import gzip
import json
import threading

import pytest
from test_serve_app import CHAT, KEY, MODEL, TINY_MODEL, app_parts, client, llm  # noqa: F401 - fixtures

from kvlens.serve.protocol import error_body


def greedy_text(client, **extra) -> str:  # noqa: F811
    body = {"model": MODEL, "prompt": [5, 17, 200, 33], "max_tokens": 4, "temperature": 0}
    return client.post("/v1/completions", json=body | extra).json()["choices"][0]["text"]


@pytest.mark.parametrize(
    "sampling", [{"temperature": 1e-40}, {"temperature": 5e-324}, {"temperature": 1.0, "top_p": 1e-300}]
)
def test_a_tiny_temperature_or_top_p_samples_the_greedy_reply(client, sampling):  # noqa: F811
    """T → 0 and top_p → 0 both leave only the most likely token (the tiny model's logits have no ties
    at the top: the greedy reply is the premise, computed at temperature 0)."""
    r = client.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": [5, 17, 200, 33], "max_tokens": 4, "seed": 3, **sampling},
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == greedy_text(client)


def raw_post(client, body: bytes, **headers):  # noqa: F811
    return client.post(
        "/v1/completions", content=body, headers={"Content-Type": "application/json", **headers}
    )


def test_a_model_name_that_is_not_unicode_is_a_400(client):  # noqa: F811
    r = raw_post(client, b'{"model": "\\ud800", "prompt": "hi"}')
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "model" and "not valid UTF-8 text" in error["message"]


def test_an_error_message_echoing_a_lone_surrogate_stays_encodable():
    message = error_body("The model 'a\ud800' does not exist")["error"]["message"]
    assert message == "The model 'a\\ud800' does not exist"
    json.dumps(message, ensure_ascii=False).encode("utf-8")  # what the JSON response does


def test_an_empty_body_says_so(client):  # noqa: F811
    r = raw_post(client, b"")
    assert r.status_code == 400
    assert r.json()["error"] | {"code": None} == {
        "message": "the request body is empty: it must be a JSON object",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }


def test_a_compressed_body_is_a_415_that_names_the_encoding(client):  # noqa: F811
    body = gzip.compress(json.dumps({"model": MODEL, "prompt": "hi"}).encode())
    r = raw_post(client, body, **{"Content-Encoding": "gzip"})
    assert r.status_code == 415
    assert (
        r.json()["error"]["message"] == "Content-Encoding 'gzip' is not supported: send the body uncompressed"
    )
    assert raw_post(client, json.dumps({"model": MODEL, "prompt": [5], "max_tokens": 1}).encode(),
                    **{"Content-Encoding": "identity"}).status_code == 200  # fmt: skip
    assert 'kvlens_request_errors_total{status="415"} 1.0' in client.get("/metrics").text


@pytest.mark.parametrize("path", ["/health", "/metrics", "/v1/models"])
def test_head_answers_where_get_does(client, path):  # noqa: F811
    got, head = client.get(path), client.head(path)
    assert head.status_code == got.status_code == 200 and head.content == b""


@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "Bearer"])
def test_the_bearer_scheme_is_case_insensitive(client, scheme):  # noqa: F811
    assert client.get("/v1/models", headers={"Authorization": f"{scheme} {KEY}"}).status_code == 200
    assert client.get("/v1/models", headers={"Authorization": f"{scheme} {KEY}x"}).status_code == 401


@pytest.mark.parametrize(
    ("extra", "param"),
    [({"max_tokens": 10**6}, "max_tokens"), ({"max_completion_tokens": 10**6}, "max_completion_tokens")],
)
def test_a_token_limit_past_the_context_is_blamed_on_the_limit(client, llm, extra, param):  # noqa: F811
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, **extra})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == param and f"max_tokens {10**6}" in error["message"]
    long_prompt = [5] * (llm.config.max_ctx + 1)  # the prompt alone is too long: it is named
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": long_prompt, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_the_server_answers_while_a_prompt_is_tokenized(client, llm, monkeypatch, endpoint):  # noqa: F811
    """The tokenizer is held inside ``encode`` until /health has been answered (10 s at most): on the
    event loop it would hold /health back too, and ``encode`` would time out waiting."""
    entered, answered, seen = threading.Event(), threading.Event(), {}
    real = llm.tokenizer.encode

    def held_encode(text, *args, **kwargs):
        entered.set()
        seen["health answered first"] = answered.wait(timeout=10)
        return real(text, *args, **kwargs)

    monkeypatch.setattr(llm.tokenizer, "encode", held_encode)
    body = {"model": MODEL, "max_tokens": 2, "temperature": 0}
    body |= {"messages": CHAT} if "chat" in endpoint else {"prompt": "the the"}
    worker = threading.Thread(target=lambda: seen.setdefault("reply", client.post(endpoint, json=body)))
    worker.start()
    assert entered.wait(timeout=30)
    assert client.get("/health").status_code == 200
    answered.set()
    worker.join(timeout=60)
    assert seen["health answered first"] and seen["reply"].status_code == 200
