"""``lab sweep``'s default pool sizes and executor choice, by hand (the planted-bug campaign of the
thirty-third session found them untested)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import typer

from kvlens.lab import sweep
from kvlens.lab.store import CellOutcome
from kvlens.lab.sweep import LocalExecutor, SweepSummary, default_threads, default_workers, make_executor


@pytest.mark.parametrize(("cores", "workers"), [(1, 1), (8, 1), (15, 1), (16, 2), (23, 2), (64, 8)])
def test_one_worker_per_eight_cores(cores: int, workers: int) -> None:
    assert default_workers(cores) == workers


@pytest.mark.parametrize(
    ("workers", "cores", "threads"), [(1, 2, 2), (2, 16, 8), (3, 16, 5), (0, 4, 4), (8, 4, 1)]
)
def test_threads_share_the_cores_among_the_workers(workers: int, cores: int, threads: int) -> None:
    assert default_threads(workers, cores) == threads


def test_workers_0_runs_in_the_driver_with_1_thread_at_least() -> None:
    ex = make_executor(0, None, False, None)
    assert isinstance(ex, LocalExecutor) and ex.workers == 0 and ex.parallelism == 1 and ex.threads >= 1
    with pytest.raises(ValueError, match="--threads >= 1"):
        LocalExecutor(1, 0)
    with pytest.raises(ValueError, match="with --ray, Ray places the cells"):
        make_executor(0, None, True, None)


def _cli_with(monkeypatch, summary_of) -> dict:
    """``sweep.cli`` with the spec and the run stood in for; returns what the run was given."""
    seen: dict = {}

    def fake_run(spec, db, executor, force, command, show_progress):
        seen["db"] = db
        return summary_of(db)

    monkeypatch.setattr(sweep, "load_spec", lambda path: SimpleNamespace(path=path))
    monkeypatch.setattr(sweep, "run_sweep", fake_run)
    return seen


def test_cli_stores_beside_the_spec_and_exits_1_when_any_cell_failed(monkeypatch, tmp_path, capsys) -> None:
    cfg = {"measurement": "ppl", "model": "m", "weights": "f32", "kv": "q8", "corpus": "c", "ctx": 8}
    bad = CellOutcome("k", json.dumps(cfg), "failed", "boom", None)
    seen = _cli_with(monkeypatch, lambda db: SweepSummary(db, 3, 0, done=2, failed=[bad]))
    with pytest.raises(typer.Exit) as e:
        sweep.cli(str(tmp_path / "grid.toml"), None, 0, 1, False, None, False, True)
    assert e.value.exit_code == 1 and seen["db"] == tmp_path / "grid.sqlite"
    out = capsys.readouterr()
    assert "3 cells: 0 already done, 2 run now, 1 failed" in out.out
    assert "failed: ppl m weights f32 kv q8 c ctx 8: boom" in out.err


def test_cli_all_done_returns_normally(monkeypatch, tmp_path) -> None:
    _cli_with(monkeypatch, lambda db: SweepSummary(db, 2, 1, done=1))
    sweep.cli(str(tmp_path / "grid.toml"), str(tmp_path / "x.db"), 0, 1, False, None, False, True)
