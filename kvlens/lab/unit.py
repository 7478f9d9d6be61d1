"""``kvlens lab unit``: the seed's unit-level experiment, one variable at a time.

Baseline: one query over L keys with K/V in fp32. Test: K and/or V through a quantization scheme
(``kvlens.kv.schemes``) and back to fp32, then the *same* attention code
(:func:`kvlens.kernels.reference.reference_attention`). Everything else is held fixed, so Δ =
out_q - out_f is the quantizer's contribution alone. Metrics and the first-order prediction of the
error are in :mod:`kvlens.lab.metrics`.

Synthetic data: a seeded stream per tensor (``seed``, trial, tensor), generated token-major, so a
longer L extends the same keys (a sweep over L changes only L). ``--dist`` changes K and V only;
Q is always N(0,1). ``normal`` N(0,1); ``uniform`` U(-√3, √3) (unit variance); ``student-t:NU``
Student-t scaled to unit variance when NU > 2; ``outlier-channels[:F]`` N(0,1) with d/32 random
key channels multiplied by F (default 10), the pattern per-channel key schemes target; ``real``
Q/K/V captured from a model run by the engine on real text (trial i reads the i-th window of L
tokens after ``seed`` windows; the query is the window's last position).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from ..checks import check_counts, check_field_types, check_int, check_list_fields, option_name
from ..kernels.reference import reference_attention
from ..kv.schemes import get_scheme
from ..models.loader import model_stamp
from .metrics import amplitude_verdicts, compare, pooled_t
from .unit_kernel import check_backend, kernel_attention
from .unit_output import render, to_json, write_plot

SYNTH_DEFAULTS = {"head_dim": 128, "heads": 1, "kv_heads": 1}
DISTS = ("normal", "uniform", "student-t:NU", "outlier-channels[:F]", "real")
_LLMS: dict[str, tuple[tuple, Any]] = {}  # model name -> (its files' stamp, the loaded model)


MAX_AMPLITUDE = 1e30  # times a unit-variance draw: K and V stay far inside float32


@dataclass
class UnitConfig:
    seq_len: list[int] = field(default_factory=lambda: [256])
    head_dim: int | None = None  # None: 128 (synthetic) or the model's
    heads: int | None = None
    kv_heads: int | None = None
    dist: str = "normal"
    k_amp: float = 1.0
    v_amp: float = 1.0
    quantize: str = "kv"
    scheme: str = "q8"
    trials: int = 1
    seed: int = 0
    amplitude: list[float] | None = None
    model: str = "smollm2"
    layer: int | None = None  # None: the middle layer
    head: int | None = None  # None: every query head of the layer
    text: str | None = None  # corpus name or UTF-8 file; None: the default corpus
    attn_backend: str | None = None  # the quantized side through this decode kernel (lab.unit_kernel)

    def __post_init__(self) -> None:
        check_field_types(self)
        self.validate()

    def validate(self) -> None:
        check_list_fields(
            self, {"seq_len": int, "amplitude": float}, optional=("amplitude",), may_be_empty=("amplitude",)
        )
        if not self.seq_len or min(self.seq_len) < 1:
            raise ValueError("--seq-len must be one or more positive integers, e.g. 256 or 64,256,1024")
        if self.quantize not in ("k", "v", "kv"):
            raise ValueError(f"--quantize must be k, v or kv, not {self.quantize!r}")
        get_scheme(self.scheme)
        parse_dist(self.dist)
        if self.attn_backend is not None:
            check_backend(self.attn_backend, self.scheme, self.quantize)
        check_counts(self, "trials", "heads", "kv_heads", "seq_len")
        check_counts(self, "head_dim", minimum=2)
        check_counts(self, "layer", "head", minimum=0)
        factors = (self.k_amp, self.v_amp, *(self.amplitude or []))
        scaled = [amp * a for amp in (self.k_amp, self.v_amp) for a in self.amplitude or ()]  # the runs' K, V
        if not all(0 < a <= MAX_AMPLITUDE for a in (*factors, *scaled)):
            raise ValueError(
                f"amplitudes (--k-amp, --v-amp, --amplitude, and --k-amp / --v-amp times each --amplitude) "
                f"must be > 0 and ≤ {MAX_AMPLITUDE:g} (float32 K and V overflow past it)"
            )
        # each tensor's torch seed is (seed + trial) * 7919 + which (_stream): it must fit in 64 bits
        check_int(
            self.seed, "--seed", minimum=-(2**63) // 7919 + 1, maximum=(2**64 - 1) // 7919 - self.trials - 1
        )
        if self.amplitude is not None and (len(self.seq_len) != 1 or not self.amplitude):
            raise ValueError("--amplitude needs a list of factors and a single --seq-len")
        h, kvh = self.heads or 1, self.kv_heads or 1
        if self.dist != "real" and h % kvh:
            raise ValueError(f"--heads ({h}) must be a multiple of --kv-heads ({kvh})")


def parse_list(text: str, kind: type = int) -> list:
    """``"64,256"`` -> ``[64, 256]``; ValueError with the bad item otherwise."""
    out = []
    for item in str(text).replace(" ", "").split(","):
        try:
            out.append(kind(item))
        except ValueError:
            raise ValueError(f"not a list of {kind.__name__}s: {text!r} (bad item {item!r})") from None
    return out


def parse_dist(dist: str) -> tuple[str, float]:
    """``(name, parameter)``: student-t's NU, outlier-channels' factor (10 by default), else 0; a
    parameter must be in (0, MAX_AMPLITUDE] (an infinite or NaN one reached the quantizer as non-finite K)."""
    name, _, arg = dist.partition(":")
    if name in ("normal", "uniform", "real") and not arg:
        return name, 0.0
    if (name == "student-t" and arg) or name == "outlier-channels":
        try:
            value = float(arg) if arg else 10.0
        except ValueError:
            value = math.nan
        if not 0 < value <= MAX_AMPLITUDE:  # nan fails too
            raise ValueError(f"--dist {dist!r}: the {name} parameter must be > 0 and ≤ {MAX_AMPLITUDE:g}")
        return name, value
    raise ValueError(f"unknown --dist {dist!r}; choose one of: {', '.join(DISTS)} (NU > 0)")


# -- data ------------------------------------------------------------------------------------
def _stream(seed: int, trial: int, which: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed + trial) * 7919 + which)  # one stream per tensor


def _draw(name: str, arg: float, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    if name == "uniform":
        return (torch.rand(shape, generator=g) * 2 - 1) * math.sqrt(3.0)
    if name == "student-t":
        rng = np.random.default_rng(int(torch.randint(0, 2**62, (1,), generator=g)))
        x = torch.from_numpy(rng.standard_t(arg, size=shape)).float()
        return x * math.sqrt((arg - 2) / arg) if arg > 2 else x
    return torch.randn(shape, generator=g)


def synthetic_qkv(
    cfg: UnitConfig, seq_len: int, trial: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q [H, 1, d], K and V [KV, L, d] for one trial (before --k-amp/--v-amp)."""
    name, arg = parse_dist(cfg.dist)
    d, h, kvh = (getattr(cfg, n) or SYNTH_DEFAULTS[n] for n in ("head_dim", "heads", "kv_heads"))
    q = torch.randn((h, 1, d), generator=_stream(cfg.seed, trial, 0))
    kind = "normal" if name == "outlier-channels" else name
    k, v = (_draw(kind, arg, (seq_len, kvh, d), _stream(cfg.seed, trial, i)).transpose(0, 1) for i in (1, 2))
    if name == "outlier-channels":
        chans = torch.randperm(d, generator=_stream(cfg.seed, trial, 3))[: max(1, d // 32)]
        k = k.clone()
        k[..., chans] *= arg
    return q, k.contiguous(), v.contiguous()


class RealSource:
    """Q/K/V of one layer of a real model on real text; one capture per trial serves every L."""

    def __init__(self, cfg: UnitConfig, llm: Any = None) -> None:
        from ..corpus import load_corpus

        if llm is None:
            stamp = model_stamp(cfg.model)  # a file replaced at the same path is loaded anew
            if _LLMS.get(cfg.model, (None,))[0] != stamp:
                import kvlens

                _LLMS[cfg.model] = (stamp, kvlens.load(cfg.model, kv="f32", attn_backend="torch"))
            llm = _LLMS[cfg.model][1]
        self.llm, c = llm, llm.config
        self.layer = c.n_layers // 2 if cfg.layer is None else cfg.layer
        if not 0 <= self.layer < c.n_layers:
            raise ValueError(f"--layer {self.layer} out of range: the model has {c.n_layers} layers")
        for name, have in (("heads", c.n_heads), ("kv_heads", c.n_kv_heads), ("head_dim", c.head_dim)):
            given = getattr(cfg, name)
            if given is not None and given != have:
                raise ValueError(f"--dist real: {option_name(name)} {given} differs from the model's {have}")
        if cfg.head is not None and not 0 <= cfg.head < c.n_heads:
            raise ValueError(f"--head {cfg.head} out of range: the model has {c.n_heads} query heads")
        self.head, self.group = cfg.head, c.group
        text, self.text_label = load_corpus(cfg.text)
        self.ids = llm.tokenizer.encode(text)
        self.window, self.seed = max(cfg.seq_len), cfg.seed
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        last = (cfg.seed + cfg.trials) * self.window
        if len(self.ids) < last:
            raise ValueError(
                f"text {self.text_label!r} has {len(self.ids)} tokens; seed {cfg.seed} and {cfg.trials} "
                f"trial(s) of {self.window} tokens need {last}"
            )

    def get(self, seq_len: int, trial: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if trial not in self._cache:
            start = (self.seed + trial) * self.window
            (self._cache[trial],) = self.llm.capture_qkv(self.ids[start : start + self.window], [self.layer])
        q, k, v = (t.float().cpu() for t in self._cache[trial])
        q, k, v = q[:, seq_len - 1 : seq_len], k[:, :seq_len], v[:, :seq_len]  # causal: a prefix is exact
        if self.head is not None:
            kvh = self.head // self.group
            q, k, v = q[self.head : self.head + 1], k[kvh : kvh + 1], v[kvh : kvh + 1]
        return q.contiguous(), k.contiguous(), v.contiguous()


# -- the experiment --------------------------------------------------------------------------
def run_trial(cfg: UnitConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, Any]:
    """Amplitudes, quantization of the chosen tensors, the comparison. Returns metrics + tensors."""
    scheme = get_scheme(cfg.scheme)
    k, v = k * cfg.k_amp, v * cfg.v_amp
    k_hat, v_hat, k_step, v_step, scale, bits = k, v, None, None, {}, []
    for role in cfg.quantize:
        x = k if role == "k" else v
        qt = scheme.quantize(x, role)
        x_hat, step = scheme.dequantize(qt), scheme.step(x, role)
        scale[role] = float(scheme.multiplier(qt).mean())
        bits.append(scheme.bits_per_value(qt))
        if role == "k":
            k_hat, k_step = x_hat, step
        else:
            v_hat, v_step = x_hat, step
    out_kernel = (
        None if cfg.attn_backend is None else kernel_attention(cfg.attn_backend, q, k, v, cfg.quantize)
    )
    m, delta, out_f, out_q = compare(q, k, v, k_hat, v_hat, k_step, v_step, out_kernel)
    m["k_scale_mean"], m["v_scale_mean"] = scale.get("k", 0.0), scale.get("v", 0.0)
    if out_kernel is not None:  # the kernel's own part: vs the reference over the same quantized K/V
        ref_q = reference_attention(q, k_hat, v_hat)
        m["kernel_rel_l2"] = float((out_kernel - ref_q).double().norm() / out_f.double().norm())
    return {
        "metrics": m,
        "delta": delta,
        "out_f": out_f,
        "out_q": out_q,
        "shape": tuple(q.shape) + (k.shape[0],),
        "bits_per_value": sum(bits) / len(bits),  # K and V hold equally many values
    }


def run_point(cfg: UnitConfig, seq_len: int, source: RealSource | None = None) -> dict[str, Any]:
    """All trials at one L: each metric's mean over trials, with its std under ``std``."""
    runs = []
    for t in range(cfg.trials):
        qkv = source.get(seq_len, t) if source else synthetic_qkv(cfg, seq_len, t)
        runs.append(run_trial(cfg, *qkv))
    keys = runs[0]["metrics"].keys()
    vals = {key: np.array([r["metrics"][key] for r in runs]) for key in keys}
    h, _, d, kvh = runs[0]["shape"]
    point: dict[str, Any] = {key: float(vals[key].mean()) for key in keys}
    point["mean_signed_diff"], point["signed_t"] = pooled_t([r["delta"] for r in runs])
    point["std"] = {key: float(vals[key].std(ddof=1)) if cfg.trials > 1 else 0.0 for key in keys}
    del point["std"]["signed_t"]  # the t-statistic is pooled over all trials' components, one number
    point.update(
        seq_len=seq_len, head_dim=d, heads=h, kv_heads=kvh, dist=cfg.dist, scheme=cfg.scheme,
        quantize=cfg.quantize, attn_backend=cfg.attn_backend, k_amp=cfg.k_amp, v_amp=cfg.v_amp, seed=cfg.seed, trials=cfg.trials,
        bits_per_value=runs[0]["bits_per_value"],
        out_f=[round(float(x), 6) for x in runs[0]["out_f"].flatten()[:4]],
        out_q=[round(float(x), 6) for x in runs[0]["out_q"].flatten()[:4]],
    )  # fmt: skip
    if source is not None:
        point.update(model=cfg.model, layer=source.layer, head=cfg.head, text=source.text_label)
    point["_deltas"] = torch.cat([r["delta"].flatten() for r in runs])  # for the histogram, not JSON
    return point


@dataclass
class UnitResult:
    config: UnitConfig
    points: list[dict[str, Any]]
    amplitude: list[dict[str, Any]] | None = None
    verdicts: dict[str, str] | None = None


def run(cfg: UnitConfig, llm: Any = None) -> UnitResult:
    """Run the configured experiment: one point, a sweep over L, or the amplitude analysis (``cfg`` was
    checked when it was built)."""
    source = RealSource(cfg, llm) if cfg.dist == "real" else None
    if cfg.amplitude is None:
        return UnitResult(cfg, [run_point(cfg, n, source) for n in cfg.seq_len])
    rows = []
    for a in cfg.amplitude:
        for which in ("v", "k"):
            c = replace(cfg, v_amp=cfg.v_amp * a) if which == "v" else replace(cfg, k_amp=cfg.k_amp * a)
            rows.append({"scaled": which, "amplitude": a, **run_point(c, cfg.seq_len[0], source)})
    return UnitResult(
        cfg, [r for r in rows if r["amplitude"] == cfg.amplitude[0]][:1], rows, amplitude_verdicts(rows)
    )


def main(cfg: UnitConfig, json_out: bool = False, plot: str | None = None) -> UnitResult:
    """The body of ``kvlens lab unit``."""
    result = run(cfg)
    if json_out:
        print(to_json(result))
    else:
        render(result)
    if plot:
        print(f"wrote {write_plot(result, plot)}", file=sys.stderr)
    return result
