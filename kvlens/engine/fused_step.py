"""The engine's one-token CPU step with each layer one compiled call (kernels/decode_step.py), and, for
layers that step does not run, their attention as one compiled call (kernels/attend_step.py).

The model stays cache-agnostic (models/ imports no kv code): this module builds the per-layer
weight tuples of a :class:`~kvlens.models.transformer.Transformer` once, and runs a step over a
KV cache's stores where the fused path applies (:func:`forward_fused`); otherwise the engine runs
the general path, which gives bit-identical results (tests/test_decode_step.py).
"""

from __future__ import annotations

import numpy as np
import torch

from ..kernels.decode_step import (
    ATTN_INT8,
    ATTN_INT16,
    AttendStep,
    FusedDecoder,
    StepShape,
    attention_kind,
    fused_stores,
    weight_tuple,
)
from ..kernels.q4int import Q4_VALUES
from ..kernels.stage import CODE_Q4, CODE_Q8
from ..kv.cache import KVCache, check_kv_finite
from ..kv.pool import PagedKV
from ..kv.quant import check_q4_range
from ..models.qlinear import PARALLEL_MIN_WORK
from ..models.transformer import Transformer, rms_norm, timed


def fused_decoder(model: Transformer) -> FusedDecoder | None:
    """The one-call-per-layer decoder of a model's weights, or None where it does not apply: layers
    that are not Llama-style on the CPU (``model.row_ops``), a matrix with no CPU kernel tuple, or an
    odd-width int4 input (the kernel would need it padded)."""
    if not model.row_ops:
        return None

    def arrays(w) -> tuple | None:
        if isinstance(w, torch.Tensor):
            return (w.numpy(),) if w.dtype == torch.float32 and w.device.type == "cpu" else None
        if w.kind == "int4" and w.shape[1] % 2:
            return None
        return w.kernel_arrays

    cfg, layers = model.cfg, []
    for L in model.w.layers:
        mats = [arrays(w) for w in (L.wqkv, L.wo, L.w_gate_up, L.w_down)]
        if any(m is None for m in mats):
            return None
        bias = np.zeros(0, np.float32) if L.bqkv is None else L.bqkv.numpy()
        wqkv, wo, w_gate_up, w_down = map(weight_tuple, mats)
        layers.append(
            (L.attn_norm.numpy(), L.ffn_norm.numpy(), cfg.rms_eps, wqkv, bias, wo, w_gate_up, w_down)
        )
    n_qkv = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
    shape = StepShape(cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn, n_qkv)
    return FusedDecoder(layers, shape, PARALLEL_MIN_WORK)


def _scores_every_k(kind: int, stores: list[tuple], head_dim: int) -> bool:
    """Whether the attention kind's kernel reads every layer's K: the 16-bit integer one int8 K only,
    the 8-bit one 4-bit K only (head_dim a multiple of its 64-value step); the float one all."""
    if kind == ATTN_INT16:
        return all(s[2] == CODE_Q8 for s in stores)
    if kind == ATTN_INT8:
        return head_dim % Q4_VALUES == 0 and all(s[2] == CODE_Q4 for s in stores)
    return True


def _stores_for_step(
    cache: KVCache | PagedKV, start: int, backend: str, head_dim: int, layers: range
) -> tuple[tuple[int, int], list[tuple], bool] | None:
    """(attention kind, the cache's fused store tuples, paged) for a compiled step writing position
    ``start`` of ``layers`` (a contiguous cache grown to hold it), or None where the compiled calls do
    not apply: not the numba backends, a mirror, block tracking or a sink store, a kind they do not
    store, a paged view without the block, a K the attention kind cannot score."""
    attn = attention_kind(backend)
    if attn is None or cache.bounds is not None or cache.has_mirror:
        return None
    paged = type(cache) is PagedKV
    if paged and start + 1 > cache.capacity or not paged and type(cache) is not KVCache:
        return None
    if not paged:
        cache.reserve(start + 1)
    stores = fused_stores(cache)  # None with a sink store, or a kind they do not store
    if stores is None or not _scores_every_k(attn[0], [stores[i] for i in layers], head_dim):
        return None
    return attn, stores, paged


def forward_fused(
    model: Transformer, decoder: FusedDecoder, ids: torch.Tensor, cache: KVCache | PagedKV, start: int,
    backend: str, window_free: int,
) -> torch.Tensor | None:  # fmt: skip
    """Final-normed hidden state [1, hidden] of one token (``ids [1]``) at ``start``, or None where the
    fused path does not apply: a KV cache (contiguous, or a sequence's paged view holding the
    blocks) whose layers all store q8, q8h, q4, q4h, f16 or f32 (not bf16 or the packed q7h, q6h, q5h;
    no mirror, kept-exact rows or block tracking), the numba backend, or numba-int16 over int8 K / numba-int over 4-bit K, no attention
    window reached (``window_free``: positions every layer attends whole). A non-finite K/V raises the
    general path's NonFiniteKVError, a 4-bit block out of fp16 range its ValueError."""
    if start + 1 > window_free:
        return None
    ready = _stores_for_step(cache, start, backend, model.cfg.head_dim, range(model.cfg.n_layers))
    if ready is None:
        return None
    attn, stores, paged = ready
    x = model.embed(ids).contiguous()
    cos, sin = model.ropes[0].rows(start, 1)
    rope = (cos.numpy()[0], sin.numpy()[0])
    table = cache.table if paged else None
    bad = timed(model.profiler, "layers", decoder.run, x.numpy(), start, rope, stores, attn, table)
    if bad >= 0:
        k, v = (torch.from_numpy(r) for r in decoder.kv_rows)
        check_kv_finite(bad, start, k, v)
        for store, rows in ((cache.k[bad], k), (cache.v[bad], v)):
            if store.kind.int4:
                check_q4_range(store.basis(rows).numpy(), store.kind.scale_search)
        raise AssertionError(f"the fused step stopped at layer {bad} on finite K/V in range")
    cache.length = max(cache.length, start + 1)
    return rms_norm(x, model.w.norm, model.cfg.rms_eps)


def attend_fused(
    step: AttendStep, cache: KVCache | PagedKV, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    start: int, window: int | None, backend: str,
) -> torch.Tensor | None:  # fmt: skip
    """Decode attention of one token at ``start`` in ``layer`` (``q [H, 1, d]``, ``k``/``v [n_kv, 1, d]``
    as the model hands them to ``attend``) as one compiled call: K/V written, the query turned into
    K's basis, the fused kernel over the positions (``window``: the last ones), the output turned back
    (:class:`~kvlens.kernels.attend_step.AttendStep`; bit-identical to the general path). None where
    that call does not apply: as :func:`forward_fused` (the stored kinds, the numba backends, no
    mirror, sink store or block tracking), on the CPU. A non-finite K/V, or a 4-bit block out of fp16
    range, raises the general path's error (nothing stored)."""
    if q.device.type != "cpu":
        return None
    ready = _stores_for_step(cache, start, backend, q.shape[-1], range(layer, layer + 1))
    if ready is None:
        return None
    attn, stores, paged = ready
    rows = [np.ascontiguousarray(x.reshape(x.shape[0], -1).numpy(), np.float32) for x in (q, k, v)]
    if step.run(attn, *rows, stores[layer], start, window, cache.table if paged else None) != -1:
        cache.write(layer, start, k, v)  # raises the general path's error for what the call refused
        raise AssertionError(f"the fused attention stopped at layer {layer} on finite K/V in range")
    if layer == cache.n_layers - 1:
        cache.length = max(cache.length, start + 1)
    return torch.from_numpy(step.out.copy()).unsqueeze(1)
