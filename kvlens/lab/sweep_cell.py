"""One sweep cell, run where the executor put it (a pool worker, a Ray task, or the driver itself).

A cell is one call of the lab's own measurement (``run_ppl``, ``run_greedy``, ``run_layers``,
``run_needle``) with the cell's single KV mode; its complete ``to_json()`` is what the store keeps.
Models stay loaded in the process between cells of the same model (the executors hand cells out in
model-major order, so each process loads each model once).
"""

from __future__ import annotations

import functools
import json
import os
import platform
import subprocess
import time
import traceback
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..kv.modes import KVMode
from ..models.loader import model_stamp
from .store import INPUTS, CellOutcome
from .sweep_inputs import inputs_of

_ISA_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "avx_vnni",
    "amx_tile",
)
# process-wide: the model now in use (its files' stamp: a file replaced at the same path is loaded
# anew), {weights: LLM} for it (a new model evicts the old one)
_LOADED: dict[str, Any] = {"model": None, "llms": {}}


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


@functools.lru_cache(maxsize=1)
def provenance() -> tuple[str, str | None]:
    """(kvlens version, git commit of the checkout kvlens runs from, '+dirty' if modified; None: not git)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        ver = version("kvlens")
    except PackageNotFoundError:
        ver = "unknown"
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(
            ["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0:
            return ver, None
        dirty = subprocess.run(
            ["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=10,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return ver, None
    return ver, head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def cpu_of(cpuinfo: str) -> tuple[str, list[str]]:
    """(CPU model, the ISA flags of :data:`_ISA_FLAGS` it has) from the text of ``/proc/cpuinfo``
    (the first CPU's entry); the model falls back to what ``platform`` says."""
    model, flags = platform.processor() or platform.machine(), []
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            model = value.strip()
        elif key.strip() == "flags":
            have = set(value.split())
            flags = [f for f in _ISA_FLAGS if f in have]
            break
    return model, flags


@functools.lru_cache(maxsize=1)
def _cpu() -> tuple[str, list[str]]:
    try:
        return cpu_of(Path("/proc/cpuinfo").read_text(encoding="utf-8"))
    except OSError:
        return cpu_of("")


def machine() -> dict[str, Any]:
    """Host, CPU model, ISA flags that matter to the kernels, cores, memory, torch threads/version."""
    import psutil
    import torch

    model, flags = _cpu()
    return {
        "host": platform.node(),
        "cpu": model,
        "isa": flags,
        "logical_cores": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def _models(model: str, weights: str) -> tuple[Any, Any, float]:
    """(llm, f32-weights reference or None, seconds spent loading now) for ``model`` with ``weights``."""
    import kvlens

    from .common import load_reference

    stamp = model_stamp(model)  # the name or path, with its files' size, mtime and inode
    if _LOADED["model"] != stamp:
        _LOADED["model"], _LOADED["llms"] = stamp, {}
    llms = _LOADED["llms"]
    t0 = time.perf_counter()
    if weights not in llms:
        llms[weights] = kvlens.load(model, kv="f32", attn_backend="torch", weights=weights)
    ref = None
    if getattr(llms[weights], "weights_mode", "f32") != "f32":
        if "f32" not in llms:
            llms["f32"] = load_reference(model, llms[weights])
        ref = llms["f32"]
    return llms[weights], ref, time.perf_counter() - t0


def _measure(c: dict[str, Any], llm: Any, ref: Any, text: str, label: str) -> dict[str, Any]:
    """The lab's own run for the cell's measurement, as its JSON."""
    m, kv = c["measurement"], KVMode.parse(c["kv"])
    keep = {k: c[k] for k in ("keep_sink", "keep_recent") if k in c}
    if m == "ppl":
        from .ppl import PplConfig, run_ppl

        cfg = PplConfig(
            kv=[kv],
            base=c["base"],
            ctx=c["ctx"],
            chunks=c["chunks"],
            prefill_chunk=c["prefill_chunk"],
            **keep,
        )
        return run_ppl(llm, text, cfg, label, ref_llm=ref).to_json()
    if m == "greedy":
        from .greedy import GreedyConfig, run_greedy

        cfg = GreedyConfig(
            kv=[kv], base=c["base"], prompts=c["prompts"], ctx=c["ctx"], tokens=c["tokens"],
            prefill_chunk=c["prefill_chunk"], **keep,
        )  # fmt: skip
        return run_greedy(llm, text, cfg, label, ref_llm=ref).to_json()
    if m == "layers":
        from .layers import LayersConfig, run_layers

        cfg = LayersConfig(kv=[kv], ctx=c["ctx"], chunks=c["chunks"], weights=c["weights"], **keep)
        return run_layers(llm, text, cfg, label).to_json()
    if m == "needle":
        from .needle import NeedleConfig, recall_table, run_needle

        cfg = NeedleConfig(
            kv=kv, ctx=[c["ctx"]], depth=c["depths"], sparse=c["method"], sparse_budget=c["budgets"],
            seed=c["seed"], dense_layers=c["dense_layers"], weights=c["weights"],
        )  # fmt: skip
        rows = run_needle(llm, text, cfg)
        table = recall_table(rows)
        return {"rows": [asdict(r) for r in rows], "recall": {k: v[c["ctx"]] for k, v in table.items()}}
    raise ValueError(f"unknown measurement {m!r}")


def metrics_of(c: dict[str, Any], result: dict[str, Any]) -> dict[str, float | int | None]:
    """The store's indexed columns (ppl cells: the mode's row against the base)."""
    if c["measurement"] != "ppl":
        return {}
    row = result["modes"][c["kv"]]
    s = row["stats"]
    return {
        "ppl_ratio": s["ppl_ratio"], "ppl_ratio_err": s["ppl_ratio_err"], "kld_mean": s["kld_mean"],
        "kld_mean_err": s["kld_mean_err"], "same_top_p": s["same_top_p"], "bytes_per_token": row["bytes_per_token"],
    }  # fmt: skip


def run_cell(key: str, config_json: str, worker: str) -> CellOutcome:
    """Run one cell; any exception becomes a 'failed' outcome with its message (the sweep goes on)."""
    from ..corpus import load_corpus

    c = json.loads(config_json)
    ver, commit = provenance()
    out = CellOutcome(key, config_json, "failed", None, None, kvlens_version=ver, git_commit=commit)
    out.worker, out.started_at = f"{worker}:{os.getpid()}", _now()
    t0 = time.perf_counter()
    try:
        llm, ref, out.load_seconds = _models(c["model"], c["weights"])
        text, label = load_corpus(c["corpus"])
        t0 = time.perf_counter()
        result = _measure(c, llm, ref, text, label)
        result["kv_bytes_per_token"] = llm.new_cache(1, c["kv"]).bytes_per_token()
        result[INPUTS] = inputs_of(llm.loaded.file_sha256, text)
        out.result, out.metrics, out.status = result, metrics_of(c, result), "done"
    except Exception as e:  # noqa: BLE001 - a failed cell is recorded, never fatal to the sweep
        last = traceback.extract_tb(e.__traceback__)[-1]
        out.error = f"{type(e).__name__}: {e} (at {Path(last.filename).name}:{last.lineno})"
    out.run_seconds = time.perf_counter() - t0
    out.finished_at = _now()
    out.machine = machine()
    return out
