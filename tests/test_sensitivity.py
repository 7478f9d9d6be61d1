"""The plan's and doctor's sensitivity passes: the fast KLD, the resumed pass against a full engine
pass, per-head probes, and the doctor reusing a plan's measurements."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from kvlens.kv.modes import StoreKind
from kvlens.kv.recipe import with_k_center
from kvlens.lab.doctor import DoctorConfig, run_doctor
from kvlens.lab.plan import PlanConfig, run_plan
from kvlens.lab.ppl import BaseLogProbs, chunk_metrics, scored_logits, scored_span
from kvlens.lab.recipe_search import SEARCH_ROUNDS, choice_mode, choose
from kvlens.lab.sensitivity import Sensitivity, kld_rows, probe_mode

Q4H, Q8H, F32 = StoreKind.Q4H, StoreKind.Q8H, StoreKind.F32


TINY_MODEL = ("qwen3", 7)  # conftest's tiny_dir / tiny: 2 layers, 2 KV heads, head_dim 32


@pytest.mark.parametrize("scale", [1e-3, 3e-2, 0.5])
def test_kld_rows_equals_the_float64_log_softmax_kld(scale):
    gen = torch.Generator().manual_seed(1)
    base = 4 * torch.randn(6, 5000, generator=gen)
    logits = base + scale * torch.randn(6, 5000, generator=gen)
    ref = chunk_metrics(BaseLogProbs(base), logits, torch.zeros(6, dtype=torch.long))["kld"]
    p = torch.softmax(base.double(), -1).float()
    got = kld_rows(base, p, logits)
    assert torch.allclose(got, ref, rtol=1e-3, atol=1e-9), (got, ref)


def engine_kld(llm, chunks: list[list[int]], mode, ctx: int) -> float:
    """Mean KLD from f32 over every scored token of ``chunks``, each through two full engine passes."""
    first = scored_span(ctx)[0]
    rows = []
    for chunk in chunks:
        base = BaseLogProbs(scored_logits(llm, chunk, llm.kv, ctx, first))
        full = scored_logits(llm, chunk, mode, ctx, first)
        rows.append(chunk_metrics(base, full, torch.tensor(chunk[first + 1 :]))["kld"])
    return float(torch.cat(rows).mean())


@pytest.mark.parametrize("item", [(0, "k"), (1, "v"), (1, 0, "k"), (0, 1, "v")])
def test_resumed_pass_equals_a_full_engine_pass(tiny, item):
    ctx = 48
    chunk = list(range(3, 3 + ctx))
    sens = Sensitivity(tiny, [chunk], ctx)
    mode = probe_mode(2, 2, item, Q4H)
    expected = engine_kld(tiny, [chunk], mode, ctx)
    assert expected > 1e-7  # the probe changes something
    assert sens.kld(mode) == pytest.approx(expected, rel=1e-3, abs=1e-9)
    assert sens.layers_run == 2 - item[0]  # resumed at the probed layer


def test_probe_modes_by_hand():
    """One layer's K (or one KV head's V) in the probed kind, every other row f32."""
    k1 = probe_mode(2, 2, (1, "k"), Q4H)
    assert (k1.kinds(0), k1.kinds(1), k1.head_kinds(1)) == ((F32, F32), (Q4H, F32), None)
    v10 = probe_mode(2, 2, (1, 0, "v"), Q8H)
    assert v10.kinds(0) == (F32, F32) and v10.head_kinds(1) == ((F32, Q8H), (F32, F32))


def test_the_kld_pools_every_chunks_scored_tokens(tiny):
    ctx = 48
    chunks = [list(range(3, 3 + ctx)), list(range(60, 60 + ctx))]
    mode = probe_mode(2, 2, (1, "v"), Q4H)
    one, both = engine_kld(tiny, chunks[:1], mode, ctx), engine_kld(tiny, chunks, mode, ctx)
    assert abs(both - one) > 1e-3 * both  # the second chunk moves the mean
    assert Sensitivity(tiny, chunks, ctx).kld(mode) == pytest.approx(both, rel=1e-3, abs=1e-9)


def test_smoothed_probes_carry_the_k_centers(tiny):
    """With smooth_k the table's probe of layer 0's K is the centered probe: its KLD is that of a full
    engine pass over the probe mode with the calibration's mean keys as centers, not the uncentered one."""
    ctx = 48
    chunk = list(range(3, 3 + ctx))
    sens = Sensitivity(tiny, [chunk], ctx, smooth_k=True)
    table = sens.table([Q4H], per_head=False)
    probe = probe_mode(2, 2, (0, "k"), Q4H)
    centered = engine_kld(tiny, [chunk], with_k_center(probe, sens.k_center), ctx)
    plain = engine_kld(tiny, [chunk], probe, ctx)
    assert abs(centered - plain) > 1e-3 * plain
    assert table[(0, "k", Q4H)] == pytest.approx(centered, rel=1e-3, abs=1e-9)


