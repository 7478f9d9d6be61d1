"""llama.cpp's ``llama-server`` as a child process, loaded by ``kvlens bench serve --vs-llama-server``.

Same GGUF, same threads, ``-ctk/-ctv`` = the KV mode's llama.cpp twin (``q8`` → ``q8_0``), flash
attention on, ``-np`` = the client's concurrency, its prompt cache on (``--cache-prompt``, the
default, said explicitly), one unified KV buffer of ``-c`` positions shared by the slots, loopback,
a free port, ``--metrics`` (so ``/metrics`` parses as Prometheus text).

How to build ``llama-server`` (as ``llama-bench``, see ``kvlens.bench.llama_cpp``; no web UI, which
would need npm or a download)::

    pip download llama-cpp-python --no-deps --no-binary :all: -d /work/llama-build
    tar xzf /work/llama-build/llama_cpp_python-*.tar.gz -C /work/llama-build
    cd /work/llama-build/llama_cpp_python-*/vendor/llama.cpp
    cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \\
        -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF
    nice cmake --build build --target llama-server -j2      # the binary: build/bin/llama-server
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..serve.process import ServerProcess
from .llama_cpp import KV_TYPES

DEFAULT_CTX = 8192  # positions of the unified KV buffer shared by all slots (SmolLM2's window)


class LlamaServerError(ValueError):
    """llama-server is missing or cannot load the model."""


def find_llama_server(path: str | Path) -> Path:
    """The llama-server executable named by ``path`` (a file, or a name on PATH)."""
    p = Path(path)
    found = p if p.is_file() else (Path(w) if (w := shutil.which(str(path))) else None)
    if found is None or not os.access(found, os.X_OK):
        raise LlamaServerError(
            f"llama-server not found (or not executable) at {path!r}; see `kvlens.bench.llama_server` "
            "for how to build it"
        )
    return found


def threads() -> int:
    """The threads kvlens serve uses by default (torch's default: the cores this process may use)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def llama_server_args(
    gguf: Path, kv: str, parallel: int, n_threads: int, ctx: int = DEFAULT_CTX
) -> list[str]:
    """Everything but the binary, host and port."""
    if kv not in KV_TYPES:
        raise LlamaServerError(
            f"KV mode {kv!r} has no llama.cpp cache type (llama.cpp has {sorted(KV_TYPES)})"
        )
    if gguf.suffix.lower() != ".gguf":
        raise LlamaServerError(f"llama-server needs a GGUF model, not {gguf}")
    t = KV_TYPES[kv]
    return [
        "-m", str(gguf), "-t", str(n_threads), "-tb", str(n_threads), "-ctk", t, "-ctv", t, "-fa", "on",
        "-np", str(parallel), "-c", str(ctx), "--kv-unified", "--cache-prompt", "--metrics",
    ]  # fmt: skip


class LlamaServerProcess(ServerProcess):
    """``llama-server ARGS --host H --port P`` on a free loopback port, healthy when ``/health`` is 200."""

    name = "llama-server"

    def __init__(self, binary: str | Path, args: list[str], start_timeout: float = 300.0) -> None:
        self.binary = find_llama_server(binary)
        super().__init__(args, start_timeout)

    def command(self, args: list[str], host: str, port: int) -> list[str]:
        return [str(self.binary), *args, "--host", host, "--port", str(port)]

    def budget_line(self) -> str:
        return ""
