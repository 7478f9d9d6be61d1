"""The thread policy of the compiled kernels: every core, except one thread when the work is small."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import numba

T = TypeVar("T")


def run_serial_if(small: bool, fn: Callable[..., T], *args) -> T:
    """``fn(*args)``; on one numba thread when ``small`` (waking the thread pool would cost more than
    the work). The thread count is asked only then (~1 µs)."""
    if not small:
        return fn(*args)
    threads = numba.get_num_threads()
    if threads == 1:
        return fn(*args)
    numba.set_num_threads(1)
    try:
        return fn(*args)
    finally:
        numba.set_num_threads(threads)


def set_threads(threads: int | None) -> None:
    """Use ``threads`` threads in numba's and torch's pools (None: leave them at every core)."""
    if threads:
        import torch

        numba.set_num_threads(threads)
        torch.set_num_threads(threads)
