"""78 hostile HTTP requests to a real `kvlens serve` (SmolLM2, q8; twenty-third session). Run from the
repository root: python docs/testing/bad-input-sweep23/http_fuzz.py. A line per request, then BAD: the
requests that got no 4xx JSON error or 200 (client-side encoding errors are the client's, not the server's)."""

import httpx

from kvlens.serve.process import ServerProcess

cases = []


def c(path, body, raw=None, headers=None, method="POST"):
    cases.append((method, path, body, raw, headers))


M = "smollm2"
# completions
for b in [
    {},
    {"model": M},
    {"model": M, "prompt": ""},
    {"model": M, "prompt": []},
    {"model": M, "prompt": [[1, 2]]},
    {"model": M, "prompt": [-1]},
    {"model": M, "prompt": [10**12]},
    {"model": M, "prompt": "hi", "max_tokens": 0},
    {"model": M, "prompt": "hi", "max_tokens": -5},
    {"model": M, "prompt": "hi", "max_tokens": 10**9},
    {"model": M, "prompt": "hi", "max_tokens": 2.5},
    {"model": M, "prompt": "hi", "max_tokens": "3"},
    {"model": M, "prompt": "hi", "temperature": -1},
    {"model": M, "prompt": "hi", "temperature": 1e309},
    {"model": M, "prompt": "hi", "temperature": "nan"},
    {"model": M, "prompt": "hi", "top_p": 0},
    {"model": M, "prompt": "hi", "top_p": 1.5},
    {"model": M, "prompt": "hi", "n": 2},
    {"model": M, "prompt": "hi", "n": 0},
    {"model": M, "prompt": "hi", "logprobs": 100},
    {"model": M, "prompt": "hi", "logprobs": -1},
    {"model": M, "prompt": "hi", "stop": ""},
    {"model": M, "prompt": "hi", "stop": ["a"] * 100},
    {"model": M, "prompt": "hi", "stop": [1]},
    {"model": M, "prompt": "hi", "seed": -1},
    {"model": M, "prompt": "hi", "seed": 2**80},
    {"model": M, "prompt": "hi", "stream": "yes"},
    {"model": M, "prompt": "hi", "stream_options": {"include_usage": True}},
    {"model": M, "prompt": "hi", "echo": True},
    {"model": M, "prompt": "hi", "best_of": 3},
    {"model": M, "prompt": "hi", "suffix": "x"},
    {"model": M, "prompt": "hi", "logit_bias": {"1": 100}},
    {"model": M, "prompt": "hi", "presence_penalty": 1.0},
    {"model": M, "prompt": "hi", "frequency_penalty": 3.0},
    {"model": M, "prompt": "hi", "user": "u"},
    {"model": M, "prompt": ["a", "b"]},
    {"model": M, "prompt": "\ud800"},
    {"model": "other", "prompt": "hi"},
    {"model": M, "prompt": "x " * 10000, "max_tokens": 1},
    {"model": M, "prompt": None},
    {"model": M, "prompt": {"a": 1}},
    {"model": M, "prompt": "hi", "max_tokens": None},
    {"model": M, "prompt": "hi", "ignore_eos": True, "max_tokens": 3},
    {"model": M, "prompt": "hi", "top_k": 5},
    {"model": M, "prompt": "hi", "top_k": -2},
]:
    c("/v1/completions", b)
for b in [
    {"model": M},
    {"model": M, "messages": []},
    {"model": M, "messages": [{}]},
    {"model": M, "messages": [{"role": "user"}]},
    {"model": M, "messages": [{"role": "wizard", "content": "hi"}]},
    {"model": M, "messages": [{"role": "user", "content": None}]},
    {"model": M, "messages": [{"role": "user", "content": 5}]},
    {"model": M, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
    {
        "model": M,
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    },
    {"model": M, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3},
    {
        "model": M,
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 3,
        "max_tokens": 5,
    },
    {
        "model": M,
        "messages": [{"role": "user", "content": "hi"}],
        "logprobs": True,
        "top_logprobs": 50,
        "max_tokens": 2,
    },
    {"model": M, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2, "max_tokens": 2},
    {
        "model": M,
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f"}}],
    },
    {"model": M, "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}},
    {"model": M, "messages": [{"role": "assistant", "content": "hi"}], "max_tokens": 2},
    {"model": M, "messages": [{"role": "system", "content": "s"}], "max_tokens": 2},
    {"model": M, "messages": [{"role": "user", "content": "hi", "name": "bob"}], "max_tokens": 2},
    {"model": M, "messages": [{"role": "tool", "content": "hi", "tool_call_id": "x"}], "max_tokens": 2},
    {
        "model": M,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "max_tokens": 2,
        "stream_options": {"include_usage": 1},
    },
    {"model": M, "messages": "hi"},
]:
    c("/v1/chat/completions", b)
c("/v1/completions", None, raw=b"{not json")
c("/v1/completions", None, raw=b"\xff\xfe\x00")
c("/v1/completions", None, raw=b"[]")
c("/v1/completions", None, raw=b'{"model":"smollm2","prompt":"hi"}', headers={"content-type": "text/plain"})
c("/v1/completions", None, raw=b'{"model":"smollm2","prompt":"hi","max_tokens":1e999}')
c("/v1/completions", None, raw=b'{"model":"smollm2","prompt":"hi","temperature":NaN}')
c("/v1/completions", None, raw=b'{"model":"smollm2","prompt":"hi","max_tokens":' + b"9" * 5000 + b"}")
c("/v1/completions", None, raw=b"[" * 100000 + b"]" * 100000)
c("/v1/nothing", {})
c("/v1/models", None, method="DELETE")
c("/v1/completions", None, method="GET")
c("/v1/completions", {"model": M, "prompt": "hi"}, headers={"authorization": "Bearer x"})
bad = []
with ServerProcess(
    ["--model", "smollm2", "--kv", "q8", "--kv-budget", "64MiB", "--max-batch", "4", "--no-warmup"]
) as srv:
    with httpx.Client(base_url=srv.url, timeout=400) as h:
        for method, path, body, raw, headers in cases:
            try:
                if raw is not None:
                    r = h.request(
                        method, path, content=raw, headers=headers or {"content-type": "application/json"}
                    )
                elif body is None:
                    r = h.request(method, path)
                else:
                    r = h.request(method, path, json=body, headers=headers)
            except Exception as e:
                bad.append(("EXC", path, str(body)[:80], repr(e)[:120]))
                continue
            ct = r.headers.get("content-type", "")
            ok = r.status_code < 500 and ("json" in ct or "event-stream" in ct)
            if r.status_code >= 400:
                try:
                    err = r.json()["error"]
                    ok = ok and isinstance(err.get("message"), str)
                except Exception:
                    ok = False
            summary = r.text[:140].replace("\n", " ")
            print(r.status_code, path, (str(body) if raw is None else repr(raw[:40]))[:90], "->", summary)
            if not ok:
                bad.append((r.status_code, path, str(body)[:80], summary))
        print("health:", h.get("/health").status_code)
print("BAD:", len(bad))
for b in bad:
    print("  ", b)
