"""Lab inputs the thirty-sixth session's sweep found misreported: `lab needle --ctx 64` said "context
56 … needs > 63" (the prompt's share of the context, not the --ctx given); `lab unit --seed` past
~1.2e15 overflowed torch's seed ("Overflow when unpacking long long"); a distribution parameter of
inf or NaN, or an amplitude past float32, reached the quantizer as "non-finite value in q8 input"."""

from __future__ import annotations

import pytest

from kvlens.lab.needle import ANSWER_TOKENS, build_prompt
from kvlens.lab.unit import MAX_AMPLITUDE, UnitConfig, parse_dist


@pytest.mark.slow
def test_the_needle_names_the_least_context_that_works(smol_f32):
    filler = smol_f32.tokenizer.encode("word " * 400, add_bos=False)
    with pytest.raises(
        ValueError, match=r"context 40 is too short for the needle prompt: it needs at least (\d+)"
    ) as e:
        build_prompt(smol_f32, filler, 40, 0.5, "12345", reserved=ANSWER_TOKENS)
    least = int(e.value.args[0].rsplit(" ", 1)[1])
    ids = build_prompt(smol_f32, filler, least, 0.5, "12345", reserved=ANSWER_TOKENS)
    assert len(ids) == least - ANSWER_TOKENS  # the answer's tokens fill the rest
    with pytest.raises(ValueError, match=f"context {least - 1} is too short .* at least {least}$"):
        build_prompt(smol_f32, filler, least - 1, 0.5, "12345", reserved=ANSWER_TOKENS)


@pytest.mark.parametrize("dist", ["student-t:inf", "student-t:nan", "student-t:0", "outlier-channels:nan",
                                  "outlier-channels:-1", "outlier-channels:1e400", "outlier-channels:1e31"])  # fmt: skip
def test_a_distribution_parameter_is_checked_by_name(dist):
    with pytest.raises(ValueError, match=f"--dist '{dist}': the .* parameter must be > 0"):
        parse_dist(dist)


def test_the_parameters_that_work_are_read():
    assert parse_dist("student-t:3") == ("student-t", 3.0)
    assert parse_dist("outlier-channels") == ("outlier-channels", 10.0)
    assert parse_dist(f"outlier-channels:{MAX_AMPLITUDE}") == ("outlier-channels", MAX_AMPLITUDE)


@pytest.mark.parametrize("field", ["k_amp", "v_amp"])
def test_an_amplitude_past_float32_is_named(field):
    UnitConfig(**{field: MAX_AMPLITUDE}).validate()
    with pytest.raises(ValueError, match=r"must be > 0 and ≤ 1e\+30"):
        UnitConfig(**{field: 1e31}).validate()


def test_the_seed_must_fit_torchs_64_bits():
    import torch

    top = (2**64 - 1) // 7919 - 2  # trials=1: (seed + 0) * 7919 + 3 is the largest stream seed (_stream)
    UnitConfig(seed=top).validate()
    torch.Generator().manual_seed(top * 7919 + 3)  # what _stream asks of torch: it fits
    with pytest.raises(ValueError, match=f"--seed must be ≤ {top}"):
        UnitConfig(seed=top + 1).validate()
