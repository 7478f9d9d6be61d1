"""The serving engine's public interface (used by kvlens.serve and the benchmarks)."""

from .sampling import SamplingParams
from .scheduler import Engine, EngineConfig, EngineStats, QueueFullError, Request, TokenEvent

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineStats",
    "QueueFullError",
    "Request",
    "SamplingParams",
    "TokenEvent",
]
