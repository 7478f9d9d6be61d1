"""lab.metrics (what ``kvlens lab unit`` reports) against independent references: the first-order
prediction as the module docstring writes it, transcribed with plain loops, and checked itself by
Monte Carlo on tiny steps; the measured metrics of ``compare`` against float64 numpy by hand;
``pooled_t`` and the amplitude verdicts on hand-made numbers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvlens.lab.metrics import amplitude_verdicts, compare, pooled_t, predict_sigma


def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max())
    return e / e.sum()


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """out [H, n, d], weights [H, n, L]: query head h reads KV head h // (H / KV)."""
    h_n, n, d = q.shape
    group = h_n // k.shape[0]
    w = np.array([[softmax(k[h // group] @ q[h, i] / math.sqrt(d)) for i in range(n)] for h in range(h_n)])
    out = np.array([[w[h, i] @ v[h // group] for i in range(n)] for h in range(h_n)])
    return out, w


def sigma_loops(q, k, v, s, t) -> np.ndarray:
    """σ_c² = Σ_j w_j² [t_jc²/12 + var(δ_j) (v_jc − out_c)²], var(δ_j) = Σ_c q_c² s_jc² / (12 d)."""
    out, w = attend(q, k, v)
    h_n, n, d = q.shape
    group = h_n // k.shape[0]
    sig = np.zeros_like(out)
    for h in range(h_n):
        g = h // group
        for i in range(n):
            for c in range(d):
                acc = 0.0
                for j in range(k.shape[1]):
                    var_delta = sum(q[h, i, e] ** 2 * s[g, j, e] ** 2 for e in range(d)) / (12 * d)
                    acc += w[h, i, j] ** 2 * (
                        t[g, j, c] ** 2 / 12 + var_delta * (v[g, j, c] - out[h, i, c]) ** 2
                    )
                sig[h, i, c] = math.sqrt(acc)
    return sig


def case(seed: int, heads: int = 4, kv: int = 2, n: int = 2, length: int = 6, d: int = 4):
    g = np.random.default_rng(seed)
    q, k, v = (g.standard_normal(shape) for shape in ((heads, n, d), (kv, length, d), (kv, length, d)))
    s, t = g.uniform(0.02, 0.2, (kv, length, d)), g.uniform(0.02, 0.2, (kv, length, d))
    return q, k, v, s, t


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_prediction_is_the_documented_formula(seed):
    q, k, v, s, t = case(seed)
    tt = [torch.from_numpy(x) for x in (q, k, v, s, t)]
    assert predict_sigma(*tt).numpy() == pytest.approx(sigma_loops(q, k, v, s, t), rel=1e-10)
    only_v = sigma_loops(q, k, v, 0 * s, t)
    only_k = sigma_loops(q, k, v, s, 0 * t)
    assert predict_sigma(*tt[:3], None, tt[4]).numpy() == pytest.approx(only_v, rel=1e-10)
    assert predict_sigma(*tt[:3], tt[3], None).numpy() == pytest.approx(only_k, rel=1e-10)


def test_the_formula_predicts_the_spread_of_uniform_rounding_errors():
    """Monte Carlo, steps small enough that first order holds: errors uniform on ±step/2 in K and V,
    the output's variance per component over 4000 draws against σ² (sampling error ~2 %)."""
    q, k, v, s, t = case(3, heads=2, kv=1, n=1, length=8, d=4)
    s, t = s * 0.01, t * 0.01
    out, _ = attend(q, k, v)
    g = np.random.default_rng(7)
    draws = np.array([attend(q, k + g.uniform(-0.5, 0.5, k.shape) * s, v + g.uniform(-0.5, 0.5, v.shape) * t)[0] - out
                      for _ in range(4000)])  # fmt: skip
    measured = draws.var(axis=0)
    predicted = sigma_loops(q, k, v, s, t) ** 2
    assert float(np.mean(measured / predicted)) == pytest.approx(1.0, abs=0.05)
    assert np.all(np.abs(measured / predicted - 1) < 0.15)


def test_compare_reports_what_its_names_say():
    q, k, v, s, t = case(4)
    g = np.random.default_rng(5)
    k_hat, v_hat = k + 0.1 * g.standard_normal(k.shape), v + 0.1 * g.standard_normal(v.shape)
    out_f, w_f = attend(q, k, v)
    out_q, w_q = attend(q, k_hat, v_hat)
    f32 = [torch.from_numpy(x).float() for x in (q, k, v, k_hat, v_hat)]
    m, delta, _, _ = compare(*f32, torch.from_numpy(s).float(), torch.from_numpy(t).float())
    d = (out_q - out_f).ravel()
    sig = sigma_loops(q, k, v, s.astype(np.float32), t.astype(np.float32))
    want = {
        "max_abs_diff": np.abs(d).max(),
        "mean_abs_diff": np.abs(d).mean(),
        "rel_l2": np.linalg.norm(d) / np.linalg.norm(out_f),
        "cosine": out_f.ravel() @ out_q.ravel() / (np.linalg.norm(out_f) * np.linalg.norm(out_q)),
        "mean_signed_diff": d.mean(),
        "signed_t": d.mean() / (d.std(ddof=1) / math.sqrt(d.size)),
        "frac_positive": np.mean(d > 0),
        "kl_weights": np.mean(np.sum(w_f * np.log(w_f / w_q), axis=-1)),
        "eff_keys": np.mean(1 / np.sum(w_f**2, axis=-1)),
        "out_rms": math.sqrt(np.mean(out_f**2)),
        "k_step_mean": s.mean(),
        "v_step_mean": t.mean(),
        "predicted_mean_abs_diff": math.sqrt(2 / math.pi) * sig.mean(),
        "predicted_rel_l2": math.sqrt(np.sum(sig**2)) / np.linalg.norm(out_f),
    }
    for key, value in want.items():  # the outputs run in float32, the rest in float64 (rel 1e-4 covers it)
        assert m[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    assert m["frac_positive"] == want["frac_positive"]  # no |Δ| near 0 here: the same signs
    # V moved in its first channel only: the other channels' outputs are bit-identical (Δ = 0, not
    # positive), the first moves by +0.5 everywhere
    v_one = f32[2].clone()
    v_one[..., 0] += 0.5
    one = compare(*f32[:3], f32[1], v_one, None, None)[0]
    assert one["frac_positive"] == 1 / 4 and one["mean_signed_diff"] == pytest.approx(0.5 / 4, rel=1e-5)
    given = torch.from_numpy(out_f).float() + 0.5  # a kernel's output given for the quantized side
    assert compare(*f32, None, None, out_q=given)[0]["mean_signed_diff"] == pytest.approx(0.5, rel=1e-6)


def test_pooled_t_by_hand():
    mean, t = pooled_t([torch.tensor([1.0, 2.0]), torch.tensor([3.0])])  # mean 2, sample std 1, n 3
    assert mean == 2.0 and t == pytest.approx(2 * math.sqrt(3))
    assert pooled_t([torch.tensor([1.0, 1.0])]) == (1.0, 0.0)


def _row(scaled, amplitude, rel_l2, quantize="kv"):
    return {"scaled": scaled, "amplitude": amplitude, "rel_l2": rel_l2, "mean_abs_diff": rel_l2 * amplitude,
            "out_rms": amplitude, "eff_keys": 10.0 / amplitude, "kl_weights": rel_l2, "quantize": quantize}  # fmt: skip


def test_amplitude_verdicts_compare_each_amplitude_with_the_first():
    rows = [_row("v", 1, 0.2), _row("v", 2, 0.208), _row("v", 3, 0.21),  # 1.04, 1.05: within 5 %
            _row("k", 1, 0.2), _row("k", 2, 0.2), _row("k", 3, 0.3)]  # fmt: skip
    out = amplitude_verdicts(rows)
    assert "x1: 1.000, x2: 1.040, x3: 1.050 -> holds" in out["v"]
    assert "x1: 1.000, x2: 1.000, x3: 1.500 -> does NOT hold" in out["k"]
    assert "effective keys 10.0 -> 3.3" in out["k"] and "mean|Δ| x4.50, rms(out) x3.00" in out["k"]
