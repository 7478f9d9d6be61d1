"""The Python API hands its ``sampling`` on: ``LLM.generate`` and ``LLM.generate_batch`` ran greedy
with any SamplingParams given and every test passed, since the only test that passed one (seeded,
twice) asserted that two runs agree, which greedy does too (a mutation run, forty-seventh session).
Here a sampled text is the text of the sampled ids, and differs from greedy."""

from __future__ import annotations

import pytest

from kvlens import SamplingParams

TINY_MODEL = ("llama", 5)  # conftest's tiny: a random model, its tokenizer byte-level BPE
PROMPTS = ["Once upon a time", "the cat sat"]
HOT = [SamplingParams(temperature=1.5, seed=s) for s in (1, 2, 3, 4)]


def sampled_text(llm, prompt: str, sampling: SamplingParams, n: int) -> str:
    """The text of the ids ``generate_ids`` samples (the primitive ``generate`` is built on)."""
    eos = llm.tokenizer.eos_ids
    ids = [t for t in llm.generate_ids(llm.encode_prompt(prompt), n, sampling) if t not in eos]
    return llm.tokenizer.decode(ids)


def test_generate_samples_with_the_given_params(tiny):
    greedy = tiny.generate(PROMPTS[0], max_new_tokens=8)
    texts = [tiny.generate(PROMPTS[0], max_new_tokens=8, sampling=p) for p in HOT]
    assert texts == [sampled_text(tiny, PROMPTS[0], p, 8) for p in HOT]
    assert any(t != greedy for t in texts)  # four seeds at temperature 1.5: not all the greedy text


def test_generate_batch_samples_each_prompt_as_generate_does(tiny):
    for p in HOT[:2]:
        batch = tiny.generate_batch(PROMPTS, max_new_tokens=8, sampling=p)
        assert batch == [tiny.generate(x, max_new_tokens=8, sampling=p) for x in PROMPTS]
    greedy = tiny.generate_batch(PROMPTS, max_new_tokens=8)
    sampled = [tiny.generate_batch(PROMPTS, max_new_tokens=8, sampling=p) for p in HOT]
    assert any(s != greedy for s in sampled)


def test_generate_batch_takes_one_new_token(tiny):
    one = tiny.generate_batch(PROMPTS, max_new_tokens=1)
    assert one == [tiny.generate(x, max_new_tokens=1) for x in PROMPTS]
    with pytest.raises(ValueError, match="max_new_tokens"):
        tiny.generate_batch(PROMPTS, max_new_tokens=0)


def test_a_system_text_that_is_not_valid_unicode_is_named(tiny):
    with pytest.raises(ValueError, match="^system"):
        tiny.encode_prompt("hi", chat=True, system="a\udfff")
