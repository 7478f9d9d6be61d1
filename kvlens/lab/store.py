"""The sweep's results store: one SQLite file, one row per cell, written only by the sweep's driver.

Schema (``SCHEMA_VERSION`` 1)::

    meta(key TEXT PRIMARY KEY, value TEXT)         -- schema_version
    runs(                                          -- one row per `kvlens lab sweep` invocation
        run_id INTEGER PRIMARY KEY, started_at TEXT, command TEXT, executor TEXT,
        spec_path TEXT, spec_text TEXT)            -- the spec exactly as read
    cells(
        cell_key TEXT PRIMARY KEY,                 -- sha256 of config_json: a cell is stored once
        config_json TEXT NOT NULL,                 -- the cell's full configuration, canonical JSON
        measurement, model, weights, kv, corpus TEXT, ctx INTEGER,   -- copies of config fields
        status TEXT NOT NULL,                      -- 'done' or 'failed'
        error TEXT,                                -- failed: the exception type and message
        result_json TEXT,                          -- done: the lab run's complete JSON (``to_json()``);
                                                   --   ppl: every llama-perplexity statistic; "inputs":
                                                   --   the sha256 of the model and text it measured
        ppl_ratio, ppl_ratio_err, kld_mean, kld_mean_err, same_top_p REAL,  -- ppl cells, from result_json
        bytes_per_token INTEGER,                   -- KV bytes per token of the cell's mode
        kvlens_version, git_commit TEXT,           -- of the process that ran the cell (git: HEAD, '+dirty')
        machine_json TEXT,                         -- host, CPU model, ISA flags summary, cores, torch threads
        worker TEXT,                               -- 'local:PID' or 'ray:NODE:PID'
        run_id INTEGER,                            -- runs.run_id of the invocation that stored it
        started_at, finished_at TEXT,              -- ISO 8601 UTC
        load_seconds REAL,                         -- model load(s) this cell waited for (0: cached)
        run_seconds REAL)                          -- the lab run itself

Each cell is written in its own transaction (WAL journal), so a killed sweep keeps every cell it
finished and never half a cell; the primary key on ``cell_key`` means a cell is never duplicated. A
failed cell is replaced by its rerun; ``--force`` replaces done cells too.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA_VERSION = "1"
METRIC_COLUMNS = ("ppl_ratio", "ppl_ratio_err", "kld_mean", "kld_mean_err", "same_top_p", "bytes_per_token")
CONFIG_COLUMNS = ("measurement", "model", "weights", "kv", "corpus", "ctx")
INPUTS = "inputs"  # result_json's key for {"model_sha256", "corpus_sha256"} (lab/sweep_inputs.py)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS runs (
    run_id INTEGER PRIMARY KEY, started_at TEXT, command TEXT, executor TEXT, spec_path TEXT, spec_text TEXT
);
CREATE TABLE IF NOT EXISTS cells (
    cell_key TEXT PRIMARY KEY,
    config_json TEXT NOT NULL,
    measurement TEXT NOT NULL, model TEXT NOT NULL, weights TEXT NOT NULL, kv TEXT NOT NULL,
    corpus TEXT NOT NULL, ctx INTEGER NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('done', 'failed')),
    error TEXT,
    result_json TEXT,
    ppl_ratio REAL, ppl_ratio_err REAL, kld_mean REAL, kld_mean_err REAL, same_top_p REAL,
    bytes_per_token INTEGER,
    kvlens_version TEXT, git_commit TEXT, machine_json TEXT, worker TEXT,
    run_id INTEGER REFERENCES runs(run_id),
    started_at TEXT, finished_at TEXT, load_seconds REAL, run_seconds REAL
);
CREATE INDEX IF NOT EXISTS cells_by_grid ON cells (measurement, model, weights, kv, corpus, ctx);
CREATE INDEX IF NOT EXISTS cells_by_status ON cells (status);
"""


class StoreError(ValueError):
    """The file is not a kvlens sweep store (or is of another schema version)."""


@dataclass
class CellOutcome:
    """What a worker hands back for one cell (plain data: it crosses process and Ray boundaries)."""

    cell_key: str
    config_json: str
    status: str  # 'done' | 'failed'
    error: str | None
    result: dict[str, Any] | None
    metrics: dict[str, float | int | None] = field(default_factory=dict)
    kvlens_version: str = ""
    git_commit: str | None = None
    machine: dict[str, Any] = field(default_factory=dict)
    worker: str = ""
    started_at: str = ""
    finished_at: str = ""
    load_seconds: float = 0.0
    run_seconds: float = 0.0


