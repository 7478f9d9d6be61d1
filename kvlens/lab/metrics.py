"""What quantizing K/V does to one attention output: measured metrics and a first-order prediction.

The analytic prediction (``predict_sigma``)
===========================================

One query ``q`` (dimension d) attends keys ``k_j`` and values ``v_j``, j = 1..L::

    z_j = q·k_j / sqrt(d),   w_j = softmax(z)_j,   out_c = sum_j w_j v_jc

Quantization replaces ``k_jc`` by ``k_jc + a_jc`` and ``v_jc`` by ``v_jc + b_jc``. Model the rounding
errors as independent, zero-mean and uniform on ±step/2 (``s_jc`` for K, ``t_jc`` for V, the
per-element steps every scheme reports), so ``var a_jc = s_jc²/12`` and ``var b_jc = t_jc²/12``.

*V error.* ``Δout_c ⊃ sum_j w_j b_jc``, variance ``sum_j w_j² t_jc²/12``.

*K error.* The logits move by ``δ_j = q·a_j / sqrt(d)``, variance ``sum_c q_c² s_jc² / (12 d)`` (for
one step per row: ``|q|² s_j² / (12 d)``). To first order softmax gives
``Δw_j = w_j (δ_j - sum_i w_i δ_i)``, so

    sum_j Δw_j v_jc = sum_j w_j δ_j v_jc - (sum_i w_i δ_i) out_c = sum_j w_j δ_j (v_jc - out_c)

exactly (the centering term is absorbed by ``- out_c``; no approximation beyond first order), with
variance ``sum_j w_j² var(δ_j) (v_jc - out_c)²`` because the δ_j are independent.

K and V errors are independent, so per output component

    σ_c² = sum_j w_j² [ t_jc²/12 + var(δ_j) (v_jc - out_c)² ]

(drop the first term when V is exact, the second when K is exact). Δout_c is a weighted sum of
many independent errors, hence close to Gaussian: ``E|Δout_c| = sqrt(2/π) σ_c`` and
``E‖Δ‖² = sum_c σ_c²``. Predicted ``mean|Δ| = sqrt(2/π)·mean_c σ_c``,
predicted ``rel_l2 = sqrt(sum_c σ_c²) / ‖out‖``. What it ignores: second-order softmax terms
(large K steps: 2-bit keys), the K×V cross term, and error correlation inside a row (the max
element of a q8 row has zero error: 1 of d values).

A useful reading for N(0,1) data: ``sum_j w_j² = 1/eff_keys`` (``eff_keys`` = effective number of
attended keys), and ``E out_c² ≈ sum_j w_j²``, so the V part of the *relative* error is about
``t/sqrt(12)`` per unit of V scale, whatever the attention shape.
"""

from __future__ import annotations

import math
from typing import Any

import torch

TOLERANCE = 0.05  # amplitude verdict: "unchanged" means within 5% of the first amplitude


