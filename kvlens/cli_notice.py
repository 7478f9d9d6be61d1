"""One line on stderr when numba starts compiling kernels that take a while.

On a fresh machine (or after the kernel sources change) the first command that runs the model
compiles its kernels for this CPU before any output, which looks like a hang. numba reports a
compile only when its on-disk cache misses (``numba:compile`` events), so a warm cache stays
silent, and so does a cold one whose compiles all end within ``after_s``.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from collections.abc import Callable

import numba.core.event as numba_event

AFTER_S = 2.0  # a compile still running after this long gets the notice


def notice_text(cache: str | None) -> str:
    where = f" (once: saved under {cache})" if cache else ""
    return f"kvlens: compiling kernels for this CPU{where}; the first run can take a few minutes"


class CompileNotice(numba_event.Listener):
    """Writes :func:`notice_text` once, ``after_s`` into an outermost compile that is still running."""

    def __init__(self, write: Callable[[str], None], after_s: float) -> None:
        self._write = write
        self._after_s = after_s
        self._depth = 0  # compiles nest: a kernel compiles the kernels it calls
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()
        self.written = threading.Event()

    def on_start(self, event: numba_event.Event) -> None:
        with self._lock:
            self._depth += 1
            if self._depth == 1 and not self.written.is_set():
                self._timer = threading.Timer(self._after_s, self._fire)
                self._timer.daemon = True
                self._timer.start()

    def on_end(self, event: numba_event.Event) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0 and self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def _fire(self) -> None:
        with self._lock:
            if self.written.is_set() or self._depth == 0:
                return
            self.written.set()
        self._write(notice_text(os.environ.get("NUMBA_CACHE_DIR")))


def _to_stderr(line: str) -> None:
    # on a terminal the line may land inside text that `generate` is streaming: start a fresh line
    lead = "\n" if sys.stdout.isatty() and sys.stderr.isatty() else ""
    print(lead + line, file=sys.stderr, flush=True)


def announce_compiles(
    write: Callable[[str], None] = _to_stderr, after_s: float | None = None
) -> CompileNotice:
    """Register a :class:`CompileNotice` for this process (the CLI does, the Python API does not);
    ``after_s`` defaults to :data:`AFTER_S`."""
    listener = CompileNotice(write, AFTER_S if after_s is None else after_s)
    numba_event.register("numba:compile", listener)
    return listener


@functools.cache
def announce_compiles_once() -> CompileNotice:
    """:func:`announce_compiles` on the first call, the same listener after: ``cli.main`` may run more
    than once in a process (a program or a test calling it), and each run must not add a listener."""
    return announce_compiles()
