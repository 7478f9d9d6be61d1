"""Per-tile conversion of cache rows to f32 for the fused CPU decode kernel (:mod:`.cpu`): every
storage kind, read from the store's raw bytes (one compiled signature for all), into an L1-resident
scratch tile. 4-bit rows are unpacked here; int8 rows are converted and their row scale folded in by
the caller (into the score or the softmax weight); packed N-bit rows (q7h, q6h, q5h) are extracted
here and scaled by their row's ``max_abs / qmax`` (an fp16 max_abs)."""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..kv.kinds import Q4_BLOCK, StoreKind
from .bits import F16_MAGIC, bf16_bits, f16_f32, int8_f32, same_bits
from .intdot import Q4_CHUNK, stage4

CODE_Q8, CODE_F16, CODE_BF16, CODE_F32, CODE_Q4 = 0, 1, 2, 3, 4
CODE_PACKED = 5  # packed kinds: code CODE_PACKED + bits (5..7 bits: 10..12)
# the one place a StoreKind becomes the int code the compiled core branches on (rotation is the
# caller's: a rotated kind is stored like its plain one)
_KIND_CODE = {
    **{kind: CODE_PACKED + kind.bits for kind in StoreKind if kind.packed},
    StoreKind.Q8: CODE_Q8,
    StoreKind.Q8H: CODE_Q8,
    StoreKind.Q4: CODE_Q4,
    StoreKind.Q4H: CODE_Q4,
    StoreKind.F16: CODE_F16,
    StoreKind.BF16: CODE_BF16,
    StoreKind.F32: CODE_F32,
}
Q4B = Q4_BLOCK
# reassoc+contract let LLVM vectorize the dot-product / sum reductions (and use FMA). No nnan/ninf:
# -inf is the "no score yet" running max of an empty split, and the merge relies on exp(-inf) = 0.
_FM = {"reassoc", "contract", "nsz"}


@njit(inline="always")
def q4_tile_scales(bsc, h, t0, nt, bs_u, bs_f):  # pragma: no cover - compiled
    """The fp16 block scales of rows t0..t0+nt of KV head h as f32, ``bs_f[j * nb + b]`` (``bs_u``: the
    same buffer's bits), in one flat pass (contiguous in the store): the f16 rows' exact conversion."""
    nb = np.uint64(bsc.shape[2])
    flat = bsc[h].reshape(-1)
    k0 = np.uint64(t0) * nb
    for k in range(np.uint64(nt) * nb):
        bs_u[k] = (np.uint32(flat[k0 + k]) & np.uint32(0x7FFF)) << np.uint32(13)
    for k in range(np.uint64(nt) * nb):
        bs_f[k] *= F16_MAGIC
    for k in range(np.uint64(nt) * nb):
        bs_u[k] |= (np.uint32(flat[k0 + k]) & np.uint32(0x8000)) << np.uint32(16)


