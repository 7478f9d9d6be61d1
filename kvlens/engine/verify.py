"""Verifiable responses: a small record of what produced an output, and its re-run check.

A record names the model file (sha256), weights and KV modes, the kernel path, the sampling
parameters with their seed, the prompt token ids themselves and the output ids, with sha256 digests
of both id lists (sha256 of the ids as little-endian int32). Because the engine is batch invariant,
re-running the request *alone* reproduces a served output bit for bit; :func:`verify_record` does
that and says where a run diverges. Bits are promised on the same kernel path: the same device kind,
attention backend and CPU target (``cpu`` in the record; numba compiles for the host's vector unit).
"""

from __future__ import annotations

import hashlib
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError

from ..checks import read_json
from ..kv.modes import CacheOptions
from .llm import LLM
from .loading import load
from .sampling import SamplingParams
from .scheduler import run_alone
from .sequence import Request

RECORD_VERSION = 1
SETTINGS = ("kv", "weights", "attn_backend", "prefill_chunk", "mirror_prefill", "device", "cpu")


def ids_sha256(ids: list[int]) -> str:
    return hashlib.sha256(np.asarray(ids, "<i4").tobytes()).hexdigest()


def host_cpu() -> str:
    try:
        import llvmlite.binding as llvm

        return llvm.get_host_cpu_name()
    except ImportError:  # pragma: no cover - numba (and llvmlite) are dependencies
        return platform.machine()


def settings(llm: LLM) -> dict:
    """The engine settings a record pins (see :data:`SETTINGS`)."""
    return {
        "kv": str(llm.kv),
        "weights": llm.weights_mode,
        "attn_backend": llm.attn_backend,
        "prefill_chunk": llm.prefill_chunk,
        "mirror_prefill": llm.cache_options.mirror_prefill,
        "device": llm.device.type,
        "cpu": host_cpu(),
    }


def make_record(llm: LLM, request: Request, output_ids: list[int]) -> dict:
    """A JSON-serializable record of one finished request (its sampling seed must be set when
    ``temperature > 0``: the engine draws one for a request that has none)."""
    from .. import __version__

    s = request.sampling
    return {
        "record_version": RECORD_VERSION,
        "kvlens_version": __version__,
        "model": {"source": str(llm.source), "sha256": llm.loaded.file_sha256},
        **settings(llm),
        "kernel_path": kernel_path(llm),
        "sampling": {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "seed": s.seed},
        "max_tokens": request.max_tokens,
        "stop_ids": None if request.stop_ids is None else sorted(request.stop_ids),
        "prompt_ids": list(request.prompt_ids),
        "prompt_sha256": ids_sha256(request.prompt_ids),
        "output_ids": list(output_ids),
        "output_sha256": ids_sha256(output_ids),
    }


def kernel_path(llm: LLM) -> str:
    weights = "numba row kernels" if llm.device.type == "cpu" else "torch matmul per row"
    return f"decode attention {llm.attn_backend}, prefill attention torch SDPA, weights {weights}"


@dataclass
class VerifyResult:
    ok: bool
    message: str
    first_divergence: int | None = None  # index of the first differing output token
    expected: int | None = None  # the record's id there (None: the record's output ended)
    got: int | None = None  # the re-run's id there (None: the re-run ended)
    mismatched: dict[str, tuple] = field(default_factory=dict)  # setting -> (record, here)


TokenId = Annotated[int, Strict(), Field(ge=0, le=2**31 - 1)]  # hashed as int32 (ids_sha256)
Number = Annotated[float, Strict()] | Annotated[int, Strict()]


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")  # later versions may add fields


class _RecordModel(_Open):
    source: Annotated[str, Strict()]
    sha256: Annotated[str, Strict()]


class _RecordSampling(_Open):
    temperature: Number
    top_k: Annotated[int, Strict()]
    top_p: Number
    seed: Annotated[int, Strict()] | None


