"""``lab doctor``'s findings on rows built by hand, where every figure is known exactly: the outlier
ratio, the key offset, the attention on position 0 (against a numpy float64 softmax), the layout
rules, the consequences measured once per (layer, kind) with only that layer quantized, and the
printed rows (``test_doctor`` runs the whole command on a model with planted outliers)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvlens.kv.modes import StoreKind
from kvlens.lab import doctor
from kvlens.lab.doctor import (
    DoctorConfig,
    DoctorResult,
    Finding,
    channel_findings,
    consequences,
    layout_findings,
    recipe_line,
    sink_findings,
    table_rows,
    usable,
)

N = 8  # positions (even: the alternating signs cancel in the mean)
SIGN = torch.tensor([(-1.0) ** t for t in range(N)])  # +1, -1, ...


def rows(*channels: torch.Tensor) -> torch.Tensor:
    """One KV head's rows [n, d] from per-channel columns of n values."""
    return torch.stack(channels, dim=-1)


def flat(value: float) -> torch.Tensor:
    return torch.full((N,), value)


def test_an_outlier_channel_is_its_rms_over_the_median_channels():
    """V rows: head 0 clean (RMS 1 in every channel), head 1 channel 3 at exactly 6x: flagged, at the
    ratio's boundary (>=); 5.99x is not. V rows carry no offset finding, whatever their mean."""
    clean = rows(*[SIGN] * 8)
    six = rows(*[SIGN] * 3, 6.0 * SIGN, *[SIGN] * 4)
    found = channel_findings(2, "v", torch.stack([clean, six]))
    assert [(f.kind, f.layer, f.head) for f in found] == [("outlier-v", 2, 1)]
    assert found[0].value == 6.0 and found[0].detail == "channel 3: RMS 6.0x the median channel"
    under = rows(*[SIGN] * 3, 5.99 * SIGN, *[SIGN] * 4)
    assert channel_findings(2, "v", torch.stack([clean, under])) == []
    offset = rows(flat(50.0), *[SIGN] * 7)  # a large mean in V: not a finding (its RMS ratio is 50)
    assert [f.kind for f in channel_findings(0, "v", offset[None])] == ["outlier-v"]


def test_the_median_is_of_channels_not_a_mean():
    """Three channels at RMS 1, four at 2, one at 12: the median channel is 2 (12 / 2 = 6: flagged);
    their mean, 2.875, would put the outlier at 4.2x."""
    x = rows(*[SIGN] * 3, *[2.0 * SIGN] * 4, 12.0 * SIGN)
    (f,) = channel_findings(0, "v", x[None])
    assert f.value == 6.0 and f.detail.startswith("channel 7:")


