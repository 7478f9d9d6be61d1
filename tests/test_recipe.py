"""Per-layer KV recipes: JSON round trip into the engine, refusals, the planner's choice and its run."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import pytest
import torch

import kvlens
from kvlens.kv.modes import MODES, KVMode, StoreKind
from kvlens.kv.recipe import RecipeError, load_recipe, recipe_mode, save_recipe
from kvlens.lab.plan import PlanConfig, run_plan
from kvlens.lab.recipe_search import SEARCH_ROUNDS, Checked, choose, search_working_budget

F16, Q8H, Q4H, F32 = StoreKind.F16, StoreKind.Q8H, StoreKind.Q4H, StoreKind.F32


TINY_MODEL = ("qwen3", 3)  # conftest's tiny_dir / tiny: 2 layers, 2 KV heads, head_dim 32


def write(path, layers, **extra):
    path.write_text(json.dumps({"kvlens_recipe": 1, "layers": layers, **extra}))
    return str(path)


def test_round_trip_json_engine(tmp_path, tiny):
    mode = recipe_mode("r", [(Q8H, Q4H), (F16, StoreKind.Q8)])
    path = tmp_path / "r.json"
    save_recipe(mode, 2, path, model="tiny")
    back = load_recipe(path)
    assert back.layers == mode.layers and back.name == str(path)
    assert KVMode.parse(str(path)) == back
    llm = tiny.variant(kv=str(path))
    cache = llm.new_cache(40)
    assert [(s.kind, t.kind) for s, t in zip(cache.k, cache.v, strict=True)] == list(mode.layers)
    hd, n_kv = 32, 2  # bytes: each layer's own rows, summed
    k_sums = 2 * (hd // 32)  # the q8h K store keeps its int16 code sums per 32 codes
    expected = n_kv * (
        Q8H.row_bytes(hd) + k_sums + Q4H.row_bytes(hd) + F16.row_bytes(hd) + StoreKind.Q8.row_bytes(hd)
    )
    assert cache.bytes_per_token() == expected == back.bytes_per_token(2, n_kv, hd)


def test_an_out_path_the_cli_accepts_is_written(tmp_path):
    """`lab plan --out` is checked before the measurement runs; a folder the check lets be created
    must then be created, not fail after minutes of work."""
    from kvlens.cli_args import check_output_path

    path = check_output_path(str(tmp_path / "new" / "deeper" / "r.json"), directory=False)
    save_recipe(recipe_mode("r", [(Q8H, Q4H), (F16, F16)]), 2, path)
    assert load_recipe(path).layers == ((Q8H, Q4H), (F16, F16))


@pytest.mark.parametrize("uniform", ["q8h", "q4h", "f16", "q6h"])
def test_a_uniform_recipe_is_that_mode(tmp_path, tiny, uniform):
    """A recipe giving every layer one mode's kinds computes bit for bit what the mode computes."""
    path = write(tmp_path / "u.json", [{"k": uniform, "v": uniform}] * 2)
    ids = list(range(5, 45))
    for backend in ("torch", "numba"):
        a = tiny.variant(kv=path, attn_backend=backend)
        b = tiny.variant(kv=uniform, attn_backend=backend)
        ca, cb = a.new_cache(41), b.new_cache(41)
        a.forward(ids, ca, 0, prefill=True)
        b.forward(ids, cb, 0, prefill=True)
        assert torch.equal(a.forward([7], ca, 40, prefill=False), b.forward([7], cb, 40, prefill=False))


