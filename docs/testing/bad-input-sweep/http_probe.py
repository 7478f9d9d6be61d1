"""Hostile requests against a running ``kvlens serve`` (no --api-key): prints the status and the
start of each answer. Every case must be a 4xx with OpenAI's error body (or a 200 where the request
is valid), never a 500 or a dropped connection, and /health must answer 200 at the end.

Usage: kvlens serve --port 18123 &  python docs/testing/bad-input-sweep/http_probe.py http://127.0.0.1:18123
"""

import json
import sys

import httpx

url = sys.argv[1]
c = httpx.Client(base_url=url, timeout=120)
M = c.get("/v1/models").json()["data"][0]["id"]
cases = {
    "max_tokens 0": ("/v1/completions", {"model": M, "prompt": "hi", "max_tokens": 0}),
    "max_tokens -1": ("/v1/completions", {"model": M, "prompt": "hi", "max_tokens": -1}),
    "max_tokens huge": ("/v1/completions", {"model": M, "prompt": "hi", "max_tokens": 10**12}),
    "max_tokens float": ("/v1/completions", {"model": M, "prompt": "hi", "max_tokens": 2.5}),
    "max_tokens bool": ("/v1/completions", {"model": M, "prompt": "hi", "max_tokens": True}),
    "n 2": ("/v1/completions", {"model": M, "prompt": "hi", "max_tokens": 2, "n": 2}),
    "prompt ids oob": ("/v1/completions", {"model": M, "prompt": [1, 99999999], "max_tokens": 2}),
    "prompt ids neg": ("/v1/completions", {"model": M, "prompt": [-5], "max_tokens": 2}),
    "prompt empty": ("/v1/completions", {"model": M, "prompt": "", "max_tokens": 2}),
    "prompt list of str": ("/v1/completions", {"model": M, "prompt": ["a", "b"], "max_tokens": 2}),
    "prompt nested ids": ("/v1/completions", {"model": M, "prompt": [[1, 2], [3]], "max_tokens": 2}),
    "prompt null": ("/v1/completions", {"model": M, "prompt": None, "max_tokens": 2}),
    "prompt lone surrogate": ("/v1/completions", {"model": M, "prompt": "\ud800", "max_tokens": 2}),
    "prompt too long": ("/v1/completions", {"model": M, "prompt": "word " * 9000, "max_tokens": 2}),
    "temperature 1e30": (
        "/v1/completions",
        {"model": M, "prompt": "hi", "max_tokens": 2, "temperature": 1e30},
    ),
    "temperature nan": (
        "/v1/completions",
        {"model": M, "prompt": "hi", "max_tokens": 2, "temperature": float("nan")},
    ),
    "temperature -1": ("/v1/completions", {"model": M, "prompt": "hi", "max_tokens": 2, "temperature": -1}),
    "top_p 0": ("/v1/completions", {"model": M, "prompt": "hi", "max_tokens": 2, "top_p": 0}),
    "top_p 2": ("/v1/completions", {"model": M, "prompt": "hi", "max_tokens": 2, "top_p": 2}),
    "top_k -2": ("/v1/completions", {"model": M, "prompt": "hi", "max_tokens": 2, "top_k": -2}),
    "seed huge": (
        "/v1/completions",
        {"model": M, "prompt": "hi", "max_tokens": 2, "seed": 2**70, "temperature": 1},
    ),
    "seed neg": (
        "/v1/completions",
        {"model": M, "prompt": "hi", "max_tokens": 2, "seed": -3, "temperature": 1},
    ),
    "stop 50": ("/v1/completions", {"model": M, "prompt": "hi", "max_tokens": 2, "stop": ["x"] * 50}),
    "stop empty str": ("/v1/completions", {"model": M, "prompt": "hi", "max_tokens": 2, "stop": [""]}),
    "stop int": ("/v1/completions", {"model": M, "prompt": "hi", "max_tokens": 2, "stop": 5}),
    "logprobs 100": ("/v1/completions", {"model": M, "prompt": "hi", "max_tokens": 2, "logprobs": 100}),
    "logprobs -1": ("/v1/completions", {"model": M, "prompt": "hi", "max_tokens": 2, "logprobs": -1}),
    "model unknown": ("/v1/completions", {"model": "gpt-9", "prompt": "hi", "max_tokens": 2}),
    "extra field": ("/v1/completions", {"model": M, "prompt": "hi", "max_tokens": 2, "frobnicate": 1}),
    "stream_options bad": (
        "/v1/completions",
        {"model": M, "prompt": "hi", "max_tokens": 2, "stream": True, "stream_options": 5},
    ),
    "chat no messages": ("/v1/chat/completions", {"model": M, "messages": []}),
    "chat bad role": (
        "/v1/chat/completions",
        {"model": M, "messages": [{"role": "wizard", "content": "hi"}], "max_tokens": 2},
    ),
    "chat content parts": (
        "/v1/chat/completions",
        {
            "model": M,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_tokens": 2,
        },
    ),
    "chat content image": (
        "/v1/chat/completions",
        {
            "model": M,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "max_tokens": 2,
        },
    ),
    "chat content null": (
        "/v1/chat/completions",
        {"model": M, "messages": [{"role": "user", "content": None}], "max_tokens": 2},
    ),
    "chat tools": (
        "/v1/chat/completions",
        {
            "model": M,
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "max_tokens": 2,
        },
    ),
    "chat max_completion_tokens": (
        "/v1/chat/completions",
        {"model": M, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2},
    ),
    "chat response_format json": (
        "/v1/chat/completions",
        {
            "model": M,
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_object"},
            "max_tokens": 2,
        },
    ),
    "chat surrogate": (
        "/v1/chat/completions",
        {"model": M, "messages": [{"role": "user", "content": "\ud83d"}], "max_tokens": 2},
    ),
    "stop surrogate": ("/v1/completions", {"model": M, "prompt": "hi", "max_tokens": 2, "stop": ["\udc00"]}),
    "chat logprobs top 30": (
        "/v1/chat/completions",
        {
            "model": M,
            "messages": [{"role": "user", "content": "hi"}],
            "logprobs": True,
            "top_logprobs": 30,
            "max_tokens": 2,
        },
    ),
}
for name, (path, body) in cases.items():
    try:
        r = httpx.post(
            url + path,
            content=json.dumps(body, allow_nan=True),
            headers={"content-type": "application/json"},
            timeout=120,
        )
        txt = r.text[:150].replace("\n", " ")
        print(f"{r.status_code} {name}: {txt}")
    except Exception as e:
        print(f"EXC {name}: {e!r}")
for name, raw, ct in [
    ("not json", b"{", "application/json"),
    ("text/plain", b'{"model":"smollm2","prompt":"hi"}', "text/plain"),
    ("array body", b"[1]", "application/json"),
    ("huge body", b'{"prompt":"' + b"a" * 50_000_000 + b'"}', "application/json"),
]:
    try:
        r = httpx.post(url + "/v1/completions", content=raw, headers={"content-type": ct}, timeout=120)
        print(f"{r.status_code} {name}: {r.text[:150]}")
    except Exception as e:
        print(f"EXC {name}: {e!r}")
print("health", c.get("/health").status_code)
