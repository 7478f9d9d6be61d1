"""Next-token choice: greedy by default; temperature, top-k and top-p when asked."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checks import check_float, check_int


@dataclass(frozen=True)
class SamplingParams:
    """Checked once, when built, and frozen (a field set later would reach the sampler unchecked;
    ``dataclasses.replace`` builds a checked copy)."""

    temperature: float = 0.0  # 0 → greedy
    top_k: int = 0  # 0 → no limit
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        checked = {
            "temperature": check_float(self.temperature, "temperature", minimum=0.0),
            "top_p": check_float(self.top_p, "top_p", above=0.0, maximum=1.0),
            "top_k": check_int(self.top_k, "top_k", minimum=0),
        }
        if self.seed is not None:
            checked["seed"] = check_int(self.seed, "seed", minimum=-(2**63), maximum=2**64 - 1)
        for name, value in checked.items():
            object.__setattr__(self, name, value)


class Sampler:
    def __init__(self, params: SamplingParams) -> None:
        self.p = params
        self.gen = torch.Generator()
        if params.seed is not None:
            self.gen.manual_seed(params.seed)
        else:
            self.gen.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        """Pick the next token from the logits [vocab] of the last position."""
        if self.p.temperature == 0:
            return int(torch.argmax(logits))
        # float64, the max subtracted first: a tiny temperature (down to 5e-324) sends every other
        # logit to -inf instead of the largest to inf (softmax would then be nan)
        logits = logits.double().cpu()
        logits = (logits - logits.max()) / self.p.temperature
        if self.p.top_k:
            kth = torch.topk(logits, min(self.p.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if self.p.top_p < 1:
            sorted_p, idx = torch.sort(probs, descending=True)
            # keep the smallest prefix whose mass reaches top_p (the first token always stays)
            drop = (sorted_p.cumsum(0) - sorted_p) >= self.p.top_p
            sorted_p[drop] = 0
            probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
        return int(torch.multinomial(probs / probs.sum(), 1, generator=self.gen))
