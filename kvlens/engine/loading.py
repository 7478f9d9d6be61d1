"""``kvlens.load``: a model by name or path, with its KV-cache mode, ready to run as an :class:`LLM`."""

from __future__ import annotations

from pathlib import Path

import torch

from ..checks import check_device
from ..kv.blocks import SparseConfig
from ..kv.modes import CacheOptions, KVMode
from ..models.loader import check_weights_mode, load_model
from .llm import DEFAULT_PREFILL_CHUNK, LLM, check_settings


def load(
    model: str | Path = "smollm2",
    kv: str | KVMode = "q8",
    device: str | None = None,
    attn_backend: str = "auto",
    cache_options: CacheOptions | None = None,
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    weights: str | None = None,
    sparse: SparseConfig | None = None,
) -> LLM:
    """Load a model (``"smollm2"``, ``"gemma3-270m"``, a .gguf file or an HF directory) with a KV-cache mode.

    ``weights``: f32, bf16, int8 or int4 (kept quantized); None/"auto" = closest to the file's
    own precision for a GGUF (SmolLM2 Q4_1: int4 layers, int8 embedding/head), f32 otherwise.
    """
    kv = KVMode.parse(kv)  # every argument checked before the (slow) load
    weights = check_weights_mode("auto" if weights is None else weights)
    dev = check_device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    check_settings(attn_backend, cache_options or CacheOptions(), prefill_chunk, sparse, dev)
    loaded = load_model(model, dev, weights=weights)
    return LLM(loaded, kv, attn_backend, cache_options, prefill_chunk, sparse)
