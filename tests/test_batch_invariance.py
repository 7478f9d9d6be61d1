"""Batch invariance: a request's tokens and logits do not depend on what else the engine runs.

The reference for "alone" is the same request run by itself (``LLM.generate_ids`` / ``run_alone``);
the batched runs must match it bit for bit. The row kernels are also held to a float64 reference,
so "bit-identical" cannot hold by both sides being equally wrong.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import write_hf

import kvlens
from kvlens.engine.scheduler import Engine, EngineConfig, Request, run_alone
from kvlens.models.qlinear import BF16Linear, Int4Linear, Int8Linear, linear, linear_rows

EPS = 2.0**-24
KINDS = {"f32": None, "bf16": BF16Linear, "int8": Int8Linear, "int4": Int4Linear}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("n,k", [(200, 96), (70, 45)])  # 45: odd k, a ragged last group
def test_linear_rows_each_row_as_alone_and_near_float64(kind, n, k):
    g = torch.Generator().manual_seed(n + k)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    layer = w if KINDS[kind] is None else KINDS[kind].from_float(w)
    deq = w if KINDS[kind] is None else layer.dequantize()
    for m in (2, 5, 16):
        x = torch.randn(m, k, generator=g)
        rows = linear_rows(x, layer, b)
        alone = torch.cat([linear(x[i : i + 1], layer, b) for i in range(m)])
        assert torch.equal(rows, alone), f"{kind}: a row's result depends on the batch (m={m})"
        ref = x.double() @ deq.double().T + b.double()
        mag = x.abs().double() @ deq.abs().double().T
        assert ((rows.double() - ref).abs() <= 2 * k * EPS * mag + 1e-6).all()


TINY_MODEL = ("llama", 3)  # conftest's tiny_dir


@pytest.fixture(scope="module", params=["f32", "q8"])
def tiny_llm(request, tiny_dir):
    # prefill chunk 16: prompts of up to 40 tokens take several chunks
    return kvlens.load(tiny_dir, kv=request.param, attn_backend="numba", prefill_chunk=16)


def _alone(llm, req: Request) -> list:
    return list(run_alone(llm, req, EngineConfig(kv_budget_bytes=1 << 22, keep_logits=True)))


def _together(llm, reqs: list[Request], config: EngineConfig) -> dict[str, list]:
    engine = Engine(llm, config)
    for r in reqs:
        engine.add_request(r)
    out: dict[str, list] = {r.request_id: [] for r in reqs}
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        for ev in engine.step():
            out[ev.request_id].append(ev)
    assert engine.stats().blocks_used == 0
    return out


def _requests(lengths: list[int], new: list[int]) -> list[Request]:
    g = torch.Generator().manual_seed(sum(lengths))
    return [
        Request(str(i), torch.randint(5, 300, (n,), generator=g).tolist(), t, stop_ids=frozenset())
        for i, (n, t) in enumerate(zip(lengths, new, strict=True))
    ]


def _assert_same(alone: list, batched: list, rid: str) -> None:
    assert [e.token_id for e in batched] == [e.token_id for e in alone], f"request {rid}: tokens differ"
    for i, (a, b) in enumerate(zip(alone, batched, strict=True)):
        assert torch.equal(a.logits, b.logits), f"request {rid}: logits of token {i} differ"


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.integers(1, 40), min_size=8, max_size=10),
    budget=st.sampled_from([16, 48]),
)
def test_concurrent_greedy_requests_equal_alone(tiny_llm, lengths, budget):
    reqs = _requests(lengths, [4 + n % 7 for n in lengths])
    config = EngineConfig(kv_budget_bytes=1 << 22, prefill_token_budget=budget, keep_logits=True)
    batched = _together(tiny_llm, reqs, config)
    for r in reqs:
        _assert_same(_alone(tiny_llm, r), batched[r.request_id], r.request_id)


def test_generate_is_the_engine_alone(tiny_llm):
    """``LLM.generate_ids`` (what ``kvlens generate`` runs) is the batch-of-one engine run."""
    (req,) = _requests([21], [9])
    ids = list(tiny_llm.generate_ids(req.prompt_ids, 9, stop_at_eos=False))
    assert ids == [e.token_id for e in _alone(tiny_llm, req)]


def test_seeded_sampling_is_per_request(tiny_llm):
    reqs = _requests([5, 9, 13, 30], [8, 8, 8, 8])
    for i, r in enumerate(reqs):
        r.sampling = kvlens.SamplingParams(temperature=1.5, top_p=0.95, seed=100 + i)
    batched = _together(tiny_llm, reqs, EngineConfig(kv_budget_bytes=1 << 22, keep_logits=True))
    for r in reqs:
        _assert_same(_alone(tiny_llm, r), batched[r.request_id], r.request_id)


def test_generate_batch_outputs_in_order(tiny_llm):
    prompts = ["the cat", "hello there, the", "a"]
    assert tiny_llm.generate_batch(prompts, max_new_tokens=6) == [
        tiny_llm.generate(p, max_new_tokens=6) for p in prompts
    ]
    with pytest.raises(TypeError):
        tiny_llm.generate_batch("not a list")


@pytest.mark.slow
def test_smollm2_concurrent_requests_equal_alone(smol_loaded):
    from conftest import PROMPTS

    llm = kvlens.LLM(smol_loaded, kv="q8")
    reqs = [
        Request(str(i), llm.tokenizer.encode(p), 6 + 2 * i, stop_ids=frozenset())
        for i, p in enumerate(PROMPTS)
    ]
    batched = _together(llm, reqs, EngineConfig(kv_budget_bytes=64 << 20, keep_logits=True))
    for r in reqs:
        _assert_same(_alone(llm, r), batched[r.request_id], r.request_id)


@pytest.mark.parametrize("row_ops", [True, False])
def test_qk_norm_glue_is_batch_invariant(tmp_path, row_ops):
    """Qwen3 (q/k norms): its glue in the JIT row functions (QK-norm, then RoPE), and in torch (the
    path a model whose norms are not f32 CPU tensors takes), alone and in a batch alike."""
    write_hf("qwen3", tmp_path / "hf", seed=4)
    llm = kvlens.load(tmp_path / "hf", kv="q8", attn_backend="numba", prefill_chunk=16)
    assert llm.model.row_ops and not llm.model.llama_rows
    llm.model.row_ops = row_ops
    reqs = _requests([3, 17, 33, 8, 25, 1, 12, 40], [5] * 8)
    batched = _together(llm, reqs, EngineConfig(kv_budget_bytes=1 << 22, keep_logits=True))
    for r in reqs:
        _assert_same(_alone(llm, r), batched[r.request_id], r.request_id)
