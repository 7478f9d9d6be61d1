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
