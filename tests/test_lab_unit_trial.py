"""``lab unit``'s trial, its pooling over trials and its data, against figures worked out here: each
role quantized by its own rule (KIVI's V per token), the bits of K and V averaged, the kernel's
share normalized by the exact output, means and sample standard deviations over trials, the
synthetic distributions' documented moments and outlier channels, and the real source's windows,
GQA heads and range checks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_lab_unit import attention_f64

from kvlens.kernels.reference import reference_attention
from kvlens.kv.schemes import SCHEMES
from kvlens.lab import unit
from kvlens.lab.unit import UnitConfig


def qkv(seed: int = 0, heads: int = 2, kv_heads: int = 1, length: int = 40, d: int = 64):
    g = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(n, rows, d, generator=g)
        for n, rows in ((heads, 1), (kv_heads, length), (kv_heads, length))
    )


def test_v_is_quantized_by_its_own_rule():
    """KIVI's V is grouped per token (32 channels), its K per channel (32 tokens): with only V
    quantized, the error is V's rule's, K's scale is 0, and V's is the mean of V's multipliers."""
    cfg = UnitConfig(scheme="kivi", quantize="v")
    q, k, v = qkv()
    r = unit.run_trial(cfg, q, k, v)
    kivi = SCHEMES["kivi"]
    want = (attention_f64(q, k, kivi.fake_quant(v, "v")) - attention_f64(q, k, v)).abs().max()
    assert r["metrics"]["max_abs_diff"] == pytest.approx(float(want), rel=1e-4)
    assert r["metrics"]["k_scale_mean"] == 0.0
    assert r["metrics"]["v_scale_mean"] == pytest.approx(float(kivi.multiplier(kivi.quantize(v, "v")).mean()))
    assert r["bits_per_value"] == 2 + 64 / 32  # V: one fp32 scale and minimum per 32 values


def test_the_bits_of_k_and_v_are_averaged():
    """40 tokens: KIVI-2's keys (groups of 32 tokens: 32 + 8) cost 2 + 64·2/40 = 5.2 bits, its values
    4; K and V hold equally many values, so the cache costs 4.6."""
    r = unit.run_trial(UnitConfig(scheme="kivi", quantize="kv"), *qkv())
    assert r["bits_per_value"] == pytest.approx(4.6)


def test_the_kernel_share_is_normalized_by_the_exact_output(monkeypatch):
    """A stand-in kernel returning the reference over the quantized K/V plus 0.01 everywhere:
    kernel_rel_l2 = ||0.01|| / ||out_f||, out_f the exact attention (float64 here)."""
    q, k, v = qkv(heads=8, kv_heads=2, length=200)

    def kernel(backend, q, k, v, quantize):
        fq = SCHEMES["q8"].fake_quant
        return reference_attention(q, fq(k), fq(v)) + 0.01

    monkeypatch.setattr(unit, "kernel_attention", kernel)
    r = unit.run_trial(UnitConfig(attn_backend="numba", k_amp=3.0), q, k, v)
    out_f = attention_f64(q, 3.0 * k, v)
    want = math.sqrt(out_f.numel()) * 0.01 / float(out_f.norm())
    assert r["metrics"]["kernel_rel_l2"] == pytest.approx(want, rel=1e-5)


def test_a_point_is_the_mean_over_trials_with_the_sample_std():
    cfg = UnitConfig(seq_len=[64], trials=3, heads=2, kv_heads=1, head_dim=32)
    point = unit.run_point(cfg, 64)
    per_trial = [unit.run_trial(cfg, *unit.synthetic_qkv(cfg, 64, t))["metrics"] for t in range(3)]
    for key in ("max_abs_diff", "rel_l2", "cosine"):
        values = np.array([m[key] for m in per_trial])
        assert point[key] == pytest.approx(values.mean(), rel=1e-12)
        assert point["std"][key] == pytest.approx(values.std(ddof=1), rel=1e-12)
        assert values.std(ddof=1) > 0


