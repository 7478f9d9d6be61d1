"""Integer dot products through the CPU's own instructions: numba ``@intrinsic`` functions whose
LLVM IR calls the x86 intrinsics (numba's auto-vectorizer never emits ``vpdpbusd`` / ``vpmaddubsw``).

Paths (:data:`PATHS`), each needing CPU features that :func:`choose_path` checks at run time —
compiling a function that holds an instruction the CPU lacks fails in LLVM ("Cannot select"), so a
path's functions are only ever compiled after its features were found:

    vnni512   AVX-512 VNNI, 512-bit: ``vpdpbusd`` (u8 x i8) / ``vpdpwssd`` (i16 x i16)
    vnni256   AVX-VNNI, or AVX-512 VNNI + VL: the same instructions on 256-bit registers
    avx2      ``vpmaddubsw`` + ``vpmaddwd`` (8-bit) / ``vpmaddwd`` (16-bit)
    portable  generic LLVM vector IR (widen, multiply, add; no x86 intrinsic): any CPU, the same
              integer sums

8-bit query (int8 codes, one scale per block of 32 values): ``vpdpbusd`` multiplies *unsigned* by
signed bytes, so the query is shifted by +128 and the key sum corrects it exactly in integers:
``sum q*k = sum (q+128)*k - 128 * sum k`` (``sum k`` per 32-block, stored at cache-write time).
AVX2's ``vpmaddubsw`` adds two u8 x i8 products into a *saturating* int16 (2 * 255 * 127 > 32767),
so the shifted form would clip; the avx2 path uses llama.cpp's sign trick instead,
``|q| * (k * sign q)`` (both factors within +-127, the pair sum <= 32258), and needs no key sum.

Lane geometry shared by every 8-bit path: a 32-bit accumulator lane sums 4 consecutive values, so
lane ``i`` covers values ``4i .. 4i+3`` and lies in query block ``4i // 32`` whatever the vector
width; each lane's int32 becomes f32 and is multiplied by its block's scale (``lane_scale``).

16-bit query (int16 codes, one scale per query head): signed x signed (``vpdpwssd`` / ``vpmaddwd``
on sign-extended key codes), int32 accumulation over the whole row (|sum| <= 32767 * 127 * 256 <
2^31 for head_dim <= 256), no correction needed.
"""

from __future__ import annotations

import functools

import llvmlite.binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils, config
from numba.core.errors import RequireLiteralValue
from numba.extending import intrinsic

PATHS = ("vnni512", "vnni256", "avx2", "portable")
# features each path needs (names as llvmlite's host features report them)
PATH_FEATURES: dict[str, tuple[tuple[str, ...], ...]] = {  # any one of the alternatives
    "vnni512": (("avx512f", "avx512bw", "avx512vnni"),),
    "vnni256": (("avxvnni", "avx2"), ("avx512vnni", "avx512vl", "avx2")),
    "avx2": (("avx2",),),
    "portable": ((),),
}
SHIFT = 128  # the +128 that makes an int8 query unsigned for vpdpbusd

# LLVM 21+ types the VNNI dot-product operands by element (<64 x i8>, <32 x i16>); older LLVM took
# <16 x i32> for every operand (both parse here through LLVM's auto-upgrade; use the native one).
_NEW_VNNI_TYPES = llvm.llvm_version_info >= (21,)

_I8, _I16, _I32, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()


def path_supported(path: str, features: dict[str, bool] | set[str] | frozenset[str]) -> bool:
    """Whether a CPU with ``features`` (a name set, or llvmlite's name -> bool map) runs ``path``."""
    have = {k for k, v in features.items() if v} if isinstance(features, dict) else set(features)
    return any(all(f in have for f in alt) for alt in PATH_FEATURES[path])


def choose_path(features: dict[str, bool] | set[str] | frozenset[str]) -> str:
    """The fastest path a CPU with ``features`` runs (a pure function of the feature set)."""
    return next(p for p in PATHS if path_supported(p, features))


