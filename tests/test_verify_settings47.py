"""``kvlens verify`` loads the record's model with each setting the record names. The weights and the
mirror's prefill read had kvlens' defaults in every verify test, so a verify that ignored them passed
(a mutation run, forty-seventh session); here neither is the default, and a re-run with the default
would show it as a mismatched setting."""

from __future__ import annotations

import json

import pytest
from test_verify import served

import kvlens
from kvlens.engine.verify import verify_file
from kvlens.kv.modes import CacheOptions

TINY_MODEL = ("llama", 11)  # conftest's tiny_dir


@pytest.mark.parametrize(
    ("kv", "weights", "mirror"),
    [("q8+mirror", "bf16", "q8"), ("q8+mirror", "int8", "exact"), ("q8", "int4", "exact")],
)
def test_verify_file_loads_the_records_weights_and_mirror_read(tiny_dir, tmp_path, kv, weights, mirror):
    llm = kvlens.load(
        tiny_dir,
        kv=kv,
        attn_backend="torch",
        weights=weights,
        cache_options=CacheOptions(mirror_prefill=mirror),
    )
    _, out, rec = served(llm)
    assert (rec["weights"], rec["mirror_prefill"]) == (weights, mirror)
    (tmp_path / "record.json").write_text(json.dumps(rec))
    result = verify_file(tmp_path / "record.json")
    assert result.ok and result.mismatched == {}, result.message


def test_a_request_that_stops_at_eos_is_recorded_and_verified(tiny_dir):
    """``stop_ids`` None (the tokenizer's EOS ids, every request a user sends) is recorded as null and
    re-run as such: the output stops at an EOS on the re-run too. The record says which format and
    which kvlens wrote it."""
    from kvlens import __version__
    from kvlens.engine.scheduler import run_alone
    from kvlens.engine.sequence import Request
    from kvlens.engine.verify import make_record, verify_record

    llm = kvlens.load(tiny_dir, kv="q8", attn_backend="torch")
    prompt, n = [5, 17, 42, 99], 8
    free = [ev.token_id for ev in run_alone(llm, Request("r", prompt, n, stop_ids=frozenset()))]
    free = [t for t in free if t is not None]
    i = next((j for j in range(1, n) if free[j] not in free[:j]), 0)  # a token first produced at i
    llm.tokenizer.eos_ids = {free[i]}  # the random model's EOS for this test: it stops there
    req = Request("r", prompt, n)
    assert req.stop_ids is None
    out = [ev.token_id for ev in run_alone(llm, req) if ev.token_id is not None]
    assert out == free[: i + 1]
    rec = make_record(llm, req, out)
    assert rec["stop_ids"] is None and (rec["record_version"], rec["kvlens_version"]) == (1, __version__)
    result = verify_record(llm, json.loads(json.dumps(rec)))
    assert result.ok, result.message
