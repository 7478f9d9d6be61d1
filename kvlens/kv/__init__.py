"""KV-cache quantizers and storage."""

from .cache import BLOCK, MODES, KVCache, NonFiniteKVError, UnknownKVModeError, parse_mode
from .quant import NonFiniteError, dequantize_q8, q8_step, quantize_q8

__all__ = [
    "BLOCK",
    "MODES",
    "KVCache",
    "NonFiniteKVError",
    "UnknownKVModeError",
    "parse_mode",
    "NonFiniteError",
    "dequantize_q8",
    "q8_step",
    "quantize_q8",
]
