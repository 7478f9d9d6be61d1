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

from ..kernels.attend_step import ATTN_INT8, ATTN_INT16, AttendStep
from ..kernels.decode_step import (
    FusedDecoder,
    StepShape,
    attention_kind,
    fused_stores,
    layer_stores,
    weight_tuple,
)
from ..kernels.q4int import Q4_VALUES
from ..kernels.stage import CODE_Q4, CODE_Q8
from ..kv.cache import KVCache
from ..kv.pool import PagedKV
from ..models.qlinear import PARALLEL_MIN_WORK
from ..models.transformer import Transformer, rms_norm, timed


def fused_decoder(model: Transformer) -> FusedDecoder | None:
    """The one-call-per-layer decoder of a model's weights, or None where it does not apply: layers
    that are not Llama-style on the CPU (``model.llama_rows``), a matrix with no CPU kernel tuple, or an
    odd-width int4 input (the kernel would need it padded)."""
    if not model.llama_rows:
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


def _step_ready(cache: KVCache | PagedKV, start: int, backend: str) -> tuple[tuple[int, int], bool] | None:
    """(attention kind, paged) for compiled calls writing position ``start`` (a contiguous cache grown
    to hold it), or None where they do not apply: not the numba backends, a mirror or kept-exact rows,
    block tracking, a paged view without the block."""
    attn = attention_kind(backend)
    if attn is None or cache.bounds is not None or cache.has_mirror:
        return None
    paged = type(cache) is PagedKV
    if paged and start + 1 > cache.capacity or not paged and type(cache) is not KVCache:
        return None
    if not paged:
        cache.reserve(start + 1)
    return attn, paged


def _refused(
    cache: KVCache | PagedKV, layer: int, start: int, k: torch.Tensor, v: torch.Tensor
) -> AssertionError:
    """After a compiled call refused ``layer``'s K/V rows ``[n_kv, 1, d]``: the general path's write
    raises its error for them (non-finite, or an fp16 scale out of range); returns the error to raise
    if it does not."""
    cache.write(layer, start, k, v)
    return AssertionError(f"the compiled step stopped at layer {layer} on finite K/V in range")


def forward_fused(
    model: Transformer, decoder: FusedDecoder, ids: torch.Tensor, cache: KVCache | PagedKV, start: int,
    backend: str, window_free: int,
) -> torch.Tensor | None:  # fmt: skip
    """Final-normed hidden state [1, hidden] of one token (``ids [1]``) at ``start``, or None where the
    fused path does not apply: a KV cache (contiguous, or a sequence's paged view holding the
    blocks) whose layers are stored whole (not per KV head) in any kind but bf16, with no sink store,
    mirror, kept-exact rows or block tracking; the numba backend, or numba-int16 over int8 K /
    numba-int over 4-bit K; no attention window reached (``window_free``: positions every layer attends
    whole). A non-finite K/V raises the general path's NonFiniteKVError, an fp16 scale out of range
    (4-bit, packed) its ValueError."""
    if start + 1 > window_free:
        return None
    ready = _step_ready(cache, start, backend)
    stores = None if ready is None else fused_stores(cache)
    if stores is None or not _scores_every_k(ready[0][0], stores, model.cfg.head_dim):
        return None
    attn, paged = ready
    x = model.embed(ids).contiguous()
    cos, sin = model.ropes[0].rows(start, 1)
    rope = (cos.numpy()[0], sin.numpy()[0])
    table = cache.table if paged else None
    bad = timed(model.profiler, "layers", decoder.run, x.numpy(), start, rope, stores, attn, table)
    if bad >= 0:
        raise _refused(cache, bad, start, *(torch.from_numpy(r) for r in decoder.kv_rows))
    cache.length = max(cache.length, start + 1)
    return rms_norm(x, model.w.norm, model.cfg.rms_eps)


def attend_fused(
    step: AttendStep, cache: KVCache | PagedKV, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    start: int, window: int | None, backend: str,
) -> torch.Tensor | None:  # fmt: skip
    """Decode attention of one token at ``start`` in ``layer`` (``q [H, 1, d]``, ``k``/``v [n_kv, 1, d]``
    as the model hands them to ``attend``) as one compiled call (one per KV head for a layer stored per
    head): K/V written, the query turned into K's basis, the fused kernel over the positions
    (``window``: the last ones; a sink store's rows read from it), the output turned back
    (:class:`~kvlens.kernels.attend_step.AttendStep`; bit-identical to the general path). None where
    that call does not apply: not the numba backends, a mirror or block tracking, a kind it does not
    store (bf16), a sink position still being written, a window that reaches the sink, off the CPU. A non-finite K/V, or an fp16 scale out of range, raises the general
    path's error."""
    if q.device.type != "cpu":
        return None
    ready = _step_ready(cache, start, backend)
    entries = None if ready is None else layer_stores(cache, layer)
    if entries is None or not _scores_every_k(ready[0][0], entries, q.shape[-1]):
        return None
    attn, paged = ready
    sink = _sink_rows(cache, layer, start, window)
    if sink is False:
        return None
    q2, k2, v2 = (np.ascontiguousarray(x.reshape(x.shape[0], -1).numpy(), np.float32) for x in (q, k, v))
    table = cache.table if paged else None
    if len(entries) == 1:
        if step.run(attn, q2, k2, v2, entries[0], start, window, table, sink) != -1:
            raise _refused(cache, layer, start, k, v)
        out = step.out.copy()
    else:  # one KV head and its query group at a time
        head, g, out = step.head_step, q2.shape[0] // len(entries), np.empty_like(q2)
        for h, entry in enumerate(entries):
            rows = None if sink is None else tuple(x[h : h + 1] for x in sink)
            hk, hv = k2[h : h + 1], v2[h : h + 1]
            if head.run(attn, q2[h * g : (h + 1) * g], hk, hv, entry, start, window, table, rows) != -1:
                raise _refused(cache, layer, start, k, v)
            out[h * g : (h + 1) * g] = head.out
    if layer == cache.n_layers - 1:
        cache.length = max(cache.length, start + 1)
    return torch.from_numpy(out).unsqueeze(1)


def _sink_rows(cache: KVCache | PagedKV, layer: int, start: int, window: int | None):
    """The sink rows the call at ``start`` reads (numpy ``[n_kv, s, d]``, K then V), None for none, or
    False where the general path must run the step: it writes the sink store (a position below the
    sink), or masks a window that still reaches the sink."""
    s = cache.sink
    if s == 0:
        return None
    if start < s or window is not None and start + 1 - window < s:
        return False
    if window is not None:
        return None
    return tuple(x.numpy() for x in cache.sink_rows(layer, start + 1))