def test_per_head_choice_builds_a_per_head_recipe():
    sens = {(0, 0, "k", Q4H): 1e-4, (0, 1, "k", Q4H): 1.0, (0, 0, "v", Q4H): 1.0, (0, 1, "v", Q4H): 1.0}
    sens |= {(*key[:-1], Q8H): 0.0 for key in list(sens)}
    choice, predicted = choose(sens, 32, 1e-3)
    assert predicted == pytest.approx(1e-4)
    mode = choice_mode("r", choice, 1, 2)
    assert mode.head_kinds(0) == ((Q4H, Q8H), (Q8H, Q8H))


def test_doctor_reuses_a_plan_and_refuses_another_models(tmp_path, tiny_dir, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(f"the {w} in a tin" for w in range(300)))
    cfg = PlanConfig(
        model=str(tiny_dir), corpus=str(corpus), kld_budget=0.01, ctx=64, calib_chunks=1, heldout_chunks=1,
        out=str(tmp_path / "r.json"), kv="q8",
    )  # fmt: skip
    plan = run_plan(cfg)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.to_json()))
    doc = run_doctor(DoctorConfig(model=str(tiny_dir), corpus=str(corpus), kld_budget=0.01, plan=str(path)))
    assert doc.recipe["layers"] == json.loads((tmp_path / "r.json").read_text())["layers"]
    n_layer_findings = len({f.layer for f in doc.findings if f.layer is not None})
    # consequences (2 kinds per flagged layer) and the recipe's check(s): no sensitivity pass repeated
    assert doc.passes <= 2 * n_layer_findings + plan.rounds
    # the plan itself reuses them too: no sensitivity pass, only the recipe's check(s)
    again = run_plan(dataclasses.replace(cfg, reuse=str(path), calib_target=0.5))
    assert again.sensitivity == plan.sensitivity and again.passes == again.rounds
    assert again.calib_kld <= 0.5 * 0.01 or again.rounds == SEARCH_ROUNDS
    # --no-verify: the same choice, its bytes, no held-out pass
    quick = run_plan(dataclasses.replace(cfg, reuse=str(path), verify=False))
    assert quick.rows == [] and quick.passes == quick.rounds and "verify" not in quick.seconds
    assert quick.recipe.layers == plan.recipe.layers and quick.recipe.heads == plan.recipe.heads
    assert quick.bytes_per_token == plan.rows[0]["bytes_per_token"]
    q8 = 2 * 2 * ((32 + 4 + 2) + (32 + 4))  # 2 layers x 2 KV heads: K codes, scale, one int16 sum; V
    assert quick.vs_q8 == pytest.approx(quick.bytes_per_token / q8)
    data = plan.to_json() | {"model": "another"}
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="was measured on another"):
        run_doctor(DoctorConfig(model=str(tiny_dir), corpus=str(corpus), plan=str(path)))


def test_plan_cli_no_verify_chooses_without_held_out_passes(tmp_path, tiny_dir):
    from typer.testing import CliRunner

    from kvlens.cli import app
    from kvlens.kv.recipe import load_recipe

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(f"the {w} in a tin" for w in range(300)))
    out = tmp_path / "r.json"
    args = ["lab", "plan", "--model", str(tiny_dir), "--corpus", str(corpus), "--kld-budget", "0.01"]
    args += ["--ctx", "64", "--calib-chunks", "1", "--heldout-chunks", "1", "--per-layer"]
    args += ["--out", str(out), "--no-verify"]
    res = CliRunner().invoke(app, [*args, "--json"])
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout)
    assert got["rows"] == [] and got["heldout_chunks"] == 0
    assert set(got["seconds"]) == {"sensitivity", "choice"}
    assert got["bytes_per_token"] == load_recipe(out).bytes_per_token(2, 2, 32)
    text = CliRunner().invoke(app, args)
    assert text.exit_code == 0 and "held-out verification not run" in text.stdout, text.output
