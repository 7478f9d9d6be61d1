"""Attention over the KV cache: write the new rows, then attend through the chosen backend.

Backends:
    torch   read the cache as float32 (dequantizing int8 rows) and run torch SDPA — every mode,
            prefill and decode; the correctness baseline.
    numba   fused single-pass CPU decode kernel reading every kind's rows directly (kernels.cpu);
            prefill chunks use the torch path.
    numba-int, numba-int16  the same with integer Q·K scores (8- / 16-bit query, kernels.cpu_int);
            ``+pv8`` (e.g. ``numba-int16+pv8``): P·V in integers too (int8 V only; opt-in, it costs
            accuracy: docs/kernels.md); ``:PATH`` forces a CPU path (vnni512, vnni256, avx2,
            portable); int8 K only (or 4-bit K with numba-int); a packed kind (q7h, q6h, q5h)
            anywhere in the cache is refused.
    triton  the same algorithm on CUDA (kernels.gpu).
    auto    the fastest correct backend for the device and cache mode.

A cache with a sink store (kv.cache: a recipe's keep_sink) hands the fused kernels its sink rows,
which they read in place of the stores' rows there.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from ..kernels.attend_step import AttendStep
from ..kernels.cpu_int import BACKEND_QBITS, IntAttn
from ..kernels.quest import quest_select
from ..kernels.reference import blocks_to_mask, sdpa_attention
from ..kv.blocks import SparseConfig, probe_positions, probe_scores, quest_scores, top_blocks
from ..kv.cache import BLOCK, HeadSplitStore, KVCache, Rotation, rotations
from ..kv.kinds import KSUM_BLOCK
from ..kv.modes import KVMode, StoreKind
from ..kv.pool import PagedKV
from ..kv.quant import rotate_rows, unrotate_rows
from ..models.transformer import AttendFn, Profiler, timed
from .fused_step import attend_fused

BACKENDS = ("auto", "torch", "numba", "triton", *BACKEND_QBITS)


class BackendError(ValueError):
    """An attention backend that cannot run here (missing package, wrong device, unsupported mode)."""


def _fused_kernel(backend: str):
    """The fused decode kernel ``backend`` names; None for torch (and auto); a BackendError for a name
    that is none of them, so a misspelt name never attends through torch."""
    spec = _int_spec(backend)
    if spec is not None:
        from ..kernels.cpu_int import decode_attention_int

        return functools.partial(decode_attention_int, spec=spec)
    if backend == "numba":
        from ..kernels.cpu import decode_attention
    elif backend == "triton":
        from ..kernels.gpu import decode_attention_triton as decode_attention
    else:
        _check_float_name(backend)
        return None
    return decode_attention


def decode_kernel(backend: str, device: torch.device = torch.device("cpu")):
    """The fused decode kernel ``kernel(q [H, hd], k_store, v_store, length)`` of ``backend`` on
    ``device`` (``auto`` resolved); BackendError for one that cannot run there or has none (torch)."""
    kernel = _fused_kernel(resolve_backend(backend, device))
    if kernel is None:
        raise BackendError(f"the {backend} backend has no fused decode kernel on {device.type}")
    return kernel


def _int_spec(backend: str) -> IntAttn | None:
    """The integer backend ``backend`` names (None for a float one); a BackendError if malformed."""
    if not isinstance(backend, str):
        raise TypeError(f"attn_backend must be a str, got {type(backend).__name__} {backend!r}")
    try:
        return IntAttn.parse(backend)
    except ValueError as e:
        raise BackendError(str(e)) from None


def _check_float_name(backend: str) -> None:
    if backend not in BACKENDS:
        raise BackendError(f"unknown attention backend {backend!r}; choose one of: {', '.join(BACKENDS)}")


def check_backend_name(backend: str) -> str:
    """``backend`` if it names a backend (an integer one may name its CPU path); else a BackendError.
    Whether it can run here is :func:`resolve_backend`'s question, once the device is known."""
    if _int_spec(backend) is None:
        _check_float_name(backend)
    return backend


