"""Every one-token decode step runs under the decode thread policy (kernels.threads.decode_threads: the
cores other processes leave free, the steadiness fix of issue 11), fused or not, its logits too; a
prefill and the logits of many rows do not (they use every thread). The serving engine's steps (what
`generate`, `generate_batch` and the server run) had not entered it at all, only `LLM.forward`'s, which
`bench decode` times; and no test held the wiring: turning the policy off everywhere passed the suite
(a mutation run, forty-seventh session)."""

from __future__ import annotations

import contextlib

import numba
import pytest
import torch

import kvlens
import kvlens.engine.llm as llm_module

TINY_MODEL = ("llama", 5)  # conftest's tiny_dir


@pytest.fixture
def entered(monkeypatch):
    """How many times the decode thread policy was entered."""
    count = [0]

    @contextlib.contextmanager
    def counting():
        count[0] += 1
        yield 1

    monkeypatch.setattr(llm_module, "decode_threads", counting)
    return count


@pytest.mark.parametrize("fused_step", [True, False])
@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_decode_steps_and_only_they_run_under_the_decode_thread_policy(
    tiny_dir, entered, fused_step, backend
):
    llm = kvlens.load(tiny_dir, kv="q8", attn_backend=backend).variant(fused_step=fused_step)
    cache = llm.new_cache(16)
    hidden = llm.forward([5, 17, 42, 99], cache, 0, prefill=True)
    llm.lm_head(hidden)
    assert entered[0] == 0  # a prefill and its four rows of logits: every thread
    hidden = llm.forward([7], cache, 4, prefill=False)
    steps = entered[0]
    assert steps >= 1  # once, or twice where the fused step declines and the general path runs
    llm.lm_head(hidden)
    assert entered[0] == steps + 1


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_the_serving_engines_steps_run_under_it_too(tiny_dir, entered, backend, monkeypatch):
    from kvlens.engine.model_runner import ModelRunner
    from kvlens.engine.scheduler import run_batch
    from kvlens.engine.sequence import Request

    steps = [0]
    decode = ModelRunner.decode

    def counted(self, *args):
        steps[0] += 1
        return decode(self, *args)

    monkeypatch.setattr(ModelRunner, "decode", counted)
    llm = kvlens.load(tiny_dir, kv="q8", attn_backend=backend)
    assert llm.servable
    out = list(llm.generate_ids([5, 17, 42, 99], 4, stop_at_eos=False))  # the engine, a batch of one
    assert len(out) == 4 and steps[0] == entered[0] == 3  # the first token comes from the prefill
    reqs = [Request(r, ids, 5, stop_ids=frozenset()) for r, ids in (("a", [5, 17]), ("b", [9, 8, 7, 6, 5]))]
    run_batch(llm, reqs)  # steps of two rows, and of one
    assert steps[0] == entered[0] > 3


@pytest.fixture(scope="module")
def long_dir(tmp_path_factory):
    """The tiny Qwen3 (head_dim 32, as the integer backends need) with a context long enough for attention to be split over threads (n_kv * rows
    past kernels.flash.SERIAL_ROWS)."""
    from tiny_models import write_hf

    out = tmp_path_factory.mktemp("long") / "hf"
    write_hf("qwen3", out, seed=5, max_position_embeddings=2048)
    return out


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs two numba threads")
@pytest.mark.parametrize("backend", ["numba", "numba-int"])
def test_a_busy_engine_step_gives_the_quiet_steps_logits(long_dir, monkeypatch, backend):
    """Under the policy a step on a busy machine runs on fewer threads but divides its work for the
    same count, so the serving engine's logits are the quiet machine's, bit for bit, for a batch of
    two rows (decode_rows) and of one (the fused step)."""
    from test_steady import busy_machine

    from kvlens.engine.model_runner import ModelRunner
    from kvlens.engine.scheduler import run_batch
    from kvlens.engine.sequence import Request
    from kvlens.kernels import threads

    logits: list[torch.Tensor] = []
    decode = ModelRunner.decode
    monkeypatch.setattr(ModelRunner, "decode", lambda self, *a: logits.append(decode(self, *a)) or logits[-1])
    llm = kvlens.load(long_dir, kv="q8", attn_backend=backend)
    prompts = [[(7 * i + 3) % 200 + 1 for i in range(1200)], [(5 * i + 1) % 200 + 1 for i in range(1300)]]

    def run() -> list[torch.Tensor]:
        logits.clear()
        run_batch(llm, [Request(str(i), p, 16 - 10 * i, stop_ids=frozenset()) for i, p in enumerate(prompts)])
        return list(logits)

    numba.set_num_threads(2)
    try:
        monkeypatch.setattr(threads, "_user_count", False)
        quiet = run()
        busy_machine(monkeypatch)
        with threads.decode_threads() as n:
            assert n == 1  # what each step of the busy run gets
        busy = run()
    finally:
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    assert len(busy) == len(quiet) >= 5 and {x.shape[0] for x in quiet} == {1, 2}
    assert all(torch.equal(b, q) for b, q in zip(busy, quiet, strict=True))
