"""Tiny random-weight checkpoints of every supported architecture, written in both formats.

The HF directory is written by transformers itself (the reference); the GGUF is converted from the
same state dict the way llama.cpp's converter does it (q/k rows permuted for Llama-architecture
models), so loading it exercises our un-permutation.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch

VOCAB = 320
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _byte_tokens() -> list[str]:
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a")]
    tokens = SPECIALS + alphabet + ["".join(m) for m in merges]
    tokens += [f"<extra_{i}>" for i in range(VOCAB - len(tokens))]
    return tokens, [" ".join(m) for m in merges]


def write_tokenizer_json(out: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens, merges = _byte_tokens()
    bpe = models.BPE({t: i for i, t in enumerate(tokens)}, [tuple(m.split(" ")) for m in merges])
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": None, "eos_token": "<|endoftext|>", "add_bos_token": False})
    )


def hf_config(arch: str, sliding_window: int | None = None, **shape):
    """A tiny config of ``arch``; ``shape`` overrides its sizes (e.g. hidden_size, num_attention_heads)."""
    import transformers as tf

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=0,
    )
    common.update(shape)
    if arch == "llama":  # with Llama-3 frequency scaling and an untied head
        return tf.LlamaConfig(
            **common,
            rope_theta=50000.0,
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    if arch == "mistral":
        return tf.MistralConfig(**common, sliding_window=sliding_window, tie_word_embeddings=False)
    window = {} if sliding_window is None else {"sliding_window": sliding_window}  # with use_sliding_window
    if arch == "qwen2":
        return tf.Qwen2Config(**common, **window, tie_word_embeddings=True)
    if arch == "qwen3":
        return tf.Qwen3Config(**common, **window, head_dim=32, tie_word_embeddings=True)
    raise ValueError(arch)


def write_hf(arch: str, out: Path, seed: int = 0, sliding_window: int | None = None, **shape):
    """Random-weight HF model saved as safetensors (several shards); returns the HF model.
    ``sliding_window`` (Mistral; Qwen2/3 with ``use_sliding_window=True``, from layer
    ``max_window_layers`` on): each query attends its last ``sliding_window`` positions;
    ``shape``: :func:`hf_config`'s size overrides."""
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(hf_config(arch, sliding_window, **shape), dtype=torch.float32)
    with torch.no_grad():  # larger-than-init norms and biases so every feature matters
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn_like(p))
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, max_shard_size="200KB")  # several shards + index.json
    write_tokenizer_json(out)
    return model