def test_uniform_data_has_unit_variance_within_its_bounds():
    _, k, v = unit.synthetic_qkv(UnitConfig(dist="uniform", head_dim=128), 4096, 0)
    for x in (k, v):
        assert float(x.abs().max()) <= math.sqrt(3.0) and float(x.abs().max()) > 1.7
        assert float(x.double().var()) == pytest.approx(1.0, abs=0.01)  # 524,288 samples: sd 0.0012


def test_k_and_v_are_independent_streams():
    _, k, v = unit.synthetic_qkv(UnitConfig(head_dim=128), 2048, 0)
    corr = np.corrcoef(k.flatten().numpy(), v.flatten().numpy())[0, 1]
    assert abs(corr) < 0.01  # 262,144 pairs: sd 0.002


@pytest.mark.parametrize(("dist", "factor"), [("outlier-channels", 10.0), ("outlier-channels:4", 4.0)])
def test_outlier_channels_scale_d_over_32_key_channels(dist, factor):
    """Against the same seed's normal data: d/32 channels of K (4 of 128) times the factor (10 by
    default), every other value of K, and all of V, unchanged."""
    _, k0, v0 = unit.synthetic_qkv(UnitConfig(head_dim=128), 64, 0)
    _, k, v = unit.synthetic_qkv(UnitConfig(head_dim=128, dist=dist), 64, 0)
    ratio = (k / k0)[0]  # [L, d]
    scaled = [c for c in range(128) if torch.allclose(ratio[:, c], torch.full((64,), factor))]
    assert len(scaled) == 4
    assert torch.equal(torch.cat([k[..., c : c + 1] for c in range(128) if c not in scaled], -1),
                       torch.cat([k0[..., c : c + 1] for c in range(128) if c not in scaled], -1))  # fmt: skip
    assert torch.equal(v, v0)


def test_the_amplitude_analysis_reports_its_first_amplitude_first():
    r = unit.run(UnitConfig(seq_len=[64], amplitude=[1.0, 4.0], head_dim=32))
    assert (r.points[0]["amplitude"], r.points[0]["scaled"]) == (1.0, "v")
    assert [(row["amplitude"], row["scaled"]) for row in r.amplitude] == [
        (1.0, "v"),
        (1.0, "k"),
        (4.0, "v"),
        (4.0, "k"),
    ]


def test_a_zero_length_is_refused():
    with pytest.raises(ValueError, match="--seq-len must be one or more positive integers"):
        UnitConfig(seq_len=[64, 0]).validate()


@pytest.mark.slow
def test_real_windows_heads_and_layers(smol_f32):
    """Trial i reads the i-th window after ``seed`` windows; query head 5 of SmolLM2 (9 heads over 3
    KV heads) reads KV head 5 // 3 = 1; layer 30 does not exist (30 layers: 0..29)."""
    a = unit.RealSource(UnitConfig(dist="real", seq_len=[16], layer=2, seed=1), smol_f32)
    b = unit.RealSource(UnitConfig(dist="real", seq_len=[16], layer=2, trials=2), smol_f32)
    for x, y in zip(a.get(16, 0), b.get(16, 1), strict=True):
        assert torch.equal(x, y)
    assert not torch.equal(a.get(16, 0)[1], b.get(16, 0)[1])
    head5 = unit.RealSource(UnitConfig(dist="real", seq_len=[16], layer=2, head=5), smol_f32)
    q, k, v = head5.get(16, 0)
    q_all, k_all, v_all = b.get(16, 0)
    assert torch.equal(q[0], q_all[5]) and torch.equal(k[0], k_all[1]) and torch.equal(v[0], v_all[1])
    n = smol_f32.config.n_layers
    with pytest.raises(ValueError, match=f"--layer {n} out of range"):
        unit.RealSource(UnitConfig(dist="real", seq_len=[16], layer=n), smol_f32)