@functools.cache
def host_features() -> frozenset[str]:
    """The CPU features numba compiles for; asked once (~1 ms a call). That is this CPU's, unless
    ``NUMBA_CPU_FEATURES`` (or ``NUMBA_CPU_NAME=generic``: none) pins them: a path's instructions
    then fail to compile in LLVM even where the CPU has them, so only the pinned set counts."""
    if config.CPU_FEATURES is not None:
        return features_from_flags(config.CPU_FEATURES)
    return frozenset(k for k, v in llvm.get_host_cpu_features().items() if v)


def features_from_flags(flags: str) -> frozenset[str]:
    """The enabled names of an LLVM feature string such as ``"+avx2,+fma,-avx512f"``."""
    return frozenset(f.strip()[1:] for f in flags.split(",") if f.strip().startswith("+"))


def _vec(elem: ir.Type, n: int) -> ir.VectorType:
    return ir.VectorType(elem, n)


def _call(builder, name: str, ret: ir.Type, args: list):
    fnty = ir.FunctionType(ret, [a.type for a in args])
    fn = cgutils.get_or_insert_function(builder.module, fnty, name)
    return builder.call(fn, args)


def _load(builder, addr, vty: ir.VectorType):
    ptr = builder.inttoptr(addr, vty.as_pointer())
    return builder.load(ptr, align=1)


def _vnni(builder, name: str, acc, a, b, bits: int):
    """``acc + dot(a, b)`` per 32-bit lane through llvm.x86.avx512.{vpdpbusd,vpdpwssd}.{512,256}."""
    if not _NEW_VNNI_TYPES:
        lanes = acc.type.count
        a, b = builder.bitcast(a, _vec(_I32, lanes)), builder.bitcast(b, _vec(_I32, lanes))
    return _call(builder, f"llvm.x86.avx512.{name}.{bits}", acc.type, [acc, a, b])


