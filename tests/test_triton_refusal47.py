"""``--attn-backend triton`` on a machine without a GPU is refused with words that say why, unless
Triton's interpreter is asked for. The suite sets TRITON_INTERPRET=1 for all its tests (conftest), so
the refusal itself had never run: turning it on for every backend, or off for Triton, passed the suite
(a mutation run, forty-seventh session)."""

from __future__ import annotations

import pytest
import torch

from kvlens.engine.attention import BackendError, resolve_backend

CPU = torch.device("cpu")


def test_triton_on_a_cpu_is_refused_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(
        BackendError, match=r"^the triton backend needs a CUDA device \(or TRITON_INTERPRET=1"
    ):
        resolve_backend("triton", CPU)
    assert [resolve_backend(b, CPU) for b in ("torch", "numba", "numba-int", "auto")] == [
        "torch", "numba", "numba-int", "numba",
    ]  # fmt: skip
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # only "1" asks for the interpreter
    with pytest.raises(BackendError, match="needs a CUDA device"):
        resolve_backend("triton", CPU)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("triton", CPU) == "triton"
