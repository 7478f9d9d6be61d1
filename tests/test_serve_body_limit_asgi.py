"""``BodyLimit`` against the ASGI message format itself: a refusal's start message carries lowercase
header names with the body's true length, a request message may leave out ``body`` (ASGI: optional,
default b""), and an empty Content-Encoding means no encoding. The forty-second session's mutation
run found each unasserted (docs/testing.md, "Mutation testing of the HTTP service")."""

from __future__ import annotations

import asyncio

from test_serve_body_limit import LIMIT, _drive

from kvlens.serve.body_limit import BodyLimit


def _run(messages: list[dict], headers: list[tuple[bytes, bytes]]) -> dict:
    """``messages`` through a ``BodyLimit(LIMIT)`` with these request headers; what the app and client saw."""
    script = [*messages, {"type": "http.disconnect"}]
    seen: dict = {"app": None, "sent": []}

    async def receive() -> dict:
        return script.pop(0)

    async def send(message: dict) -> None:
        seen["sent"].append(message)

    async def app(scope, receive, send) -> None:
        seen["app"] = await receive()

    asyncio.run(BodyLimit(app, LIMIT)({"type": "http", "headers": headers}, receive, send))
    return seen


def test_a_refusal_starts_with_lowercase_headers_and_the_bodys_length() -> None:
    start, body = _drive([b"x" * (LIMIT + 1)])["sent"]
    assert start["type"] == "http.response.start" and start["status"] == 413
    length = str(len(body["body"])).encode()
    assert start["headers"] == [(b"content-type", b"application/json"), (b"content-length", length)]


def test_a_request_message_without_a_body_reads_as_an_empty_one() -> None:
    messages = [{"type": "http.request", "more_body": True}, {"type": "http.request", "body": b"abc"}]
    seen = _run(messages, [])
    assert seen["app"] == {"type": "http.request", "body": b"abc", "more_body": False}
    assert seen["sent"] == []


def test_an_empty_content_encoding_is_no_encoding() -> None:
    seen = _run([{"type": "http.request", "body": b"{}"}], [(b"content-encoding", b"")])
    assert seen["app"] == {"type": "http.request", "body": b"{}", "more_body": False}
    assert seen["sent"] == []
