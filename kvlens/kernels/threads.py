"""The thread policy of the CPU kernels, in one place: OpenMP settings, thread counts, serial runs.

torch and numba each bring an OpenMP runtime (two libgomp copies in one process: torch's bundled one,
and the system one that numba's ``omp`` layer links). Their settings are read when each runtime
loads, so :func:`apply_env_defaults` runs from ``kvlens/__init__`` before torch is imported; a value
the user has set in the environment always wins. Why these values, and the measurements behind
them: docs/decode.md, "Steady speed".
"""

from __future__ import annotations

import os
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from types import TracebackType
from typing import TypeVar

T = TypeVar("T")

# Idle OpenMP threads sleep (PASSIVE) instead of spinning, so one runtime's idle pool does not starve
# the other's busy one; a short spin (GOMP_SPINCOUNT, which overrides PASSIVE's zero) keeps them
# awake between the back-to-back parallel regions of one decode step.
ENV_DEFAULTS: dict[str, str] = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "30000"}
THREADS_ENV = ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS")  # a thread count the user set
_user_count = any(name in os.environ for name in THREADS_ENV)
RECENT_STEPS = 3  # decode steps whose load readings decide one step's threads (their median)
_recent_others: deque[int] = deque([0] * (RECENT_STEPS - 1), maxlen=RECENT_STEPS)
_step = threading.local()  # .threads: the count a decode step divides work for, while it runs on fewer


def apply_env_defaults(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set each of :data:`ENV_DEFAULTS` that ``environ`` lacks; returns the ones it set (the user's win)."""
    added = {k: v for k, v in ENV_DEFAULTS.items() if k not in environ}
    environ.update(added)
    return added


class ThreadSettingError(ValueError):
    """``NUMBA_NUM_THREADS`` holds a value numba cannot start with (it raises while it is imported)."""


def check_thread_env(environ: Mapping[str, str] = os.environ) -> None:
    """:class:`ThreadSettingError` naming ``NUMBA_NUM_THREADS`` when it is not a whole number ≥ 1: at 0
    numba's import fails with a traceback that names no variable, and a non-number is ignored with a
    warning. Checked from ``kvlens/__init__``, before numba loads; left uncaught (a command line), the
    error prints as one ``error:`` line instead of a traceback, and the exit status is 1."""
    value = environ.get("NUMBA_NUM_THREADS")
    if value is None or _numba_count(value) >= 1:
        return
    previous = sys.excepthook

    def one_line(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        if issubclass(kind, ThreadSettingError):
            print(f"error: {error}", file=sys.stderr)
        else:
            previous(kind, error, tb)

    sys.excepthook = one_line
    raise ThreadSettingError(
        f"NUMBA_NUM_THREADS={value!r}: numba needs a whole number of threads ≥ 1 (unset it for one per CPU)"
    )


def _numba_count(value: str) -> int:
    """The count numba reads from ``value`` (it calls ``int`` on it); 0 where that fails ("²" is a
    digit to ``str.isdigit`` but not to ``int``)."""
    try:
        return int(value)
    except ValueError:
        return 0


def set_threads(threads: int | None) -> None:
    """Threads for numba's kernels and torch's ops alike, fixed from now on (decode steps then keep
    this count on a busy machine too); ``None``/0: leave both as they are."""
    global _user_count
    if threads:
        _user_count = True
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
# A parallel region waits for its slowest thread; a thread that shares its core with another
# process is the slowest by a whole time slice, and a decode step runs ~150 regions. So while other
# processes hold CPUs, a step runs on the CPUs left (measured: docs/decode.md, "Steady speed").


def others_running(read_loadavg: Callable[[], str], own_running: Callable[[], int]) -> int:
    """Runnable tasks of other processes: the machine's ("3/210" in ``/proc/loadavg`` text, as
    ``read_loadavg()`` returns it) less this process's ``own_running()``, asked only when more than
    the caller's one thread runs. The load is read a second time *after* our own threads are counted:
    between two parallel regions our threads can only go to sleep, never wake, so counting them
    first can only undercount the others; counted last, a worker that fell asleep in between was
    taken for another process and a quiet step ran on one thread (docs/decode.md, "Third pass")."""
    if _running(read_loadavg()) <= 1:
        return 0
    own = own_running()
    return max(0, _running(read_loadavg()) - own)


def _running(loadavg: str) -> int:
    return int(loadavg.split()[3].split("/")[0])


def step_threads(threads: int, cpus: int, others: int) -> int:
    """Threads for one decode step: ``threads``, less one for every CPU that other runnable tasks
    hold, never below one."""
    return max(1, min(threads, cpus - others))


def steady_others(others: int, recent: deque[int] | None = None) -> int:
    """The median of the last :data:`RECENT_STEPS` readings of :func:`others_running`, this one
    included: a task that runs for a moment (a shell command, a kernel worker) does not cost a step
    its second thread, while a neighbour that holds a core, seen in two of the last three steps, does
    (docs/decode.md, "Third pass")."""
    recent = _recent_others if recent is None else recent
    recent.append(others)
    return sorted(recent)[len(recent) // 2]


def _read_loadavg() -> str:
    with open("/proc/loadavg", encoding="utf-8") as f:
        return f.read()


def _own_running() -> int:
    """This process's threads that are running or runnable now (``R`` in their /proc stat)."""
    n = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat", encoding="utf-8") as f:
                n += f.read().rpartition(")")[2].split()[0] == "R"
        except OSError:  # the thread ended
            pass
    return n


def split_threads() -> int:
    """The thread count to divide work for (Flash-Decoding splits): numba's count, and inside a decode
    step that runs on fewer threads the count it had before, so results never depend on the load."""
    base = getattr(_step, "threads", None)
    if base is not None:
        return base
    import numba

    return numba.get_num_threads()


@contextmanager
def decode_threads() -> Iterator[int]:
    """Run one decode step on the CPUs other processes leave free (see above); yields the count used.
    The numba count stays as it is where the user fixed a count (:data:`THREADS_ENV`,
    :func:`set_threads`) or /proc is not there to read."""
    import numba

    threads = numba.get_num_threads()
    if _user_count or threads == 1 or not os.path.exists("/proc/loadavg"):
        yield threads
        return
    n = step_threads(
        threads, len(os.sched_getaffinity(0)), steady_others(others_running(_read_loadavg, _own_running))
    )
    if n == threads:
        yield n
        return
    numba.set_num_threads(n)
    _step.threads = threads
    try:
        yield n
    finally:
        _step.threads = None
        numba.set_num_threads(threads)
