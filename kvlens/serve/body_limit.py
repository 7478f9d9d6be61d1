"""A cap on request body size, as ASGI middleware: a body over the cap is a 413 with OpenAI's error
body and is never held in memory, so no client can make the server hold gigabytes.

A body within the cap is handed to the app as one message; later messages (a client's disconnect)
pass through unchanged. A body over it (a declared ``Content-Length`` or the bytes counted so far)
is read to its end and dropped chunk by chunk before the 413 is sent: a client still sending when
the server answered and closed would meet a reset connection instead of the answer. A body sent
with a ``Content-Encoding`` (gzip, …) is drained the same way and answered 415: the app reads JSON
as sent, and would call compressed bytes malformed JSON. A body of which nothing arrives for
``idle_timeout_s`` (a client that declared more than it sends) is answered 408.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from .protocol import error_body

DEFAULT_MAX_BODY_BYTES = 16 << 20  # a 128k-token prompt as a list of token ids is ~1 MB of JSON
# uvicorn waits for a body as long as the client keeps its connection: one that declares more bytes
# than it sends would hold the connection and a task for good
BODY_IDLE_TIMEOUT_S = 60.0

Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class _Stalled(Exception):
    """No part of the body arrived within the idle timeout."""


class BodyLimit:
    """ASGI middleware: requests whose body exceeds ``max_bytes`` get a 413, a compressed body a 415, a
    body of which nothing arrives for ``idle_timeout_s`` a 408; ``on_refused(status)`` is called for
    each (the server's error counter)."""

    def __init__(
        self,
        app: Any,
        max_bytes: int = DEFAULT_MAX_BODY_BYTES,
        on_refused: Callable[[int], None] = lambda status: None,
        idle_timeout_s: float = BODY_IDLE_TIMEOUT_S,
    ):
        self.app, self.max_bytes, self.on_refused = app, max_bytes, on_refused
        self.idle_timeout_s = idle_timeout_s

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            await self._gate(scope, receive, send)
        except _Stalled:
            await self._answer(
                send, 408, f"no part of the request body arrived for {self.idle_timeout_s:g} s"
            )

    async def _next(self, receive: Receive) -> Message:
        try:
            return await asyncio.wait_for(receive(), self.idle_timeout_s)
        except asyncio.TimeoutError:
            raise _Stalled from None

    async def _gate(self, scope: dict, receive: Receive, send: Send) -> None:
        headers = dict(scope.get("headers", ()))
        encoding = headers.get(b"content-encoding", b"identity").strip().lower()
        if encoding not in (b"", b"identity"):  # else the app would read gzip bytes as broken JSON
            await self._drain(receive)
            name = encoding.decode("latin-1")
            await self._answer(
                send, 415, f"Content-Encoding {name!r} is not supported: send the body uncompressed"
            )
            return
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            first, sending = None, True
        else:
            first, sending = await self._read(receive)
        if first is None:
            if sending:
                await self._drain(receive)
            await self._refuse(send)
            return
        pending = [first]

        async def replay() -> Message:
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)  # past the body: a stalled app is not the client's doing

    async def _read(self, receive: Receive) -> tuple[Message | None, bool]:
        """The whole body as one message (or the disconnect that cut it short), or None past the cap
        with whether the client is still sending."""
        chunks, size = [], 0
        while True:
            message = await self._next(receive)
            if message["type"] != "http.request":
                return message, False
            size += len(message.get("body", b""))
            more = message.get("more_body", False)
            if size > self.max_bytes:
                return None, more
            chunks.append(message.get("body", b""))
            if not more:
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}, False

    async def _drain(self, receive: Receive) -> None:
        """Read the rest of the body, keeping none of it."""
        while True:
            message = await self._next(receive)
            if message["type"] != "http.request" or not message.get("more_body", False):
                return

    async def _refuse(self, send: Send) -> None:
        mib = self.max_bytes / (1 << 20)
        await self._answer(send, 413, f"the request body is over this server's limit of {mib:g} MiB")

    async def _answer(self, send: Send, status: int, message: str) -> None:
        self.on_refused(status)
        body = json.dumps(error_body(message)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
