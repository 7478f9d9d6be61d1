"""Before/after probe of the forty-fifth session: a GGUF whose token list is shorter than its embedding
(the tiny model's 320 rows and `llama.vocab_size` 320, with the last 20 tokens cut from the list).
llama.cpp sizes the embedding by the token list and refuses the file. Run from the repository root:
    PYTHONPATH=tests .venv/bin/python docs/testing/probe45/vocab.py
"""

import tempfile
from pathlib import Path

import gguf
from test_bad_input_models import rewrite_gguf
from tiny_models import write_gguf, write_hf

from kvlens.models.loader import load_model

GT = gguf.GGUFValueType
root = Path(tempfile.mkdtemp())
ok = write_gguf(write_hf("mistral", root / "hf"), "mistral", root / "ok.gguf")
fields = gguf.GGUFReader(ok).fields
tokens = fields["tokenizer.ggml.tokens"].contents()[:300]
types = fields["tokenizer.ggml.token_type"].contents()[:300]
meta = {
    "tokenizer.ggml.tokens": (tokens, GT.ARRAY, GT.STRING),
    "tokenizer.ggml.token_type": (types, GT.ARRAY, GT.INT32),
}
short = rewrite_gguf(ok, root / "short.gguf", meta=meta)
try:
    m = load_model(short)
    print(f"loads: {m.config.vocab} embedding rows, {m.tokenizer.vocab_size} tokens")
except Exception as e:  # what a user would see
    print(f"refused: {e}")
