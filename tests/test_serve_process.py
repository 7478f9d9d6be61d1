"""serve/process.py against stand-in servers on 127.0.0.1 (a few lines of ``http.server``): what a
server that is not kvlens, or a server process that misbehaves, gets from ``served_model``,
``scrape_metrics`` and ``ServerProcess`` (the tests, the tour and ``bench serve`` rely on them).
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvlens.serve.process import ServerProcess, scrape_metrics, served_model


@contextmanager
def stand_in(status: int, body: str, kind: str = "application/json") -> Iterator[str]:
    """A loopback server answering every GET with ``status`` and ``body``; its base URL."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_a_model_list_behind_an_error_status_is_refused_with_the_status():
    with stand_in(401, json.dumps({"error": {"message": "invalid API key"}})) as url:
        with pytest.raises(ValueError, match="answered HTTP 401"):
            served_model(url)


@pytest.mark.parametrize("body", [{"object": "list"}, {"data": []}, {"data": [{"name": "x"}]}, {"data": "x"}])
def test_a_model_list_without_a_model_id_is_one_value_error(body):
    with stand_in(200, json.dumps(body)) as url:
        with pytest.raises(ValueError, match="did not list a model"):
            served_model(url)


def test_metrics_keep_their_labels_apart():
    text = (
        "# TYPE kvlens_http_errors counter\n"
        'kvlens_http_errors_total{status="400"} 2.0\n'
        'kvlens_http_errors_total{status="429"} 5.0\n'
        "# TYPE kvlens_requests_running gauge\n"
        "kvlens_requests_running 1.0\n"
    )
    with stand_in(200, text, "text/plain; version=0.0.4") as url:
        m = scrape_metrics(url)
    assert m["kvlens_http_errors_total|status=400"] == 2.0
    assert m["kvlens_http_errors_total|status=429"] == 5.0
    assert m["kvlens_requests_running"] == 1.0


CHILD = """
import http.server, signal, sys
port, mode = int(sys.argv[1]), sys.argv[2]
if mode == "exit":
    sys.exit(3)
if mode == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("KV cache: loading the recipe", flush=True)
print("KV pool (q8): 4 blocks x 32 positions", flush=True)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


class StandInProcess(ServerProcess):
    """A child that exits at once, serves /health, or serves it and ignores SIGTERM (``args[0]``)."""

    name = "stand-in"

    def command(self, args: list[str], host: str, port: int) -> list[str]:
        return [sys.executable, "-c", CHILD, str(port), args[0]]


def test_a_child_that_exits_is_reported_at_once():
    with pytest.raises(RuntimeError, match="stand-in exited with 3"):
        StandInProcess(["exit"], start_timeout=20)


def test_the_budget_line_is_the_kv_pool_line():
    with StandInProcess(["serve"], start_timeout=60) as proc:
        assert proc.budget_line() == "KV pool (q8): 4 blocks x 32 positions"


def test_a_child_that_ignores_sigterm_is_killed_after_the_timeout():
    proc = StandInProcess(["stubborn"], start_timeout=60)
    try:
        assert proc.stop(timeout=1) == -9
    finally:
        proc.proc.kill()
        proc.proc.wait()
        proc.log.unlink(missing_ok=True)
