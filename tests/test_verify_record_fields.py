"""A record whose fields are not of the types ``make_record`` writes is refused by name before anything
loads (thirty-sixth session: such records ended in "internal error" from deep inside, or ran cut to
what they held: ``prefill_chunk`` 32.7 as 32, ``stop_ids`` "abc" as three ids, version 99 as 1). The
record here is written out by hand, as a client would send it."""

from __future__ import annotations

import pytest

from kvlens.engine.verify import _check_record, ids_sha256

PROMPT, OUTPUT = [1, 2, 3], [4, 5]


def record(**changes) -> dict:
    base = {
        "record_version": 1, "model": {"source": "smollm2", "sha256": "ab" * 32}, "kv": "q8",
        "weights": "auto", "attn_backend": "numba", "prefill_chunk": 512, "mirror_prefill": "exact",
        "device": "cpu", "cpu": "znver4", "sampling": {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": None},
        "max_tokens": 2, "stop_ids": None, "prompt_ids": PROMPT, "prompt_sha256": ids_sha256(PROMPT),
        "output_ids": OUTPUT, "output_sha256": ids_sha256(OUTPUT),
    }  # fmt: skip
    return base | changes


def test_a_record_as_written_passes():
    _check_record(record())
    _check_record(record(sampling={"temperature": 1, "top_k": 5, "top_p": 0.9, "seed": 7}, stop_ids=[2]))


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"record_version": 99}, "record_version: Input should be 1"),
        ({"model": "smollm2"}, "model: Input should be an object"),
        ({"model": {}}, "model.source: Field required"),
        ({"kv": 8}, "kv: Input should be a valid string"),
        ({"attn_backend": None}, "attn_backend: Input should be a valid string"),
        ({"prefill_chunk": 32.7}, "prefill_chunk: Input should be a valid integer"),
        ({"prefill_chunk": "512"}, "prefill_chunk: Input should be a valid integer"),
        ({"max_tokens": True}, "max_tokens: Input should be a valid integer"),
        ({"max_tokens": 0}, "max_tokens: Input should be greater than or equal to 1"),
        ({"sampling": {}}, "sampling.temperature: Field required"),
        ({"sampling": {"temperature": "hot", "top_k": 0, "top_p": 1.0, "seed": None}}, "sampling.temperature: "),
        ({"stop_ids": "abc"}, "stop_ids: Input should be a valid list"),
        ({"output_ids": [[4, 5]]}, "output_ids.0: Input should be a valid integer"),
    ],
)  # fmt: skip
def test_a_field_of_the_wrong_type_is_named(changes, named):
    with pytest.raises(ValueError, match="not a kvlens record") as info:
        _check_record(record(**changes))
    assert named in str(info.value)


@pytest.mark.parametrize(
    ("ids", "named"),
    [([2**40], "less than or equal to 2147483647"), ([-1], "greater than or equal to 0"), ([1.0], "valid integer"),
     ([True], "valid integer")],
)  # fmt: skip
def test_prompt_ids_are_int32_token_ids(ids, named):
    """Checked before they are hashed as int32 (2**40 was an OverflowError there)."""
    with pytest.raises(ValueError, match=f"prompt_ids.0: .*{named}"):
        _check_record(record(prompt_ids=ids, prompt_sha256="0" * 64))
