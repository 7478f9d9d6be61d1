"""``kvlens serve``: load a model, build the paged engine, print what the KV budget holds, run uvicorn."""

from __future__ import annotations

import logging
import re
import signal
import sys
from pathlib import Path

_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")


def parse_size(text: str) -> int:
    """Bytes of a size such as ``512MiB``, ``1.5GiB``, ``64KiB`` or a plain byte count."""
    m = _SIZE.fullmatch(text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"bad size {text!r}: use a number with KiB, MiB or GiB (e.g. 512MiB)")
    size = int(float(m.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"bad size {text!r}: must be more than 0 bytes")
    return size


def model_id(model: str) -> str:
    """The name clients pass as ``model``: the built-in name, or the file/directory name."""
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name if path.exists() else model


def budget_summary(stats, kv: str) -> str:
    """One line: what the pool holds in this mode, and what f16 would hold in the same bytes."""
    ratio = stats.tokens_capacity / max(1, stats.f16_tokens_same_bytes)
    return (
        f"KV pool ({kv}): {stats.blocks_total} blocks x {stats.block_size} positions = "
        f"{stats.tokens_capacity} tokens at {stats.bytes_per_token} B/token; "
        f"f16 would hold {stats.f16_tokens_same_bytes} tokens in the same bytes (x{ratio:.2f})"
    )


def _exit_cleanly_on_signals() -> None:
    # uvicorn shuts down gracefully on SIGTERM/SIGINT, then re-raises the signal to the handler that
    # was installed before it: with these the process then returns from main and exits 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)


def serve(
    model: str,
    kv: str,
    weights: str,
    kv_budget: str | None,
    max_batch: int,
    max_waiting: int,
    host: str,
    port: int,
    api_key: str | None,
    graceful_s: float,
) -> None:
    import uvicorn

    import kvlens

    from ..engine.serving import Engine, EngineConfig
    from .app import ServeConfig, build_app

    budget = parse_size(kv_budget) if kv_budget else None
    llm = kvlens.load(model, kv=kv, weights=weights)
    engine = Engine(llm, EngineConfig(kv_budget_bytes=budget, max_batch=max_batch, max_waiting=max_waiting))
    print(budget_summary(engine.stats(), kv), flush=True)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s", stream=sys.stderr)
    app = build_app(llm, engine, ServeConfig(model_id(model), api_key))
    _exit_cleanly_on_signals()
    uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=graceful_s)
    print("kvlens serve: stopped", flush=True)
