"""``lab.metrics.compare`` where its statistics degenerate, against what each must then be: nothing
quantized (every difference exactly 0, no t statistic, no steps), an all-zero V (no relative error
exists: NaN, not an exception), and outputs of one or two components (the t statistic needs two)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvlens.lab.metrics import compare


def qkv(h: int, n: int, L: int, d: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(shape, generator=g) for shape in [(h, n, d), (h, L, d), (h, L, d)])


def test_nothing_quantized_gives_exact_zeros() -> None:
    q, k, v = qkv(2, 3, 40, 32)
    m = compare(q, k, v, k.clone(), v.clone(), None, None)[0]
    for key in ["max_abs_diff", "mean_abs_diff", "rel_l2", "mean_signed_diff", "frac_positive", "kl_weights",
                "k_step_mean", "v_step_mean", "predicted_mean_abs_diff", "predicted_rel_l2"]:  # fmt: skip
        assert m[key] == 0.0, key
    assert m["signed_t"] == 0.0  # a zero spread has no t statistic
    assert m["cosine"] == pytest.approx(1.0, rel=1e-12)


def test_an_all_zero_v_has_no_relative_error() -> None:
    q, k, _ = qkv(1, 2, 16, 32)
    v = torch.zeros(1, 16, 32)
    m = compare(q, k, v, k + 0.1, v.clone(), torch.full_like(k, 0.01), None)[0]
    assert m["out_rms"] == 0.0 and m["max_abs_diff"] == 0.0
    assert all(math.isnan(m[key]) for key in ["rel_l2", "cosine", "predicted_rel_l2"])


def test_one_component_has_no_t_and_two_have_theirs() -> None:
    q, k, v = qkv(1, 1, 8, 1, seed=1)
    m = compare(q, k, v, k, v + 0.25, None, torch.full_like(v, 0.5))[0]
    assert m["mean_signed_diff"] == pytest.approx(0.25, rel=1e-6) and m["signed_t"] == 0.0
    q, k, v = qkv(1, 1, 8, 2, seed=2)
    v_hat = v + torch.tensor([0.25, 0.5])
    m, delta, _, _ = compare(q, k, v, k, v_hat, None, torch.full_like(v, 0.5))
    d = delta.double().numpy().ravel()
    assert d.size == 2 and m["signed_t"] == pytest.approx(d.mean() / (d.std(ddof=1) / np.sqrt(2)), rel=1e-12)


def test_a_small_output_still_has_its_cosine() -> None:
    """Only an output of norm exactly 0 lacks a direction: at norm ~1e-3 the cosine is numpy's."""
    q, k, v = qkv(1, 2, 16, 32, seed=3)
    v = v * 1e-4
    m, _, out_f, out_q = compare(q, k, v, k, v * 1.01 + 1e-6, None, torch.full_like(v, 1e-6))
    of, oq = out_f.double().numpy().ravel(), out_q.double().numpy().ravel()
    assert 0 < np.linalg.norm(of) < 1e-2
    assert m["cosine"] == pytest.approx(of @ oq / (np.linalg.norm(of) * np.linalg.norm(oq)), rel=1e-12)
