"""Continuous batching over a paged KV block pool (the vLLM / nano-vllm design, for this engine).

Each :meth:`Engine.step`:

1. **decode**: every running sequence past its prompt feeds one token, all as ONE batch through the
   weights (:meth:`ModelRunner.decode`); a sequence that needs a new block and finds none free
   preempts the newest running sequence (its blocks are freed; it is recomputed later);
2. **prefill**: pending prompt chunks, oldest first, then newly admitted requests (admitted only when
   the blocks of their first chunk are free and fewer than ``max_batch`` run), up to
   ``prefill_token_budget`` tokens, spent in whole chunks (the first chunk of a step always runs).

Chunk rule (batch invariance of prefill): a prompt is cut at absolute multiples of the LLM's
``prefill_chunk`` — ``[0, c), [c, 2c), ...`` — exactly as :meth:`LLM.prefill` cuts it alone, and a
chunk holds one sequence's positions only. So a prompt's prefill is the same computation whether it
runs alone or interleaved with others, whatever the budget.

Recompute after preemption: the prompt is prefilled again by the same chunks, then the tokens it
had generated are fed again as decode rows (teacher-forced, not sampled), so its KV cache — and
everything after — is bit-identical to an uninterrupted run. Its sampler (and seed state) is kept.

A finished (stop id or max_tokens) or aborted request frees its blocks at once.

Prefix cache (``EngineConfig.prefix_cache``, :mod:`kvlens.engine.prefix_cache`): a request admitted
with an empty cache first takes the cached whole chunks its prompt starts with, and prefills from
there; every whole chunk it computes is published for later requests. The chunk rule above is what
makes a hit exact: it resumes at a chunk boundary, so every later chunk is the same computation.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..checks import check_bool, check_int, check_token_ids
from ..kv.cache import BLOCK, NonFiniteKVError
from ..kv.disk import DiskStats
from ..kv.modes import MODES
from ..kv.pool import BlockPool, PagedKV, kv_block_bytes, kv_bytes_per_token
from ..kv.stores import KVAllocationError
from .attention import check_backend_mode
from .budget import default_kv_budget
from .llm import LLM, ContextOverflowError
from .model_runner import ModelRunner
from .prefix_cache import PrefixCache
from .sampling import Sampler, SamplingParams
from .sequence import Request, Sequence, TokenEvent

log = logging.getLogger("kvlens.engine")


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound (HTTP: 429 with Retry-After)."""


@dataclass(frozen=True)
class EngineConfig:
    kv_budget_bytes: int | None = None  # None: a sensible share of free memory (engine.budget)
    max_batch: int = 16  # running sequences per step
    max_waiting: int = 64  # requests that may wait beyond the free running slots (then: QueueFullError)
    prefill_token_budget: int = 512  # prompt tokens prefilled per step (chunked prefill)
    prefix_cache: bool = False  # reuse cached whole prefill chunks of earlier prompts (exact)
    kv_disk: Path | str | None = None  # prefix cache: spill evicted blocks here, restore on a hit
    kv_disk_budget: int = 4 << 30  # bytes of block files kept under kv_disk (oldest deleted first)
    keep_logits: bool = False  # attach each sampled token's logits to its TokenEvent (tests, verify)

    def __post_init__(self) -> None:
        for name in ("max_batch", "prefill_token_budget", "kv_disk_budget"):
            check_int(getattr(self, name), name, minimum=1)
        check_int(self.max_waiting, "max_waiting", minimum=0)
        for name in ("prefix_cache", "keep_logits"):
            check_bool(getattr(self, name), name)
        if self.kv_budget_bytes is not None:
            check_int(self.kv_budget_bytes, "kv_budget_bytes", minimum=1)
        if self.kv_disk is not None and not isinstance(self.kv_disk, (str, os.PathLike)):
            raise TypeError(f"kv_disk must be a directory path or None, got {type(self.kv_disk).__name__}")
        if self.kv_disk is not None and not self.prefix_cache:
            raise ValueError("the KV disk tier holds prefix-cache blocks: it needs prefix_cache=True")


@dataclass
class EngineStats:
    blocks_total: int
    blocks_used: int
    block_size: int  # positions per block
    tokens_capacity: int  # blocks_total * block_size
    f16_tokens_same_bytes: int  # what an f16 cache would hold in the same bytes
    bytes_per_token: int  # of this engine's KV mode
    running: int
    waiting: int
    preemptions: int  # cumulative
    prompt_tokens: int
    generated_tokens: int  # cumulative counters
    prefix_hit_tokens: int = 0  # prompt tokens served from the prefix cache (memory or disk), cumulative
    prefix_evictions: int = 0  # cached blocks evicted from memory, cumulative
    prefix_cached_blocks: int = 0  # unreferenced cached blocks kept now
    disk: DiskStats | None = None  # the disk tier's counters (None: no disk tier)
    peak_running: int = 0  # high-water marks since the engine started: exact, where a poll of
    peak_blocks_used: int = 0  # running / blocks_used can miss a short burst


