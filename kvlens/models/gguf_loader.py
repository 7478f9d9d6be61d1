"""Load a GGUF file (llama.cpp's format) through the ``gguf`` package.

Config comes from the ``{arch}.*`` metadata, tensors are dequantized with ``gguf.quants`` and
renamed to HF names. llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` for
Llama-architecture models (it turns HF's rotate-half RoPE layout into interleaved pairs); we undo
that here so the transformer uses one RoPE convention for every source.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .config import ARCHITECTURES, ModelConfig, ModelLoadError

# architectures whose attn_q/attn_k rows the converter permutes
PERMUTED_ARCHS = {"llama", "mistral"}

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",
}


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE pairs → HF's rotate-half halves)."""
    rows = w.shape[0]
    # GGUF rows are laid out [head, pair, 2]; HF's are [head, 2 halves, pair].
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def read_metadata(reader: Any) -> dict[str, Any]:
    """GGUF key → python value (strings, numbers, lists)."""
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        meta[key] = field.contents()
    return meta


def open_gguf(path: str | Path) -> tuple[Any, dict[str, Any]]:
    import gguf

    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"model file not found: {path}")
    try:
        reader = gguf.GGUFReader(path)
        return reader, read_metadata(reader)
    except Exception as e:  # the gguf package raises ValueError/IndexError/struct errors on damage
        raise ModelLoadError(f"cannot read GGUF file {path} (truncated or corrupt?): {e}") from e


def config_from_gguf(meta: dict[str, Any]) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported GGUF architecture {arch!r}; kvlens implements: {', '.join(ARCHITECTURES)}"
        )

    def key(name: str, default: Any = None) -> Any:
        v = meta.get(f"{arch}.{name}", default)
        if v is None:
            raise ModelLoadError(f"GGUF metadata lacks {arch}.{name}")
        return v

    n_heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    scaling = None
    if meta.get(f"{arch}.rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": float(meta[f"{arch}.rope.scaling.factor"])}
    window = meta.get(f"{arch}.attention.sliding_window")
    return ModelConfig(
        arch=arch,
        n_layers=int(key("block_count")),
        hidden=hidden,
        n_heads=n_heads,
        n_kv_heads=int(key("attention.head_count_kv", n_heads)),
        head_dim=int(key("attention.key_length", hidden // n_heads)),
        ffn=int(key("feed_forward_length")),
        vocab=int(meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rms_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        max_ctx=int(key("context_length", 4096)),
        tied_embeddings=False,  # decided from the tensors (no output.weight → tied)
        qkv_bias=ARCHITECTURES[arch]["qkv_bias"],
        qk_norm=ARCHITECTURES[arch]["qk_norm"],
        rope_scaling=scaling,
        sliding_window=int(window) if window else None,
        name=str(meta.get("general.name", "")),
    )


def dequantize_tensor(t: Any) -> torch.Tensor:
    """One GGUF tensor → float32 torch tensor in numpy (row-major, HF) orientation."""
    import gguf

    kind = t.tensor_type.name
    try:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
    except (NotImplementedError, KeyError, ValueError) as e:
        raise ModelLoadError(f"tensor {t.name}: unsupported tensor type {kind} ({e})") from e
    shape = tuple(int(n) for n in reversed(t.shape.tolist()))
    # F32/F16 tensors come back as read-only views of the memory map; copy into torch-owned memory.
    return torch.from_numpy(np.array(arr, dtype=np.float32, copy=True).reshape(shape))


def load_gguf_tensors(reader: Any, cfg: ModelConfig, skip: Collection[str] = ()) -> dict[str, torch.Tensor]:
    """Every known tensor, dequantized to float32, under its HF name, q/k permutation undone.

    ``skip``: HF names not to dequantize (the caller repacked their quantized blocks).
    """
    out: dict[str, torch.Tensor] = {}
    names = set()
    for t in reader.tensors:
        name = hf_name(t.name)
        names.add(name)
        if name is None or name in skip:
            continue
        w = dequantize_tensor(t)
        if not bool(torch.isfinite(w).all()):
            raise ModelLoadError(f"tensor {t.name} contains NaN/Inf (corrupt file?)")
        if cfg.arch in PERMUTED_ARCHS and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = unpermute(w, cfg.n_heads)
        elif cfg.arch in PERMUTED_ARCHS and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = unpermute(w, cfg.n_kv_heads)
        out[name] = w
    cfg.tied_embeddings = "lm_head.weight" not in names
    return out
