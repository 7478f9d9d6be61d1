"""KV-cache modes, quantizers and storage."""

from .cache import BLOCK, KVCache, NonFiniteKVError
from .modes import MODES, CacheOptions, KVMode, StoreKind, UnknownKVModeError
from .quant import NonFiniteError, dequantize_q8, q8_step, quantize_q8

__all__ = [
    "BLOCK",
    "MODES",
    "CacheOptions",
    "KVCache",
    "KVMode",
    "NonFiniteKVError",
    "StoreKind",
    "UnknownKVModeError",
    "NonFiniteError",
    "dequantize_q8",
    "q8_step",
    "quantize_q8",
]