def test_mixed_recipe_is_each_layer_its_own_mode(tmp_path, tiny):
    """Layer 0 from one mode, layer 1 from another: the K/V rows each layer stores are those modes' rows."""
    path = write(tmp_path / "m.json", [{"k": "q4h", "v": "q8"}, {"k": "f16", "v": "q4"}])
    ids = list(range(5, 37))
    caches = {}
    for kv in (path, "k=q4h,v=q8", "k=f16,v=q4"):
        llm = tiny.variant(kv=kv)
        caches[kv] = llm.new_cache(32)
        llm.forward(ids, caches[kv], 0, prefill=True)
    # layer 0 sees the same input in every mode: its stored rows equal exactly
    assert torch.equal(caches[path].k[0].data, caches["k=q4h,v=q8"].k[0].data)
    assert torch.equal(caches[path].v[0].data, caches["k=q4h,v=q8"].v[0].data)


@pytest.mark.parametrize(
    "content,match",
    [
        ({"kvlens_recipe": 1, "layers": [{"k": "q3", "v": "q8"}] * 2}, "layer 0 K: unknown KV kind 'q3'"),
        ({"kvlens_recipe": 1, "layers": [{"k": "q8"}] * 2}, "layer 0 must be"),
        ({"kvlens_recipe": 1, "layers": [{"k": "q8", "v": "q8", "K": "f16"}] * 2}, "layer 0 must be"),
        ({"kvlens_recipe": 1, "layers": []}, "non-empty list"),
        ({"layers": [{"k": "q8", "v": "q8"}]}, "not a kvlens KV recipe"),
    ],
)
def test_bad_recipe_is_one_clear_error(tmp_path, content, match):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(content))
    with pytest.raises(RecipeError, match=match):
        KVMode.parse(str(path))


