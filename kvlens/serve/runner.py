"""One HTTP request's life in the engine: admission, token events to text, stop strings, the
verifiable record, metrics and the per-request log line."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from ..engine.llm import LLM, ContextOverflowError
from ..engine.sampling import SamplingParams
from ..engine.serving import QueueFullError, Request
from ..engine.verify import make_record
from .async_engine import AsyncEngine, Timed
from .metrics import ServeMetrics
from .output import OutputText
from .protocol import APIError

log = logging.getLogger("kvlens.serve")


class EngineFault(RuntimeError):
    """The engine failed while running this request (logged with its traceback)."""


@dataclass
class Job:
    """An admitted request and what it has produced so far."""

    endpoint: str
    request: Request
    out: OutputText
    events: asyncio.Queue[Timed]
    arrived: float  # time.perf_counter() when the HTTP request was accepted
    finish_reason: str | None = None
    cached_tokens: int = 0  # prompt tokens the prefix cache served (from the first token's event)
    first_at: float | None = None
    last_at: float | None = None
    record: dict[str, Any] | None = field(default=None, repr=False)

    @property
    def rid(self) -> str:
        return self.request.request_id

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.out.token_ids)


class Runner:
    """Turns validated requests into engine requests and their events into text."""

    def __init__(self, llm: LLM, engine: AsyncEngine, metrics: ServeMetrics, retry_after_s: int = 1) -> None:
        self.llm, self.engine, self.metrics = llm, engine, metrics
        self.retry_after_s = retry_after_s

    async def submit(
        self,
        endpoint: str,
        rid: str,
        prompt_ids: list[int],
        max_tokens: int | None,
        body: Any,
        logprobs: int | None,
    ) -> Job:
        """Admit a request to the engine; 400 for what the engine refuses (empty or over-long prompt,
        ids outside the vocabulary, more tokens than the pool holds), 429 when its queue is full."""
        arrived = time.perf_counter()
        if max_tokens is None:  # OpenAI: as many as fit
            room = min(self.llm.config.max_ctx, self.engine.stats().tokens_capacity) - len(prompt_ids)
            max_tokens = max(1, room)
        # a sampled request without a seed gets one from the engine, recorded for verify
        sampling = SamplingParams(temperature=body.temperature, top_p=body.top_p, seed=body.seed)
        stop_ids = frozenset() if body.ignore_eos else None  # None: the tokenizer's EOS ids
        req = Request(rid, list(prompt_ids), max_tokens, sampling, stop_ids, logprobs)
        try:
            events = await self.engine.add(req)
        except QueueFullError as e:
            raise APIError(
                429,
                f"the server is busy ({e}); retry later",
                "rate_limit_error",
                "rate_limit_exceeded",
                headers={"Retry-After": str(self.retry_after_s)},
            ) from e
        except ValueError as e:
            raise APIError(400, str(e), param=self._refused_field(e, endpoint, len(prompt_ids), body)) from e
        out = OutputText(self.llm.tokenizer, body.stop_strings)
        return Job(endpoint, req, out, events, arrived)

    def _refused_field(self, error: ValueError, endpoint: str, n_prompt: int, body: Any) -> str:
        """The field a refusal is about: the token limit where prompt + limit do not fit but the prompt
        alone does, else the prompt (ids outside the vocabulary, a prompt too long by itself)."""
        prompt = "messages" if endpoint == "chat" else "prompt"
        room = min(self.llm.config.max_ctx, self.engine.stats().tokens_capacity)
        if not isinstance(error, ContextOverflowError) or n_prompt >= room:
            return prompt
        return "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"

    async def run(self, job: Job) -> AsyncIterator[str]:
        """Text deltas as they become final; ``job.finish_reason`` and ``job.record`` set at the end.

        Leaving early (client gone, task cancelled) aborts the request: its blocks are freed.
        """
        try:
            while job.finish_reason is None:
                timed = await job.events.get()
                ev = timed.event
                if ev.finish_reason == "error":
                    job.finish_reason = "error"
                    why = f": {ev.error}" if ev.error is not None else ""
                    raise EngineFault(f"the engine failed while running request {job.rid}{why}")
                delta = ""
                if ev.token_id is not None:
                    if job.first_at is None:
                        job.cached_tokens = ev.cached_tokens
                    self._observe(job, timed.at)
                    is_stop = ev.finished and ev.finish_reason == "stop"
                    delta = job.out.push(ev.token_id, ev.logprob, ev.top_logprobs, is_stop)
                if job.out.stopped and not ev.finished:  # a stop string: end it here
                    self.engine.abort(job.rid)
                    job.finish_reason = "stop"
                elif ev.finished:
                    job.finish_reason = "stop" if job.out.stopped else ev.finish_reason
                if job.finish_reason is not None:
                    delta += job.out.finish()
                    job.record = self._record(job)
                if delta:
                    yield delta
        finally:
            if job.finish_reason is None:
                self.engine.abort(job.rid)
                job.finish_reason = "cancelled"
            self._done(job)

    async def collect(self, job: Job, disconnected: Any) -> str:
        """Run to the end (non-streamed); ``disconnected()`` is polled so a gone client frees its blocks."""
        pieces: list[str] = []

        async def consume() -> None:
            async for piece in self.run(job):
                pieces.append(piece)

        task = asyncio.ensure_future(consume())
        while not task.done():
            await asyncio.wait({task}, timeout=1.0)
            if not task.done() and await disconnected():
                task.cancel()
        await task  # re-raises EngineFault / CancelledError
        return "".join(pieces)

    def _record(self, job: Job) -> dict[str, Any]:
        req = job.request
        if job.out.stopped:  # cut by a stop string: a re-run of exactly this many tokens reproduces it
            req = replace(req, max_tokens=job.completion_tokens)
        return make_record(self.llm, req, list(job.out.token_ids))

    def _observe(self, job: Job, at: float) -> None:
        if job.first_at is None:
            job.first_at = at
            self.metrics.ttft.observe(max(0.0, at - job.arrived))
        else:
            self.metrics.itl.observe(max(0.0, at - (job.last_at or at)))
        job.last_at = at

    def _done(self, job: Job) -> None:
        self.metrics.requests.labels(job.endpoint, job.finish_reason).inc()
        ttft = (job.first_at - job.arrived) if job.first_at else float("nan")
        decode_s = (job.last_at or 0.0) - (job.first_at or 0.0)
        rate = (job.completion_tokens - 1) / decode_s if decode_s > 0 else float("nan")
        log.info(
            "%s %s prompt=%d cached=%d output=%d ttft=%.3fs decode=%.1f tok/s finish=%s",
            job.rid,
            job.endpoint,
            job.prompt_tokens,
            job.cached_tokens,
            job.completion_tokens,
            ttft,
            rate,
            job.finish_reason,
        )
