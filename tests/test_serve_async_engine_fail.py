"""A request whose own computation fails (here: its sampler raises) ends alone, and the engine thread
keeps no trace of it: its finished "error" event closes its stream, as a finished or aborted one does
(``test_serve_async_engine``). A failed request still counted in flight would be waited for at shutdown
and its queue kept for the server's life."""

from __future__ import annotations

import asyncio

import torch
from test_serve_async_engine import TINY_MODEL, WAIT_S, drain, llm, new_engine, request  # noqa: F401

import kvlens.engine.scheduler
from kvlens.engine.sampling import Sampler, SamplingParams
from kvlens.engine.scheduler import Request
from kvlens.serve.async_engine import AsyncEngine

FAULTY_SEED = 666


class FaultySampler(Sampler):
    def __call__(self, logits: torch.Tensor) -> int:
        if self.p.seed == FAULTY_SEED:
            raise RuntimeError("injected sampler fault")
        return super().__call__(logits)


def test_a_request_that_failed_alone_leaves_no_stream_behind(llm, monkeypatch):  # noqa: F811
    monkeypatch.setattr(kvlens.engine.scheduler, "Sampler", FaultySampler)

    async def run() -> None:
        ae = AsyncEngine(new_engine(llm))
        ae.start()
        try:
            bad = Request(
                "bad", request("bad").prompt_ids, 4, SamplingParams(temperature=1.0, seed=FAULTY_SEED)
            )
            streams = [await ae.add(bad), await ae.add(request("good"))]
            failed, served = [[t.event for t in await drain(s)] for s in streams]
            assert (failed[-1].finish_reason, str(failed[-1].error)) == ("error", "injected sampler fault")
            assert served[-1].finish_reason == "length" and len(served) == 4
            assert not ae._streams
            assert not ae._live
            assert ae.faults == 0  # one request's failure is not a fault of the engine's step
        finally:
            await ae.stop(timeout=WAIT_S)

    asyncio.run(run())
