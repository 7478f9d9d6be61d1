"""``kvlens lab unit --attn-backend``: the quantized side's attention through an engine decode kernel
(``numba``, ``numba-int``, ``numba-int16[:PATH]``) instead of the float reference, so the kernel's
own arithmetic (e.g. the integer kernels' quantized query) adds to the measured error.

K and V are written into the cache's row stores exactly as the engine writes them (q8 where
``--quantize`` names the tensor, f32 otherwise) and the kernel reads them; the seed's q8 scheme
produces the same codes (:mod:`kvlens.kv.quant`), so the reference side and the kernel see the
same cache."""

from __future__ import annotations

import torch

from ..engine.attention import decode_kernel
from ..kernels.cpu_int import IntAttn
from ..kv.cache import RowStore
from ..kv.modes import StoreKind

CPU = torch.device("cpu")


def check_backend(backend: str, scheme: str, quantize: str) -> None:
    """ValueError naming the problem for a backend the unit experiment cannot run that way."""
    decode_kernel(backend, CPU)  # BackendError (a ValueError) for an unknown or unrunnable one
    if scheme != "q8":
        raise ValueError(f"--attn-backend reads the cache's q8 rows; it needs --scheme q8, not {scheme!r}")
    if IntAttn.parse(backend) is not None and "k" not in quantize:
        raise ValueError(f"the {backend} backend needs int8 keys: --quantize k or kv")


def kernel_attention(
    backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, quantize: str
) -> torch.Tensor:
    """Attention of ``q [H, 1, d]`` over ``k, v [KV, L, d]`` through ``backend``'s decode kernel, K/V
    stored as the engine stores them (q8 for the tensors in ``quantize``); returns ``[H, 1, d]`` f32."""
    n_kv, length, d = k.shape

    def store(x: torch.Tensor, role: str) -> RowStore:
        kind = StoreKind.Q8 if role in quantize else StoreKind.F32
        s = RowStore.empty(kind, n_kv, length, d, CPU, with_ksum=role == "k" and d % 32 == 0)
        s.write(0, x.to(torch.float32).contiguous())
        return s

    out = decode_kernel(backend, CPU)(
        q[:, 0].to(torch.float32).contiguous(), store(k, "k"), store(v, "v"), length
    )
    return out[:, None]
