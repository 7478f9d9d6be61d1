"""Model configuration shared by the loaders and the transformer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class ModelLoadError(ValueError):
    """A model file or directory that is missing, truncated, corrupt or unsupported."""


# Architectures the transformer implements, with the features each one switches on.
ARCHITECTURES = {
    "llama": {"qkv_bias": False, "qk_norm": False},
    "mistral": {"qkv_bias": False, "qk_norm": False},
    "qwen2": {"qkv_bias": True, "qk_norm": False},
    "qwen3": {"qkv_bias": False, "qk_norm": True},
}


@dataclass
class ModelConfig:
    arch: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    max_ctx: int = 4096
    tied_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_scaling: dict[str, Any] | None = (
        None  # HF-style dict, e.g. {"rope_type": "llama3", "factor": 8, ...}
    )
    sliding_window: int | None = None
    name: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {self.arch!r}; kvlens implements: {', '.join(ARCHITECTURES)}"
            )
        if self.n_heads % self.n_kv_heads:
            raise ModelLoadError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """Build a :class:`ModelConfig` from an HF ``config.json`` dict."""
    arch = cfg.get("model_type", "")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported model_type {arch!r} in config.json; kvlens implements: {', '.join(ARCHITECTURES)}"
        )
    n_heads = cfg["num_attention_heads"]
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    theta = cfg.get("rope_theta") or (scaling or {}).get("rope_theta") or 10000.0
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", arch == "mistral") else None
    return ModelConfig(
        arch=arch,
        n_layers=cfg["num_hidden_layers"],
        hidden=cfg["hidden_size"],
        n_heads=n_heads,
        n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
        ffn=cfg["intermediate_size"],
        vocab=cfg["vocab_size"],
        rope_theta=float(theta),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        max_ctx=int(cfg.get("max_position_embeddings", 4096)),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", ARCHITECTURES[arch]["qkv_bias"])),
        qk_norm=ARCHITECTURES[arch]["qk_norm"],
        rope_scaling=dict(scaling) if scaling else None,
        sliding_window=window,
        name=cfg.get("_name_or_path", ""),
    )
