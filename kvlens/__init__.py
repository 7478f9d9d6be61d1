"""kvlens: an LLM inference engine built around an int8 KV cache, and the lab that measures its cost."""

import os

# torch and numba each load their own OpenMP runtime; with the default busy-wait policy the idle
# spinning threads of one starve the other on small machines (measured: one layer's q8 decode
# attention at 16K, 8B shape, 29.9 ms with the default policy vs 9.6 ms passive, in
# `kvlens bench attention --sparse quest --ctx 16k --shape 8b`). Must be set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from .engine.llm import LLM, load  # noqa: E402
from .engine.sampling import SamplingParams  # noqa: E402

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__", "load"]
