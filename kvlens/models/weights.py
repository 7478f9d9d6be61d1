"""Model weights in the transformer's own layout, built from HF-style tensor names.

Both loaders produce a flat ``{hf_name: float tensor}`` dict (HF transformers' names, GGUF
names are translated), and :func:`build_weights` turns it into :class:`Weights`. Q, K and V
projections are fused into one matrix and gate/up into another, so a layer runs two matmuls
where a naive port runs five.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .config import ModelConfig, ModelLoadError


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    wqkv: torch.Tensor  # [(n_heads + 2 n_kv) * head_dim, hidden]
    bqkv: torch.Tensor | None
    wo: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    ffn_norm: torch.Tensor
    w_gate_up: torch.Tensor  # [2 * ffn, hidden]
    w_down: torch.Tensor


@dataclass
class Weights:
    embed: torch.Tensor
    norm: torch.Tensor
    lm_head: torch.Tensor
    layers: list[LayerWeights]
    rope_freq_factors: torch.Tensor | None = None  # GGUF's llama3 `rope_freqs`: inv_freq is divided by it


def build_weights(
    cfg: ModelConfig, get: Callable[[str], torch.Tensor | None], dtype: torch.dtype, device: torch.device
) -> Weights:
    """Assemble :class:`Weights`; ``get(name)`` returns an HF-named tensor or None if absent."""

    def need(name: str) -> torch.Tensor:
        t = get(name)
        if t is None:
            raise ModelLoadError(f"tensor {name!r} is missing from the checkpoint")
        return t.to(device=device, dtype=dtype)

    def opt(name: str) -> torch.Tensor | None:
        t = get(name)
        return None if t is None else t.to(device=device, dtype=dtype)

    layers = []
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        q, k, v = (need(p + f"self_attn.{n}_proj.weight") for n in "qkv")
        expect = (cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim)
        for t, rows, n in zip((q, k, v), expect, "qkv", strict=True):
            if tuple(t.shape) != (rows, cfg.hidden):
                raise ModelLoadError(
                    f"layer {i} {n}_proj has shape {tuple(t.shape)}, config implies {(rows, cfg.hidden)}"
                )
        biases = [opt(p + f"self_attn.{n}_proj.bias") for n in "qkv"]
        bqkv = torch.cat(biases) if cfg.qkv_bias and all(b is not None for b in biases) else None
        if cfg.qkv_bias and bqkv is None:
            raise ModelLoadError(f"layer {i}: {cfg.arch} needs q/k/v biases, the checkpoint lacks them")
        layers.append(
            LayerWeights(
                attn_norm=need(p + "input_layernorm.weight"),
                wqkv=torch.cat([q, k, v]).contiguous(),
                bqkv=bqkv,
                wo=need(p + "self_attn.o_proj.weight"),
                q_norm=need(p + "self_attn.q_norm.weight") if cfg.qk_norm else None,
                k_norm=need(p + "self_attn.k_norm.weight") if cfg.qk_norm else None,
                ffn_norm=need(p + "post_attention_layernorm.weight"),
                w_gate_up=torch.cat(
                    [need(p + "mlp.gate_proj.weight"), need(p + "mlp.up_proj.weight")]
                ).contiguous(),
                w_down=need(p + "mlp.down_proj.weight"),
            )
        )
    embed = need("model.embed_tokens.weight")
    if tuple(embed.shape) != (cfg.vocab, cfg.hidden):
        raise ModelLoadError(
            f"embedding has shape {tuple(embed.shape)}, config implies {(cfg.vocab, cfg.hidden)}"
        )
    lm_head = embed if cfg.tied_embeddings else opt("lm_head.weight")
    if lm_head is None:  # some checkpoints tie without saying so
        lm_head = embed
    factors = get("rope_freqs")
    return Weights(
        embed=embed,
        norm=need("model.norm.weight"),
        lm_head=lm_head,
        layers=layers,
        rope_freq_factors=None if factors is None else factors.to(device=device, dtype=torch.float32),
    )
