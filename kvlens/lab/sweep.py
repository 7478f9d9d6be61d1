"""``kvlens lab sweep SPEC``: run a spec's cells (see :mod:`.sweep_spec`) into a results store.

The driver opens the store (:mod:`.store`), skips cells already done (``force`` redoes them), hands
the rest to an executor in model-major order and writes each outcome as it comes back, one
transaction per cell. Only the driver writes the store.

Executors:

- local (default): a process pool (``spawn``) of ``workers`` processes, each with ``threads`` torch
  threads; a worker keeps its model loaded across cells (see :mod:`.sweep_cell`). ``workers=0`` runs
  the cells in the driver's own process (no isolation; for debugging).
- Ray: every cell is a Ray task asking for ``threads`` CPUs; ``ray_address`` None starts a local Ray
  instance (or joins ``$RAY_ADDRESS`` / an instance already initialized), else connects to that
  cluster. Nodes need kvlens installed (``pip install kvlens[cluster]``).
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path

from ..kernels.threads import set_threads
from .store import INPUTS, CellOutcome, Store
from .sweep_cell import run_cell
from .sweep_inputs import check_outcome, check_unchanged, spec_digests
from .sweep_spec import Cell, Spec, cell_label, load_spec

CORES_PER_WORKER = 8  # a lab run uses every thread it gets; more workers only on larger machines


def default_workers(cores: int | None = None) -> int:
    return max(1, (cores or os.cpu_count() or 1) // CORES_PER_WORKER)


def default_threads(workers: int, cores: int | None = None) -> int:
    return max(1, (cores or os.cpu_count() or 1) // max(workers, 1))


# -- executors -----------------------------------------------------------------------------------------
class LocalExecutor:
    """A ``spawn`` process pool; ``workers=0``: the driver's own process."""

    name = "local"

    def __init__(self, workers: int, threads: int) -> None:
        if workers < 0 or threads < 1:
            raise ValueError(f"--workers must be >= 0 and --threads >= 1 (got {workers}, {threads})")
        self.workers, self.threads = workers, threads
        self.parallelism = max(workers, 1)

    def run(self, cells: Sequence[Cell]) -> Iterator[CellOutcome]:
        if self.workers == 0:
            set_threads(self.threads)
            for c in cells:
                yield run_cell(c.key, c.config_json(), "local")
            return
        import multiprocessing

        pool = ProcessPoolExecutor(
            self.workers, mp_context=multiprocessing.get_context("spawn"), initializer=set_threads,
            initargs=(self.threads,),
        )  # fmt: skip
        try:
            pending = {pool.submit(run_cell, c.key, c.config_json(), "local") for c in cells}
            while pending:
                finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                for f in finished:
                    yield f.result()
        except BrokenProcessPool as e:
            raise RuntimeError(
                f"a sweep worker process died ({e}); the finished cells are stored: rerun to resume"
            ) from None
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


def _ray_cell(key: str, config_json: str, threads: int) -> CellOutcome:
    import ray

    set_threads(threads)
    return run_cell(key, config_json, f"ray:{ray.get_runtime_context().get_node_id()[:8]}")


