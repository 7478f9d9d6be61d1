"""Text <-> token ids, built on the `tokenizers` library from GGUF metadata or a HF tokenizer.json.

A GGUF carries no tokenizer.json, only llama.cpp's description of one (vocab, merges, a named
pre-tokenizer), so `from_gguf_metadata` rebuilds it the way llama.cpp interprets those keys.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

from ..checks import check_bool, check_int, check_token_ids, read_json
from .spm_spelling import SPACE, spelling_check
from .token_bytes import token_bytes_reader


class TokenizerError(ValueError):
    """The tokenizer description is unsupported or incomplete, or a template is missing."""


_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
_GPT2_SPLIT = (
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"  # as llama.cpp spells it
)
# llama.cpp's "default" pre-tokenizer (also a file that names none): these splits in turn, each within
# the pieces of the one before (runs of punctuation, GPT-2's, runs of digits, then groups of three).
_DEFAULT_SPLITS = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]")
# tokenizer.ggml.pre value -> pre-tokenizer family (llama.cpp's names, including its aliases; "gpt2"
# is kvlens' older spelling of llama.cpp's "gpt-2").
_PRE_FAMILY = {
    None: "default", "default": "default", "gpt-2": "gpt2", "gpt2": "gpt2", "smollm": "smollm",
    "llama3": "llama3", "llama-v3": "llama3", "llama-bpe": "llama3",
    "qwen2": "qwen2", "deepseek-r1-qwen": "qwen2",
}  # fmt: skip
_SPLITS = {"default": _DEFAULT_SPLITS, "llama3": (_LLAMA3_SPLIT,), "qwen2": (_QWEN2_SPLIT,)}
# Control tokens llama.cpp treats as end-of-generation by their text, besides the declared ids.
_EOG_TEXTS = {
    "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
    "<|end_of_text|>", "<EOT>", "_<EOT>", "<｜end▁of▁sentence｜>", "<end_of_utterance>",
}  # fmt: skip
_CONTROL, _USER_DEFINED = 3, 4
_EOT_KEYS = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")  # also end generation


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    family = _PRE_FAMILY.get(pre)
    if family is None:
        raise TokenizerError(
            f"unsupported tokenizer.ggml.pre {pre!r}; known: {sorted(p for p in _PRE_FAMILY if p)}"
        )
    if family == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if family == "smollm":  # llama.cpp: every \p{N} on its own, then the GPT-2 regex
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    return pre_tokenizers.Sequence(
        [
            *(pre_tokenizers.Split(Regex(split), behavior="isolated") for split in _SPLITS[family]),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _gguf_flag(meta: dict, key: str, default: bool) -> bool:
    """A GGUF bool, ``default`` where absent; another type is refused, as llama.cpp refuses it (a
    string "false" would read as true)."""
    value = meta.get(key, default)
    if not isinstance(value, bool):
        raise TokenizerError(f"{key} must be a bool, got {type(value).__name__} {value!r}")
    return value


def _sentencepiece_backend(meta: dict, tokens: list[str], prefix: bool) -> tuple[_HFTokenizer, list[str]]:
    """A sentencepiece-BPE vocabulary (``tokenizer.ggml.model = llama``) as a `tokenizers` BPE with byte
    fallback, and the tokens as it spells them; ``prefix``: a space goes before the text.

    Such a file lists no merges: they are recovered from the vocabulary, every token cut in two known
    halves, ranked by the token's score (best first; ties by file order), which is the order llama.cpp's
    sentencepiece tokenizer merges in. (Gemma's runs of spaces are user-defined tokens spelled with
    real spaces: matched whole in the raw text, as llama.cpp does, they need no respelling.)
    """
    scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    if len(scores) != len(tokens):
        raise TokenizerError(f"{len(tokens)} tokens but {len(scores)} token scores")
    vocab = {t: i for i, t in enumerate(tokens)}
    found = []
    for token, i in vocab.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                found.append((-float(scores[i]), i, -len(left), left, right))
    found.sort()
    merges = [(left, right) for *_, left, right in found]
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    unk_text = tokens[unk] if isinstance(unk, int) and 0 <= unk < len(tokens) else None
    backend = _HFTokenizer(models.BPE(vocab, merges, unk_token=unk_text, fuse_unk=True, byte_fallback=True))
    steps = [normalizers.Prepend(SPACE)] if prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE)])
    strip = [decoders.Strip(" ", 1, 0)] if prefix else []
    backend.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
    )
    return backend, tokens


def _as_ids(value: Any, name: str) -> list[int]:
    if value is None:
        return []
    try:
        return [
            check_int(v, name, minimum=0) for v in (value if isinstance(value, (list, tuple)) else [value])
        ]
    except (TypeError, ValueError) as e:
        raise TokenizerError(str(e)) from None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    data = read_json(path, TokenizerError)
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json spells special tokens as a string or as an AddedToken dict.
    return value.get("content") if isinstance(value, dict) else value


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False
) -> str:
    # Like HF: no HTML escaping, unlike jinja's built-in tojson.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationBlock(jinja2.ext.Extension):
    """transformers' ``{% generation %}…{% endgeneration %}``, which marks an assistant turn for
    training (TRL's assistant-only loss puts it in fine-tuned models' templates); rendered as its body,
    as transformers and vLLM render it."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


