"""The LLM's own API edges: variants refuse what does not fit, a sparse engine's caches track block
bounds, chunk starts are absolute, generation takes its stop rule as given and ends its text before
an EOS, and a decode batch is each sequence alone."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny_models import write_hf

import kvlens
from kvlens.engine.sampling import SamplingParams
from kvlens.kv.blocks import SparseConfig
from kvlens.kv.kinds import StoreKind as S
from kvlens.kv.modes import CacheOptions, KVMode

TINY_MODEL = ("qwen2", 0)  # conftest's tiny_dir: 2 layers, 2 KV heads


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return kvlens.load(tiny_dir, kv="q8", attn_backend="numba", prefill_chunk=16)


def test_variant_refuses_unknown_settings_and_recipes_of_another_model(tiny):
    with pytest.raises(TypeError, match="LLM has no setting 'kv_mode'"):
        tiny.variant(kv_mode="q8")
    three_layers = KVMode("r3", S.Q8, S.Q8, layers=((S.Q8, S.Q8),) * 3)
    with pytest.raises(ValueError, match="KV recipe r3 has 3 layers; the model has 2"):
        tiny.variant(kv=three_layers)
    assert tiny.variant(kv=KVMode("r2", S.Q8, S.F16, layers=((S.Q8, S.F16),) * 2)).kv.name == "r2"


def test_a_sparse_engines_caches_track_block_bounds(tiny):
    """Its own caches track bounds whatever options they are given; a dense engine's do not."""
    sparse = tiny.variant(sparse=SparseConfig("quest", 32, 1, 0))
    assert tiny.new_cache(64).bounds is None
    assert sparse.new_cache(64).bounds is not None
    assert sparse.new_cache(64, "q8", CacheOptions()).bounds is not None
    assert len(list(sparse.generate_ids([5, 17, 200, 33] * 20, 4, stop_at_eos=False))) == 4


def test_prefill_hands_on_hidden_absolute_chunk_starts(tiny):
    ids = [5, 17, 200, 33, 41, 9, 128, 77, 64, 3, 250]
    cache = tiny.new_cache(len(ids))
    tiny.prefill(ids[:3], cache)
    starts = []
    tiny.prefill(ids[3:], cache, chunk=4, start=3, on_hidden=lambda s, h: starts.append((s, h.shape[0])))
    assert starts == [(3, 4), (7, 4)]


def test_without_stop_at_eos_generation_runs_past_an_eos(tiny, monkeypatch):
    """The first greedy token made an EOS: generation stops on it, or without stop_at_eos runs on, on
    the serving path and the LLM's own loop (an explicit cache) alike."""
    prompt = [5, 17, 200, 33]
    first = next(tiny.generate_ids(prompt, 1))
    monkeypatch.setattr(tiny.tokenizer, "eos_ids", {first})
    for cache in (None, tiny.new_cache(16)):
        assert list(tiny.generate_ids(prompt, 6, cache=cache)) == [first]
    for make_cache in (lambda: None, lambda: tiny.new_cache(16)):
        assert len(list(tiny.generate_ids(prompt, 6, stop_at_eos=False, cache=make_cache()))) == 6


def test_what_the_serving_engine_runs(tiny):
    """The paged pool serves dense decode and a recipe's sink of one block (32 positions) at most."""
    assert tiny.servable
    assert not tiny.variant(sparse=SparseConfig("quest", 32, 1, 0)).servable
    sink = {n: KVMode(f"s{n}", S.Q8, S.Q8, keep_sink=n) for n in (32, 33)}
    assert tiny.variant(kv=sink[32]).servable and not tiny.variant(kv=sink[33]).servable


def test_sparse_generation_selects_blocks(tiny, monkeypatch):
    """A sparse engine's generation decodes sparse (its own loop), not dense through the scheduler."""
    from kvlens.engine import attention

    calls = []
    select = attention.select_blocks
    monkeypatch.setattr(attention, "select_blocks", lambda *a: calls.append(a[2]) or select(*a))
    sparse = tiny.variant(sparse=SparseConfig("quest", 32, 1, 0))
    list(sparse.generate_ids([5, 17, 200, 33] * 20, 3, stop_at_eos=False))
    assert calls == [1, 1]  # layer 1 (after the one dense layer) of the two decode steps


def test_chat_prompts_carry_one_bos_and_the_system_message(tmp_path):
    """The chat template writes the BOS itself: encoding does not add a second; a system message is
    rendered before the user's."""
    import json
    from types import SimpleNamespace

    from tiny_models import write_tokenizer_json

    from kvlens.models.tokenizer import Tokenizer

    write_tokenizer_json(tmp_path)
    template = "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m.role }}: {{ m.content }}<|im_end|>{% endfor %}"
    config = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "add_bos_token": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": template}))
    tok = Tokenizer.from_hf_dir(tmp_path)
    engine = SimpleNamespace(tokenizer=tok)
    ids = kvlens.LLM.encode_prompt(engine, "hi", chat=True, system="be brief")
    assert ids.count(tok.bos_id) == 1 and ids[0] == tok.bos_id
    assert (
        tok.decode(ids) == "<|endoftext|><|im_start|>system: be brief<|im_end|><|im_start|>user: hi<|im_end|>"
    )
    assert kvlens.LLM.encode_prompt(engine, "hi")[:1] == [tok.bos_id]  # plain text: BOS added once


