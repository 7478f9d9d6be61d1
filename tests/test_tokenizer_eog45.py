"""End-of-turn markers in a GGUF vocabulary, as llama.cpp's ``llama_vocab::load`` treats them: a token
spelled ``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``, … ends generation and is a control token
whatever type the file gives it ("control-looking token … its type will be overridden"). Until the
forty-fifth session kvlens did so only for tokens the file typed as control: a normal-typed
``<|im_end|>`` was spelled out character by character in a rendered chat prompt, never stopped
generation, and was printed. Expected ids are read off the synthetic vocabulary by hand."""

from __future__ import annotations

import pytest
from test_tokenizer import _tiny_meta

from kvlens.models.tokenizer import Tokenizer

NORMAL, CONTROL, USER_DEFINED = 1, 3, 4


def _tokenizer(im_end_type: int, think_type: int = USER_DEFINED) -> Tokenizer:
    meta = _tiny_meta("gpt2")  # ids: 0 <|endoftext|>, 1 <|im_end|>, 2 <think>, 3 Ġ, then ASCII 33..126
    n = len(meta["tokenizer.ggml.tokens"])
    meta["tokenizer.ggml.token_type"] = [CONTROL, im_end_type, think_type] + [NORMAL] * (n - 3)
    return Tokenizer.from_gguf_metadata(meta)


@pytest.mark.parametrize("stated", [NORMAL, CONTROL, USER_DEFINED])
def test_an_end_of_turn_marker_is_a_control_token_whatever_its_type(stated):
    t = _tokenizer(stated)
    x, y = ord("x") - 33 + 4, ord("y") - 33 + 4  # the printable-ASCII tokens start at id 4
    assert t.encode("x<|im_end|>y", add_bos=False) == [x, 1, y]  # matched whole, one id
    assert t.eos_ids == {0, 1}  # the declared EOS and the marker
    assert t.decode([x, 1, y], skip_special=True) == "xy"
    assert t.decode([x, 1, y]) == "x<|im_end|>y"


@pytest.mark.parametrize("stated", [NORMAL, USER_DEFINED])
def test_other_tokens_keep_their_stated_type(stated):
    t = _tokenizer(CONTROL, think_type=stated)
    assert 2 not in t.eos_ids
    ids = t.encode("<think>", add_bos=False)
    assert (ids == [2]) is (stated == USER_DEFINED)  # a normal token is not matched whole in the text
    assert t.decode(ids, skip_special=True) == "<think>"
