"""Load a GGUF file (llama.cpp's format) through the ``gguf`` package.

Config comes from the ``{arch}.*`` metadata, tensors are dequantized with ``gguf.quants`` and
renamed to HF names. llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` for
Llama-architecture models (it turns HF's rotate-half RoPE layout into interleaved pairs); we undo
that here so the transformer uses one RoPE convention for every source.
"""

from __future__ import annotations

import functools
from collections.abc import Collection
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .config import (
    ARCHITECTURES,
    REQUIRED,
    ModelConfig,
    ModelLoadError,
    build_config,
    check_readable,
    count,
    non_negative,
    positive,
    read_key,
    read_shape,
)
from .weights import check_structure

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
# Gemma-3's sandwich norms: its ffn_norm is the MLP's pre-norm, post_attention_norm the attention's post-norm.
_GEMMA3_NAMES = {
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",
}


def _layer_names(arch: str) -> dict[str, str]:
    return {**_LAYER_NAMES, **_GEMMA3_NAMES} if arch == "gemma3" else _LAYER_NAMES


def hf_name(gguf_name: str, arch: str) -> str | None:
    """The HF name of a GGUF tensor of architecture ``arch``, or None for a tensor kvlens does not know."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    names = _layer_names(arch)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}"
    return None


def gguf_name(name: str, arch: str) -> str:
    """The GGUF spelling of an HF tensor name (inverse of :func:`hf_name`); unknown names unchanged."""
    for g, h in _GLOBAL_NAMES.items():
        if h == name:
            return g
    parts = name.removeprefix("model.layers.").split(".", 1)
    for g, h in _layer_names(arch).items():
        if len(parts) == 2 and parts[1] == h:
            return f"blk.{parts[0]}.{g}"
    return name


def check_gguf_structure(reader: Any, cfg: ModelConfig) -> None:
    """Every tensor the header implies is in the file with its shape, and every tensor in it is used."""
    found: dict[str, tuple[int, ...]] = {}
    for t in reader.tensors:
        found[hf_name(t.name, cfg.arch) or t.name] = tuple(int(n) for n in reversed(t.shape.tolist()))
    check_structure(cfg, found, lambda name: gguf_name(name, cfg.arch), from_gguf=True)


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


@functools.cache
def gguf_reader_class() -> type:
    """``gguf.GGUFReader`` reading through a plain ndarray view of its memory map (no copy: the
    view shares the mapping, and tensors are still read lazily). The reader slices its buffer a few
    times per metadata value, about a million times for SmolLM2's 49K-token vocabulary and merges; on
    an ``np.memmap`` every slice runs numpy's Python-level ``memmap.__getitem__`` and
    ``__array_finalize__``, which made up most of a model's load time (docs/testing.md)."""
    import gguf

    class ViewedGGUFReader(gguf.GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._viewed

        @data.setter
        def data(self, mapped: np.ndarray) -> None:  # the base __init__ assigns its np.memmap here
            self._viewed = mapped.view(np.ndarray)

    return ViewedGGUFReader


def open_gguf(path: str | Path) -> tuple[Any, dict[str, Any]]:
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"model file not found: {path}")
    if check_readable(path).stat().st_size == 0:
        raise ModelLoadError(f"{path} is empty (0 bytes); not a GGUF file")
    try:
        reader = gguf_reader_class()(path)
        meta = read_metadata(reader)
    except Exception as e:  # the gguf package raises ValueError/IndexError/struct errors on damage
        raise ModelLoadError(f"cannot read GGUF file {path} (truncated or corrupt?): {e}") from e
    _check_layout(reader, path)
    return reader, meta


