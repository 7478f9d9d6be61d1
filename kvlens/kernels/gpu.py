"""Fused decode attention in Triton: the algorithm of :mod:`kvlens.kernels.cpu` for GPUs.

One program per (kv_head, split): it loads the query rows of the whole GQA group once (padded to
``G_PAD >= 16`` rows so ``tl.dot`` applies), walks its slice of the sequence ``BLOCK_N`` positions at a
time with an online softmax, and writes ``(m, l, acc)``; a few torch ops merge the splits exactly
(Flash-Decoding). int8 rows are read as int8 with the K row scale folded into the score and the V row
scale into the softmax weight (vLLM's trick), never dequantized in memory. 4-bit rows (q4, q4h) are
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

LOG2E = 1.4426950408889634
tl = None  # triton.language, bound by _kernels(); the jit functions resolve it from module globals


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
    """Import triton and define the kernel (decorated now, so TRITON_INTERPRET is read at first use)."""
    global tl
    triton, tl = _import_triton()

    @triton.jit
    def split_kernel(
        Q, K, KS, V, VS, Acc, M, L, Blocks, n_sel, Table,
        length, split_len, stride_kh, stride_kt, stride_vh, stride_vt, stride_ksh, stride_vsh,
        stride_kst, stride_vst, qk_scale,
        GROUP: tl.constexpr, G_PAD: tl.constexpr, HD: tl.constexpr, D_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr, K_Q8: tl.constexpr, V_Q8: tl.constexpr, K_Q4: tl.constexpr,
        V_Q4: tl.constexpr, SPARSE: tl.constexpr, PAGED: tl.constexpr,
    ):  # fmt: skip
        h = tl.program_id(0)
        s = tl.program_id(1)
        n_splits = tl.num_programs(1)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D_PAD)
        gmask = g < GROUP
        dmask = d < HD
        # 4-bit rows (pack_q4's layout): element d is in byte 16*(d//32) + d%16, high nibble if d%32 >= 16
        byte_of = (d // 32) * 16 + d % 16
        shift_of = ((d % 32) // 16 * 4).to(tl.uint8)
        # All query heads of the group, pre-scaled by log2(e)/sqrt(hd): the softmax runs in base 2.
        q = tl.load(
            Q + (h * GROUP + g)[:, None] * HD + d[None, :], mask=gmask[:, None] & dmask[None, :], other=0.0
        )
        q = q.to(tl.float32) * qk_scale
        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D_PAD], tl.float32)
        # Splits divide the positions (contiguous dense) or a list of cache blocks (BLOCK_N is then the
        # cache block): this head's selected blocks (sparse) or every block of a paged cache, whose
        # logical block b is stored in block Table[b]. One loop serves all so the tile body exists once.
        lo = s * split_len
        if SPARSE or PAGED:
            hi = tl.minimum(lo + split_len, n_sel)
            n_iter = hi - lo
        else:
            hi = tl.minimum(lo + split_len, length)
            n_iter = tl.cdiv(hi - lo, BLOCK_N)
        for i in range(0, n_iter):
            if SPARSE or PAGED:
                if SPARSE:
                    lb = tl.load(Blocks + h * n_sel + lo + i)
                else:
                    lb = lo + i
                n = lb * BLOCK_N + tl.arange(0, BLOCK_N)  # logical positions
                nmask = n < length
                if PAGED:
                    r = tl.load(Table + lb) * BLOCK_N + tl.arange(0, BLOCK_N)  # where they are stored
                else:
                    r = n
            else:
                n = lo + i * BLOCK_N + tl.arange(0, BLOCK_N)
                nmask = n < hi
                r = n
            kmask = nmask[None, :] & dmask[:, None]
            if K_Q4:  # [D, N]: code pairs and fp16 block scales, unpacked in registers
                kb = tl.load(
                    K + h * stride_kh + r[None, :] * stride_kt + byte_of[:, None], mask=kmask, other=8
                )
                kc = ((kb >> shift_of[:, None]) & 15).to(tl.float32) - 8.0
                kd = tl.load(
                    KS + h * stride_ksh + r[None, :] * stride_kst + (d // 32)[:, None], mask=kmask, other=0.0
                )
                kt = kc * kd.to(tl.float32)
            else:
                kt = tl.load(K + h * stride_kh + r[None, :] * stride_kt + d[:, None], mask=kmask, other=0)
            sc = tl.dot(q, kt.to(tl.float32), input_precision="ieee")  # [G_PAD, BLOCK_N]
            if K_Q8:  # K row scale folded into the score
                ks = tl.load(KS + h * stride_ksh + r, mask=nmask, other=0.0)
                sc = sc * (ks * (1.0 / 127.0))[None, :]
            sc = tl.where(nmask[None, :], sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(sc - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if V_Q8:  # V row scale folded into the weight
                vs = tl.load(VS + h * stride_vsh + r, mask=nmask, other=0.0)
                p = p * (vs * (1.0 / 127.0))[None, :]
            vmask = nmask[:, None] & dmask[None, :]
            if V_Q4:  # [N, D]
                vb = tl.load(
                    V + h * stride_vh + r[:, None] * stride_vt + byte_of[None, :], mask=vmask, other=8
                )
                vc = ((vb >> shift_of[None, :]) & 15).to(tl.float32) - 8.0
                vd = tl.load(
                    VS + h * stride_vsh + r[:, None] * stride_vst + (d // 32)[None, :], mask=vmask, other=0.0
                )
                vt = vc * vd.to(tl.float32)
            else:
                vt = tl.load(V + h * stride_vh + r[:, None] * stride_vt + d[None, :], mask=vmask, other=0)
            acc = acc * alpha[:, None] + tl.dot(p, vt.to(tl.float32), input_precision="ieee")
            m_i = m_new
        item = h * n_splits + s
        tl.store(M + item * G_PAD + g, m_i)
        tl.store(L + item * G_PAD + g, l_i)
        tl.store(Acc + (item * G_PAD + g)[:, None] * D_PAD + d[None, :], acc)

    return split_kernel


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


def decode_attention_triton(
    q: torch.Tensor,
    k_store,
    v_store,
    length: int,
    n_splits: int | None = None,
    block_n: int = 64,
    blocks: torch.Tensor | None = None,
    table: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of ``q [n_heads, hd]`` over the first ``length`` rows of one layer's K/V
    :class:`~kvlens.kv.cache.RowStore` (every kind, mixed K/V kinds included; rotated kinds as
    stored: ``q`` in K's basis, the result in V's), in Triton.

    Returns float32 ``[n_heads, hd]`` on the stores' device. ``block_n``: positions per step (power
    of 2, >= 16); ``n_splits``: sequence splits per KV head (default :func:`choose_splits_gpu`).
    ``blocks [n_kv, n_sel]``: sparse decode — attend only these cache blocks (BLOCK positions each).
    ``table [n_blocks]``: a paged cache's block table (logical block j stored in block ``table[j]`` of
    the stores; ``blocks`` then name logical blocks), read in place.
    """
    kernel = _kernels()
    k, v = k_store.data, v_store.data
    n_kv, cap = k.shape[:2]
    hd = k_store.head_dim
    n_heads = q.shape[0]
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
    group = n_heads // n_kv
    g_pad, d_pad = _next_pow2(group, 16), _next_pow2(hd, 16)
    dev = k.device
    n_sel, selected = 0, torch.zeros(1, dtype=torch.int32, device=dev)
    if blocks is not None:
        selected = torch.as_tensor(blocks, dtype=torch.int32).to(dev).contiguous()
        n_sel, block_n = selected.shape[1], BLOCK
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
        block_n = BLOCK
        if blocks is None:
            n_sel = -(-length // BLOCK)  # the split loop walks every logical block
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
        length, split_len, k.stride(0), k.stride(1), v.stride(0), v.stride(1), ks.stride(0), vs.stride(0),
        kst, vst, LOG2E / math.sqrt(hd),
        GROUP=group, G_PAD=g_pad, HD=hd, D_PAD=d_pad, BLOCK_N=block_n,
        K_Q8=k_store.kind.int8, V_Q8=v_store.kind.int8, K_Q4=k_store.kind.int4, V_Q4=v_store.kind.int4,
        SPARSE=blocks is not None, PAGED=table is not None,
    )  # fmt: skip
    # Exact merge of the splits (base 2): empty splits have m = -inf, l = 0 and weigh exp2(-inf) = 0.
    m_max = m.amax(dim=1, keepdim=True)
    w = torch.exp2(m - m_max)
    out = (acc * w[..., None]).sum(1) / (lsum * w).sum(1)[..., None]
    return out[:, :group, :hd].reshape(n_heads, hd)