def test_generated_text_ends_before_the_eos(tiny, monkeypatch):
    """An EOS ends the text and is not part of it, alone (generate) and in a batch (generate_batch)."""
    prompt = "the the"
    first = next(tiny.generate_ids(tiny.encode_prompt(prompt), 1))
    assert tiny.tokenizer.decode([first]) != ""
    monkeypatch.setattr(tiny.tokenizer, "eos_ids", {first})
    assert tiny.generate(prompt, 6) == ""
    assert tiny.generate_batch([prompt, prompt], 6) == ["", ""]


def test_generated_text_keeps_a_char_cut_short_at_the_end(tiny, monkeypatch):
    """Text held back as a UTF-8 char split over tokens is flushed at the end: returned and streamed."""
    tok = tiny.tokenizer
    e_acute = tok.encode("é", add_bos=False)
    assert len(e_acute) == 2  # two byte tokens
    ids = tok.encode("Ab", add_bos=False) + e_acute[:1]
    monkeypatch.setattr(tiny, "generate_ids", lambda *a, **kw: iter(ids))
    pieces = []
    text = tiny.generate("x", 8, on_text=pieces.append)
    assert text == "".join(pieces) == "Ab\ufffd"


def test_capture_returns_the_layers_in_the_order_asked(tiny):
    ids = [5, 17, 200, 33]
    every = tiny.capture_qkv(ids)
    for got, want in zip(tiny.capture_qkv(ids, [1, 0]), (every[1], every[0]), strict=True):
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_generate_command_hands_the_engine_every_setting(monkeypatch, capsys):
    """`kvlens generate`'s body: the load options, the sampling, the fit check with the new tokens,
    and the prompt echoed before a plain continuation (not before a chat answer)."""
    from kvlens.engine import generate

    seen = {}

    class Engine:
        attn_backend, kv = "torch", "q8+mirror"  # read by the backend-and-mode check (torch reads any)

        def encode_prompt(self, prompt, chat):
            return [7] * len(prompt)

        def check_fits(self, n):
            seen["fits"] = n

        def generate(self, prompt, n, chat, sampling, on_text):
            seen["sampling"] = sampling
            on_text("!")
            return "!"

    def load(model, **kw):
        seen["load"] = (model, kw)
        return Engine()

    monkeypatch.setattr(kvlens, "load", load)
    sparse = SparseConfig("probe", 64, 1, 0)
    cfg = generate.GenerateConfig(
        "hello", model="m.gguf", kv="q8+mirror", max_tokens=5, temperature=0.5, top_k=3, top_p=0.9, seed=4,
        prefill_chunk=7, attn_backend="torch", mirror_prefill="q8", weights="int8", sparse=sparse,
    )  # fmt: skip
    assert generate.main(cfg) == "!"
    options = CacheOptions(mirror_prefill="q8")
    want = {"kv": "q8+mirror", "device": None, "attn_backend": "torch", "cache_options": options,
            "prefill_chunk": 7, "weights": "int8", "sparse": sparse}  # fmt: skip
    assert seen["load"] == ("m.gguf", want)
    assert seen["sampling"] == SamplingParams(temperature=0.5, top_k=3, top_p=0.9, seed=4)
    assert seen["fits"] == 5 + 5 and capsys.readouterr().out == "hello!\n"
    generate.main(dataclasses.replace(cfg, chat=True))
    assert capsys.readouterr().out == "!\n"


@pytest.mark.parametrize(("length", "want"), [(0, (0, 16)), (24, (24, 32)), (32, (32, 48)), (64, (64, 70))])
def test_prefill_chunks_end_at_absolute_multiples_of_the_chunk(length, want):
    """A prefill resumed mid-chunk (as after a prefix-cache hit of whole 32-position blocks under a
    chunk that does not divide 32) ends its next chunk where the request's chunks end alone."""
    from types import SimpleNamespace

    from kvlens.engine.sequence import Request, Sequence

    req = Request("r", list(range(70)), 4)
    seq = Sequence(req, SimpleNamespace(length=length), None, frozenset(), list(req.prompt_ids))
    assert seq.next_chunk(16) == want
    assert seq.in_prefill


@pytest.mark.parametrize("window", [None, 4])
def test_a_decode_batch_is_each_sequence_decoded_alone(tmp_path, window):
    """ModelRunner.decode over two sequences (the scheduler's step) equals each one's own step bit for
    bit: the one-call path is for a single sequence, and a sliding window (Mistral's, here 4 of the
    8 positions) holds in the batch as alone."""
    from kvlens.engine.model_runner import ModelRunner

    arch = "qwen2" if window is None else "mistral"
    write_hf(arch, tmp_path, sliding_window=window)
    llm = kvlens.load(str(tmp_path), kv="q8", attn_backend="numba")
    assert llm.fused is not None and llm.config.sliding_window == window
    runner, seqs = ModelRunner(llm), [[5, 17, 200, 33, 41, 9, 128, 77], [6, 9, 100, 3, 42, 250, 64, 2]]

    def decode(batch):
        caches = [llm.new_cache(len(s)) for s in batch]
        for cache, s in zip(caches, batch, strict=True):
            llm.forward(s[:-1], cache, 0)
        return runner.decode(caches, [s[-1] for s in batch], [len(s) - 1 for s in batch])

    together = decode(seqs)
    for b, s in enumerate(seqs):
        assert torch.equal(together[b], decode([s])[0]), f"row {b}"
