"""Which attention backends the fused decode step runs (the thirty-third session's planted-bug
campaign: a ``+pv8`` backend taken by the fused step, whose P·V is float, passed every test)."""

from __future__ import annotations

from kvlens.kernels.decode_step import attention_kind


def test_the_fused_step_leaves_integer_pv_to_the_general_path() -> None:
    for backend in ("numba-int16+pv8", "numba-int+pv8"):
        assert attention_kind(backend) is None, backend
    for backend in ("numba", "numba-int16", "numba-int"):
        assert attention_kind(backend) is not None, backend
    assert attention_kind("torch") is None
