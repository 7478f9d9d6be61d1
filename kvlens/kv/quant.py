"""The seed's int8 KV rule: one fp32 ``max_abs`` per row, round half up, clamp to ±127.

The same rule at a narrower width (``bits`` N = 7, 6, 5: the packed kinds q7h, q6h, q5h) uses
``qmax = 2^(N-1) - 1`` (63, 31, 15) in place of 127; ``bits=8`` is the q8 rule itself.

For a row ``x`` of ``head_dim`` values (one token, one KV head, K or V separately)::

    max_abs = max |x|            (a row with max_abs < 1e-6 uses 1.0)
    q       = clamp(floor(x * (127 / max_abs) + 0.5), -127, 127)   as int8
    x'      = q * (max_abs / 127)

The arithmetic is done in float32 exactly as written (multiply by the reciprocal, not divide),
so results are bit-identical with the seed's C engine.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from ..checks import check_tensor
from ..kernels.bits import FP16_MAX
from ..kernels.q4store import GROUP_MAX_EPS, Q4_SEARCH, hadamard_rows, store_q4_rows
from ..kernels.q4store import Q4_BLOCK as JIT_Q4_BLOCK
from ..kernels.q8store import KSUM_BLOCK, NO_KSUM, first_nonfinite_index, store_q8_rows
from ..models.blockquant import symmetric_blocks
from .kinds import KSUM_BLOCK as KINDS_KSUM_BLOCK
from .kinds import Q4_BLOCK, row_qmax

Q8_MAX = 127.0
TINY_MAX_ABS = 1e-6


def fp16_overflow(peak: float, what: str) -> ValueError:
    """The one error for values whose fp16 scale (``what``: "max_abs of a row", "scale of a block")
    would overflow: ``peak`` is the largest |x| that asked for it."""
    return ValueError(f"|x| up to {peak:.3g} overflows the fp16 {what}")


class NonFiniteError(ValueError):
    """K/V contained NaN or Inf; quantizing it would silently produce garbage codes."""


def check_finite(x: torch.Tensor, what: str = "input") -> None:
    """Raise :class:`NonFiniteError` if ``x`` holds NaN or Inf."""
    if not bool(torch.isfinite(x).all()):
        bad = (~torch.isfinite(x)).nonzero()[0].tolist()
        raise NonFiniteError(f"non-finite value in {what} at index {tuple(bad)}; refusing to quantize it")


def row_max_abs(x: torch.Tensor) -> torch.Tensor:
    """Per-row max |x| over the last dimension, with the seed's 1e-6 floor replaced by 1.0."""
    m = x.abs().amax(dim=-1)
    return torch.where(m < TINY_MAX_ABS, torch.ones_like(m), m)


