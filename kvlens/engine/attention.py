"""Attention over the KV cache: write the new rows, then attend through the chosen backend.

Backends:
    torch   read the cache as float32 (dequantizing int8 rows) and run torch SDPA — every mode,
            prefill and decode; the correctness baseline.
    numba   fused single-pass CPU decode kernel reading int8/f16/f32 rows directly (kernels.cpu);
            prefill chunks use the torch path.
    triton  the same algorithm on CUDA (kernels.gpu).
    auto    the fastest correct backend for the device and cache mode.
"""

from __future__ import annotations

import torch

from ..kernels.reference import sdpa_attention
from ..kv.cache import KVCache
from ..models.transformer import AttendFn

BACKENDS = ("auto", "torch", "numba", "triton")


class BackendError(ValueError):
    """An attention backend that cannot run here (missing package, wrong device, unsupported mode)."""


def _fused_kernel(backend: str):
    if backend == "numba":
        from ..kernels.cpu import decode_attention
    elif backend == "triton":
        from ..kernels.gpu import decode_attention_triton as decode_attention
    else:
        return None
    return decode_attention


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise BackendError(f"unknown attention backend {backend!r}; choose one of: {', '.join(BACKENDS)}")
    if backend == "auto":
        if device.type == "cuda":
            try:
                import triton  # noqa: F401

                return "triton"
            except ImportError:
                return "torch"
        try:
            import numba  # noqa: F401

            return "numba"
        except ImportError:
            return "torch"
    if backend == "numba" and device.type != "cpu":
        raise BackendError("the numba backend runs on CPU tensors only")
    if backend == "triton" and device.type != "cuda" and not _triton_interpreted():
        raise BackendError("the triton backend needs a CUDA device (or TRITON_INTERPRET=1 for testing)")
    return backend


def _triton_interpreted() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


def make_attend(cache: KVCache, prefill: bool, backend: str = "torch", window: int | None = None) -> AttendFn:
    """An ``attend`` callback for one forward pass (``prefill`` says which phase the mirror mode sees)."""
    kernel = _fused_kernel(backend)
    # Fused kernels read the stores directly; options that splice exact rows in go through torch.
    use_kernel = kernel is not None and not cache.keep_sink and not cache.keep_recent and window is None

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
        n = q.shape[1]
        cache.write(layer, start, k, v)
        end = start + n
        if use_kernel and n == 1 and not prefill:
            return kernel(q[:, 0], cache.k[layer], cache.v[layer], end).unsqueeze(1)
        k_all, v_all = cache.read(layer, end, prefill=prefill)
        q_pos = torch.arange(start, end, device=q.device)
        return sdpa_attention(q, k_all, v_all, q_pos, window)

    return attend
