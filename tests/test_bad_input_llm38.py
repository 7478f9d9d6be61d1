"""The LLM's methods refuse by name what they silently ran or failed on with another exception
(thirty-eighth session's hostile sweep of the Python API)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kvlens
from kvlens.engine.sampling import SamplingParams

TINY_MODEL = ("llama", 3)


@pytest.mark.parametrize("value", ["no", None, 1])
def test_chat_must_be_a_bool(tiny, value):
    # "no" was read as true: the chat template was applied
    for call in (
        lambda: tiny.encode_prompt("Hi", value),
        lambda: tiny.generate("Hi", 2, chat=value),
        lambda: tiny.generate_batch(["Hi"], 2, chat=value),
    ):
        with pytest.raises(TypeError, match="chat must be True or False"):
            call()


@pytest.mark.parametrize("value", ["no", None])
def test_stop_at_eos_must_be_a_bool(tiny, value):
    with pytest.raises(TypeError, match="stop_at_eos must be True or False"):
        list(tiny.generate_ids([5, 6], 2, stop_at_eos=value))
    cache = tiny.new_cache(8)
    logits = tiny.prefill([5, 6], cache)
    with pytest.raises(TypeError, match="stop_at_eos must be True or False"):
        list(tiny.decode(cache, logits, 2, 2, stop_at_eos=value))


def test_generate_batch_refuses_a_generator_it_would_use_up(tiny):
    # the type check consumed the generator, so nothing ran and [] came back
    with pytest.raises(TypeError, match="prompts must be a list of strings"):
        tiny.generate_batch((p for p in ["Hi", "Yo"]), 2)
    assert len(tiny.generate_batch(("Hi", "Yo"), 2)) == 2


@pytest.mark.parametrize(("backend", "error"), [("bogus", ValueError), (5, TypeError)])
def test_forward_checks_a_backend_it_is_given(tiny, backend, error):
    # "bogus" ran on torch silently; 5 was an AttributeError
    with pytest.raises(error, match="backend"):
        tiny.forward([5, 6], tiny.new_cache(4), 0, backend=backend)


@pytest.mark.parametrize(
    ("make", "error", "said"),
    [
        (lambda width: [0.0] * width, TypeError, "hidden must be a torch.Tensor, got list"),
        (lambda width: torch.zeros(1, 10), ValueError, r"hidden must have shape \(n, \d+\), got \(1, 10\)"),
        (
            lambda width: torch.zeros(1, 1, width),
            ValueError,
            r"hidden must have shape \(n, \d+\), got \(1, 1,",
        ),
        (lambda width: torch.zeros(1, width, dtype=torch.long), TypeError, "must be a floating-point tensor"),
    ],
    ids=["list", "narrow", "3-D", "int"],
)
def test_lm_head_checks_its_hidden_states(tiny, make, error, said):
    with pytest.raises(error, match=said):
        tiny.lm_head(make(tiny.config.hidden))


@pytest.mark.parametrize("bad", ["2-D", "wide", "short", "nan"])
def test_decode_checks_the_logits_it_starts_from(tiny, bad):
    # a [2, vocab] tensor yielded a token id past the vocabulary; NaN logits gave token 0 (greedy)
    vocab = tiny.config.vocab
    logits = {
        "2-D": torch.zeros(2, vocab),
        "wide": torch.zeros(vocab + 10),
        "short": torch.zeros(10),
        "nan": torch.full((vocab,), float("nan")),
    }[bad]
    cache = tiny.new_cache(8)
    tiny.prefill([5, 6], cache)
    said = "logits holds NaN" if bad == "nan" else rf"logits must have shape \({vocab}\)"
    with pytest.raises(ValueError, match=said):
        list(tiny.decode(cache, logits, 2, 2))


def test_decode_takes_masked_logits(tiny):
    # -inf is a masked logit, not an error: greedy picks the one left
    logits = torch.full((tiny.config.vocab,), float("-inf"))
    logits[7] = 0.0
    cache = tiny.new_cache(8)
    tiny.prefill([5, 6], cache)
    assert list(tiny.decode(cache, logits, 2, 1)) == [7]


def test_sampling_params_cannot_be_changed_past_their_checks():
    sp = SamplingParams(temperature=0.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        sp.temperature = float("nan")
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        dataclasses.replace(sp, temperature=float("nan"))
    assert dataclasses.replace(sp, seed=3) == SamplingParams(0.5, 0, 1.0, 3)


@pytest.mark.parametrize(
    ("changes", "error", "said"),
    [
        ({"config": None}, TypeError, "LLM has no setting 'config'"),
        ({"tokenizer": None}, TypeError, "LLM has no setting 'tokenizer'"),
        ({"device": "gpu"}, TypeError, "LLM has no setting 'device'"),
        ({"fused_step": "no"}, TypeError, "fused_step must be True or False"),
    ],
)
def test_variant_changes_engine_settings_only(tiny, changes, error, said):
    with pytest.raises(error, match=said):
        tiny.variant(**changes)


@pytest.mark.parametrize("loaded", [None, "smollm2"])
def test_an_llm_is_built_from_a_loaded_model(loaded):
    with pytest.raises(TypeError, match="LLM takes a LoadedModel"):
        kvlens.LLM(loaded)


def test_an_empty_weights_mode_is_not_auto():
    with pytest.raises(ValueError, match="unknown weights mode ''"):
        kvlens.load("smollm2", weights="")


def test_check_fits_and_on_text_are_checked(tiny):
    with pytest.raises(TypeError, match="n_tokens must be an integer, got float nan"):
        tiny.check_fits(float("nan"))
    with pytest.raises(TypeError, match="on_text must be a callable or None, got int"):
        tiny.generate("Hi", 2, on_text=5)


def test_decode_checks_its_cache_and_position_even_when_the_first_token_ends_it(tiny):
    # with an EOS first, decode returned before forward ever looked at the cache or the position
    logits = torch.zeros(tiny.config.vocab)
    logits[min(tiny.tokenizer.eos_ids)] = 9.0
    with pytest.raises(TypeError, match="cache must be a KVCache"):
        list(tiny.decode("x", logits, 0, 2))
    cache = tiny.new_cache(8)
    with pytest.raises(ValueError, match="pos must be ≥ 0, got -1"):
        list(tiny.decode(cache, logits, -1, 2))
    with pytest.raises(ValueError, match="pos 5 is past the 0 positions the cache holds"):
        list(tiny.decode(cache, logits, 5, 2))
    with pytest.raises(TypeError, match="pos must be an integer, got float 1.5"):
        list(tiny.decode(cache, logits, 1.5, 2))


def test_decode_refuses_logits_with_nothing_to_choose(tiny):
    cache = tiny.new_cache(8)
    tiny.prefill([5, 6], cache)
    for sampling in (None, SamplingParams(temperature=1.0, seed=1)):
        with pytest.raises(ValueError, match="logits has no finite entry"):
            list(tiny.decode(cache, torch.full((tiny.config.vocab,), float("-inf")), 2, 1, sampling))


def test_forward_takes_prefill_as_a_bool(tiny):
    with pytest.raises(TypeError, match="prefill must be True or False, got str"):
        tiny.forward([5, 6], tiny.new_cache(4), 0, prefill="no")
