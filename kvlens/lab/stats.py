"""The statistics ``llama-perplexity --kl-divergence`` prints, computed from per-token arrays.

Conventions (those of llama.cpp's perplexity tool, re-derived here; n = number of scored tokens):

* Standard error of a mean: ``se(x) = sqrt(var(x) / (n - 1))`` with ``var`` the population variance
  (``mean(x^2) - mean(x)^2``), i.e. the usual ``s / sqrt(n)``. Zero when n < 2.
* ``PPL = exp(mean nll)``; by the delta method ``err(PPL) = PPL * se(nll)``.
* ``cov = (mean(a*b) - mean(a)*mean(b)) / (n - 1)``: the covariance of the two *means* of nll_q and
  nll_base; ``Cor(ln PPL(Q), ln PPL(base)) = cov / (se(nll_q) * se(nll_base))`` (Pearson r).
* ``ln(PPL(Q)/PPL(base)) = mean(nll_q) - mean(nll_base)``,
  ``err = sqrt(se_q^2 + se_base^2 - 2 cov)``; computed as ``se(nll_q - nll_base)``, which is the
  same number but never takes the square root of a rounding-negative value (llama.cpp prints -nan).
* ``PPL(Q)/PPL(base) = exp(ln ratio)``, ``err = ratio * err(ln ratio)``.
* ``PPL(Q) - PPL(base)``, ``err = sqrt(err_q^2 + err_base^2 - 2 PPL_q PPL_base cov)``; computed as
  ``se(PPL_q * nll_q - PPL_base * nll_base)`` (same number, same reason).
* Percentiles: linear interpolation between order statistics at position ``f * (n - 1)`` of the sorted
  values (numpy's default "linear" method); the median is the 50% point of the same rule.
* Δp = p_q - p_base of the actual next token, reported in %; ``RMS Δp = sqrt(mean Δp^2)`` with
  ``err = se(Δp^2) / (2 RMS)`` (delta method for the square root).
* Same top p = fraction of tokens whose argmax agrees, ``err = sqrt(p (1 - p) / (n - 1))`` (binomial).

Unlike llama.cpp (which prints nothing under 100 tokens and zeroes errors up to 10) every statistic is
returned for any n >= 1; with so few tokens the errors are simply large.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

# (key suffix, fraction, label) of the percentiles llama-perplexity prints, top to bottom.
_KLD_PCTS = [("p999", 0.999, "99.9%"), ("p99", 0.99, "99.0%"), ("p95", 0.95, "95.0%"), ("p90", 0.90, "90.0%")]
_KLD_PCTS_LOW = [
    ("p10", 0.10, "10.0%"),
    ("p05", 0.05, " 5.0%"),
    ("p01", 0.01, " 1.0%"),
    ("p001", 0.001, " 0.1%"),
]
_DP_PCTS = _KLD_PCTS + [("p75", 0.75, "75.0%")]
_DP_PCTS_LOW = [("p25", 0.25, "25.0%")] + _KLD_PCTS_LOW


def _as_f64(x: Any, name: str) -> np.ndarray:
    """Any tensor/array/sequence -> flat float64 numpy array; refuse empty or non-finite input."""
    if isinstance(x, torch.Tensor):
        x = x.detach().to("cpu", torch.float64).numpy()
    a = np.asarray(x, dtype=np.float64).reshape(-1)
    if a.size == 0:
        raise ValueError(f"{name} is empty")
    bad = np.flatnonzero(~np.isfinite(a))
    if bad.size:
        raise ValueError(f"{name} has a non-finite value at index {int(bad[0])} ({a[bad[0]]})")
    return a


def _same_len(**arrays: np.ndarray) -> int:
    sizes = {k: v.size for k, v in arrays.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"per-token arrays differ in length: {sizes}")
    return next(iter(sizes.values()))


def mean_and_err(x: np.ndarray) -> tuple[float, float]:
    """Mean and its standard error ``sqrt(var_pop / (n - 1))`` (0 for n < 2)."""
    n = x.size
    m = float(x.mean())
    return m, (math.sqrt(float(x.var()) / (n - 1)) if n > 1 else 0.0)


def _pct(sorted_x: np.ndarray, f: float) -> float:
    return float(np.quantile(sorted_x, f, method="linear"))


def token_kld(logits_base: torch.Tensor, logits_q: torch.Tensor) -> torch.Tensor:
    """Per-position ``KL(P_base || P_q) = sum_v p_base (ln p_base - ln p_q)`` over the last dim, in float64."""
    if logits_base.shape != logits_q.shape:
        raise ValueError(f"logit shapes differ: {tuple(logits_base.shape)} vs {tuple(logits_q.shape)}")
    lb = torch.log_softmax(logits_base.to(torch.float64), dim=-1)
    lq = torch.log_softmax(logits_q.to(torch.float64), dim=-1)
    pb = lb.exp()
    # Terms with p_base == 0 contribute 0 (and would be 0 * (-inf - x) = nan otherwise).
    return torch.where(pb > 0, pb * (lb - lq), torch.zeros_like(pb)).sum(dim=-1)


def target_nll(logp: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log p of each position's target token, from log-probabilities ``logp [n, V]``."""
    return -logp.gather(-1, targets.to(torch.long).reshape(-1, 1)).squeeze(-1)


