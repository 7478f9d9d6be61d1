"""A request, the events it yields, and the scheduler's record of it while it runs (a sequence)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..kv.pool import PagedKV
from .sampling import Sampler, SamplingParams


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_ids: frozenset[int] | None = None  # None: the tokenizer's EOS ids
    logprobs: int | None = None  # None: no logprobs; N >= 0: chosen token's logprob + top-N


@dataclass
class TokenEvent:
    request_id: str
    token_id: int | None  # None only for a finish without a new token (abort)
    logprob: float | None  # log-softmax of the chosen token (temperature-free logits)
    top_logprobs: list[tuple[int, float]] | None
    finished: bool
    finish_reason: str | None  # "stop" (a stop id; the stop token IS reported), "length", "abort", "error"
    logits: torch.Tensor | None = field(default=None, repr=False)  # with EngineConfig.keep_logits
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache (set on the first token's event)
    error: Exception | None = None  # finish_reason "error": what failed in this request's own computation


@dataclass
class Sequence:
    req: Request
    kv: PagedKV
    sampler: Sampler
    stop_ids: frozenset[int]
    tokens: list[int]  # prompt, then the generated tokens
    cached_tokens: int | None = None  # prefix-cache hit at first admission

    @property
    def n_prompt(self) -> int:
        return len(self.req.prompt_ids)

    @property
    def n_generated(self) -> int:
        return len(self.tokens) - self.n_prompt

    @property
    def in_prefill(self) -> bool:
        return self.kv.length < self.n_prompt

    def next_chunk(self, chunk: int) -> tuple[int, int]:
        """The next prefill chunk ``[start, end)``: up to the next absolute multiple of ``chunk``."""
        start = self.kv.length
        return start, min(self.n_prompt, (start // chunk + 1) * chunk)
