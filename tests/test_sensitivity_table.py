"""The plan's sensitivity table, whole: per layer or per KV head as asked (every item of the model and
each kind, no other key), each entry the KLD of a full engine pass over that item's probe (also for a
sliding-window model whose chunk is longer than its hidden size), and one progress line per layer on
stderr."""

from __future__ import annotations

import itertools

import pytest
import torch
from test_sensitivity import engine_kld
from tiny_models import write_hf

import kvlens
from kvlens.kv.modes import StoreKind
from kvlens.lab.sensitivity import Sensitivity, probe_mode

Q4H, Q8H, F32 = StoreKind.Q4H, StoreKind.Q8H, StoreKind.F32
TINY_MODEL = ("qwen3", 7)  # conftest's tiny: 2 layers, 2 KV heads, head_dim 32
CTX = 48


@pytest.mark.parametrize("per_head", [False, True])
def test_the_table_has_an_entry_per_item_and_kind(tiny, per_head):
    sens = Sensitivity(tiny, [list(range(3, 3 + CTX))], CTX)
    heads = [(h,) for h in range(2)] if per_head else [()]
    want = {
        (layer, *head, role, kind)
        for layer, head, role, kind in itertools.product(range(2), heads, "kv", [Q4H, Q8H])
    }
    assert set(sens.table([Q4H, Q8H], per_head)) == want


def test_a_per_head_entry_is_its_probes_engine_kld(tiny):
    chunk = list(range(3, 3 + CTX))
    table = Sensitivity(tiny, [chunk], CTX).table([Q4H], per_head=True)
    for item in [(1, 0, "v"), (0, 1, "k")]:
        expected = engine_kld(tiny, [chunk], probe_mode(2, 2, item, Q4H), CTX)
        assert table[(*item, Q4H)] == pytest.approx(expected, rel=1e-3, abs=1e-9)


@pytest.mark.parametrize("per_head", [False, True])
def test_one_progress_line_per_layer(tiny, per_head, capsys):
    Sensitivity(tiny, [list(range(3, 3 + CTX))], CTX).table([Q4H], per_head)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "sensitivity:" in line]
    assert lines == ["  sensitivity: layer 1/2", "  sensitivity: layer 2/2"]


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """A tiny Mistral whose every layer attends its last 8 positions (hidden size 64, head_dim 32)."""
    out = tmp_path_factory.mktemp("windowed") / "hf"
    write_hf("mistral", out, seed=3, sliding_window=8, head_dim=32)
    return kvlens.load(out, kv="f32", attn_backend="torch")


@pytest.mark.parametrize("item", [(0, "v"), (1, 1, "v")])
def test_a_windowed_models_probe_is_its_engine_kld(windowed, item):
    """96 positions, past the 8-position window and past the hidden size: the resumed sensitivity pass
    attends as the engine does."""
    ctx = 96
    chunk = [3 + (7 * i) % 90 for i in range(ctx)]
    mode = probe_mode(2, 2, item, Q4H)
    expected = engine_kld(windowed, [chunk], mode, ctx)
    assert expected > 1e-6
    assert Sensitivity(windowed, [chunk], ctx).kld(mode) == pytest.approx(expected, rel=1e-3, abs=1e-9)


def test_the_k_centers_are_the_float64_mean_rounded_once(tiny):
    """128 O(1) float32 keys per channel sum exactly in float64 and 128 divides exactly, so the centers
    are the exact mean of the engine's captured keys rounded once to float32: equal, bit for bit."""
    chunks = [list(range(3, 3 + 64)), list(range(100, 100 + 64))]
    sens = Sensitivity(tiny, chunks, 64, smooth_k=True)
    keys = [torch.stack([k for _, k, _ in tiny.capture_qkv(chunk)]) for chunk in chunks]  # [L, KV, n, d]
    assert torch.equal(sens.k_center, torch.cat(keys, 2).double().mean(2).float())


def test_a_per_head_k_probe_by_hand():
    """One KV head's K in the probed kind (``test_sensitivity`` has the per-head V case)."""
    k10 = probe_mode(2, 2, (1, 0, "k"), Q4H)
    assert (k10.kinds(0), k10.head_kinds(0)) == ((F32, F32), None)  # layer 0 unsplit, all f32
    assert k10.head_kinds(1) == ((Q4H, F32), (F32, F32))