def quantize_q8(
    x: torch.Tensor, *, check: bool = True, bits: int = 8, fp16_scale: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize over the last dimension. Returns ``(q int8, max_abs float32)``; max_abs lacks the last dim.
    ``bits``: the rule with qmax :func:`row_qmax` (codes in ``-qmax..qmax``), 8 = q8's. ``fp16_scale``
    (the packed kinds): max_abs is rounded to fp16 (nearest even) and the codes are made with the
    rounded value; returned as float16; a row whose max_abs exceeds 65504 is refused (ValueError)."""
    qmax = float(row_qmax(bits))
    x = check_tensor(x, "x", floating=True, min_dim=1).to(torch.float32)
    if x.shape[-1] == 0:
        raise ValueError(f"x must have rows to quantize (a last dimension > 0), got shape {tuple(x.shape)}")
    if check:
        check_finite(x)
    max_abs = row_max_abs(x)
    if fp16_scale:
        if bool((max_abs > FP16_MAX).any()):
            raise fp16_overflow(float(max_abs.max()), "max_abs of a row")
        max_abs = max_abs.to(torch.float16).to(torch.float32)
    # float32 127/max_abs once per row, as the C engine does. Not ``Q8_MAX / max_abs``: torch computes a
    # scalar over a tensor as reciprocal(max_abs) * 127, which is an ulp off in ~1 row of 4 and then flips
    # a code now and then against the JIT store (kernels/q8store.py), which divides.
    inv = torch.full_like(max_abs, qmax).div_(max_abs)
    q = torch.floor(x * inv.unsqueeze(-1) + 0.5).clamp_(-qmax, qmax).to(torch.int8)
    return q, max_abs.to(torch.float16) if fp16_scale else max_abs


def dequantize_q8(
    q: torch.Tensor, max_abs: torch.Tensor, dtype: torch.dtype = torch.float32, bits: int = 8
) -> torch.Tensor:
    """Inverse of :func:`quantize_q8`: ``q * (max_abs / qmax)`` in float32 (qmax 127 at 8 bits)."""
    check_tensor(q, "q", dtypes=(torch.int8,), min_dim=1)
    check_tensor(max_abs, "max_abs", floating=True, shape=q.shape[:-1], no_nan=True)
    if bool((max_abs < 0).any()):  # a max |x| is never negative: the codes' signs would flip
        raise ValueError(f"max_abs must be ≥ 0, got {float(max_abs.min())}")
    step = (max_abs.to(torch.float32) / row_qmax(bits)).unsqueeze(-1)
    return (q.to(torch.float32) * step).to(dtype)


def q8_step(max_abs: torch.Tensor) -> torch.Tensor:
    """The quantization step (distance between adjacent codes) of each row."""
    return check_tensor(max_abs, "max_abs", floating=True).to(torch.float32) / Q8_MAX


def first_nonfinite(x: torch.Tensor) -> int | None:
    """Flat index of the first NaN/Inf in ``x``, or None (one pass; a JIT loop for CPU float32)."""
    if x.device.type == "cpu" and x.dtype == torch.float32:
        i = first_nonfinite_index(x.detach().contiguous().numpy())
        return None if i < 0 else int(i)
    bad = ~torch.isfinite(x)
    return int(bad.reshape(-1).nonzero()[0, 0]) if bool(bad.any()) else None


def block_sums(q: torch.Tensor) -> torch.Tensor:
    """Sum of int8 codes ``[..., d]`` per block of :data:`KSUM_BLOCK`: ``[..., d // 32]`` int16."""
    return q.to(torch.int32).unflatten(-1, (-1, KSUM_BLOCK)).sum(-1).to(torch.int16)


def store_q8(
    rows: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, start: int, ksum: torch.Tensor | None = None
) -> None:
    """Quantize ``rows [n_kv, n, d]`` by the rule above into ``data[:, start:start+n]`` (int8) and
    ``scale[:, start:start+n]`` (max_abs), in place; rows must be finite (the caller checks). With
    ``ksum [n_kv, cap, d // 32]`` (int16), also the codes' sum per 32-block (:func:`block_sums`)."""
    if rows.device.type == "cpu":
        ks = NO_KSUM if ksum is None else ksum.numpy()
        store_q8_rows(
            rows.detach().to(torch.float32).contiguous().numpy(), data.numpy(), scale.numpy(), start, ks
        )
        return
    q, max_abs = quantize_q8(rows, check=False)
    data[:, start : start + rows.shape[1]] = q
    scale[:, start : start + rows.shape[1]] = max_abs
    if ksum is not None:
        ksum[:, start : start + rows.shape[1]] = block_sums(q)


# -- the 4-bit rule (q4, q4h) ---------------------------------------------------------------------
# the JIT stores (kvlens-free leaves) keep their own copies of the block sizes
assert JIT_Q4_BLOCK == Q4_BLOCK and KINDS_KSUM_BLOCK == KSUM_BLOCK
Q4_LOW = 8.0  # q4_0: the block's signed max becomes code -8 (d = max / -8), codes -8..7


def quantize_sym_blocks(xg: torch.Tensor, qmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's symmetric block rule (q8_0's) with an fp16 scale, on groups ``xg [..., G]``: codes
    are computed with the f32 ``1/d`` (``d = absmax/qmax``), the scale is stored as fp16 (the lab's
    ``q8_0`` scheme). Returns ``(codes int8, d fp16 [...])``."""
    q, d = symmetric_blocks(xg, qmax)
    if bool((d > FP16_MAX).any()):
        raise fp16_overflow(float(d.max()) * qmax, "scale of a block")
    d16 = d.to(torch.float16)
    # a scale that underflows fp16 dequantizes to 0 whatever the codes: store 0 codes then
    q = torch.where((d16 == 0).unsqueeze(-1), torch.zeros_like(q), q)
    return q.to(torch.int8), d16


def quantize_q4_0_blocks(xg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's q4_0 (``quantize_row_q4_0_ref``) on f32 groups ``xg [..., 32]``: ``max`` = the
    element of largest |x| with its sign (the first on ties), ``d = max / -8``, ``id = d ? 1/d : 0``,
    stored code ``min(15, (int)(x * id + 8.5f))`` (0..15; here returned as ``code - 8``, -8..7:
    value = code * d), d stored as fp16 (signed). The step is |max|/8: all 16 levels are used, the
    max lands on -8 exactly and the other side clips at +7 (an error up to one step there). A block
    whose fp16 scale is zero gets codes 0 (values 0 as in C; C's codes there are multiplied by 0, or
    undefined where 1/d overflows). The one torch implementation (the cache's q4 kinds off the CPU,
    the lab's ``q4`` scheme); :func:`kvlens.kernels.q4store.store_q4_rows` is the JIT one."""
    at = xg.abs().argmax(dim=-1, keepdim=True)  # the first largest |x|, as C's strict ``amax < |v|``
    mx = xg.gather(-1, at).squeeze(-1)
    mx = torch.where(mx == 0, torch.zeros_like(mx), mx)  # C starts from +0.0f: never -0 here
    d = mx / -Q4_LOW  # exact: a power of two
    if bool((d.abs() > FP16_MAX).any()):
        raise fp16_overflow(float(mx.abs().max()), "scale of a block")
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    y = xg * inv.unsqueeze(-1)  # two f32 roundings as in C (no fused multiply-add)
    u = torch.trunc(y + 8.5).clamp_(max=15.0)  # y + 8.5 >= 0.5: the C cast truncates = floor
    d16 = d.to(torch.float16)
    q = torch.where((d16 == 0).unsqueeze(-1), torch.zeros_like(u), u - Q4_LOW)
    return q.to(torch.int8), d16


def quantize_q4_search_blocks(xg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q4h's block rule on f32 groups ``xg [..., 32]``: llama.cpp's scale search (``make_qx_quants``
    with weights 1: :func:`kvlens.kernels.q4store.searched_block`, the JIT one, bit-identical). Per
    candidate ``iscale = -Q4_SEARCH[c] / max``: codes ``clamp(round(iscale * x), -8, 7)`` (half to
    even), the least-squares step ``sum(l x) / sum(l²)``; the first candidate removing the most
    squared error wins, its step is stored as fp16 (through f32). Codes -8..7 (value = code * d);
    a block whose |max| is under GROUP_MAX_EPS, or whose step rounds to an fp16 zero, gets codes 0."""
    at = xg.abs().argmax(dim=-1, keepdim=True)
    mx = xg.gather(-1, at)
    nonzero = mx.abs() >= float(GROUP_MAX_EPS)
    iscale = -torch.from_numpy(Q4_SEARCH) / torch.where(nonzero, mx, torch.ones_like(mx))  # [..., 19]
    codes = torch.round(iscale.unsqueeze(-1) * xg.unsqueeze(-2)).clamp_(-8.0, 7.0)  # [..., 19, 32]
    wide = codes.double()
    lx = (wide * xg.double().unsqueeze(-2)).sum(-1)  # exact in float64: the order does not matter
    l2 = (wide * wide).sum(-1)
    best = (lx * lx / l2).argmax(dim=-1, keepdim=True)  # the first of equals, as C's strict ``>``
    d = (lx.gather(-1, best) / l2.gather(-1, best)).squeeze(-1).to(torch.float32)
    d = torch.where(nonzero.squeeze(-1), d, torch.zeros_like(d))
    over = d.abs() > FP16_MAX
    if bool(over.any()):
        raise fp16_overflow(float(mx.squeeze(-1).abs()[over].max()), "searched scale of a block")
    q = codes.gather(-2, best.unsqueeze(-1).expand(*best.shape, Q4_BLOCK)).squeeze(-2)
    d16 = d.to(torch.float16)
    q = torch.where((d16 == 0).unsqueeze(-1), torch.zeros_like(q), q)
    return q.to(torch.int8), d16


def quantize_q4(x: torch.Tensor, search: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The q4 rule (llama.cpp's q4_0, :func:`quantize_q4_0_blocks`), or with ``search`` q4h's
    (:func:`quantize_q4_search_blocks`), over rows ``x [..., d]`` in blocks of Q4_BLOCK:
    ``(codes int8 [..., d] in -8..7, scale fp16 [..., d / Q4_BLOCK], signed)``."""
    x = check_tensor(x, "x", floating=True, min_dim=1).to(torch.float32)
    d = x.shape[-1]
    _check_q4_width(d)
    rule = quantize_q4_search_blocks if search else quantize_q4_0_blocks
    q, d16 = rule(x.reshape(*x.shape[:-1], d // Q4_BLOCK, Q4_BLOCK))
    return q.reshape(x.shape), d16


def pack_q4(codes: torch.Tensor) -> torch.Tensor:
    """Two codes per byte, llama.cpp's q4_0 layout: in each block of 32 values, byte ``i`` (0..15)
    holds element ``i`` in its low nibble and element ``i + 16`` in its high one, each as
    ``code + 8`` (0..15), so unpacking writes two contiguous runs of 16 (vector stores).
    ``codes int8 [..., d]`` (d a multiple of 32) -> ``uint8 [..., d/2]``."""
    check_tensor(codes, "codes", dtypes=(torch.int8,), min_dim=1)
    if codes.shape[-1] % Q4_BLOCK:
        raise ValueError(f"pack_q4 needs a last dimension divisible by {Q4_BLOCK}, got {codes.shape[-1]}")
    if bool(((codes < -8) | (codes > 7)).any()):
        raise ValueError("4-bit codes must lie in -8..7")
    u = (codes.to(torch.int16) + 8).to(torch.uint8).reshape(*codes.shape[:-1], -1, Q4_BLOCK)
    half = Q4_BLOCK // 2
    return (u[..., :half] | (u[..., half:] << 4)).reshape(*codes.shape[:-1], codes.shape[-1] // 2)


def unpack_q4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_q4`: ``uint8 [..., d/2]`` -> codes ``int8 [..., d]``."""
    check_tensor(packed, "packed", dtypes=(torch.uint8,), min_dim=1)
    blocks = packed.reshape(*packed.shape[:-1], -1, Q4_BLOCK // 2)
    lo = (blocks & 15).to(torch.int8) - 8
    hi = (blocks >> 4).to(torch.int8) - 8
    return torch.cat((lo, hi), dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def dequantize_q4(
    packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Packed codes ``[..., d/2]`` and fp16 block scales ``[..., d/32]`` as values ``[..., d]``."""
    codes = unpack_q4(packed).to(torch.float32)
    blocks = codes.reshape(*codes.shape[:-1], -1, Q4_BLOCK) * scale.to(torch.float32).unsqueeze(-1)
    return blocks.reshape(codes.shape).to(dtype)


def _check_q4_width(d: int) -> None:
    if d % Q4_BLOCK:
        raise ValueError(f"q4 needs a last dimension divisible by {Q4_BLOCK}, got {d}")


def _raise_q4_overflow(x: np.ndarray, bad: int, search: bool) -> None:
    """The fp16 range error for flat block ``bad`` of rows ``x`` (none when ``bad`` < 0)."""
    if bad >= 0:
        block = x.reshape(-1, Q4_BLOCK)[bad]
        raise fp16_overflow(
            float(abs(block).max()), "searched scale of a block" if search else "scale of a block"
        )


def store_q4(
    rows: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, start: int, search: bool = False
) -> None:
    """Quantize ``rows [n_kv, n, d]`` by the q4 rule (``search``: q4h's) into
    ``data[:, start:start+n]`` (packed uint8) and ``scale[:, start:start+n]`` (fp16 per block), in
    place; nothing is stored if a block's scale is past fp16 (ValueError). On the CPU one JIT pass
    (:func:`kvlens.kernels.q4store.store_q4_rows`, bit-identical to the torch ops)."""
    if rows.device.type != "cpu":
        codes, d16 = quantize_q4(rows, search)
        data[:, start : start + rows.shape[1]] = pack_q4(codes)
        scale[:, start : start + rows.shape[1]] = d16
        return
    x = rows.detach().to(torch.float32).contiguous().numpy()
    _check_q4_width(x.shape[-1])
    bad = store_q4_rows(x, data.numpy(), scale.view(torch.int16).numpy().view(np.uint16), start, search)
    _raise_q4_overflow(x, bad, search)


# -- the rotation of the h kinds (q8h, q4h) ---------------------------------------------------------
ROTATION_SEED = 20261130  # fixed: a cache written by one process is read right by another


@functools.cache
def _signs(head_dim: int) -> torch.Tensor:
    """The rotation's fixed random signs ``s`` (float32 +-1)."""
    if head_dim < 1 or head_dim & (head_dim - 1):
        raise ValueError(f"a Hadamard rotation needs head_dim a power of two, got {head_dim}")
    gen = torch.Generator().manual_seed(ROTATION_SEED + head_dim)
    return torch.randint(0, 2, (head_dim,), generator=gen).to(torch.float32) * 2 - 1


def rotation_signs(head_dim: int) -> torch.Tensor:
    """The rotation's fixed random signs (float32 +-1; the fused decode step's turns read them)."""
    return _signs(head_dim)


def _span(head_dim: int, span: int | None) -> int:
    span = head_dim if span is None else span
    if span < 2 or span & (span - 1) or head_dim % span:
        raise ValueError(
            f"a Hadamard rotation's span must be a power of two dividing head_dim {head_dim}, got {span}"
        )
    return span


@functools.cache
def _rotation64(head_dim: int, span: int) -> torch.Tensor:
    signs = _signs(head_dim).to(torch.float64)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < span:  # Sylvester: H_2n = [[H, H], [H, -H]]
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return signs[:, None] * torch.block_diag(*[h] * (head_dim // span)) / math.sqrt(span)


def rotation(
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    span: int | None = None,
) -> torch.Tensor:
    """The orthonormal randomized Hadamard matrix ``R = diag(s) (I ⊗ H) / sqrt(span)`` (random signs
    ``s``, seeded; ``H`` the Sylvester Hadamard matrix of order ``span``, default head_dim, on each
    contiguous block of ``span`` values) of the rotated kinds (``StoreKind.rotation_span``): a row
    ``x`` is stored as ``x @ R``; ``y @ R.T`` turns it back.

    Scores are unchanged when the query is rotated too (``(q R)·(k R) = q·k``), and attention over
    rotated V rows is the rotated output (turned back with ``R.T``). The rotation spreads an outlier
    channel over the channels of its span, which is what makes low-bit codes of such rows accurate."""
    return _rotation64(head_dim, _span(head_dim, span)).to(dtype=dtype, device=device)


def _hadamard_scale(span: int) -> np.float32:
    return np.float32(1.0 / math.sqrt(span))


@functools.cache
def _ones(head_dim: int) -> torch.Tensor:
    return torch.ones(head_dim, dtype=torch.float32)


def _hadamard(rows: torch.Tensor, pre: torch.Tensor, post: torch.Tensor, span: int) -> torch.Tensor:
    """``((rows * pre) @ (I ⊗ H)) / sqrt(span) * post`` in float32 (``kernels.q4store.hadamard_rows``
    on the CPU, the same operations in torch elsewhere: bit-identical)."""
    d = rows.shape[-1]
    if rows.device.type == "cpu":
        x = rows.detach().to(torch.float32).contiguous()
        out = torch.empty_like(x)
        hadamard_rows(x.view(-1, d).numpy(), pre.numpy(), post.numpy(), span, out.view(-1, d).numpy())
        return out
    return _hadamard_torch(rows, pre, post, span)


def _hadamard_torch(rows: torch.Tensor, pre: torch.Tensor, post: torch.Tensor, span: int) -> torch.Tensor:
    d = rows.shape[-1]
    y = rows.to(torch.float32) * pre.to(rows.device)
    h = 1
    while h < span:  # the butterflies of stride < span: H on each contiguous block of span values
        pairs = y.reshape(*y.shape[:-1], d // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).reshape(y.shape)
        h *= 2
    return y * torch.tensor(_hadamard_scale(span), device=rows.device) * post.to(rows.device)


def rotate_rows_torch(rows: torch.Tensor, span: int | None = None) -> torch.Tensor:
    """:func:`rotate_rows` in torch ops on any device: the reference the JIT pass must equal."""
    d = rows.shape[-1]
    return _hadamard_torch(rows, _signs(d), _ones(d), _span(d, span))


def rotate_rows(rows: torch.Tensor, span: int | None = None) -> torch.Tensor:
    """``rows [..., d]`` (d a power of two) in the rotated kinds' stored basis, ``rows @ R`` up to
    float32 rounding (:func:`rotation` of the same ``span``, default d), as a new float32 tensor: a
    fast Walsh–Hadamard transform (signs, butterflies of stride 1, 2, 4, ... below ``span``, then
    ``1/sqrt(span)``), one JIT pass on the CPU."""
    d = rows.shape[-1]
    return _hadamard(rows, _signs(d), _ones(d), _span(d, span))


def unrotate_rows(rows: torch.Tensor, span: int | None = None) -> torch.Tensor:
    """The inverse of :func:`rotate_rows`: ``rows @ R.T`` (attention's output over rotated V rows)."""
    d = rows.shape[-1]
    return _hadamard(rows, _ones(d), _signs(d), _span(d, span))
