"""One decode-step layer as one compiled call: norm → QKV → RoPE → KV write → attention → o-proj →
norm → gate/up → SiLU → down, with both residual adds (CPU, one token, Llama-style layers).

At 512 positions a SmolLM2 step spent more time between kernels than in attention: ~13 numba
dispatches, ~25 torch ``.numpy()``/``from_numpy`` round trips and ~10 small allocations per layer,
plus the KV write's checks (docs/kernels.md, "Profile of the 512-position decode step"). Here the
same kernels run back to back inside one compiled function, on buffers allocated once:

* the arithmetic is the unfused path's, call for call — the same compiled kernels (``rowops``,
  ``qkernels``, ``q8store``, the attention cores of ``cpu`` / ``cpu_int``) in the same order, and
  the glue (residual adds, 1/sqrt(d) into q, the 16-bit query) without fastmath, as numpy/torch do
  it — so logits are bit-identical to the unfused path (tested);
* weights and K/V stores are tuples of numpy arrays of one numba type whatever their kind
  (:func:`weight_tuple`, :func:`store_tuple`), the kind read at run time (:func:`matvec`,
  :func:`step_kv.store_row`): a model's weight kinds and a cache's stored kinds add no compiled
  specializations (each is ~1 MB of machine code and ~12 s of compiling);
* the compiled specialization is looked up once per signature (:class:`LayerCall`): calling the
  dispatcher would re-type ~30 arguments every layer, and a literal (the attention kind) every call.

A non-finite K or V value (or a 4-bit block whose scale overflows fp16) stops the call before
anything is stored; the caller raises.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import literally, njit

from ..kv.modes import StoreKind
from . import flash, intdot
from .attend_step import (  # noqa: F401 - the attention kinds: this module's API
    ATTN_FLOAT,
    ATTN_INT8,
    ATTN_INT16,
    AttendStep,
    StepPlan,
    _get_threads,
    _set_threads,
    attend_buffers,
    attend_row,
    head_scale,
    literal_signature,
    rotation_buffers,
    start_threads,
)
from .cpu import store_arrays
from .cpu_int import IntAttn
from .q8store import NO_KSUM
from .qkernels import _mv_bf16, _mv_f32, _mv_int4, _mv_int8
from .rowops import rms_norm_row, rope_split_row, silu_mul_row
from .stage import _KIND_CODE
from .step_kv import f32_to_f16_bits  # noqa: F401 - f32_to_f16_bits: API

# the kinds of a weight tuple (:func:`weight_tuple`): one numba type for all, the kind read at run time
W_F32, W_BF16, W_INT8, W_INT4 = 0, 1, 2, 3
_NO_F32_2D, _NO_F32_3D = np.zeros((0, 0), np.float32), np.zeros((0, 0, 0), np.float32)
_NO_U16_3D, _NO_I8_3D, _NO_U8_3D = (np.zeros((0, 0, 0), t) for t in (np.uint16, np.int8, np.uint8))


def weight_tuple(arrays: tuple[np.ndarray, ...]) -> tuple:
    """A weight matrix's CPU kernel arrays (``(W,)`` for f32 ``[n, k]``, else
    :attr:`kvlens.models.qlinear.QLinear.kernel_arrays`: bf16 bits; int8 codes, scales; int4 packed
    codes, scales, mins) as the fused step's weight tuple (kind, f32 W, bf16 bits, int8 codes, int4
    codes, scales, mins): the same numba type whatever the kind (the unused members empty), so the
    weight kinds add no compiled specializations of the step."""
    if len(arrays) == 3:
        return (W_INT4, _NO_F32_2D, _NO_U16_3D, _NO_I8_3D, *arrays)
    if len(arrays) == 2:
        return (W_INT8, _NO_F32_2D, _NO_U16_3D, arrays[0], _NO_U8_3D, arrays[1], _NO_F32_3D)
    if arrays[0].dtype == np.uint16:
        return (W_BF16, _NO_F32_2D, arrays[0], _NO_I8_3D, _NO_U8_3D, _NO_F32_3D, _NO_F32_3D)
    return (W_F32, arrays[0], _NO_U16_3D, _NO_I8_3D, _NO_U8_3D, _NO_F32_3D, _NO_F32_3D)


@njit(cache=True)
def matvec(w, x, out):  # pragma: no cover - compiled
    """``out [1, n] = x [1, k] @ W.T`` for a weight tuple ``w`` (:func:`weight_tuple`)."""
    kind = w[0]
    if kind == W_INT4:
        _mv_int4(x, w[4], w[5], w[6], out)
    elif kind == W_INT8:
        _mv_int8(x, w[3], w[5], out)
    elif kind == W_BF16:
        _mv_bf16(x, w[2], out)
    else:
        _mv_f32(w[1], x, out)


@njit(cache=True)
def _linear(w, bias, x, out, min_work):  # pragma: no cover - compiled
    """matvec on one thread when the work is too small to wake the pool (qlinear.PARALLEL_MIN_WORK),
    plus the bias (torch's ``out += bias``: the same f32 adds)."""
    threads = _get_threads()
    serial = x.shape[1] * out.shape[1] < min_work and threads > 1
    if serial:
        _set_threads(1)
    matvec(w, x, out)
    if serial:
        _set_threads(threads)
    for i in range(bias.shape[0]):
        out[0, i] += bias[i]


@njit(cache=True)
def _add(x, y):  # pragma: no cover - compiled
    for i in range(x.shape[1]):
        x[0, i] += y[0, i]


@njit(cache=True)
def decode_layer(kind, path, x, lw, ks, vs, pos, rope, at, buf, min_work):  # pragma: no cover - compiled
    """One layer of a one-token step, ``x [1, hidden]`` updated in place; returns -1, or the flat index
    of the first non-finite value of K (``i``) or V (``K.size + i``): nothing is stored then.

    ``kind``, ``path``: literal attention kind and integer-kernel path (one specialization each).
    ``lw``: (attn_norm, ffn_norm, eps, wqkv, bqkv, wo, w_gate_up, w_down), weights as tuples.
    ``ks``/``vs``: the layer's K and V store tuples (:func:`store_tuple`: one type for every kind, so
    the kinds add no specializations), written at row ``pos`` (physical, in a paged cache). ``rope``: (cos, sin) rows of the token's position.
    ``at``: (K code, V code, 1/sqrt(d) as f32, length, then flash.plan_call's splits, serial, tiles, table,
    then K's and V's rotation spans (0: not rotated), then the layer's K centers ``[n_kv, d]``, an empty array for
    none, then whether K's and V's 4-bit steps are searched (q4h)). ``buf``: (h, qkv, q, k, v, o, proj, gate_up, act) scratch, then
    :func:`~kvlens.kernels.attend_step.attend_row`'s attention and rotation scratch, then its ``sink``
    argument (none).
    Returns ``step_kv.FP16_OVERFLOW`` where a 4-bit block's scale overflows (nothing stored)."""
    kind, path = literally(kind), literally(path)
    attn_norm, ffn_norm, eps, wqkv, bqkv, wo, wgu, wdown = lw
    h, qkv, q, k, v, o, proj, gu, act = buf[0]
    rms_norm_row(x[0], attn_norm, eps, h[0])
    _linear(wqkv, bqkv, h, qkv, min_work)
    rope_split_row(qkv[0], rope[0], rope[1], q, k, v)
    bad = attend_row(kind, path, q, k, v, ks, vs, pos, at, buf[1], buf[2], o, buf[3])
    if bad != -1:
        return bad
    no_bias = bqkv[:0]
    _linear(wo, no_bias, o.reshape(1, o.size), proj, min_work)
    _add(x, proj)
    rms_norm_row(x[0], ffn_norm, eps, h[0])
    _linear(wgu, no_bias, h, gu, min_work)
    silu_mul_row(gu[0], act[0])
    _linear(wdown, no_bias, act, proj, min_work)
    _add(x, proj)
    return -1


# -- the Python side: arrays and buffers set up once, the compiled entry points looked up once ---------
_NO_CENTER = np.zeros((0, 1), np.float32)  # an uncentered layer's K centers (step_kv.center_rows)
# not bf16 (a cache holding it runs the general path, tested)
_STORE_KINDS = (StoreKind.Q8, StoreKind.Q8H, StoreKind.Q4, StoreKind.Q4H, StoreKind.F16, StoreKind.F32,
                StoreKind.Q7H, StoreKind.Q6H, StoreKind.Q5H)  # fmt: skip


def store_tuple(store) -> tuple[np.ndarray, ...] | None:
    """A RowStore as :func:`step_kv.store_row` takes it, or None for a kind not written here (bf16)
    and for a layer stored per KV head (kv.cache.HeadSplitStore: see :func:`layer_stores`): zero-copy
    views (row bytes, int8 max_abs, fp16 scale bits, int8 code sums), the same numba type for every
    kind (the storage code travels beside it). Memoized on the store while its tensors are the same
    objects."""
    if not hasattr(store, "data") or store.kind not in _STORE_KINDS:  # a per-head split store too
        return None
    memo = store.__dict__.get("_step_tuple")
    if memo is not None and memo[0] is store.data:
        return memo[1]
    raw, _, scale, bsc = store_arrays(store)
    ksum = NO_KSUM if store.ksum is None else store.ksum.numpy()
    arrays = (raw, scale, bsc, ksum)
    store.__dict__["_step_tuple"] = (store.data, arrays)
    return arrays


def _span(store) -> int:
    """The store's rotation span (kv.kinds.StoreKind.rotation_span), 0 where it is not rotated."""
    return store.kind.rotation_span(store.head_dim)


def layer_entry(ks, vs) -> tuple | None:
    """One layer's (or one KV head's) K and V RowStores as :func:`attend_row` and :meth:`FusedDecoder.run`
    take them: (K tuple, V tuple, K code, V code, K span, V span, K centers, K search, V search), or
    None where a kind is not written here."""
    kt, vt = store_tuple(ks), store_tuple(vs)
    if kt is None or vt is None:
        return None
    center = _NO_CENTER if ks.center is None else ks.center[:, 0].contiguous().numpy()
    spans, search = (_span(ks), _span(vs)), (ks.kind.scale_search, vs.kind.scale_search)
    return (kt, vt, _KIND_CODE[ks.kind], _KIND_CODE[vs.kind], *spans, center, *search)


def layer_stores(cache, layer: int) -> list[tuple] | None:
    """``layer`` of a KVCache (or a sequence's paged view) as :func:`layer_entry` tuples: one for a
    layer stored whole, one per KV head for a layer stored per head (a per-head recipe), or None where
    a kind is not written here. Memoized on the cache while the layer's stores keep their tensors."""
    ks, vs = cache.k[layer], cache.v[layer]
    split = hasattr(ks, "parts")  # kv.stores.HeadSplitStore
    key = (ks.parts[0].data, vs.parts[-1].data) if split else (ks.data, vs.data)
    memo = cache.__dict__.setdefault("_layer_stores", {}).get(layer)
    if memo is not None and memo[0] is key[0] and memo[1] is key[1]:
        return memo[2]
    pairs = zip(ks.parts, vs.parts, strict=True) if split else [(ks, vs)]
    entries = [layer_entry(k, v) for k, v in pairs]
    entries = None if None in entries else entries
    cache.__dict__["_layer_stores"][layer] = (*key, entries)
    return entries


def fused_stores(cache) -> list[tuple] | None:
    """Per layer of a KVCache: its :func:`layer_entry` for :meth:`FusedDecoder.run`, or None if a layer
    is stored per KV head or in a kind not written here, or the cache has a sink store (read by the
    layer-by-layer calls only). Memoized on the cache while its stores keep their tensors (they grow all
    together: :meth:`kvlens.kv.cache.KVCache.reserve`)."""
    if cache.sink:
        return None
    first, last = (getattr(s, "data", s) for s in (cache.k[0], cache.v[-1]))
    memo = cache.__dict__.get("_step_stores")
    if memo is not None and memo[0] is first and memo[1] is last:
        return memo[2]
    stores = []
    for ks, vs in zip(cache.k, cache.v, strict=True):
        entry = layer_entry(ks, vs)
        if entry is None:
            stores = None
            break
        stores.append(entry)
    cache.__dict__["_step_stores"] = (first, last, stores)
    return stores


def attention_kind(backend: str) -> tuple[int, int] | None:
    """(kind, path index) of a resolved attention backend this module runs, else None."""
    if backend == "numba":
        # the float kind never runs the integer core, but numba still compiles that branch: give it
        # the portable path, which every CPU (and CI's pinned baseline) can compile
        return ATTN_FLOAT, intdot.PATHS.index("portable")
    spec = IntAttn.parse(backend)
    if spec is None or spec.pv8:
        return None
    return ATTN_INT16 if spec.qbits == 16 else ATTN_INT8, intdot.PATHS.index(spec.resolved_path())


@dataclass(frozen=True)
class StepShape:
    hidden: int
    n_heads: int
    n_kv: int
    head_dim: int
    ffn: int
    n_qkv: int


class FusedDecoder:
    """The layers of one-token decode steps as one :func:`decode_layer` call each.

    ``layers``: per layer (attn_norm, ffn_norm, eps, wqkv, bqkv, wo, w_gate_up, w_down) with numpy
    arrays and weight tuples (:func:`weight_tuple`). Scratch buffers live here, reused by every step (one
    decoder serves one step at a time)."""

    def __init__(self, layers: list[tuple], shape: StepShape, min_work: int) -> None:
        self.layers, self.shape, self.min_work = layers, shape, min_work
        s, f32 = shape, np.float32
        self.buf = (
            (np.empty((1, s.hidden), f32), np.empty((1, s.n_qkv), f32), np.empty((s.n_heads, s.head_dim), f32),
             np.empty((s.n_kv, s.head_dim), f32), np.empty((s.n_kv, s.head_dim), f32),
             np.empty((s.n_heads, s.head_dim), f32), np.empty((1, s.hidden), f32), np.empty((1, 2 * s.ffn), f32),
             np.empty((1, s.ffn), f32)),
            attend_buffers(s.n_heads, s.head_dim),
            rotation_buffers(s.n_heads, s.n_kv, s.head_dim),
            flash.NO_SINK,
        )  # fmt: skip
        self.inv_sqrt = head_scale(shape.head_dim)
        self._entry: dict[tuple, object] = {}

    def run(
        self, x: np.ndarray, pos: int, rope: tuple, stores: list[tuple], attn: tuple[int, int], table=None
    ) -> int:
        """Every layer at position ``pos`` over ``stores`` (per layer: K tuple, V tuple, K code, V code),
        ``x [1, hidden]`` in place; ``table``: a paged cache's block table (int32), else None. Returns
        -1, or the layer whose K or V (:attr:`kv_rows`) holds a non-finite value or, for a 4-bit store, a
        block whose scale overflows fp16 (stopped there: nothing of it stored)."""
        plan = StepPlan.of(self.shape.n_kv, stores[0][0][0].shape[1], pos, None, table)
        for i, (lw, layer) in enumerate(zip(self.layers, stores, strict=True)):
            at = plan.layer_args(layer, self.inv_sqrt)
            args = (*attn, x, lw, layer[0], layer[1], plan.row, rope, at, self.buf, self.min_work)
            entry = self._entry.get((i, *attn, at[0], at[1])) or self._compile(i, args)
            if entry(*args) != -1:
                return i
        return -1

    def _compile(self, layer: int, args: tuple):
        """The compiled specialization for ``args`` (compiled, or loaded from numba's disk cache, once)."""
        start_threads()
        entry = decode_layer.compile(literal_signature(args))
        at = args[8]
        self._entry[(layer, args[0], args[1], at[0], at[1])] = entry
        return entry

    @property
    def kv_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """The last layer's K and V rows ``[n_kv, 1, d]`` (the ones :meth:`run` refused, after a stop)."""
        k, v = self.buf[0][3:5]
        return k[:, None], v[:, None]
