"""kvlens: an LLM inference engine built around an int8 KV cache, and the lab that measures its cost."""

from .kernels.jitcache import apply_cache_default, lock_numba_cache
from .kernels.threads import apply_env_defaults, check_thread_env

apply_env_defaults()  # OpenMP settings, read when torch and numba load: before either is imported
check_thread_env()  # a NUMBA_NUM_THREADS numba cannot start with, named before numba's import fails on it
apply_cache_default()  # numba's cache folder, named by the kernels' sources (read when numba loads)
lock_numba_cache()  # numba's cache files are not safe for two processes at once

from .engine.llm import LLM  # noqa: E402
from .engine.loading import load  # noqa: E402
from .engine.sampling import SamplingParams  # noqa: E402

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__", "load"]
