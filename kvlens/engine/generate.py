"""``kvlens generate``: load a model and stream a continuation of the prompt to stdout."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from ..checks import check_counts, check_device, check_field_types, check_finite_fields, check_text
from ..kv.blocks import SparseConfig
from ..kv.modes import CacheOptions, KVMode
from ..models.loader import check_weights_mode
from .attention import check_backend_mode, check_backend_name
from .llm import DEFAULT_PREFILL_CHUNK
from .sampling import SamplingParams


@dataclass
class GenerateConfig:
    prompt: str
    model: str = "smollm2"
    kv: str = "q8"
    max_tokens: int = 64
    chat: bool = False
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    attn_backend: str = "auto"
    mirror_prefill: str = "exact"
    device: str | None = None
    weights: str = "auto"
    sparse: SparseConfig | None = None

    def __post_init__(self) -> None:  # the CLI's parse-time ranges, before the model loads
        check_field_types(self)
        check_counts(self, "max_tokens", "prefill_chunk")
        check_counts(self, "top_k", minimum=0)
        check_finite_fields(self, "temperature", minimum=0.0)
        check_finite_fields(self, "top_p", above=0.0, maximum=1.0)
        if not check_text(self.prompt):
            raise ValueError("the prompt is empty")
        KVMode.parse(self.kv)
        check_backend_name(self.attn_backend)
        CacheOptions(mirror_prefill=self.mirror_prefill)
        if self.device is not None:
            check_device(self.device)
        self.sampling  # noqa: B018 - the seed's range, checked before the model loads
        check_weights_mode(self.weights)

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed
        )


def main(cfg: GenerateConfig) -> str:
    """The body of ``kvlens generate``: the text streams to stdout as it is produced; nothing is printed
    before the prompt is known to fit and the backend to read the cache."""
    import kvlens  # the public entry point (tests stand in for it)

    llm = kvlens.load(
        cfg.model,
        kv=cfg.kv,
        device=cfg.device,
        attn_backend=cfg.attn_backend,
        cache_options=CacheOptions(mirror_prefill=cfg.mirror_prefill),
        prefill_chunk=cfg.prefill_chunk,
        weights=cfg.weights,
        sparse=cfg.sparse,
    )
    params = cfg.sampling
    llm.check_fits(len(llm.encode_prompt(cfg.prompt, cfg.chat)) + cfg.max_tokens)
    check_backend_mode(llm.attn_backend, llm.kv)  # what the engine checks, before the prompt is echoed
    if not cfg.chat:
        sys.stdout.write(cfg.prompt)
        sys.stdout.flush()
    text = llm.generate(
        cfg.prompt,
        cfg.max_tokens,
        chat=cfg.chat,
        sampling=params,
        on_text=lambda s: (sys.stdout.write(s), sys.stdout.flush()),
    )
    sys.stdout.write("\n")
    return text
