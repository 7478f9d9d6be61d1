"""The engine thread behind the HTTP server (serve/async_engine.py), driven directly from asyncio with
a real engine over a tiny model: what the HTTP tests reach only through timing, here made certain.

Every wait is bounded (``asyncio.wait_for``), so a request the thread never answers fails the test
instead of hanging it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator

import pytest
from engine_loop import steps_until_done
from test_prefix_cache import engine_bytes_per_token

import kvlens
from kvlens.engine.scheduler import Engine, EngineConfig, Request
from kvlens.kv.cache import BLOCK
from kvlens.serve.async_engine import AsyncEngine

TINY_MODEL = ("llama", 5)  # conftest's tiny_dir
WAIT_S = 30.0


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return kvlens.load(tiny_dir, kv="q8", attn_backend="numba")


def new_engine(llm) -> Engine:
    return Engine(llm, EngineConfig(kv_budget_bytes=16 * BLOCK * engine_bytes_per_token(llm), max_batch=4))


@contextlib.asynccontextmanager
async def running(engine: Engine) -> AsyncIterator[AsyncEngine]:
    """An ``AsyncEngine`` over ``engine`` with its thread started; stopped (bounded) on the way out."""
    ae = AsyncEngine(engine)
    ae.start()
    try:
        yield ae
    finally:
        await ae.stop(timeout=WAIT_S)


def request(rid: str, n: int = 4) -> Request:
    return Request(rid, [5, 17, 200, 33, 41, 9], n, stop_ids=frozenset())


async def drain(events: asyncio.Queue) -> list:
    """A request's events up to its finished one."""
    out = []
    while not out or not out[-1].event.finished:
        out.append(await asyncio.wait_for(events.get(), WAIT_S))
    return out


def test_a_request_after_the_thread_stopped_is_refused(llm):
    """Once the engine thread has stopped, ``add`` raises at once; it does not wait for a thread
    that will never admit it."""

    async def run() -> None:
        ae = AsyncEngine(new_engine(llm))
        ae.start()
        await ae.stop(timeout=WAIT_S)
        assert not ae.alive
        with pytest.raises(RuntimeError, match="not running"):
            await asyncio.wait_for(ae.add(request("late")), WAIT_S)

    asyncio.run(run())


def test_finished_and_aborted_requests_leave_no_stream_behind(llm):
    """A server runs for weeks: neither the event-loop side's per-request queues (``_streams``) nor
    the thread's ids in flight (``_live``, which a fault or a stop ends) keep a request that finished
    or was aborted."""

    async def run() -> None:
        async with running(new_engine(llm)) as ae:
            # r1 is long, so the abort finds it running (not already finished)
            streams = [await ae.add(request(f"r{i}", n=200 if i == 1 else 4)) for i in range(3)]
            ae.abort("r1")
            for i in (0, 2):
                assert (await drain(streams[i]))[-1].event.finish_reason == "length"
            assert not ae._streams
            assert not ae._live  # updated before the events were handed over

    asyncio.run(run())


def test_a_caller_gone_before_admission_leaves_the_loop_clean(llm):
    """The caller is cancelled while ``add`` waits for the engine thread to admit its request: the
    thread's answer then finds the future cancelled and drops it (no error in the event loop), and
    the engine drops the request."""

    async def run() -> list:
        loop = asyncio.get_running_loop()
        errors: list = []
        loop.set_exception_handler(lambda _, context: errors.append(context))
        async with running(new_engine(llm)) as ae:
            task = asyncio.create_task(ae.add(request("gone")))
            await asyncio.sleep(0)  # ``add`` posts the request and waits; the answer is not in yet
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(300):  # bounded: the thread drops the request and publishes its stats
                stats = ae.stats()
                if stats.running == stats.waiting == 0 and ae._inbox.empty():
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)  # the thread's last callbacks run
        return errors

    assert asyncio.run(run()) == []


def test_a_fault_in_a_step_ends_the_requests_in_flight_and_the_thread_serves_on(llm):
    """``Engine.step`` raising (a fault of the scheduler's, not of one request): every request in
    flight gets a finished event with reason "error", their blocks are freed, the fault is counted,
    and the next request is served as if nothing happened."""
    engine = new_engine(llm)
    step, calls = engine.step, []

    def failing_step():
        # the first step with both requests in (the thread may step the first alone a few times before
        # the second is posted: a fault at a fixed step count raced with it on a busy machine)
        if not calls and len(engine.running) + len(engine.waiting) == 2:
            calls.append(1)
            raise RuntimeError("planted fault")
        return step()

    engine.step = failing_step

    async def run() -> tuple[list, list, int]:
        async with running(engine) as ae:
            # 200 tokens: the first cannot end before the second is in, however slowly it is posted
            streams = [await ae.add(request(f"r{i}", n=200)) for i in range(2)]
            ended = [(await drain(s))[-1].event.finish_reason for s in streams]
            stats = ae.stats()
            assert (stats.running, stats.waiting, stats.blocks_used) == (0, 0, 0)
            after = [t.event.token_id for t in await drain(await ae.add(request("after")))]
            return ended, after, ae.faults

    ended, after, faults = asyncio.run(run())
    assert ended == ["error", "error"] and faults == 1
    alone = new_engine(llm)
    alone.add_request(request("after"))
    want = []
    for _ in steps_until_done(alone):
        want += [e.token_id for e in alone.step()]
    assert after == want


def test_stopping_ends_the_requests_in_flight_as_aborted(llm):
    """``stop`` with requests still running: each gets a finished event with reason "abort" and the
    pool is empty when the thread ends."""
    engine = new_engine(llm)

    async def run() -> list:
        ae = AsyncEngine(engine)
        ae.start()
        streams = [await ae.add(request(f"r{i}", n=200)) for i in range(2)]
        await ae.stop(timeout=WAIT_S)
        return [(await drain(s))[-1].event.finish_reason for s in streams]

    assert asyncio.run(run()) == ["abort", "abort"]
    stats = engine.stats()
    assert (stats.running, stats.waiting, stats.blocks_used) == (0, 0, 0)


def test_the_stats_show_an_admitted_request_before_its_first_step_ends(llm):
    """/metrics reads the snapshot the thread publishes: a request admitted while a step is still
    running (here held until the snapshot is checked) is counted as waiting at once, not only after
    the step."""
    engine = new_engine(llm)
    step, release = engine.step, threading.Event()

    def held_step():
        release.wait(WAIT_S)
        return step()

    engine.step = held_step

    async def run() -> int:
        ae = AsyncEngine(engine)
        ae.start()
        try:
            events = await ae.add(request("r"))
            for _ in range(500):  # bounded: the snapshot taken after the inbox changed
                if ae.stats().waiting == 1:
                    break
                await asyncio.sleep(0.01)
            seen = ae.stats().waiting
            release.set()
            await drain(events)
            return seen
        finally:
            release.set()
            await ae.stop(timeout=WAIT_S)

    assert asyncio.run(run()) == 1
