"""A stand-in for llama.cpp's ``llama-server``: the OpenAI subset ``kvlens bench serve`` uses.

Records its argv (JSON, one line per start) to the file named by ``$FAKE_LLAMA_LOG``. Prompt "tokens"
are words: a completion prompt's token ids, a chat's ``role: content`` words. A prompt cache keeps
every prompt + reply seen; ``cached_tokens`` = the longest common word prefix with any of them (as
llama-server's slots report ``prompt_tokens_details.cached_tokens``). Each output token is one word
``tK`` streamed as its own chunk. ``$FAKE_LLAMA_FAIL`` set: print a load error and exit 1.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SEEN: list[list[str]] = []
LOCK = threading.Lock()


def cached(words: list[str]) -> int:
    best = 0
    with LOCK:
        for seen in SEEN:
            n = 0
            for a, b in zip(words, seen, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
    return best


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def _send(self, code: int, body: str, kind: str = "application/json") -> None:
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._send(200, '{"status": "ok"}')
        elif self.path == "/v1/models":
            self._send(200, json.dumps({"object": "list", "data": [{"id": "fake.gguf", "object": "model"}]}))
        elif self.path == "/metrics":
            self._send(
                200,
                "# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 0\n",
                "text/plain",
            )
        else:
            self._send(404, '{"error": {"message": "not found"}}')

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        chat = self.path == "/v1/chat/completions"
        if chat:
            words = [w for m in body["messages"] for w in f"{m['role']}: {m['content']}".split()]
        else:
            words = [str(t) for t in body["prompt"]]
        hit = cached(words)
        n_out = body["max_tokens"]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        reply = [f"t{k}" for k in range(n_out)]
        kind = "chat.completion.chunk" if chat else "text_completion"
        for k, w in enumerate(reply):
            piece = w if k == 0 else " " + w
            choice = (
                {"index": 0, "delta": {"role": "assistant", "content": piece}}
                if chat
                else {"index": 0, "text": piece}
            )
            self._event({"id": "x", "object": kind, "created": 0, "model": "fake", "choices": [choice]})
        usage = {
            "prompt_tokens": len(words), "completion_tokens": n_out, "total_tokens": len(words) + n_out,
            "prompt_tokens_details": {"cached_tokens": hit},
        }  # fmt: skip
        self._event({"id": "x", "object": kind, "created": 0, "model": "fake", "choices": [], "usage": usage})
        self.wfile.write(b"data: [DONE]\n\n")
        with LOCK:
            SEEN.append(words + ["assistant:", *reply])

    def _event(self, obj: dict) -> None:
        self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
        self.wfile.flush()


def main() -> None:
    argv = sys.argv[1:]
    with open(os.environ["FAKE_LLAMA_LOG"], "a", encoding="utf-8") as log:
        log.write(json.dumps(argv) + "\n")
    if os.environ.get("FAKE_LLAMA_FAIL"):
        print("llama_model_load: error loading model: unknown model architecture", file=sys.stderr)
        sys.exit(1)
    host, port = argv[argv.index("--host") + 1], int(argv[argv.index("--port") + 1])
    server = ThreadingHTTPServer((host, port), Handler)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    server.serve_forever()
    server.server_close()


if __name__ == "__main__":
    main()
