"""``kvlens bench decode`` at a toy context: weight modes, the time split, and the llama-bench driver
(a stand-in script that records its arguments and prints llama-bench's JSON report)."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import psutil
import pytest

import kvlens
from kvlens.bench import llama_cpp
from kvlens.bench.bandwidth import MachineProbe, MiB
from kvlens.bench.decode import TABLE_HEADERS, run_decode_bench, table_rows
from kvlens.bench.decode_rows import machine_caption
from kvlens.bench.spread import MachineSpread, spread
from kvlens.corpus import load_corpus

FAKE = """#!{python}
import json, sys
open({log!r}, "a").write(json.dumps(sys.argv[1:]) + "\\n")
if {fail}:
    print("error: unknown model architecture", file=sys.stderr)
    sys.exit(1)
a = sys.argv
print("some banner line")
print(json.dumps([{{"type_k": a[a.index("-ctk") + 1], "type_v": a[a.index("-ctv") + 1],
    "n_depth": int(a[a.index("-d") + 1]), "n_gen": int(a[a.index("-n") + 1]),
    "n_threads": int(a[a.index("-t") + 1]), "avg_ts": 42.5, "stddev_ts": 0.5}}]))
"""


def fake_llama_bench(tmp_path: Path, fail: bool = False) -> tuple[Path, Path]:
    log = tmp_path / "args.jsonl"
    exe = tmp_path / "llama-bench"
    exe.write_text(FAKE.format(python=sys.executable, log=str(log), fail=fail))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe, log


@pytest.fixture(scope="module")
def int8_llm():
    return kvlens.load("smollm2", kv="q8", weights="int8")


def test_rows_weights_split_and_llama_cpp(tmp_path, smol_f32, int8_llm):
    exe, log = fake_llama_bench(tmp_path)
    probe = MachineProbe(n_bytes=64 * MiB, reps=1, arith_iters=1000, sync_reps=10)
    probe.sample()  # an earlier context's sample, made far from any of this one's: no row may count it
    probe.reads[0], probe.ariths[0], probe.syncs[0] = 1e6, 1e6, 1e6
    rows = run_decode_bench(
        [smol_f32, int8_llm], [64], ["f16", "q8", "q8-k"], steps=3, with_hf=False, llama_bench=str(exe),
        rounds=3, step_kinds=("fused", "general"), probe=probe,
    )  # fmt: skip
    # the RSS column is the model's and caches' memory, not the probe's 64 MiB buffer (resident all along;
    # the 64-position caches freed since are a few hundred KiB)
    rss_now = psutil.Process().memory_info().rss
    assert all(r.rss_bytes <= rss_now - probe.nbytes + 16 * MiB for r in rows if r.engine == "kvlens")
    ours = [r for r in rows if r.engine == "kvlens"]
    assert {(r.weights, r.mode, r.step) for r in ours} == {
        (w, m, k) for w in ("f32", "int8") for m in ("f16", "q8", "q8-k") for k in ("fused", "general")
    }
    for r in ours:
        assert r.ctx == 64 and r.tok_per_s > 0 and r.ms_per_tok == pytest.approx(1e3 / r.tok_per_s)
        assert r.weights_ms > 0 and r.other_ms >= 0
        if r.step == "fused" and r.backend == "numba":  # one call per layer (LM head outside): no split
            assert r.attn_ms is None and r.layers_ms > 0
            assert r.layers_ms + r.weights_ms + r.other_ms == pytest.approx(r.ms_per_tok)
        else:  # the general path, and the torch backend (smol_f32) has no fused step
            assert r.layers_ms is None and 0 < r.kv_write_ms <= r.attn_ms
            assert r.weights_ms + r.attn_ms + r.other_ms == pytest.approx(r.ms_per_tok)  # one step's parts
        assert r.rounds == 3 and r.tok_per_s_min <= r.tok_per_s <= r.tok_per_s_max  # the median round
        assert r.as_dict()["spread"] == pytest.approx(r.tok_per_s_max / r.tok_per_s_min - 1)
        # the machine's read bandwidth and arithmetic rate, sampled once after each of this context's rounds, the same for every row
        assert len(probe.reads) == len(probe.ariths) == len(probe.syncs) == 4 and min(probe.syncs) > 0
        # and a read of the step's own bytes (its weights and its whole cache) after each round: one a
        # size, shared by the two step kinds
        own = {"f32": smol_f32, "int8": int8_llm}[r.weights].step_weight_bytes + r.kv_bytes
        assert [i for i, _ in probe.sized[own]] == [1, 2, 3]
        own_read = spread([gbs for _, gbs in probe.sized[own]])
        ours_only = (spread(probe.reads[1:]), spread(probe.ariths[1:]), spread(probe.syncs[1:]))
        assert r.machine == MachineSpread(*ours_only, own_read, own)
    assert len(probe.sized) == 6  # 2 weights x 3 KV modes
    caption = machine_caption(rows)
    assert "ctx 64: memory read" in caption and all(f", {n} " in caption for n in ("arithmetic", "fork/join"))
    assert caption.count("read of its own") == len(ours)  # once a row, not in the context's line
    r = next(r for r in ours if (r.weights, r.mode, r.step) == ("int8", "q8", "general"))
    assert f"int8 q8 general ctx 64: read of its own {r.machine.own_bytes / 1e6:.0f} MB " in caption
    assert "not sampled" in machine_caption([])
    by = {(r.weights, r.mode): r for r in ours}
    # every layer and KV head, 64 positions; a row of head_dim = 64 values: f16 2 bytes a value; q8 1 byte
    # a value + a 4-byte max_abs, and K also its int16 code sums per 32 values (the integer kernels')
    cfg = smol_f32.config
    rows_64 = cfg.n_layers * cfg.n_kv_heads * 64
    assert by["int8", "f16"].kv_bytes == rows_64 * 2 * (64 * 2)
    assert by["int8", "q8"].kv_bytes == rows_64 * ((64 + 4 + 2 * 2) + (64 + 4))
    kv_mib = [cells[TABLE_HEADERS.index("KV MiB")] for cells in table_rows(ours[:1], "f16")]
    assert kv_mib == [f"{ours[0].kv_bytes / 2**20:.1f}"]  # MiB, not MB
    # llama.cpp: one run per KV mode with a twin (q8-k has none), same depth and threads
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == 2
    for args, t in zip(calls, ("f16", "q8_0"), strict=True):
        flag = {args[i]: args[i + 1] for i in range(0, len(args) - 1) if args[i].startswith("-")}
        assert flag["-ctk"] == flag["-ctv"] == t and flag["-d"] == "63" and flag["-fa"] == "1"
        assert flag["-m"] == str(smol_f32.source) and flag["-o"] == "json" and flag["-p"] == "0"
    lc = {r.mode: r for r in rows if r.engine == "llama.cpp"}
    assert set(lc) == {"f16", "q8"} and lc["q8"].tok_per_s == 42.5
    assert lc["q8"].rss_bytes >= 4 * MiB  # the stand-in is a Python process: getrusage's KiB made bytes
    assert lc["q8"].kv_bytes == 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 64 * 34 // 32
    assert all(r.spread is None for r in rows if r.engine != "kvlens")  # one figure, no rounds
    table = table_rows(rows, "f16")
    assert all(len(r) == len(TABLE_HEADERS) for r in table)
    col_base, col_lcpp = TABLE_HEADERS.index("× base KV"), TABLE_HEADERS.index("× llama.cpp")
    for r, cells in zip(rows, table, strict=True):
        if r.engine == "kvlens" and r.mode == "f16":
            assert cells[col_base] == "1.00"
        if r.engine == "kvlens" and r.mode == "q8":
            assert float(cells[col_lcpp]) == pytest.approx(r.tok_per_s / 42.5, abs=0.01)


def test_a_step_reads_every_matrix_and_norm_and_the_head_once(smol_f32, int8_llm):
    """The weight bytes of one decode step, counted from the config: per layer the fused QKV, O,
    gate/up and down matrices and two norms, then the final norm and the (tied) LM head; f32 weights 4
    bytes a value, int8 ones a byte a value and a 4-byte scale per 32 inputs, rows in tiles of 64."""
    cfg = smol_f32.config
    h, d = cfg.hidden, cfg.head_dim
    mats = [((cfg.n_heads + 2 * cfg.n_kv_heads) * d, h), (h, cfg.n_heads * d), (2 * cfg.ffn, h), (h, cfg.ffn)]
    norms = (2 * cfg.n_layers + 1) * h
    assert smol_f32.step_weight_bytes == 4 * (
        cfg.n_layers * sum(n * k for n, k in mats) + norms + cfg.vocab * h
    )

    def int8(n: int, k: int) -> int:
        return -(-n // 64) * 64 * (k + 4 * -(-k // 32))

    layers = cfg.n_layers * sum(int8(n, k) for n, k in mats)
    assert int8_llm.step_weight_bytes == layers + 4 * norms + int8(cfg.vocab, h)


def test_llama_bench_failures(tmp_path):
    exe, _ = fake_llama_bench(tmp_path, fail=True)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(llama_cpp.LlamaBenchError, match="exited with 1.*unknown model architecture"):
        llama_cpp.run_llama_bench(exe, gguf, "q8", 64, 4, 1)
    with pytest.raises(llama_cpp.LlamaBenchError, match="not found"):
        llama_cpp.run_llama_bench(tmp_path / "nope", gguf, "q8", 64, 4, 1)
    with pytest.raises(llama_cpp.LlamaBenchError, match="GGUF"):
        llama_cpp.run_llama_bench(exe, tmp_path, "q8", 64, 4, 1)
    for mode in ("q8+mirror", "f32"):  # no llama-bench twin (it has no f32 cache type)
        assert llama_cpp.run_llama_bench(exe, gguf, mode, 64, 4, 1) is None
    for text in ("", "no json here", "[]", '[{"avg_ts": 1}]'):
        with pytest.raises(llama_cpp.LlamaBenchError):
            llama_cpp.parse_report(text)


def test_several_backends_run_the_modes_each_can_read():
    """``--attn-backend numba,numba-int``: an integer backend runs only the modes whose K it scores
    (numba-int: int8 or 4-bit K; numba-int16: int8 K), and the table names each row's backend, the
    × base column over the first backend's base row."""

    from kvlens.bench.decode import backend_reads
    from kvlens.bench.decode_rows import DecodeRow

    cases = {
        "numba": (True, True, True),
        "numba-int": (True, True, False),
        "numba-int16": (True, False, False),
    }
    for backend, want in cases.items():
        assert tuple(backend_reads(backend, m) for m in ("q8h", "k=q4h,v=f16", "f16")) == want, backend
    rows = [
        DecodeRow("kvlens", "auto", m, 8192, tps, 1e3 / tps, 1, 1, b, "fused")
        for m, tps, b in (("q8", 20.0, "numba"), ("q4h", 25.0, "numba-int"), ("q8", 10.0, "numba-int"))
    ]
    table = table_rows(rows, "q8")
    assert [r[2] for r in table] == ["q8 (numba)", "q4h (numba-int)", "q8 (numba-int)"]
    assert [r[9] for r in table] == ["1.00", "1.25", "0.50"]


