"""Where numba keeps compiled kernels: a folder named by a hash of every kernel source file.

numba re-compiles a cached function only when *its own* file changes; a kernel that inlines a helper
from another file (``kernels/flash.py``, ``stage.py``, ``bits.py``) would keep running the old
helper's machine code after that file changed (a ``git pull`` that touches only the helper). Naming
the cache folder by the hash of all of ``kernels/*.py`` gives each source state its own cache, so a
stale kernel is never loaded. A ``NUMBA_CACHE_DIR`` the user set always wins.

numba's cache is not safe for two processes at once: ``IndexDataCacheFile.save`` reads the index,
picks a free data-file number and writes both back, unlocked. Two processes compiling different
signatures of one kernel (two kvlens commands started together on a cold cache) can both pick the
same number, and the index can end up naming the other signature's machine code.
:func:`lock_numba_cache` makes a save exclusive and a load shared, per cached function, with
``fcntl.flock`` on a file beside its index.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
from collections.abc import Callable, Iterator, MutableMapping
from contextlib import contextmanager
from pathlib import Path

KERNELS = Path(__file__).resolve().parent


def source_digest(folder: Path = KERNELS) -> str:
    """The first 16 hex digits of sha256 over the names and contents of ``folder/*.py``, sorted."""
    h = hashlib.sha256()
    for path in sorted(folder.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def user_cache(environ: MutableMapping[str, str] = os.environ) -> Path:
    """``$XDG_CACHE_HOME/kvlens`` (``~/.cache/kvlens`` when unset): kvlens' compiled kernels and corpus."""
    return Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvlens"


def cache_dir(environ: MutableMapping[str, str] = os.environ, folder: Path = KERNELS) -> Path:
    """``$XDG_CACHE_HOME/kvlens/numba/<digest>`` (``~/.cache`` when unset)."""
    return user_cache(environ) / "numba" / source_digest(folder)


def apply_cache_default(environ: MutableMapping[str, str] = os.environ, folder: Path = KERNELS) -> str | None:
    """Set ``NUMBA_CACHE_DIR`` to :func:`cache_dir` unless the user set it; returns what it set."""
    if "NUMBA_CACHE_DIR" in environ:
        return None
    environ["NUMBA_CACHE_DIR"] = str(cache_dir(environ, folder))
    return environ["NUMBA_CACHE_DIR"]


@contextmanager
def index_lock(cache_file, mode: int) -> Iterator[None]:
    """``flock`` ``mode`` (LOCK_EX or LOCK_SH) on ``<index>.lock`` beside a numba cache index."""
    path = os.path.join(cache_file._cache_path, cache_file._index_name + ".lock")
    try:
        os.makedirs(cache_file._cache_path, exist_ok=True)
        lock = open(path, "a+b")
    except OSError:  # a read-only cache folder: nobody can save into it, so there is no race
        yield
        return
    with lock:
        fcntl.flock(lock, mode)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _under(mode: int, method: Callable) -> Callable:
    @functools.wraps(method)
    def locked(self, *args):
        with index_lock(self, mode):
            return method(self, *args)

    locked.__kvlens_locked__ = True
    return locked


def lock_numba_cache() -> None:
    """Wrap numba's cache-file ``save`` (exclusive) and ``load`` (shared) in :func:`index_lock`;
    idempotent. Refuses loudly if numba's cache class no longer has the shape this relies on."""
    import numba
    from numba.core import caching

    cls = caching.IndexDataCacheFile
    for name in ("save", "load"):
        method = getattr(cls, name, None)
        if method is None or not hasattr(cls, "_load_index"):
            raise RuntimeError(f"numba {numba.__version__}: IndexDataCacheFile.{name} not found")
        if not getattr(method, "__kvlens_locked__", False):
            setattr(cls, name, _under(fcntl.LOCK_EX if name == "save" else fcntl.LOCK_SH, method))
