"""The serving engine's default KV budget: a quarter of the memory free at start-up, no more than
max_batch full-context sequences use, and never under the floor; free memory read as the OS says."""

from __future__ import annotations

from types import SimpleNamespace

import psutil
import torch

from kvlens.engine import budget
from kvlens.kv.modes import MODES
from kvlens.kv.pool import kv_block_bytes

MIB = 1 << 20


def fake_llm(max_ctx: int) -> SimpleNamespace:
    cfg = SimpleNamespace(n_layers=30, n_kv_heads=4, head_dim=64, max_ctx=max_ctx)
    return SimpleNamespace(config=cfg, kv=MODES["q8"], device=torch.device("cpu"))


def test_budget_is_the_smallest_of_a_share_and_what_the_batch_can_use(monkeypatch):
    llm = fake_llm(max_ctx=1000)  # 32 blocks of 32 positions, the last one partial
    useful = kv_block_bytes(MODES["q8"], 30, 4, 64) * 32 * 4
    assert useful > 16 * MIB
    monkeypatch.setattr(budget, "available_memory", lambda device: 64 * useful)
    assert budget.default_kv_budget(llm, max_batch=4) == useful
    monkeypatch.setattr(budget, "available_memory", lambda device: 400 * MIB)
    assert budget.default_kv_budget(fake_llm(max_ctx=1 << 20), max_batch=4) == 100 * MIB  # a quarter
    monkeypatch.setattr(budget, "available_memory", lambda device: 8 * MIB)
    assert budget.default_kv_budget(fake_llm(max_ctx=1 << 20), max_batch=4) == 16 * MIB  # the floor


def test_free_memory_is_what_the_os_reports():
    """MemAvailable in bytes (psutil reads the same line): equal up to what moved between the reads."""
    ours, theirs = budget.available_memory(torch.device("cpu")), psutil.virtual_memory().available
    assert 0.9 < ours / theirs < 1.1
