"""``kvlens bench engine``: what a round times (every sequence one token per timed step), how rounds
interleave the cells and drop the warm-up, the ratios paired by round, the pool bytes against the
cache's own arithmetic, the refusals, and the command end to end."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
from test_bad_input_cli import assert_one_error_line, run_main
from test_bad_input_cli import test_bad_option_values_are_usage_errors_before_anything_runs as usage_error
from test_cli_wiring import _config as cli_config

from kvlens.bench import engine_decode
from kvlens.bench.engine_decode import LOOP, EngineBenchConfig, EngineRow, with_ratios
from kvlens.kv.cache import BLOCK


def _clock(monkeypatch, *times: float) -> None:
    """The module's clock reads ``times`` in turn (only the module's: numba and torch keep theirs)."""
    ticks = iter(times)
    monkeypatch.setattr(engine_decode, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))


def _prompts(llm, batch: int, length: int) -> list[list[int]]:
    ids = llm.tokenizer.encode(
        "The printing press changed how books were made and read. " * 20, add_bos=False
    )
    return [ids[b : b + length] for b in range(batch)]


@pytest.mark.parametrize(("batch", "steps"), [(1, 3), (3, 4)])
def test_a_round_times_steps_that_feed_every_sequence(monkeypatch, smol_f32, batch, steps):
    llm = smol_f32.variant(attn_backend="numba", kv="q8")
    _clock(monkeypatch, 10.0, 12.0)  # the timed steps took 2 s on the stand-in clock
    assert engine_decode.engine_round(llm, _prompts(llm, batch, 9), steps) == batch * steps / 2.0


def test_the_loop_round_times_the_tokens_after_the_prefills(monkeypatch, smol_f32):
    _clock(monkeypatch, 0.0, 4.0)
    assert engine_decode.loop_round(smol_f32, _prompts(smol_f32, 1, 9)[0], 5) == 5 / 4.0


def _f16_bytes(cfg, positions: int) -> int:
    """K and V, 2 bytes a value, every layer and KV head: an f16 cache's bytes, by hand."""
    return positions * 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 2


def test_rounds_visit_every_cell_and_drop_the_warm_up(monkeypatch, smol_f32):
    llms = {"f16": smol_f32.variant(kv="f16"), "q8": smol_f32.variant(kv="q8")}
    calls, rate = [], iter(range(1, 100))

    def engine(llm, prompts, steps):
        calls.append((str(llm.kv), len(prompts), prompts[0], steps))
        return float(next(rate))

    def loop(llm, prompt, steps):
        calls.append((str(llm.kv), LOOP, prompt, steps))
        return float(next(rate))

    monkeypatch.setattr(engine_decode, "engine_round", engine)
    monkeypatch.setattr(engine_decode, "loop_round", loop)
    cfg = EngineBenchConfig(kv=["f16", "q8"], batches=[1, 2], prompt_len=5, steps=3, rounds=3)
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    labels = []
    rows = engine_decode.run_engine_bench(cfg, llms, prompts, labels.append)
    cells = [("f16", LOOP), ("f16", 1), ("f16", 2), ("q8", LOOP), ("q8", 1), ("q8", 2)]
    assert [(kv, b) for kv, b, _, _ in calls] == cells * 4 and labels == [
        "warm-up",
        "round 1",
        "round 2",
        "round 3",
    ]
    assert all(p == prompts[0] and s == 3 for _, _, p, s in calls)
    assert [(r.kv, r.batch) for r in rows] == cells
    for i, r in enumerate(rows):  # the warm-up's rates 1..6 are not counted
        assert r.round_tok_s == [7.0 + i, 13.0 + i, 19.0 + i] and r.tok_s == 13.0 + i
    cfg16 = smol_f32.config
    by = {(r.kv, r.batch): r for r in rows}
    assert by[("f16", LOOP)].kv_bytes == _f16_bytes(cfg16, 5 + 3 + 1)
    assert by[("f16", 2)].kv_bytes == 2 * _f16_bytes(cfg16, math.ceil((5 + 3 + 2) / BLOCK) * BLOCK)


def _row(kv: str, batch, rates: list[float]) -> EngineRow:
    return EngineRow(kv, batch, rates, 0)


