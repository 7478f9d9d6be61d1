"""kvlens: an LLM inference engine built around an int8 KV cache, and the lab that measures its cost."""

import os

# torch and numba each load their own OpenMP runtime (libgomp). With the default wait policy (spin
# ~300k iterations) the idle spinning threads of one starve the other on small machines (measured:
# one layer's q8 decode attention at 16K, 8B shape, 29.9 ms vs 9.6 ms passive, in `kvlens bench
# attention --sparse quest --ctx 16k --shape 8b`). Fully passive threads sleep at once, and a decode
# step then pays a futex wake-up per parallel region (~120 per step): a short spin (GOMP_SPINCOUNT,
# which overrides PASSIVE's zero) keeps them awake between back-to-back kernels. Measured on the
# 2-core box: SmolLM2 int8 weights, q8 KV, 4K: 39.6 ms/step passive, 22.7 ms with 30000 spins; the
# 16K attention case above unchanged. Both must be set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("GOMP_SPINCOUNT", "30000")

from .engine.llm import LLM, load  # noqa: E402
from .engine.sampling import SamplingParams  # noqa: E402

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__", "load"]
