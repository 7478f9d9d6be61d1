"""Request bounds at their edges, each side of the limit (the planted-bug campaign of the
thirty-third session found the limits themselves untested). The limits are OpenAI's: completions
``logprobs`` ≤ 5, chat ``top_logprobs`` ≤ 20, a ``seed`` ≥ 0 (a 64-bit signed one)."""

from __future__ import annotations

import pytest

from kvlens.serve.protocol import ChatRequest, CompletionRequest

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "x"}


def test_completion_logprobs_0_to_5() -> None:
    for n in (0, 5):
        assert CompletionRequest.model_validate(COMPLETION | {"logprobs": n}).logprobs == n
    for n in (-1, 6):
        with pytest.raises(ValueError, match="logprobs"):
            CompletionRequest.model_validate(COMPLETION | {"logprobs": n})


def test_chat_top_logprobs_0_to_20_and_only_with_logprobs() -> None:
    for n in (0, 20):
        assert ChatRequest.model_validate(CHAT | {"logprobs": True, "top_logprobs": n}).logprobs_top == n
    with pytest.raises(ValueError, match="top_logprobs"):
        ChatRequest.model_validate(CHAT | {"logprobs": True, "top_logprobs": 21})
    with pytest.raises(ValueError, match="top_logprobs requires logprobs"):  # 0 is a value, not "unset"
        ChatRequest.model_validate(CHAT | {"top_logprobs": 0})


@pytest.mark.parametrize("model", [CompletionRequest, ChatRequest])
def test_seed_is_a_non_negative_64_bit_integer(model) -> None:
    body = COMPLETION if model is CompletionRequest else CHAT
    for seed in (0, 2**63 - 1):
        assert model.model_validate(body | {"seed": seed}).seed == seed
    for seed in (-1, 2**63):
        with pytest.raises(ValueError, match="seed"):
            model.model_validate(body | {"seed": seed})
