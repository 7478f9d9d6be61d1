"""The tokenizer's rules that the real models' files leave at one setting, on tiny vocabularies where
the right pieces are known by hand: sentencepiece's space prefix (llama.cpp's default: on) and its
removal on decode, Llama-3's whole-word lookup before merges, and an HF directory's BOS and EOS
taken from config.json and generation_config.json when tokenizer_config.json does not name them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_tokenizer import _tiny_meta
from tokenizers import Tokenizer as HFBackend
from tokenizers import models, pre_tokenizers

from kvlens.models.tokenizer import Tokenizer, TokenizerError

SPACE = "\u2581"


def sentencepiece_meta(**extra) -> dict:
    """A sentencepiece-BPE vocabulary (``tokenizer.ggml.model = llama``): merges come from the scores."""
    tokens = ["<unk>", "<s>", "</s>", SPACE, "a", "b", f"{SPACE}a", f"{SPACE}b", "ab", f"{SPACE}ab"]
    scores = [0.0, 0.0, 0.0, -1.0, -2.0, -2.0, -3.0, -3.0, -4.0, -5.0]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": [2, 3, 3] + [1] * 7,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    } | extra


def pieces(tok: Tokenizer, text: str) -> list[str]:
    return [tok.id_to_token(i) for i in tok.encode(text, add_bos=False)]


def test_sentencepiece_prepends_a_space_unless_the_file_says_not_to():
    default = Tokenizer.from_gguf_metadata(sentencepiece_meta())
    assert pieces(default, "ab b") == [f"{SPACE}ab", f"{SPACE}b"]
    assert default.decode(default.encode("ab b", add_bos=False)) == "ab b"  # the prefix removed again
    off = Tokenizer.from_gguf_metadata(sentencepiece_meta(**{"tokenizer.ggml.add_space_prefix": False}))
    assert pieces(off, "ab b") == ["ab", f"{SPACE}b"]
    assert off.decode(off.encode(" ab", add_bos=False)) == " ab"  # nothing to strip: a real space stays


def byte_level_meta(
    pre: str, tokens: tuple[str, ...] = ("xy", "xyz"), merges: tuple[str, ...] = ("x y",)
) -> dict:
    """``test_tokenizer``'s tiny byte-level vocabulary (printable ASCII maps to itself) plus ``tokens``
    and ``merges``: by default "xy" and the whole word "xyz", where the merges make "xy" but nothing
    makes "xyz"."""
    meta = _tiny_meta(pre)
    return meta | {
        "tokenizer.ggml.tokens": [*meta["tokenizer.ggml.tokens"], *tokens],
        "tokenizer.ggml.token_type": [*meta["tokenizer.ggml.token_type"], *[1] * len(tokens)],
        "tokenizer.ggml.merges": [*meta["tokenizer.ggml.merges"], *merges],
    }


@pytest.mark.parametrize(("pre", "want"), [("llama3", ["xyz"]), ("gpt2", ["xy", "z"])])
def test_llama3_looks_a_whole_word_up_before_merging(pre, want):
    """llama.cpp (and Llama-3's tokenizer.json, ``ignore_merges``) take a pre-token found whole in the
    vocabulary as one token; GPT-2's rule builds it from merges only."""
    assert pieces(Tokenizer.from_gguf_metadata(byte_level_meta(pre)), "xyz") == want


def write_hf_dir(out: Path, tokenizer_config: dict, config: dict, generation: dict | None = None) -> Path:
    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", "<eot>", "a", "b"])}
    backend = HFBackend(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (out / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (out / "generation_config.json").write_text(json.dumps(generation))
    return out


def test_an_hf_directory_takes_bos_and_eos_ids_from_its_configs(tmp_path):
    """No token named in tokenizer_config.json: BOS from config.json's bos_token_id; EOS, the first of
    generation_config.json's list (every one of them, and config.json's, ends generation)."""
    path = write_hf_dir(
        tmp_path, {"add_bos_token": True}, {"bos_token_id": 1, "eos_token_id": 2}, {"eos_token_id": [3, 2]}
    )
    tok = Tokenizer.from_hf_dir(path)
    assert (tok.bos_id, tok.add_bos, tok.bos_prefix) == (1, True, [1])
    assert tok.encode("a b") == [1, 4, 5] and tok.eos_ids == {2, 3}
    tok.chat_template = "{{ bos_token }}|{{ eos_token }}"
    assert tok.apply_chat_template([]) == "<s>|<eot>"  # the declared EOS is generation_config's first


def test_without_add_bos_token_bos_is_off_unless_the_post_processor_adds_it(tmp_path):
    """``test_tokenizer`` covers a post-processor that adds BOS; this one has none: no BOS."""
    tok = Tokenizer.from_hf_dir(write_hf_dir(tmp_path, {"bos_token": "<s>"}, {}))
    assert (tok.bos_id, tok.add_bos, tok.encode("a b")) == (1, False, [4, 5])


def test_chat_templates_from_a_named_list_or_a_jinja_file(tmp_path):
    """tokenizer_config.json's older list form picks the one named "default", wherever it stands; a
    directory without one in its config reads chat_template.jinja."""
    listed = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]
    tok = Tokenizer.from_hf_dir(write_hf_dir(tmp_path, {"chat_template": listed}, {}))
    assert tok.chat_template == "plain"
    other = tmp_path / "jinja"
    other.mkdir()
    write_hf_dir(other, {}, {})
    (other / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!", encoding="utf-8")
    assert Tokenizer.from_hf_dir(other).apply_chat_template([{"role": "user", "content": "hi"}]) == "hi!"


def test_tojson_in_a_template_keeps_non_ascii_text_as_it_is(tmp_path):
    """As transformers renders it: ``json.dumps(..., ensure_ascii=False)``, no \\u escapes."""
    tok = Tokenizer.from_hf_dir(write_hf_dir(tmp_path, {"chat_template": "{{ messages | tojson }}"}, {}))
    messages = [{"role": "user", "content": "你好 😀 café"}]
    assert tok.apply_chat_template(messages) == json.dumps(messages, ensure_ascii=False)


def test_the_stream_decoder_keeps_sentencepiece_spaces_between_pushes():
    """Decoded alone, "▁b" loses its space (the prefix strip); the decoder decodes each new token
    after the last emitted one, so the words keep their spaces."""
    tok = Tokenizer.from_gguf_metadata(sentencepiece_meta())
    ids = tok.encode("ab b ab", add_bos=False)
    assert len(ids) == 3 and tok.decode(ids[1:2]) == "b"
    dec = tok.stream_decoder()
    assert [dec.push(i) for i in ids] == ["ab", " b", " ab"]
    assert dec.flush() == ""


def test_flush_resets_the_stream_decoder():
    """A byte-level emoji split over four byte tokens: held back, flushed lossily, and after the
    flush a new stream starts empty (a second flush gives nothing, the same bytes are held again)."""
    tok = Tokenizer.from_gguf_metadata(byte_level_meta("gpt2", tokens=("ð", "Ł", "ĺ", "Ģ"), merges=()))
    ids = tok.encode("😀", add_bos=False)
    assert len(ids) == 4 and tok.decode(ids) == "😀"
    dec = tok.stream_decoder()
    assert [dec.push(i) for i in ids[:2]] == ["", ""]
    assert dec.flush() == tok.decode(ids[:2]) and dec.flush() == ""
    assert [dec.push(i) for i in ids] == ["", "", "", "😀"]


def test_templates_render_with_transformers_whitespace_rules(tmp_path):
    """trim_blocks and lstrip_blocks, as transformers compiles templates: a block tag's line leaves no
    newline or indent behind."""
    template = "{% for m in messages %}\n    {% if m['role'] == 'user' %}\n{{ m['content'] }}\n    {% endif %}\n{% endfor %}"
    tok = Tokenizer.from_hf_dir(write_hf_dir(tmp_path, {"chat_template": template}, {}))
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "x"},
        {"role": "user", "content": "b"},
    ]
    assert tok.apply_chat_template(messages) == "a\nb\n"


def test_a_special_token_id_outside_the_vocabulary_is_refused():
    with pytest.raises(TokenizerError, match="the BOS token id 10 is outside the tokenizer's 10 tokens"):
        Tokenizer.from_gguf_metadata(sentencepiece_meta(**{"tokenizer.ggml.bos_token_id": 10}))
    Tokenizer.from_gguf_metadata(sentencepiece_meta(**{"tokenizer.ggml.bos_token_id": 9}))  # the last id
