"""The Triton kernel of :mod:`kvlens.kernels.gpu` (imported by it on first use, so that triton is
only needed, and ``TRITON_INTERPRET`` only read, when a Triton decode runs).

One program per (kv_head, split); the helpers below are ``@triton.jit`` functions, inlined into the
kernel when it compiles.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tile_positions(
    i, lo, hi, h, length, first, Blocks, n_sel, Table,
    BLOCK_N: tl.constexpr, SPARSE: tl.constexpr, PAGED: tl.constexpr,
):  # fmt: skip
    """Step ``i`` of a split: which of its positions are read here (``nmask``) and the store rows
    ``r`` that hold them. Splits divide the positions (contiguous dense) or a list of cache blocks
    (BLOCK_N is then the cache block): this head's selected blocks (sparse) or every block of a
    paged cache, whose logical block b is stored in block Table[b]. Positions below ``first`` (a
    sink, read from its own store and merged by the caller) are not read."""
    if SPARSE or PAGED:
        if SPARSE:
            lb = tl.load(Blocks + h * n_sel + lo + i)
        else:
            lb = lo + i
        n = lb * BLOCK_N + tl.arange(0, BLOCK_N)  # logical positions
        nmask = (n < length) & (n >= first)
        if PAGED:
            r = tl.load(Table + lb) * BLOCK_N + tl.arange(0, BLOCK_N)  # where they are stored
        else:
            r = n
    else:
        n = lo + i * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = (n < hi) & (n >= first)
        r = n
    return nmask, r


@triton.jit
def _load_rows(
    X, XS, h, r, nmask, d, dmask, stride_h, stride_t, stride_sh, stride_st,
    Q4: tl.constexpr, D_FIRST: tl.constexpr, BITS: tl.constexpr,
):  # fmt: skip
    """Rows ``r`` of KV head ``h`` as f32, ``[D, N]`` when ``D_FIRST`` (K, for ``q @ k``) else
    ``[N, D]`` (V). 4-bit rows (pack_q4's layout: element d is in byte 16*(d//32) + d%16, high nibble
    if d%32 >= 16) are loaded as code pairs with their fp16 block scales and unpacked in registers.
    ``BITS`` > 0: packed N-bit rows (kv.nbit: element d in row bits [d*N, d*N+N), two's complement),
    read as the byte pair holding the field and sign-extended; their row scale is the caller's."""
    if D_FIRST:
        rows, cols, mask = r[None, :], d[:, None], nmask[None, :] & dmask[:, None]
    else:
        rows, cols, mask = r[:, None], d[None, :], nmask[:, None] & dmask[None, :]
    if BITS > 0:
        bit = cols * BITS
        at = X + h * stride_h + rows * stride_t + bit // 8
        shift = bit % 8
        lo = tl.load(at, mask=mask, other=0).to(tl.int32)
        hi = tl.load(at + 1, mask=mask & (shift + BITS > 8), other=0).to(tl.int32)
        field = ((lo | (hi << 8)) >> shift) & ((1 << BITS) - 1)
        half: tl.constexpr = 1 << (BITS - 1)
        return ((field ^ half) - half).to(tl.float32)
    if Q4:
        byte_of = (cols // 32) * 16 + cols % 16
        shift_of = ((cols % 32) // 16 * 4).to(tl.uint8)
        b = tl.load(X + h * stride_h + rows * stride_t + byte_of, mask=mask, other=8)
        codes = ((b >> shift_of) & 15).to(tl.float32) - 8.0
        scale = tl.load(XS + h * stride_sh + rows * stride_st + cols // 32, mask=mask, other=0.0)
        return codes * scale.to(tl.float32)
    return tl.load(X + h * stride_h + rows * stride_t + cols, mask=mask, other=0).to(tl.float32)


@triton.jit
def split_kernel(
    Q, K, KS, V, VS, Acc, M, L, Blocks, n_sel, Table,
    length, first, split_len, stride_kh, stride_kt, stride_vh, stride_vt, stride_ksh, stride_vsh,
    stride_kst, stride_vst, qk_scale,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, HD: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, K_Q8: tl.constexpr, V_Q8: tl.constexpr, K_Q4: tl.constexpr,
    V_Q4: tl.constexpr, SPARSE: tl.constexpr, PAGED: tl.constexpr, K_BITS: tl.constexpr,
    V_BITS: tl.constexpr, K_QMAX: tl.constexpr, V_QMAX: tl.constexpr,
):  # fmt: skip
    """One (kv_head, split): online softmax over the split's positions for the whole GQA group;
    writes the split's ``(m, l, acc)`` (base 2) for the merge."""
    h = tl.program_id(0)
    s = tl.program_id(1)
    n_splits = tl.num_programs(1)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    gmask = g < GROUP
    dmask = d < HD
    # All query heads of the group, pre-scaled by log2(e)/sqrt(hd): the softmax runs in base 2.
    q = tl.load(
        Q + (h * GROUP + g)[:, None] * HD + d[None, :], mask=gmask[:, None] & dmask[None, :], other=0.0
    )
    q = q.to(tl.float32) * qk_scale
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    lo = s * split_len
    if SPARSE or PAGED:  # one loop serves all layouts so the tile body exists once
        hi = tl.minimum(lo + split_len, n_sel)
        n_iter = hi - lo
    else:
        hi = tl.minimum(lo + split_len, length)
        n_iter = tl.cdiv(hi - lo, BLOCK_N)
    for i in range(0, n_iter):
        nmask, r = _tile_positions(i, lo, hi, h, length, first, Blocks, n_sel, Table, BLOCK_N, SPARSE, PAGED)
        kt = _load_rows(
            K, KS, h, r, nmask, d, dmask, stride_kh, stride_kt, stride_ksh, stride_kst, K_Q4, True, K_BITS
        )
        sc = tl.dot(q, kt, input_precision="ieee")  # [G_PAD, BLOCK_N]
        if K_Q8:  # K row scale folded into the score (int8 and packed rows: max_abs / qmax)
            ks = tl.load(KS + h * stride_ksh + r, mask=nmask, other=0.0).to(tl.float32)  # packed: fp16
            sc = sc * (ks * (1.0 / K_QMAX))[None, :]
        sc = tl.where(nmask[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a tile of sink positions only: no NaN
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(sc - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_Q8:  # V row scale folded into the weight
            vs = tl.load(VS + h * stride_vsh + r, mask=nmask, other=0.0).to(tl.float32)
            p = p * (vs * (1.0 / V_QMAX))[None, :]
        vt = _load_rows(
            V, VS, h, r, nmask, d, dmask, stride_vh, stride_vt, stride_vsh, stride_vst, V_Q4, False, V_BITS
        )
        acc = acc * alpha[:, None] + tl.dot(p, vt, input_precision="ieee")
        m_i = m_new
    item = h * n_splits + s
    tl.store(M + item * G_PAD + g, m_i)
    tl.store(L + item * G_PAD + g, l_i)
    tl.store(Acc + (item * G_PAD + g)[:, None] * D_PAD + d[None, :], acc)
