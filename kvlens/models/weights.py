"""Model weights in the transformer's own layout, built from HF-style tensor names.

Both loaders produce a flat ``{hf_name: float tensor}`` dict (HF transformers' names, GGUF
names are translated), and :func:`build_weights` turns it into :class:`Weights`. Q, K and V
projections are fused into one matrix and gate/up into another, so a layer runs two matmuls
where a naive port runs five. A matrix is an f32 tensor or, with kept-quantized weights, a
:class:`~kvlens.models.qlinear.QLinear` (bf16/int8/int4); the transformer calls both alike.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from .config import ModelConfig, ModelLoadError
from .qlinear import Matrix, QCodes, make_matrix, matrix_bytes


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    wqkv: Matrix  # [(n_heads + 2 n_kv) * head_dim, hidden]; Matrix: f32 tensor or a QLinear
    bqkv: torch.Tensor | None
    wo: Matrix
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    ffn_norm: torch.Tensor
    w_gate_up: Matrix  # [2 * ffn, hidden]
    w_down: Matrix
    post_attn_norm: torch.Tensor | None = None  # sandwich norms (Gemma): on each sublayer's output
    post_ffn_norm: torch.Tensor | None = None


@dataclass
class Weights:
    embed: Matrix
    norm: torch.Tensor
    lm_head: Matrix  # the same object as embed when tied
    layers: list[LayerWeights]
    rope_freq_factors: torch.Tensor | None = None  # GGUF's llama3 `rope_freqs`: inv_freq is divided by it


Shapes = dict[str, tuple[int, ...]]
# GGUF's Llama-3 RoPE scaling tensor `rope_freqs`: llama.cpp's llama graph reads it; its qwen2, qwen3
# and gemma3 graphs do not, and refuse a file that holds it.
ROPE_FREQS_ARCHS = ("llama", "mistral")
# HF names of the norm before the MLP and of the sandwich norms (Gemma), per layer
POST_ATTN_NORM, POST_FFN_NORM = "post_attention_layernorm.weight", "post_feedforward_layernorm.weight"


def ffn_norm_name(cfg: ModelConfig) -> str:
    """Llama calls the MLP's pre-norm post_attention_layernorm; Gemma's sandwich layers use that name
    for the attention output's norm and call the MLP's pre-norm pre_feedforward_layernorm."""
    return "pre_feedforward_layernorm.weight" if cfg.sandwich_norms else POST_ATTN_NORM


def expected_tensors(cfg: ModelConfig, from_gguf: bool = False) -> tuple[Shapes, Shapes]:
    """``(required, optional)``: HF name → shape of every tensor the config implies."""
    h, d = cfg.hidden, cfg.head_dim
    q_rows, kv_rows = cfg.n_heads * d, cfg.n_kv_heads * d
    required: Shapes = {"model.embed_tokens.weight": (cfg.vocab, h), "model.norm.weight": (h,)}
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        layer = {
            "input_layernorm.weight": (h,),
            "self_attn.q_proj.weight": (q_rows, h),
            "self_attn.k_proj.weight": (kv_rows, h),
            "self_attn.v_proj.weight": (kv_rows, h),
            "self_attn.o_proj.weight": (h, q_rows),
            ffn_norm_name(cfg): (h,),
            "mlp.gate_proj.weight": (cfg.ffn, h),
            "mlp.up_proj.weight": (cfg.ffn, h),
            "mlp.down_proj.weight": (h, cfg.ffn),
        }
        if cfg.qkv_bias:
            layer.update({"self_attn.q_proj.bias": (q_rows,), "self_attn.k_proj.bias": (kv_rows,)})
            layer["self_attn.v_proj.bias"] = (kv_rows,)
        if cfg.qk_norm:
            layer.update({"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)})
        if cfg.sandwich_norms:
            layer.update({POST_ATTN_NORM: (h,), POST_FFN_NORM: (h,)})
        required.update({p + k: v for k, v in layer.items()})
    optional: Shapes = {"lm_head.weight": (cfg.vocab, h)}  # absent when tied (unread when the config ties it)
    if from_gguf and cfg.arch in ROPE_FREQS_ARCHS:
        optional["rope_freqs"] = (d // 2,)
    return required, optional


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _span(ids: list[int]) -> str:
    """[28, 29] → "28..29" (a run), else the list."""
    if len(ids) == 1:
        return str(ids[0])
    return f"{ids[0]}..{ids[-1]}" if ids == list(range(ids[0], ids[-1] + 1)) else str(ids)


# Tensors an HF checkpoint may carry that kvlens deliberately does not read. A GGUF file gets no such
# leave: llama.cpp refuses a tensor that its graph does not create, and so does kvlens.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)  # old HF checkpoints: recomputed from the config


def check_structure(
    cfg: ModelConfig, found: Shapes, label: Callable[[str], str] = str, from_gguf: bool = False
) -> None:
    """Refuse a checkpoint that does not match its config, both ways: every tensor the config implies
    is present with its shape, and every tensor present is used or (HF only) named in
    :data:`IGNORED_SUFFIXES`.

    ``found``: name (HF's where known) → shape; ``label(name)`` is the name as the file spells it.
    """
    required, optional = expected_tensors(cfg, from_gguf)
    ignored = () if from_gguf else IGNORED_SUFFIXES
    layers_key = cfg.keys.get("n_layers", "n_layers")
    extra_layers = sorted(
        {int(m.group(1)) for n in found if (m := _LAYER.match(n))} - set(range(cfg.n_layers))
    )
    if extra_layers:
        raise ModelLoadError(
            f"the file holds tensors of layer(s) {_span(extra_layers)} but {layers_key} = {cfg.n_layers} "
            f"(layers 0..{cfg.n_layers - 1}); the header and the tensors disagree"
        )
    missing = [n for n in required if n not in found]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelLoadError(f"tensor {label(missing[0])!r} is missing from the checkpoint{more}")
    for name, shape in found.items():
        want = required.get(name) or optional.get(name)
        if want is None:
            if name.endswith(ignored):
                continue
            raise ModelLoadError(
                f"unexpected tensor {label(name)!r} in the checkpoint ({cfg.arch} does not use it)"
            )
        if tuple(shape) != want:
            raise ModelLoadError(
                f"tensor {label(name)!r} has shape {tuple(shape)}, the config implies {want}"
            )


class _Getter:
    """Tensors by HF name, on the target device and dtype, with the loader's errors."""

    def __init__(self, get, dtype, device, mode_for, get_codes, label: Callable[[str], str] = str) -> None:
        self.get, self.dtype, self.device, self.label = get, dtype, device, label
        self.codes = get_codes or (lambda _name: None)
        self._matrix = None if mode_for is None else make_matrix(mode_for, self.need, self.codes, device)

    def need(self, name: str) -> torch.Tensor:
        t = self.opt(name)
        if t is None:
            raise ModelLoadError(f"tensor {name!r} is missing from the checkpoint")
        return t

    def opt(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor | None:
        """The tensor, checked finite as the file holds it (both loaders' float tensors pass here)."""
        t = self.get(name)
        if t is None:
            return None
        if not bool(torch.isfinite(t).all()):
            raise ModelLoadError(f"tensor {self.label(name)!r} holds NaN or Inf values (a corrupt file?)")
        return t.to(device=self.device, dtype=dtype or self.dtype)

    def matrix(self, names: list[str]) -> Matrix:
        if self._matrix is not None:
            return self._matrix(names)
        return (
            torch.cat([self.need(n) for n in names]).contiguous() if len(names) > 1 else self.need(names[0])
        )

    def checked(self, what: str, names: list[str], shape: tuple[int, int]) -> Matrix:
        w = self.matrix(names)
        if tuple(w.shape) != shape:
            raise ModelLoadError(f"{what} has shape {tuple(w.shape)}, config implies {shape}")
        return w


def _layer_weights(cfg: ModelConfig, i: int, g: _Getter) -> LayerWeights:
    p = f"model.layers.{i}."
    biases = [g.opt(p + f"self_attn.{n}_proj.bias") for n in "qkv"]
    bqkv = torch.cat(biases) if cfg.qkv_bias and all(b is not None for b in biases) else None
    if cfg.qkv_bias and bqkv is None:
        raise ModelLoadError(f"layer {i}: {cfg.arch} needs q/k/v biases, the checkpoint lacks them")
    qkv_rows = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
    return LayerWeights(
        attn_norm=g.need(p + "input_layernorm.weight"),
        wqkv=g.checked(
            f"layer {i} q/k/v_proj (fused)",
            [p + f"self_attn.{n}_proj.weight" for n in "qkv"],
            (qkv_rows, cfg.hidden),
        ),
        bqkv=bqkv,
        wo=g.matrix([p + "self_attn.o_proj.weight"]),
        q_norm=g.need(p + "self_attn.q_norm.weight") if cfg.qk_norm else None,
        k_norm=g.need(p + "self_attn.k_norm.weight") if cfg.qk_norm else None,
        ffn_norm=g.need(p + ffn_norm_name(cfg)),
        w_gate_up=g.matrix([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
        w_down=g.matrix([p + "mlp.down_proj.weight"]),
        post_attn_norm=g.need(p + POST_ATTN_NORM) if cfg.sandwich_norms else None,
        post_ffn_norm=g.need(p + POST_FFN_NORM) if cfg.sandwich_norms else None,
    )


def build_weights(
    cfg: ModelConfig,
    get: Callable[[str], torch.Tensor | None],
    dtype: torch.dtype,
    device: torch.device,
    mode_for: Callable[[str], str] | None = None,
    get_codes: Callable[[str], QCodes | None] | None = None,
    label: Callable[[str], str] = str,
) -> Weights:
    """Assemble :class:`Weights`; ``get(name)`` returns an HF-named tensor or None if absent.
    ``label(name)``: the name the file gives that tensor, for errors (a GGUF's own names).

    Weight matrices are f32 tensors unless ``mode_for(name)`` picks a kept-quantized mode
    (bf16/int8/int4, :mod:`.qlinear`); ``get_codes(name)`` may hand over already-quantized codes
    (repacked GGUF blocks), which ``get`` then need not return.
    """
    g = _Getter(get, dtype, device, mode_for, get_codes, label)
    layers = [_layer_weights(cfg, i, g) for i in range(cfg.n_layers)]
    embed = g.checked("embedding", ["model.embed_tokens.weight"], (cfg.vocab, cfg.hidden))
    lm_head = embed  # tied (some checkpoints tie without saying so)
    if not cfg.tied_embeddings and (
        get("lm_head.weight") is not None or g.codes("lm_head.weight") is not None
    ):
        lm_head = g.matrix(["lm_head.weight"])
    factors = g.opt("rope_freqs", torch.float32)
    return Weights(
        embed=embed,
        norm=g.need("model.norm.weight"),
        lm_head=lm_head,
        layers=layers,
        rope_freq_factors=factors,
    )


def step_read_bytes(w: Weights) -> int:
    """The weight bytes one decode step reads: every layer's matrices, biases and norms, the final norm
    and the LM head (the embedding gives one row, left out unless it is the tied head)."""
    per_layer = (getattr(L, f.name) for L in w.layers for f in fields(L))
    return sum(matrix_bytes(m) for m in (*per_layer, w.norm, w.lm_head) if m is not None)
