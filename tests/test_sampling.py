"""The sampler on fixed logits: empirical frequencies of many seeded draws vs the exact distribution.

Expected distributions are written out here in float64 (softmax of logits / T, the k largest, the
smallest prefix reaching p), independently of the sampler. Each count of N draws is Binomial(N, p):
a 6-sigma band (+1 for the discreteness) fails a correct sampler with probability < 1e-8 per
category, and the seeds are fixed, so the test is deterministic. Temperature as a product instead
of a division, or a prefix one token too short or long, moves some probability by > 0.05, i.e.
> 9 sigma at N = 6000.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvlens.engine.sampling import Sampler, SamplingParams

N = 6_000
LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.7, -0.3, 0.2, -1.0, 1.2])


def softmax64(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def counts(params: SamplingParams, logits: torch.Tensor = LOGITS, n: int = N) -> np.ndarray:
    sample = Sampler(params)
    return np.bincount([sample(logits) for _ in range(n)], minlength=logits.numel())


def assert_matches(observed: np.ndarray, p: np.ndarray) -> None:
    n = observed.sum()
    sigma = np.sqrt(n * p * (1 - p))
    assert (np.abs(observed - n * p) <= 6 * sigma + 1).all(), (observed / n, p)
    assert (observed[p == 0] == 0).all()


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.5])
def test_temperature_divides_the_logits(temperature):
    want = softmax64(LOGITS.double().numpy() / temperature)
    assert_matches(counts(SamplingParams(temperature=temperature, seed=1)), want)


def test_lower_temperature_sharpens():
    p_hot = counts(SamplingParams(temperature=2.0, seed=2)) / N
    p_cold = counts(SamplingParams(temperature=0.3, seed=2)) / N
    top = int(LOGITS.argmax())
    assert p_cold[top] > 0.7 > 0.3 > p_hot[top]  # exact: 0.76 and 0.22


@pytest.mark.parametrize("k", [1, 3, 5])
def test_top_k_keeps_exactly_the_k_largest(k):
    x = LOGITS.double().numpy() / 0.8
    keep = np.argsort(-x)[:k]
    want = np.zeros_like(x)
    want[keep] = softmax64(x[keep])
    assert_matches(counts(SamplingParams(temperature=0.8, top_k=k, seed=3)), want)


@pytest.mark.parametrize("top_p", [0.3, 0.55, 0.8, 0.95])
def test_top_p_keeps_the_smallest_prefix_reaching_p(top_p):
    p = softmax64(LOGITS.double().numpy())
    order = np.argsort(-p)
    mass = np.cumsum(p[order])
    n_keep = int(np.searchsorted(mass, top_p) + 1)  # first prefix whose mass is >= top_p
    assert mass[n_keep - 1] >= top_p and (n_keep == 1 or mass[n_keep - 2] < top_p)
    want = np.zeros_like(p)
    want[order[:n_keep]] = p[order[:n_keep]] / mass[n_keep - 1]
    assert_matches(counts(SamplingParams(temperature=1.0, top_p=top_p, seed=4)), want)


def test_top_k_then_top_p():
    x = LOGITS.double().numpy()
    keep = np.argsort(-x)[:4]
    pk = softmax64(x[keep])  # top-k first: renormalized over the 4 largest (sorted)
    n_keep = int(np.searchsorted(np.cumsum(pk), 0.7) + 1)
    want = np.zeros_like(x)
    want[keep[:n_keep]] = pk[:n_keep] / pk[:n_keep].sum()
    assert_matches(counts(SamplingParams(temperature=1.0, top_k=4, top_p=0.7, seed=5)), want)


def test_zero_temperature_is_argmax_and_seeds_reproduce():
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(50, 100, generator=g)
    greedy = Sampler(SamplingParams())
    assert [greedy(r) for r in rows] == rows.argmax(1).tolist()
    params = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=11)
    a, b = Sampler(params), Sampler(params)
    assert [a(r) for r in rows] == [b(r) for r in rows]


@pytest.mark.parametrize("kwargs", [{"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1}])
def test_bad_sampling_params(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_seed_takes_what_torch_generators_take_and_nothing_more():
    """torch seeds a generator from any int in [-2**63, 2**64 - 1]; past either end the Python API names
    the seed at once instead of torch's "Overflow when unpacking long" at the first draw."""
    logits = torch.tensor([0.0, 1.0, 2.0])
    for seed in (-(2**63), 2**64 - 1):
        Sampler(SamplingParams(temperature=1.0, seed=seed))(logits)
    with pytest.raises(ValueError, match=r"seed must be ≥ -9223372036854775808, got -9223372036854775809"):
        SamplingParams(seed=-(2**63) - 1)
    with pytest.raises(ValueError, match=r"seed must be ≤ 18446744073709551615, got 18446744073709551616"):
        SamplingParams(seed=2**64)
    with pytest.raises(TypeError, match="seed must be an integer, got float"):
        SamplingParams(seed=1.0)
