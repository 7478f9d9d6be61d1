"""The serving engine's public interface (used by kvlens.serve and the benchmarks)."""

from .sampling import SamplingParams
from .scheduler import Engine, EngineConfig, EngineStats, QueueFullError, fitted_config, run_alone, run_batch
from .sequence import Request, TokenEvent

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineStats",
    "QueueFullError",
    "Request",
    "SamplingParams",
    "TokenEvent",
    "fitted_config",
    "run_alone",
    "run_batch",
]
