"""``kvlens serve``: load a model, build the paged engine, print what the KV budget holds, run uvicorn."""

from __future__ import annotations

import logging
import re
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..checks import check_api_key, check_counts, check_field_types, check_finite_fields, option_name
from ..kv.modes import KVMode
from ..models.loader import check_weights_mode

if TYPE_CHECKING:
    from ..engine.llm import LLM

_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")


def parse_size(text: str) -> int:
    """Bytes of a size such as ``512MiB``, ``1.5GiB``, ``64KiB`` or a plain byte count."""
    m = _SIZE.fullmatch(text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"bad size {text!r}: use a number with KiB, MiB or GiB (e.g. 512MiB)")
    number = float(m.group(1)) * _UNITS[unit]
    if not number < 2**63:  # inf from a long digit string, or more bytes than any machine has
        raise ValueError(f"bad size {text!r}: too large")
    size = int(number)
    if size <= 0:
        raise ValueError(f"bad size {text!r}: must be more than 0 bytes")
    return size


def check_sizes(config: Any, *names: str) -> None:
    """Each named size field of a config (None skipped) parses as :func:`parse_size` (an empty one
    is not "the default"), named as its CLI option."""
    for name in names:
        value = getattr(config, name)
        if value is not None:
            try:
                parse_size(value)
            except ValueError as e:
                raise ValueError(f"{option_name(name)}: {e}") from None


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


def listen_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads, so a host or port that cannot be used (a
    port in use, an address not on this machine) is one clear error and not a failure after the load
    and warm-up. uvicorn listens on it."""
    sock = None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        sock.bind(address)
    except OSError as e:
        if sock is not None:
            sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def _exit_cleanly_on_signals() -> None:
    # uvicorn shuts down gracefully on SIGTERM/SIGINT, then re-raises the signal to the handler that
    # was installed before it: with these the process then returns from main and exits 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)


@dataclass(frozen=True)
class ServeConfig:
    """What ``kvlens serve`` runs (sizes as the user wrote them, e.g. ``512MiB``)."""

    model: str = "smollm2"
    kv: str = "q8"
    weights: str = "auto"
    kv_budget: str | None = None  # None: a share of free memory
    max_batch: int = 16
    max_waiting: int = 64
    prefill_chunk: int = 512  # prompt tokens per prefill chunk; the prefix cache reuses whole chunks
    prefix_cache: bool = True
    kv_disk: str | None = None  # directory of the prefix cache's disk tier
    kv_disk_budget: str = "4GiB"
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    graceful_s: float = 10.0
    warmup: bool = True  # run tiny requests before listening, so the first client's does not compile

    def __post_init__(self) -> None:  # the CLI's parse-time ranges
        check_field_types(self)
        check_counts(self, "max_batch", "prefill_chunk")
        check_counts(self, "max_waiting", minimum=0)
        check_counts(self, "port", minimum=0, maximum=65535)
        check_finite_fields(self, "graceful_s", minimum=0.0)
        check_sizes(self, "kv_budget", "kv_disk_budget")
        check_weights_mode(self.weights)
        KVMode.parse(self.kv)
        if self.api_key is not None:
            check_api_key(self.api_key)

    def engine_config(self):
        from ..engine.serving import EngineConfig

        if self.kv_disk is not None and not self.prefix_cache:
            raise ValueError("--kv-disk holds prefix-cache blocks: drop --no-prefix-cache")
        return EngineConfig(
            kv_budget_bytes=parse_size(self.kv_budget) if self.kv_budget else None,
            max_batch=self.max_batch,
            max_waiting=self.max_waiting,
            prefix_cache=self.prefix_cache,
            kv_disk=self.kv_disk,
            kv_disk_budget=parse_size(self.kv_disk_budget),
        )


def prefix_summary(config: ServeConfig) -> str:
    if not config.prefix_cache:
        return "prefix cache: off"
    disk = f"; disk tier {config.kv_disk} ({config.kv_disk_budget})" if config.kv_disk else ""
    return f"prefix cache: on (reuse in whole chunks of {config.prefill_chunk} tokens){disk}"


def warm_up(llm: LLM) -> float:
    """Seconds spent running tiny requests through the engine's own throwaway runs (each a pool
    fitted to its requests, no prefix cache): one alone, then two together (one of them a one-token
    prompt, whose prefill is a single-row step), each through prefill and decode. The one alone has
    more prompt tokens than quantized weights multiply row by row (``SMALL_M``), so its prefill
    takes their dequantize-then-GEMM path. Every kernel the server's steps call is then compiled (or
    loaded from numba's cache) before the first client arrives; the served engine's pool, prefix
    cache and counters are untouched."""
    from ..engine.serving import Request, run_alone, run_batch
    from ..models.qlinear import SMALL_M

    t0 = time.perf_counter()
    ids = llm.encode_prompt("Warm up.")
    many_rows = ids + ids[-1:] * max(0, SMALL_M + 1 - len(ids))
    list(run_alone(llm, Request("warmup-alone", many_rows, max_tokens=3)))
    run_batch(llm, [Request("warmup-0", ids, max_tokens=3), Request("warmup-1", ids[:1], max_tokens=3)])
    return time.perf_counter() - t0


def serve(config: ServeConfig) -> None:
    import uvicorn

    import kvlens

    from ..engine.serving import Engine
    from .app import AppConfig, build_app

    engine_config = config.engine_config()  # bad sizes are refused before the model loads
    sock = listen_socket(config.host, config.port)
    llm = kvlens.load(config.model, kv=config.kv, weights=config.weights, prefill_chunk=config.prefill_chunk)
    engine = Engine(llm, engine_config)
    print(budget_summary(engine.stats(), config.kv), flush=True)
    print(prefix_summary(config), flush=True)
    if config.warmup:
        print(f"warm-up: {warm_up(llm):.1f} s (the kernels compiled or loaded before listening)", flush=True)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s", stream=sys.stderr)
    app = build_app(llm, engine, AppConfig(model_id(config.model), config.api_key))
    _exit_cleanly_on_signals()
    uv_config = uvicorn.Config(
        app, host=config.host, port=config.port, log_level="info", timeout_graceful_shutdown=config.graceful_s
    )
    with sock:
        uvicorn.Server(uv_config).run(sockets=[sock])
    print("kvlens serve: stopped", flush=True)