class Engine:
    """Continuous-batching engine over one :class:`LLM` (not thread-safe: drive it from one thread)."""

    def __init__(self, llm: LLM, config: EngineConfig = EngineConfig()) -> None:
        if not isinstance(llm, LLM):
            raise TypeError(f"Engine takes an LLM (kvlens.load), got {type(llm).__name__}")
        if not llm.servable:
            raise ValueError(
                "the serving engine runs dense decode over its paged pool, which implements neither sparse decode, "
                f"the lab's keep-sink / keep-recent options, nor a recipe's keep_sink over {BLOCK} positions"
            )
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        check_backend_mode(llm.attn_backend, llm.kv)  # before any request: not at its first step
        self.llm, self.config = llm, config
        cfg = llm.config
        budget = config.kv_budget_bytes or default_kv_budget(llm, config.max_batch)  # checked >= 1 or None
        pool_settings = (llm.kv, budget, llm.device, llm.cache_options.mirror_prefill)
        try:
            self.pool = BlockPool(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, *pool_settings)
        except KVAllocationError as e:  # the budget is more than this machine has free
            raise ValueError(f"cannot allocate a KV pool of {budget} bytes (kv_budget_bytes): {e}") from None
        self.runner = ModelRunner(llm)
        self.prefix = None
        if config.prefix_cache:
            model = f"{llm.loaded.file_sha256}|weights={llm.weights_mode}|{llm.device.type}"
            self.prefix = PrefixCache(
                self.pool, model, llm.prefill_chunk, config.kv_disk, config.kv_disk_budget
            )
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._events: list[TokenEvent] = []  # finishes without a step (aborts)
        self.preemptions = self.prompt_tokens = self.generated_tokens = self.peak_running = 0

    # -- requests -------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        self._check(req)
        # the bound is on requests that must wait: those the next step can admit (free running slots)
        # do not count, so a burst of up to max_batch requests on an idle engine is never refused
        free_slots = max(0, self.config.max_batch - len(self.running))
        if len(self.waiting) >= self.config.max_waiting + free_slots:
            raise QueueFullError(
                f"the waiting queue is full ({self.config.max_waiting} requests beyond the "
                f"{free_slots} free running slots)"
            )
        if req.sampling.temperature > 0 and req.sampling.seed is None:
            # every sampled request gets a recorded seed, so its output can be re-run (verify)
            req.sampling = replace(req.sampling, seed=secrets.randbits(63))
        stop = req.stop_ids if req.stop_ids is not None else frozenset(self.llm.tokenizer.eos_ids)
        seq = Sequence(req, PagedKV(self.pool), Sampler(req.sampling), frozenset(stop), list(req.prompt_ids))
        self.waiting.append(seq)
        self.prompt_tokens += seq.n_prompt

    def _check(self, req: Request) -> None:
        total = check_request(self.llm, req)
        if -(-total // BLOCK) > self.pool.n_blocks:
            raise ContextOverflowError(
                f"{total} tokens (prompt + max_tokens) can never fit in the KV pool "
                f"({self.pool.n_blocks * BLOCK} tokens)"
            )
        if any(s.req.request_id == req.request_id for s in (*self.waiting, *self.running)):
            raise ValueError(f"duplicate request_id {req.request_id!r}")

    def abort(self, request_id: str) -> None:
        """Cancel a request: its blocks are freed now, its final event comes with the next step."""
        for queue in (self.waiting, self.running):
            for seq in list(queue):
                if seq.req.request_id == request_id:
                    queue.remove(seq)
                    seq.kv.free()
                    self._events.append(TokenEvent(request_id, None, None, None, True, "abort"))
                    return

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._events)

    def stats(self) -> EngineStats:
        p, cfg = self.pool, self.llm.config
        f16_per_token = kv_bytes_per_token(MODES["f16"], cfg.n_layers, cfg.n_kv_heads, cfg.head_dim)
        return EngineStats(
            p.n_blocks, p.blocks_used, BLOCK, p.n_blocks * BLOCK, p.bytes_total // f16_per_token,
            p.bytes_per_token, len(self.running), len(self.waiting), self.preemptions,
            self.prompt_tokens, self.generated_tokens,
            *self._prefix_stats(), peak_running=self.peak_running, peak_blocks_used=p.peak_used,
        )  # fmt: skip

    def _prefix_stats(self) -> tuple:
        if self.prefix is None:
            return 0, 0, 0, None
        disk = self.prefix.disk
        stats = None
        if disk is not None:
            stats = replace(disk.stats, restore_seconds=disk.stats.restore_seconds.snapshot())
        index = self.prefix.index
        return self.prefix.stats.hit_tokens, index.evictions, self.pool.blocks_cached, stats

    # -- one step -------------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        events, self._events = self._events, []
        self._decode(events)
        self._prefill(events)
        return events

    def _reserve(self, seq: Sequence, end: int) -> bool:
        """Hold blocks for positions ``[0, end)`` of a running sequence, preempting the newest running
        sequences while the pool is short; False if ``seq`` itself had to go."""
        while seq.kv.blocks_needed(end) > self.pool.blocks_free:
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        seq.kv.grow(end)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.kv.free()
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def _decode(self, events: list[TokenEvent]) -> None:
        batch = []
        for seq in [s for s in self.running if not s.in_prefill]:
            if seq in self.running and self._reserve(seq, seq.kv.length + 1):
                batch.append(seq)
        batch = [s for s in batch if s in self.running]  # a later reservation may have preempted it
        if not batch:
            return
        self._decode_rows(batch, events)

    def _decode_rows(self, batch: list[Sequence], events: list[TokenEvent]) -> None:
        positions = [s.kv.length for s in batch]
        try:
            logits = self.runner.decode(
                [s.kv for s in batch], [s.tokens[p] for s, p in zip(batch, positions, strict=True)], positions
            )
        except Exception as e:  # one sequence's own computation: find it, the others go on
            if len(batch) == 1:
                return self._fail(batch[0], e, events)
            for seq, pos in zip(batch, positions, strict=True):
                seq.kv.length = pos  # rows before the failing one may have finished their step
                self._decode_rows([seq], events)  # alone: the same computation as its batch row
            return
        for b, seq in enumerate(batch):
            if seq.kv.length == len(seq.tokens):  # not a recompute replay: sample the next token
                self._emit(seq, logits[b], events)

    def _prefill(self, events: list[TokenEvent]) -> None:
        chunk, budget = self.llm.prefill_chunk, self.config.prefill_token_budget
        spent = 0
        for seq in [s for s in self.running if s.in_prefill]:
            start, end = seq.next_chunk(chunk)
            if spent and spent + end - start > budget:
                return
            if seq in self.running and self._reserve(seq, end):
                self._run_chunk(seq, start, end, events)
                spent += end - start
        while self.waiting and len(self.running) < self.config.max_batch and spent < budget:
            seq = self.waiting[0]
            self._reuse_prefix(seq)
            start, end = seq.next_chunk(chunk)
            if (spent and spent + end - start > budget) or seq.kv.blocks_needed(end) > self.pool.blocks_free:
                seq.kv.free()  # cached blocks it took stay cached; taken again next time
                return
            self.waiting.popleft()
            self.running.append(seq)
            self.peak_running = max(self.peak_running, len(self.running))
            if seq.cached_tokens is None:  # first admission (not a recompute): what it reused
                seq.cached_tokens = seq.kv.length
                if self.prefix is not None:
                    self.prefix.stats.hit_tokens += seq.kv.length
            seq.kv.grow(end)
            self._run_chunk(seq, start, end, events)
            spent += end - start

    def _reuse_prefix(self, seq: Sequence) -> None:
        if self.prefix is None or seq.kv.blocks:
            return
        self.prefix.acquire(seq.kv, seq.req.prompt_ids)

    def _run_chunk(self, seq: Sequence, start: int, end: int, events: list[TokenEvent]) -> None:
        try:
            logits = self.runner.prefill(seq.kv, seq.tokens[start:end], start)
        except Exception as e:  # a chunk is one sequence's: it alone ends
            return self._fail(seq, e, events)
        if self.prefix is not None:
            self.prefix.publish(seq.kv, seq.req.prompt_ids, start, end)
        if end == len(seq.tokens):  # the prompt is in and nothing was generated yet
            self._emit(seq, logits, events)

    def _fail(self, seq: Sequence, error: Exception, events: list[TokenEvent]) -> None:
        """End ``seq`` alone: its own computation failed (a non-finite K/V, or a fault while its rows
        ran), no other sequence's did. Only its own blocks were written, and they are freed."""
        if not isinstance(error, NonFiniteKVError):  # not the input's doing: keep the traceback
            log.error("request %s failed while it ran", seq.req.request_id, exc_info=error)
        self.running.remove(seq)
        seq.kv.free()
        events.append(TokenEvent(seq.req.request_id, None, None, None, True, "error", error=error))

    def _emit(self, seq: Sequence, logits: torch.Tensor, events: list[TokenEvent]) -> None:
        req = seq.req
        try:
            tok = seq.sampler(logits)
        except Exception as e:  # the sampler runs on this sequence's logits alone: it alone ends
            return self._fail(seq, e, events)
        seq.tokens.append(tok)
        self.generated_tokens += 1
        logprob = top = None
        if req.logprobs is not None:
            lp = torch.log_softmax(logits.float(), dim=-1)
            logprob = float(lp[tok])
            if req.logprobs:
                vals, idx = torch.topk(lp, min(req.logprobs, lp.numel()))
                top = [(int(i), float(v)) for i, v in zip(idx.tolist(), vals.tolist(), strict=True)]
            else:
                top = []
        reason = "stop" if tok in seq.stop_ids else "length" if seq.n_generated >= req.max_tokens else None
        if reason is not None:
            self.running.remove(seq)
            seq.kv.free()
        kept = logits.clone() if self.config.keep_logits else None
        cached = (seq.cached_tokens or 0) if seq.n_generated == 1 else 0
        events.append(TokenEvent(req.request_id, tok, logprob, top, reason is not None, reason, kept, cached))


