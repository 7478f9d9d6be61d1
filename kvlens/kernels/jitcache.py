"""Where numba keeps compiled kernels: a folder named by a hash of every kernel source file.

numba re-compiles a cached function only when *its own* file changes; a kernel that inlines a helper
from another file (``kernels/flash.py``, ``stage.py``, ``bits.py``) would keep running the old
helper's machine code after that file changed (a ``git pull`` that touches only the helper). Naming
the cache folder by the hash of all of ``kernels/*.py`` gives each source state its own cache, so a
stale kernel is never loaded. A ``NUMBA_CACHE_DIR`` the user set always wins.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import MutableMapping
from pathlib import Path

KERNELS = Path(__file__).resolve().parent


def source_digest(folder: Path = KERNELS) -> str:
    """The first 16 hex digits of sha256 over the names and contents of ``folder/*.py``, sorted."""
    h = hashlib.sha256()
    for path in sorted(folder.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def cache_dir(environ: MutableMapping[str, str] = os.environ, folder: Path = KERNELS) -> Path:
    """``$XDG_CACHE_HOME/kvlens/numba/<digest>`` (``~/.cache`` when unset)."""
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvlens" / "numba" / source_digest(folder)


def apply_cache_default(environ: MutableMapping[str, str] = os.environ, folder: Path = KERNELS) -> str | None:
    """Set ``NUMBA_CACHE_DIR`` to :func:`cache_dir` unless the user set it; returns what it set."""
    if "NUMBA_CACHE_DIR" in environ:
        return None
    environ["NUMBA_CACHE_DIR"] = str(cache_dir(environ, folder))
    return environ["NUMBA_CACHE_DIR"]
