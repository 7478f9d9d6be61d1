"""numba's cache folder follows the kernel sources: an edit to any kernel file (an inlined helper
included) gives a new folder, so no stale machine code is loaded; the user's setting wins."""

import subprocess
import sys

from kvlens.kernels.jitcache import apply_cache_default, cache_dir, source_digest


def test_any_kernel_file_edit_changes_the_folder(tmp_path):
    (tmp_path / "cpu.py").write_text("def core(): return helper()\n")
    (tmp_path / "flash.py").write_text("def helper(): return 1\n")
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    before = cache_dir(env, tmp_path)
    assert before.parent == tmp_path / "cache" / "kvlens" / "numba"
    (tmp_path / "flash.py").write_text("def helper(): return 2\n")  # only the inlined helper changes
    after = cache_dir(env, tmp_path)
    assert after != before
    (tmp_path / "flash.py").write_text("def helper(): return 1\n")
    assert cache_dir(env, tmp_path) == before  # the same sources, the same folder
    (tmp_path / "notes.txt").write_text("not a kernel")
    assert cache_dir(env, tmp_path) == before


def test_a_renamed_file_changes_the_digest(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    d1 = source_digest(tmp_path)
    (tmp_path / "a.py").rename(tmp_path / "b.py")
    assert source_digest(tmp_path) != d1


def test_user_setting_wins(tmp_path):
    env = {"NUMBA_CACHE_DIR": "/somewhere"}
    assert apply_cache_default(env, tmp_path) is None and env["NUMBA_CACHE_DIR"] == "/somewhere"
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    assert apply_cache_default(env, tmp_path) == str(cache_dir({"XDG_CACHE_HOME": str(tmp_path)}, tmp_path))


def test_importing_kvlens_points_numba_there(tmp_path):
    code = "import kvlens, numba; print(numba.config.CACHE_DIR)"
    env = {"PATH": "/usr/bin:/bin", "XDG_CACHE_HOME": str(tmp_path), "HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    from kvlens.kernels.jitcache import KERNELS

    assert out.stdout.strip() == str(tmp_path / "kvlens" / "numba" / source_digest(KERNELS))


def _cache_file(tmp_path):
    from numba.core.caching import IndexDataCacheFile

    import kvlens  # noqa: F401  (installs the lock)

    return IndexDataCacheFile(str(tmp_path), "kernel-fn", ("stamp", 1))


def _blocked_by(tmp_path, mode, call, patience: float = 0.3) -> bool:
    """Whether ``call`` has not finished after ``patience`` seconds while another open file holds
    ``mode`` on the index lock; it must finish once the lock is let go. A blocked call never finishes
    while the lock is held, so a long ``patience`` makes "not blocked" safe on a slow machine."""
    import fcntl
    import threading

    done = threading.Event()
    with open(tmp_path / "kernel-fn.nbi.lock", "a+b") as held:
        fcntl.flock(held, mode)
        worker = threading.Thread(target=lambda: (call(), done.set()), daemon=True)
        worker.start()
        blocked = not done.wait(patience)
        fcntl.flock(held, fcntl.LOCK_UN)
    worker.join(10)
    assert done.is_set(), "the cache call never finished after the lock was released"
    return blocked


def test_a_cache_save_waits_for_another_process_save(tmp_path):
    """Two processes saving into one index must not interleave (numba's save reads the index, picks
    a data-file number and writes both back): a save waits while the lock is held elsewhere."""
    import fcntl

    cache = _cache_file(tmp_path)
    assert _blocked_by(tmp_path, fcntl.LOCK_EX, lambda: cache.save("sig-a", b"code-a"))
    assert cache.load("sig-a") == b"code-a"
    assert _blocked_by(tmp_path, fcntl.LOCK_SH, lambda: cache.save("sig-b", b"code-b"))


def test_loads_wait_for_a_save_but_not_for_each_other(tmp_path):
    import fcntl

    cache = _cache_file(tmp_path)
    cache.save("sig-a", b"code-a")
    assert _blocked_by(tmp_path, fcntl.LOCK_EX, lambda: cache.load("sig-a"))
    assert not _blocked_by(tmp_path, fcntl.LOCK_SH, lambda: cache.load("sig-a"), patience=30)
