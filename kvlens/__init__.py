"""kvlens: an LLM inference engine built around an int8 KV cache, and the lab that measures its cost."""

from .engine.llm import LLM, load
from .engine.sampling import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__", "load"]
