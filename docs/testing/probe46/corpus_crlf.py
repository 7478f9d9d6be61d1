"""How many tokens a CRLF text file gives SmolLM2's tokenizer as kvlens read it before the forty-sixth
session (BOM dropped, CRLF turned into LF) and as llama-perplexity -f reads it (kvlens now).

Run: .venv/bin/python docs/testing/probe46/corpus_crlf.py
"""

import tempfile
from pathlib import Path

import kvlens
from kvlens.corpus import _read_utf8, load_corpus, read_like_llama_cpp

text = load_corpus("hamlet_gut")[0][:20000]
path = Path(tempfile.mkdtemp()) / "hamlet-crlf.txt"
path.write_bytes(text.replace("\n", "\r\n").encode("utf-8"))
tok = kvlens.load("smollm2", kv="f32").tokenizer
for how, read in (("normalized (before)", _read_utf8), ("as llama-perplexity -f (now)", read_like_llama_cpp)):
    ids = tok.encode(read(path))
    print(f"{how:30s} {len(ids):6d} tokens; first 12 ids {ids[:12]}")
