"""Before/after probe of the forty-fifth session: an end-of-turn marker that a GGUF types as a normal
(1) or user-defined (4) token. Run from the repository root:
    PYTHONPATH=tests .venv/bin/python docs/testing/probe45/eog.py
"""

from test_tokenizer import _tiny_meta

from kvlens.models.tokenizer import Tokenizer

for stated in (1, 4):
    meta = _tiny_meta("gpt2")  # ids: 0 <|endoftext|>, 1 <|im_end|>, 2 <think>, 3 Ġ, then ASCII 33..126
    meta["tokenizer.ggml.token_type"] = [3, stated, 4] + [1] * (len(meta["tokenizer.ggml.tokens"]) - 3)
    t = Tokenizer.from_gguf_metadata(meta)
    ids = t.encode("x<|im_end|>y", add_bos=False)
    shown = t.decode(ids, skip_special=True)
    print(
        f"<|im_end|> typed {stated}: eos_ids={sorted(t.eos_ids)} encode={ids} decode(skip_special)={shown!r}"
    )
