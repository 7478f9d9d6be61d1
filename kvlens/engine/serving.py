"""The serving engine's public interface (used by kvlens.serve and the benchmarks)."""

from .sampling import SamplingParams
from .scheduler import (
    Engine,
    EngineConfig,
    EngineStats,
    QueueFullError,
    Request,
    TokenEvent,
    run_alone,
    run_batch,
)

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineStats",
    "QueueFullError",
    "Request",
    "SamplingParams",
    "TokenEvent",
    "run_alone",
    "run_batch",
]
