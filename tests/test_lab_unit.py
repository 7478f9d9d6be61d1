"""`kvlens lab unit`: the reference attention, determinism, exact amplitude scaling, the prediction, CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from kvlens.cli import app
from kvlens.kernels.reference import reference_attention
from kvlens.lab import unit
from kvlens.lab.unit import UnitConfig

KEYS = ["max_abs_diff", "mean_abs_diff", "rel_l2", "cosine", "mean_signed_diff", "k_step_mean", "v_step_mean",
        "predicted_mean_abs_diff"]  # fmt: skip


def attention_f64(q, k, v):
    """An independent float64 attention: explicit loop over query heads, GQA by index."""
    h, _, d = q.shape
    group = h // k.shape[0]
    outs = []
    for i in range(h):
        kk, vv = k[i // group].double(), v[i // group].double()
        s = q[i].double() @ kk.T / math.sqrt(d)
        w = torch.exp(s - s.max(dim=-1, keepdim=True).values)
        outs.append((w / w.sum(dim=-1, keepdim=True)) @ vv)
    return torch.stack(outs)


@pytest.mark.parametrize("h,kvh,n_q", [(1, 1, 1), (8, 2, 3), (4, 4, 1)])
def test_reference_attention_equals_float64(h, kvh, n_q):
    g = torch.Generator().manual_seed(h * 10 + kvh)
    q, k, v = (
        torch.randn(h, n_q, 64, generator=g),
        torch.randn(kvh, 100, 64, generator=g),
        torch.randn(kvh, 100, 64, generator=g),
    )
    ref = attention_f64(q, k, v)
    assert (reference_attention(q.double(), k.double(), v.double()) - ref).abs().max() < 1e-12
    assert (reference_attention(q, k, v) - ref).abs().max() < 1e-5


def test_default_run_is_deterministic_and_json_has_the_keys():
    a, b = unit.run(UnitConfig()), unit.run(UnitConfig())
    assert unit.to_json(a) == unit.to_json(b)
    obj = json.loads(unit.to_json(a))
    assert isinstance(obj, dict) and all(isinstance(obj[k], float) for k in KEYS)
    assert obj["seq_len"] == 256 and obj["head_dim"] == 128 and obj["scheme"] == "q8"
    assert unit.to_json(unit.run(UnitConfig(seed=1))) != unit.to_json(a)


def test_v_amp_2_doubles_the_absolute_error_exactly():
    one = unit.run(UnitConfig(quantize="v", v_amp=1.0)).points[0]
    two = unit.run(UnitConfig(quantize="v", v_amp=2.0)).points[0]
    assert two["max_abs_diff"] == 2 * one["max_abs_diff"]
    assert two["mean_abs_diff"] == 2 * one["mean_abs_diff"]
    assert two["rel_l2"] == one["rel_l2"]


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"quantize": "k"},
        {"quantize": "v"},
        {"scheme": "q8_0"},
        {"scheme": "fp8"},
        {"heads": 4, "kv_heads": 2},
    ],
)
def test_prediction_within_factor_of_measured(kw):
    p = unit.run(UnitConfig(trials=6, **kw)).points[0]
    for meas, pred in (("mean_abs_diff", "predicted_mean_abs_diff"), ("rel_l2", "predicted_rel_l2")):
        assert 0.7 <= p[pred] / p[meas] <= 1.4, (meas, p[meas], p[pred])


def test_rounding_is_not_biased_on_gaussian_data():
    p = unit.run(UnitConfig(trials=8)).points[0]
    assert abs(p["signed_t"]) < 4 and 0.4 < p["frac_positive"] < 0.6


def test_sweep_extends_the_same_keys_and_plots(tmp_path):
    r = unit.run(UnitConfig(seq_len=[32, 64]))
    obj = json.loads(unit.to_json(r))
    assert isinstance(obj, list) and [o["seq_len"] for o in obj] == [32, 64]
    k32 = unit.synthetic_qkv(UnitConfig(), 32, 0)[1]
    k64 = unit.synthetic_qkv(UnitConfig(), 64, 0)[1]
    assert torch.equal(k64[:, :32], k32)  # one variable at a time: a longer L adds keys
    png = unit.write_plot(r, tmp_path / "sweep.png")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_amplitude_v_holds_k_does_not():
    r = unit.run(UnitConfig(amplitude=[1, 3], trials=4))
    rows = {(x["scaled"], x["amplitude"]): x for x in r.amplitude}
    assert rows[("v", 3)]["rel_l2"] == pytest.approx(rows[("v", 1)]["rel_l2"], rel=1e-3)
    assert rows[("k", 3)]["rel_l2"] / rows[("k", 1)]["rel_l2"] > 1.2
    assert "-> holds" in r.verdicts["v"] and "does NOT hold" in r.verdicts["k"]


@pytest.mark.parametrize("dist", ["uniform", "student-t:3", "outlier-channels", "outlier-channels:20"])
def test_distributions_are_seeded(dist):
    a = unit.synthetic_qkv(UnitConfig(dist=dist), 64, 0)
    b = unit.synthetic_qkv(UnitConfig(dist=dist), 64, 0)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert 0.5 < float(a[2].std()) < 1.5  # V keeps unit scale; only K gets the outlier channels


@pytest.mark.parametrize(
    "kw,msg",
    [({"scheme": "q3"}, "unknown scheme"), ({"dist": "cauchy"}, "unknown --dist"), ({"quantize": "q"}, "--quantize"),
     ({"heads": 3, "kv_heads": 2}, "multiple"), ({"amplitude": [1, 3], "seq_len": [64, 128]}, "single"),
     ({"k_amp": 0.0}, "amplitudes"), ({"trials": 0}, "trials")],
)  # fmt: skip
def test_bad_options_raise_value_error(kw, msg):
    with pytest.raises(ValueError, match=msg):
        unit.run(UnitConfig(**kw))


def test_cli_default_line_table_json_and_errors(tmp_path):
    runner = CliRunner()
    res = runner.invoke(app, ["lab", "unit"])
    assert res.exit_code == 0, res.output
    first = res.output.splitlines()[0]
    assert first.startswith("L256 hd128 | fp32-KV vs q8-KV attention output: max|d_out| ")
    assert "out_f[0..3]" in first and "(avg K per-token scale ~ " in first and "mean|d_out|" in first
    assert "rel L2" in res.output and "KL" in res.output
    res = runner.invoke(app, ["lab", "unit", "--json", "--scheme", "q4", "--quantize", "k"])
    assert res.exit_code == 0 and json.loads(res.output)["scheme"] == "q4"
    png = tmp_path / "s.png"
    res = runner.invoke(app, ["lab", "unit", "--seq-len", "32,64", "--plot", str(png), "--json"])
    assert res.exit_code == 0 and png.is_file() and len(json.loads(res.stdout)) == 2
    res = runner.invoke(app, ["lab", "unit", "--scheme", "nope"])
    assert isinstance(res.exception, ValueError) and "unknown scheme" in str(res.exception)


@pytest.mark.slow
def test_real_model_heads_prefix_and_prediction(smol_f32):
    r = unit.run(UnitConfig(dist="real", seq_len=[16], layer=1, head=4), llm=smol_f32).points[0]
    assert (r["heads"], r["kv_heads"], r["head_dim"], r["layer"], r["text"]) == (1, 1, 64, 1, "britannica")
    assert 0 < r["rel_l2"] < 0.2 and r["k_step_mean"] > 0 and r["v_step_mean"] > 0
    # one capture of 64 tokens serves the rest
    cfg = UnitConfig(dist="real", seq_len=[64], layer=1)
    src = unit.RealSource(cfg, smol_f32)
    p = unit.run_point(cfg, 64, src)  # all heads: the model's 9 query / 3 KV heads
    assert (p["heads"], p["kv_heads"]) == (9, 3)
    assert 0.5 <= p["predicted_mean_abs_diff"] / p["mean_abs_diff"] <= 2.0  # one window: a noisy draw
    # slicing: L=32 is the capture's prefix queried at position 31; head 4 reads KV head 4 // 3 = 1
    q, k, v = src.get(64, 0)
    raw_q = src._cache[0][0]
    assert torch.equal(q[:, 0], raw_q[:, 63]) and torch.equal(src.get(32, 0)[0][:, 0], raw_q[:, 31])
    src.head = 4
    q1, k1, v1 = src.get(32, 0)
    assert (
        torch.equal(q1[0, 0], raw_q[4, 31])
        and torch.equal(k1[0], k[1, :32])
        and torch.equal(v1[0], v[1, :32])
    )
    with pytest.raises(ValueError, match="differs from the model"):
        unit.run(UnitConfig(dist="real", seq_len=[48], head_dim=128), llm=smol_f32)


def _q8(x):
    """The seed's q8 rule written out: codes and step per row (an independent copy)."""
    m = x.abs().amax(-1, keepdim=True)
    m = torch.where(m < 1e-6, torch.ones_like(m), m)
    return torch.floor(x * (127.0 / m) + 0.5).clamp(-127, 127), m / 127.0


