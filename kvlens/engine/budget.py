"""The default KV budget of a serving engine: a share of free memory, no more than it can use."""

from __future__ import annotations

from ..kv.cache import BLOCK
from ..kv.pool import kv_block_bytes
from ..kv.stores import available_memory
from .llm import LLM

MEMORY_SHARE = 0.25  # of the memory free at start-up (the weights are already loaded)
MIN_BUDGET = 16 << 20


def default_kv_budget(llm: LLM, max_batch: int) -> int:
    """A quarter of free memory, capped at what ``max_batch`` full-context sequences would use."""
    cfg = llm.config
    per_block = kv_block_bytes(llm.kv, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim)
    useful = per_block * -(-cfg.max_ctx // BLOCK) * max_batch
    return max(MIN_BUDGET, min(int(available_memory(llm.device) * MEMORY_SHARE), useful))
