"""Weights kept quantized: bf16, int8 and int4 linear layers with JIT (numba) CPU kernels.

Formats (``G`` = 32 inputs per group, the GGUF block size, so Q8_0/Q4_0/Q4_1 repack losslessly):

* ``int8``: ``w = code * scale``, symmetric, one f32 scale per (output row, group) — Q8_0's rule;
* ``int4``: ``w = code * scale + min``, codes 0..15, one f32 scale and min per (row, group) — Q4_1's
  rule (Q4_0 is the case ``min = -8 scale``);
* ``bf16``: the top half of each f32.

Scales and mins are f32 (GGUF's fp16 ones widen exactly): 9 bits per weight for int8 (Q8_0: 8.5),
6 for int4 (Q4_1: 5), 16 for bf16.

Why not torch's own weight-only ops (``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``)? On
this AVX2 CPU they measured ~10-20x *slower* than f32 ``F.linear`` at decode and ~40-80x at prefill
(``scripts/bench_qlinear.py``). The kernels here store each tile of TILE output rows as one
contiguous ``[in, TILE]`` block, so the inner loop runs over output columns: convert one row of
codes to f32 and ``axpy`` it into the accumulators — contiguous and branch-free, which LLVM
vectorizes (a row-dot layout leaves a 32-long reduction per group that it would not), and one
sequential stream per thread. Scales are applied once per group. Up to SMALL_M input rows (decode)
run this kernel; more rows (prefill) dequantize a few MiB of tiles at a time to f32 and call
torch's GEMM, which is compute-bound there anyway (the crossover measured at ~8 rows).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Self

import numpy as np
import torch
import torch.nn.functional as F

from ..kernels.qkernels import (
    G,
    _deq_bf16,
    _deq_int4,
    _deq_int8,
    _mv_bf16,
    _mv_f32,
    _mv_int4,
    _mv_int8,
)
from ..kernels.threads import run_serial_if
from .blockquant import symmetric_blocks

WEIGHT_MODES = ("f32", "bf16", "int8", "int4")
PRECISION = {"int4": 0, "int8": 1, "bf16": 2, "f32": 3}  # fusing mixed parts keeps the finest
SMALL_M = 8  # up to this many input rows run the JIT kernel; more dequantize tiles for torch's GEMM
TILE = 64  # output rows per kernel tile (the unit of storage and of parallel work)
TILE_ELEMS = 1 << 20  # f32 elements per dequantized tile on the GEMM path (4 MiB)
# Multiply-adds (or dequantized weights) below which a kernel runs on one thread: waking numba's
# thread pool costs more than such work, while decode-sized layers stream weights from DRAM, which
# two cores read faster than one (figures: docs/decode.md, "Steady speed").
PARALLEL_MIN_WORK = 1 << 16


# -- codes in row-major form: quantizers, GGUF repacking and concatenation meet here --------------------
@dataclass
class QCodes:
    """Quantized matrix ``[n, k]`` row-major: int8 codes, or int4 codes 0..15 (one per uint8)."""

    kind: str  # "int8" | "int4"
    codes: torch.Tensor  # [n, k] int8 (int8) or uint8 (int4)
    scales: torch.Tensor  # [n, ceil(k/G)] f32
    mins: torch.Tensor | None = None  # [n, ceil(k/G)] f32, int4 only

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @staticmethod
    def quantize(w: torch.Tensor, kind: str) -> QCodes:
        """Group-wise quantization of a float matrix ``[n, k]`` (round to nearest)."""
        n, k = w.shape
        ng = -(-k // G)
        # pad the last group with its own last value: no effect on its max |w|, min or max
        wg = F.pad(w.float(), (0, ng * G - k), mode="replicate").view(n, ng, G)
        if kind == "int8":
            q, scale = symmetric_blocks(wg, 127.0)  # Q8_0's rule, llama.cpp's rounding
            return QCodes(kind, q.to(torch.int8).view(n, -1)[:, :k].contiguous(), scale)
        if kind != "int4":
            raise ValueError(f"cannot quantize to {kind!r}")
        lo, hi = wg.amin(-1), wg.amax(-1)
        scale = (hi - lo) / 15
        inv = torch.where(scale > 0, 1 / scale, 0)
        q = torch.round((wg - lo[..., None]) * inv[..., None]).clamp_(0, 15).to(torch.uint8)
        return QCodes(kind, q.view(n, -1)[:, :k].contiguous(), scale, lo)

    def dequantize(self) -> torch.Tensor:
        """The float matrix these codes stand for (f32, unfused ``code * scale + min``)."""
        k = self.codes.shape[1]
        s = self.scales.repeat_interleave(G, 1)[:, :k]
        w = self.codes.float() * s
        return w + self.mins.repeat_interleave(G, 1)[:, :k] if self.mins is not None else w

    @staticmethod
    def cat(parts: list[QCodes]) -> QCodes:
        """Stack along output rows (groups run along inputs, so rows are independent)."""
        if len(parts) == 1:
            return parts[0]
        mins = None if parts[0].mins is None else torch.cat([p.mins for p in parts])
        return QCodes(
            parts[0].kind, torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]), mins
        )


def _run(fn: Callable[..., None], work: int, *args) -> None:
    """``fn(*args)``, on one thread when the work is too small to pay for a parallel region."""
    run_serial_if(work < PARALLEL_MIN_WORK, fn, *args)


# -- the linear layers ---------------------------------------------------------------------------------
def _block(a: torch.Tensor) -> torch.Tensor:
    """Per-row data [n, r] → [n_tiles, r, TILE]: each tile of TILE output rows is one contiguous
    stream, read front to back by one thread (a plain [r, n] transpose strides through memory)."""
    n = a.shape[0]
    nt = -(-n // TILE)
    a = torch.cat([a, a.new_zeros(nt * TILE - n, *a.shape[1:])]) if nt * TILE > n else a
    return a.view(nt, TILE, -1).transpose(1, 2).contiguous()


def _unblock(b: torch.Tensor, n: int) -> torch.Tensor:
    return b.transpose(1, 2).reshape(-1, b.shape[1])[:n]


class QLinear:
    """A weight ``[n, k]`` kept quantized; ``layer(x, bias)`` = ``F.linear(x, W, bias)`` in f32."""

    kind = ""

    def __init__(self, n: int, k: int, per_row: list[torch.Tensor]) -> None:
        self.shape = (n, k)
        self.device = per_row[0].device
        self._t = [_block(a) for a in per_row]  # torch-owned storage
        self._np = [a.numpy() for a in self._t] if self.device.type == "cpu" else None

    @classmethod
    def from_float(cls, w: torch.Tensor) -> Self:
        """The layer of a float weight ``[n, k]``: its codes in the layer's ``kind`` (int8, int4)."""
        return cls(QCodes.quantize(w, cls.kind))

    @property
    def kernel_arrays(self) -> tuple[np.ndarray, ...] | None:
        """The arrays the layer's JIT kernel reads (CPU), in its argument order; None elsewhere."""
        return None if self._np is None else tuple(self._np)

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() for a in self._t)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.shape[0]}x{self.shape[1]}, {self.nbytes / 2**20:.1f} MiB)"

    def _unpack(self, per_row: list[torch.Tensor]) -> torch.Tensor:
        """Per-row arrays of some rows → those rows of the float weight [rows, k] (f32)."""
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        """The float weight ``[n, k]`` (f32) this layer multiplies by."""
        return self._unpack([_unblock(a, self.shape[0]) for a in self._t])

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding lookup ``W[ids]`` (f32), dequantizing only those rows."""
        flat = ids.reshape(-1)
        rows = self._unpack([a[flat // TILE, :, flat % TILE] for a in self._t])
        return rows.view(*ids.shape, self.shape[1])

    # the kind's JIT kernels (qkernels): up to SMALL_M rows, and dequantize tiles for the GEMM path
    _mv = _deq = None

    def _kernel(self, x: np.ndarray, out: np.ndarray) -> None:
        self._mv(x, *self._np, out)

    def _deq_tiles(self, t0: int, out: np.ndarray) -> None:
        self._deq(*self._np, t0, out)

    def decode_rows(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``self(x)`` for independent rows ``x [m, k]`` (a decode batch), each row bit-identical to a
        one-row call: the decode kernel for any m (weights read once for all rows)."""
        if self._np is None:
            return torch.cat([self(x[b : b + 1], bias) for b in range(x.shape[0])])
        x2 = x.float().contiguous()
        out = torch.empty(x2.shape[0], self.shape[0], dtype=torch.float32)
        _run(self._kernel, x2.numel() * self.shape[0], x2.numpy(), out.numpy())
        if bias is not None:
            out += bias
        return out

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        n, k = self.shape
        if self._np is None:  # no JIT kernel off the CPU: dequantize per call (correct, not fast)
            return F.linear(x, self.dequantize().to(x.dtype), bias)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, k).float().contiguous()
        m = x2.shape[0]
        out = torch.empty(m, n, dtype=torch.float32)
        if m <= SMALL_M:
            _run(self._kernel, m * n * k, x2.numpy(), out.numpy())
        else:  # dequantize a few MiB of tiles at a time and let torch's GEMM do the flops
            step = max(1, TILE_ELEMS // (k * TILE))
            n_tiles = self._t[0].shape[0]
            for t0 in range(0, n_tiles, step):
                tile = torch.empty(k, min(step, n_tiles - t0) * TILE)
                _run(self._deq_tiles, tile.numel(), t0, tile.numpy())
                c0 = t0 * TILE
                w = min(tile.shape[1], n - c0)
                if w == n and tile.shape[1] == n:
                    torch.mm(x2, tile, out=out)
                else:
                    out[:, c0 : c0 + w] = x2 @ tile[:, :w]
        if bias is not None:
            out += bias
        return out.view(*lead, n)


class Int8Linear(QLinear):
    kind = "int8"
    _mv, _deq = staticmethod(_mv_int8), staticmethod(_deq_int8)

    def __init__(self, c: QCodes) -> None:
        super().__init__(*c.shape, [c.codes, c.scales])

    def _unpack(self, per_row):
        return QCodes("int8", *per_row).dequantize()


class Int4Linear(QLinear):
    kind = "int4"
    _mv, _deq = staticmethod(_mv_int4), staticmethod(_deq_int4)

    def __init__(self, c: QCodes) -> None:
        n, k = c.shape
        q = F.pad(c.codes, (0, k % 2))  # pair the last input with a zero code
        super().__init__(n, k, [q[:, 0::2] | (q[:, 1::2] << 4), c.scales, c.mins])

    def _unpack(self, per_row):
        packed, s, mn = per_row
        q = torch.stack([packed & 15, packed >> 4], -1).view(packed.shape[0], -1)[:, : self.shape[1]]
        return QCodes("int4", q, s, mn).dequantize()

    def _kernel(self, x, out):
        if x.shape[1] % 2:  # the kernel reads inputs in pairs: give the padding code a zero input
            x = np.pad(x, ((0, 0), (0, 1)))
        super()._kernel(x, out)


class BF16Linear(QLinear):
    kind = "bf16"
    _mv, _deq = staticmethod(_mv_bf16), staticmethod(_deq_bf16)

    def __init__(self, w: torch.Tensor) -> None:
        super().__init__(*w.shape, [w.to(torch.bfloat16).view(torch.int16)])
        if self._np is not None:
            self._np = [self._np[0].view(np.uint16)]

    @classmethod
    def from_float(cls, w: torch.Tensor) -> BF16Linear:
        return cls(w)

    def _unpack(self, per_row):
        return per_row[0].view(torch.bfloat16).float()


Matrix = torch.Tensor | QLinear


def matrix_bytes(m: Matrix) -> int:
    """The bytes a :data:`Matrix` holds (codes and scales for a :class:`QLinear`)."""
    return m.nbytes if isinstance(m, QLinear) else m.numel() * m.element_size()


def linear(x: torch.Tensor, w: Matrix, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for a float weight (one f32 row on the CPU: the JIT GEMV), the layer's own
    kernel for a quantized one."""
    if not isinstance(w, torch.Tensor):
        return w(x, bias)
    if x.numel() == x.shape[-1] and _f32_rows_kernel(x, w):
        return _f32_rows(x.reshape(1, -1), w, bias).view(*x.shape[:-1], w.shape[0])
    return F.linear(x, w, bias)


def _f32_rows_kernel(x: torch.Tensor, w: torch.Tensor) -> bool:
    return w.device.type == "cpu" and w.dtype == x.dtype == torch.float32


def _f32_rows(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = np.empty((x.shape[0], w.shape[0]), np.float32)
    _run(_mv_f32, w.numel() * x.shape[0], w.numpy(), x.contiguous().numpy(), out)
    y = torch.from_numpy(out)
    if bias is not None:
        y += bias
    return y


def embedding(w: Matrix, ids: torch.Tensor) -> torch.Tensor:
    return w[ids] if isinstance(w, torch.Tensor) else w.rows(ids)


def make_matrix(
    mode_for: Callable[[str], str],
    get_float: Callable[[str], torch.Tensor],
    get_codes: Callable[[str], QCodes | None],
    device: torch.device,
) -> Callable[[list[str]], Matrix]:
    """A ``matrix(names)`` builder for :func:`~kvlens.models.weights.build_weights`.

    Row-stacks the named tensors into one layer in the finest of their modes. Parts whose codes are
    already in that format (GGUF blocks repacked without a float round trip) are used as they are;
    the others are quantized from floats.
    """

    def matrix(names: list[str]) -> Matrix:
        mode = max((mode_for(n) for n in names), key=PRECISION.__getitem__)
        if mode not in PRECISION:
            raise ValueError(f"unknown weight mode {mode!r}; expected one of {', '.join(WEIGHT_MODES)}")

        def as_float(name: str) -> torch.Tensor:
            c = get_codes(name)
            return c.dequantize() if c is not None else get_float(name)

        if mode in ("f32", "bf16"):
            w = torch.cat([as_float(n) for n in names]).to(device=device, dtype=torch.float32)
            return w.contiguous() if mode == "f32" else BF16Linear(w)
        parts = []
        for name in names:
            c = get_codes(name)
            parts.append(c if c is not None and c.kind == mode else QCodes.quantize(as_float(name), mode))
        c = QCodes.cat(parts)
        c = QCodes(
            c.kind, c.codes.to(device), c.scales.to(device), None if c.mins is None else c.mins.to(device)
        )
        return Int8Linear(c) if mode == "int8" else Int4Linear(c)

    return matrix


def linear_rows(x: torch.Tensor, w: Matrix, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``linear`` of a batch of independent rows ``x [B, k]`` (one decode token per sequence), each
    row's result bit-identical to a one-row call (batch invariance): on the CPU one call of the decode
    kernel reads every weight once for the batch; elsewhere (torch's GEMMs pick their reduction by
    shape) the rows run one at a time."""
    if not isinstance(w, torch.Tensor):
        return w.decode_rows(x, bias)
    if _f32_rows_kernel(x, w):
        return _f32_rows(x, w, bias)
    return torch.cat([F.linear(x[b : b + 1], w, bias) for b in range(x.shape[0])])