def test_the_ratio_is_of_root_mean_squares():
    """A channel at 10, 0, 10, 0, ... has RMS sqrt(50) = 7.07 (flagged) where its mean |x| is 5."""
    x = rows(*[SIGN] * 7, torch.tensor([10.0, 0.0] * (N // 2)))
    (f,) = channel_findings(0, "v", x[None])
    assert f.value == pytest.approx(math.sqrt(50.0), rel=1e-12) and f.detail.startswith("channel 7:")


def test_the_key_offset_is_the_mean_over_the_spread_around_it():
    """K rows (3, ±2, ±2, ±1): mean (3, 0, 0, 0), spread sqrt(4 + 4 + 1) = 3, offset exactly 1.0
    (flagged: the boundary is >=); with 2.9 in place of 3 it is 0.967, not flagged. RMS per channel
    (3, 2, 2, 1): no outlier."""
    k = rows(flat(3.0), 2.0 * SIGN, 2.0 * SIGN, SIGN)
    found = channel_findings(4, "k", torch.stack([k, k]))
    assert [(f.kind, f.layer, f.head, f.value) for f in found] == [
        ("offset-k", 4, 0, 1.0),
        ("offset-k", 4, 1, 1.0),
    ]
    assert found[0].detail == "|mean k| = 1.00x the RMS spread around it"
    assert channel_findings(4, "k", rows(flat(2.9), 2.0 * SIGN, 2.0 * SIGN, SIGN)[None]) == []


def test_boundaries_move_with_their_thresholds(monkeypatch):
    monkeypatch.setattr(doctor, "OUTLIER_RATIO", math.nextafter(6.0, 7.0))
    assert channel_findings(0, "v", rows(*[SIGN] * 3, 6.0 * SIGN, *[SIGN] * 4)[None]) == []
    monkeypatch.setattr(doctor, "OFFSET_RATIO", math.nextafter(1.0, 2.0))
    assert channel_findings(0, "k", rows(flat(3.0), 2.0 * SIGN, 2.0 * SIGN, SIGN)[None]) == []


def softmax_to_first(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Mean causal softmax weight on key 0 over the second half's queries, per query head (numpy)."""
    n_heads, n, d = q.shape
    group = n_heads // k.shape[0]
    out = []
    for h in range(n_heads):
        kh = k[h // group]
        weights = []
        for t in range(n // 2, n):
            s = kh[: t + 1] @ q[h, t] / math.sqrt(d)
            e = np.exp(s - s.max())
            weights.append(e[0] / e.sum())
        out.append(np.mean(weights))
    return np.array(out)


def test_sinks_are_the_second_halfs_attention_on_position_0():
    """Three query heads over one KV head: head 0's query is zero (uniform causal weights: the mean of
    1/(t+1) over the second half), head 1 points at key 0 (small random keys elsewhere), head 2 away."""
    gen = torch.Generator().manual_seed(1)
    n, d = 8, 4
    k = 0.1 * torch.randn(1, n, d, generator=gen, dtype=torch.float64)
    k[0, 0] = torch.tensor([2.0, 0.0, 0.0, 0.0])
    q = torch.zeros(3, n, d, dtype=torch.float64)
    q[1, :, 0], q[2, :, 0] = 3.0, -3.0
    v = torch.randn(1, n, d, generator=gen, dtype=torch.float64)
    want = softmax_to_first(q.numpy(), k.numpy())
    assert want[0] == pytest.approx(np.mean([1 / (t + 1) for t in range(n // 2, n)]), rel=1e-12)
    assert want[1] > doctor.SINK_WEIGHT > max(want[0], want[2])
    found = sink_findings(5, q, k, v)
    assert [(f.kind, f.layer, f.head) for f in found] == [("sink", 5, 1)]
    assert found[0].value == pytest.approx(want[1], rel=1e-12)
    assert found[0].detail == f"query head 1: {100 * want[1]:.0f}% of attention on position 0"


def test_a_sink_at_exactly_the_threshold_is_flagged(monkeypatch):
    q, k, v = torch.zeros(1, 6, 4), torch.zeros(1, 6, 4), torch.zeros(1, 6, 4)
    share = float(np.mean([1 / 4, 1 / 5, 1 / 6]))  # uniform weights, queries 3..5
    monkeypatch.setattr(doctor, "SINK_WEIGHT", share)
    (f,) = sink_findings(0, q, k, v)
    assert f.value == pytest.approx(share, rel=1e-15)
    monkeypatch.setattr(doctor, "SINK_WEIGHT", math.nextafter(share, 1.0) + 1e-12)
    assert sink_findings(0, q, k, v) == []


@pytest.mark.parametrize(
    ("head_dim", "words"),
    [
        (64, []),
        (16, ["not a multiple of 32: no q4/q4h"]),
        (96, ["not a power of two: no q8h/q4h"]),
        (80, ["not a power of two: no q8h/q4h", "not a multiple of 32: no q4/q4h"]),
    ],
)
def test_layout_findings(head_dim, words):
    found = layout_findings(head_dim)
    assert [f.detail for f in found] == [f"head_dim {head_dim} is {w}" for w in words]
    assert all((f.kind, f.layer, f.head, f.value) == ("layout", None, None, head_dim) for f in found)


def test_usable_kinds_follow_the_layout():
    q8, q8h, q4h = StoreKind.Q8, StoreKind.Q8H, StoreKind.Q4H
    assert usable([q8, q8h, q4h], 64) == [q8, q8h, q4h]
    assert usable([q8, q8h, q4h], 96) == [q8]
    assert usable([q8h, q4h], 48) == []


class CountingSensitivity:
    """Stands in for :class:`Sensitivity`: records each mode it is asked to score; KLD by formula."""

    def __init__(self, n_layers: int) -> None:
        self.llm = SimpleNamespace(config=SimpleNamespace(n_layers=n_layers))
        self.modes = []

    def kld(self, mode) -> float:
        self.modes.append(mode)
        changed = [
            i for i in range(self.llm.config.n_layers) if mode.kinds(i) != (StoreKind.F32, StoreKind.F32)
        ]
        (layer,) = changed
        return 0.001 * (layer + 1) * (2 if mode.kinds(layer)[0] == StoreKind.Q4H else 1)


def test_consequences_quantize_only_the_finding_s_layer_once_per_kind():
    sens = CountingSensitivity(n_layers=4)
    findings = [
        Finding("outlier-k", 2, 0, 9.0, ""),
        Finding("offset-k", 2, 1, 1.5, ""),  # the same layer: measured once
        Finding("sink", 0, 3, 0.5, ""),
        Finding("layout", None, None, 80, ""),
    ]
    consequences(sens, findings, [StoreKind.Q8, StoreKind.Q4H])
    assert findings[0].kld == findings[1].kld == {"q8": 0.003, "q4h": 0.006}
    assert findings[2].kld == {"q8": 0.001, "q4h": 0.002} and findings[3].kld == {}
    asked = [tuple(m.kinds(i) for i in range(4)) for m in sens.modes]
    f32 = (StoreKind.F32, StoreKind.F32)
    assert len(asked) == 4 and len(set(asked)) == 4
    for kind in (StoreKind.Q8, StoreKind.Q4H):
        assert (f32, f32, (kind, kind), f32) in asked and ((kind, kind), f32, f32, f32) in asked


def test_the_doctor_refuses_kept_exact_positions():
    for option in ({"keep_sink": 4}, {"keep_recent": 4}):
        with pytest.raises(ValueError, match="keep_sink and keep_recent must be 0"):
            DoctorConfig(**option)


def test_rows_and_the_recipe_line_as_printed():
    findings = [
        Finding(
            "outlier-k",
            1,
            0,
            12.345,
            "channel 5: RMS 12.3x the median channel",
            {"q8": 0.00012, "q4h": 0.0345},
        ),
        Finding("layout", None, None, 80, "head_dim 80 is not a power of two: no q8h/q4h"),
    ]
    r = DoctorResult("m", "c", 64, 80, findings, {"kld_budget": 0.005}, 0.0041, "q8h 3/4, q4h 1/4", 12.4, 7)
    assert table_rows(r) == [
        ["outlier-k", "1", "0", "12.3", "channel 5: RMS 12.3x the median channel", "0.00012", "0.0345"],
        ["layout", "", "", "80", "head_dim 80 is not a power of two: no q8h/q4h", "", ""],
    ]
    assert recipe_line(r) == (
        "recommended recipe (budget 0.005, measured KLD 0.0041 on the calibration text), per (layer, KV "
        "head): q8h 3/4, q4h 1/4; 7 KLD passes, 12 s"
    )
    assert r.to_json()["findings"][0]["kld"] == {"q8": 0.00012, "q4h": 0.0345}
