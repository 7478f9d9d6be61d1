"""GGUF Q8_0 / Q4_0 / Q4_1 blocks → kvlens int8 / int4 codes, without a float round trip.

A GGUF block covers 32 consecutive inputs of one output row — exactly one group of
:mod:`kvlens.models.qlinear` — so repacking only moves bits: Q8_0's int8 codes and fp16 scale are
kept (the scale widened to f32, exactly); Q4_1's nibbles, scale ``d`` and min ``m`` map to
``code * d + m``; Q4_0's ``d * (code - 8)`` is ``code * d + (-8 d)``, also exact in f32. The
dequantized weights are therefore bit-identical to ``gguf.quants.dequantize`` of the file.

``auto`` weights pick, per tensor, the closest mode to the file's own precision: F32 → f32,
F16/BF16 → bf16, Q8_0 → int8 and Q4_0/Q4_1 → int4 (both lossless); any other quantized type
(K-quants, Q5_*) is dequantized and re-quantized to int8, whose half-step error is a small
fraction of the 4–6-bit step the file already carries.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .config import ModelConfig, ModelLoadError
from .gguf_loader import PERMUTED_ARCHS, hf_name, unpermute
from .qlinear import G, QCodes

# GGUF type → (our kind, bytes per block of 32)
REPACKABLE = {"Q8_0": ("int8", 34), "Q4_0": ("int4", 18), "Q4_1": ("int4", 20)}
AUTO_MODE = {"F32": "f32", "F16": "bf16", "BF16": "bf16", "Q8_0": "int8", "Q4_0": "int4", "Q4_1": "int4"}


def auto_mode(type_name: str) -> str:
    """The weight mode closest to a GGUF tensor type's own precision."""
    return AUTO_MODE.get(type_name, "int8")


def _f16(raw: np.ndarray) -> torch.Tensor:
    """fp16 fields [n, blocks, 2] (uint8) → f32 [n, blocks] (exact)."""
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32))


def repack(t: Any) -> QCodes | None:
    """One GGUF reader tensor as :class:`QCodes` (rows in file order), or None if its type has no repack."""
    kind_name = t.tensor_type.name
    if kind_name not in REPACKABLE or len(t.shape) != 2:
        return None
    kind, block_bytes = REPACKABLE[kind_name]
    k, n = (int(d) for d in t.shape)  # GGUF lists the fastest dimension first
    if k % G:
        return None
    blocks = np.asarray(t.data, dtype=np.uint8).reshape(n, k // G, block_bytes)
    scales = _f16(blocks[..., 0:2])
    if kind_name == "Q8_0":
        codes = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(n, k))
        mins = None
    else:
        head = 2 if kind_name == "Q4_0" else 4
        qs = blocks[..., head:]  # [n, blocks, 16]: input j in the low nibble of byte j, j + 16 in the high
        codes = torch.from_numpy(np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(n, k))
        mins = -8 * scales if kind_name == "Q4_0" else _f16(blocks[..., 2:4])
    if not bool(torch.isfinite(scales).all()) or (mins is not None and not bool(torch.isfinite(mins).all())):
        raise ModelLoadError(f"tensor {t.name} has NaN/Inf block scales (corrupt file?)")
    return QCodes(kind, codes, scales, mins)


def gguf_codes(reader: Any, cfg: ModelConfig) -> dict[str, QCodes]:
    """Every repackable weight matrix under its HF name, q/k row permutation undone."""
    out: dict[str, QCodes] = {}
    for t in reader.tensors:
        name = hf_name(t.name, cfg.arch)
        if name is None or (c := repack(t)) is None:
            continue
        heads = (
            cfg.n_heads
            if name.endswith("q_proj.weight")
            else cfg.n_kv_heads
            if name.endswith("k_proj.weight")
            else None
        )
        if cfg.arch in PERMUTED_ARCHS and heads is not None:  # a row permutation: move codes and scales alike
            c = QCodes(
                c.kind,
                unpermute(c.codes, heads).contiguous(),
                unpermute(c.scales, heads).contiguous(),
                None if c.mins is None else unpermute(c.mins, heads).contiguous(),
            )
        out[name] = c
    return out


def gguf_modes(reader: Any, arch: str) -> dict[str, str]:
    """HF name → :func:`auto_mode` of its GGUF tensor type."""
    return {name: auto_mode(t.tensor_type.name) for t in reader.tensors if (name := hf_name(t.name, arch))}
