"""``BodyLimit`` driven as ASGI middleware directly, with scripted messages: the cap at its edge, a
body in several chunks arriving whole, and an oversize body read to its end before the 413 (the
planted-bug campaign of the thirty-third session found these untested; the HTTP test sends one
oversize body only)."""

from __future__ import annotations

import asyncio
import json

from kvlens.serve.body_limit import BodyLimit

LIMIT = 10


def _drive(chunks: list[bytes], declared: int | None = None) -> dict:
    """Run one request of ``chunks`` through a ``BodyLimit(LIMIT)``; what the app and client saw."""
    script = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)
    ]
    script.append({"type": "http.disconnect"})
    seen: dict = {"app": None, "sent": [], "refused": 0, "read": 0}

    async def receive() -> dict:
        seen["read"] += 1
        return script.pop(0)

    async def send(message: dict) -> None:
        seen["sent"].append(message)

    async def app(scope, receive, send) -> None:
        seen["app"] = [await receive(), await receive()]  # the body, then what comes after it

    headers = [] if declared is None else [(b"content-length", str(declared).encode())]
    limit = BodyLimit(app, LIMIT, on_refused=lambda status: seen.__setitem__("refused", seen["refused"] + 1))
    asyncio.run(limit({"type": "http", "headers": headers}, receive, send))
    return seen


def test_a_body_of_exactly_the_limit_passes_whole_in_one_message() -> None:
    for declared in (None, LIMIT):
        seen = _drive([b"abc", b"defg", b"hij"], declared)
        body, after = seen["app"]
        assert body == {"type": "http.request", "body": b"abcdefghij", "more_body": False}
        assert after == {"type": "http.disconnect"}  # later messages pass through unchanged
        assert seen["sent"] == [] and seen["refused"] == 0


def _status(seen: dict) -> int:
    start, body = seen["sent"]
    assert json.loads(body["body"])["error"]["type"] == "invalid_request_error"
    return start["status"]


def test_one_byte_over_is_a_413_and_the_rest_of_the_body_is_read_first() -> None:
    chunks = [b"abcdef", b"ghijk", b"more", b"end"]  # over the cap in the second chunk of four
    seen = _drive(chunks)
    assert seen["app"] is None and _status(seen) == 413 and seen["refused"] == 1
    assert seen["read"] == len(chunks)  # drained to more_body false, never the disconnect


def test_a_declared_length_over_the_limit_is_refused_before_the_app() -> None:
    seen = _drive([b"a"] * 3 + [b"b" * 8], declared=LIMIT + 1)
    assert seen["app"] is None and _status(seen) == 413 and seen["read"] == 4


def _stalled_drive(chunks: list[bytes], headers: list[tuple[bytes, bytes]]) -> dict:
    """``chunks`` arrive, each saying more is coming, then nothing ever again."""
    script = [{"type": "http.request", "body": c, "more_body": True} for c in chunks]
    seen: dict = {"app": None, "sent": [], "refused": []}

    async def receive() -> dict:
        if script:
            return script.pop(0)
        await asyncio.Event().wait()  # the client never sends the rest
        raise AssertionError("unreachable")

    async def send(message: dict) -> None:
        seen["sent"].append(message)

    async def app(scope, receive, send) -> None:
        seen["app"] = await receive()

    limit = BodyLimit(app, LIMIT, on_refused=seen["refused"].append, idle_timeout_s=0.05)
    asyncio.run(asyncio.wait_for(limit({"type": "http", "headers": headers}, receive, send), 30))
    return seen


def test_a_body_that_stops_arriving_is_a_408() -> None:
    for chunks in ([], [b"abc"]):  # nothing at all, or part of it
        seen = _stalled_drive(chunks, [(b"content-length", b"9")])
        assert seen["app"] is None and _status(seen) == 408 and seen["refused"] == [408]
        assert json.loads(seen["sent"][1]["body"])["error"]["message"] == (
            "no part of the request body arrived for 0.05 s"
        )


def test_a_refused_body_that_stops_arriving_is_still_answered() -> None:
    """Draining an oversize or compressed body stops at the stall: the client gets an answer."""
    seen = _stalled_drive([b"abcdefghijkl"], [])
    assert _status(seen) == 408 and seen["refused"] == [408]
    seen = _stalled_drive([b"ab"], [(b"content-encoding", b"gzip")])
    assert _status(seen) == 408 and seen["refused"] == [408]