def resolve_backend(backend: str, device: torch.device) -> str:
    """The backend that runs for ``backend`` on ``device`` (``auto`` resolved); a BackendError when
    it is unknown or cannot run there."""
    spec = _int_spec(backend)
    if spec is not None:
        try:
            spec.resolved_path()  # refuses a path the CPU cannot run
        except ValueError as e:
            raise BackendError(str(e)) from None
        if device.type != "cpu":
            raise BackendError(f"the {backend} backend runs on CPU tensors only")
        return backend
    _check_float_name(backend)
    if backend == "auto":
        if device.type == "cuda":
            try:
                import triton  # noqa: F401

                return "triton"
            except ImportError:
                return "torch"
        try:
            import numba  # noqa: F401

            return "numba"
        except ImportError:
            return "torch"
    if backend == "numba" and device.type != "cpu":
        raise BackendError("the numba backend runs on CPU tensors only")
    if backend == "triton" and device.type != "cuda" and not _triton_interpreted():
        raise BackendError("the triton backend needs a CUDA device (or TRITON_INTERPRET=1 for testing)")
    return backend


def _triton_interpreted() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


def check_sparse_cache(sparse: SparseConfig | None, cache: KVCache | PagedKV) -> None:
    """ValueError where sparse decode would run over a cache without block bounds: decoding dense
    there would report dense figures under a sparse name."""
    if sparse is not None and cache.bounds is None:
        raise ValueError(
            "sparse decode needs a cache that tracks block bounds: make it with the LLM's new_cache, "
            "or pass CacheOptions(track_blocks=True)"
        )


