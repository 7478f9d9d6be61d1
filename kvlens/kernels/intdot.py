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
