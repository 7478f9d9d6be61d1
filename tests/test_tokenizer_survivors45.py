"""The tokenizer's behaviours that the forty-fifth session's mutation run of ``models/tokenizer.py``
found unasserted (docs/testing.md): explicit BOS on request, an HF directory's EOS from each of its
three files with distinct ids, the chat template's three sources, sentencepiece merges ranked by
score and its space prefix removed once, the checks of a GGUF token list, and the words of the
refusals. Expected ids are read off the tiny vocabularies by hand."""

from __future__ import annotations

import json

import pytest
from test_tokenizer import _tiny_meta
from test_tokenizer_rules import SPACE, pieces, sentencepiece_meta, write_hf_dir

from kvlens.models.spm_spelling import UnspellableTextError
from kvlens.models.tokenizer import Tokenizer, TokenizerError

# write_hf_dir's vocabulary: <unk> 0, <s> 1, </s> 2, <eot> 3, a 4, b 5


def test_bos_on_request(tmp_path):
    with_bos = Tokenizer.from_hf_dir(write_hf_dir(tmp_path, {"bos_token": "<s>", "add_bos_token": False}, {}))
    assert with_bos.encode("a b") == [4, 5]
    assert with_bos.encode("a b", add_bos=True) == [1, 4, 5]
    assert with_bos.encode("a b", add_bos=False) == [4, 5]
    other = tmp_path / "none"
    other.mkdir()
    without = Tokenizer.from_hf_dir(write_hf_dir(other, {}, {}))
    assert without.bos_id is None and without.encode("a b", add_bos=True) == [4, 5]


@pytest.mark.parametrize(
    "tokenizer_config, config, generation, declared, stops",
    [
        ({"eos_token": "</s>"}, {"eos_token_id": 4}, {"eos_token_id": [3]}, 2, {2, 3, 4}),
        ({"eos_token": {"content": "</s>", "special": True}}, {}, None, 2, {2}),  # an AddedToken dict
        ({}, {"eos_token_id": 2}, {"eos_token_id": [3, 4]}, 3, {2, 3, 4}),  # generation_config's first
        ({}, {"eos_token_id": [4, 3]}, None, 4, {3, 4}),  # without it, config.json's first
        ({}, {}, {"eos_token_id": 5}, 5, {5}),
    ],
)
def test_an_hf_directorys_eos_from_each_file(tmp_path, tokenizer_config, config, generation, declared, stops):
    tok = Tokenizer.from_hf_dir(write_hf_dir(tmp_path, tokenizer_config, config, generation))
    assert tok.eos_ids == stops
    tok.chat_template = "[{{ eos_token }}]"
    assert tok.apply_chat_template([]) == f"[{['<unk>', '<s>', '</s>', '<eot>', 'a', 'b'][declared]}]"


def test_the_special_tokens_a_template_reads_are_empty_where_there_are_none(tmp_path):
    tok = Tokenizer.from_hf_dir(write_hf_dir(tmp_path, {}, {}))
    tok.chat_template = "[{{ bos_token }}][{{ eos_token }}]"
    assert tok.apply_chat_template([]) == "[][]"


def test_the_chat_template_from_each_source(tmp_path):
    unnamed = [{"name": "tool_use", "template": "tools"}, {"name": "rag", "template": "rag"}]
    assert (
        Tokenizer.from_hf_dir(write_hf_dir(tmp_path, {"chat_template": unnamed}, {})).chat_template == "tools"
    )
    other = tmp_path / "json"
    other.mkdir()
    write_hf_dir(other, {}, {})
    (other / "chat_template.json").write_text(json.dumps({"chat_template": "from json"}))
    assert Tokenizer.from_hf_dir(other).chat_template == "from json"
    (other / "chat_template.jinja").write_text("from jinja", encoding="utf-8")  # the .jinja file wins
    assert Tokenizer.from_hf_dir(other).chat_template == "from jinja"


