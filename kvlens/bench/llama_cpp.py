"""llama.cpp's ``llama-bench`` run side by side with ``kvlens bench decode`` (same GGUF, threads, KV types).

``llama-bench -m GGUF -p 0 -n STEPS -d DEPTH -t THREADS -ctk T -ctv T -fa 1 -o json`` times STEPS
generated tokens after a DEPTH-token context. kvlens's ``ctx`` is the number of positions the timed
step attends, so DEPTH = ctx - 1 puts both engines at the same place. Flash attention is on: llama.cpp
needs it for a quantized V cache, and it is its fast CPU path. Weights are the file's own (for
SmolLM2, Q4_1); compare with kvlens's ``--weights auto`` rows, which repack those same blocks.

How to build ``llama-bench`` (CPU, no network needed beyond PyPI)::

    pip download llama-cpp-python --no-deps --no-binary :all: -d /tmp/lcpp
    tar xzf /tmp/lcpp/llama_cpp_python-*.tar.gz -C /tmp/lcpp
    cd /tmp/lcpp/llama_cpp_python-*/vendor/llama.cpp
    cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF
    cmake --build build --target llama-bench -j
    # the binary: build/bin/llama-bench
"""

from __future__ import annotations

import json
import resource
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

# kvlens KV mode -> llama-bench cache type (K and V alike); other kvlens modes (f32 included: llama-bench
# accepts only f16, bf16 and quantized cache types) have no llama.cpp twin
KV_TYPES = {"f16": "f16", "bf16": "bf16", "q8": "q8_0"}
BYTES_PER_VALUE = {"f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32}  # q8_0: 32 int8 + an fp16 scale


class LlamaBenchError(ValueError):
    """llama-bench is missing, failed, or printed something that is not its JSON report."""


@dataclass
class LlamaBenchRow:
    kv_type: str
    depth: int
    n_gen: int
    threads: int
    tok_per_s: float
    stddev: float
    peak_rss: int = 0  # the largest max-RSS of any child process so far (getrusage), bytes


def kv_bytes(kv_type: str, n_layers: int, n_kv_heads: int, head_dim: int, ctx: int) -> int:
    """llama.cpp's KV bytes for ``ctx`` positions (K and V of every layer)."""
    return int(2 * n_layers * n_kv_heads * head_dim * ctx * BYTES_PER_VALUE[kv_type])


def find_binary(path: str | Path) -> Path:
    """The llama-bench executable named by ``path`` (a file, or a name on PATH)."""
    p = Path(path)
    found = p if p.is_file() else (Path(w) if (w := shutil.which(str(path))) else None)
    if found is None:
        raise LlamaBenchError(
            f"llama-bench not found at {path!r} (see `kvlens.bench.llama_cpp` for how to build it)"
        )
    return found


def command(
    binary: Path, gguf: Path, kv_type: str, depth: int, n_gen: int, threads: int, reps: int
) -> list[str]:
    return [
        str(binary), "-m", str(gguf), "-p", "0", "-n", str(n_gen), "-d", str(depth),
        "-t", str(threads), "-ctk", kv_type, "-ctv", kv_type, "-fa", "1", "-r", str(reps), "-o", "json",
    ]  # fmt: skip


def parse_report(text: str) -> list[LlamaBenchRow]:
    """Rows of llama-bench's ``-o json`` report (a JSON list of test records)."""
    start = text.find("[")
    try:
        records = json.loads(text[start:]) if start >= 0 else None
    except json.JSONDecodeError as e:
        raise LlamaBenchError(f"llama-bench did not print a JSON report: {e}") from e
    if not isinstance(records, list) or not records:
        raise LlamaBenchError("llama-bench printed no test records")
    try:
        return [
            LlamaBenchRow(
                str(r["type_k"]),
                int(r.get("n_depth", 0)),
                int(r["n_gen"]),
                int(r["n_threads"]),
                float(r["avg_ts"]),
                float(r.get("stddev_ts", 0.0)),
            )
            for r in records
        ]
    except (KeyError, TypeError, ValueError) as e:
        raise LlamaBenchError(f"unexpected llama-bench record: {e}") from e


def run_llama_bench(
    binary: str | Path, gguf: Path, kv_mode: str, ctx: int, n_gen: int, threads: int, reps: int = 3
) -> LlamaBenchRow | None:
    """llama.cpp's decode tokens/s at ``ctx`` with the KV type matching ``kv_mode`` (None: no twin)."""
    if kv_mode not in KV_TYPES:
        return None
    if gguf.suffix != ".gguf":
        raise LlamaBenchError(f"llama-bench needs a GGUF model, not {gguf}")
    cmd = command(find_binary(binary), gguf, KV_TYPES[kv_mode], ctx - 1, n_gen, threads, reps)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LlamaBenchError(f"could not run {cmd[0]}: {e}") from e
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise LlamaBenchError(f"llama-bench exited with {done.returncode}: {' | '.join(tail)}")
    row = parse_report(done.stdout)[0]
    row.peak_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux
    return row
