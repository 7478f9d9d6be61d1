"""Before/after probe of the forty-fifth session: byte-level GGUF pre-tokenizer names. SmolLM2's
vocabulary with its `tokenizer.ggml.pre` replaced by "gpt-2" (llama.cpp's name for GPT-2's regex),
"default" (llama.cpp's four-step chain, also what it runs for a file naming none) or left out,
tokenizing the first 20,000 characters of the corpus's Britannica article. Run from the repository
root (after `kvlens corpus fetch`):
    .venv/bin/python docs/testing/probe45/pre_default.py
"""

from kvlens.corpus import load_corpus
from kvlens.models.gguf_loader import open_gguf
from kvlens.models.loader import resolve_model
from kvlens.models.tokenizer import Tokenizer

text = load_corpus("britannica")[0][:20000]
_, meta = open_gguf(resolve_model("smollm2"))
for pre in ("gpt-2", "default", None):
    named = {k: v for k, v in meta.items() if k != "tokenizer.ggml.pre"} | (
        {"tokenizer.ggml.pre": pre} if pre else {}
    )
    try:
        print(f"pre {pre!r}: {len(Tokenizer.from_gguf_metadata(named).encode(text, add_bos=False))} tokens")
    except Exception as e:  # what a user would see
        print(f"pre {pre!r}: refused: {e}")