@pytest.mark.parametrize(
    "backend,query_rule",
    [("numba", "exact"), ("numba-int:portable", "int8 per 32"), ("numba-int16:portable", "int16 per row")],
)
def test_attn_backend_runs_the_kernel_on_the_quantized_side(backend, query_rule):
    """--attn-backend: out_q is the decode kernel's attention over the q8 cache, i.e. float64
    attention over the dequantized K/V with the query as that kernel quantizes it."""
    cfg = UnitConfig(seq_len=[200], heads=8, kv_heads=2, head_dim=64, attn_backend=backend)
    q, k, v = unit.synthetic_qkv(cfg, 200, 0)
    r = unit.run_trial(cfg, q, k, v)
    kq, vq = (c * s for c, s in map(_q8, (k, v)))
    if query_rule == "int8 per 32":
        c, s = _q8(q.view(8, 1, 2, 32))
        q_used = (c * s).view(8, 1, 64)
    elif query_rule == "int16 per row":
        m = q.abs().amax(-1, keepdim=True)
        q_used = torch.floor(q * (32767.0 / m) + 0.5) * (m / 32767.0)
    else:
        q_used = q
    want = attention_f64(q_used, kq, vq)
    # f32 arithmetic in the kernel over |scores| of a few units: 1e-5 absolute with headroom
    torch.testing.assert_close(r["out_q"].double(), want, rtol=0, atol=1e-5)
    ref_q = attention_f64(q, kq, vq)  # the quantized side without the kernel's own arithmetic
    rel = float((want - ref_q).norm() / r["out_f"].double().norm())
    assert r["metrics"]["kernel_rel_l2"] == pytest.approx(rel, rel=1e-2, abs=2e-6)


def test_attn_backend_refusals():
    for kw, msg in [
        ({"attn_backend": "numba-int", "quantize": "v"}, "int8 keys"),
        ({"attn_backend": "numba", "scheme": "q4"}, "--scheme q8"),
        ({"attn_backend": "numba-int:sse9"}, "unknown integer attention path"),
        ({"attn_backend": "cuda-magic"}, "unknown attention backend"),
        ({"attn_backend": "torch"}, "no fused decode kernel"),
    ]:
        with pytest.raises(ValueError, match=msg):
            UnitConfig(**kw).validate()
    res = CliRunner().invoke(app, ["lab", "unit", "--attn-backend", "numba-int", "--quantize", "v"])
    assert isinstance(res.exception, ValueError) and "int8 keys" in str(res.exception)  # main: one line
