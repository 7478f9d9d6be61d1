"""kvlens: an LLM inference engine built around an int8 KV cache, and the lab that measures its cost."""

import os

# torch and numba each load their own OpenMP runtime (libgomp). With the default wait policy the idle
# spinning threads of one starve the other on small machines; fully passive threads pay a wake-up per
# parallel region. A short spin (GOMP_SPINCOUNT overrides PASSIVE's zero) keeps them awake between
# back-to-back kernels. Measurements: docs/kernels.md section 4. Both must be set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("GOMP_SPINCOUNT", "30000")

from .engine.llm import LLM, load  # noqa: E402
from .engine.sampling import SamplingParams  # noqa: E402

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__", "load"]
