"""Quantized weights at their edges: GGUF blocks with NaN scales refused, only 2-D tensors repacked,
the auto weight mode per GGUF type as documented, and int4's ragged last group ranged over its own
values only."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvlens.models.config import ModelLoadError
from kvlens.models.gguf_repack import auto_mode, repack
from kvlens.models.qlinear import QCodes, make_matrix


def gguf_tensor(type_name: str, shape: tuple[int, ...], blocks: np.ndarray) -> SimpleNamespace:
    """What `repack` reads of a gguf reader tensor: its type, shape (fastest dimension first), bytes."""
    return SimpleNamespace(
        name="blk.0.t", tensor_type=SimpleNamespace(name=type_name), shape=shape, data=blocks
    )


def f16_bytes(*values: float) -> np.ndarray:
    return np.array(values, np.float16).view(np.uint8)


@pytest.mark.parametrize(
    ("type_name", "head"),
    [
        ("Q8_0", lambda d: f16_bytes(d)),
        ("Q4_0", lambda d: f16_bytes(d)),
        ("Q4_1", lambda d: f16_bytes(d, 0.5)),  # the min is read as well: NaN in either is refused
        ("Q4_1", lambda d: f16_bytes(0.5, d)),
    ],
)
def test_blocks_with_nan_or_inf_scales_are_refused(type_name, head):
    body = 32 if type_name == "Q8_0" else 16
    good = np.concatenate([head(0.25), np.zeros(body, np.uint8)])
    assert repack(gguf_tensor(type_name, (32, 2), np.concatenate([good, good]))) is not None
    for bad_value in (np.nan, np.inf):
        bad = np.concatenate([head(bad_value), np.zeros(body, np.uint8)])
        with pytest.raises(ModelLoadError, match="blk.0.t has NaN/Inf block scales"):
            repack(gguf_tensor(type_name, (32, 2), np.concatenate([good, bad])))


def test_only_matrices_are_repacked():
    block = np.concatenate([f16_bytes(0.25), np.zeros(32, np.uint8)])
    assert repack(gguf_tensor("Q8_0", (32,), block)) is None
    assert repack(gguf_tensor("Q6_K", (256, 1), np.zeros(210, np.uint8))) is None


def test_auto_weights_per_gguf_type():
    """F32 → f32, F16/BF16 → bf16, Q8_0 → int8, Q4_0/Q4_1 → int4 (lossless); any other type → int8."""
    want = {"F32": "f32", "F16": "bf16", "BF16": "bf16", "Q8_0": "int8", "Q4_0": "int4", "Q4_1": "int4"}
    for other in ("Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "IQ4_NL"):
        want[other] = "int8"
    assert {t: auto_mode(t) for t in want} == want


def test_int4_ragged_last_group_ranges_over_its_own_values():
    """k = 40: the last group holds 8 values; its scale and min come from those alone (a zero pad
    would stretch a group of all-positive values down to 0)."""
    g = torch.Generator().manual_seed(0)
    w = 1 + torch.rand(3, 40, generator=g)  # every value in [1, 2): a zero would be outside
    c = QCodes.quantize(w, "int4")
    last = w[:, 32:]
    assert torch.equal(c.mins[:, 1], last.amin(1))
    assert torch.equal(c.scales[:, 1], (last.amax(1) - last.amin(1)) / 15)


def test_a_fused_matrix_takes_the_finest_mode_and_keeps_codes_already_in_it():
    """q, k as int4 codes (Q4 blocks) and v as int8 codes (Q8_0), as SmolLM2's GGUF mixes them: the
    fused QKV is int8; v's codes are used as they are, q and k re-quantized from their int4 values."""
    g = torch.Generator().manual_seed(1)
    w = {name: torch.randn(rows, 64, generator=g) for name, rows in (("q", 8), ("k", 4), ("v", 4))}
    codes = {"q": QCodes.quantize(w["q"], "int4"), "k": QCodes.quantize(w["k"], "int4")}
    codes["v"] = QCodes.quantize(w["v"], "int8")
    modes = {"q": "int4", "k": "int4", "v": "int8"}
    matrix = make_matrix(modes.__getitem__, w.__getitem__, codes.get, torch.device("cpu"))
    fused = matrix(["q", "k", "v"])
    assert fused.kind == "int8"
    deq = fused.dequantize()
    assert torch.equal(deq[12:], codes["v"].dequantize())
    requantized = QCodes.quantize(torch.cat([codes["q"].dequantize(), codes["k"].dequantize()]), "int8")
    assert torch.equal(deq[:12], requantized.dequantize())