class Store:
    """A sweep's SQLite file. Open it in the driver only; every write is one transaction."""

    def __init__(self, path: str | Path, create: bool = True) -> None:
        """``create``: make the tables in a new (or empty) file; else (a report) only read, and refuse a
        file that holds no sweep. Either way a SQLite file with other tables is refused, never written."""
        self.path = Path(path)
        if create:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.conn = sqlite3.connect(self.path, isolation_level=None)  # explicit transactions
        self.conn.row_factory = sqlite3.Row
        try:
            self._open(create)
        except StoreError:
            self.conn.close()
            raise
        except sqlite3.DatabaseError as e:
            self.conn.close()
            raise StoreError(f"{self.path} is not a kvlens sweep store: {e}") from None

    def _open(self, create: bool) -> None:
        tables = {r[0] for r in self.conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if tables and "meta" not in tables:
            others = ", ".join(sorted(tables)[:5])
            raise StoreError(
                f"{self.path} is a SQLite database of other tables ({others}), not a kvlens sweep store"
            )
        if not tables and not create:
            raise StoreError(f"{self.path} holds no sweep (an empty database)")
        if create:
            self.conn.execute("PRAGMA journal_mode=WAL")
            with self._tx():
                for stmt in _SCHEMA.split(";"):
                    if stmt.strip():
                        self.conn.execute(stmt)
                self.conn.execute(
                    "INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (SCHEMA_VERSION,)
                )
        version = self.conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        if version is None or version[0] != SCHEMA_VERSION:
            raise StoreError(
                f"{self.path}: sweep store schema {version and version[0]}, expected {SCHEMA_VERSION}"
            )

    @contextmanager
    def _tx(self) -> Iterator[None]:
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def begin_run(self, command: str, executor: str, spec_path: str, spec_text: str) -> int:
        from datetime import datetime, timezone

        now = datetime.now(timezone.utc).isoformat(timespec="seconds")
        with self._tx():
            cur = self.conn.execute(
                "INSERT INTO runs (started_at, command, executor, spec_path, spec_text) VALUES (?, ?, ?, ?, ?)",
                (now, command, executor, spec_path, spec_text),
            )
        return int(cur.lastrowid)

    def done_with(self, json_path: str) -> list[tuple[str, str, str, str | None]]:
        """(cell key, model, corpus, ``json_extract(result_json, json_path)``) of every done cell."""
        sql = "SELECT cell_key, model, corpus, json_extract(result_json, ?) FROM cells WHERE status = 'done'"
        return [tuple(r) for r in self.conn.execute(sql, (json_path,))]

    def record(self, o: CellOutcome, run_id: int | None) -> None:
        """Insert or replace the cell's row, in one transaction."""
        config = json.loads(o.config_json)
        row = {
            "cell_key": o.cell_key,
            "config_json": o.config_json,
            **{c: config[c] for c in CONFIG_COLUMNS},
            "status": o.status,
            "error": o.error,
            "result_json": None if o.result is None else json.dumps(o.result, allow_nan=True),
            **{c: o.metrics.get(c) for c in METRIC_COLUMNS},
            "kvlens_version": o.kvlens_version,
            "git_commit": o.git_commit,
            "machine_json": json.dumps(o.machine, sort_keys=True),
            "worker": o.worker,
            "run_id": run_id,
            "started_at": o.started_at,
            "finished_at": o.finished_at,
            "load_seconds": o.load_seconds,
            "run_seconds": o.run_seconds,
        }
        cols = ", ".join(row)
        marks = ", ".join(f":{c}" for c in row)
        update = ", ".join(f"{c} = excluded.{c}" for c in row if c != "cell_key")
        with self._tx():
            self.conn.execute(
                f"INSERT INTO cells ({cols}) VALUES ({marks}) ON CONFLICT(cell_key) DO UPDATE SET {update}",
                row,
            )

    def rows(self, status: str | None = None) -> list[dict[str, Any]]:
        """Every cell (or those of one status) as dicts, ``config``/``result``/``machine`` decoded."""
        sql = "SELECT * FROM cells" + (" WHERE status = ?" if status else "") + " ORDER BY rowid"
        out = []
        for r in self.conn.execute(sql, (status,) if status else ()):
            d = dict(r)
            d["config"] = json.loads(d["config_json"])
            d["result"] = json.loads(d["result_json"]) if d["result_json"] else None
            d["machine"] = json.loads(d["machine_json"]) if d["machine_json"] else {}
            out.append(d)
        return out

    def runs(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self.conn.execute("SELECT * FROM runs ORDER BY run_id")]
