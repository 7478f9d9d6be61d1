"""``lab plan``'s options, chunk layout and reused measurements by hand, without a model (the
thirty-third session's planted-bug campaign on ``lab/plan.py``)."""

from __future__ import annotations

import dataclasses
import json
import math
from types import SimpleNamespace

import pytest
from test_plan_chunks import corpus  # noqa: F401 - the module's corpus fixture

from kvlens.kv.modes import StoreKind
from kvlens.lab import plan
from kvlens.lab.plan import (
    PlanConfig,
    chunk_layout,
    load_measurements,
    plan_chunks,
    run_plan,
    sensitivity_key,
)


def test_calib_target_is_a_share_in_0_to_1() -> None:
    assert PlanConfig(calib_target=1.0).calib_target == 1.0
    for bad, said in ((0.0, "> 0, got 0"), (1.01, "≤ 1, got 1.01"), (math.nan, "a finite number, got nan")):
        with pytest.raises(ValueError, match=f"--calib-target must be {said}"):
            PlanConfig(calib_target=bad)
    with pytest.raises(TypeError, match="--calib-target must be a number, got str '1'"):
        PlanConfig(calib_target="1")


@pytest.mark.parametrize(
    ("changes", "said"),
    [({"kld_budget": True}, "--kld-budget must be a number, got bool"), ({"ctx": 3}, "--ctx must be ≥ 4, got 3"),
     ({"calib_chunks": 0}, "--calib-chunks must be ≥ 1"), ({"heldout_chunks": -1}, "--heldout-chunks must be ≥ 0"),
     ({"calib_chunks": 1.5}, "--calib-chunks must be an integer")],
)  # fmt: skip
def test_plan_counts_and_budget_are_checked_by_name(changes, said) -> None:
    """From Python (the CLI's options are typed): calib_chunks=0 ran and said "k_center holds a
    non-finite value" (thirty-sixth session's sweep)."""
    with pytest.raises((TypeError, ValueError), match=said):
        PlanConfig(**changes)


def test_candidates_skip_empty_items_and_refuse_none() -> None:
    assert PlanConfig(candidates="q8h,,q4h ,").candidates == [StoreKind.Q8H, StoreKind.Q4H]
    with pytest.raises(ValueError, match="--candidates names no KV kind"):
        PlanConfig(candidates=" , ")
    with pytest.raises(ValueError, match="unknown KV kind 'q3'"):
        PlanConfig(candidates="q8h,q3")


def test_sensitivity_keys_round_trip_per_layer_and_per_head() -> None:
    assert sensitivity_key("3.k.q8h") == (3, "k", StoreKind.Q8H)
    assert sensitivity_key("12.1.v.q4h") == (12, 1, "v", StoreKind.Q4H)


def test_spread_calibration_chunks_are_i_times_need_over_calib() -> None:
    """3 of 8: chunks 0, 8/3 and 16/3 rounded down (0, 2, 5), not steps of 8 // 3."""
    assert chunk_layout(3, 5, True) == ([0, 2, 5], [1, 3, 4, 6, 7])


def test_plan_chunks_need_every_chunk_the_layout_names() -> None:
    llm = SimpleNamespace(
        tokenizer=SimpleNamespace(bos_prefix=[], encode=lambda t: [int(x) for x in t.split()])
    )
    text = " ".join(str(i) for i in range(12))  # three chunks of 4
    calib, held = plan_chunks(llm, text, PlanConfig(ctx=4), ([2], [0, 1]))
    assert calib == [[8, 9, 10, 11]] and held == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="holds 3 chunks of 4 tokens; the plan needs 4"):
        plan_chunks(llm, text, PlanConfig(ctx=4), ([0], [1, 3]))


def _measured(tmp_path, **changes) -> str:
    data = {"model": "m", "corpus": "c", "ctx": 64, "calib_chunks": 2, "sensitivity": {"0.k.q8h": 1e-4}}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data | changes))
    return str(path)


def test_reused_measurements_name_where_they_were_taken(tmp_path) -> None:
    m = load_measurements(_measured(tmp_path), "m", "c", None)
    assert m.table == {(0, "k", StoreKind.Q8H): 1e-4} and m.calib_index == [0, 1] and m.ctx == 64
    assert m.smooth_k is False  # an output from before K smoothing was measured without it
    assert load_measurements(_measured(tmp_path, smooth_k=True), "m", "c", 64).smooth_k is True
    for model, text, ctx in (("other", "c", 64), ("m", "other", 64), ("m", "c", 128)):
        with pytest.raises(ValueError, match="was measured on m, c, ctx 64"):
            load_measurements(_measured(tmp_path), model, text, ctx)
    with pytest.raises(ValueError, match="does not name distinct chunks"):
        load_measurements(_measured(tmp_path, calib_index=[1, 1]), "m", "c", 64)


TINY_MODEL = ("qwen3", 5)  # conftest's tiny_dir: 2 layers, 2 KV heads, head_dim 32


def test_the_choice_aims_at_a_share_of_the_budget_and_within_means_at_most(
    tmp_path,
    tiny_dir,
    corpus,  # noqa: F811 - the fixture imported above
    monkeypatch,
) -> None:
    """The search gets ``kld_budget × calib_target``; a held-out row is within the budget when its
    KLD is at most the budget, equal included (q8's row does not depend on the budget)."""
    targets: list[float] = []
    choose = plan.choose_verified
    monkeypatch.setattr(
        plan, "choose_verified", lambda s, t, target, o: targets.append(target) or choose(s, t, target, o)
    )
    cfg = PlanConfig(
        model=str(tiny_dir), corpus=str(corpus), kld_budget=0.02, ctx=48, calib_chunks=1, heldout_chunks=1,
        out=str(tmp_path / "r.json"), kv="q8", smooth_k=False, per_head=False, calib_target=0.25,
    )  # fmt: skip
    q8 = run_plan(cfg).rows[-1]
    assert targets == [0.02 * 0.25] and q8["kv"] == "q8" and q8["kld_mean"] > 0
    for budget, within in ((q8["kld_mean"], True), (q8["kld_mean"] * (1 - 1e-9), False)):
        row = run_plan(dataclasses.replace(cfg, kld_budget=budget)).rows[-1]
        assert row["kld_mean"] == q8["kld_mean"] and row["within_budget"] is within
