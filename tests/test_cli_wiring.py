"""From the command line to each command's config: the options reach the config whole (a stand-in
``main`` records what it was given; nothing runs), the defaults are the documented ones, and a value
just past an option's limit is a usage error before anything loads."""

from __future__ import annotations

import pytest
from test_bad_input_cli import run_main
from test_bad_input_cli import test_bad_option_values_are_usage_errors_before_anything_runs as usage_error

from kvlens.bench import attention, decode
from kvlens.kv.blocks import SparseConfig
from kvlens.kv.modes import KVMode
from kvlens.lab import greedy, layers, ppl_report


def _config(monkeypatch, capsys, module, *args: str):
    seen = []
    monkeypatch.setattr(module, "main", lambda cfg, *rest: seen.append(cfg))
    code, _, err = run_main(monkeypatch, capsys, *args)
    assert code == 0 and len(seen) == 1, err
    return seen[0]


@pytest.mark.parametrize(("command", "module"), [("ppl", ppl_report), ("greedy", greedy)])
def test_compare_commands_pass_the_sparse_policy_whole(monkeypatch, capsys, command, module):
    args = ["lab", command, "--sparse", "probe", "--sparse-budget", "0.5", "--sparse-dense-layers", "3"]
    cfg = _config(monkeypatch, capsys, module, *args)
    assert cfg.sparse == SparseConfig("probe", 0.5, 3, 0)
    cfg = _config(monkeypatch, capsys, module, "lab", command, "--sparse", "quest")
    assert cfg.sparse == SparseConfig("quest", 0.25, 2, 0)  # the documented defaults
    cfg = _config(monkeypatch, capsys, module, "lab", command)
    assert cfg.sparse is None
    assert cfg.kv == [KVMode.parse(m) for m in ("q8", "q8-k", "q8-v", "f16")]
    assert (cfg.base, cfg.weights, cfg.prefill_chunk) == (KVMode.parse("f32"), "f32", 32)


def test_layers_default_modes(monkeypatch, capsys):
    cfg = _config(monkeypatch, capsys, layers, "lab", "layers")
    assert cfg.kv == [KVMode.parse(m) for m in ("q8", "q8-k", "q8-v", "f16")] and cfg.chunks == 1


def test_bench_attention_lists(monkeypatch, capsys):
    cfg = _config(monkeypatch, capsys, attention, "bench", "attention", "--sparse", "quest")
    assert cfg.ctx == [4096, 16384, 65536]  # sparse decode is measured from 4K on by default
    assert cfg.sparse == ["quest"] and cfg.sparse_budget == [1024, 2048]
    cfg = _config(monkeypatch, capsys, attention, "bench", "attention", "--ctx", "1k", "--sparse", "quest")
    assert cfg.ctx == [1024]
    cfg = _config(monkeypatch, capsys, attention, "bench", "attention")
    assert cfg.ctx == [1024, 4096, 16384, 65536] and cfg.sparse is None and cfg.backend is None


def test_bench_decode_lists(monkeypatch, capsys):
    cfg = _config(monkeypatch, capsys, decode, "bench", "decode", "--kv", "q8,f16", "--weights", "int8")
    assert (cfg.ctx, cfg.kv, cfg.weights, cfg.steps) == ([512, 2048, 4096], ["q8", "f16"], ["int8"], 12)


JUST_PAST = [
    (["lab", "ppl", "--ctx", "3"], "--ctx"),
    (["lab", "ppl", "--prefill-chunk", "0"], "--prefill-chunk"),
    (["lab", "greedy", "--ctx", "1"], "--ctx"),
    (["lab", "layers", "--chunks", "0"], "--chunks"),
    (["lab", "unit", "--head-dim", "1"], "--head-dim"),
    (["lab", "sweep", "x.toml", "--workers", "-1"], "--workers"),
    (["bench", "decode", "--steps", "2"], "--steps"),
    (["bench", "serve", "--rate", "0"], "--rate"),
    (["bench", "serve", "--concurrency", "0"], "--concurrency"),
]


@pytest.mark.parametrize(("args", "option"), JUST_PAST, ids=[" ".join(a) for a, _ in JUST_PAST])
def test_a_value_just_past_the_limit_is_a_usage_error(monkeypatch, capsys, args, option):
    usage_error(monkeypatch, capsys, args, option)


def test_bench_serve_lists(monkeypatch, capsys):
    from kvlens.bench import serve

    cfg = _config(monkeypatch, capsys, serve, "bench", "serve")
    assert cfg.concurrency == [1, 4, 8, 16]  # the documented default of the throughput scenario
    assert cfg.kv == ["q8", "f16"] and cfg.arms == ["no-cache", "cache", "disk"]
    cfg = _config(monkeypatch, capsys, serve, "bench", "serve", "--concurrency", "2,8")
    assert cfg.concurrency == [2, 8]


def test_lab_sweep_passes_its_options_in_place(monkeypatch, capsys):
    from kvlens.lab import sweep

    seen = []
    monkeypatch.setattr(sweep, "cli", lambda *args: seen.append(args))
    code, _, err = run_main(monkeypatch, capsys, "lab", "sweep", "s.toml", "--force", "--workers", "0")
    assert code == 0, err
    assert seen == [("s.toml", None, 0, None, False, None, True, False)]  # 0 workers: in-process
    run_main(monkeypatch, capsys, "lab", "sweep", "s.toml", "--quiet", "--ray-address", "auto")
    assert seen[-1] == ("s.toml", None, None, None, False, "auto", False, True)