def _lanes_u8(builder, path: str, qa, sa, ka):
    """int32 lanes (4 values each) of one 8-bit chunk (:func:`_geometry`). ``qa``: the u8 query
    (q + 128 for VNNI, |q| for avx2); ``sa``: the signed codes (avx2's sign source, portable)."""
    if path in ("vnni512", "vnni256"):
        n = 64 if path == "vnni512" else 32
        q, k = _load(builder, qa, _vec(_I8, n)), _load(builder, ka, _vec(_I8, n))
        return _vnni(builder, "vpdpbusd", ir.Constant(_vec(_I32, n // 4), None), q, k, 8 * n)
    k = _load(builder, ka, _vec(_I8, 32))
    sgn = _load(builder, sa, _vec(_I8, 32))
    if path == "portable":  # generic IR: widen, multiply, add each 4 neighbours
        prod = builder.mul(builder.sext(sgn, _vec(_I32, 32)), builder.sext(k, _vec(_I32, 32)))
        parts = [builder.shuffle_vector(prod, prod, ir.Constant(_vec(_I32, 8), list(range(r, 32, 4))))
                 for r in range(4)]  # fmt: skip
        return builder.add(builder.add(parts[0], parts[1]), builder.add(parts[2], parts[3]))
    # avx2: sign trick, |q| * (k * sign q), both factors within +-127 so the int16 pair sum cannot clip
    q = _load(builder, qa, _vec(_I8, 32))
    ks = _call(builder, "llvm.x86.avx2.psign.b", _vec(_I8, 32), [k, sgn])
    pairs = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _vec(_I16, 16), [q, ks])
    ones = ir.Constant(_vec(_I16, 16), [1] * 16)
    return _call(builder, "llvm.x86.avx2.pmadd.wd", _vec(_I32, 8), [pairs, ones])


def _lanes_i16(builder, path: str, acc, qa, ka):
    """acc + int32 lanes (2 values each) of a 16-bit-query chunk (key codes sign-extended)."""
    n = 32 if path == "vnni512" else 16
    q = _load(builder, qa, _vec(_I16, n))
    k = builder.sext(_load(builder, ka, _vec(_I8, n)), _vec(_I16, n))
    if path == "portable":  # generic IR: widen to i32, multiply, add
        prod = builder.mul(builder.sext(q, _vec(_I32, n)), builder.sext(k, _vec(_I32, n)))
        return builder.add(acc, prod)
    if path == "avx2":
        return builder.add(acc, _call(builder, "llvm.x86.avx2.pmadd.wd", _vec(_I32, 8), [q, k]))
    return _vnni(builder, "vpdpwssd", acc, q, k, 512 if path == "vnni512" else 256)


def _geometry(path: str, qbits: int) -> tuple[int, int]:
    """(values per chunk, 32-bit lanes per chunk) of a path's vector step."""
    if qbits == 8:
        return (64, 16) if path == "vnni512" else (32, 8)
    return {"vnni512": (32, 16), "portable": (16, 16)}.get(path, (16, 8))


def _literal_path(code) -> str:
    if not isinstance(code, types.IntegerLiteral):
        raise RequireLiteralValue("the integer-dot path code must be a compile-time constant")
    return PATHS[code.literal_value]


def _sum_chunks(builder, hd_v, n_val: int, vec_type, step):
    """The vector accumulator after ``acc = step(acc, off)`` over the chunks of ``n_val`` values of a
    row of ``hd_v`` values (``off``: the chunk's first value), starting from zeros."""
    acc = cgutils.alloca_once_value(builder, ir.Constant(vec_type, None))
    with cgutils.for_range(builder, builder.udiv(hd_v, ir.Constant(hd_v.type, n_val))) as loop:
        off = builder.mul(loop.index, ir.Constant(hd_v.type, n_val))
        builder.store(step(builder.load(acc), off), acc)
    return builder.load(acc)


@intrinsic
def dot8(typingctx, path_code, q_addr, sgn_addr, k_addr, ls_addr, hd):
    """``dot8(PATH, q, sgn, k, lane_scale, hd) -> f32``: sum over 32-bit lanes of f32(lane's int sum)
    times ``lane_scale[lane]`` (addresses of contiguous rows; ``PATH`` a literal index into PATHS)."""
    path = _literal_path(path_code)
    n_val, n_lane = _geometry(path, 8)
    sig = types.float32(path_code, types.uintp, types.uintp, types.uintp, types.uintp, types.intp)

    def codegen(context, builder, signature, args):
        _, qa, sa, ka, la, hd_v = args
        fvec = _vec(_F32, n_lane)

        def step(acc, off):
            lanes = _lanes_u8(builder, path, builder.add(qa, off), builder.add(sa, off), builder.add(ka, off))
            scale = _load(builder, builder.add(la, off), fvec)  # lane i's f32 sits at byte 4i = value 4i
            return builder.fadd(acc, builder.fmul(builder.sitofp(lanes, fvec), scale))

        acc = _sum_chunks(builder, hd_v, n_val, fvec, step)
        return _call(builder, f"llvm.vector.reduce.fadd.v{n_lane}f32", _F32, [ir.Constant(_F32, 0.0), acc])

    return sig, codegen


@intrinsic
def dot16(typingctx, path_code, q_addr, k_addr, hd):
    """``dot16(PATH, q16, k, hd) -> int32``: sum of int16 query codes times int8 key codes."""
    path = _literal_path(path_code)
    n_val, n_lane = _geometry(path, 16)
    sig = types.int32(path_code, types.uintp, types.uintp, types.intp)

    def codegen(context, builder, signature, args):
        _, qa, ka, hd_v = args

        def step(acc, off):
            q_at = builder.add(qa, builder.mul(off, ir.Constant(hd_v.type, 2)))
            return _lanes_i16(builder, path, acc, q_at, builder.add(ka, off))

        acc = _sum_chunks(builder, hd_v, n_val, _vec(_I32, n_lane), step)
        return _call(builder, f"llvm.vector.reduce.add.v{n_lane}i32", _I32, [acc])

    return sig, codegen


def _pv_lanes(builder, path: str, acc, w4, vb, n: int):
    """acc + per 32-bit lane the dot of the 4 weight bytes ``w4`` (u8, the same in every lane) with
    the lane's 4 V bytes (i8): ``vpdpbusd`` on VNNI, generic widen-multiply-add elsewhere."""
    if path in ("vnni512", "vnni256"):
        return _vnni(builder, "vpdpbusd", acc, w4, vb, 32 * n)
    prod = builder.mul(builder.zext(w4, _vec(_I32, 4 * n)), builder.sext(vb, _vec(_I32, 4 * n)))
    parts = [builder.shuffle_vector(prod, prod, ir.Constant(_vec(_I32, n), list(range(r, 4 * n, 4))))
             for r in range(4)]  # fmt: skip
    return builder.add(acc, builder.add(builder.add(parts[0], parts[1]), builder.add(parts[2], parts[3])))


@intrinsic
def pv8(typingctx, path_code, acc_addr, p_addr, vt_addr, n4, hd):
    """``pv8(PATH, acc, p, vt, n4, hd)``: ``acc[d] += sum_j p[j] * v[j, d]`` in int32 for j < 4 * n4,
    ``p`` u8 weights, ``vt`` the int8 V rows interleaved by 4 (``vt[j // 4, d, j % 4]``), so each
    32-bit lane d takes 4 rows in one ``vpdpbusd`` (u8 x i8, no saturation) against the 4 weights
    broadcast to every lane. Exact integer sums on every path."""
    path = _literal_path(path_code)
    n = 16 if path == "vnni512" else 8  # 32-bit lanes (values of d) per step
    sig = types.void(path_code, types.uintp, types.uintp, types.uintp, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        _, acc_a, p_a, vt_a, n4_v, hd_v = args
        ivec, bvec = _vec(_I32, n), _vec(_I8, 4 * n)
        idx = hd_v.type
        with cgutils.for_range(builder, builder.udiv(hd_v, ir.Constant(idx, n))) as chunk:
            acc_at = builder.add(acc_a, builder.mul(chunk.index, ir.Constant(idx, 4 * n)))
            acc = cgutils.alloca_once_value(builder, _load(builder, acc_at, ivec))
            with cgutils.for_range(builder, n4_v) as row4:
                w = _load(
                    builder, builder.add(p_a, builder.mul(row4.index, ir.Constant(idx, 4))), _vec(_I32, 1)
                )
                w4 = builder.bitcast(builder.shuffle_vector(w, w, ir.Constant(ivec, [0] * n)), bvec)
                v_off = builder.add(builder.mul(row4.index, builder.mul(hd_v, ir.Constant(idx, 4))),
                                    builder.mul(chunk.index, ir.Constant(idx, 4 * n)))  # fmt: skip
                vb = _load(builder, builder.add(vt_a, v_off), bvec)
                builder.store(_pv_lanes(builder, path, builder.load(acc), w4, vb, n), acc)
            builder.store(builder.load(acc), builder.inttoptr(acc_at, ivec.as_pointer()), align=1)
        return context.get_dummy_value()

    return sig, codegen


# -- 4-bit codes (q4, q4h: llama.cpp's q4_0 nibble order, code + 8 unsigned) x an int8 query ------------
Q4_CHUNK = 32  # packed bytes per step: 64 values, two 32-value blocks


def _q4_lanes(builder, path: str, qa, ka):
    """8 int32 lanes of one 32-byte chunk of packed codes: lane i sums bytes 4i..4i+3, each byte's
    low nibble times the query's low half and its high nibble times the high half (the query chunk:
    32 low-half codes, then 32 high-half codes; :func:`kvlens.kernels.q4int.permute_query`). The
    codes are unsigned (0..15), the query signed: u8 x i8 as the instructions take them, no shift."""
    b32 = _vec(_I8, 32)
    k = _load(builder, ka, b32)
    lo = builder.and_(k, ir.Constant(b32, [15] * 32))
    hi = builder.lshr(k, ir.Constant(b32, [4] * 32))
    i8 = _vec(_I32, 8)
    if path == "vnni512":  # both halves in one 512-bit vpdpbusd, then the halves' lanes added
        both = builder.shuffle_vector(lo, hi, ir.Constant(_vec(_I32, 64), list(range(64))))
        q = _load(builder, qa, _vec(_I8, 64))
        v = _vnni(builder, "vpdpbusd", ir.Constant(_vec(_I32, 16), None), both, q, 512)
        halves = [builder.shuffle_vector(v, v, ir.Constant(i8, list(range(r, r + 8)))) for r in (0, 8)]
        return builder.add(*halves)
    q_lo = _load(builder, qa, b32)
    q_hi = _load(builder, builder.add(qa, ir.Constant(qa.type, 32)), b32)
    if path == "vnni256":
        acc = _vnni(builder, "vpdpbusd", ir.Constant(i8, None), lo, q_lo, 256)
        return _vnni(builder, "vpdpbusd", acc, hi, q_hi, 256)
    if path == "avx2":  # pair sums <= 2 * 15 * 127 (and their sum <= 7620): int16 never saturates
        pairs = builder.add(
            _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _vec(_I16, 16), [lo, q_lo]),
            _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _vec(_I16, 16), [hi, q_hi]),
        )
        return _call(builder, "llvm.x86.avx2.pmadd.wd", i8, [pairs, ir.Constant(_vec(_I16, 16), [1] * 16)])
    w32 = _vec(_I32, 32)  # portable: generic IR (widen, multiply, add each 4 neighbours)
    prod = builder.add(
        builder.mul(builder.zext(lo, w32), builder.sext(q_lo, w32)),
        builder.mul(builder.zext(hi, w32), builder.sext(q_hi, w32)),
    )
    parts = [builder.shuffle_vector(prod, prod, ir.Constant(i8, list(range(r, 32, 4)))) for r in range(4)]
    return builder.add(builder.add(parts[0], parts[1]), builder.add(parts[2], parts[3]))


@intrinsic
def score4(typingctx, path_code, q_addr, qoff_addr, qs_addr, k_addr, bs_addr, n_bytes, n_rows, out_addr):
    """``score4(PATH, q, qoff, qs, k, bs, n_bytes, n_rows, out)``: ``out[j]`` (f32) for the ``n_rows``
    contiguous packed rows at ``k`` (``n_bytes`` each, a multiple of :data:`Q4_CHUNK`) against one
    query head: per 32-bit lane ``i`` (:func:`_q4_lanes`; 8 per chunk, 4 per block), ``f32(dot_i -
    qoff[i]) * qs[i] * bs[j, block of i]``, summed. ``qoff``: int32, 8 x the query codes a lane
    multiplies (the stored codes' +8); ``qs``: f32, the lane's query block scale; ``bs``: f32, the
    rows' block scales ``[n_rows, n_bytes // 16]``. The integer part is exact on every path."""
    path = _literal_path(path_code)
    u = types.uintp
    sig = types.void(path_code, u, u, u, u, u, types.intp, types.intp, u)

    def codegen(context, builder, signature, args):
        _, qa, oa, sa, ka, ba, nb_v, nr_v, out_a = args
        idx = nb_v.type
        i8, f8 = _vec(_I32, 8), _vec(_F32, 8)
        c_chunk, c2 = ir.Constant(idx, Q4_CHUNK), ir.Constant(idx, 2)
        n_chunks = builder.udiv(nb_v, c_chunk)
        bcast = ir.Constant(i8, [0, 0, 0, 0, 1, 1, 1, 1])  # the chunk's two block scales over its lanes
        with cgutils.for_range(builder, nr_v) as row:
            j = row.index
            k_row = builder.add(ka, builder.mul(j, nb_v))
            bs_row = builder.add(
                ba, builder.mul(builder.mul(j, builder.mul(n_chunks, c2)), ir.Constant(idx, 4))
            )

            def step(acc, off, k_row=k_row, bs_row=bs_row):  # off: the chunk's first byte
                c = builder.udiv(off, c_chunk)
                lanes = _q4_lanes(
                    builder, path, builder.add(qa, builder.mul(off, c2)), builder.add(k_row, off)
                )
                lane_at = builder.mul(c, ir.Constant(idx, 32))  # 8 lanes x 4 bytes
                lanes = builder.sub(lanes, _load(builder, builder.add(oa, lane_at), i8))
                b2 = _load(builder, builder.add(bs_row, builder.mul(c, ir.Constant(idx, 8))), _vec(_F32, 2))
                scale = builder.fmul(_load(builder, builder.add(sa, lane_at), f8),
                                     builder.shuffle_vector(b2, b2, bcast))  # fmt: skip
                return builder.fadd(acc, builder.fmul(builder.sitofp(lanes, f8), scale))

            acc = _sum_chunks(builder, nb_v, Q4_CHUNK, f8, step)
            for half in (4, 2, 1):  # a tree of adds (an ordered reduction would chain eight)
                hi = builder.shuffle_vector(
                    acc, acc, ir.Constant(_vec(_I32, half), list(range(half, 2 * half)))
                )
                lo = builder.shuffle_vector(acc, acc, ir.Constant(_vec(_I32, half), list(range(half))))
                acc = builder.fadd(lo, hi)
            total = builder.extract_element(acc, ir.Constant(_I32, 0))
            out_at = builder.add(out_a, builder.mul(j, ir.Constant(idx, 4)))
            builder.store(total, builder.inttoptr(out_at, _F32.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def stage4(typingctx, k_addr, bs_addr, n_bytes, out_addr):
    """``stage4(k, bs, n_bytes, out)``: the packed 4-bit rows at ``k`` (``n_bytes``, a multiple of
    :data:`Q4_CHUNK`, contiguous rows) as f32 values ``(u - 8) * s_b`` at ``out`` in element order,
    ``bs`` the f32 block scales (one per 16 bytes). Generic IR only (no x86 intrinsic: every CPU);
    the same values as ``stage._stage_q4``'s loops (``u - 8`` is exact in f32, then one product)."""
    sig = types.void(types.uintp, types.uintp, types.intp, types.uintp)

    def codegen(context, builder, signature, args):
        ka, ba, nb_v, oa = args
        idx = nb_v.type
        b32, b64, f64 = _vec(_I8, 32), _vec(_I8, 64), _vec(_F32, 64)
        order = list(range(16)) + list(range(32, 48)) + list(range(16, 32)) + list(range(48, 64))
        with cgutils.for_range(builder, builder.udiv(nb_v, ir.Constant(idx, Q4_CHUNK))) as loop:
            c = loop.index
            k = _load(builder, builder.add(ka, builder.mul(c, ir.Constant(idx, Q4_CHUNK))), b32)
            lo = builder.and_(k, ir.Constant(b32, [15] * 32))
            hi = builder.lshr(k, ir.Constant(b32, [4] * 32))
            codes = builder.sub(builder.shuffle_vector(lo, hi, ir.Constant(_vec(_I32, 64), order)),
                                ir.Constant(b64, [8] * 64))  # fmt: skip
            b2 = _load(builder, builder.add(ba, builder.mul(c, ir.Constant(idx, 8))), _vec(_F32, 2))
            scale = builder.shuffle_vector(b2, b2, ir.Constant(_vec(_I32, 64), [0] * 32 + [1] * 32))
            vals = builder.fmul(builder.sitofp(codes, f64), scale)
            out_at = builder.add(oa, builder.mul(c, ir.Constant(idx, 4 * 2 * Q4_CHUNK)))
            builder.store(vals, builder.inttoptr(out_at, f64.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen
