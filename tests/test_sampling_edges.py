"""The sampler where its rules meet exact boundaries: top-p when a prefix's mass equals p exactly,
and each seed its own stream (unseeded draws their own too)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_sampling import counts

from kvlens.engine.sampling import Sampler, SamplingParams

EQUAL = torch.zeros(4)  # softmax: 0.25 each, exactly; prefix masses 0.25, 0.5, 0.75, 1 exactly


@pytest.mark.parametrize(("top_p", "kept"), [(0.25, 1), (0.5, 2), (0.75, 3), (1.0, 4), (0.6, 3)])
def test_top_p_keeps_the_smallest_prefix_whose_mass_reaches_p_exactly(top_p, kept):
    observed = counts(SamplingParams(temperature=1.0, top_p=top_p, seed=5), EQUAL, n=400)
    assert np.count_nonzero(observed) == kept


def test_each_seed_draws_its_own_stream():
    logits = torch.zeros(1000)

    def draws(seed):
        sample = Sampler(SamplingParams(temperature=1.0, seed=seed))
        return [sample(logits) for _ in range(20)]

    assert draws(1) == draws(1)
    assert draws(1) != draws(2) and draws(None) != draws(None)
