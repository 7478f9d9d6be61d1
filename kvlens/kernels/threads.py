"""The thread policy of the CPU kernels, in one place: OpenMP settings, thread counts, serial runs.

torch and numba each bring an OpenMP runtime (two libgomp copies in one process: torch's bundled one,
and the system one that numba's ``omp`` layer links). Their settings are read when each runtime
loads, so :func:`apply_env_defaults` runs from ``kvlens/__init__`` before torch is imported; a value
the user has set in the environment always wins. Why these values, and the measurements behind
them: docs/decode.md, "Steady speed".
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from collections.abc import Callable, MutableMapping
from typing import TypeVar

T = TypeVar("T")

# Idle OpenMP threads sleep (PASSIVE) instead of spinning, so one runtime's idle pool does not starve
# the other's busy one; a short spin (GOMP_SPINCOUNT, which overrides PASSIVE's zero) keeps them
# awake between the back-to-back parallel regions of one decode step.
ENV_DEFAULTS: dict[str, str] = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "30000"}


def apply_env_defaults(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set each of :data:`ENV_DEFAULTS` that ``environ`` lacks; returns the ones it set (the user's win)."""
    added = {k: v for k, v in ENV_DEFAULTS.items() if k not in environ}
    environ.update(added)
    return added


OPENMP_ENV = "KVLENS_OPENMP"  # "separate": leave torch with its bundled OpenMP runtime


def share_openmp_runtime(environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Load the system libgomp before torch, so that torch binds to it too and numba's ``omp`` layer
    (which links the system libgomp) shares torch's runtime: one pool of threads, not two pools
    taking turns on the same cores. Returns the library loaded, or None when it does not apply:
    torch already imported, no system libgomp, or ``KVLENS_OPENMP=separate`` in the environment."""
    if environ.get(OPENMP_ENV) == "separate" or "torch" in sys.modules:
        return None
    name = ctypes.util.find_library("gomp")
    if name is None:
        return None
    ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
    return name


def set_threads(threads: int | None) -> None:
    """Threads for numba's kernels and torch's ops alike (``None``/0: leave both as they are)."""
    if threads:
        import numba
        import torch

        numba.set_num_threads(threads)
        torch.set_num_threads(threads)


def run_serial_if(small: bool, fn: Callable[..., T], *args) -> T:
    """``fn(*args)``, on one numba thread when ``small`` (waking the pool would cost more than the work)."""
    if not small:
        return fn(*args)
    import numba

    threads = numba.get_num_threads()  # ~1 µs: only asked when it matters
    if threads == 1:
        return fn(*args)
    numba.set_num_threads(1)
    try:
        return fn(*args)
    finally:
        numba.set_num_threads(threads)


# -- decode steps on a shared machine ---------------------------------------------------------------
THREADS_ENV = ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS", "KVLENS_DECODE_THREADS")  # the user's count wins


def others_running(loadavg: str) -> int:
    """Runnable tasks besides the caller's thread, from ``/proc/loadavg`` text ("0.5 0.4 0.3 3/210 99")."""
    return max(0, int(loadavg.split()[3].split("/")[0]) - 1)


def step_threads(threads: int, cpus: int, others: int) -> int:
    """Threads for one decode step: ``threads`` while the CPUs are free, one fewer for every CPU
    other runnable tasks hold (a parallel region waits for its slowest thread, and a thread that
    shares its core with another process is the slowest by a time slice), never below one."""
    return max(1, min(threads, cpus - others))
