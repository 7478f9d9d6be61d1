"""The engine behind an asyncio server: one dedicated thread loops ``Engine.step()``.

``Engine`` is not thread-safe, so only its own thread touches it. Requests to add or abort go
through a thread-safe inbox drained between steps; each step's token events (and a stats
snapshot) are handed to the event loop with ``call_soon_threadsafe`` and routed to per-request
asyncio queues. A request whose own computation fails is ended alone by the engine itself; any
other fault inside ``step()`` (the scheduler's bookkeeping) ends the requests in flight with
``finish_reason "error"`` and frees their blocks; the thread keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass

from ..engine.serving import Engine, EngineStats, Request, TokenEvent

log = logging.getLogger("kvlens.serve")


@dataclass
class Timed:
    """A token event and when its step ended (``time.perf_counter()``)."""

    event: TokenEvent
    at: float


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._inbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, asyncio.Queue[Timed]] = {}  # event-loop side only
        self._live: set[str] = set()  # engine-thread side only: ids the engine holds
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stats: EngineStats = engine.stats()
        self.faults = 0  # steps that raised

    # -- event-loop side ----------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvlens-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stats(self) -> EngineStats:
        """The snapshot taken after the engine's latest step (or inbox change)."""
        return self._stats

    async def add(self, req: Request) -> asyncio.Queue[Timed]:
        """Admit a request; its events arrive on the returned queue, the last one ``finished``.

        Raises what ``Engine.add_request`` raises (ValueError, QueueFullError).
        """
        if not self.alive:
            raise RuntimeError("the engine is not running")
        assert self._loop is not None
        events: asyncio.Queue[Timed] = asyncio.Queue()
        self._streams[req.request_id] = events
        admitted = self._loop.create_future()
        self._post(("add", req, admitted))
        try:
            await admitted
        except BaseException:  # refused, or the caller went away while waiting: the engine drops it
            self._streams.pop(req.request_id, None)
            self._post(("abort", req.request_id, None))
            raise
        return events

    def abort(self, request_id: str) -> None:
        """Cancel a request (no-op if it already finished); its blocks are freed on the next turn."""
        if self._streams.pop(request_id, None) is not None:
            self._post(("abort", request_id, None))

    async def stop(self, timeout: float = 30.0) -> None:
        """Abort whatever is still running and end the engine thread."""
        if self._thread is None:
            return
        self._post(("stop", None, None))
        await asyncio.to_thread(self._thread.join, timeout)

    def _post(self, item: tuple) -> None:
        self._inbox.put(item)
        self._wake.set()

    def _deliver(self, events: list[TokenEvent], at: float, stats: EngineStats) -> None:
        self._stats = stats
        for ev in events:
            q = self._streams.get(ev.request_id)
            if q is None:
                continue  # aborted by the client meanwhile
            q.put_nowait(Timed(ev, at))
            if ev.finished:
                del self._streams[ev.request_id]

    def _settle(self, future: asyncio.Future, error: BaseException | None) -> None:
        if future.cancelled():
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    # -- engine-thread side -------------------------------------------------------------------
    def _publish(self, events: list[TokenEvent]) -> None:
        assert self._loop is not None
        for ev in events:
            if ev.finished:
                self._live.discard(ev.request_id)
        stats = self._engine.stats()
        try:
            self._loop.call_soon_threadsafe(self._deliver, events, time.perf_counter(), stats)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _drain(self) -> bool:
        """Apply the inbox; False once a stop was asked."""
        assert self._loop is not None
        changed, running = False, True
        while True:
            try:
                kind, payload, future = self._inbox.get_nowait()
            except queue.Empty:
                break
            changed = True
            if kind == "add":
                error: BaseException | None = None
                try:
                    self._engine.add_request(payload)
                    self._live.add(payload.request_id)
                except Exception as e:  # ValueError / QueueFullError: the caller's answer
                    error = e
                self._loop.call_soon_threadsafe(self._settle, future, error)
            elif kind == "abort":
                self._engine.abort(payload)
                self._live.discard(payload)
            else:
                running = False
        if changed:
            self._publish([])
        return running

    def _abort_all(self, reason: str) -> None:
        ids = sorted(self._live)
        for rid in ids:
            self._engine.abort(rid)
        self._live.clear()
        self._publish([TokenEvent(rid, None, None, None, True, reason) for rid in ids])

    def _run(self) -> None:
        while self._drain():
            if not self._engine.has_unfinished():
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                events = self._engine.step()
            except Exception:
                self.faults += 1
                log.exception("engine step failed; ending the %d requests in flight", len(self._live))
                self._abort_all("error")
                continue
            self._publish(events)
        self._abort_all("abort")