def test_ratios_are_medians_of_the_ratios_within_each_round():
    rows = with_ratios(
        [
            _row("q8", 1, [10.0, 20.0, 10.0]),
            _row("q8", 4, [30.0, 30.0, 40.0]),  # over batch 1 by round: 3, 1.5, 4 -> 3
            _row("f16", 1, [20.0, 10.0, 5.0]),  # over q8 by round: 2, 0.5, 0.5 -> 0.5
            _row("f16", 4, [60.0, 15.0, 20.0]),  # over f16 batch 1: 3, 1.5, 4; over q8 batch 4: 2, 0.5, 0.5
            _row("f16", LOOP, [1.0, 1.0, 1.0]),  # no q8 loop row to compare with
        ]
    )
    got = [(r.x_batch1, r.x_first_kv) for r in rows]
    assert got == [(1.0, 1.0), (3.0, 1.0), (1.0, 0.5), (3.0, 0.5), (pytest.approx(0.1), None)]


def test_ratios_of_rows_whose_rounds_do_not_pair_fall_back_to_the_medians():
    rows = with_ratios([_row("q8", 1, [10.0, 30.0]), _row("q8", 2, [40.0, 40.0, 100.0])])
    assert rows[1].x_batch1 == pytest.approx(40.0 / 20.0)


BAD_CONFIGS = [
    ({"kv": []}, "--kv"),
    ({"kv": ["q8", "q8"]}, "twice"),
    ({"kv": ["q9"]}, "q9"),
    ({"weights": "int3"}, "int3"),
    ({"batches": []}, "--batches"),
    ({"batches": [0]}, "--batches"),
    ({"batches": [engine_decode.MAX_BATCH + 1]}, "--batches"),
    ({"steps": 0}, "steps"),
    ({"rounds": 0}, "rounds"),
    ({"prompt_len": 0}, "prompt-len"),
]


@pytest.mark.parametrize(("changes", "needle"), BAD_CONFIGS, ids=[str(c) for c, _ in BAD_CONFIGS])
def test_bad_configs_are_refused_by_name(changes, needle):
    with pytest.raises(ValueError, match=needle):
        EngineBenchConfig(**changes)


def test_the_last_valid_batch_size_is_taken():
    assert EngineBenchConfig(batches=[1, engine_decode.MAX_BATCH]).batches == [1, engine_decode.MAX_BATCH]


def test_the_cli_builds_the_documented_config(monkeypatch, capsys):
    cfg = cli_config(monkeypatch, capsys, engine_decode, "bench", "engine")
    assert (cfg.kv, cfg.batches, cfg.prompt_len, cfg.steps, cfg.rounds, cfg.loop) == (
        ["q8", "f16"], [1, 4, 8, 16], 64, 16, 5, True,
    )  # fmt: skip
    cfg = cli_config(monkeypatch, capsys, engine_decode, "bench", "engine", "--batches", "2,3", "--no-loop")
    assert (cfg.batches, cfg.loop) == ([2, 3], False)
    usage_error(monkeypatch, capsys, ["bench", "engine", "--batches", "0"], "--batches")
    usage_error(monkeypatch, capsys, ["bench", "engine", "--rounds", "0"], "--rounds")


def test_a_prompt_past_the_context_is_one_error_line(monkeypatch, capsys):
    code, out, err = run_main(monkeypatch, capsys, "bench", "engine", "--prompt-len", "8175", "--steps", "16")
    assert_one_error_line(
        code, out, err, "8175 + --steps 16 + 2 = 8193 positions do not fit in the model's context of 8192"
    )


def test_the_command_prints_its_rows_as_json(monkeypatch, capsys, smol_f32):
    args = ["bench", "engine", "--kv", "f16,q8", "--batches", "2", "--steps", "2", "--rounds", "1"]
    code, out, err = run_main(monkeypatch, capsys, *args, "--prompt-len", "8", "--json")
    assert code == 0, err
    rows = json.loads(out)
    assert [(r["kv"], r["batch"]) for r in rows] == [("f16", LOOP), ("f16", 2), ("q8", LOOP), ("q8", 2)]
    assert all(r["tok_s"] > 0 and len(r["round_tok_s"]) == 1 for r in rows)
    assert [r["x_first_kv"] for r in rows[:2]] == [1.0, 1.0] and rows[1]["x_batch1"] is None
    assert rows[1]["kv_bytes"] == 2 * _f16_bytes(smol_f32.config, math.ceil(12 / BLOCK) * BLOCK)


def test_the_machine_is_sampled_after_each_counted_round(monkeypatch, smol_f32):
    events = []
    monkeypatch.setattr(
        engine_decode, "engine_round", lambda llm, prompts, steps: events.append("cell") or 1.0
    )
    probe = SimpleNamespace(sample=lambda: events.append("probe"))
    cfg = EngineBenchConfig(kv=["f16"], batches=[1, 2], loop=False, rounds=2)
    engine_decode.run_engine_bench(cfg, {"f16": smol_f32}, [[1, 2], [3, 4]], lambda label: None, probe)
    assert events == ["cell", "cell"] + ["cell", "cell", "probe"] * 2
