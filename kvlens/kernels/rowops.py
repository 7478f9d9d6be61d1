"""One-token (decode) glue of a layer as JIT calls: RMSNorm, QKV split + (QK-norm +) RoPE, SiLU or
GELU gate, a sandwich norm's residual add.

At one token per step the tensors are a few hundred floats, and each torch op costs more in
dispatch (~1.5-5 µs) than in arithmetic: RMSNorm is 6 ops (16 µs), RoPE on Q and K ~14 ops. These
do the same float32 math in one call each. :meth:`Transformer.layer` uses them for single-token
steps on the CPU; prefill chunks keep the torch functions, and tests hold the two paths together.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_FM = {"reassoc", "contract", "nsz"}


@njit(fastmath=_FM, cache=True)
def rms_norm_row(x, w, eps, out):  # pragma: no cover - compiled
    """out = x / sqrt(mean(x²) + eps) * w for one row."""
    s = np.float32(0.0)
    for i in range(x.shape[0]):
        s += x[i] * x[i]
    r = np.float32(1.0) / np.sqrt(s / np.float32(x.shape[0]) + np.float32(eps))
    for i in range(x.shape[0]):
        out[i] = x[i] * r * w[i]


@njit(fastmath=_FM, cache=True)
def copy_v_heads(qkv, first, v):  # pragma: no cover - compiled
    """v[h] = the fused QKV row's head ``first + h`` (V follows the Q and K heads)."""
    d = v.shape[1]
    for h in range(v.shape[0]):
        for i in range(d):
            v[h, i] = qkv[(first + h) * d + i]


@njit(fastmath=_FM, cache=True)
def rope_split_row(qkv, cos, sin, q, k, v):  # pragma: no cover - compiled
    """Split one token's fused QKV row into ``q [H, d]``, ``k [KV, d]``, ``v [KV, d]``, rotating Q and K
    (rotate-half RoPE: ``x cos + [-x2, x1] sin``)."""
    n_heads, d = q.shape
    n_kv, half = k.shape[0], d // 2
    for h in range(n_heads + n_kv):
        dst = q[h] if h < n_heads else k[h - n_heads]
        src = qkv[h * d : (h + 1) * d]
        for i in range(half):
            dst[i] = src[i] * cos[i] - src[i + half] * sin[i]
            dst[i + half] = src[i + half] * cos[i + half] + src[i] * sin[i + half]
    copy_v_heads(qkv, n_heads + n_kv, v)


@njit(fastmath=_FM, cache=True)
def silu_mul_row(gate_up, out):  # pragma: no cover - compiled
    """out = silu(gate) * up for one row of the fused ``[gate | up]`` projection."""
    f = out.shape[0]
    for i in range(f):
        g = gate_up[i]
        out[i] = g / (np.float32(1.0) + np.exp(-g)) * gate_up[f + i]


@njit(fastmath=_FM, cache=True)
def qk_norm_rope_split_row(qkv, cos, sin, q_norm, k_norm, eps, q_scale, q, k, v):  # pragma: no cover
    """:func:`rope_split_row` for QK-norm layers (Qwen3, Gemma-3): each Q and K head RMS-normed with
    its weight first (:func:`rms_norm_row`), Q then times ``q_scale`` (the model's own attention
    scale over the kernels' 1/sqrt(d)), then rotated."""
    n_heads, d = q.shape
    n_kv, half = k.shape[0], d // 2
    for h in range(n_heads + n_kv):
        head_q = h < n_heads
        dst = q[h] if head_q else k[h - n_heads]
        rms_norm_row(qkv[h * d : (h + 1) * d], q_norm if head_q else k_norm, eps, dst)
        if head_q and q_scale != 1.0:
            for i in range(d):
                dst[i] *= np.float32(q_scale)
        for i in range(half):
            a, b = dst[i], dst[i + half]
            dst[i] = a * cos[i] - b * sin[i]
            dst[i + half] = b * cos[i + half] + a * sin[i + half]
    copy_v_heads(qkv, n_heads + n_kv, v)


GELU_K = np.float32(0.7978845608028654)  # sqrt(2 / pi)


@njit(fastmath=_FM, cache=True)
def gelu_mul_row(gate_up, out):  # pragma: no cover - compiled
    """out = gelu_tanh(gate) * up for one row of the fused ``[gate | up]`` projection (GeGLU, as torch's
    ``gelu(approximate="tanh")``: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x³))))."""
    f = out.shape[0]
    for i in range(f):
        g = gate_up[i]
        t = np.tanh(GELU_K * (g + np.float32(0.044715) * g * g * g))
        out[i] = np.float32(0.5) * g * (np.float32(1.0) + t) * gate_up[f + i]


@njit(fastmath=_FM, cache=True)
def norm_add_row(x, out, w, eps, res):  # pragma: no cover - compiled
    """res = x + rms_norm(out) * w: a sandwich-normed sublayer's residual add (Gemma-3)."""
    rms_norm_row(out, w, eps, res)
    for i in range(x.shape[0]):
        res[i] += x[i]


# -- a decode batch: the same row functions over B independent rows, one call per layer step ---------
@njit(fastmath=_FM, cache=True)
def rms_norm_rows(x, w, eps, out):  # pragma: no cover - compiled
    for b in range(x.shape[0]):
        rms_norm_row(x[b], w, eps, out[b])


@njit(fastmath=_FM, cache=True)
def rope_split_rows(qkv, cos, sin, q, k, v):  # pragma: no cover - compiled
    """:func:`rope_split_row` for rows ``qkv [B, ...]`` with their own ``cos``/``sin [B, d]`` into
    ``q [B, H, d]``, ``k``/``v [B, KV, d]``."""
    for b in range(qkv.shape[0]):
        rope_split_row(qkv[b], cos[b], sin[b], q[b], k[b], v[b])


@njit(fastmath=_FM, cache=True)
def act_mul_rows(gate_up, out, gelu):  # pragma: no cover - compiled
    """:func:`gelu_mul_row` (``gelu``) or :func:`silu_mul_row` for each row of ``gate_up [B, 2F]``."""
    for b in range(gate_up.shape[0]):
        if gelu:
            gelu_mul_row(gate_up[b], out[b])
        else:
            silu_mul_row(gate_up[b], out[b])


@njit(fastmath=_FM, cache=True)
def qk_norm_rope_split_rows(qkv, cos, sin, q_norm, k_norm, eps, q_scale, q, k, v):  # pragma: no cover
    for b in range(qkv.shape[0]):
        qk_norm_rope_split_row(qkv[b], cos[b], sin[b], q_norm, k_norm, eps, q_scale, q[b], k[b], v[b])


@njit(fastmath=_FM, cache=True)
def norm_add_rows(x, out, w, eps, res):  # pragma: no cover - compiled
    for b in range(x.shape[0]):
        norm_add_row(x[b], out[b], w, eps, res[b])
