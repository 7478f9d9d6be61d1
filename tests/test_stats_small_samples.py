"""The statistics at the smallest samples that have them, by hand, and their inputs' shapes: two
tokens already have standard errors and a correlation, a constant side has none; a per-token array given 2-D is taken flat (its
percentiles are the flat array's, not a row's)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvlens.lab.stats import dp_stats, kld_stats, mean_and_err, ppl_stats


def test_two_tokens_by_hand() -> None:
    """nll_q [1, 3], nll_base [1, 2]: means 2 and 1.5; population variances 1 and 0.25 over n - 1 = 1,
    so standard errors 1 and 0.5; covariance of the means 0.5, hence correlation 1; ln ratio [0, 1]:
    0.5 ± 0.5."""
    assert mean_and_err(np.array([1.0, 3.0])) == (2.0, 1.0)
    s = ppl_stats([1.0, 3.0], [1.0, 2.0])
    assert s["ppl_q"] == pytest.approx(math.exp(2)) and s["ppl_q_err"] == pytest.approx(math.exp(2))
    assert s["ppl_base"] == pytest.approx(math.exp(1.5)) and s["ppl_base_err"] == pytest.approx(
        0.5 * math.exp(1.5)
    )
    assert s["cor_ln_ppl"] == pytest.approx(1.0)
    assert (s["ln_ratio"], s["ln_ratio_err"]) == pytest.approx((0.5, 0.5))


def test_a_2d_array_is_taken_flat() -> None:
    kld = np.array([[0.9, 0.1], [0.3, 0.2]])
    assert kld_stats(kld) == kld_stats(kld.ravel())
    assert kld_stats(kld)["kld_median"] == pytest.approx(0.25)  # of 0.1 0.2 0.3 0.9
    p_q, p_b = np.array([[0.5, 0.2], [0.1, 0.4]]), np.array([[0.25, 0.25], [0.25, 0.25]])
    tops = np.array([[1, 2], [3, 4]])
    assert dp_stats(p_q, p_b, tops, tops) == dp_stats(p_q.ravel(), p_b.ravel(), tops.ravel(), tops.ravel())


@pytest.mark.parametrize(
    ("nll_q", "nll_base"), [([2.0, 2.0, 2.0], [1.0, 2.0, 4.0]), ([1.0, 2.0, 4.0], [3.0] * 3)]
)
def test_a_constant_side_has_no_correlation(nll_q, nll_base) -> None:
    """A side whose nll never moves has no spread to correlate with: NaN, as Pearson's r is undefined."""
    s = ppl_stats(nll_q, nll_base)
    assert math.isnan(s["cor_ln_ppl"])
    assert s["ln_ratio"] == pytest.approx(np.mean(nll_q) - np.mean(nll_base))


def test_identical_probabilities_have_no_dp_and_no_error() -> None:
    p, tops = [0.5, 0.25, 0.125, 0.75], [1, 2, 3, 4]
    s = dp_stats(p, p, tops, tops)
    assert (s["dp_mean"], s["dp_mean_err"], s["rms_dp"], s["rms_dp_err"]) == (0.0, 0.0, 0.0, 0.0)
    assert (s["same_top_p"], s["same_top_p_err"]) == (100.0, 0.0)


def test_two_tokens_agreeing_once() -> None:
    """same top p = 1/2, binomial error sqrt(p (1 - p) / (n - 1)) = 0.5: 50 ± 50 %."""
    s = dp_stats([0.5, 0.5], [0.25, 0.5], [1, 2], [1, 3])
    assert (s["same_top_p"], s["same_top_p_err"]) == pytest.approx((50.0, 50.0))
