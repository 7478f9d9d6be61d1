"""The sampler at the ends of its valid ranges, against the limits worked out by hand: as T → 0 the
softmax of logits / T puts all its mass, evenly, on the largest logits; a top_p below every token's
probability keeps the most likely token alone. Before the thirty-sixth session logits / T overflowed
float32 for T ≤ ~1e-38 (inf - inf = nan in the softmax) and a top_p under float32's smallest value
dropped every token: torch.multinomial raised on a valid request."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_sampling import LOGITS, counts

from kvlens.engine.sampling import SamplingParams

TIES = torch.tensor([0.5, 3.0, -1.0, 3.0, 2.999])  # the largest twice; a near-tie that must lose


@pytest.mark.parametrize("temperature", [1e-30, 1e-40, 1e-300, 5e-324])
def test_a_tiny_temperature_is_the_argmax(temperature):
    observed = counts(SamplingParams(temperature=temperature, seed=1), n=200)
    assert observed[int(LOGITS.argmax())] == 200


@pytest.mark.parametrize("temperature", [1e-40, 5e-324])
def test_a_tiny_temperature_splits_evenly_between_tied_maxima(temperature):
    observed = counts(SamplingParams(temperature=temperature, seed=2), TIES, n=400)
    assert observed.sum() == observed[1] + observed[3]  # nothing else, not even the 2.999
    assert abs(observed[1] - 200) <= 6 * np.sqrt(400 * 0.25) + 1  # Binomial(400, 1/2), 6 sigma


@pytest.mark.parametrize("top_p", [1e-300, 5e-324, 1e-46])
def test_a_top_p_below_every_probability_keeps_the_most_likely_token(top_p):
    observed = counts(SamplingParams(temperature=1.0, top_p=top_p, seed=3), n=200)
    assert observed[int(LOGITS.argmax())] == 200