_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_header(path: Path, arch: str, cfg, head_dim: int, rope_theta: float) -> gguf.GGUFWriter:
    """A GGUF writer holding the shape keys of the HF config ``cfg``."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    return w


def write_out(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter permutation of q/k rows (HF halves → interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(
    model, arch: str, path: Path, dtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32
) -> Path:
    cfg = model.config
    gguf_arch = "llama" if arch == "mistral" else arch
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    theta = cfg.rope_parameters["rope_theta"] if getattr(cfg, "rope_parameters", None) else cfg.rope_theta
    w = gguf_header(path, gguf_arch, cfg, head_dim, theta)
    w.add_vocab_size(cfg.vocab_size)
    tokens, merges = _byte_tokens()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_eos_token_id(0)
    w.add_add_bos_token(False)
    for name, t in model.state_dict().items():
        a = t.detach().float().numpy()
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            i, rest = name.removeprefix("model.layers.").split(".", 1)
            gname = f"blk.{i}.{_GGUF_LAYER[rest]}"
        if gguf_arch == "llama" and "q_proj" in name:
            a = permute(a, cfg.num_attention_heads)
        elif gguf_arch == "llama" and "k_proj" in name:
            a = permute(a, cfg.num_key_value_heads)
        if a.ndim == 2 and dtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(gname, gguf.quants.quantize(a, dtype), raw_dtype=dtype)
        else:
            w.add_tensor(gname, np.ascontiguousarray(a))
    inv = _llama3_freq_factors(model) if arch == "llama" else None
    if inv is not None:
        w.add_tensor("rope_freqs.weight", inv)
    write_out(w)
    return path


def _llama3_freq_factors(model) -> np.ndarray:
    """llama.cpp stores Llama-3 RoPE scaling as per-frequency divisors of the base inv_freq."""
    cfg = model.config
    d = cfg.hidden_size // cfg.num_attention_heads
    theta = cfg.rope_parameters["rope_theta"]
    base = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaled = model.model.rotary_emb.inv_freq.float()
    return (base / scaled).numpy().astype(np.float32)


# ---------------------------------------------------------------- Gemma-3 (GGUF only)
SPM_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
# "th" ranks last: merged first (worst-first order), "▁the" would never form
SPM_PIECES = ["▁", "t", "h", "e", "a", "n", "▁t", "he", "▁the", "▁a", "an", "▁an", "in", "▁in", "th"]
_GEMMA3_LAYER = {
    **_GGUF_LAYER,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}


def gemma3_config(
    head_dim: int = 256, sliding_window: int = 4, n_layers: int = 6, query_pre_attn_scalar=None,
    global_rope: dict | None = None,
):  # fmt: skip
    """Gemma-3 as llama.cpp describes it (5 windowed layers, then a global one; local RoPE base 1e4,
    global 1e6; attention scaled by 1/sqrt(head_dim)), tiny; one KV head. ``global_rope``: the global
    layers' RoPE scaling (as Gemma-3-4B's ``{"rope_type": "linear", "factor": 8.0}``)."""
    import transformers as tf

    return tf.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=n_layers,
        num_attention_heads=2, num_key_value_heads=1, head_dim=head_dim, query_pre_attn_scalar=query_pre_attn_scalar or head_dim,
        sliding_window=sliding_window, max_position_embeddings=256, rms_norm_eps=1e-6,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1e6} | (global_rope or {}),
        },
        pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True,
    )  # fmt: skip


def spm_tokens() -> tuple[list[str], list[float], list[int]]:
    """A sentencepiece-style vocabulary: control tokens, byte fallbacks, scored pieces, a user token."""
    # as in Gemma's file, the user-defined run of spaces comes before the byte tokens and the pieces
    tokens = SPM_SPECIALS + ["  "] + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES
    types = [3] * 4 + [4] + [6] * 256 + [1] * len(SPM_PIECES)
    scores = [-1000.0] * 261 + [-float(i) for i in range(len(SPM_PIECES))]
    pad = VOCAB - len(tokens)
    return tokens + [f"<unused{i}>" for i in range(pad)], scores + [-1000.0] * pad, types + [3] * pad


META_TYPES = {
    bool: gguf.GGUFValueType.BOOL,
    int: gguf.GGUFValueType.UINT32,
    float: gguf.GGUFValueType.FLOAT32,
    str: gguf.GGUFValueType.STRING,
}


def write_gemma3(path: Path, seed: int = 0, skip: tuple[str, ...] = (), meta: dict | None = None, **config):
    """A random Gemma-3 (HF model, the reference) and its GGUF as llama.cpp's converter writes it
    (norms stored as 1 + w, no output.weight); returns ``(hf_model, path)``. ``skip``: GGUF tensor
    names left out; ``meta``: extra metadata, bool / int / float / str (damaged files, RoPE scaling)."""
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.Gemma3ForCausalLM(gemma3_config(**config)).float().eval()
    with torch.no_grad():  # Gemma norms multiply by 1 + w: random w so every norm matters
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.3 * torch.randn_like(p))
    cfg = model.config
    w = gguf_header(path, "gemma3", cfg, cfg.head_dim, 1e6)
    w.add_sliding_window(cfg.sliding_window)
    tokens, scores, types = spm_tokens()
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    for key, value in (meta or {}).items():  # typed as given: a bool stays a GGUF BOOL, not an int
        w.add_key_value(key, value, META_TYPES[type(value)])
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        a = t.detach().float().numpy() + (1.0 if "norm" in name else 0.0)
        if name in ("model.embed_tokens.weight", "model.norm.weight"):
            gname = {"model.embed_tokens.weight": "token_embd.weight"}.get(name, "output_norm.weight")
        else:
            i, rest = name.removeprefix("model.layers.").split(".", 1)
            gname = f"blk.{i}.{_GEMMA3_LAYER[rest]}"
        if gname not in skip:
            w.add_tensor(gname, np.ascontiguousarray(a, dtype=np.float32))
    write_out(w)
    return model, path
