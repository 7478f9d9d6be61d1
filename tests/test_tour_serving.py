"""The tour's serving step (``kvlens tour``'s last part; ``./setup.sh`` runs it on every fresh clone):
a real ``kvlens serve`` on a free loopback port and the real ``openai`` client. Its answers are the
greedy answers of the engine alone (batch invariance), its memory line follows from the pool's peak
blocks and the row layouts worked out here by hand, and a server that exits badly fails the step."""

from __future__ import annotations

import re

import pytest

import kvlens
from kvlens.kv.cache import BLOCK
from kvlens.serve import tour

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def printed() -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        tour.serving_step(max_tokens=MAX_TOKENS)
    return out.getvalue()


def test_the_answers_are_the_greedy_answers_alone(printed):
    llm = kvlens.load("smollm2", kv="q8", weights="auto")
    for q in tour.QUESTIONS:
        alone = llm.generate(q, MAX_TOKENS, chat=True).strip().replace("\n", "\n    ")
        assert f"  > {q}\n    {alone}\n" in printed


def test_the_memory_line_follows_from_the_peak_blocks(printed):
    cfg = kvlens.load("smollm2", kv="f16", weights="auto").config
    m = re.search(
        r"at peak (\d+) sequences ran at once in (\d+) blocks \((\d+) token positions\): ([\d.]+) MiB of "
        r"q8 KV, where f16 would take ([\d.]+) MiB",
        printed,
    )
    assert m is not None, printed
    running, blocks, tokens = (int(g) for g in m.groups()[:3])
    q8_mib, f16_mib = float(m.group(4)), float(m.group(5))
    assert 1 <= running <= len(tour.QUESTIONS) and blocks >= 1 and tokens == blocks * BLOCK
    hd, rows = cfg.head_dim, cfg.n_layers * cfg.n_kv_heads
    # q8: K rows hold hd int8 codes, an fp32 max_abs and an int16 code sum per 32 codes; V rows the
    # codes and the max_abs. f16: 2 bytes a value, K and V.
    q8_bytes, f16_bytes = rows * ((hd + 4 + 2 * (hd // 32)) + (hd + 4)), rows * 2 * hd * 2
    assert q8_mib == pytest.approx(tokens * q8_bytes / 2**20, abs=0.005)
    assert f16_mib == pytest.approx(tokens * f16_bytes / 2**20, abs=0.01)
    assert printed.splitlines()[0].startswith("KV pool") and printed.endswith("exit code 0\n")


class _BadExit:
    """A stand-in server that answers nothing and exits 3 on SIGTERM."""

    url = "http://127.0.0.1:9"

    def __init__(self, args):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def budget_line(self) -> str:
        return "KV pool: stand-in"

    def metrics(self) -> dict[str, float]:
        return {"kvlens_kv_block_size": 16.0, "kvlens_kv_bytes_per_token": 1.0,
                "kvlens_kv_tokens_capacity": 1.0, "kvlens_kv_f16_tokens_same_bytes": 2.0,
                "kvlens_kv_blocks_used_peak": 1.0, "kvlens_requests_running_peak": 1.0}  # fmt: skip

    def stop(self) -> int:
        return 3

    def output(self) -> str:
        return "the server's last words"


def test_a_server_that_exits_badly_fails_the_step(monkeypatch, capsys):
    async def answers(url, model, max_tokens):
        return ["x"] * len(tour.QUESTIONS)

    monkeypatch.setattr(tour, "ServerProcess", _BadExit)
    monkeypatch.setattr(tour, "_ask_all", answers)
    with pytest.raises(RuntimeError, match="exited with 3:\nthe server's last words"):
        tour.serving_step()
    assert "exit code 3" in capsys.readouterr().out