@lru_cache(maxsize=8)
def _compile_template(source: str) -> jinja2.Template:
    # The same environment transformers uses, so templates render byte-identically.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class Tokenizer:
    def __init__(
        self,
        backend: _HFTokenizer,
        bos_id: int | None,
        eos_id: int | None,
        eos_ids: set[int],
        add_bos: bool,
        chat_template: str | None,
        check_spelling: Callable[[str], None] | None = None,
    ) -> None:
        n = backend.get_vocab_size(with_added_tokens=True)
        for what, i in [("BOS", bos_id), ("EOS", eos_id), *(("EOS", i) for i in eos_ids)]:
            if i is not None and not 0 <= i < n:
                raise TokenizerError(f"the {what} token id {i} is outside the tokenizer's {n} tokens")
        self._tok = backend
        self.bos_id = bos_id
        self._eos_id = eos_id  # the declared EOS, which templates see as eos_token
        self.eos_ids = eos_ids | ({eos_id} if eos_id is not None else set())
        self.add_bos = add_bos
        self.chat_template = chat_template
        self._bytes_of: Callable[[int], bytes | None] | None = None  # built on first use
        self._check_spelling = check_spelling  # kvlens.models.spm_spelling; None: nothing to refuse

    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> Tokenizer:
        model = meta.get("tokenizer.ggml.model")
        if model not in ("gpt2", "llama"):
            raise TokenizerError(
                f"unsupported tokenizer model {model!r} (byte-level BPE 'gpt2' and sentencepiece 'llama' are)"
            )
        pre = meta.get("tokenizer.ggml.pre")
        pre_tok = _pre_tokenizer(pre) if model == "gpt2" else None  # fail before the (slower) build
        tokens = meta.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
            raise TokenizerError("GGUF metadata lacks tokenizer.ggml.tokens (a non-empty list of strings)")
        types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        if len(types) != len(tokens):
            raise TokenizerError(f"{len(tokens)} tokens but {len(types)} token types")
        llama3 = model == "gpt2" and _PRE_FAMILY[pre] == "llama3"
        # sentencepiece: a space before the text (llama.cpp's default), which its encoder and the
        # spelling check below both need
        prefix = model == "llama" and _gguf_flag(meta, "tokenizer.ggml.add_space_prefix", True)
        if model == "llama":
            backend, tokens = _sentencepiece_backend(meta, tokens, prefix)
        else:
            merges = meta.get("tokenizer.ggml.merges")
            if merges is None:  # llama.cpp: "cannot find tokenizer merges in model file"
                raise TokenizerError(
                    "GGUF metadata lacks tokenizer.ggml.merges, which a byte-level vocabulary needs"
                )
            if not isinstance(merges, list) or not all(isinstance(m, str) and " " in m for m in merges):
                raise TokenizerError("tokenizer.ggml.merges must be a list of 'left right' strings")
            merges = [tuple(m.split(" ", 1)) for m in merges]
            # llama.cpp (and Llama-3's own tokenizer.json) look a whole pre-token up in the vocab first.
            bpe = models.BPE(
                {t: i for i, t in enumerate(tokens)}, merges, byte_fallback=False, ignore_merges=llama3
            )
            backend = _HFTokenizer(bpe)
            backend.pre_tokenizer = pre_tok
            backend.decoder = decoders.ByteLevel()
        # Both kinds are matched whole in the input (so a templated "<|im_start|>" is one id). As in
        # transformers' GGUF loader, control tokens are special (dropped by skip_special) and
        # user-defined ones are not; llama.cpp also always prints user-defined tokens. An end-of-turn
        # marker is a control token whatever its stated type, as llama.cpp overrides it
        # ("control-looking token ... its type will be overridden").
        typed = [(t, _CONTROL if t in _EOG_TEXTS else y) for t, y in zip(tokens, types, strict=True)]
        backend.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t, y in typed if y == _CONTROL]
        )
        backend.add_tokens(
            [AddedToken(t, special=False, normalized=False) for t, y in typed if y == _USER_DEFINED]
        )
        # Where the file does not say, llama.cpp's defaults: a sentencepiece vocabulary has BOS 1 and
        # EOS 2 and adds BOS; a byte-level one adds BOS only in the Llama-3 family.
        spm = model == "llama"
        bos = meta.get("tokenizer.ggml.bos_token_id", 1 if spm else None)
        eos_id = meta.get("tokenizer.ggml.eos_token_id", 2 if spm else None)
        eos = {i for key in _EOT_KEYS for i in _as_ids(meta.get(key), key)}
        eos |= {i for i, t in enumerate(tokens) if t in _EOG_TEXTS}
        add_bos = _gguf_flag(meta, "tokenizer.ggml.add_bos_token", llama3 or spm) and bos is not None
        bos, eos_id = (
            None if v is None else _as_ids(v, f"tokenizer.ggml.{k}_token_id")[0]
            for k, v in (("bos", bos), ("eos", eos_id))
        )
        specials = [t for t, y in typed if y in (_CONTROL, _USER_DEFINED)]
        # Where the file names an unknown token, an unspellable character becomes it, as in sentencepiece.
        check = spelling_check(tokens, prefix, specials) if spm and backend.model.unk_token is None else None
        return cls(backend, bos, eos_id, eos, add_bos, meta.get("tokenizer.chat_template"), check)

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise TokenizerError(f"no tokenizer.json in {path}")
        try:
            backend = _HFTokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as e:  # the tokenizers library raises a bare Exception on a bad file
            raise TokenizerError(f"{path / 'tokenizer.json'} is not a valid tokenizer file: {e}") from e
        cfg = _read_json(path / "tokenizer_config.json")
        model_cfg = _read_json(path / "config.json")
        gen_cfg = _read_json(path / "generation_config.json")

        def tid(text: str | None) -> int | None:
            return None if text is None else backend.token_to_id(text)

        bos = tid(_token_text(cfg.get("bos_token")))
        if bos is None and model_cfg.get("bos_token_id") is not None:
            bos = _as_ids(model_cfg["bos_token_id"], f"{path / 'config.json'}: bos_token_id")[0]
        eos_id = tid(_token_text(cfg.get("eos_token")))
        gen_eos = _as_ids(gen_cfg.get("eos_token_id"), f"{path / 'generation_config.json'}: eos_token_id")
        model_eos = _as_ids(model_cfg.get("eos_token_id"), f"{path / 'config.json'}: eos_token_id")
        if eos_id is None:  # the first that generation_config.json, else config.json, lists
            eos_id = next(iter(gen_eos or model_eos), None)
        eos = set(gen_eos) | set(model_eos)
        eos |= {
            i for i, t in backend.get_added_tokens_decoder().items() if t.special and t.content in _EOG_TEXTS
        }
        if cfg.get("add_bos_token") is not None:  # null: as absent
            add_bos = cfg["add_bos_token"]
            if not isinstance(add_bos, bool):  # "false" would read as true
                raise TokenizerError(
                    f"{path / 'tokenizer_config.json'}: add_bos_token must be true or false, got {add_bos!r}"
                )
        else:  # Llama-3 style: BOS comes from tokenizer.json's post-processor, so probe it.
            probe = backend.encode("a", add_special_tokens=True).ids
            add_bos = bos is not None and probe[:1] == [bos]
        template = cfg.get("chat_template")
        if isinstance(template, list):  # older multi-template form: [{"name", "template"}]
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default", next(iter(named.values()), None))
        if template is None and (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        if template is None:
            template = _read_json(path / "chat_template.json").get("chat_template")
        return cls(backend, bos, eos_id, eos, add_bos and bos is not None, template)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def bos_prefix(self) -> list[int]:
        """What :meth:`encode` puts before the text by default: ``[bos_id]`` where the model's
        tokenizer adds a BOS, else nothing. Every caller that builds token ids by hand uses this."""
        return [self.bos_id] if self.add_bos and self.bos_id is not None else []

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        # add_special_tokens=False: the post-processor never adds anything; BOS is ours to add.
        # encode_batch, unlike encode, lets go of the GIL while it runs: a server tokenizing a long
        # prompt in a worker thread keeps answering other requests (the same ids).
        if self._check_spelling is not None:
            self._check_spelling(text)
        ids = self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        if add_bos is None:
            return self.bos_prefix + ids
        return ([self.bos_id] if add_bos and self.bos_id is not None else []) + ids

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        """The text of ``ids``. An id past the tokenizer's tokens (a model's padding rows) decodes to
        nothing, as in HF tokenizers; a negative or non-integer id is refused."""
        ids = check_token_ids(ids, None, "ids", allow_empty=True)
        return self._decode(ids, check_bool(skip_special, "skip_special"))

    def _decode(self, ids: list[int], skip_special: bool) -> str:
        """:meth:`decode` of ids already checked (the stream decoder checks each id once, as it comes)."""
        return self._tok.decode(ids, skip_special_tokens=skip_special)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes | None:
        """The bytes ``token_id`` stands for in a text (part of a UTF-8 character for some tokens), or
        None where the decoder does not say (kvlens.models.token_bytes)."""
        if self._bytes_of is None:
            self._bytes_of = token_bytes_reader(self._tok)
        return self._bytes_of(token_id)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise TokenizerError("this tokenizer has no chat template; format the prompt yourself")
        tok = self._tok.id_to_token
        return _compile_template(self.chat_template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=tok(self.bos_id) if self.bos_id is not None else "",
            eos_token=tok(self._eos_id) if self._eos_id is not None else "",
        )

    def stream_decoder(self, skip_special: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special)


class StreamDecoder:
    """Incremental detokenizer: each push returns only text that is final.

    Decodes a short window of recent tokens twice (with and without the new one) and emits the
    difference, which is right for any decoder (byte-level, or sentencepiece's leading-space
    rules); text ending in U+FFFD is held back, since it is usually a UTF-8 char split over tokens.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False) -> None:
        self._tok = tokenizer
        self._skip = check_bool(skip_special, "skip_special")
        self._ids: list[int] = []  # window: ids[:_read] already emitted, the rest pending
        self._read = 0

    def push(self, token_id: int) -> str:
        self._ids.append(check_int(token_id, "token id", minimum=0))
        done = self._tok._decode(self._ids[: self._read], self._skip)
        text = self._tok._decode(self._ids, self._skip)
        if len(text) <= len(done) or text.endswith("\ufffd"):
            return ""
        # Slide the window: keep the last emitted chunk as context for the next decode.
        self._ids = self._ids[self._read :]
        self._read = len(self._ids)
        return text[len(done) :]

    def flush(self) -> str:
        """Whatever is still held back (possibly with U+FFFD); resets the decoder."""
        done = self._tok._decode(self._ids[: self._read], self._skip)
        text = self._tok._decode(self._ids, self._skip)
        self._ids, self._read = [], 0
        return text[len(done) :]
