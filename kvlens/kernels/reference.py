"""Reference attention: plain softmax(Q·Kᵀ/sqrt(d))·V in torch, the ground truth for every kernel.

Shapes (one sequence, head-major like the cache)::

    q: [n_heads, n_q, head_dim]     k, v: [n_kv_heads, n_k, head_dim]

Query head ``h`` reads KV head ``h // (n_heads // n_kv_heads)`` (grouped-query attention).
``q_pos`` gives the absolute position of each query; key ``j`` sits at position ``j``. A query
attends keys with position ≤ its own (causal) and, with ``window``, > its position − window.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def attention_mask(q_pos: torch.Tensor, n_k: int, window: int | None = None) -> torch.Tensor:
    """Boolean [n_q, n_k] mask, True where the query may attend the key."""
    k_pos = torch.arange(n_k, device=q_pos.device)
    mask = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= k_pos[None, :] > (q_pos[:, None] - window)
    return mask


def sliding_window(
    n_kv: int, length: int, window: int | None, blocks, sink, block: int
) -> tuple[np.ndarray | None, int]:
    """How a decode kernel reads a sliding ``window`` (the query at ``length - 1`` attends positions
    ``length - window ..``), in place: the logical blocks of ``block`` positions it covers, per KV head
    ``[n_kv, n]`` int32 (numpy), and its first position (the kernels skip the rows below it). With no window,
    or one that holds every position yet: ``(blocks, 0)``. A reached window takes no sparse
    ``blocks`` and no ``sink`` rows (ValueError): the engine sends those through the torch path."""
    if window is None:
        return blocks, 0
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a positive int, got {window!r}")
    if window >= length:
        return blocks, 0
    if blocks is not None or sink is not None:
        raise ValueError("a sliding window reached takes no sparse blocks and no sink rows")
    first = length - window
    return np.tile(np.arange(first // block, -(-length // block), dtype=np.int32), (n_kv, 1)), first


def blocks_to_mask(blocks: torch.Tensor, n_k: int, block: int) -> torch.Tensor:
    """Sparse decode's selection (block indices [n_kv, n_sel]) as a key mask [n_kv, n_k]."""
    pos = torch.arange(n_k, device=blocks.device)
    return (pos[None, None, :] // block == blocks.long()[:, :, None]).any(dim=1)


def _key_mask(
    q_pos: torch.Tensor | None, n_k: int, window: int | None, kv_mask: torch.Tensor | None, group: int
) -> torch.Tensor | None:
    """The keys each query may attend: the causal/window mask ``[n_q, n_k]`` (with ``q_pos``) and the
    sparse selection ``kv_mask [n_kv, n_k]`` as ``[H, 1, n_k]``, broadcast together; None: all."""
    mask = None if q_pos is None else attention_mask(q_pos, n_k, window)
    if kv_mask is not None:
        head_mask = kv_mask.repeat_interleave(group, dim=0)[:, None, :]
        mask = head_mask if mask is None else mask[None] & head_mask
    return mask


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor | None = None,
    window: int | None = None,
    return_weights: bool = False,
    kv_mask: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Stable-softmax attention in the dtype of ``q`` (pass float64 for a float64 reference).

    With ``q_pos=None`` every query sees every key (the seed's single-query experiment).
    ``kv_mask [n_kv, n_k]`` restricts each KV head's keys (sparse decode: softmax over the selection).
    """
    n_heads, n_q, d = q.shape
    n_kv = k.shape[0]
    group = n_heads // n_kv
    k = k.to(q.dtype).repeat_interleave(group, dim=0)
    v = v.to(q.dtype).repeat_interleave(group, dim=0)
    scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(d))
    mask = _key_mask(q_pos, k.shape[1], window, kv_mask, group)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    scores = scores - scores.amax(dim=-1, keepdim=True)
    w = torch.exp(scores)
    w = w / w.sum(dim=-1, keepdim=True)
    out = torch.matmul(w, v)
    return (out, w) if return_weights else out


def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor | None = None,
    window: int | None = None,
    kv_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same contract through torch's fused ``scaled_dot_product_attention`` (the engine's default)."""
    n_heads, n_kv = q.shape[0], k.shape[0]
    if q.shape[1] == 1 and window is None:
        q_pos = None  # one query at the newest position sees every cached key
    mask = _key_mask(q_pos, k.shape[1], window, kv_mask, n_heads // n_kv)
    return torch.nn.functional.scaled_dot_product_attention(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask, enable_gqa=n_heads != n_kv
    ).squeeze(0)


def sink_state(
    qs: torch.Tensor, sink_k: torch.Tensor, sink_v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The softmax state of queries ``qs [n_heads, hd]`` (already scaled by 1/sqrt(hd)) over the sink
    rows ``sink_k``/``sink_v [n_kv, s, hd]`` (kvlens.kv.cache.KVCache.sink_rows): per query head the
    max score ``m``, ``l = sum exp(s - m)`` and ``acc = sum exp(s - m) v`` ``[n_heads, hd]``, in
    float64 on ``qs``'s device; a decode kernel starts a split from it (natural base)."""
    k, v = (x.to(qs.device, torch.float64) for x in (sink_k, sink_v))
    n_kv, n, hd = k.shape
    if v.shape != k.shape or qs.dim() != 2 or qs.shape[1] != hd or qs.shape[0] % n_kv or n == 0:
        raise ValueError(
            f"sink rows must be [n_kv, s>0, {qs.shape[-1]}] for K and V, got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    scores = torch.einsum("hgd,hsd->hgs", qs.to(torch.float64).reshape(n_kv, -1, hd), k)
    m = scores.amax(dim=2, keepdim=True)
    p = torch.exp(scores - m)
    return m.reshape(-1), p.sum(dim=2).reshape(-1), torch.einsum("hgs,hsd->hgd", p, v).reshape(-1, hd)
