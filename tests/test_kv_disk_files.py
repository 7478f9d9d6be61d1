"""The disk tier's files at their edges (kv/disk.py): budgets of nothing or of less than a block, a
block spilled again, files of an older format or another payload length, writes that fail and then
succeed, a write that fails after its temporary file exists, and the order of files a restart finds
(their mtimes, touched on each restore) when it trims to a smaller budget.

References: the files in the folder themselves (sizes, names, mtimes set by hand), not the tier's
own counters.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
from test_kv_disk import random_pool

from kvlens.kv.disk import MAGIC, SUFFIX, DiskTier


def test_a_disk_tier_of_no_bytes_is_refused(tmp_path):
    pool = random_pool("q8", 0)
    for budget in (0, -1):
        with pytest.raises(ValueError, match="more than 0 bytes"):
            DiskTier(tmp_path, budget, pool, "m")


def test_a_block_spilled_again_is_written_once(tmp_path):
    """A block restored from disk, then evicted again, is spilled under the same hash: the file is
    there already, so nothing is written and the byte count stays the folder's."""
    pool = random_pool("q8", 0)
    disk = DiskTier(tmp_path, 1 << 20, pool, "m")
    disk.spill(0, b"a" * 32)
    assert disk.restore(1, b"a" * 32)
    disk.spill(1, b"a" * 32)
    assert disk.stats.spilled == 1
    assert disk.stats.bytes == sum(p.stat().st_size for p in tmp_path.glob(f"*{SUFFIX}"))


def test_a_block_larger_than_the_budget_is_not_written(tmp_path):
    """A budget one byte short of one block's file: the spill writes nothing (it would delete every
    other file, then still break the budget)."""
    pool = random_pool("q8", 0)
    probe = DiskTier(tmp_path / "probe", 1 << 20, pool, "m")
    probe.spill(0, b"p" * 32)
    disk = DiskTier(tmp_path / "d", probe.stats.bytes - 1, pool, "m")
    disk.spill(0, b"a" * 32)
    assert (disk.stats.spilled, disk.stats.bytes) == (0, 0)
    assert not list((tmp_path / "d").glob(f"*{SUFFIX}"))


def assert_rewritten_file_is_refused(tmp_path, edit) -> None:
    """A spilled file whose body (all before the checksum) ``edit`` changes, checksum recomputed over
    it (as a writer of another layout would): refused, counted, deleted; the pool's block untouched."""
    pool = random_pool("q8", 0)
    disk = DiskTier(tmp_path, 1 << 20, pool, "m")
    disk.spill(0, b"a" * 32)
    path = disk.path(b"a" * 32)
    body = edit(path.read_bytes()[: -hashlib.sha256().digest_size])
    path.write_bytes(body + hashlib.sha256(body).digest())
    target = [t.clone() for t in pool.block_rows(1)]
    assert not disk.restore(1, b"a" * 32)
    assert all(torch.equal(a, b) for a, b in zip(target, pool.block_rows(1), strict=True))
    assert (disk.stats.corrupt, disk.stats.bytes, path.exists()) == (1, 0, False)


def test_a_file_of_an_older_format_is_refused(tmp_path):
    """A file whose first line names an earlier format (KVLENS-BLOCK-3: q4h's 4-bit step not yet
    searched), header and payload otherwise right for this pool."""
    assert MAGIC.endswith(b"-4\n")

    def older(body: bytes) -> bytes:
        assert body.startswith(MAGIC)
        return MAGIC[:-2] + b"3\n" + body[len(MAGIC) :]

    assert_rewritten_file_is_refused(tmp_path, older)


@pytest.mark.parametrize("change", [-16, 16])
def test_a_payload_of_another_length_is_refused(tmp_path, change):
    """Magic and header right, the payload 16 bytes short or long."""
    assert_rewritten_file_is_refused(
        tmp_path, lambda body: body[:change] if change < 0 else body + bytes(change)
    )


def test_a_failing_folder_is_warned_of_again_after_a_write_succeeded(tmp_path, caplog):
    """The warning comes once per run of failed writes: a write that succeeds in between ends the run,
    so the next failure is warned of again."""
    pool = random_pool("q8", 0)
    root = tmp_path / "tier"
    disk = DiskTier(root, 1 << 20, pool, "m")

    def fail_writes(on: bool) -> None:  # a file where the folder was: every write fails
        if on:
            root.rmdir()
            root.write_bytes(b"not a folder")
        else:
            root.unlink()

    with caplog.at_level("WARNING", logger="kvlens.kv.disk"):
        fail_writes(True)
        disk.spill(0, b"a" * 32)
        disk.spill(1, b"b" * 32)
        fail_writes(False)
        disk.spill(2, b"c" * 32)  # made again, written
        for f in root.iterdir():
            f.unlink()
        fail_writes(True)
        disk.spill(3, b"d" * 32)
    assert (disk.stats.spilled, disk.stats.failed) == (1, 3)
    assert len([r for r in caplog.records if "cannot write block files" in r.message]) == 2


def test_a_write_that_fails_after_its_temporary_file_leaves_nothing(tmp_path):
    """The final name taken by a folder: the temporary file is written, the rename fails; the spill
    is counted as failed and no temporary file stays in the folder."""
    pool = random_pool("q8", 0)
    disk = DiskTier(tmp_path, 1 << 20, pool, "m")
    disk.path(b"a" * 32).mkdir()
    disk.spill(0, b"a" * 32)
    assert (disk.stats.spilled, disk.stats.failed) == (0, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [disk.path(b"a" * 32).name]


def test_a_restart_trims_the_least_recently_used_files_to_its_budget(tmp_path):
    """Three files, their mtimes set so that name order is not age order (m oldest, then z, then a),
    then m restored (used: now the newest). A restart with room for one file keeps m alone: the
    least recently used go first (not the first by name), as many as needed."""
    import os
    import time

    pool = random_pool("q8", 0)
    disk = DiskTier(tmp_path, 1 << 20, pool, "m")
    names = [b"m" * 32, b"z" * 32, b"a" * 32]
    now = time.time()
    for i, h in enumerate(names):
        disk.spill(i, h)
        os.utime(disk.path(h), (now - 100 + 10 * i, now - 100 + 10 * i))
    one = disk.stats.bytes // 3
    again = DiskTier(tmp_path, 3 * one, pool, "m")
    assert again.restore(3, names[0])
    smaller = DiskTier(tmp_path, one, pool, "m")
    assert [h for h in names if smaller.path(h).exists()] == [names[0]]
    assert smaller.stats.bytes == one == sum(p.stat().st_size for p in tmp_path.glob(f"*{SUFFIX}"))
