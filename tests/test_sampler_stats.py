"""The sampler's draws against the exact filtered distribution, and the quality of its noise.

Each case draws 40,000 rows at once (seeds and positions varied) from one row of logits over 16 tokens
and compares the counts with softmax(logits / T) after top-k, top-p and min-p, computed here in float64
numpy. The test is deterministic (fixed seeds); its bound is the chi-square quantile at 1 - 1e-6, and
each case also checks that the same counts reject a nearby wrong distribution (a filter one token off,
or temperature not applied), so the bound is tight enough to catch those.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from engine.sampler import Sampler, sampling_tensors, stages_of
from engine.sampling_ops import sample_tokens
from engine.sampling_params import SamplingParams
from kernels.sampling_noise import gumbel_noise

ROWS = 40_000
P = np.array(
    [0.2, 0.15, 0.12, 0.1, 0.09, 0.08, 0.07, 0.06, 0.04, 0.03, 0.025, 0.015, 0.01, 0.005, 0.003, 0.002]
)
PERM = np.random.default_rng(0).permutation(len(P))  # the ranks scattered over the vocabulary
LOGITS = np.log(P / P.sum())[PERM]
Z = 4.753  # standard normal quantile at 1 - 1e-6


def chi2_bound(df: int) -> float:
    """The chi-square quantile at 1 - 1e-6 (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + Z * math.sqrt(2 / (9 * df))) ** 3