def select_blocks(
    q: torch.Tensor, cache: KVCache, layer: int, length: int, sparse: SparseConfig
) -> torch.Tensor | None:
    """Sparse decode's block choice for one query ``q [H, d]``: sorted indices [KV, n_sel], or None (dense).

    quest on CPU runs compiled (:func:`kvlens.kernels.quest.quest_select`); on CUDA, and for probe,
    the torch functions of :mod:`kvlens.kv.blocks` (the same selection, ties included)."""
    n_select = sparse.budget_blocks(length, BLOCK)
    nb = -(-length // BLOCK)
    if n_select >= nb:
        return None
    if sparse.method == "quest":
        kmin, kmax = cache.bounds.kmin[layer], cache.bounds.kmax[layer]
        if q.device.type == "cpu":
            return quest_select(q, kmin, kmax, nb, n_select)
        scores = quest_scores(q, kmin[:, :nb], kmax[:, :nb])
    else:
        scores = probe_scores(q, cache.k[layer].read_index(probe_positions(length, BLOCK).to(q.device)))
    return top_blocks(scores, n_select)


def turn(x: torch.Tensor, rot: Rotation, back: bool = False) -> torch.Tensor:
    """Query heads ``x [H, n, d]`` in a layer's stored basis (``back``: out of it); a per-KV-head
    rotation turns each KV head's group of query heads (GQA: query head i reads KV head i // (H/KV))
    or leaves the group alone (None). The turn is the fast Walsh-Hadamard pass of the rotation's span
    (JIT on the CPU: no torch op between the numba kernels), equal to ``x @ R`` (``x @ R.T``) up to
    float32 rounding."""
    if rot is None:
        return x
    apply = unrotate_rows if back else rotate_rows
    if isinstance(rot, int):
        return apply(x, rot)
    g = x.shape[0] // len(rot)
    groups = [x[h * g : (h + 1) * g] for h in range(len(rot))]
    return torch.cat(
        [xs.to(torch.float32) if r is None else apply(xs, r) for xs, r in zip(groups, rot, strict=True)]
    )


def split_kernel(
    kernel, q: torch.Tensor, k_store: HeadSplitStore, v_store: HeadSplitStore, end: int, blocks, table,
    window: int | None = None, **sink,
):  # fmt: skip
    """A fused decode kernel over a layer split per KV head: one call per head on its query group
    (and, given ``sink=(k, v)``, that head's sink rows)."""
    g = q.shape[0] // len(k_store.parts)
    rows = sink.get("sink")
    return torch.cat(
        [
            kernel(
                q[h * g : (h + 1) * g].contiguous(),
                ks,
                vs,
                end,
                blocks=None if blocks is None else blocks[h : h + 1],
                table=table,
                window=window,
                **({} if rows is None else {"sink": (rows[0][h : h + 1], rows[1][h : h + 1])}),
            )
            for h, (ks, vs) in enumerate(zip(k_store.parts, v_store.parts, strict=True))
        ]
    )


def _mode_kinds(mode: KVMode) -> list[tuple[StoreKind, StoreKind]]:
    """Every (K kind, V kind) pair ``mode`` stores: each layer's, each KV head's of a per-head layer."""
    layers = range(len(mode.layers))
    pairs = [mode.kinds(i) for i in layers] or [(mode.k, mode.v)]
    return pairs + [pair for i in layers for pair in mode.head_kinds(i) or ()]


def check_backend_mode(backend: str, mode: KVMode) -> None:
    """Refuse an integer backend (numba-int...) for a KV mode whose K it cannot score, or whose rows
    are packed N-bit codes (q7h, q6h, q5h: the integer kernels read int8 / 4-bit codes only). Checked
    when an :class:`Engine` is made, before ``kvlens generate`` echoes its prompt, and for each cache
    the attention reads."""
    spec = _int_spec(backend)
    if spec is None:
        return
    pairs = _mode_kinds(mode)
    kind = next((kind for pair in pairs for kind in pair if kind.packed), None)
    if kind is not None:
        raise BackendError(
            f"the {backend} backend cannot read {kind} rows (packed {kind.bits}-bit codes); "
            f"use the numba, triton or torch backend for {mode.name}"
        )
    if not all(spec.scores(k) for k, _ in pairs):
        four = ", or 4-bit with numba-int (q4, q4h)" if spec.qbits == 8 and not spec.pv8 else ""
        raise BackendError(
            f"the {backend} backend needs an int8 K cache (q8, q8h, q8-k, q8+mirror){four}, not {mode.name}"
        )


def check_backend_head_dim(backend: str, head_dim: int) -> None:
    """Refuse an integer backend for a model whose head_dim is not a multiple of 32: its query is
    quantized, and an int8 K's code sums are kept, per 32 values. Checked where an LLM is built or
    varied, so such a model fails at load, not at its first decode step (on a VNNI CPU, after a
    prefill; a server: at every request)."""
    if _int_spec(backend) is not None and head_dim % KSUM_BLOCK:
        raise BackendError(
            f"the {backend} backend needs head_dim divisible by {KSUM_BLOCK} (its query and K code sums are "
            f"per {KSUM_BLOCK} values); this model's is {head_dim}: use the numba, triton or torch backend"
        )


def _windowed_step(cache: KVCache, layer: int, q: torch.Tensor, start: int, win: int) -> torch.Tensor:
    """A windowed decode step on torch reads only the rows its window reaches and a block more (the
    mask selects), not all of them (the fused kernels read the window in place)."""
    end = start + 1
    lo = max(0, end - win - BLOCK)
    k_win, v_win = cache.k[layer].read(lo, end), cache.v[layer].read(lo, end)
    return sdpa_attention(q, k_win, v_win, torch.arange(start - lo, end - lo, device=q.device), win)


def layer_window(window: int | Sequence[int | None] | None, layer: int, end: int) -> int | None:
    """The attention window of ``layer`` (``window``: every layer's, or one per layer) for a query at
    ``end - 1``; None also while the window still holds every position."""
    win = window[layer] if isinstance(window, Sequence) else window
    return None if win is not None and end <= win else win


def _kernel_step(kernel, cache: KVCache | PagedKV, layer: int, q: torch.Tensor, end: int, blocks, win):
    """One decode step of ``layer`` through a fused kernel, the stores read in place (a paged cache
    through its block table, a per-head layer one call per KV head): the window's rows, or without a
    window every row, the sink rows from their own store."""
    ks, vs = cache.k[layer], cache.v[layer]
    run = functools.partial(split_kernel, kernel) if isinstance(ks, HeadSplitStore) else kernel
    rows = {"sink": cache.sink_rows(layer, end)} if cache.sink and win is None else {}
    table = cache.table if isinstance(cache, PagedKV) else None
    return run(q[:, 0], ks, vs, end, blocks=blocks, table=table, window=win, **rows).unsqueeze(1)


def _torch_step(cache, layer: int, q: torch.Tensor, start: int, win: int | None, blocks, prefill: bool):
    """Attention of ``q [H, n, d]`` at ``start ..`` over every cached row in torch, the causal, window
    and sparse-block masks applied."""
    end = start + q.shape[1]
    k_all, v_all = cache.read(layer, end, prefill=prefill)
    q_pos = torch.arange(start, end, device=q.device)
    kv_mask = None if blocks is None else blocks_to_mask(blocks, end, BLOCK)
    return sdpa_attention(q, k_all, v_all, q_pos, win, kv_mask)


def make_attend(
    cache: KVCache | PagedKV,
    prefill: bool,
    backend: str = "torch",
    window: int | Sequence[int | None] | None = None,
    sparse: SparseConfig | None = None,
    profiler: Profiler | None = None,
    step: AttendStep | None = None,
) -> AttendFn:
    """An ``attend`` callback for one forward pass (``prefill`` says which phase the mirror mode sees).

    ``window``: every layer's attention window, or one per layer (``ModelConfig.layer_windows``).

    With ``sparse`` (decode steps only; the cache must track blocks), layers past the dense ones attend
    only the selected blocks: the fused kernels read just those blocks, the torch path masks the rest.

    With ``step`` (the engine's, :class:`~kvlens.kernels.attend_step.AttendStep`), a decode step's
    write and attention run as one compiled call where it applies (:func:`~kvlens.engine.fused_step.attend_fused`:
    CPU, the numba backends, no sparse decode); the same results.
    """
    kernel = _fused_kernel(backend)
    check_backend_mode(backend, cache.mode)
    sink = cache.sink  # positions read from the cache's sink store (0: none)
    # Fused kernels read the stores directly; options that splice exact rows in go through torch.
    use_kernel = kernel is not None and not cache.options.keeps_exact
    check_sparse_cache(sparse, cache)
    paged = isinstance(cache, PagedKV)  # the kernels then read through its block table
    # rotated kinds (q8h, q4h, q7h / q6h / q5h): the query goes into K's stored basis, the output back from V's
    rotation = [rotations(cache.k[i], cache.v[i]) for i in range(len(cache.k))]

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
        if step is not None and q.shape[1] == 1 and not prefill and sparse is None:
            win = layer_window(window, layer, start + 1)
            out = attend_fused(step, cache, layer, q, k, v, start, win, backend)
            if out is not None:
                return out
        rk, rv = rotation[layer]
        return turn(attend_stored(layer, turn(q, rk), k, v, start), rv, back=True)

    def attend_stored(
        layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int
    ) -> torch.Tensor:
        timed(profiler, "kv_write", cache.write, layer, start, k, v)
        end = start + q.shape[1]
        decode = q.shape[1] == 1 and not prefill
        win = layer_window(window, layer, end)
        blocks = None
        if decode and sparse is not None and sparse.applies(layer, end):
            blocks = select_blocks(q[:, 0], cache, layer, end, sparse)
        # a window reached reads no sink rows once past them; one that still reaches them, or sparse
        # blocks, goes through torch's masks
        window_past_sink = win is not None and end - win >= sink
        if use_kernel and decode and (win is None or window_past_sink and blocks is None):
            return _kernel_step(kernel, cache, layer, q, end, blocks, win)
        split = isinstance(cache.k[layer], HeadSplitStore) or isinstance(cache.v[layer], HeadSplitStore)
        contiguous_rows = not (paged or split or cache.options.keeps_exact)
        if decode and window_past_sink and blocks is None and contiguous_rows:
            return _windowed_step(cache, layer, q, start, win)
        return _torch_step(cache, layer, q, start, win, blocks, prefill)

    return attend