def token_metrics(
    logits_base: torch.Tensor, logits_q: torch.Tensor, targets: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Per-token arrays for one chunk: nll_q, nll_base, kld, top_q, top_base (logits [n, V], targets [n]).

    ``targets[i]`` is the actual next token scored at position i. Concatenate these across chunks and
    pass them to :func:`summarize`.
    """
    return {
        "nll_q": target_nll(torch.log_softmax(logits_q.to(torch.float64), dim=-1), targets),
        "nll_base": target_nll(torch.log_softmax(logits_base.to(torch.float64), dim=-1), targets),
        "kld": token_kld(logits_base, logits_q),
        "top_q": logits_q.argmax(dim=-1),
        "top_base": logits_base.argmax(dim=-1),
    }


def ppl_stats(nll_q: Any, nll_base: Any) -> dict[str, float]:
    """Perplexity block: ppl_q, ppl_base (± err), cor_ln_ppl, ln_ratio, ppl_ratio, ppl_diff (± err), n_tokens."""
    a, b = _as_f64(nll_q, "nll_q"), _as_f64(nll_base, "nll_base")
    n = _same_len(nll_q=a, nll_base=b)
    mq, eq = mean_and_err(a)
    mb, eb = mean_and_err(b)
    cov = float(((a - mq) * (b - mb)).mean()) / (n - 1) if n > 1 else 0.0
    cor = cov / (eq * eb) if eq > 0 and eb > 0 else math.nan
    ppl_q, ppl_b = math.exp(mq), math.exp(mb)
    ln_ratio, ln_ratio_err = mean_and_err(a - b)
    _, diff_err = mean_and_err(ppl_q * a - ppl_b * b)
    return {
        "n_tokens": n,
        "ppl_q": ppl_q,
        "ppl_q_err": ppl_q * eq,
        "ppl_base": ppl_b,
        "ppl_base_err": ppl_b * eb,
        "cor_ln_ppl": cor,
        "ln_ratio": ln_ratio,
        "ln_ratio_err": ln_ratio_err,
        "ppl_ratio": math.exp(ln_ratio),
        "ppl_ratio_err": math.exp(ln_ratio) * ln_ratio_err,
        "ppl_diff": ppl_q - ppl_b,
        "ppl_diff_err": diff_err,
    }


def kld_stats(kld: Any) -> dict[str, float]:
    """KL block: kld_mean ± kld_mean_err, kld_max, kld_p999 ... kld_median ... kld_p001, kld_min."""
    x = np.sort(_as_f64(kld, "kld"))
    mean, err = mean_and_err(x)
    out = {"kld_mean": mean, "kld_mean_err": err, "kld_max": float(x[-1])}
    out |= {f"kld_{k}": _pct(x, f) for k, f, _ in _KLD_PCTS}
    out["kld_median"] = _pct(x, 0.5)
    out |= {f"kld_{k}": _pct(x, f) for k, f, _ in _KLD_PCTS_LOW}
    out["kld_min"] = float(x[0])
    return out


def dp_stats(p_q: Any, p_base: Any, top_q: Any, top_base: Any) -> dict[str, float]:
    """Token probability block, all in %: dp_mean ± err, dp_max, percentiles (incl. 75/25), dp_min,
    rms_dp ± rms_dp_err, same_top_p ± same_top_p_err."""
    q, b = _as_f64(p_q, "p_q"), _as_f64(p_base, "p_base")
    tq, tb = _as_f64(top_q, "top_q"), _as_f64(top_base, "top_base")
    n = _same_len(p_q=q, p_base=b, top_q=tq, top_base=tb)
    dp = q - b
    x = np.sort(dp)
    mean, err = mean_and_err(dp)
    out = {"dp_mean": 100 * mean, "dp_mean_err": 100 * err, "dp_max": 100 * float(x[-1])}
    out |= {f"dp_{k}": 100 * _pct(x, f) for k, f, _ in _DP_PCTS}
    out["dp_median"] = 100 * _pct(x, 0.5)
    out |= {f"dp_{k}": 100 * _pct(x, f) for k, f, _ in _DP_PCTS_LOW}
    out["dp_min"] = 100 * float(x[0])
    mse, mse_err = mean_and_err(dp * dp)
    rms = math.sqrt(mse)
    out["rms_dp"] = 100 * rms
    out["rms_dp_err"] = 100 * (0.5 * mse_err / rms if rms > 0 else 0.0)
    same = float(np.mean(tq == tb))
    out["same_top_p"] = 100 * same
    out["same_top_p_err"] = 100 * (math.sqrt(same * (1 - same) / (n - 1)) if n > 1 else 0.0)
    return out


def summarize(nll_q: Any, nll_base: Any, kld: Any, top_q: Any, top_base: Any) -> dict[str, float]:
    """All three blocks from per-token arrays (p = exp(-nll)), ready for :func:`format_kld_report`."""
    a, b = _as_f64(nll_q, "nll_q"), _as_f64(nll_base, "nll_base")
    k, tq, tb = _as_f64(kld, "kld"), _as_f64(top_q, "top_q"), _as_f64(top_base, "top_base")
    _same_len(nll_q=a, nll_base=b, kld=k, top_q=tq, top_base=tb)  # kld_stats alone cannot see a mismatch
    return ppl_stats(a, b) | kld_stats(k) | dp_stats(np.exp(-a), np.exp(-b), tq, tb)


def _pm(v: float, e: float) -> str:
    return f"{v:10.6f} ± {e:10.6f}"


def _quantile_lines(
    s: dict[str, float], key: str, label: str, fmt: str, unit: str, high: list, low: list
) -> list[str]:
    """Maximum, the ``high`` percentiles, median, the ``low`` ones and minimum of ``key``, one a line."""
    rows = [("Maximum", "max"), *((f"{name}  ", k) for k, _, name in high), ("Median ", "median"),
            *((f"{name}  ", k) for k, _, name in low), ("Minimum", "min")]  # fmt: skip
    return [f"{name} {label}: {s[f'{key}_{k}']:{fmt}}{unit}" for name, k in rows]


def format_kld_report(stats: dict[str, float]) -> str:
    """The three blocks in llama-perplexity's layout and field names; blocks whose keys are absent are
    skipped, so the output of any one ``*_stats`` function can be printed alone."""
    s, lines = stats, []
    if "ppl_q" in s:
        lines += [
            "====== Perplexity statistics ======",
            f"Mean PPL(Q)                   : {_pm(s['ppl_q'], s['ppl_q_err'])}",
            f"Mean PPL(base)                : {_pm(s['ppl_base'], s['ppl_base_err'])}",
            f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * s['cor_ln_ppl']:6.2f}%",
            f"Mean ln(PPL(Q)/PPL(base))     : {_pm(s['ln_ratio'], s['ln_ratio_err'])}",
            f"Mean PPL(Q)/PPL(base)         : {_pm(s['ppl_ratio'], s['ppl_ratio_err'])}",
            f"Mean PPL(Q)-PPL(base)         : {_pm(s['ppl_diff'], s['ppl_diff_err'])}",
            "",
        ]
    if "kld_mean" in s:
        lines += [
            "====== KL divergence statistics ======",
            f"Mean    KLD: {_pm(s['kld_mean'], s['kld_mean_err'])}",
        ]
        lines += [*_quantile_lines(s, "kld", "KLD", "10.6f", "", _KLD_PCTS, _KLD_PCTS_LOW), ""]
    if "dp_mean" in s:
        lines += ["====== Token probability statistics ======"]
        lines.append(f"Mean    Δp: {s['dp_mean']:6.3f} ± {s['dp_mean_err']:5.3f} %")
        lines += _quantile_lines(s, "dp", "Δp", "6.3f", "%", _DP_PCTS, _DP_PCTS_LOW)
        lines.append(f"RMS Δp    : {s['rms_dp']:6.3f} ± {s['rms_dp_err']:5.3f} %")
        lines.append(f"Same top p: {s['same_top_p']:6.3f} ± {s['same_top_p_err']:5.3f} %")
        lines.append("")
    return "\n".join(lines)
