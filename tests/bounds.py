"""Error bounds derived from float32 arithmetic, for comparing a kernel with a float64 reference.

Attention of one query over n keys, computed in f32 from f32 (or exactly representable) inputs:

* score s_j = q·k_j / sqrt(d): a length-d dot product in any summation order (the kernels reassociate
  and fuse) is off by at most d·u·Σ_i |q_i k_ji| / sqrt(d) (Higham's γ_d bound, u = 2^-24); int8 keys
  dequantized by a scale add one more rounding per term, so 2·d·u·Σ|q k|/sqrt(d) in all;
* softmax: an error δ in every score changes each weight by a relative factor of at most e^(2δ) - 1
  ≈ 2δ; exp itself, the running-max rescales and the sum over n terms add (n + c)·u relative;
* output: a convex combination of V rows, so the error is (2δ + (n + c)·u) · max|v| plus the
  weighted sum's own rounding, n·u·max|v|.

A whole f32 forward pass against a float64 one (f32_forward_tol): a dot product of length K has a
rounding error of about sqrt(K)·u relative to Σ|x w| (the probabilistic bound of Higham & Mary, 2019,
which any summation order obeys); each layer makes two residual updates (attention, FFN) and the
head one more product, and these errors add up, so |logits_f32 - logits_f64| ≲ (2L + 2) · sqrt(K) · u
· max|logits| with K the longest inner dimension (the FFN width). Measured errors sit 10-100x below. That holds on any SIMD width; a wrong position, mask, scale or
rounding rule moves logits by far more (0.1 and up).

The helpers return that worst case; tests use it with a headroom factor (the worst case is far from
typical, but it does not depend on which SIMD width the CPU has, so it holds on any x86-64).
"""

from __future__ import annotations

import math

import torch

U32 = 2.0**-24  # unit roundoff of float32


def attention_bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None):
    """Worst-case |f32 attention - exact| per query head: q [H, d], k/v [KV, n, d] (what the kernel
    reads, dequantized), mask [KV, n] of the keys attended. Returns a float64 tensor [H, 1]."""
    n_heads, d = q.shape
    group = n_heads // k.shape[0]
    kk = k.double().repeat_interleave(group, 0)
    vv = v.double().repeat_interleave(group, 0)
    abs_scores = torch.einsum("hd,hnd->hn", q.double().abs(), kk.abs()) / math.sqrt(d)
    if mask is not None:
        keep = mask.repeat_interleave(group, 0)
        abs_scores = abs_scores.masked_fill(~keep, 0.0)
        vv = vv.masked_fill(~keep[..., None], 0.0)
    n = k.shape[1]
    delta = 2 * d * U32 * abs_scores.amax(1)  # score error
    v_max = vv.abs().amax((1, 2))
    return ((2 * delta + 2 * (n + 16) * U32) * v_max)[:, None]


def f32_forward_tol(cfg, ref: torch.Tensor) -> float:
    """Tolerance of an f32 forward pass of the model ``cfg`` against its float64 result ``ref``."""
    k = max(cfg.hidden, cfg.ffn, cfg.n_heads * cfg.head_dim)
    return (2 * cfg.n_layers + 2) * math.sqrt(k) * U32 * ref.abs().max().item()