def test_the_ratio_to_the_base_mode_pairs_the_rounds():
    """× base KV is the median of the same-round ratios (the rounds interleave the modes): a machine
    that ran fast for one round moves both rows of that round, not the ratio. Without rounds on both
    sides (llama.cpp's one figure, a different count), the ratio of the medians."""
    from kvlens.bench.decode_rows import DecodeRow, speed_ratio

    def row(mode: str, rounds: list[float] | None) -> DecodeRow:
        median = sorted(rounds)[len(rounds) // 2] if rounds else 10.0
        return DecodeRow("kvlens", "auto", mode, 8192, median, 1e3 / median, 1, 1, "numba", "fused",
                         round_tok_per_s=rounds)  # fmt: skip

    base, other = row("q8", [10.0, 20.0, 30.0]), row("q4h", [11.0, 10.0, 33.0])
    assert speed_ratio(other, base) == pytest.approx(1.1)  # ratios 1.1, 0.5, 1.1
    assert other.tok_per_s / base.tok_per_s == pytest.approx(0.55)  # what the medians alone say
    assert [r[9] for r in table_rows([base, other], "q8")] == ["1.00", "1.10"]
    assert speed_ratio(row("q4h", None), base) == pytest.approx(10.0 / 20.0)
    assert speed_ratio(row("q4h", [5.0, 40.0]), base) == pytest.approx(40.0 / 20.0)


def test_a_timed_step_is_the_median_after_warm_up_at_the_cache_end(int8_llm, monkeypatch):
    """time_decode on a scripted clock: each forward takes the next duration; the first two (warm-up)
    are not timed, the result is the median of the rest, and every step starts at ``pos`` with the
    cache rewound to ``pos`` rows."""
    from kvlens.bench import decode

    now, durations, seen = [0.0], [100.0, 100.0, 4.0, 1.0, 5.0, 3.0, 2.0], []
    forward = int8_llm.forward

    def scripted(ids, cache, start, **kw):
        seen.append((start, cache.length))
        now[0] += durations[len(seen) - 1]
        return forward(ids, cache, start, **kw)

    cache = int8_llm.new_cache(16, "q8")
    int8_llm.prefill(list(range(1, 11)), cache)
    monkeypatch.setattr(int8_llm, "forward", scripted)
    monkeypatch.setattr(decode.time, "perf_counter", lambda: now[0])
    step = decode.time_decode(int8_llm, cache, 10, 5, int8_llm.attn_backend)
    assert step[0] == 3.0 and seen == [(10, 10)] * 7 and cache.length == 10


def test_the_bench_times_the_step_that_attends_exactly_ctx(int8_llm, monkeypatch):
    """At ctx 40 the caches hold 39 corpus positions and each timed step runs at position 39."""
    from kvlens.bench.decode import corpus_ids

    ids = corpus_ids(int8_llm, 39)
    assert len(ids) == 39 and ids == int8_llm.tokenizer.encode(load_corpus(None)[0])[:39]
    steps, forward = [], type(int8_llm).forward

    def spy(self, ids, cache, start, prefill=True, **kw):
        if not prefill:
            steps.append((start, cache.length))
        return forward(self, ids, cache, start, prefill, **kw)

    monkeypatch.setattr(type(int8_llm), "forward", spy)
    rows = run_decode_bench([int8_llm], [40], ["q8"], steps=2, with_hf=False, rounds=1)
    assert [r.ctx for r in rows] == [40] and steps == [(39, 39)] * 4  # 2 warm-up + 2 timed
