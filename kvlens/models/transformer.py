"""A Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, and Gemma-3's variant) in plain torch functions.

The transformer knows nothing about the KV cache: each layer hands its post-RoPE Q, K, V to an
``attend`` callback (supplied by the engine), which stores K/V wherever the cache mode says and
returns the attention output. This keeps one forward pass for every cache mode and kernel.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from ..kernels import rowops
from .config import ModelConfig, rope_scaling_kind
from .qlinear import embedding, linear, linear_rows
from .weights import LayerWeights, Weights

# attend(layer, q [H, n, d], k [KV, n, d], v [KV, n, d], start) -> out [H, n, d]
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


class Profiler(Protocol):
    """Told the seconds of each timed part of a forward pass: ``"linear"`` (every weight matmul, LM head
    included), ``"attend"`` (a layer's attention call, KV write included) and ``"kv_write"``; the
    engine's fused step (kvlens.engine.fused_step) reports its layers as one part, ``"layers"``."""

    def add(self, part: str, seconds: float) -> None: ...


def timed(profiler: Profiler | None, part: str, fn: Callable, *args):
    """``fn(*args)``, its seconds reported to ``profiler`` as ``part`` (no clock read without one)."""
    if profiler is None:
        return fn(*args)
    t0 = time.perf_counter()
    try:
        return fn(*args)
    finally:
        profiler.add(part, time.perf_counter() - t0)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope_inv_freq(cfg: ModelConfig, freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """RoPE inverse frequencies, with Llama-3 frequency scaling when the config asks for it."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = cfg.rope_scaling or {}
    kind = rope_scaling_kind(s)
    if kind == "llama3":
        factor, lo, hi = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
        old = float(s["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
        inv = torch.where(medium, smoothed, scaled)
    elif kind not in ("default", "linear"):
        raise ValueError(f"unsupported rope scaling {kind!r}")
    if freq_factors is not None:  # GGUF stores Llama-3 scaling as per-frequency divisors
        inv = inv / freq_factors.float().cpu()
    return inv


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class RopeTable:
    """cos/sin rows [n, head_dim] of one RoPE frequency set, grown on demand."""

    def __init__(self, inv_freq: torch.Tensor, pos_scale: float, device: torch.device) -> None:
        self.inv_freq, self.pos_scale, self.device = inv_freq, pos_scale, device
        self.cos = self.sin = torch.empty(0, 2 * inv_freq.shape[0])

    def rows(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if start + n > self.cos.shape[0]:
            size = max(start + n, 2 * self.cos.shape[0], 256)
            pos = torch.arange(size, dtype=torch.float32) * self.pos_scale
            freqs = pos[:, None] * self.inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            self.cos, self.sin = emb.cos().to(self.device), emb.sin().to(self.device)
        return self.cos[start : start + n], self.sin[start : start + n]


def layer_ropes(cfg: ModelConfig, weights: Weights, device: torch.device) -> list[RopeTable]:
    """Each layer's RoPE table; Gemma-3's windowed layers share a second one (their own base, unscaled)."""
    s = cfg.rope_scaling or {}
    pos_scale = 1.0 / float(s["factor"]) if rope_scaling_kind(s) == "linear" else 1.0
    main = RopeTable(rope_inv_freq(cfg, weights.rope_freq_factors), pos_scale, device)
    if cfg.rope_local_theta is None:
        return [main] * cfg.n_layers
    local_cfg = replace(cfg, rope_theta=cfg.rope_local_theta, rope_scaling=None)
    local = RopeTable(rope_inv_freq(local_cfg), 1.0, device)
    return [local if cfg.is_windowed(i) else main for i in range(cfg.n_layers)]


ACTIVATION = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


class RowNorms(NamedTuple):
    """A layer's norm weights as f32 numpy rows for the JIT glue (None: the layer has no such norm)."""

    attn: np.ndarray
    ffn: np.ndarray
    q: np.ndarray | None
    k: np.ndarray | None
    post_attn: np.ndarray | None
    post_ffn: np.ndarray | None

    @classmethod
    def of(cls, L: LayerWeights) -> RowNorms | None:
        """The layer's norms, or None where one is not an f32 CPU tensor (the torch glue runs then)."""
        norms = (L.attn_norm, L.ffn_norm, L.q_norm, L.k_norm, L.post_attn_norm, L.post_ffn_norm)
        if any(n is not None and (n.dtype != torch.float32 or n.device.type != "cpu") for n in norms):
            return None
        return cls(*(None if n is None else n.numpy() for n in norms))


class Transformer:
    def __init__(self, cfg: ModelConfig, weights: Weights) -> None:
        self.cfg, self.w = cfg, weights
        self.device = weights.embed.device
        self.ropes = layer_ropes(cfg, weights, self.device)
        self.act = ACTIVATION[cfg.hidden_act]
        # the kernels scale scores by 1/sqrt(head_dim); a model's own attention scale goes into q
        self.q_scale = 1.0 if cfg.query_pre_attn_scalar is None else cfg.attn_scale * math.sqrt(cfg.head_dim)
        self.profiler: Profiler | None = None  # set to time the parts of each forward (bench decode)
        # decode steps (one token, or the scheduler's batch rows) run the layer glue as JIT calls
        # (rowops) on the CPU; a model's own attention scale rides on its QK-norm call
        row_norms = [RowNorms.of(L) for L in weights.layers] if self.device.type == "cpu" else [None]
        self.row_ops = all(n is not None for n in row_norms) and (cfg.qk_norm or self.q_scale == 1.0)
        self._row_norms: list[RowNorms] = row_norms if self.row_ops else []
        # Llama-style layers: what the fused one-call-per-layer decoder (engine.fused_step) runs
        plain = not cfg.qk_norm and not cfg.sandwich_norms and cfg.hidden_act == "silu"
        self.llama_rows = self.row_ops and plain and cfg.embed_scale == 1.0 and self.q_scale == 1.0

    def rope_tables(self, start: int, n: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [n, head_dim] of ``layer`` for positions start..start+n-1 (tables grown on demand)."""
        return self.ropes[layer].rows(start, n)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = embedding(self.w.embed, ids)
        return x * self.cfg.embed_scale if self.cfg.embed_scale != 1.0 else x

    def _post(self, x: torch.Tensor, out: torch.Tensor, norm: torch.Tensor | None) -> torch.Tensor:
        """The residual add of a sublayer's output (sandwich-normed first where the model has it)."""
        return x + (out if norm is None else rms_norm(out, norm, self.cfg.rms_eps))

    def layer(
        self, i: int, x: torch.Tensor, start: int, cos: torch.Tensor, sin: torch.Tensor, attend: AttendFn
    ) -> torch.Tensor:
        cfg, L = self.cfg, self.w.layers[i]
        n, d = x.shape[0], cfg.head_dim
        if n == 1 and self.row_ops:
            return self.layer_row(i, x, start, cos, sin, attend)
        h = rms_norm(x, L.attn_norm, cfg.rms_eps)
        q, k, v = self.split_rope(L, self.linear(h, L.wqkv, L.bqkv), cos, sin)
        o = attend(i, q, k, v, start)
        x = self._post(x, self.linear(o.transpose(0, 1).reshape(n, cfg.n_heads * d), L.wo), L.post_attn_norm)
        return self._post(x, self.mlp(L, rms_norm(x, L.ffn_norm, cfg.rms_eps)), L.post_ffn_norm)

    def split_rope(
        self, L: LayerWeights, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Fused QKV rows [n, ...] → head-major q [H, n, d], k, v [KV, n, d], q/k-normed and rotated."""
        cfg, n, d = self.cfg, qkv.shape[0], self.cfg.head_dim
        q, k, v = qkv.split((cfg.n_heads * d, cfg.n_kv_heads * d, cfg.n_kv_heads * d), dim=-1)
        q = q.view(n, cfg.n_heads, d).transpose(0, 1)
        k = k.view(n, cfg.n_kv_heads, d).transpose(0, 1)
        v = v.view(n, cfg.n_kv_heads, d).transpose(0, 1)
        if cfg.qk_norm:
            q, k = rms_norm(q, L.q_norm, cfg.rms_eps), rms_norm(k, L.k_norm, cfg.rms_eps)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return q, k, v.contiguous()

    def layer_row(
        self, i: int, x: torch.Tensor, start: int, cos: torch.Tensor, sin: torch.Tensor, attend: AttendFn
    ) -> torch.Tensor:
        """:meth:`layer` for one token on the CPU: the same math, the glue in JIT calls (rowops) on
        numpy views (a torch ``.numpy()`` or index costs ~1.5 µs, and a step has ~30 per layer); the
        scheduler's batch rows (:meth:`layer_rows`) call the same functions."""
        cfg, L, norms = self.cfg, self.w.layers[i], self._row_norms[i]
        d, eps = cfg.head_dim, cfg.rms_eps
        h = np.empty((1, cfg.hidden), np.float32)
        rowops.rms_norm_row(x.numpy()[0], norms.attn, eps, h[0])
        qkv = self.linear(torch.from_numpy(h), L.wqkv, L.bqkv).numpy()
        q, k, v = self._split_rows(norms, qkv, cos.numpy(), sin.numpy())
        o = attend(i, torch.from_numpy(q[0]), torch.from_numpy(k[0]), torch.from_numpy(v[0]), start)
        x = self._add_rows(x, self.linear(o.reshape(1, cfg.n_heads * d), L.wo), norms.post_attn)
        rowops.rms_norm_row(x.numpy()[0], norms.ffn, eps, h[0])
        act = self._act_rows(self.linear(torch.from_numpy(h), L.w_gate_up))
        return self._add_rows(x, self.linear(act, L.w_down), norms.post_ffn)

    def _split_rows(
        self, norms: RowNorms, qkv: np.ndarray, cos: np.ndarray, sin: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows ``qkv [B, ...]`` → ``q [B, H, 1, d]``, ``k``/``v [B, KV, 1, d]``, q/k-normed and rotated."""
        cfg, n = self.cfg, qkv.shape[0]
        q, k, v = (
            np.empty((n, m, 1, cfg.head_dim), np.float32)
            for m in (cfg.n_heads, cfg.n_kv_heads, cfg.n_kv_heads)
        )
        if norms.q is None:
            rowops.rope_split_rows(qkv, cos, sin, q[:, :, 0], k[:, :, 0], v[:, :, 0])
        else:
            rowops.qk_norm_rope_split_rows(qkv, cos, sin, norms.q, norms.k, cfg.rms_eps, self.q_scale,
                                           q[:, :, 0], k[:, :, 0], v[:, :, 0])  # fmt: skip
        return q, k, v

    def _act_rows(self, gate_up: torch.Tensor) -> torch.Tensor:
        act = np.empty((gate_up.shape[0], gate_up.shape[1] // 2), np.float32)
        rowops.act_mul_rows(gate_up.numpy(), act, self.cfg.hidden_act == "gelu_tanh")
        return torch.from_numpy(act)

    def _add_rows(self, x: torch.Tensor, out: torch.Tensor, norm: np.ndarray | None) -> torch.Tensor:
        """A sublayer's residual add, its output sandwich-normed first where the model has the norm."""
        if norm is None:
            return x + out
        res = np.empty(tuple(x.shape), np.float32)
        rowops.norm_add_rows(x.numpy(), np.ascontiguousarray(out.numpy()), norm, self.cfg.rms_eps, res)
        return torch.from_numpy(res)

    def linear(self, x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
        """Every weight matmul goes through here (the profiler times them)."""
        return timed(self.profiler, "linear", linear, x, w, bias)

    def mlp(self, L: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        return self.linear(self._gated(self.linear(h, L.w_gate_up)), L.w_down)

    def forward(self, ids: torch.Tensor, start: int, attend: AttendFn) -> torch.Tensor:
        """Final-normed hidden states [n, hidden] for tokens at positions start..start+n-1."""
        return self.forward_from(self.embed(ids), start, attend)

    def forward_from(
        self,
        x: torch.Tensor,
        start: int,
        attend: AttendFn,
        first: int = 0,
        on_input: Callable[[int, torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """:meth:`forward` from the residual ``x [n, hidden]`` entering layer ``first`` (the lab resumes
        a pass there); ``on_input(i, x)`` sees the residual entering each layer ``i``."""
        tables = {id(r): r.rows(start, x.shape[0]) for r in self.ropes}
        if self.profiler is not None:
            inner, profiler = attend, self.profiler
            attend = lambda *args: timed(profiler, "attend", inner, *args)  # noqa: E731
        for i in range(first, self.cfg.n_layers):
            if on_input is not None:
                on_input(i, x)
            x = self.layer(i, x, start, *tables[id(self.ropes[i])], attend)
        return rms_norm(x, self.w.norm, self.cfg.rms_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear(hidden, self.w.lm_head)

    # -- batched decode: one token of each of B sequences, rows independent of each other -----------
    def decode_rows(self, ids: torch.Tensor, positions: list[int], attends: list[AttendFn]) -> torch.Tensor:
        """Final-normed hidden states [B, hidden] for token ``ids[b]`` at ``positions[b]`` of sequence
        ``b`` (attending through ``attends[b]``). Every weight matrix is read once for the batch by
        :func:`linear_rows`; the glue runs row by row, so a row's arithmetic does not depend on B."""
        x = self.embed(ids)
        for i in range(self.cfg.n_layers):
            x = self.layer_rows(i, x, positions, attends)
        return self._norm_rows(x, self.w.norm, None)

    def logits_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear_rows(hidden, self.w.lm_head)

    def _norm_rows(
        self, x: torch.Tensor, weight: torch.Tensor, row_weight: np.ndarray | None
    ) -> torch.Tensor:
        if row_weight is None or not self.row_ops:
            return torch.cat([rms_norm(x[b : b + 1], weight, self.cfg.rms_eps) for b in range(x.shape[0])])
        h = np.empty(tuple(x.shape), np.float32)
        rowops.rms_norm_rows(x.numpy(), row_weight, self.cfg.rms_eps, h)
        return torch.from_numpy(h)

    def _attend_rows(
        self, i: int, qkv: torch.Tensor, positions: list[int], attends: list[AttendFn]
    ) -> torch.Tensor:
        """Attention output [B, H*d] of each row's query over its own sequence."""
        cfg, L, d, n = self.cfg, self.w.layers[i], self.cfg.head_dim, qkv.shape[0]
        out = torch.empty(n, cfg.n_heads * d, dtype=qkv.dtype, device=qkv.device)
        if self.row_ops:
            q, k, v = map(
                torch.from_numpy,
                self._split_rows(self._row_norms[i], qkv.numpy(), *self._rope_rows(i, positions)),
            )
            for b, pos in enumerate(positions):
                out[b] = attends[b](i, q[b], k[b], v[b], pos).reshape(-1)
            return out
        for b, pos in enumerate(positions):
            cos, sin = self.rope_tables(pos, 1, i)
            q, k, v = self.split_rope(L, qkv[b : b + 1], cos, sin)
            out[b] = attends[b](i, q, k, v, pos).reshape(-1)
        return out

    def _rope_rows(self, i: int, positions: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """cos/sin rows [B, head_dim] of each row's position in layer ``i``'s table (numpy)."""
        table = self.ropes[i]
        table.rows(max(positions), 1)  # grows the tables when needed
        idx = np.asarray(positions)
        return table.cos.numpy()[idx], table.sin.numpy()[idx]

    def layer_rows(
        self, i: int, x: torch.Tensor, positions: list[int], attends: list[AttendFn]
    ) -> torch.Tensor:
        L = self.w.layers[i]
        if self.row_ops:
            norms = self._row_norms[i]
            qkv = linear_rows(self._norm_rows(x, L.attn_norm, norms.attn), L.wqkv, L.bqkv)
            x = self._add_rows(
                x, linear_rows(self._attend_rows(i, qkv, positions, attends), L.wo), norms.post_attn
            )
            gate_up = linear_rows(self._norm_rows(x, L.ffn_norm, norms.ffn), L.w_gate_up)
            return self._add_rows(x, linear_rows(self._act_rows(gate_up), L.w_down), norms.post_ffn)
        qkv = linear_rows(self._norm_rows(x, L.attn_norm, None), L.wqkv, L.bqkv)
        x = self._post_rows(
            x, linear_rows(self._attend_rows(i, qkv, positions, attends), L.wo), L.post_attn_norm
        )
        gate_up = linear_rows(self._norm_rows(x, L.ffn_norm, None), L.w_gate_up)
        act = torch.cat([self._gated(gate_up[b : b + 1]) for b in range(x.shape[0])])
        return self._post_rows(x, linear_rows(act, L.w_down), L.post_ffn_norm)

    def _post_rows(self, x: torch.Tensor, out: torch.Tensor, norm: torch.Tensor | None) -> torch.Tensor:
        """:meth:`_post` row by row (a row's arithmetic independent of the batch)."""
        if norm is None:
            return x + out
        return torch.cat([self._post(x[b : b + 1], out[b : b + 1], norm) for b in range(x.shape[0])])

    def _gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act(gate) * up
