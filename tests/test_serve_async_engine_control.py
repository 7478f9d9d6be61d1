"""The engine thread's controls with its steps held (serve/async_engine.py): an abort reaches the engine
between steps, ``stop`` waits no longer than its timeout for a thread stuck in a step, stopping an engine
never started does nothing, and the thread is a daemon that cannot keep a dying server's process alive.
The forty-second session's mutation run found each unasserted: the one abort test let the aborted
request run to its end, which on a fast machine came before the check (docs/testing.md, "Mutation
testing of the HTTP service")."""

from __future__ import annotations

import asyncio
import threading

from test_serve_async_engine import TINY_MODEL, WAIT_S, llm, new_engine, request, running  # noqa: F401
from test_serve_wire import GatedStep

from kvlens.engine.scheduler import Engine, EngineConfig, QueueFullError
from kvlens.serve.async_engine import AsyncEngine


async def until(condition, what: str) -> None:
    """Poll ``condition`` (the event loop runs meanwhile); AssertionError after WAIT_S."""
    for _ in range(int(WAIT_S / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


def test_an_abort_reaches_the_engine_while_no_step_runs(llm):  # noqa: F811
    engine = new_engine(llm)
    GatedStep(engine)  # never opened: the thread takes in the abort between empty steps

    async def run() -> None:
        async with running(engine) as ae:
            await ae.add(request("r1", n=200))
            await until(lambda: ae.stats().waiting + ae.stats().running == 1, "r1 admitted")
            ae.abort("r1")
            await until(lambda: ae.stats().waiting + ae.stats().running == 0, "r1 gone from the engine")

    asyncio.run(run())


def test_a_refused_request_leaves_no_stream_behind(llm):  # noqa: F811
    """The queue is full (one slot, no waiting room, the first request held there): the second is
    refused, and its per-request queue is not kept for the server's life."""
    engine = Engine(
        llm, EngineConfig(kv_budget_bytes=new_engine(llm).config.kv_budget_bytes, max_batch=1, max_waiting=0)
    )
    GatedStep(engine)  # never opened: r1 holds the only slot

    async def run() -> None:
        async with running(engine) as ae:
            await ae.add(request("r1", n=4))
            try:
                await ae.add(request("r2", n=4))
            except QueueFullError:
                pass
            else:
                raise AssertionError("the second request was admitted")
            assert list(ae._streams) == ["r1"]

    asyncio.run(run())


class StuckStep:
    """``Engine.step`` that blocks until ``release`` (or WAIT_S), saying when it has begun."""

    def __init__(self, engine) -> None:
        self.begun, self.release, self._step = threading.Event(), threading.Event(), engine.step
        engine.step = self

    def __call__(self):
        self.begun.set()
        self.release.wait(WAIT_S)
        return self._step()


def test_stop_waits_no_longer_than_its_timeout_for_a_stuck_step(llm):  # noqa: F811
    engine = new_engine(llm)
    stuck = StuckStep(engine)

    async def run() -> bool:
        ae = AsyncEngine(engine)
        ae.start()
        await ae.add(request("r1", n=4))
        assert await asyncio.to_thread(stuck.begun.wait, WAIT_S)
        await ae.stop(timeout=0.2)
        still_stepping = ae.alive  # stop returned while the step is still stuck
        stuck.release.set()
        await ae.stop(timeout=WAIT_S)
        assert not ae.alive
        return still_stepping

    assert asyncio.run(run())


def test_stopping_an_engine_never_started_does_nothing(llm):  # noqa: F811
    ae = AsyncEngine(new_engine(llm))
    assert not ae.alive
    asyncio.run(ae.stop(timeout=WAIT_S))
    assert not ae.alive


def test_the_engine_thread_is_a_daemon(llm):  # noqa: F811
    async def run() -> list[threading.Thread]:
        before = set(threading.enumerate())
        async with running(new_engine(llm)):
            return [t for t in threading.enumerate() if t not in before]

    (thread,) = asyncio.run(run())
    assert thread.daemon and thread.name == "kvlens-engine"


def test_an_abort_after_the_request_finished_does_nothing(llm):  # noqa: F811
    """A stop string can end a request on one of its tokens while its finished event is already
    delivered (its stream gone): the abort the runner then sends must be a no-op, as for any unknown id."""

    async def run() -> None:
        async with running(new_engine(llm)) as ae:
            events = await ae.add(request("r1", n=2))
            while not (await asyncio.wait_for(events.get(), WAIT_S)).event.finished:
                pass
            ae.abort("r1")
            ae.abort("never-sent")
            assert not ae._streams and ae.alive

    asyncio.run(run())
