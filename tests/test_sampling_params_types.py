"""``SamplingParams`` stores the checked values, not what it was given: a request's record goes to JSON
(engine/verify.make_record), where a numpy number does not serialize and an int temperature reads back
as another type. The forty-second session's mutation run found the stored types unasserted
(storing a checked value under a misspelt name left the given one in place and passed every test)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from kvlens.engine.sampling import SamplingParams


def test_the_fields_hold_python_numbers_whatever_was_given():
    p = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(3), top_p=1, seed=np.uint64(2**64 - 1))
    assert [type(v) for v in (p.temperature, p.top_p, p.top_k, p.seed)] == [float, float, int, int]
    assert (p.temperature, p.top_p, p.top_k, p.seed) == (0.5, 1.0, 3, 2**64 - 1)
    assert json.loads(json.dumps(dataclasses.asdict(p))) == {
        "temperature": 0.5, "top_k": 3, "top_p": 1.0, "seed": 2**64 - 1
    }  # fmt: skip


def test_an_int_temperature_is_stored_as_a_float():
    p = SamplingParams(temperature=1, top_p=np.float64(0.25))
    assert type(p.temperature) is float and type(p.top_p) is float and p.seed is None
