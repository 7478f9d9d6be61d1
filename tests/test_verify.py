"""``kvlens verify`` and its records, in-process on a tiny random model: a record's digests by hand, a
re-run that matches, and every way one can fail to (a changed, a longer or a shorter output, other
settings, a tampered digest, a sampled request without its seed), each with the index and ids it names."""

from __future__ import annotations

import copy
import hashlib
import json
import struct

import pytest
from test_bad_input_cli import run_main

from kvlens.engine.sampling import SamplingParams
from kvlens.engine.scheduler import run_alone
from kvlens.engine.sequence import Request
from kvlens.engine.verify import make_record, verify_file, verify_record

TINY_MODEL = ("llama", 11)  # conftest's tiny_dir
N_OUT = 10
PROMPT = [5, 17, 42, 99, 7, 3, 250, 64, 12]


def sha(ids: list[int]) -> str:
    """The record's digest, written out: sha256 of the ids as little-endian int32."""
    return hashlib.sha256(struct.pack(f"<{len(ids)}i", *ids)).hexdigest()


@pytest.fixture(scope="module")
def llm(tiny_dir):
    import kvlens

    return kvlens.load(tiny_dir, kv="q8", attn_backend="torch", weights="f32")


def served(llm, sampling: SamplingParams | None = None, stop: frozenset[int] | None = None):
    """A request as the server runs it, its output ids and its record."""
    req = Request("r", list(PROMPT), N_OUT, sampling or SamplingParams(), stop if stop else frozenset())
    out = [ev.token_id for ev in run_alone(llm, req) if ev.token_id is not None]
    return req, out, make_record(llm, req, out)


def with_output(record: dict, ids: list[int]) -> dict:
    """The record with other output ids and their own (correct) digest: only the comparison can tell."""
    other = copy.deepcopy(record)
    other["output_ids"], other["output_sha256"] = ids, sha(ids)
    return other


def test_a_record_names_what_produced_it(llm):
    req, out, rec = served(llm, SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=123))
    assert len(out) == N_OUT
    assert rec["prompt_ids"] == PROMPT and rec["prompt_sha256"] == sha(PROMPT)
    assert rec["output_ids"] == out and rec["output_sha256"] == sha(out)
    assert rec["sampling"] == {"temperature": 0.7, "top_k": 5, "top_p": 0.9, "seed": 123}
    assert rec["max_tokens"] == N_OUT and rec["stop_ids"] == []
    assert (rec["kv"], rec["weights"], rec["attn_backend"], rec["device"]) == ("q8", "f32", "torch", "cpu")
    assert rec["prefill_chunk"] == llm.prefill_chunk and rec["mirror_prefill"] == "exact"
    assert rec["model"]["sha256"] == llm.loaded.file_sha256
    json.dumps(rec)  # a record is JSON as it stands


def test_the_same_request_re_run_alone_is_verified(llm):
    _, out, rec = served(llm)
    result = verify_record(llm, rec)
    assert result.ok and not result.mismatched and result.first_divergence is None
    assert result.message == f"verified: {N_OUT} output tokens identical (sha256 {sha(out)[:16]})"


def test_a_seeded_sampled_request_is_verified(llm):
    _, out, rec = served(llm, SamplingParams(temperature=1.0, seed=2026))
    assert verify_record(llm, rec).ok


@pytest.mark.parametrize("at", [0, 4, N_OUT - 1])
def test_a_changed_output_token_is_found_where_it_changed(llm, at):
    _, out, rec = served(llm)
    changed = list(out)
    changed[at] = (out[at] + 1) % llm.config.vocab
    result = verify_record(llm, with_output(rec, changed))
    assert not result.ok
    assert (result.first_divergence, result.expected, result.got) == (at, changed[at], out[at])
    assert result.message == (
        f"diverged at output token {at}: expected id {changed[at]}, got id {out[at]} "
        f"({N_OUT} recorded, {N_OUT} re-run)"
    )


def test_a_record_longer_or_shorter_than_the_re_run(llm):
    _, out, rec = served(llm)
    longer = verify_record(llm, with_output(rec, [*out, 7]))
    assert (longer.ok, longer.first_divergence, longer.expected, longer.got) == (False, N_OUT, 7, None)
    assert f"({N_OUT + 1} recorded, {N_OUT} re-run)" in longer.message
    shorter = verify_record(llm, with_output(rec, out[:-3]))
    assert (shorter.ok, shorter.first_divergence) == (False, N_OUT - 3)
    assert (shorter.expected, shorter.got) == (None, out[N_OUT - 3])


