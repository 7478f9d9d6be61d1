"""The probe behind docs/serve.md's warm-up table: start `kvlens serve --kv q8 --kv-budget 256MiB
--port PORT [EXTRA ARGS]` (loopback), poll /health every 0.1 s (at most 600 s), send one chat
request, print both times and the server's output, then SIGTERM it.

Usage (from the repository root, with the .venv): python docs/serve/first_request_probe.py PORT [--no-warmup ...]
A cold run: an empty XDG_CACHE_HOME. PROBE_MODEL names the model the request asks for (default smollm2)."""

import os
import subprocess
import sys
import time

import httpx

port = sys.argv[1]
args = ["--kv", "q8", "--kv-budget", "256MiB", "--host", "127.0.0.1", "--port", port, *sys.argv[2:]]
t0 = time.monotonic()
server = subprocess.Popen(
    [".venv/bin/kvlens", "serve", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
)
try:
    for _ in range(6000):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    else:
        raise SystemExit("the server was not healthy after 600 s")
    ready = time.monotonic() - t0
    t1 = time.monotonic()
    body = {
        "model": os.environ.get("PROBE_MODEL", "smollm2"),
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 8,
        "temperature": 0,
    }
    r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=600, json=body)
    first = time.monotonic() - t1
    answer = (
        r.json()["choices"][0]["message"]["content"]
        if r.status_code == 200
        else f"HTTP {r.status_code} {r.text}"
    )
    print(f"ready after {ready:.1f} s; first request {first:.2f} s; {answer!r}")
finally:
    server.terminate()
    print(server.communicate(timeout=60)[0])
