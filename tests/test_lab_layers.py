"""``kvlens lab layers`` against a float64 transcription of its docstring (numpy loops, one query head
at a time), and its flagging rule by hand at each boundary."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from kvlens.kv.modes import MODES
from kvlens.kv.quant import rotation
from kvlens.lab.layers import LayersConfig, LayersResult, flag_heads, layer_rows, run_layers, summary_rows
from kvlens.lab.ppl import make_chunks

EXCERPT = Path(__file__).parent / "data" / "excerpt.txt"


def attention64(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, window: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """Causal softmax attention, query head i on KV head i // group, the query at i seeing keys j with
    i - window < j <= i (Mistral's sliding window; None: all j <= i): (out [H, n, d], weights [H, n, n])."""
    n_heads, n, d = q.shape
    group = n_heads // k.shape[0]
    out, weights = np.zeros_like(q), np.zeros((n_heads, n, n))
    i, j = np.indices((n, n))
    hidden = (j > i) | ((i - j >= window) if window else False)
    for hq in range(n_heads):
        s = q[hq] @ k[hq // group].T / math.sqrt(d)
        s[hidden] = -np.inf
        w = np.exp(s - s.max(axis=1, keepdims=True))
        weights[hq] = w / w.sum(axis=1, keepdims=True)
        out[hq] = weights[hq] @ v[hq // group]
    return out, weights


def channel_ratio64(x: np.ndarray) -> np.ndarray:
    """Per KV head: the largest channel's max |x| over its lower-middle median channel (torch's median)."""
    c = np.abs(x).max(axis=1)
    return np.array([row.max() / np.sort(row)[(len(row) - 1) // 2] for row in c])


def stored64(llm, qkv, mode, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each layer's K and V as a cache of ``mode`` returns them to decode, turned back to the model's
    basis by ``@ R.T`` in float64 where the kind is rotated (R: kv.quant.rotation)."""
    cache = llm.new_cache(n, mode)
    for i, (_q, k, v) in enumerate(qkv):
        cache.write(i, 0, k, v)
    out = []
    for i in range(len(qkv)):
        rows = []
        for x, kind in zip(cache.read(i, n, prefill=False), mode.kinds(i), strict=True):
            x, span = x.double().numpy(), kind.rotation_span(x.shape[-1])
            rows.append(x @ rotation(x.shape[-1], torch.float64, "cpu", span).numpy().T if span else x)
        out.append((rows[0], rows[1]))
    return out


def check_against_transcription(llm, text: str, ctx: int, windows: list[int | None]) -> None:
    """Two windows of ``ctx`` tokens, q8 and q8h (rotated: read in its basis, turned back): the relative
    error per (layer, KV head) pools squared norms over the group's query heads, the positions and
    the windows; the channel ratios and the sink weight average over the windows; max and mean |Δout|.
    ``windows``: each layer's sliding window as the transcription applies it (written by hand)."""
    cfg = LayersConfig(kv=["q8", "q8h"], ctx=ctx, chunks=2)
    r = run_layers(llm, text, cfg)
    tok, c = llm.tokenizer, llm.config
    chunks = make_chunks(tok.encode(text), ctx, 2, tok.bos_prefix[0] if tok.bos_prefix else None)
    assert len(chunks) == 2 and r.windows == 2
    n_l, n_kv, group = c.n_layers, c.n_kv_heads, c.n_heads // c.n_kv_heads
    modes = [MODES["q8"], MODES["q8h"]]
    num = {m: np.zeros((n_l, n_kv)) for m in modes}
    den, sink, k_ratio, v_ratio = (np.zeros((n_l, n_kv)) for _ in range(4))
    max_abs, sum_abs, count = dict.fromkeys(modes, 0.0), dict.fromkeys(modes, 0.0), 0
    for ids in chunks:
        qkv = llm.capture_qkv(ids)
        stored = {m: stored64(llm, qkv, m, len(ids)) for m in modes}
        for layer, (q, k, v) in enumerate(qkv):
            q, k, v = (x.double().numpy() for x in (q, k, v))
            ref, w = attention64(q, k, v, windows[layer])
            count += ref.size
            k_ratio[layer] += channel_ratio64(k) / 2
            v_ratio[layer] += channel_ratio64(v) / 2
            for h in range(n_kv):
                heads = slice(h * group, (h + 1) * group)
                den[layer, h] += (ref[heads] ** 2).sum()
                sink[layer, h] += w[heads, 1:, 0].mean() / 2  # queries after position 0
            for m in modes:
                diff = attention64(q, *stored[m][layer], windows[layer])[0] - ref
                max_abs[m] = max(max_abs[m], np.abs(diff).max())
                sum_abs[m] += np.abs(diff).sum()
                for h in range(n_kv):
                    num[m][layer, h] += (diff[h * group : (h + 1) * group] ** 2).sum()
    np.testing.assert_allclose(r.k_ratio, k_ratio, rtol=1e-6)
    np.testing.assert_allclose(r.v_ratio, v_ratio, rtol=1e-6)
    np.testing.assert_allclose(r.sink, sink, rtol=1e-9)
    for m, rtol in zip(modes, (1e-6, 1e-4), strict=True):  # q8h: the engine turns back in f32
        np.testing.assert_allclose(r.err[m], np.sqrt(num[m] / den), rtol=rtol)
        assert r.max_abs[m] == pytest.approx(max_abs[m], rel=rtol)
        assert r.mean_abs[m] == pytest.approx(sum_abs[m] / count, rel=rtol)


@pytest.mark.slow
def test_every_figure_equals_a_float64_transcription(smol_f32):
    text = EXCERPT.read_text(encoding="utf-8")
    check_against_transcription(smol_f32, text, 24, [None] * smol_f32.config.n_layers)


@pytest.fixture(scope="module")
def mistral_window(tmp_path_factory):
    """A tiny random Mistral whose every layer attends the last 4 positions (byte tokenizer)."""
    from tiny_models import write_hf

    import kvlens

    out = tmp_path_factory.mktemp("mistral-window") / "hf"
    write_hf("mistral", out, seed=2, sliding_window=4)
    return kvlens.load(out, kv="f32", attn_backend="torch")


def test_a_sliding_window_model_is_measured_inside_its_window(mistral_window):
    text = EXCERPT.read_text(encoding="utf-8")[:2000]
    check_against_transcription(mistral_window, text, 16, [4] * mistral_window.config.n_layers)


def _flat(value: float = 0.25) -> tuple[np.ndarray, ...]:
    """err all ``value`` (4 layers x 2 KV heads), K/V channel ratios 4 and 1 everywhere, no sink."""
    return np.full((4, 2), value), np.full((4, 2), 4.0), np.full((4, 2), 1.0), np.zeros((4, 2))


def test_a_head_exactly_at_three_times_the_median_is_not_flagged():
    err, k_ratio, v_ratio, sink = _flat()
    err[1, 0] = 0.75  # 3 x 0.25, exact in binary: "above" is strict
    assert flag_heads(err, k_ratio, v_ratio, sink, "q8", "q8") == []
    err[1, 0] = np.nextafter(0.75, 1.0)
    assert [(f["layer"], f["kv_head"]) for f in flag_heads(err, k_ratio, v_ratio, sink, "q8", "q8")] == [
        (1, 0)
    ]


def test_the_median_leaves_out_heads_with_no_error():
    """Five of ten heads store exactly (error 0): the median is that of the other five (0.25, 0.25,
    0.25, 0.5, 1.0), 0.25, so only 1.0 is above 3x; over all ten it would be 0.125, flagging 0.5 too."""
    err = np.array([[0, 0], [0, 0], [0, 0.25], [0.25, 0.25], [0.5, 1.0]])
    k_ratio, v_ratio, sink = np.full((5, 2), 4.0), np.full((5, 2), 1.0), np.zeros((5, 2))
    flagged = flag_heads(err, k_ratio, v_ratio, sink, "q8", "q8")
    assert [(f["layer"], f["kv_head"], f["times_median"]) for f in flagged] == [(4, 1, 4.0)]


def test_flags_are_sorted_by_error_and_each_cause_at_its_own_threshold():
    """K outliers at 2 x the model's median K ratio (4, not V's 1); a sink at weight 0.5 inclusive."""
    err, k_ratio, v_ratio, sink = _flat()
    err[0, 1], err[2, 0] = 1.0, 2.0
    k_ratio[0, 1], k_ratio[2, 0] = 7.0, 8.0  # 7 < 2 x 4: not an outlier; 8: one
    sink[0, 1] = 0.5
    first, second = flag_heads(err, k_ratio, v_ratio, sink, "q8", "q8")
    assert (first["layer"], first["kv_head"], second["layer"], second["kv_head"]) == (2, 0, 0, 1)
    assert [c.split(" (")[0] for c in first["causes"]] == ["outlier K channels"]
    assert [c.split(" (")[0] for c in second["causes"]] == ["attention sink"]


def test_summary_and_per_layer_rows_by_hand():
    """The printed figures: the median over heads with an error, the largest head as layer.head,
    max/median, and each layer's RMS over its KV heads."""
    q8 = MODES["q8"]
    err = np.array([[0.0, 0.0], [0.4, 0.3], [0.1, 0.2]])  # 3 layers x 2 KV heads
    r = LayersResult(
        "m", "c", 8, 1, 0, 0, {q8: err}, {q8: 0.5}, {q8: 0.01}, np.ones((3, 2)) * 2, np.ones((3, 2)),
        np.zeros((3, 2)), {q8: []}, 0.0,
    )  # fmt: skip
    assert r.median(q8) == pytest.approx(0.25)  # of 0.1, 0.2, 0.3, 0.4 (the exact layer left out)
    _, (row,) = summary_rows(r)
    assert row[:5] == ["q8", q8.label, "2.50e-01", "4.00e-01 (1.0)", "1.60×"]
    _, rows = layer_rows(r)
    assert [x[1] for x in rows] == ["0.00e+00", f"{np.sqrt(0.125):.2e}", f"{np.sqrt(0.025):.2e}"]