@njit(fastmath=_FM, cache=True)
def _stage_q4(raw, bsc, h, t0, nt, dst_f, bs_u, bs_f):  # pragma: no cover - compiled
    """4-bit rows (llama.cpp's q4_0 layout, :func:`kvlens.kv.quant.pack_q4`): in each block of 32,
    byte i holds element i (low nibble) and i + 16 (high), each as code + 8. The tile's fp16 block
    scales (contiguous in the store) are converted first (:func:`q4_tile_scales`); then the tile's
    packed bytes (contiguous: a tile never crosses a block of a paged cache) go through
    :func:`intdot.stage4` 32 bytes at a time (generic vector IR: ~2x the numba loops it replaced,
    which ran 16 values per loop; docs/beyond-q8.md), a last odd block (head_dim 32) by the loop."""
    q4_tile_scales(bsc, h, t0, nt, bs_u, bs_f)
    row_bytes = raw.shape[2]
    total = nt * row_bytes
    whole = total - total % Q4_CHUNK
    stage4(raw[h, t0].ctypes.data, bs_f.ctypes.data, whole, dst_f.ctypes.data)
    if whole < total:  # one block of 16 bytes left: the last row's last block
        j, o1 = nt - 1, row_bytes - Q4B // 2
        sb = bs_f[whole // (Q4B // 2)]
        for i in range(Q4B // 2):
            u = raw[h, t0 + j, o1 + i]
            dst_f[j, 2 * o1 + i] = (np.float32(np.int32(u & np.uint8(15))) - np.float32(8.0)) * sb
            dst_f[j, 2 * o1 + Q4B // 2 + i] = (np.float32(np.int32(u >> np.uint8(4))) - np.float32(8.0)) * sb


@njit(inline="always")
def _convert_rows(src, h, t0, nt, dst, convert):  # pragma: no cover - compiled
    """dst[j, d] = convert(src[h, t0 + j, d]) for the tile's rows."""
    for j in range(nt):
        for d in range(dst.shape[1]):
            dst[j, d] = convert(src[h, t0 + j, d])


PAIR_BITS = (5, 6, 7)  # the packed widths unpack_row reads 16 codes per load (two groups)


def _splat(builder, x, vty: ir.VectorType):
    one = builder.insert_element(ir.Constant(vty, None), x, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(
        one, one, ir.Constant(ir.VectorType(ir.IntType(32), vty.count), [0] * vty.count)
    )


def _unpack_pair(builder, src, dst, steps, bits: int, skip: int) -> None:
    """16 codes (two groups, ``2 * bits`` bytes from ``src + skip``) from one 16-byte load at ``src``:
    code i (bits [i*N, i*N+N) of the pair) gets its two bytes in a 16-bit lane by one byte shuffle,
    then a shift up by ``16 - N - (i*N & 7)`` and an arithmetic shift down by ``16 - N`` leave it
    sign-extended; 16 exact conversions, one f32 product each, stored at ``dst``. ``bits`` and
    ``skip`` are constants, so the shuffle and the shifts are too."""
    i8, i16, i32, f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
    v16b, v16h, v16f = ir.VectorType(i8, 16), ir.VectorType(i16, 16), ir.VectorType(f32, 16)
    picks, ups = [], []
    for i in range(16):
        byte, shift = skip + ((i * bits) >> 3), (i * bits) & 7
        picks += [byte, byte + 1]
        ups.append(16 - bits - shift)
    loaded = builder.load(builder.inttoptr(src, v16b.as_pointer()), align=1)
    lanes = builder.bitcast(
        builder.shuffle_vector(loaded, loaded, ir.Constant(ir.VectorType(i32, 32), picks)), v16h
    )
    codes = builder.ashr(builder.shl(lanes, ir.Constant(v16h, ups)), ir.Constant(v16h, [16 - bits] * 16))
    builder.store(
        builder.fmul(builder.sitofp(codes, v16f), steps), builder.inttoptr(dst, v16f.as_pointer()), align=4
    )


def _unpack_pairs(builder, row, out, step, n_groups, bits: int):
    """The row's codes 16 at a time (:func:`_unpack_pair`) while a 16-byte load from the pair's first
    byte stays inside the row; where the groups are even in number, the last pair too, from a load
    that ends at the row's end. Returns the groups done."""
    idx = n_groups.type
    steps = _splat(builder, step, ir.VectorType(ir.FloatType(), 16))
    n_bytes, half = builder.mul(n_groups, ir.Constant(idx, bits)), builder.sdiv(n_groups, ir.Constant(idx, 2))
    # pairs p with 2p*bits + 16 <= n_bytes, at most n_groups // 2
    fits = builder.add(
        builder.sdiv(builder.sub(n_bytes, ir.Constant(idx, 16)), ir.Constant(idx, 2 * bits)),
        ir.Constant(idx, 1),
    )
    fits = builder.select(builder.icmp_signed("<", n_bytes, ir.Constant(idx, 16)), ir.Constant(idx, 0), fits)
    fits = builder.select(builder.icmp_signed("<", fits, half), fits, half)
    with cgutils.for_range(builder, fits) as loop:
        src = builder.add(row, builder.mul(loop.index, ir.Constant(idx, 2 * bits)))
        _unpack_pair(
            builder, src, builder.add(out, builder.mul(loop.index, ir.Constant(idx, 64))), steps, bits, 0
        )
    # an even count of groups of 16 bytes or more leaves one pair, 16 - 2*bits bytes short of a load
    even = builder.icmp_signed("==", builder.srem(n_groups, ir.Constant(idx, 2)), ir.Constant(idx, 0))
    tail = builder.and_(even, builder.icmp_signed("==", fits, builder.sub(half, ir.Constant(idx, 1))))
    tail = builder.and_(tail, builder.icmp_signed(">=", n_bytes, ir.Constant(idx, 16)))
    with builder.if_then(tail):
        src = builder.add(row, builder.sub(n_bytes, ir.Constant(idx, 16)))
        dst = builder.add(out, builder.mul(fits, ir.Constant(idx, 64)))
        _unpack_pair(builder, src, dst, steps, bits, 16 - 2 * bits)
    return builder.select(tail, n_groups, builder.mul(fits, ir.Constant(idx, 2)))


def _unpack_groups(builder, row, out, step, first, n_groups, bits):
    """Groups ``first..n_groups-1``, 8 codes per unaligned 64-bit load split into lanes by shifts (the
    last group's load ends at the row's end, so no byte past the row is read)."""
    idx, i64 = n_groups.type, ir.IntType(64)
    v8, f8 = ir.VectorType(i64, 8), ir.VectorType(ir.FloatType(), 8)
    n64 = builder.sext(bits, i64) if bits.type.width < 64 else bits
    shifts = builder.mul(_splat(builder, n64, v8), ir.Constant(v8, list(range(8))))
    up = _splat(builder, builder.sub(ir.Constant(i64, 64), n64), v8)
    steps = _splat(builder, step, f8)
    last = builder.sub(builder.mul(n_groups, bits), ir.Constant(idx, 8))  # the last 8 bytes of the row
    with cgutils.for_range_slice(builder, first, n_groups, ir.Constant(idx, 1)) as (g, _):
        gn = builder.mul(g, bits)
        at = builder.select(builder.icmp_signed("<", gn, last), gn, last)
        word = builder.load(builder.inttoptr(builder.add(row, at), i64.as_pointer()), align=1)
        word = builder.lshr(word, builder.mul(builder.sub(gn, at), ir.Constant(idx, 8)))
        codes = builder.ashr(builder.shl(builder.lshr(_splat(builder, word, v8), shifts), up), up)
        vals = builder.fmul(builder.sitofp(codes, f8), steps)
        dst = builder.add(out, builder.mul(g, ir.Constant(idx, 32)))
        builder.store(vals, builder.inttoptr(dst, f8.as_pointer()), align=4)


@intrinsic
def unpack_row(typingctx, row_addr, n_groups, bits, step, out_addr):
    """``unpack_row(row, n_groups, bits, step, out)``: the ``8 * n_groups`` codes of one packed row at
    ``row`` (each group of 8 is ``bits`` bytes, little-endian, code i its bits [i*N, i*N+N), signed)
    as f32 ``code * step`` at ``out``. For the kinds' widths (:data:`PAIR_BITS`) 16 codes per 16-byte
    load (:func:`_unpack_pairs`) while the load stays inside the row, then the rest, and other widths
    throughout, 8 per 64-bit load (:func:`_unpack_groups`); no byte past the row is read (the row
    must hold ≥ 8 bytes). Generic IR (every CPU); the same values as the scalar loop (exact
    conversion, one f32 product)."""
    sig = types.void(types.uintp, types.intp, types.intp, types.float32, types.uintp)

    def codegen(context, builder, signature, args):
        row, n_groups, bits, step, out = args
        done = cgutils.alloca_once_value(builder, ir.Constant(n_groups.type, 0))  # groups the pairs did
        for width in PAIR_BITS:
            with builder.if_then(builder.icmp_signed("==", bits, ir.Constant(bits.type, width))):
                builder.store(_unpack_pairs(builder, row, out, step, n_groups, width), done)
        _unpack_groups(builder, row, out, step, builder.load(done), n_groups, bits)
        return context.get_dummy_value()

    return sig, codegen


@njit(inline="always")
def _stage_packed(raw, bits, rsc16, h, t0, nt, dst_f):  # pragma: no cover - compiled
    """Packed rows (:mod:`kvlens.kv.nbit`): each group of 8 codes is ``bits`` whole bytes, little-endian;
    code i of the group is its bits [i*N, i*N+N), sign-extended, times the row's ``max_abs / qmax``
    (``rsc16 [n_kv, cap, 1]``: the fp16 max_abs bits of each row): :func:`unpack_row` per row, the
    scalar loop where a row holds fewer than 8 bytes (head_dim 8)."""
    mask = np.int32((1 << bits) - 1)
    half = np.int32(1 << (bits - 1))
    inv_qmax = np.float32(1.0) / np.float32(half - 1)
    groups = dst_f.shape[1] // 8
    for j in range(nt):
        step = f16_f32(rsc16[h, t0 + j, 0]) * inv_qmax
        if groups * bits >= 8:
            unpack_row(raw[h, t0 + j].ctypes.data, groups, bits, step, dst_f[j].ctypes.data)
            continue
        row = raw[h, t0 + j]
        for gi in range(groups):
            for i in range(8):
                lo_bit = i * bits
                at, shift = gi * bits + (lo_bit >> 3), lo_bit & 7
                w = np.int32(row[at])
                if shift + bits > 8:  # the field runs into the next byte (inside the group)
                    w |= np.int32(row[at + 1]) << np.int32(8)
                c = (w >> np.int32(shift)) & mask
                dst_f[j, gi * 8 + i] = np.float32((c ^ half) - half) * step


@njit(fastmath=_FM, cache=True)
def _stage(raw, code, bsc, h, t0, nt, dst_u, dst_f, bs_u, bs_f):  # pragma: no cover - compiled
    """Rows t0..t0+nt of KV head h as f32 in dst_f (dst_u: same buffer). ``raw``: the store's bytes
    ``[n_kv, cap, row_bytes]`` — one uint8 signature for every kind means a single (cached) compile.
    ``bsc``: the fp16 scale bits of a 4-bit store (one per block of 32; ``bs_u``/``bs_f``: their f32
    scratch) or of a packed store (its max_abs, ``[n_kv, cap, 1]``); int8 rows' fp32 scales are folded
    in by the caller."""
    hd = dst_f.shape[1]
    if code > CODE_PACKED:
        # one inlined copy per width, so ``bits`` is a constant there: the byte and field loops unroll
        if code == CODE_PACKED + 7:
            _stage_packed(raw, 7, bsc, h, t0, nt, dst_f)
        elif code == CODE_PACKED + 6:
            _stage_packed(raw, 6, bsc, h, t0, nt, dst_f)
        else:  # CODE_PACKED + 5: the packed codes of _KIND_CODE are 10..12
            _stage_packed(raw, 5, bsc, h, t0, nt, dst_f)
    elif code == CODE_Q4:
        _stage_q4(raw, bsc, h, t0, nt, dst_f, bs_u, bs_f)
    elif code == CODE_Q8:
        _convert_rows(raw.view(np.int8), h, t0, nt, dst_f, int8_f32)
    elif code == CODE_F32:
        _convert_rows(raw.view(np.uint32), h, t0, nt, dst_u, same_bits)
    elif code == CODE_BF16:
        _convert_rows(raw.view(np.uint16), h, t0, nt, dst_u, bf16_bits)
    else:  # f16; cache rows are finite by policy, so Inf/NaN bit patterns need no special case
        s16 = raw.view(np.uint16)
        for j in range(nt):
            for d in range(hd):
                dst_u[j, d] = (np.uint32(s16[h, t0 + j, d]) & np.uint32(0x7FFF)) << np.uint32(13)
            for d in range(hd):
                dst_f[j, d] *= F16_MAGIC  # exact: also renormalizes f16 subnormals
            for d in range(hd):
                dst_u[j, d] |= (np.uint32(s16[h, t0 + j, d]) & np.uint32(0x8000)) << np.uint32(16)