def attention64(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float64 attention for the analysis: ``(out [H,n,d], weights [H,n,L], log-weights)`` (GQA)."""
    group = q.shape[0] // k.shape[0]
    q, k, v = (t.to(torch.float64) for t in (q, k, v))
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    logw = torch.log_softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
    w = logw.exp()
    return w @ v, w, logw


def predict_sigma(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_step: torch.Tensor | None,
    v_step: torch.Tensor | None,
) -> torch.Tensor:
    """Predicted std of each output component ``[H, n_q, d]`` (see the module docstring).

    ``k_step``/``v_step`` are per-element steps ``[KV, L, d]``; ``None`` means that tensor is exact.
    """
    group = q.shape[0] // k.shape[0]
    out, w, _ = attention64(q, k, v)
    w2 = w**2  # [H, n, L]
    var = torch.zeros_like(out)
    if v_step is not None:
        t2 = v_step.to(torch.float64).repeat_interleave(group, 0) ** 2 / 12.0  # [H, L, d]
        var += w2 @ t2
    if k_step is not None:
        s2 = k_step.to(torch.float64).repeat_interleave(group, 0) ** 2 / 12.0  # [H, L, d]
        q64 = q.to(torch.float64)
        var_delta = (q64**2) @ s2.transpose(-1, -2) / q.shape[-1]  # [H, n, L]
        vv = v.to(torch.float64).repeat_interleave(group, 0)  # [H, L, d]
        # sum_j w_j² varδ_j (v_jc - out_c)² expanded so no [H, n, L, d] tensor is built
        a = w2 * var_delta
        var += a @ vv**2 - 2 * out * (a @ vv) + out**2 * a.sum(-1, keepdim=True)
    return var.clamp_min(0).sqrt()


def compare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_hat: torch.Tensor,
    v_hat: torch.Tensor,
    k_step: torch.Tensor | None,
    v_step: torch.Tensor | None,
    out_q: torch.Tensor | None = None,
) -> tuple[dict[str, float], torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the reference attention on exact and quantized K/V; return ``(metrics, Δ, out_f, out_q)``.

    Both sides use :func:`kvlens.kernels.reference.reference_attention` in float32 (the seed's
    setting), unless ``out_q`` gives the quantized side's output (a decode kernel's); the KL
    divergence and the prediction are computed in float64 from the same tensors.
    """
    from ..kernels.reference import reference_attention

    out_f = reference_attention(q, k, v)
    if out_q is None:
        out_q = reference_attention(q, k_hat, v_hat)
    delta = (out_q - out_f).to(torch.float64)
    of, oq = out_f.to(torch.float64).flatten(), out_q.to(torch.float64).flatten()
    d = delta.flatten()
    n = d.numel()
    sd = float(d.std(unbiased=True)) if n > 1 else 0.0
    _, w_f, logw_f = attention64(q, k, v)
    _, _, logw_q = attention64(q, k_hat, v_hat)
    kl = (w_f * (logw_f - logw_q)).sum(-1)  # KL(exact || quantized) per (head, query)
    sigma = predict_sigma(q, k, v, k_step, v_step)
    norm = float(of.norm())
    m = {
        "max_abs_diff": float(d.abs().max()),
        "mean_abs_diff": float(d.abs().mean()),
        "rel_l2": float(d.norm()) / norm if norm > 0 else float("nan"),
        "cosine": float(of @ oq / (of.norm() * oq.norm())) if norm > 0 else float("nan"),
        "mean_signed_diff": float(d.mean()),
        "signed_t": float(d.mean()) / (sd / math.sqrt(n)) if sd > 0 else 0.0,
        "frac_positive": float((d > 0).double().mean()),
        "kl_weights": float(kl.mean()),
        "eff_keys": float((1.0 / (w_f**2).sum(-1)).mean()),
        "out_rms": float(of.pow(2).mean().sqrt()),
        "k_step_mean": float(k_step.mean()) if k_step is not None else 0.0,
        "v_step_mean": float(v_step.mean()) if v_step is not None else 0.0,
        "predicted_mean_abs_diff": math.sqrt(2 / math.pi) * float(sigma.mean()),
        "predicted_rel_l2": float(sigma.pow(2).sum().sqrt()) / norm if norm > 0 else float("nan"),
    }
    return m, delta, out_f, out_q


def pooled_t(deltas: list[torch.Tensor]) -> tuple[float, float]:
    """Mean of all signed Δ components pooled over trials and its t-statistic (mean / standard error)."""
    d = torch.cat([x.flatten().to(torch.float64) for x in deltas])
    if d.numel() < 2 or float(d.std()) == 0.0:
        return float(d.mean()), 0.0
    return float(d.mean()), float(d.mean()) / (float(d.std()) / math.sqrt(d.numel()))


def amplitude_verdicts(rows: list[dict[str, Any]]) -> dict[str, str]:
    """Does the seed's "relative error unchanged" hold when V (resp. K) is scaled? Why, in numbers."""
    out = {}
    for which, name in (("v", "V"), ("k", "K")):
        rs = [r for r in rows if r["scaled"] == which]
        base = rs[0]
        ratios = [r["rel_l2"] / base["rel_l2"] for r in rs]
        holds = all(abs(x - 1) <= TOLERANCE for x in ratios)
        parts = ", ".join(f"x{r['amplitude']:g}: {x:.3f}" for r, x in zip(rs, ratios, strict=True))
        top = rs[-1]
        grow = f"mean|Δ| x{top['mean_abs_diff'] / base['mean_abs_diff']:.2f}, rms(out) x{top['out_rms'] / base['out_rms']:.2f}"
        if which == "v":
            why = (
                "V's per-row scales grow with V, so V-hat scales by the same factor (exactly for a power of "
                f"two) and the weights do not change: Δout and out scale together ({grow})"
            )
        else:
            why = (
                f"K×a multiplies every logit by a (softmax temperature 1/a): effective keys "
                f"{base['eff_keys']:.1f} -> {top['eff_keys']:.1f}; "
            )
            if "k" in base["quantize"]:
                why += (
                    f"K's step grows by a too, so the logit errors grow a-fold: KL(w||w-hat) "
                    f"{base['kl_weights']:.2e} -> {top['kl_weights']:.2e}, {grow}"
                )
            else:
                why += f"K is exact here, and the V error relative to |out| hardly depends on the weights ({grow})"
        verdict = "holds" if holds else "does NOT hold"
        out[which] = f"{name} scaled: rel L2 ratio vs x{base['amplitude']:g} = {parts} -> {verdict} ({why})."
    return out