def test_bad_recipe_files_and_layer_count(tmp_path, tiny, tiny_dir):
    (tmp_path / "nojson.json").write_text("{not json")
    with pytest.raises(RecipeError, match="not valid JSON"):
        KVMode.parse(str(tmp_path / "nojson.json"))
    with pytest.raises(RecipeError, match="cannot read"):
        KVMode.parse(str(tmp_path / "missing.json"))
    three = write(tmp_path / "three.json", [{"k": "q8", "v": "q8"}] * 3)
    with pytest.raises(ValueError, match="has 3 layers; the model has 2"):
        tiny.variant(kv=three)
    with pytest.raises(ValueError, match="has 3 layers; the model has 2"):
        kvlens.load(tiny_dir, kv=three)
    # the CLI: one line, exit 2
    r = subprocess.run(
        [sys.executable, "-m", "kvlens.cli", "generate", "--model", str(tiny_dir), "--kv", three, "hi"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == ["error: KV recipe " + three + " has 3 layers; the model has 2"]


def test_a_recipes_k_and_v_are_its_widest_kinds():
    """KVMode's contract for a recipe: ``k`` / ``v`` name the widest kind any layer stores (by hand:
    f16 rows are 2 bytes a value, q8h 1 + a 4-byte scale, q4h half a byte + fp16 block scales)."""
    mode = recipe_mode("r", [(Q8H, Q4H), (F16, Q8H), (Q4H, Q4H)])
    assert (mode.k, mode.v) == (F16, Q8H)
    assert mode.kinds(2) == (Q4H, Q4H)


def test_choice_counts_the_code_sums_an_int8_k_row_keeps():
    """K and V of one layer cost the same KLD in q8h, and the budget takes one of them: V saves more
    bytes (an int8 K row also keeps int16 code sums per 32 values: at head_dim 64, f16 128 bytes,
    q8h 64 + 4, K's sums 4 more), so the greedy ratio takes V."""
    hd = 64
    assert (F16.row_bytes(hd), Q8H.row_bytes(hd), Q8H.row_bytes(hd, with_ksum=True)) == (128, 68, 72)
    sens = {(0, "k", Q8H): 0.25, (0, "v", Q8H): 0.25}
    chosen, predicted = choose(sens, hd, 0.375)
    assert chosen == {(0, "k"): F16, (0, "v"): Q8H} and predicted == 0.25
    sens = {(0, "k", Q8H): 0.25, (0, "v", Q8H): 0.26}  # V a little dearer: 60 / 0.26 still beats 56 / 0.25
    chosen, _ = choose(sens, hd, 0.375)
    assert chosen == {(0, "k"): F16, (0, "v"): Q8H}


def test_a_budget_met_exactly_is_within():
    """The budget bounds the summed KLD from above, inclusive (0.25 + 0.5 is exact in binary)."""
    sens = {(0, "k", Q8H): 0.25, (0, "v", Q8H): 0.5}
    chosen, predicted = choose(sens, 64, 0.75)
    assert chosen == {(0, "k"): Q8H, (0, "v"): Q8H} and predicted == 0.75


def brute_force(sens, n_layers, hd, budget):
    """The cheapest assignment under the budget by enumeration (tiny instances only)."""
    items = [(layer, role) for layer in range(n_layers) for role in ("k", "v")]
    best = None
    for combo in itertools.product([F16, Q8H, Q4H], repeat=len(items)):
        kld = sum(0.0 if k == F16 else sens[(*it, k)] for it, k in zip(items, combo, strict=True))
        size = sum(k.row_bytes(hd) for k in combo)
        if kld <= budget and (best is None or size < best[0]):
            best = (size, kld)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_choice_is_within_budget_maximal_and_near_optimal(seed):
    gen = torch.Generator().manual_seed(seed)
    n, hd = 3, 64
    sens = {}
    for layer in range(n):
        for role in ("k", "v"):
            a = float(torch.rand(1, generator=gen)) * 1e-3 * (4 if role == "k" else 1)
            sens[layer, role, Q8H] = a
            sens[layer, role, Q4H] = a * (5 + 20 * float(torch.rand(1, generator=gen)))
    budget = 2e-3
    chosen, predicted = choose(sens, hd, budget)
    assert set(chosen) == {(layer, role) for layer in range(n) for role in ("k", "v")}
    kld = sum(0.0 if kind == F16 else sens[(*it, kind)] for it, kind in chosen.items())
    assert kld == pytest.approx(predicted) and kld <= budget
    size = sum(kind.row_bytes(hd) for kind in chosen.values())
    for it, kind in chosen.items():  # maximal: no single further downgrade fits
        for cheaper in (Q8H, Q4H):
            if cheaper.row_bytes(hd) < kind.row_bytes(hd):
                old = 0.0 if kind == F16 else sens[(*it, kind)]
                assert kld - old + sens[(*it, cheaper)] > budget
    opt_size, _ = brute_force(sens, n, hd, budget)
    assert size <= 1.25 * opt_size  # greedy knapsack: close to the optimum on these instances


def fake_check(kld_per_unit: float, floor: float = 0.0, cheapest: float = 0.0):
    """A choice whose bytes fall as the working budget w grows (to ``cheapest`` w), and whose
    measured KLD is ``kld_per_unit * w + floor`` (> 1: the items' KLDs add up to more than their sum)."""
    calls = []

    def check(w: float) -> Checked:
        spent = w if not cheapest else min(w, cheapest)
        calls.append(w)
        return Checked(
            f"recipe@{spent:.6f}", spent, kld_per_unit * spent + floor, round(10_000 - 1_000 * spent)
        )

    return check, calls


@pytest.mark.parametrize("kld_per_unit", [0.6, 0.9, 1.3, 2.5])
def test_the_search_spends_the_budget_and_never_returns_a_choice_over_it(kld_per_unit):
    """Whether the items' KLDs add to more or less than their sum, the search lands within the budget
    and within the bracket of it (the largest working budget whose choice measures within)."""
    check, calls = fake_check(kld_per_unit)
    got, rounds = search_working_budget(check, 1.0)
    assert got.measured <= 1.0 and rounds == len(calls) <= SEARCH_ROUNDS
    best_possible = 1.0 / kld_per_unit  # the working budget whose choice measures exactly 1.0
    assert got.predicted >= 0.95 * best_possible  # the bracket (2 %) and the rounds left some room
    # the fewest bytes among the checks measured within, not merely the last one
    within = [check(w) for w in list(calls) if kld_per_unit * w <= 1.0]
    assert got.bytes_per_token == min(c.bytes_per_token for c in within)


def test_the_search_keeps_the_fewest_bytes_within_not_the_last_check_within():
    """The greedy choice need not save bytes monotonically with its budget: the search returns the
    cheapest check measured within, wherever it came in the sequence."""
    replies = iter([(0.5, 9000), (0.9, 9500), (1.2, 8000), (0.99, 9600), (1.1, 8500), (0.98, 9700)])

    def check(w: float) -> Checked:
        measured, n_bytes = next(replies)
        return Checked(f"recipe@{w:.6f}", w, measured, n_bytes)

    got, rounds = search_working_budget(check, 1.0)
    assert rounds == SEARCH_ROUNDS and (got.measured, got.bytes_per_token) == (0.5, 9000)


def test_the_search_stops_once_the_bracket_is_two_percent_of_its_top():
    """The search's steps by hand for scripted measurements (budget 1.0): over at w = 1, so the next
    w is 1 / 1.01 * 0.9; within there, so bisect; stop when over - within <= 2 % of over."""
    measured = iter([1.01, 0.99, 1.001, 0.99, 0.99, 0.99])
    calls = []

    def check(w: float) -> Checked:
        calls.append(w)
        return Checked(f"recipe@{w:.6f}", w, next(measured), round(10_000 - 1_000 * w))

    got, rounds = search_working_budget(check, 1.0)
    w2 = 1.0 / 1.01 * 0.9
    w3 = (w2 + 1.0) / 2  # over: the bracket is (w2, w3)
    w4 = (w2 + w3) / 2  # within: (w4, w3)
    w5 = (w4 + w3) / 2  # within: (w5, w3), 1.4 % of w3 wide: done
    assert (w3 - w5) <= 0.02 * w3 < (w3 - w4)
    assert calls == pytest.approx([1.0, w2, w3, w4, w5], rel=1e-12) and rounds == 5
    assert got.predicted == pytest.approx(w5)  # the fewest bytes within: the largest w within


def test_the_search_stops_when_a_larger_budget_buys_nothing():
    check, calls = fake_check(0.5, cheapest=0.3)  # every item at its cheapest kind from w = 0.3
    got, rounds = search_working_budget(check, 1.0)
    assert rounds == 2 and got.measured == pytest.approx(0.15)


def test_the_search_reports_a_choice_over_the_budget_when_none_is_within():
    check, calls = fake_check(1.0, floor=2.0)  # even the f16 fallback measures over
    got, rounds = search_working_budget(check, 1.0)
    assert rounds == SEARCH_ROUNDS and got.measured > 1.0


@pytest.mark.parametrize("per_head", [False, True])
def test_plan_end_to_end_on_a_tiny_model(tmp_path, tiny_dir, per_head):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(f"the {w} in a tin" for w in range(400)))
    out = tmp_path / "plan.json"
    cfg = PlanConfig(
        model=str(tiny_dir), corpus=str(corpus), kld_budget=0.01, ctx=64, calib_chunks=1, heldout_chunks=2,
        out=str(out), kv="q8", per_head=per_head,
    )  # fmt: skip
    r = run_plan(cfg)
    back = load_recipe(out)
    assert back.layers == r.recipe.layers and back.heads == r.recipe.heads and len(back.layers) == 2
    assert r.calib_kld <= 0.01 or r.rounds == SEARCH_ROUNDS
    rows = {x["kv"]: x for x in r.rows}
    assert set(rows) == {str(out), "q8"}
    assert rows[str(out)]["bytes_per_token"] == back.bytes_per_token(2, 2, 32)
    f16 = MODES["f16"].bytes_per_token(2, 2, 32)
    assert rows[str(out)]["vs_f16"] == pytest.approx(rows[str(out)]["bytes_per_token"] / f16)
    assert all(x["kld_mean"] >= 0 for x in rows.values())
