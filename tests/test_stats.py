"""llama-perplexity --kl-divergence statistics against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvlens.lab.stats import (
    dp_stats,
    format_kld_report,
    kld_stats,
    ppl_stats,
    summarize,
    token_kld,
    token_metrics,
)

approx = pytest.approx


def test_kld_percentiles_by_hand() -> None:
    # sorted [1, 2, 3, 4, 5]; the f-quantile sits at position f * (n - 1) = 4f, linearly interpolated.
    s = kld_stats(np.array([5.0, 1.0, 4.0, 2.0, 3.0]))
    assert s["kld_max"] == 5.0 and s["kld_min"] == 1.0
    assert s["kld_p999"] == approx(4.996)  # position 3.996
    assert s["kld_p99"] == approx(4.96)
    assert s["kld_p95"] == approx(4.8)
    assert s["kld_p90"] == approx(4.6)
    assert s["kld_median"] == approx(3.0)
    assert s["kld_p10"] == approx(1.4)
    assert s["kld_p05"] == approx(1.2)
    assert s["kld_p01"] == approx(1.04)
    assert s["kld_p001"] == approx(1.004)
    # mean 3, population variance 2 -> se = sqrt(2 / 4)
    assert s["kld_mean"] == approx(3.0) and s["kld_mean_err"] == approx(math.sqrt(0.5))


def test_even_median_averages_the_middle_pair() -> None:
    assert kld_stats(torch.tensor([10.0, 1.0, 3.0, 2.0]))["kld_median"] == approx(2.5)


def test_ppl_stats_by_hand() -> None:
    a = [1.0, 2.0, 3.0, 4.0]  # nll_q: mean 2.5, pop. var 1.25
    b = [1.0, 1.0, 2.0, 2.0]  # nll_base: mean 1.5, pop. var 0.25
    s = ppl_stats(torch.tensor(a, dtype=torch.float64), np.array(b))
    se_q, se_b = math.sqrt(1.25 / 3), math.sqrt(0.25 / 3)
    cov = 0.5 / 3  # mean((a - 2.5) * (b - 1.5)) = 0.5
    assert s["n_tokens"] == 4
    assert s["ppl_q"] == approx(math.exp(2.5)) and s["ppl_q_err"] == approx(math.exp(2.5) * se_q)
    assert s["ppl_base"] == approx(math.exp(1.5)) and s["ppl_base_err"] == approx(math.exp(1.5) * se_b)
    assert s["cor_ln_ppl"] == approx(0.8944271909999159)  # Pearson r = 2 / sqrt(5)
    assert s["ln_ratio"] == approx(1.0) and s["ln_ratio_err"] == approx(math.sqrt(1 / 6))
    assert math.sqrt(se_q**2 + se_b**2 - 2 * cov) == approx(math.sqrt(1 / 6))  # llama.cpp's form agrees
    assert s["ppl_ratio"] == approx(math.e) and s["ppl_ratio_err"] == approx(math.e * math.sqrt(1 / 6))
    pq, pb = math.exp(2.5), math.exp(1.5)
    assert s["ppl_diff"] == approx(pq - pb)
    assert s["ppl_diff_err"] == approx(math.sqrt((pq * se_q) ** 2 + (pb * se_b) ** 2 - 2 * pq * pb * cov))


def test_dp_stats_by_hand() -> None:
    p_q = [0.5, 0.2, 0.9, 0.4]
    p_b = [0.4, 0.2, 0.6, 0.6]  # dp = [0.1, 0, 0.3, -0.2]
    s = dp_stats(p_q, p_b, [1, 2, 3, 4], [1, 2, 3, 5])
    assert s["dp_mean"] == approx(5.0)
    assert s["dp_mean_err"] == approx(100 * math.sqrt(0.0325 / 3))  # pop. var = 0.035 - 0.05^2
    assert s["dp_max"] == approx(30.0) and s["dp_min"] == approx(-20.0)
    assert s["dp_median"] == approx(5.0)  # mean of 0 and 0.1
    assert s["dp_p75"] == approx(15.0)  # position 2.25 between 0.1 and 0.3
    assert s["dp_p25"] == approx(-5.0)  # position 0.75 between -0.2 and 0
    assert s["rms_dp"] == approx(100 * math.sqrt(0.035))
    # se(dp^2) = sqrt((mean dp^4 - 0.035^2) / 3) = sqrt(1.225e-3 / 3); err = se / (2 rms)
    assert s["rms_dp_err"] == approx(100 * 0.5 * math.sqrt(1.225e-3 / 3) / math.sqrt(0.035))
    assert s["same_top_p"] == approx(75.0) and s["same_top_p_err"] == approx(25.0)


def test_token_kld_by_hand_and_zero_prob_terms() -> None:
    base = torch.tensor([[0.0, 0.0], [0.0, -math.inf]])
    q = torch.tensor([[math.log(3.0), 0.0], [0.0, 0.0]])
    kld = token_kld(base, q)
    assert kld.dtype == torch.float64
    assert kld[0].item() == approx(0.5 * math.log(4 / 3))  # p=[.5,.5] vs q=[.75,.25]
    assert kld[1].item() == approx(math.log(2.0))  # p=[1,0] vs q=[.5,.5]; the p=0 term adds 0, not nan


def test_identical_logits_give_exact_zero_and_full_agreement() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(200, 64, generator=g) * 5
    targets = torch.randint(0, 64, (200,), generator=g)
    assert torch.equal(token_kld(logits, logits.clone()), torch.zeros(200, dtype=torch.float64))
    s = summarize(**token_metrics(logits, logits.clone(), targets))
    assert s["same_top_p"] == 100.0 and s["same_top_p_err"] == 0.0
    assert s["kld_max"] == 0.0 and s["ln_ratio"] == 0.0 and s["ppl_ratio"] == 1.0 and s["ppl_diff"] == 0.0
    assert s["rms_dp"] == 0.0 and s["cor_ln_ppl"] == approx(1.0)


def numpy_kld(base: np.ndarray, q: np.ndarray) -> np.ndarray:
    """KL(P_base || P_q) per row, written out in float64 numpy: sum p (ln p - ln q)."""
    lp = base - base.max(-1, keepdims=True)
    lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
    lq = q - q.max(-1, keepdims=True)
    lq = lq - np.log(np.exp(lq).sum(-1, keepdims=True))
    return (np.exp(lp) * (lp - lq)).sum(-1)


def test_kld_by_hand() -> None:
    # P = (1/2, 1/2), Q = (3/4, 1/4): KL = 1/2 ln(2/3) + 1/2 ln 2 = 1/2 ln(4/3); KL(P||P) = 0
    base = torch.tensor([[0.0, 0.0], [1.0, 2.0]], dtype=torch.float64)
    q = torch.tensor([[math.log(3.0), 0.0], [1.0, 2.0]], dtype=torch.float64)
    assert token_kld(base, q).tolist() == approx([0.5 * math.log(4 / 3), 0.0], abs=1e-15)
    # direction: KL(Q||P) = 3/4 ln(3/2) + 1/4 ln(1/2) differs from KL(P||Q)
    assert token_kld(q[:1], base[:1]).item() == approx(0.75 * math.log(1.5) + 0.25 * math.log(0.5))


@settings(max_examples=50, deadline=None)
@given(
    n=st.integers(1, 4),
    v=st.integers(2, 40),
    seed=st.integers(0, 2**31 - 1),
    scale=st.floats(1e-4, 30.0),
)
@example(n=4, v=3, seed=1155115455, scale=1e-3)  # 1.5x over the old bound, which shrank with the scale
def test_kld_equals_float64_reference(n: int, v: int, seed: int, scale: float) -> None:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, v, generator=g) * scale
    q = base + torch.randn(n, v, generator=g) * scale * torch.rand(1, generator=g)
    want = numpy_kld(base.double().numpy(), q.double().numpy())
    # Each float64 log-probability is off by <= (v + 3)·u·(R + ln v), R the row's logit range (the
    # shift by the max, the v-term sum and its log); KL sums v products of two of them, computed twice
    # (kvlens and numpy): 4(v + 4)·u·(R + ln v) absolute, not shrinking with the scale. rtol covers
    # the second-order term through p (|ln p - ln q| up to ~2R, relative to a large KL).
    spread = max(float((x.max(-1).values - x.min(-1).values).max()) for x in (base, q))
    atol = 4 * (v + 4) * 2.0**-53 * (spread + math.log(v))
    np.testing.assert_allclose(token_kld(base, q).numpy(), want, rtol=1e-9, atol=atol)


def test_token_metrics_matches_direct_computation() -> None:
    g = torch.Generator().manual_seed(1)
    base, q = torch.randn(50, 30, generator=g), torch.randn(50, 30, generator=g)
    t = torch.randint(0, 30, (50,), generator=g)
    m = token_metrics(base, q, t)
    ref = -torch.log_softmax(q.double(), -1)[torch.arange(50), t]
    assert torch.allclose(m["nll_q"], ref)
    assert torch.equal(m["top_base"], base.argmax(-1))
    s = summarize(**m)
    assert s["n_tokens"] == 50
    assert s["same_top_p"] == approx(100.0 * (base.argmax(-1) == q.argmax(-1)).double().mean().item())
    assert s["kld_min"] == approx(numpy_kld(base.double().numpy(), q.double().numpy()).min(), abs=1e-12)


def test_report_has_llama_blocks_and_fields() -> None:
    g = torch.Generator().manual_seed(2)
    base = torch.randn(120, 16, generator=g)
    m = token_metrics(
        base, base + 0.1 * torch.randn(120, 16, generator=g), torch.randint(0, 16, (120,), generator=g)
    )
    s = summarize(**m)
    out = format_kld_report(s)
    for line in [
        "====== Perplexity statistics ======",
        "Mean PPL(Q)                   : ",
        "Cor(ln(PPL(Q)), ln(PPL(base))): ",
        "Mean PPL(Q)-PPL(base)         : ",
        "====== KL divergence statistics ======",
        "99.9%   KLD: ",
        " 0.1%   KLD: ",
        "Minimum KLD: ",
        "====== Token probability statistics ======",
        "75.0%   Δp: ",
        "RMS Δp    : ",
        "Same top p: ",
    ]:
        assert line in out, line
    mean_line = next(x for x in out.splitlines() if x.startswith("Mean    KLD:"))
    assert float(mean_line.split(":")[1].split("±")[0]) == approx(s["kld_mean"], abs=1e-6)
    only_kld = format_kld_report(kld_stats(m["kld"]))
    assert "KL divergence" in only_kld and "Perplexity" not in only_kld


def test_summarize_gives_dp_the_probabilities_of_both_sides() -> None:
    """Δp is taken between p_q = exp(-nll_q) and p_base = exp(-nll_base): here 0.5 against 0.25 on
    every token, so +25 %, and the other blocks are the blocks of the same arrays."""
    nll_q, nll_b = [math.log(2)] * 3, [math.log(4)] * 3
    s = summarize(nll_q, nll_b, [0.1, 0.2, 0.3], [1, 2, 3], [1, 2, 4])
    assert s["dp_mean"] == approx(25.0) and s["dp_min"] == approx(25.0) and s["rms_dp"] == approx(25.0)
    assert s["same_top_p"] == approx(100 * 2 / 3) and s["kld_mean"] == approx(0.2)
    assert s["ppl_q"] == approx(2.0) and s["ppl_base"] == approx(4.0) and s["ppl_ratio"] == approx(0.5)


def test_report_prints_each_figure_on_its_own_line() -> None:
    """The printed numbers are the named statistics', in llama-perplexity's units (Cor in %)."""
    s = ppl_stats([1.0, 2.0, 3.0, 4.0], [1.0, 1.0, 2.0, 2.0])  # by hand: test_ppl_stats_by_hand
    lines = {
        x.split(":")[0].strip(): x.split(":", 1)[1] for x in format_kld_report(s).splitlines() if ":" in x
    }
    assert lines["Mean PPL(Q)"] == f" {math.exp(2.5):10.6f} ± {math.exp(2.5) * math.sqrt(1.25 / 3):10.6f}"
    assert lines["Mean PPL(base)"] == f" {math.exp(1.5):10.6f} ± {math.exp(1.5) * math.sqrt(0.25 / 3):10.6f}"
    assert lines["Cor(ln(PPL(Q)), ln(PPL(base)))"] == "  89.44%"  # r = 2 / sqrt(5)
    assert lines["Mean ln(PPL(Q)/PPL(base))"] == f" {1.0:10.6f} ± {math.sqrt(1 / 6):10.6f}"
    assert lines["Mean PPL(Q)/PPL(base)"].startswith(f" {math.e:10.6f} ± ")


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="differ in length"):
        ppl_stats([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="non-finite value at index 1"):
        kld_stats([0.1, float("nan")])
    with pytest.raises(ValueError, match="empty"):
        kld_stats([])
    with pytest.raises(ValueError, match="shapes differ"):
        token_kld(torch.zeros(2, 3), torch.zeros(2, 4))


def test_single_token_has_zero_errors() -> None:
    s = summarize([1.0], [0.5], [0.2], [3], [3])
    assert s["ppl_q_err"] == 0.0 and s["kld_mean_err"] == 0.0 and s["same_top_p_err"] == 0.0
    assert math.isnan(s["cor_ln_ppl"])
