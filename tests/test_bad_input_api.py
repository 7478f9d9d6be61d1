"""The Python API refuses what the CLI refuses, with a TypeError/ValueError that names the argument."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import VOCAB, write_hf

import kvlens
from kvlens.checks import check_device
from kvlens.engine.llm import ContextOverflowError
from kvlens.engine.scheduler import Engine, EngineConfig, Request
from kvlens.kv.quant import dequantize_q8, quantize_q8
from kvlens.models.loader import load_model


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("api") / "hf"
    write_hf("qwen2", path)
    return kvlens.LLM(load_model(path), kv="f32", attn_backend="torch")


BAD_IDS = [
    ([], ValueError, "token ids must not be empty"),
    ([1, VOCAB], ValueError, rf"token ids\[1\] = {VOCAB} is outside the vocabulary \[0, {VOCAB}\)"),
    ([-1], ValueError, r"token ids\[0\] = -1 is outside"),
    ([1, 2.0], TypeError, r"token ids\[1\] must be an int, got float"),
    ([True], TypeError, r"token ids\[0\] must be an int, got bool"),
    ("hello", TypeError, "token ids must be a list of ints, got str"),
    (7, TypeError, "token ids must be a list of ints, got int"),
    (torch.tensor([1.0, 2.0]), TypeError, "integer tensor, got dtype torch.float32"),
    (torch.tensor([[1, 2]]), ValueError, r"must be 1-D, got a tensor of shape \(1, 2\)"),
    (torch.tensor([3, VOCAB + 5]), ValueError, rf"token ids\[1\] = {VOCAB + 5}"),
]


@pytest.mark.parametrize(("ids", "error", "match"), BAD_IDS, ids=[repr(b[0])[:30] for b in BAD_IDS])
def test_token_ids_are_checked_at_every_entry(llm, ids, error, match):
    calls = [
        lambda: llm.logits(ids),
        lambda: llm.prefill(ids, llm.new_cache(8)),
        lambda: list(llm.generate_ids(ids, 2)),
        lambda: llm.capture_qkv(ids, [0]),
        lambda: llm.forward(ids, llm.new_cache(8), 0),
        # the serving engine's own entry (a 2-D tensor once raised torch's "Boolean value of Tensor")
        lambda: Engine(llm, EngineConfig(kv_budget_bytes=1 << 20)).add_request(Request("r", ids, 2)),
    ]
    for call in calls:
        with pytest.raises(
            error,
            match="the prompt is empty" if call is calls[-1] and isinstance(ids, list) and not ids else match,
        ):
            call()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"kv_budget_bytes": 1.5}, TypeError, "kv_budget_bytes must be an integer, got float"),  # was run
        (
            {"kv_budget_bytes": "1GiB"},
            TypeError,
            "kv_budget_bytes must be an integer, got str",
        ),  # int()'s words
        ({"kv_budget_bytes": 0}, ValueError, "kv_budget_bytes must be ≥ 1"),
        ({"max_batch": True}, TypeError, "max_batch must be an integer, got bool"),
        ({"max_batch": 0}, ValueError, "max_batch must be ≥ 1"),
        ({"max_waiting": -1}, ValueError, "max_waiting must be ≥ 0"),
        ({"prefill_token_budget": 2.0}, TypeError, "prefill_token_budget must be an integer"),
    ],
)
def test_engine_config(kwargs, error, match):
    with pytest.raises(error, match=match):
        EngineConfig(**kwargs)


def test_a_request_id_is_a_string(llm):
    with pytest.raises(TypeError, match="request_id must be a str, got int"):  # ran, keyed by 5
        Engine(llm, EngineConfig(kv_budget_bytes=1 << 20)).add_request(Request(5, [1, 2], 2))


def test_a_prefill_chunk_is_checked_wherever_it_is_given(llm):
    for call in (
        lambda: list(llm.generate_ids([1, 2], 2, prefill_chunk=0)),
        lambda: llm.variant(prefill_chunk=0),
    ):
        with pytest.raises(ValueError, match="prefill_chunk must be ≥ 1, got 0"):  # was ZeroDivisionError
            call()


def test_valid_ids_in_any_accepted_form_give_the_same_logits(llm):
    ids = [5, 17, 200, VOCAB - 1]
    ref = llm.logits(ids)
    assert ref.shape == (4, VOCAB)
    assert torch.equal(llm.logits(torch.tensor(ids)), ref)
    assert torch.equal(llm.logits(tuple(ids)), ref)
    assert torch.equal(llm.logits(torch.tensor(ids, dtype=torch.int32)), ref)


def test_counts_and_layers(llm):
    with pytest.raises(ValueError, match="max_new_tokens must be ≥ 0, got -1"):
        list(llm.generate_ids([1, 2], -1))
    with pytest.raises(TypeError, match="max_new_tokens must be an integer, got float"):
        list(llm.generate_ids([1, 2], 1.5))
    assert list(llm.generate_ids([1, 2], 0)) == []
    with pytest.raises(ValueError, match="layer must be ≤ 1, got 2"):
        llm.capture_qkv([1, 2], [0, 2])
    with pytest.raises(TypeError, match="layer must be an integer, got bool"):
        llm.capture_qkv([1, 2], [True])
    with pytest.raises(TypeError, match="layers must be a sequence of layer indices, got int"):
        llm.capture_qkv([1, 2], 1)
    with pytest.raises(ValueError, match="chunk must be ≥ 1, got 0"):
        llm.prefill([1, 2], llm.new_cache(4), chunk=0)
    with pytest.raises(ValueError, match="prefill_chunk must be ≥ 1"):
        llm.variant(prefill_chunk=0)
    with pytest.raises(TypeError, match="LLM takes a LoadedModel .kvlens.load builds one., got NoneType"):
        kvlens.LLM(None, prefill_chunk=0)
    with pytest.raises(TypeError, match="sampling must be a SamplingParams, got dict"):
        list(llm.generate_ids([1, 2], 2, sampling={"temperature": 1.0}))


def test_decode_checks_its_sampling_argument(llm):
    """``decode`` is public on its own (the lab's loops call it after their own prefill): a dict in
    place of SamplingParams is named there too, not an AttributeError from inside the sampler."""
    cache = llm.new_cache(4)
    logits = llm.prefill([1, 2], cache)
    with pytest.raises(TypeError, match="sampling must be a SamplingParams, got dict"):
        list(llm.decode(cache, logits, 2, 2, sampling={"temperature": 1.0}))


def test_the_context_holds_exactly_max_ctx_tokens(llm):
    """The tiny model's context is its max_position_embeddings, 256 (tests/tiny_models.py): 256 tokens
    run, 257 are refused before any work, whether they come as a prompt or as prompt plus new tokens."""
    assert llm.config.max_ctx == 256
    assert llm.logits([1] * 256).shape == (256, VOCAB)
    with pytest.raises(ContextOverflowError, match="257 tokens do not fit in the model's context of 256"):
        llm.logits([1] * 257)
    cache = llm.new_cache(256)
    logits = llm.prefill([1, 2], cache)
    assert len(list(llm.decode(cache, logits, 2, 254, stop_at_eos=False))) == 254
    for call in (
        lambda: list(llm.generate_ids([1, 2], 255)),
        lambda: list(llm.decode(llm.new_cache(4), logits, 2, 255)),
    ):
        with pytest.raises(ContextOverflowError, match="257 tokens do not fit"):
            call()


def test_forward_starts_where_the_cache_ends_or_before(llm):
    """A start past the written positions would attend rows never written (a silent wrong result)."""
    cache = llm.new_cache(8)
    with pytest.raises(ValueError, match="start 2 is past the 0 positions the cache holds"):
        llm.forward([1], cache, 2)
    with pytest.raises(ValueError, match="start must be ≥ 0, got -1"):
        llm.forward([1], cache, -1)
    with pytest.raises(TypeError, match="start must be an integer"):
        llm.forward([1], cache, 0.0)
    first = llm.forward([1, 2, 3], cache, 0)
    assert cache.length == 3
    llm.forward([4], cache, 3, prefill=False)  # the next position, and a rewrite from an earlier one:
    again = llm.forward([1, 2, 3], cache, 0)
    assert torch.equal(again, first)
    with pytest.raises(ValueError, match="start 5 is past the 4 positions"):
        llm.forward([5], cache, 5, prefill=False)
    with pytest.raises(ValueError, match="capacity must be ≤ 2147483647, got 1000000000000000"):
        llm.new_cache(10**15)


def test_prompt_text_must_be_valid_unicode(llm):
    with pytest.raises(ValueError, match="prompt is not valid UTF-8 text"):
        llm.generate("bad \udcff byte", 2)
    with pytest.raises(TypeError, match="prompt must be a str, got bytes"):
        llm.generate(b"bytes", 2)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"temperature": math.nan}, ValueError, "temperature must be a finite number"),
        ({"temperature": math.inf}, ValueError, "temperature must be a finite number"),
        ({"temperature": -0.5}, ValueError, "temperature must be ≥ 0"),
        ({"temperature": "1"}, TypeError, "temperature must be a number, got str"),
        ({"top_p": math.nan}, ValueError, "top_p must be a finite number"),
        ({"top_p": 0.0}, ValueError, "top_p must be > 0"),
        ({"top_p": 1.5}, ValueError, "top_p must be ≤ 1"),
        ({"top_k": 2.5}, TypeError, "top_k must be an integer, got float"),
        ({"top_k": -1}, ValueError, "top_k must be ≥ 0"),
        ({"seed": 1.5}, TypeError, "seed must be an integer"),
    ],
)
def test_sampling_params(kwargs, error, match):
    with pytest.raises(error, match=match):
        kvlens.SamplingParams(**kwargs)


def test_sampling_params_accept_valid_values():
    p = kvlens.SamplingParams(temperature=1, top_k=5, top_p=0.5, seed=-3)
    assert (p.temperature, p.top_k, p.top_p, p.seed) == (1.0, 5, 0.5, -3)


def test_q8_quantizer_checks_dtypes_and_shapes():
    x = torch.randn(3, 5, 8)
    q, max_abs = quantize_q8(x)
    assert torch.allclose(dequantize_q8(q, max_abs), x, atol=float(max_abs.max()) / 127 / 2 * 1.0001)
    with pytest.raises(ValueError, match=r"max_abs must have shape \(3, 5\), got \(3,\)"):
        dequantize_q8(q, max_abs[:, 0])
    with pytest.raises(ValueError, match=r"max_abs must have shape \(3, 5\), got \(5, 3\)"):
        dequantize_q8(q, max_abs.T.contiguous())
    with pytest.raises(TypeError, match="max_abs must be a floating-point tensor, got dtype torch.int64"):
        dequantize_q8(q, max_abs.long())
    with pytest.raises(TypeError, match="q must have dtype torch.int8, got torch.float32"):
        dequantize_q8(q.float(), max_abs)
    with pytest.raises(TypeError, match="max_abs must be a torch.Tensor, got list"):
        dequantize_q8(q, max_abs.tolist())
    with pytest.raises(TypeError, match="x must be a floating-point tensor, got dtype torch.int32"):
        quantize_q8(torch.ones(4, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="x must have at least 1 dimension"):
        quantize_q8(torch.tensor(1.0))


@pytest.mark.parametrize("model", [None, 3, b"smollm2"])
def test_model_must_be_a_name_or_path(model):
    with pytest.raises(TypeError, match=f"model must be a name or a path .*, not {type(model).__name__}"):
        kvlens.load(model)


def test_devices():
    assert check_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="unknown device 'gpu0'"):
        check_device("gpu0")
    with pytest.raises(ValueError, match="unsupported device 'meta'"):
        check_device("meta")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device 'cuda' is not available"):
            kvlens.load("smollm2", device="cuda")


def test_kv_cache_checks_what_it_is_given():
    from kvlens.kv.cache import KVCache
    from kvlens.kv.modes import MODES

    with pytest.raises(ValueError, match="n_kv_heads must be ≥ 1, got 0"):
        KVCache(2, 0, 16, 8, MODES["q8"])
    with pytest.raises(ValueError, match="capacity must be ≥ 0, got -1"):
        KVCache(2, 2, 16, -1, MODES["q8"])
    cache = KVCache(2, 2, 16, 8, MODES["q8"])
    rows = torch.randn(2, 3, 16)
    cache.write(0, 0, rows, rows)  # the valid case
    with pytest.raises(ValueError, match="layer must be ≤ 1, got 2"):
        cache.write(2, 0, rows, rows)
    with pytest.raises(ValueError, match="start must be ≥ 0"):
        cache.write(1, -1, rows, rows)
    with pytest.raises(ValueError, match=r"k must be \[n_kv_heads=2, n, head_dim=16\], got \(2, 3, 8\)"):
        cache.write(1, 0, rows[..., :8], rows)
    with pytest.raises(ValueError, match=r"k and v must have the same shape"):
        cache.write(1, 0, rows, rows[:, :2])
    with pytest.raises(TypeError, match="v must be a floating-point tensor"):
        cache.write(1, 0, rows, rows.to(torch.int8))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"budget": math.inf}, ValueError, "the sparse budget must be a finite number"),
        ({"budget": math.nan}, ValueError, "the sparse budget must be a finite number"),
        ({"budget": 0}, ValueError, "the sparse budget must be > 0"),
        ({"budget": "1k"}, TypeError, "the sparse budget must be a number"),
        ({"dense_layers": -1}, ValueError, "dense_layers must be ≥ 0"),
        ({"min_ctx": 1.5}, TypeError, "min_ctx must be an integer"),
    ],
)
def test_sparse_config(kwargs, error, match):
    from kvlens.kv.blocks import SparseConfig

    with pytest.raises(error, match=match):
        SparseConfig(**kwargs)


@pytest.mark.parametrize("name", ["doctor.DoctorConfig", "plan.PlanConfig"])
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kld_budget": 0.0}, "--kld-budget must be > 0, got 0"),
        ({"kld_budget": -1e-3}, "--kld-budget must be > 0, got -0.001"),
        ({"kld_budget": math.nan}, "--kld-budget must be a finite number, got nan"),
        ({"kld_budget": math.inf}, "--kld-budget must be a finite number, got inf"),
        ({"kv": "q9"}, "unknown KV cache mode 'q9'"),  # the lab config's own checks still run first
        ({"kv": "q9", "kld_budget": 0.0}, "unknown KV cache mode 'q9'"),
    ],
)
def test_recipe_configs_check_budget_and_lab_fields(name, kwargs, match):
    import importlib

    module, cls = name.split(".")
    config = getattr(importlib.import_module(f"kvlens.lab.{module}"), cls)
    with pytest.raises(ValueError, match=match):
        config(**kwargs)
    config(kld_budget=1e-9)  # any positive budget is taken
