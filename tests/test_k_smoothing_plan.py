"""K smoothing in recipe files and in ``kvlens lab plan --smooth-k``: the ``k_center`` JSON round trip,
old recipes unchanged, bad centers refused with one clear error (API and CLI), and the plan's centers
against the mean of the captured post-RoPE keys of its calibration chunks."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from kvlens.kv.modes import KVMode, StoreKind
from kvlens.kv.recipe import RecipeError, head_recipe_mode, load_recipe, save_recipe, with_k_center
from kvlens.lab.doctor import DoctorConfig, run_doctor
from kvlens.lab.plan import PlanConfig, plan_chunks, run_plan

TINY_MODEL = ("qwen3", 5)  # conftest's tiny_dir / tiny: 2 layers, 2 KV heads, head_dim 32
Q4H, Q8 = StoreKind.Q4H, StoreKind.Q8
LAYERS = [{"k": "q4h", "v": "q8"}, {"k": ["q8", "q4h"], "v": "q4h"}]


def write(path, **data):
    path.write_text(json.dumps({"kvlens_recipe": 1, "layers": LAYERS} | data))
    return str(path)


def test_round_trip_with_centers_is_exact(tmp_path, tiny):
    c = torch.randn(2, 2, 32, generator=torch.Generator().manual_seed(0)) * 10
    c[0, 0, 0] = 1 / 3  # a float32 that no short decimal writes exactly
    mode = with_k_center(head_recipe_mode("r", [[(Q4H, Q8)] * 2, [(Q8, Q4H), (Q4H, Q4H)]]), c)
    save_recipe(mode, 2, tmp_path / "r.json")
    back = load_recipe(tmp_path / "r.json")
    assert torch.equal(back.k_center, c) and back.k_center_digest == mode.k_center_digest
    assert back.layers == mode.layers and back.heads == mode.heads
    assert len(json.loads((tmp_path / "r.json").read_text())["k_center"][1]) == 2
    cache = tiny.variant(kv=str(tmp_path / "r.json")).new_cache(8)
    assert torch.equal(cache.k[0].center, c[0].unsqueeze(1))  # the engine's stores carry them
    assert torch.equal(cache.k[1].parts[1].center, c[1, 1:].unsqueeze(1))
    assert cache.v[0].center is None


def test_a_modes_centers_are_its_own_copy():
    """with_k_center copies: changing the caller's tensor afterwards changes neither the mode's centers
    nor its digest (the digest names what the cache subtracts)."""
    c = torch.ones(2, 2, 32)
    mode = with_k_center(head_recipe_mode("r", [[(Q8, Q8)] * 2] * 2), c)
    digest = mode.k_center_digest
    c.add_(1.0)
    assert torch.equal(mode.k_center, torch.ones(2, 2, 32)) and mode.k_center_digest == digest


def test_a_recipe_without_centers_is_unchanged(tmp_path):
    mode = KVMode.parse(write(tmp_path / "old.json"))
    assert mode.k_center is None and mode.k_center_digest == "" and mode.identity == mode.name
    save_recipe(mode, 2, tmp_path / "again.json")
    assert "k_center" not in json.loads((tmp_path / "again.json").read_text())


ROW = [0.5] * 32


@pytest.mark.parametrize(
    "center,match",
    [
        ([[ROW, ROW]] * 3, r"one entry per layer \(2\), got 3 entries"),
        ("zeros", r"one entry per layer \(2\), got 'zeros'"),
        ([[ROW, ROW], [ROW]], "k_center layer 1 has 1 KV heads; layer 0 has 2"),
        ([[ROW, ROW], [ROW, [0.5] * 31]], "k_center layer 1 head 1 has 31 values, layer 0 head 0 has 32"),
        ([[[0.5] * 31, ROW], [ROW, ROW]], "k_center layer 0 head 1 has 32 values, layer 0 head 0 has 31"),
        (
            [[ROW, ROW], [ROW, [*ROW[:5], float("nan"), *ROW[6:]]]],
            "layer 1 head 1 value 5 is nan, not a finite",
        ),
        ([[ROW, [*ROW[:3], "0.5", *ROW[4:]]], [ROW, ROW]], "layer 0 head 1 value 3 is '0.5', not a number"),
        ([[ROW, [True] * 32], [ROW, ROW]], "layer 0 head 1 value 0 is True, not a number"),
        ([[ROW, ROW], [ROW, [1e39] * 32]], "value 0 is 1e\\+39, not a finite float32"),
    ],
)
def test_bad_centers_are_one_clear_error(tmp_path, center, match):
    with pytest.raises(RecipeError, match=match):
        KVMode.parse(write(tmp_path / "bad.json", k_center=center))


def generate_with(recipe: str, model_dir) -> subprocess.CompletedProcess:
    """``kvlens generate --kv recipe`` in a real process (the CLI's one-line error boundary)."""
    return subprocess.run(
        [sys.executable, "-m", "kvlens.cli", "generate", "--model", str(model_dir), "--kv", recipe, "hi"],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    "shape,match",
    [((2, 3, 32), "k_center is .* = \\[2, 3, 32\\]; the model has 2 KV heads"),
     ((2, 2, 64), "\\[2, 2, 64\\]; the model has 32 head_dim")],
)  # fmt: skip
def test_centers_not_shaped_like_the_model_are_refused(tmp_path, tiny, tiny_dir, shape, match):
    bad = write(
        tmp_path / "bad.json", layers=[{"k": "q8", "v": "q8"}] * 2, k_center=torch.ones(shape).tolist()
    )
    with pytest.raises(ValueError, match=match):
        tiny.variant(kv=bad)
    r = generate_with(bad, tiny_dir)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: KV recipe ") and "k_center" in lines[0], r.stderr


def test_cli_refuses_a_non_numeric_center_in_one_line(tmp_path, tiny_dir):
    bad = write(tmp_path / "bad.json", k_center=[[ROW, ROW], [ROW, ["x"] * 32]])
    r = generate_with(bad, tiny_dir)
    assert r.returncode != 0
    assert r.stderr.strip().splitlines() == [
        f"error: {bad} k_center layer 1 head 1 value 0 is 'x', not a number"
    ]


# ------------------------------------------------------------------ lab plan --smooth-k


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(" ".join(f"the {w} in a tin" for w in range(300)))
    return path


def test_plan_centers_are_the_mean_captured_key_of_the_calibration(tmp_path, tiny, tiny_dir, corpus):
    cfg = PlanConfig(
        model=str(tiny_dir), corpus=str(corpus), kld_budget=0.01, ctx=64, calib_chunks=2, heldout_chunks=1,
        out=str(tmp_path / "r.json"), kv="q8", smooth_k=True,
    )  # fmt: skip
    plan = run_plan(cfg)
    # independently: the engine's capture of each calibration chunk, keys averaged over every position
    calib, _ = plan_chunks(tiny, corpus.read_text(), cfg)
    keys = [torch.stack([k for _, k, _ in tiny.capture_qkv(chunk)]) for chunk in calib]  # [L, KV, n, d]
    expected = torch.cat(keys, 2).double().mean(2)
    got = load_recipe(cfg.out).k_center
    assert got.shape == (2, 2, 32)
    # a float32 mean of float32 keys: rounding only (the keys are O(1) here)
    assert torch.allclose(got.double(), expected, rtol=0, atol=1e-6 * float(expected.abs().max()))
    assert plan.smooth_k and plan.to_json()["smooth_k"] is True
    assert plan.recipe.k_center is not None and plan.rows[0]["kv"] == cfg.out  # verified on that recipe
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.to_json()))
    # a measurement is reused only the way it was taken
    with pytest.raises(ValueError, match="measured with K smoothing: reuse it with --smooth-k"):
        run_plan(dataclasses.replace(cfg, reuse=str(path), smooth_k=False))
    again = run_plan(dataclasses.replace(cfg, reuse=str(path), verify=False))
    assert torch.equal(again.recipe.k_center, got)
    # the doctor's recipe from a smoothed plan carries the same centers
    doc = run_doctor(DoctorConfig(model=str(tiny_dir), corpus=str(corpus), kld_budget=0.01, plan=str(path)))
    assert torch.equal(torch.tensor(doc.recipe["k_center"]), got)
    plain = json.loads(path.read_text())
    del plain["smooth_k"]  # an output from before K smoothing: measured without
    path.write_text(json.dumps(plain))
    with pytest.raises(ValueError, match="measured without K smoothing: reuse it with --no-smooth-k"):
        run_plan(dataclasses.replace(cfg, reuse=str(path)))
    doc = run_doctor(DoctorConfig(model=str(tiny_dir), corpus=str(corpus), kld_budget=0.01, plan=str(path)))
    assert "k_center" not in doc.recipe
