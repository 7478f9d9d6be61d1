"""A request whose own values go non-finite ends alone, with its error; the others in its batch run on
to the tokens they give alone, and every block goes back to the pool.

The failure is real in the first two tests (one token's embedding row set to NaN in memory, since a file
holding one is refused at load: K turns NaN at layer 0 wherever that token is fed, in prefill or in a
batched decode row) and injected in the third (at the last layer of one row, after an earlier row has
finished its step; a non-finite K/V, and a RuntimeError standing for a fault of the code)."""

from __future__ import annotations

import pytest
import torch
from engine_loop import steps_until_done
from tiny_models import write_hf

import kvlens
import kvlens.kv.pool
from kvlens.engine.scheduler import Engine, EngineConfig, Request, run_alone, run_batch
from kvlens.kv.cache import BLOCK, NonFiniteKVError
from kvlens.kv.pool import kv_bytes_per_token


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("fail") / "hf"
    write_hf("llama", out, seed=9)
    return out


def _load(model_dir):
    return kvlens.load(model_dir, kv="q8", attn_backend="numba", prefill_chunk=16)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(5, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(llm, blocks: int = 24) -> Engine:
    c = llm.config
    per_token = kv_bytes_per_token(llm.kv, c.n_layers, c.n_kv_heads, c.head_dim)
    return Engine(llm, EngineConfig(kv_budget_bytes=blocks * BLOCK * per_token, max_batch=4))


def _drive(engine: Engine, reqs: list[Request]) -> dict[str, list]:
    out: dict[str, list] = {r.request_id: [] for r in reqs}
    for r in reqs:
        engine.add_request(r)
    for _ in steps_until_done(engine, limit=500):
        for ev in engine.step():
            out[ev.request_id].append(ev)
    assert not engine.has_unfinished()
    assert engine.stats().blocks_used == 0 and engine.pool.blocks_free == engine.pool.n_blocks
    # every request's events end with exactly one finished event (the server's stream closes on it)
    assert all(
        [ev.finished for ev in events] == [False] * (len(events) - 1) + [True] for events in out.values()
    )
    return out


def _tokens(events: list) -> list[int]:
    return [e.token_id for e in events if e.token_id is not None]


def _poisoned(model_dir, token: int):
    llm = _load(model_dir)
    assert isinstance(llm.model.w.embed, torch.Tensor)
    llm.model.w.embed[token] = float("nan")
    return llm


def _first_request(rid: str, n: int, fits) -> Request:
    """The first of a few seeded prompts that ``fits`` accepts: the premise is checked on the machine
    the test runs on, since greedy tokens of a random tiny model may differ in near-ties between CPUs."""
    for seed in range(20):
        r = Request(rid, _prompt(n, 100 * n + seed), 6, stop_ids=frozenset())
        if fits(r):
            return r
    raise AssertionError(f"no prompt of {n} tokens fits the premise")


def _clean_alone(llm, r: Request) -> bool:
    try:
        list(run_alone(llm, r))
    except NonFiniteKVError:
        return False
    return True


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_a_request_gone_non_finite_ends_alone(model_dir, phase):
    clean = _load(model_dir)
    if phase == "prefill":  # b's prompt holds the poisoned token
        b = Request("b", _prompt(37, 2), 6, stop_ids=frozenset())
        poison = b.prompt_ids[20]
    else:  # the token b generates first: its prefill is clean, its first batched decode row is not
        b = _first_request("b", 37, lambda r: next(run_alone(clean, r)).token_id not in r.prompt_ids)
        poison = next(run_alone(clean, b)).token_id
    llm = _poisoned(model_dir, poison)
    a, c = (_first_request(rid, n, lambda r: _clean_alone(llm, r)) for rid, n in (("a", 21), ("c", 9)))
    want = {r.request_id: _tokens(list(run_alone(llm, r))) for r in (a, c)}  # alone, poisoned model
    out = _drive(_engine(llm), [a, b, c])
    assert {r: _tokens(out[r]) for r in ("a", "c")} == want
    (end,) = [e for e in out["b"] if e.finished]
    assert (end.finish_reason, type(end.error)) == ("error", NonFiniteKVError)
    assert "non-finite K value at layer 0" in str(end.error)
    assert _tokens(out["b"]) == ([] if phase == "prefill" else [poison])
    # alone, through the Python API, the same failure is raised, never a silently short output
    with pytest.raises(NonFiniteKVError, match="layer 0"):
        list(run_alone(llm, b))
    with pytest.raises(NonFiniteKVError, match="layer 0"):
        run_batch(llm, [a, b])


@pytest.mark.parametrize("fault_type", [NonFiniteKVError, RuntimeError])
def test_rows_that_finished_their_step_before_the_failure_run_it_again_alone(
    model_dir, monkeypatch, caplog, fault_type
):
    """The failure at the LAST layer of b's row, after a's row wrote its last layer (and so advanced its
    length): a is decoded again alone at the same position, and gives the tokens it gives alone. A
    fault that is not the input's doing (here a RuntimeError) is isolated the same way, and logged
    with its traceback."""
    llm = _load(model_dir)
    llm.fused_step = False  # every row through the general path (PagedKV.write, which the fault hooks)
    a, b = (
        Request("a", _prompt(21, 1), 6, stop_ids=frozenset()),
        Request("b", _prompt(37, 2), 6, stop_ids=frozenset()),
    )
    want = _tokens(list(run_alone(llm, a)))
    last, fail_at = llm.config.n_layers - 1, len(b.prompt_ids) + 2  # b's third decode row
    real = kvlens.kv.pool.check_kv_finite

    def fault(layer, start, k, v):
        if layer == last and start == fail_at:
            raise fault_type(f"injected at layer {layer}, position {start}")
        real(layer, start, k, v)

    monkeypatch.setattr(kvlens.kv.pool, "check_kv_finite", fault)
    with caplog.at_level("ERROR", logger="kvlens.engine"):
        out = _drive(_engine(llm), [a, b])
    assert _tokens(out["a"]) == want
    end = out["b"][-1]
    assert (end.finish_reason, type(end.error), len(_tokens(out["b"]))) == ("error", fault_type, 3)
    logged = [r for r in caplog.records if r.name == "kvlens.engine"]
    if fault_type is RuntimeError:  # a fault of the code, not of the input: its traceback is kept
        assert len(logged) == 1 and "request b failed" in logged[0].message and logged[0].exc_info
    else:
        assert not logged


def test_the_server_names_the_failure_of_that_request(model_dir):
    """The HTTP layer's side: a request's "error" event becomes an EngineFault (a 500, or an error
    event on a stream) that carries the engine's words, and the request is counted as an error."""
    import asyncio

    from kvlens.engine.scheduler import TokenEvent
    from kvlens.serve.async_engine import Timed
    from kvlens.serve.metrics import ServeMetrics
    from kvlens.serve.output import OutputText
    from kvlens.serve.runner import EngineFault, Job, Runner

    llm = _load(model_dir)
    metrics = ServeMetrics(lambda: None, lambda: 0)
    runner = Runner(llm, engine=None, metrics=metrics)
    error = NonFiniteKVError(
        "non-finite K value at layer 0, position 3; refusing to store it in the KV cache"
    )

    async def run() -> str:
        events: asyncio.Queue = asyncio.Queue()
        events.put_nowait(Timed(TokenEvent("r", None, None, None, True, "error", error=error), 0.0))
        job = Job("completions", Request("r", [5, 6, 7], 4), OutputText(llm.tokenizer, []), events, 0.0)
        with pytest.raises(EngineFault) as info:
            async for _ in runner.run(job):
                pass
        assert job.finish_reason == "error"
        return str(info.value)

    message = asyncio.run(run())
    assert message == f"the engine failed while running request r: {error}"
    assert metrics.requests.labels("completions", "error")._value.get() == 1