def check_request(llm: LLM, req: Request) -> int:
    """``req``'s fields checked against ``llm`` (its prompt ids put in canonical form); the positions it
    needs (prompt + max_tokens), which must fit in the model's context."""
    if not isinstance(req, Request):
        raise TypeError(f"add_request takes a Request, got {type(req).__name__}")
    if not isinstance(req.request_id, str):  # events, aborts and records are keyed by it
        raise TypeError(f"request_id must be a str, got {type(req.request_id).__name__}")
    req.prompt_ids = check_token_ids(req.prompt_ids, llm.config.vocab, "prompt token ids", allow_empty=True)
    if not req.prompt_ids:
        raise ValueError("the prompt is empty")
    check_int(req.max_tokens, "max_tokens", minimum=1)
    if req.logprobs is not None:
        check_int(req.logprobs, "logprobs", minimum=0)
    if not isinstance(req.sampling, SamplingParams):
        raise TypeError(f"sampling must be a SamplingParams, got {type(req.sampling).__name__}")
    if req.stop_ids is not None:  # a string was a set of characters: it never stopped
        if not isinstance(req.stop_ids, (set, frozenset, list, tuple)):
            raise TypeError(f"stop_ids must be a set of token ids or None, got {type(req.stop_ids).__name__}")
        req.stop_ids = frozenset(
            check_token_ids(list(req.stop_ids), llm.config.vocab, "stop_ids", allow_empty=True)
        )
    total = len(req.prompt_ids) + req.max_tokens
    try:
        llm.check_fits(total)
    except ContextOverflowError as e:  # name both parts: either may be what is too long
        raise ContextOverflowError(
            f"prompt {len(req.prompt_ids)} + max_tokens {req.max_tokens} = {e}"
        ) from None
    return total


