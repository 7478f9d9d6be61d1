"""Fused decode attention in Triton: the algorithm of :mod:`kvlens.kernels.cpu` for GPUs.

One program per (kv_head, split): it loads the query rows of the whole GQA group once (padded to
``G_PAD >= 16`` rows so ``tl.dot`` applies), walks its slice of the sequence ``BLOCK_N`` positions at a
time with an online softmax, and writes ``(m, l, acc)``; a few torch ops merge the splits exactly
(Flash-Decoding). int8 rows are read as int8 with the K row scale folded into the score and the V row
scale into the softmax weight (vLLM's trick), never dequantized in memory; packed N-bit rows (q7h,
q6h, q5h) likewise, their codes extracted from the bytes in registers. 4-bit rows (q4, q4h) are
loaded as packed bytes with their fp16 block scales and unpacked in registers (each byte is loaded
for both of its codes; the second load hits the cache). Rotated kinds are read as stored (the
caller rotates query and output, :func:`kvlens.kv.cache.rotations`). Float caches (f32, f16,
bf16) use the same kernel; the dots run in full f32 (``input_precision="ieee"``, no TF32) since
decode is bound by memory traffic, not by math.

triton is imported lazily: without it everything else in kvlens works, and only a call raises
:class:`TritonUnavailableError`. On a machine without a GPU the kernels run under Triton's interpreter
when ``TRITON_INTERPRET=1`` is set before the first call (slow: for tests at small sizes only).
"""

from __future__ import annotations

import functools
import math
import os

import torch

from ..kv.cache import BLOCK
from .reference import sink_state, sliding_window

LOG2E = 1.4426950408889634


class TritonUnavailableError(ImportError):
    """triton is not installed (or cannot run here); the Triton decode path cannot be used."""


def _import_triton():
    """(triton, triton.language), or :class:`TritonUnavailableError`."""
    try:
        import triton
        import triton.language as tl_mod
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise TritonUnavailableError(
            "decode_attention_triton needs the 'triton' package (pip install triton); "
            "use kvlens.kernels.cpu.decode_attention on CPU"
        ) from e
    return triton, tl_mod


@functools.cache
def _kernels():
    """Import triton and the kernel (decorated now, so TRITON_INTERPRET is read at first use)."""
    _import_triton()
    from .triton_decode import split_kernel

    return split_kernel


def _qmax(kind) -> float:
    """The row scale's divisor of a row-scaled kind (127.0 for q8; 1.0, unread, otherwise)."""
    return float(kind.qmax) if kind.row_scaled else 1.0


def _next_pow2(n: int, at_least: int = 1) -> int:
    return max(at_least, 1 << (n - 1).bit_length())