def _check_layout(reader: Any, path: Path) -> None:
    """ggml's rule (``gguf_init_from_file``): each tensor's data starts where the one before it ends,
    padded to the file's alignment. The gguf package reads any offset, so two tensors could share
    bytes without a word."""
    expected, alignment = 0, int(reader.alignment)  # a stated alignment is read as numpy's uint32
    for t in reader.tensors:
        offset = t.data_offset - reader.data_offset
        if offset != expected:
            raise ModelLoadError(
                f"cannot read GGUF file {path}: tensor {t.name!r} has its data at offset {offset}, "
                f"where the tensors before it end at {expected} (overlapping or misplaced tensor data)"
            )
        expected += -(-int(t.n_bytes) // alignment) * alignment


def _gguf_keys(arch: str) -> dict[str, str]:
    return {
        "n_layers": f"{arch}.block_count",
        "hidden": f"{arch}.embedding_length",
        "n_heads": f"{arch}.attention.head_count",
        "n_kv_heads": f"{arch}.attention.head_count_kv",
        "head_dim": f"{arch}.attention.key_length",
        "ffn": f"{arch}.feed_forward_length",
        "vocab": f"{arch}.vocab_size",
        "rope_theta": f"{arch}.rope.freq_base",
        "rms_eps": f"{arch}.attention.layer_norm_rms_epsilon",
        "max_ctx": f"{arch}.context_length",
        "sliding_window": f"{arch}.attention.sliding_window",
    }


def config_from_gguf(meta: dict[str, Any], where: str = "GGUF metadata") -> ModelConfig:
    """Build a :class:`ModelConfig` from GGUF metadata; a bad or missing value names its key."""
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported GGUF architecture {arch!r}; kvlens implements: {', '.join(ARCHITECTURES)}"
        )
    keys = _gguf_keys(arch)
    if arch in PERMUTED_ARCHS:  # llama.cpp's llama graph, whose MoE form (Mixtral) kvlens lacks
        experts = read_key(meta, f"{arch}.expert_count", where, non_negative, 0)
        if experts:
            raise ModelLoadError(
                f"{where}: {arch}.expert_count = {experts}: a mixture-of-experts model; "
                "kvlens implements dense models only"
            )

    def get(field_name: str, check: Any = count, default: Any = REQUIRED) -> Any:
        return read_key(meta, keys[field_name], where, check, default)

    # llama.cpp refuses a file without the norm epsilon or the training context; so does kvlens
    shape = read_shape(get, keys, where, {"rms_eps": REQUIRED, "max_ctx": REQUIRED})
    hidden, n_heads, head_dim = shape["hidden"], shape["n_heads"], shape["head_dim"]
    for other in ("attention.value_length", "rope.dimension_count"):  # kvlens needs both = head_dim
        value = read_key(meta, f"{arch}.{other}", where, count, head_dim)
        if value != head_dim:
            raise ModelLoadError(
                f"{where}: {arch}.{other}={value} differs from the head size {head_dim}; unsupported"
            )
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = get("vocab", count, len(tokens) if isinstance(tokens, list) and tokens else None)
    if vocab is None:
        raise ModelLoadError(f"{where} lacks {keys['vocab']} and tokenizer.ggml.tokens")
    if isinstance(tokens, list) and tokens and vocab != len(tokens):  # llama.cpp: rows = the token count
        raise ModelLoadError(
            f"{where}: {keys['vocab']} = {vocab} but tokenizer.ggml.tokens lists {len(tokens)} tokens; "
            "a GGUF's embedding has one row per token"
        )
    fields = dict(
        arch=arch,
        **(_gemma3_fields(meta, where, hidden, n_heads, shape["n_layers"]) if arch == "gemma3" else {}),
        **shape,
        vocab=vocab,
        rope_theta=get("rope_theta", positive, 10000.0),
        tied_embeddings=False,  # decided from the tensors (no output.weight → tied)
        qkv_bias=ARCHITECTURES[arch]["qkv_bias"],
        qk_norm=ARCHITECTURES[arch]["qk_norm"],
        rope_scaling=_rope_scaling(meta, arch, where),
        sliding_window=get("sliding_window", non_negative, None) or None,  # llama.cpp: 0 is no window
        name=str(meta.get("general.name", "")),
    )
    return build_config(fields, keys, where)


def _rope_scaling(meta: dict[str, Any], arch: str, where: str) -> dict[str, Any] | None:
    """RoPE scaling as llama.cpp's loader reads it: the type defaults to linear; the factor is
    ``rope.scaling.factor``, else the older ``rope.scale_linear``; no factor, a factor of 1 or the type
    none is no scaling."""
    kind = meta.get(f"{arch}.rope.scaling.type", "linear")
    if kind not in ("none", "linear"):
        raise ModelLoadError(f"{where}: {arch}.rope.scaling.type={kind!r} is not supported (none, linear)")
    key = next((k for k in (f"{arch}.rope.scaling.factor", f"{arch}.rope.scale_linear") if k in meta), None)
    if kind == "none" or key is None:
        return None
    factor = read_key(meta, key, where, positive)
    return None if factor == 1.0 else {"rope_type": "linear", "factor": factor}


def _gemma3_fields(
    meta: dict[str, Any], where: str, hidden: int, n_heads: int, n_layers: int
) -> dict[str, Any]:
    """Gemma-3's settings that llama.cpp fixes by architecture when the file does not state them; the
    attention scale as llama.cpp sets it: 1/sqrt(hidden / n_heads) for the 27B (62 layers), else
    1/sqrt(head_dim) (HF's query_pre_attn_scalar)."""
    for key in ("gemma3.attn_logit_softcapping", "gemma3.final_logit_softcapping"):
        if meta.get(key) is not None:
            raise ModelLoadError(f"{where}: {key} is set; kvlens does not implement logit soft-capping")
    pattern = meta.get("gemma3.attention.sliding_window_pattern", 6)  # llama.cpp: 5 local, then 1 global
    if not isinstance(pattern, int) or isinstance(pattern, bool):
        raise ModelLoadError(
            f"{where}: gemma3.attention.sliding_window_pattern={pattern!r}; kvlens reads only an integer period"
        )
    return dict(
        sliding_pattern=pattern,
        rope_local_theta=read_key(meta, "gemma3.rope.freq_base_swa", where, positive, 10000.0),
        hidden_act="gelu_tanh",
        embed_scale=float(hidden) ** 0.5,
        sandwich_norms=True,
        query_pre_attn_scalar=hidden / n_heads if n_layers == 62 else None,
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
        name = hf_name(t.name, cfg.arch)
        names.add(name)
        if name is None or name in skip:
            continue
        w = dequantize_tensor(t)  # checked finite where build_weights reads it
        if cfg.arch in PERMUTED_ARCHS and name.endswith("q_proj.weight"):  # these archs have no q/k bias
            w = unpermute(w, cfg.n_heads)
        elif cfg.arch in PERMUTED_ARCHS and name.endswith("k_proj.weight"):
            w = unpermute(w, cfg.n_kv_heads)
        out[name] = w
    cfg.tied_embeddings = "lm_head.weight" not in names
    return out
