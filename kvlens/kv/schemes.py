"""KV quantization schemes side by side, behind one interface (``SCHEMES[name]``).

Every scheme quantizes a K or V tensor ``[..., L, d]`` (tokens, head_dim) in groups along one axis:

=========  ==========================================  ====================  ====================
name       rule                                        group / axis          bits per value
=========  ==========================================  ====================  ====================
``q8``     the seed's rule, :mod:`kvlens.kv.quant`      one row of d values   8 + 32/d (fp32 scale)
``q8_0``   llama.cpp q8_0: d = absmax/127 (fp16),       32 along head_dim     8 + 16/32 = 8.5
           q = roundf(x * (1/d)) (half away from 0)
``q4``     llama.cpp q4_0: d = (signed max)/-8 (fp16),  32 along head_dim     4 + 16/32 = 4.5
           q = min(15, (int)(x/d + 8.5)) - 8 in [-8, 7]
``fp8``    e4m3 per token-head: s = absmax/448 (fp32),  one row of d values   8 + 32/d
           code = float8_e4m3fn(x / s), RNE
``kivi``   KIVI-2: asymmetric min/max, 2 bits; keys     32 tokens (K),        2 + 64/32 = 4
           per channel, values per token                 32 channels (V)
``kivi4``  the same with 4 bits                         as kivi               4 + 64/32 = 6
=========  ==========================================  ====================  ====================

``q4`` is llama.cpp's q4_0 (:func:`kvlens.kv.quant.quantize_q4_0_blocks`): the block's extreme
lands on -8 exactly and all 16 levels are used (step |max|/8, not the symmetric rule's |max|/7), at
the price of clipping the other side at +7: an element there can be off by up to a whole step
(|error| <= max(step/2, |x| - 7 step)), which the property tests check.

``q8_0``/``q4`` reproduce llama.cpp's arithmetic: codes are computed with the fp32 ``1/d`` but
dequantized with the fp16-rounded d, so the error grows by |q|·|d - fp16(d)| (at most 127·2^-11 ≈ 6%
of a step for q8_0). KIVI's scale and minimum are kept in fp32 here (the
paper stores fp16); its "last R tokens in full precision" window is a cache policy, not part of
the quantizer, and is not applied. Non-finite input raises :class:`NonFiniteError` in every scheme.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .quant import (
    Q4_LOW,
    Q8_MAX,
    check_finite,
    dequantize_q8,
    q8_step,
    quantize_q4_0_blocks,
    quantize_q8,
    quantize_sym_blocks,
)

ROLES = ("k", "v")
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_MIN_EXP = -6  # e4m3: smallest normal 2^-6, 3 mantissa bits -> subnormal spacing 2^-9


@dataclass
class QTensor:
    """Codes and scales of one quantized tensor, grouped as ``[..., n_groups, group]``."""

    codes: torch.Tensor  # int8 / uint8 / float8_e4m3fn
    scale: torch.Tensor  # [..., n_groups]: the stored scale (q8: max_abs, as the seed stores it)
    zero: torch.Tensor | None  # [..., n_groups] minimum (asymmetric schemes) or None
    shape: torch.Size  # the input's shape
    axis: int  # -1: groups run along head_dim; -2: along tokens (per-channel)


def _to_groups(x: torch.Tensor, axis: int, group: int) -> torch.Tensor:
    """Move ``axis`` last, pad it to a multiple of ``group`` by repeating its last value (which
    changes no group's min, max or absmax) and split it: ``[..., n_groups, group]``."""
    x = x.movedim(axis, -1)
    pad = -x.shape[-1] % group
    if pad:
        x = torch.cat([x, x[..., -1:].expand(*x.shape[:-1], pad)], dim=-1)
    return x.reshape(*x.shape[:-1], -1, group)


def _from_groups(y: torch.Tensor, shape: torch.Size, axis: int) -> torch.Tensor:
    n = shape[axis]
    y = y.reshape(*y.shape[:-2], -1)[..., :n]
    return y.movedim(-1, axis)


class Scheme:
    """Base class: subclasses define ``_quantize``/``_dequantize``/``_step`` on grouped tensors."""

    name = ""
    description = ""
    code_bits = 8
    scale_bits = 32  # stored scale (and zero) bits per group
    group: int | None = 32  # None: the whole head_dim row is one group
    fp16_scale = False  # scale rounded to fp16 after the codes were computed (llama.cpp)
    qmax = 127.0  # largest |code| of the symmetric integer schemes

    def axis(self, role: str = "k") -> int:
        """The axis along which a group runs for K (``role="k"``) or V."""
        if role not in ROLES:
            raise ValueError(f"role must be 'k' or 'v', not {role!r}")
        return -1

    def _group_size(self, x: torch.Tensor, axis: int) -> int:
        return self.group or x.shape[axis]

    def quantize(self, x: torch.Tensor, role: str = "k") -> QTensor:
        """Quantize ``x [..., L, d]`` as a K (``role="k"``) or V tensor."""
        x = x.to(torch.float32)
        check_finite(x, f"{self.name} input")
        axis = self.axis(role)
        if x.dim() < 2 and axis == -2:
            raise ValueError(f"{self.name} quantizes keys per channel: give a [..., L, d] tensor")
        codes, scale, zero = self._quantize(_to_groups(x, axis, self._group_size(x, axis)))
        return QTensor(codes, scale, zero, x.shape, axis)

    def dequantize(self, qt: QTensor) -> torch.Tensor:
        return _from_groups(self._dequantize(qt), qt.shape, qt.axis)

    def fake_quant(self, x: torch.Tensor, role: str = "k") -> torch.Tensor:
        """``dequantize(quantize(x))`` in float32, the shape of ``x``."""
        return self.dequantize(self.quantize(x, role))

    def step(self, x: torch.Tensor, role: str = "k") -> torch.Tensor:
        """Per-element quantization step (distance between the codes around each value), shape of ``x``."""
        qt = self.quantize(x, role)
        xg = _to_groups(x.to(torch.float32), qt.axis, self._group_size(x, qt.axis))
        return _from_groups(self._step(xg, qt), qt.shape, qt.axis)

    def multiplier(self, qt: QTensor) -> torch.Tensor:
        """The per-group factor codes are multiplied by (q8 stores max_abs; the factor is max_abs/127)."""
        return qt.scale.to(torch.float32)

    def bits_per_value(self, qt: QTensor) -> float:
        """Storage bits per value of ``qt``, its scales (and minima) included. A group cut short, where
        head_dim (or, for keys grouped along tokens, L) is not a multiple of the group, keeps its own
        scale, so it costs more than the nominal figure of the table above."""
        return self.code_bits + self.scale_bits * qt.scale.numel() / math.prod(qt.shape)

    # -- per scheme ---------------------------------------------------------------------------
    def _quantize(self, xg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def _dequantize(self, qt: QTensor) -> torch.Tensor:
        raise NotImplementedError

    def _step(self, xg: torch.Tensor, qt: QTensor) -> torch.Tensor:
        return self.multiplier(qt).unsqueeze(-1).expand(xg.shape)  # a uniform code's step


class Q8(Scheme):
    name, group = "q8", None
    description = "seed rule: int8, one fp32 max_abs per (token, head) row, round half up"

    def _quantize(self, xg):
        q, max_abs = quantize_q8(xg, check=False)  # the one implementation of the seed's rule
        return q, max_abs, None

    def _dequantize(self, qt):
        return dequantize_q8(qt.codes, qt.scale)

    def multiplier(self, qt):
        return q8_step(qt.scale)


class BlockSym(Scheme):
    """llama.cpp-style blocks of 32 along head_dim with an fp16 scale (q8_0: d = absmax/qmax)."""

    scale_bits, fp16_scale = 16, True

    def _rule(self, xg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_sym_blocks(xg, self.qmax)

    def _quantize(self, xg):
        try:  # the one implementation of each rule (the cache's q4 kinds store q4's too)
            q, d16 = self._rule(xg)
        except ValueError as e:
            raise ValueError(f"{self.name}: {e}") from None
        return q, d16, None

    def _dequantize(self, qt):
        return qt.codes.to(torch.float32) * qt.scale.to(torch.float32).unsqueeze(-1)


class Q8_0(BlockSym):
    name, code_bits, qmax = "q8_0", 8, 127.0
    description = "llama.cpp q8_0: blocks of 32, int8, fp16 scale absmax/127, roundf"


class Q4(BlockSym):
    """llama.cpp's q4_0: the scale ``d = max / -8`` is signed; the step is |d|."""

    name, code_bits, qmax = "q4", 4, Q4_LOW  # qmax: the largest |code| (-8, the block's max)
    description = "llama.cpp q4_0: blocks of 32, codes -8..7, fp16 scale (signed max)/-8"

    def _rule(self, xg):
        return quantize_q4_0_blocks(xg)

    def multiplier(self, qt):
        return qt.scale.to(torch.float32).abs()


class FP8(Scheme):
    name, group, code_bits = "fp8", None, 8
    description = "fp8 e4m3 per (token, head) row, fp32 scale absmax/448"

    def _quantize(self, xg):
        amax = xg.abs().amax(dim=-1)
        # below this the scale would be subnormal/zero in fp32; such rows quantize to 0 with s = 1
        s = torch.where(
            amax >= torch.finfo(torch.float32).tiny * FP8_MAX, amax / FP8_MAX, torch.ones_like(amax)
        )
        y = (xg / s.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX)
        return y.to(torch.float8_e4m3fn), s, None

    def _dequantize(self, qt):
        return qt.codes.to(torch.float32) * qt.scale.unsqueeze(-1)

    def _step(self, xg, qt):
        # e4m3 spacing around y = x/s: 2^(e-3) in binade [2^e, 2^(e+1)), 2^-9 in the subnormal range
        y = (xg / qt.scale.unsqueeze(-1)).abs()
        _, e = torch.frexp(y)  # y = m * 2^e with m in [0.5, 1): binade exponent e - 1
        e = torch.clamp(e - 1, min=FP8_MIN_EXP)
        return torch.ldexp(torch.ones_like(y), e - 3) * qt.scale.unsqueeze(-1)


class Kivi(Scheme):
    """KIVI: asymmetric min/max codes; keys grouped per channel over 32 tokens, values per token."""

    group, scale_bits = 32, 64  # fp32 scale + fp32 minimum per group

    def __init__(self, bits: int) -> None:
        self.code_bits = bits
        self.levels = float(2**bits - 1)
        self.name = "kivi" if bits == 2 else f"kivi{bits}"
        self.description = (
            f"KIVI-{bits}: K per channel (groups of 32 tokens), V per token (32 channels), min/max"
        )

    def axis(self, role: str = "k") -> int:
        super().axis(role)
        return -2 if role == "k" else -1

    def _quantize(self, xg):
        lo, hi = xg.amin(dim=-1), xg.amax(dim=-1)
        scale = (hi - lo) / self.levels
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # constant group: all codes 0, exact
        q = torch.floor((xg - lo.unsqueeze(-1)) / safe.unsqueeze(-1) + 0.5).clamp_(0, self.levels)
        return q.to(torch.uint8), scale, lo

    def _dequantize(self, qt):
        return qt.codes.to(torch.float32) * qt.scale.unsqueeze(-1) + qt.zero.unsqueeze(-1)


SCHEMES: dict[str, Scheme] = {s.name: s for s in (Q8(), Q8_0(), Q4(), FP8(), Kivi(2), Kivi(4))}


def get_scheme(name: str) -> Scheme:
    """The registered scheme ``name``; ValueError listing the choices otherwise."""
    if name not in SCHEMES:
        raise ValueError(f"unknown scheme {name!r}; choose one of: {', '.join(SCHEMES)}")
    return SCHEMES[name]


__all__ = ["SCHEMES", "QTensor", "Scheme", "get_scheme", "Q8_MAX"]
