"""``lab unit``'s pooled signed-error statistic and amplitude verdicts, whole: the t statistic in float64
for any number of components from two up (numpy as the reference), and each verdict's full sentence,
written out here by hand for the three cases the command meets (V scaled; K scaled with K quantized;
K scaled with K exact)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvlens.lab.metrics import amplitude_verdicts, pooled_t


def numpy_t(parts: list[np.ndarray]) -> tuple[float, float]:
    d = np.concatenate([p.astype(np.float64).ravel() for p in parts])
    return float(d.mean()), float(d.mean() / (d.std(ddof=1) / np.sqrt(d.size)))


def test_two_components_get_their_t() -> None:
    """n = 2 is the smallest sample with a standard error: [1, 3] has mean 2, s = √2, t = 2 / (√2/√2)."""
    assert pooled_t([torch.tensor([1.0, 3.0])]) == pytest.approx((2.0, 2.0), rel=1e-15)
    assert pooled_t([torch.tensor([1.0]), torch.tensor([3.0])]) == pytest.approx((2.0, 2.0), rel=1e-15)


def test_one_component_has_no_t() -> None:
    assert pooled_t([torch.tensor([0.25])]) == (0.25, 0.0)


def test_float32_deltas_are_pooled_in_float64() -> None:
    """Float32 components near 1e4 with a small spread: a float32 mean and standard deviation are off in
    the 4th digit of t; the float64 statistic matches numpy's to 1e-9."""
    g = torch.Generator().manual_seed(0)
    parts = [1e4 + torch.rand(50_000, generator=g) for _ in range(3)]
    want = numpy_t([p.numpy() for p in parts])
    assert pooled_t(parts) == pytest.approx(want, rel=1e-9)


def _row(scaled: str, amplitude: float, rel_l2: float, quantize: str, out_rms: float) -> dict:
    return {"scaled": scaled, "amplitude": amplitude, "rel_l2": rel_l2, "mean_abs_diff": 0.01 * amplitude,
            "out_rms": out_rms, "eff_keys": 12.0 / amplitude, "kl_weights": 1e-4 * amplitude**2,
            "quantize": quantize}  # fmt: skip


V_SCALED = (
    [_row("v", 1, 0.2, "kv", 0.5), _row("v", 4, 0.2, "kv", 1.5),
     _row("k", 1, 0.2, "kv", 0.5), _row("k", 4, 0.2, "kv", 0.5)],
    "v",
    "V scaled: rel L2 ratio vs x1 = x1: 1.000, x4: 1.000 -> holds (V's per-row scales grow with V, "
    "so V-hat scales by the same factor (exactly for a power of two) and the weights do not change: "
    "Δout and out scale together (mean|Δ| x4.00, rms(out) x3.00)).",
)  # fmt: skip
K_QUANTIZED = (
    [_row("v", 1, 0.2, "kv", 0.5), _row("v", 2, 0.2, "kv", 1.0),
     _row("k", 1, 0.2, "kv", 0.5), _row("k", 2, 0.3, "kv", 0.25)],
    "k",
    "K scaled: rel L2 ratio vs x1 = x1: 1.000, x2: 1.500 -> does NOT hold (K×a multiplies every logit "
    "by a (softmax temperature 1/a): effective keys 12.0 -> 6.0; K's step grows by a too, so the logit "
    "errors grow a-fold: KL(w||w-hat) 1.00e-04 -> 4.00e-04, mean|Δ| x2.00, rms(out) x0.50).",
)  # fmt: skip
K_EXACT = (
    [_row("v", 1, 0.2, "v", 0.5), _row("v", 2, 0.2, "v", 1.0),
     _row("k", 1, 0.2, "v", 0.5), _row("k", 3, 0.192, "v", 0.4)],
    "k",
    "K scaled: rel L2 ratio vs x1 = x1: 1.000, x3: 0.960 -> holds (K×a multiplies every logit by a "
    "(softmax temperature 1/a): effective keys 12.0 -> 4.0; K is exact here, and the V error relative "
    "to |out| hardly depends on the weights (mean|Δ| x3.00, rms(out) x0.80)).",
)  # fmt: skip


@pytest.mark.parametrize(
    ("rows", "which", "sentence"), [V_SCALED, K_QUANTIZED, K_EXACT], ids=["v", "k-quantized", "k-exact"]
)
def test_the_verdict_in_full(rows, which, sentence) -> None:
    assert amplitude_verdicts(rows)[which] == sentence