def fitted_config(llm: LLM, reqs: list[Request], **changes) -> EngineConfig:
    """A config whose pool holds every request whole at once (no preemption); each request checked
    first, so a bad one is named rather than sizing the pool."""
    blocks = sum(-(-check_request(llm, r) // BLOCK) for r in reqs)
    cfg = llm.config
    return EngineConfig(
        kv_budget_bytes=blocks * kv_block_bytes(llm.kv, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim), **changes
    )


def _run_out(engine: Engine) -> Iterator[TokenEvent]:
    """Every event until nothing is left to run; a request's own failure is raised, not passed on."""
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.error is not None:
                raise ev.error
            yield ev


def run_alone(llm: LLM, req: Request, config: EngineConfig | None = None) -> Iterator[TokenEvent]:
    """Events of one request run alone (a batch of one): what ``kvlens generate`` runs. The engine and
    the request are checked here, before the first event is asked for (not a generator itself)."""
    engine = Engine(llm, config or fitted_config(llm, [req], max_batch=1))
    engine.add_request(req)
    return _run_out(engine)


def run_batch(llm: LLM, reqs: list[Request], config: EngineConfig | None = None) -> dict[str, list[int]]:
    """Generated token ids of every request, run together; ``{request_id: ids}``."""
    if not reqs:
        return {}
    config = config or fitted_config(llm, reqs, max_batch=min(len(reqs), 16), max_waiting=len(reqs))
    engine = Engine(llm, config)
    out: dict[str, list[int]] = {}
    for req in reqs:
        engine.add_request(req)
        out[req.request_id] = []
    for ev in _run_out(engine):
        if ev.token_id is not None:
            out[ev.request_id].append(ev.token_id)
    return out