class RayExecutor:
    """Each cell a Ray task of ``threads`` CPUs; outcomes come back to the driver as they finish."""

    name = "ray"

    def __init__(self, address: str | None, threads: int) -> None:
        try:
            import ray  # noqa: F401
        except ImportError:
            raise ImportError("--ray needs Ray: pip install 'kvlens[cluster]'") from None
        self.address, self.threads, self.parallelism = address, threads, 1

    def run(self, cells: Sequence[Cell]) -> Iterator[CellOutcome]:
        import ray

        started_here = not ray.is_initialized()
        if started_here:
            ray.init(address=self.address, include_dashboard=False, log_to_driver=False)
        self.parallelism = max(1, int(ray.cluster_resources().get("CPU", 1)) // self.threads)
        task = ray.remote(num_cpus=self.threads, max_retries=0)(_ray_cell)
        pending = [task.remote(c.key, c.config_json(), self.threads) for c in cells]
        try:
            while pending:
                finished, pending = ray.wait(pending, num_returns=1)
                yield ray.get(finished[0])
        finally:
            for ref in pending:
                ray.cancel(ref, force=True)
            if started_here:
                ray.shutdown()


# -- driver ----------------------------------------------------------------------------------------------
@dataclass
class SweepSummary:
    db: Path
    total: int
    skipped: int
    done: int = 0
    failed: list[CellOutcome] = field(default_factory=list)


def run_sweep(
    spec: Spec,
    db: str | Path,
    executor: LocalExecutor | RayExecutor,
    force: bool = False,
    command: str = "",
    show_progress: bool = True,
    on_stored: Callable[[CellOutcome], None] | None = None,
) -> SweepSummary:
    """Run the spec's cells not yet done in ``db`` (all of them with ``force``); ``on_stored(outcome)``
    is called after each cell's transaction has committed."""
    with Store(db) as store:
        stored = store.done_with(f"$.{INPUTS}")
        done = {key for key, *_ in stored}
        digests = spec_digests(spec.cells)
        check_unchanged(stored, spec.cells, digests, force, Path(db))
        todo = [c for c in spec.cells if force or c.key not in done]
        summary = SweepSummary(Path(db), len(spec.cells), len(spec.cells) - len(todo))
        run_id = store.begin_run(command, executor.name, str(spec.path), spec.text)
        with _progress(len(todo), executor, show_progress) as tick:
            for outcome in executor.run(todo):
                store.record(check_outcome(outcome, digests), run_id)
                if outcome.status == "done":
                    summary.done += 1
                else:
                    summary.failed.append(outcome)
                tick(summary)
                if on_stored:
                    on_stored(outcome)
    return summary


class _progress:
    """Rich progress on stderr: cells done / running / failed, elapsed and ETA."""

    def __init__(self, total: int, executor: LocalExecutor | RayExecutor, enabled: bool) -> None:
        self.total, self.executor, self.enabled, self.bar = total, executor, enabled, None

    def _text(self, done: int, failed: int) -> str:
        running = min(self.executor.parallelism, self.total - done - failed)
        return f"sweep: {done} done · {running} running · {failed} failed"

    def __enter__(self) -> Callable[[SweepSummary], None]:
        if not self.enabled or not self.total:
            return lambda _s: None
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )  # fmt: skip

        cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        self.bar = Progress(*cols, TextColumn("ETA"), TimeRemainingColumn(), console=Console(stderr=True))
        self.bar.__enter__()
        task = self.bar.add_task(self._text(0, 0), total=self.total)

        def tick(s: SweepSummary) -> None:
            self.bar.update(
                task, completed=s.done + len(s.failed), description=self._text(s.done, len(s.failed))
            )

        return tick

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)


def make_executor(workers: int | None, threads: int | None, ray: bool, ray_address: str | None):
    if ray or ray_address:
        if workers is not None:
            raise ValueError(
                "--workers sizes the local process pool; with --ray, Ray places the cells (see --threads)"
            )
        return RayExecutor(ray_address, threads or default_threads(1))
    w = default_workers() if workers is None else workers
    return LocalExecutor(w, threads or default_threads(w))


def cli(
    spec_path: str, db: str | None, workers: int | None, threads: int | None, ray: bool,
    ray_address: str | None, force: bool, quiet: bool,
) -> None:  # fmt: skip
    """The body of ``kvlens lab sweep``: validate, run, summarize; exit 1 if a cell failed."""
    import typer

    spec = load_spec(spec_path)
    executor = make_executor(workers, threads, ray, ray_address)
    db_path = Path(db) if db else Path(spec_path).with_suffix(".sqlite")
    command = shlex.join(["kvlens", *sys.argv[1:]]) if sys.argv else ""
    s = run_sweep(spec, db_path, executor, force, command, show_progress=not quiet)
    typer.echo(
        f"{s.total} cells: {s.skipped} already done, {s.done} run now, {len(s.failed)} failed -> {s.db}"
    )
    for o in s.failed:
        typer.echo(f"failed: {cell_label(json.loads(o.config_json))}: {o.error}", err=True)
    if s.failed:
        raise typer.Exit(1)