def test_the_refusals_words(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tokenizer.json").write_text("{}")
    with pytest.raises(TokenizerError) as e:
        Tokenizer.from_hf_dir(bad)
    assert str(e.value).startswith(f"{bad / 'tokenizer.json'} is not a valid tokenizer file: ")
    listed = tmp_path / "listed"
    listed.mkdir()
    write_hf_dir(listed, {}, {})
    (listed / "tokenizer_config.json").write_text("[1]")
    with pytest.raises(TokenizerError) as e:
        Tokenizer.from_hf_dir(listed)
    assert str(e.value) == f"{listed / 'tokenizer_config.json'} must hold a JSON object, got list"
    (listed / "tokenizer_config.json").write_text("{")
    with pytest.raises(TokenizerError, match="tokenizer_config.json"):
        Tokenizer.from_hf_dir(listed)
    (listed / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": "no"}))
    with pytest.raises(TokenizerError) as e:
        Tokenizer.from_hf_dir(listed)
    assert (
        str(e.value) == f"{listed / 'tokenizer_config.json'}: add_bos_token must be true or false, got 'no'"
    )
    tok = Tokenizer.from_gguf_metadata(_tiny_meta("gpt-2"))
    with pytest.raises(TokenizerError) as e:
        tok.apply_chat_template([])
    assert str(e.value) == "this tokenizer has no chat template; format the prompt yourself"
    with pytest.raises(TypeError) as e:
        tok.stream_decoder(skip_special="yes")
    assert str(e.value) == "skip_special must be True or False, got str 'yes'"
    with pytest.raises(ValueError) as e:
        tok.decode([1, -2])
    assert str(e.value) == "ids[1] = -2 is negative"


@pytest.mark.parametrize("tokens", ["abc", [], ["a", 1]])
def test_a_gguf_token_list_must_be_strings(tokens):
    with pytest.raises(TokenizerError) as e:
        Tokenizer.from_gguf_metadata(_tiny_meta("gpt-2") | {"tokenizer.ggml.tokens": tokens})
    assert str(e.value) == "GGUF metadata lacks tokenizer.ggml.tokens (a non-empty list of strings)"


def test_a_sentencepiece_file_ignores_the_pre_tokenizer_name():
    """llama.cpp reads ``tokenizer.ggml.pre`` for byte-level vocabularies only."""
    tok = Tokenizer.from_gguf_metadata(sentencepiece_meta(**{"tokenizer.ggml.pre": "no-such-name"}))
    assert pieces(tok, "ab") == [f"{SPACE}ab"]


@pytest.mark.parametrize("first, want", [("ab", ["ab", "c"]), ("bc", ["a", "bc"])])
def test_sentencepiece_merges_follow_the_scores(first, want):
    """ "abc" can become "ab"+"c" or "a"+"bc": the better-scored token is made first."""
    tokens = ["<unk>", "<s>", "</s>", "a", "b", "c", "ab", "bc"]
    scores = [0.0, 0.0, 0.0, -1.0, -1.0, -1.0, -2.0, -2.0]
    scores[tokens.index(first)] = -1.5
    meta = sentencepiece_meta() | {
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": [2, 3, 3] + [1] * 5,
        "tokenizer.ggml.add_space_prefix": False,
    }
    assert pieces(Tokenizer.from_gguf_metadata(meta), "abc") == want
    with pytest.raises(TokenizerError) as e:
        Tokenizer.from_gguf_metadata(meta | {"tokenizer.ggml.scores": scores[:-1]})
    assert str(e.value) == "8 tokens but 7 token scores"


def test_sentencepiece_without_scores_merges_in_file_order():
    """Every score 0: merges rank by the merged token's place in the file (▁a, ▁b, ab, ▁ab), so "▁ab▁b"
    becomes ▁a, ▁b, then ▁a+b."""
    meta = sentencepiece_meta()
    del meta["tokenizer.ggml.scores"]
    assert pieces(Tokenizer.from_gguf_metadata(meta), "ab b") == [f"{SPACE}ab", f"{SPACE}b"]


def test_sentencepiece_removes_one_leading_space_on_decode():
    tok = Tokenizer.from_gguf_metadata(sentencepiece_meta())
    for text in ("ab", " ab", "  ab b"):
        assert tok.decode(tok.encode(text, add_bos=False)) == text


def test_an_unknown_sentencepiece_character_is_the_unknown_token():
    """A vocabulary without byte tokens: a character outside it encodes as <unk> (id 0)."""
    tok = Tokenizer.from_gguf_metadata(sentencepiece_meta())
    assert tok.encode("az", add_bos=False) == [6, 0]


def test_a_byte_level_gguf_without_merges_is_refused():
    """llama.cpp: "cannot find tokenizer merges in model file"; kvlens ran it with no merges at all."""
    meta = _tiny_meta("gpt-2")
    del meta["tokenizer.ggml.merges"]
    with pytest.raises(TokenizerError) as e:
        Tokenizer.from_gguf_metadata(meta)
    assert str(e.value) == "GGUF metadata lacks tokenizer.ggml.merges, which a byte-level vocabulary needs"


def test_eot_and_eom_ids_end_generation_and_other_control_tokens_do_not():
    meta = _tiny_meta("gpt-2")  # 0 <|endoftext|> (control, EOS), 1 <|im_end|>, 2 <think>
    meta["tokenizer.ggml.token_type"] = [3, 3, 3] + [1] * (len(meta["tokenizer.ggml.tokens"]) - 3)
    assert Tokenizer.from_gguf_metadata(meta).eos_ids == {0, 1}  # <think> is control but no marker
    extra = {"tokenizer.ggml.eot_token_id": 7, "tokenizer.ggml.eom_token_id": 9}
    assert Tokenizer.from_gguf_metadata(meta | extra).eos_ids == {0, 1, 7, 9}


def test_a_byte_level_gguf_has_no_bos_or_eos_unless_it_says_so():
    """The sentencepiece defaults (BOS 1, EOS 2) are llama.cpp's for that kind only."""
    meta = {k: v for k, v in _tiny_meta("gpt-2").items() if not k.endswith(("bos_token_id", "eos_token_id"))}
    meta["tokenizer.ggml.token_type"] = [1] * len(meta["tokenizer.ggml.tokens"])  # no marker by type
    tok = Tokenizer.from_gguf_metadata(meta)
    assert (tok.bos_id, tok.eos_ids) == (None, {0, 1})  # the markers by their text only
    tok.chat_template = "[{{ bos_token }}][{{ eos_token }}]"
    assert tok.apply_chat_template([]) == "[][]"


@pytest.mark.parametrize(
    "key",
    [
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id",
    ],
)
def test_a_negative_special_id_is_refused_by_name(key):
    with pytest.raises(TokenizerError) as e:
        Tokenizer.from_gguf_metadata(_tiny_meta("gpt-2") | {key: -1})
    assert str(e.value) == f"{key} must be ≥ 0, got -1"


@pytest.mark.parametrize(
    "key, what", [("tokenizer.ggml.bos_token_id", "BOS"), ("tokenizer.ggml.eot_token_id", "EOS")]
)
def test_a_special_id_past_the_vocabulary_is_refused_by_what_it_is(key, what):
    n = len(_tiny_meta("gpt-2")["tokenizer.ggml.tokens"])
    with pytest.raises(TokenizerError) as e:
        Tokenizer.from_gguf_metadata(_tiny_meta("gpt-2") | {key: n})
    assert str(e.value) == f"the {what} token id {n} is outside the tokenizer's {n} tokens"


def test_a_user_defined_token_is_matched_in_the_raw_text():
    """Gemma's runs of spaces are user-defined tokens spelled with real spaces: llama.cpp matches them
    in the text before sentencepiece's space handling (which would turn them into ▁▁)."""
    meta = sentencepiece_meta(**{"tokenizer.ggml.add_space_prefix": False})  # as Gemma's
    meta["tokenizer.ggml.tokens"] = [*meta["tokenizer.ggml.tokens"], "  "]
    meta["tokenizer.ggml.scores"] = [*meta["tokenizer.ggml.scores"], 0.0]
    meta["tokenizer.ggml.token_type"] = [*meta["tokenizer.ggml.token_type"], 4]
    tok = Tokenizer.from_gguf_metadata(meta)
    assert tok.encode("a  b", add_bos=False) == [4, 10, 5]  # a, "  ", b
    assert tok.decode([4, 10, 5]) == "a  b"


def test_an_added_special_token_past_the_base_vocabulary_can_be_the_eos(tmp_path):
    """Llama-3 keeps its special tokens in tokenizer.json's added tokens only, past the model's vocab."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFBackend

    path = write_hf_dir(tmp_path, {"eos_token": "<|eot_id|>"}, {})
    backend = HFBackend.from_file(str(path / "tokenizer.json"))
    backend.add_special_tokens([AddedToken("<|eot_id|>", special=True)])  # id 6
    backend.save(str(path / "tokenizer.json"))
    tok = Tokenizer.from_hf_dir(path)
    assert tok.eos_ids == {6} and tok.encode("a <|eot_id|>") == [4, 6]


# ---- round 2 of the mutation run: what the tests above still left open ----


def test_a_post_processors_bos_is_not_added_twice(tmp_path):
    from tokenizers import Tokenizer as HFBackend
    from tokenizers import processors

    path = write_hf_dir(tmp_path, {"bos_token": "<s>"}, {})
    backend = HFBackend.from_file(str(path / "tokenizer.json"))
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    backend.save(str(path / "tokenizer.json"))
    tok = Tokenizer.from_hf_dir(path)
    assert tok.encode("a b") == [1, 4, 5] and tok.encode("a b", add_bos=False) == [4, 5]


@pytest.mark.parametrize("unk", [None, 10, "0"])  # absent, past the list, not an id: no unknown token
def test_a_sentencepiece_unknown_id_that_names_no_token_is_left_out(unk):
    meta = sentencepiece_meta()
    meta.pop("tokenizer.ggml.unknown_token_id")
    if unk is not None:
        meta["tokenizer.ggml.unknown_token_id"] = unk
    tok = Tokenizer.from_gguf_metadata(meta)
    assert tok.encode("ab", add_bos=False) == [9]
    with pytest.raises(UnspellableTextError, match="'z'"):  # no token, no byte token, no unknown token
        tok.encode("az", add_bos=False)


def test_a_run_of_unknown_sentencepiece_characters_is_one_unknown_token():
    """As transformers' sentencepiece-BPE converter builds it (``fuse_unk=True``)."""
    tok = Tokenizer.from_gguf_metadata(sentencepiece_meta())
    assert tok.encode("azzz", add_bos=False) == [6, 0]


def test_a_declared_eos_past_the_vocabulary_is_named_as_the_eos():
    n = len(_tiny_meta("gpt-2")["tokenizer.ggml.tokens"])
    with pytest.raises(TokenizerError) as e:
        Tokenizer.from_gguf_metadata(_tiny_meta("gpt-2") | {"tokenizer.ggml.eos_token_id": n})
    assert str(e.value) == f"the EOS token id {n} is outside the tokenizer's {n} tokens"


def test_a_gguf_without_token_types_reads_every_token_as_normal():
    meta = _tiny_meta("gpt-2")
    del meta["tokenizer.ggml.token_type"]
    tok = Tokenizer.from_gguf_metadata(meta)
    assert tok.encode("<think>", add_bos=False) != [2]  # not user-defined: spelled out
    assert tok.eos_ids == {0, 1}  # the declared EOS, and <|im_end|> by its text


@pytest.mark.parametrize("merges", [["ab"], "1 2", [1]])
def test_merges_must_be_a_list_of_pairs(merges):
    with pytest.raises(TokenizerError) as e:
        Tokenizer.from_gguf_metadata(_tiny_meta("gpt-2") | {"tokenizer.ggml.merges": merges})
    assert str(e.value) == "tokenizer.ggml.merges must be a list of 'left right' strings"


def test_an_empty_template_list_is_no_template(tmp_path):
    assert Tokenizer.from_hf_dir(write_hf_dir(tmp_path, {"chat_template": []}, {})).chat_template is None


@pytest.mark.parametrize(
    "config, generation, named",
    [
        ({"eos_token_id": -1}, None, "config.json: eos_token_id"),
        ({"bos_token_id": "1"}, None, "config.json: bos_token_id"),
        ({}, {"eos_token_id": [3, -2]}, "generation_config.json: eos_token_id"),
    ],
)
def test_a_bad_id_in_an_hf_config_names_its_file_and_key(tmp_path, config, generation, named):
    with pytest.raises(TokenizerError) as e:
        Tokenizer.from_hf_dir(write_hf_dir(tmp_path, {}, config, generation))
    assert str(e.value).startswith(f"{tmp_path / named} must be")


def test_a_stream_decoder_keeps_special_tokens_unless_told():
    from kvlens.models.tokenizer import StreamDecoder

    tok = Tokenizer.from_gguf_metadata(_tiny_meta("gpt-2"))
    ids = tok.encode("x<|im_end|>", add_bos=False)
    for decoder, want in ((StreamDecoder(tok), "x<|im_end|>"), (StreamDecoder(tok, skip_special=True), "x")):
        assert "".join(decoder.push(i) for i in ids) + decoder.flush() == want
