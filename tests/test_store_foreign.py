"""The sweep store never writes into a SQLite file that is not its own (thirty-sixth session's sweep:
`lab sweep-report OTHER.db` and `lab sweep SPEC --db OTHER.db` added kvlens' tables to a user's
database and exited 0; a report of an empty file turned it into a store). Checked on the file's bytes."""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

import pytest

from kvlens.lab.store import Store, StoreError


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def foreign(tmp_path: Path) -> Path:
    path = tmp_path / "users.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE users (id INTEGER, name TEXT)")
        conn.execute("INSERT INTO users VALUES (1, 'ada')")
    return path


@pytest.mark.parametrize("create", [True, False])
def test_a_database_of_other_tables_is_refused_and_left_as_it_was(foreign, create):
    before = digest(foreign)
    with pytest.raises(
        StoreError, match=r"users\.db is a SQLite database of other tables \(users\), not a kvlens"
    ):
        Store(foreign, create=create)
    assert digest(foreign) == before
    assert not foreign.with_name("users.db-wal").exists()


def test_a_report_of_an_empty_file_is_refused_and_writes_nothing(tmp_path):
    path = tmp_path / "empty.db"
    path.write_bytes(b"")
    with pytest.raises(StoreError, match="holds no sweep"):
        Store(path, create=False)
    assert path.read_bytes() == b""


def test_a_store_is_made_in_a_new_file_and_read_back(tmp_path):
    path = tmp_path / "sweep.db"
    Store(path).close()
    Store(path, create=False).close()


def test_a_report_of_an_empty_file_leaves_it_empty(tmp_path):
    """The report's own path (``write_report``) opens the store read-only."""
    from kvlens.lab.sweep_report import write_report

    path = tmp_path / "empty.db"
    path.write_bytes(b"")
    with pytest.raises(StoreError, match="holds no sweep"):
        write_report(path, tmp_path / "report", "kvlens lab sweep-report")
    assert path.read_bytes() == b""