class _RecordFields(_Open):
    """The fields :func:`make_record` writes, each of the type it writes (JSON's own: no "12" for 12,
    no true for 1, no 32.7 for a count)."""

    record_version: Literal[1] = RECORD_VERSION  # a later version's record is not read as this one
    model: _RecordModel
    kv: Annotated[str, Strict()]
    weights: Annotated[str, Strict()]
    attn_backend: Annotated[str, Strict()]
    prefill_chunk: Annotated[int, Strict(), Field(ge=1)]
    mirror_prefill: Annotated[str, Strict()]
    device: Annotated[str, Strict()]
    cpu: Annotated[str, Strict()]
    sampling: _RecordSampling
    max_tokens: Annotated[int, Strict(), Field(ge=1)]
    stop_ids: list[TokenId] | None = None
    prompt_ids: list[TokenId]
    prompt_sha256: Annotated[str, Strict()] | None = None
    output_ids: list[TokenId]
    output_sha256: Annotated[str, Strict()]


def _check_record(record: dict) -> None:
    need = ("model", "sampling", "max_tokens", "prompt_ids", "output_ids", "output_sha256", *SETTINGS)
    missing = [k for k in need if k not in record]
    if missing:
        raise ValueError(f"not a kvlens record: missing {', '.join(missing)}")
    try:
        _RecordFields.model_validate(record)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"] if p not in ("float", "int"))  # not union branches
        msg = "Input should be an object" if first["type"] == "model_type" else first["msg"]
        raise ValueError(f"not a kvlens record: {where}: {msg}") from None
    if ids_sha256(record["prompt_ids"]) != record.get("prompt_sha256"):
        raise ValueError("the record's prompt ids do not match its prompt_sha256")
    if ids_sha256(record["output_ids"]) != record["output_sha256"]:
        raise ValueError("the record's output ids do not match its output_sha256")


def verify_record(llm: LLM, record: dict) -> VerifyResult:
    """Re-run the recorded request alone on ``llm`` and compare the output ids token by token."""
    _check_record(record)
    prompt = list(record["prompt_ids"])
    here = {"model sha256": llm.loaded.file_sha256, **settings(llm)}
    there = {"model sha256": record["model"]["sha256"], **{k: record[k] for k in SETTINGS}}
    mismatched = {k: (there[k], here[k]) for k in here if here[k] != there[k]}
    s = record["sampling"]
    sampling = SamplingParams(s["temperature"], s["top_k"], s["top_p"], s["seed"])
    if sampling.temperature > 0 and sampling.seed is None:
        return VerifyResult(False, "a sampled request without a seed cannot be re-run", mismatched=mismatched)
    stop = None if record.get("stop_ids") is None else frozenset(record["stop_ids"])
    req = Request("verify", prompt, int(record["max_tokens"]), sampling, stop)
    got = [ev.token_id for ev in run_alone(llm, req) if ev.token_id is not None]
    want = list(record["output_ids"])
    note = (
        ""
        if not mismatched
        else "; settings differ: " + ", ".join(f"{k} {a} vs {b}" for k, (a, b) in mismatched.items())
    )
    if got == want:
        return VerifyResult(
            True,
            f"verified: {len(got)} output tokens identical (sha256 {ids_sha256(got)[:16]}){note}",
            mismatched=mismatched,
        )
    i = next((j for j, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), min(len(want), len(got)))
    exp = want[i] if i < len(want) else None
    out = got[i] if i < len(got) else None
    return VerifyResult(
        False,
        f"diverged at output token {i}: expected id {exp}, got id {out} "
        f"({len(want)} recorded, {len(got)} re-run){note}",
        i, exp, out, mismatched,
    )  # fmt: skip


def verify_file(path: str | Path, model: str | None = None, device: str | None = None) -> VerifyResult:
    """``kvlens verify``: load the record's model with its settings and re-run it."""
    record = read_json(path, ValueError, "the record")
    if isinstance(record, dict) and isinstance(record.get("kvlens"), dict):
        record = record["kvlens"]  # a whole server response: its record sits under "kvlens"
    if not isinstance(record, dict):
        raise ValueError(f"{path}: not a kvlens record")
    _check_record(record)
    llm = load(
        model or record["model"]["source"],
        kv=record["kv"],
        device=device or record["device"],
        attn_backend=record["attn_backend"],
        cache_options=CacheOptions(mirror_prefill=record["mirror_prefill"]),
        prefill_chunk=int(record["prefill_chunk"]),
        weights=record["weights"],
    )
    return verify_record(llm, record)


__all__ = ["VerifyResult", "make_record", "verify_file", "verify_record"]
