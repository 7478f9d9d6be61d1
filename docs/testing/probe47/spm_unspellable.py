"""A GGUF sentencepiece vocabulary without byte tokens, given a character it has no token for.

llama.cpp throws there (byte_to_token's token_to_id.at). Prints what kvlens does, with and without an
unknown token named in the file. Run: PYTHONPATH=tests .venv/bin/python docs/testing/probe47/spm_unspellable.py
"""

from test_tokenizer_rules import sentencepiece_meta

from kvlens.models.tokenizer import Tokenizer

for label, meta in [
    ("unk named", sentencepiece_meta()),
    ("no unk", {k: v for k, v in sentencepiece_meta().items() if k != "tokenizer.ggml.unknown_token_id"}),
]:
    tok = Tokenizer.from_gguf_metadata(meta)
    for text in ["ab b", "ab c b", "ab é"]:
        try:
            ids = tok.encode(text, add_bos=False)
            print(f"{label:10} {text!r:10} -> {[tok.id_to_token(i) for i in ids]} (decodes to {tok.decode(ids)!r})")
        except ValueError as e:
            print(f"{label:10} {text!r:10} -> {type(e).__name__}: {e}")