def test_a_stop_id_ends_the_re_run_where_it_ended_the_request(llm):
    _, out, _ = served(llm)
    stop = out[3]
    first = out.index(stop)  # the first time the stop id comes (it is reported, then the request ends)
    _, stopped, rec = served(llm, stop=frozenset({stop}))
    assert stopped == out[: first + 1] and rec["stop_ids"] == [stop] and rec["max_tokens"] == N_OUT
    assert verify_record(llm, rec).ok
    no_stop = dict(rec, stop_ids=[])  # the same record without its stop: the re-run goes on past it
    assert first + 1 < N_OUT and verify_record(llm, no_stop).first_divergence == first + 1


def test_other_settings_are_named(llm):
    _, _, rec = served(llm)
    other = dict(rec, kv="f16", prefill_chunk=rec["prefill_chunk"] * 2)
    other["model"] = {"source": "x", "sha256": "0" * 64}
    result = verify_record(llm, other)
    assert result.ok  # the same ids all the same: the re-run used this LLM's settings
    assert result.mismatched == {
        "model sha256": ("0" * 64, llm.loaded.file_sha256),
        "kv": ("f16", "q8"),
        "prefill_chunk": (rec["prefill_chunk"] * 2, llm.prefill_chunk),
    }
    assert result.message.endswith(
        f"; settings differ: model sha256 {'0' * 64} vs {llm.loaded.file_sha256}, kv f16 vs q8, "
        f"prefill_chunk {rec['prefill_chunk'] * 2} vs {llm.prefill_chunk}"
    )


def test_a_record_that_does_not_add_up_is_refused(llm):
    _, out, rec = served(llm)
    cases = [
        (dict(rec, output_sha256=sha(out[:-1])), "output ids do not match its output_sha256"),
        (dict(rec, prompt_ids=PROMPT[:-1]), "prompt ids do not match its prompt_sha256"),
        ({k: v for k, v in rec.items() if k not in ("kv", "cpu")}, "missing kv, cpu"),
    ]
    for bad, needle in cases:
        with pytest.raises(ValueError, match=needle):
            verify_record(llm, bad)


def test_a_sampled_record_without_its_seed_cannot_be_re_run(llm):
    _, _, rec = served(llm, SamplingParams(temperature=0.8, seed=5))
    rec["sampling"]["seed"] = None
    result = verify_record(llm, rec)
    assert not result.ok and result.message == "a sampled request without a seed cannot be re-run"


def test_verify_file_reads_a_record_or_a_whole_response(tiny_dir, tmp_path):
    """The record's model is loaded with the record's settings (none of them kvlens' defaults here)."""
    import kvlens

    other = kvlens.load(tiny_dir, kv="k=q8,v=f16", attn_backend="torch", weights="f32", prefill_chunk=4)
    _, out, rec = served(other)
    assert (rec["kv"], rec["prefill_chunk"]) == ("k=q8,v=f16", 4)
    (tmp_path / "record.json").write_text(json.dumps(rec))
    (tmp_path / "response.json").write_text(json.dumps({"id": "cmpl-1", "kvlens": rec}))
    for name in ("record.json", "response.json"):
        result = verify_file(tmp_path / name)
        assert result.ok and not result.mismatched, result.message


def test_the_command_exits_1_naming_the_divergence(llm, tmp_path, monkeypatch, capsys):
    _, out, rec = served(llm)
    changed = [*out[:2], (out[2] + 1) % llm.config.vocab, *out[3:]]
    (tmp_path / "ok.json").write_text(json.dumps(rec))
    (tmp_path / "changed.json").write_text(json.dumps(with_output(rec, changed)))
    code, stdout, _ = run_main(monkeypatch, capsys, "verify", str(tmp_path / "ok.json"))
    assert code == 0 and stdout.startswith(f"verified: {N_OUT} output tokens identical")
    code, stdout, _ = run_main(monkeypatch, capsys, "verify", str(tmp_path / "changed.json"))
    assert code == 1 and stdout.startswith(f"diverged at output token 2: expected id {changed[2]}")