def exact(logits: np.ndarray, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """Float64: softmax(logits / T), then top-k, top-p over the top-k renormalized, then min-p."""
    z = logits / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros(len(p), dtype=bool)
    k = top_k if top_k > 0 else len(p)
    keep[order[:k]] = True
    q = np.where(keep, p, 0.0)
    q /= q.sum()
    mass = 0.0
    for rank, i in enumerate(order[:k]):
        if rank > 0 and mass >= top_p:
            keep[i] = False
        mass += q[i]
    keep &= p >= min_p * p.max()
    out = np.where(keep, p, 0.0)
    return out / out.sum()


def chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's statistic; infinite when a token of probability 0 was drawn."""
    if (counts[probs == 0] > 0).any():
        return math.inf
    expected = probs[probs > 0] * counts.sum()
    return float(((counts[probs > 0] - expected) ** 2 / expected).sum())


def draw(params: SamplingParams, salt: int) -> np.ndarray:
    """Token counts of ROWS draws with distinct seeds and scattered positions."""
    g = torch.Generator().manual_seed(salt)
    seeds = torch.randint(-(2**62), 2**62, (ROWS,), generator=g).tolist()
    positions = torch.randint(0, 1 << 20, (ROWS,), generator=g).tolist()
    rows = [params] * ROWS
    t = sampling_tensors(rows, seeds, positions, len(P), torch.device("cpu"))
    logits = torch.tensor(LOGITS, dtype=torch.float32).expand(ROWS, -1)
    tokens = sample_tokens(logits, t, stages_of(rows, len(P)))
    return np.bincount(tokens.numpy(), minlength=len(P))


CASES = [
    # (knobs, wrong knobs the draws must reject)
    ({}, {"temperature": 0.8}),
    ({"temperature": 0.5}, {}),
    ({"temperature": 2.0}, {}),
    ({"top_k": 5}, {"top_k": 6}),
    ({"top_k": 5}, {"top_k": 4}),
    ({"top_p": 0.7}, {"top_p": 0.8}),  # 0.7 keeps 6 tokens, 0.8 keeps 7
    ({"top_p": 0.7}, {"top_p": 0.6}),
    ({"min_p": 0.25}, {"min_p": 0.32}),  # keeps 8 tokens vs 7
    ({"temperature": 0.7, "top_k": 8, "top_p": 0.8}, {"temperature": 0.7, "top_k": 8, "top_p": 0.9}),
    ({"temperature": 0.7, "top_k": 8, "top_p": 0.8}, {"top_k": 8, "top_p": 0.8}),
    (
        {"temperature": 1.3, "top_k": 12, "top_p": 0.8, "min_p": 0.42},  # top-p keeps 8, min-p 7
        {"temperature": 1.3, "top_k": 12, "top_p": 0.8},
    ),
]


@pytest.mark.parametrize("knobs, wrong", CASES)
def test_draws_follow_the_filtered_distribution(knobs, wrong):
    want, other = exact(LOGITS, **knobs), exact(LOGITS, **wrong)
    assert np.abs(want - other).sum() > 0.02, "the wrong distribution must differ"
    counts = draw(SamplingParams(**knobs), salt=len(str(knobs)))
    df = int((want > 0).sum()) - 1
    assert chi2(counts, want) < chi2_bound(df), (counts, want * ROWS)
    assert chi2(counts, other) > chi2_bound(int((other > 0).sum()) - 1)


def test_filter_boundaries_are_clear_of_rounding():
    """The cases' top-p and min-p values sit well inside a step of the cumulative mass and of the
    probability ratios, so float32 and float64 pick the same tokens."""
    for case in [c for pair in CASES for c in pair]:
        z = LOGITS / case.get("temperature", 1.0)
        p = np.sort(np.exp(z - z.max()))[::-1]  # p / p_max, descending
        if "top_p" in case:
            k = case.get("top_k", len(p))
            assert np.abs(np.cumsum(p[:k] / p[:k].sum()) - case["top_p"]).min() > 1e-3
        if "min_p" in case:
            assert np.abs(p - case["min_p"]).min() > 1e-3


def test_unseeded_rows_draw_the_distribution_through_the_sampler():
    """Rows without a seed get theirs from the sampler's generator: identical logits still differ."""
    params = [SamplingParams(temperature=0.9, top_k=10)] * ROWS
    logits = torch.tensor(LOGITS, dtype=torch.float32).expand(ROWS, -1).clone()
    out = Sampler(seed=3)(logits, params, [None] * ROWS)
    counts = np.bincount(out.token_ids, minlength=len(P))
    want = exact(LOGITS, temperature=0.9, top_k=10)
    assert chi2(counts, want) < chi2_bound(int((want > 0).sum()) - 1)


def gumbel_cdf(x: np.ndarray) -> np.ndarray:
    return np.exp(-np.exp(-x))


def test_noise_is_gumbel_distributed():
    """Kolmogorov-Smirnov over 2M values from 2,000 (seed, position) rows of 1,000 tokens: the bound is
    the 1 - 1e-6 quantile, 2.65 / sqrt(n)."""
    seeds = torch.arange(2000, dtype=torch.int64) * 7919
    positions = torch.arange(2000, dtype=torch.int64) % 97
    x = np.sort(gumbel_noise(seeds, positions, 1000).double().flatten().numpy())
    n = len(x)
    cdf = gumbel_cdf(x)
    ks = max((np.arange(1, n + 1) / n - cdf).max(), (cdf - np.arange(n) / n).max())
    assert ks < 2.65 / math.sqrt(n), ks
    assert np.isfinite(x).all()


def test_noise_is_uncorrelated_across_tokens_positions_and_seeds():
    """Uniforms recovered from the noise: neighbours along the vocabulary, along positions and along
    seeds correlate below 5 / sqrt(n), and their mean is 1/2."""
    base = torch.arange(500, dtype=torch.int64)
    u = lambda s, p: gumbel_cdf(gumbel_noise(s, p, 2000).double().numpy())  # (500, 2000) uniforms
    a = u(base, torch.zeros(500, dtype=torch.int64))
    pairs = [
        (a[:, :-1], a[:, 1:]),  # adjacent vocab entries
        (a, u(base, torch.ones(500, dtype=torch.int64))),  # the next position, same seed
        (a, u(base + 1, torch.zeros(500, dtype=torch.int64))),  # the next seed, same position
    ]
    for x, y in pairs:
        r = np.corrcoef(x.flatten(), y.flatten())[0, 1]
        assert abs(r) < 5 / math.sqrt(x.size), r
    assert a.min() > 0 and a.max() < 1
    assert abs(a.mean() - 0.5) < 5 * math.sqrt(1 / 12 / a.size)