def choose_splits_gpu(length: int, n_kv: int, device: torch.device, block_n: int) -> int:
    """About two programs per SM (one per CPU core when interpreted), splits of at least 256 positions."""
    if device.type == "cuda":
        units = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        units = os.cpu_count() or 1
    want = max(1, -(-units // n_kv))
    return max(1, min(want, -(-length // max(256, block_n))))


def _block_lists(
    blocks, table, n_kv: int, cap: int, length: int, dev: torch.device
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The kernel's ``(Blocks, Table, n_sel)``: the sparse selection and the paged block table on
    ``dev`` (1-element dummies when absent), checked; ``n_sel``: the cache blocks each split loop
    walks (the selected ones, or every logical block of a paged cache)."""
    n_sel, selected = 0, torch.zeros(1, dtype=torch.int32, device=dev)
    if blocks is not None:
        selected = torch.as_tensor(blocks, dtype=torch.int32).to(dev).contiguous()
        n_sel = selected.shape[1]
        if (
            selected.shape[0] != n_kv
            or n_sel == 0
            or int(selected.max()) * BLOCK >= length
            or int(selected.min()) < 0
        ):
            raise ValueError(f"blocks must be [n_kv={n_kv}, n_sel>0] indices of blocks below {length}")
    page = torch.zeros(1, dtype=torch.int32, device=dev)
    if table is not None:
        page = torch.as_tensor(table, dtype=torch.int32).to(dev).contiguous()
        used = page[: -(-length // BLOCK)]
        if int(used.min()) < 0 or (int(used.max()) + 1) * BLOCK > cap:
            raise ValueError(f"a block table entry lies outside the store's {cap // BLOCK} blocks")
        if blocks is None:
            n_sel = -(-length // BLOCK)
    return selected, page, n_sel


def _check_call(
    q: torch.Tensor, k_store, v_store, length: int, block_n: int, table: torch.Tensor | None
) -> None:
    """Refuse shapes, lengths and block sizes the kernel cannot read, and a CPU run outside the interpreter."""
    k, v = k_store.data, v_store.data
    n_kv, cap = k.shape[:2]
    hd, n_heads = k_store.head_dim, q.shape[0]
    if q.shape != (n_heads, hd) or n_heads % n_kv or v.shape[:2] != k.shape[:2] or v_store.head_dim != hd:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("K/V rows must be contiguous")
    if not 1 <= length <= (cap if table is None else BLOCK * len(table)):
        raise ValueError(f"length {length} outside [1, cap={cap}] or the block table")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError("block_n must be a power of 2 >= 16")
    if k.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise TritonUnavailableError(
            "Triton kernels need a GPU, or TRITON_INTERPRET=1 for the CPU interpreter"
        )


def decode_attention_triton(
    q: torch.Tensor,
    k_store,
    v_store,
    length: int,
    n_splits: int | None = None,
    block_n: int = 64,
    blocks: torch.Tensor | None = None,
    table: torch.Tensor | None = None,
    sink: tuple[torch.Tensor, torch.Tensor] | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Decode attention of ``q [n_heads, hd]`` over the first ``length`` rows of one layer's K/V
    :class:`~kvlens.kv.cache.RowStore` (every kind, mixed K/V kinds included; rotated kinds as
    stored: ``q`` in K's basis, the result in V's), in Triton.

    Returns float32 ``[n_heads, hd]`` on the stores' device. ``block_n``: positions per step (power
    of 2, >= 16); ``n_splits``: sequence splits per KV head (default :func:`choose_splits_gpu`).
    ``blocks [n_kv, n_sel]``: sparse decode — attend only these cache blocks (BLOCK positions each).
    ``table [n_blocks]``: a paged cache's block table (logical block j stored in block ``table[j]`` of
    the stores; ``blocks`` then name logical blocks), read in place. ``sink``: K and V of the first s
    positions (as :func:`kvlens.kernels.cpu.decode_attention` takes them), read in place of the
    stores' rows there: the kernel skips those positions, the merge adds their softmax state.
    ``window``: a sliding window, read in place through the blocks it covers (as the CPU kernels).
    """
    kernel = _kernels()
    _check_call(q, k_store, v_store, length, block_n, table)
    k, v = k_store.data, v_store.data
    n_kv, cap = k.shape[:2]
    hd = k_store.head_dim
    n_heads = q.shape[0]
    group = n_heads // n_kv
    g_pad, d_pad = _next_pow2(group, 16), _next_pow2(hd, 16)
    dev = k.device
    blocks, first = sliding_window(n_kv, length, window, blocks, sink, BLOCK)
    first = first if sink is None else sink[0].shape[1]  # positions the kernel skips
    selected, page, n_sel = _block_lists(blocks, table, n_kv, cap, length, dev)
    if blocks is not None or table is not None:
        block_n = BLOCK  # the split loop walks cache blocks
    work = n_sel * BLOCK if blocks is not None or table is not None else length
    if n_splits is None:
        n_splits = choose_splits_gpu(work, n_kv, k.device, block_n)
    split_len = -(-(n_sel if blocks is not None or table is not None else length) // n_splits)
    acc = torch.empty(n_kv, n_splits, g_pad, d_pad, dtype=torch.float32, device=dev)
    m = torch.empty(n_kv, n_splits, g_pad, dtype=torch.float32, device=dev)
    lsum = torch.empty_like(m)
    ks = k_store.scale if k_store.kind.quantized else m  # any f32 tensor: unread when the kind is float
    vs = v_store.scale if v_store.kind.quantized else m
    kst, vst = (ks.stride(1) if ks.dim() == 3 else 0), (vs.stride(1) if vs.dim() == 3 else 0)
    qc = q.detach().to(device=dev, dtype=torch.float32).contiguous()
    kernel[(n_kv, n_splits)](
        qc, k, ks, v, vs, acc, m, lsum, selected, n_sel, page,
        length, first, split_len, k.stride(0), k.stride(1), v.stride(0), v.stride(1), ks.stride(0), vs.stride(0),
        kst, vst, LOG2E / math.sqrt(hd),
        GROUP=group, G_PAD=g_pad, HD=hd, D_PAD=d_pad, BLOCK_N=block_n,
        K_Q8=k_store.kind.row_scaled, V_Q8=v_store.kind.row_scaled, K_Q4=k_store.kind.int4,
        V_Q4=v_store.kind.int4, SPARSE=blocks is not None, PAGED=table is not None,
        K_BITS=k_store.kind.bits if k_store.kind.packed else 0, V_BITS=v_store.kind.bits if v_store.kind.packed else 0,
        K_QMAX=_qmax(k_store.kind), V_QMAX=_qmax(v_store.kind),
    )  # fmt: skip
    if sink is not None:
        parts = _sink_split(qc, sink, blocks, acc.shape)
        acc, m, lsum = (torch.cat([x, y], dim=1) for x, y in zip((acc, m, lsum), parts, strict=True))
    return _merge_splits(acc, m, lsum)[:, :group, :hd].reshape(n_heads, hd)


def _merge_splits(acc: torch.Tensor, m: torch.Tensor, lsum: torch.Tensor) -> torch.Tensor:
    """The exact merge of the splits' ``(acc, m, l)`` (m in base 2) over dim 1: empty splits have
    m = -inf, l = 0 and weigh exp2(-inf) = 0."""
    m_max = m.amax(dim=1, keepdim=True)
    w = torch.exp2(m - m_max)
    return (acc * w[..., None]).sum(1) / (lsum * w).sum(1)[..., None]


def _sink_split(q: torch.Tensor, sink, blocks, shape: torch.Size) -> tuple[torch.Tensor, ...]:
    """The sink's softmax state as one more split ``(acc, m, l)`` of the kernel's padded ``shape``
    ``[n_kv, splits, G_PAD, D_PAD]``, m in base 2; a sparse KV head whose blocks leave out block 0
    gets an empty one (it does not see the sink, as the torch path's block mask)."""
    n_kv, _, g_pad, d_pad = shape
    hd = q.shape[1]
    m, lsum, acc_s = sink_state(q / math.sqrt(hd), *sink)
    group = q.shape[0] // n_kv
    acc = torch.zeros(n_kv, 1, g_pad, d_pad, dtype=torch.float32, device=q.device)
    m2 = torch.full((n_kv, 1, g_pad), float("-inf"), dtype=torch.float32, device=q.device)
    l2 = torch.zeros_like(m2)
    acc[:, 0, :group, :hd] = acc_s.reshape(n_kv, group, hd).float()
    m2[:, 0, :group] = (m * LOG2E).reshape(n_kv, group).float()
    l2[:, 0, :group] = lsum.reshape(n_kv, group).float()
    if blocks is not None:
        blind = ~(torch.as_tensor(blocks, device=q.device) == 0).any(dim=1)
        m2[blind], l2[blind], acc[blind] = float("-inf"), 0.0, 0.0
    return acc, m2, l2
