"""Sampler: greedy, filters, seeded reproducibility, the sampled distribution, logprobs."""

import math

import pytest
import torch

from engine.sampler import Sampler, filtered_probs
from engine.sampling_params import SamplingParams


def test_greedy_is_argmax():
    logits = torch.randn(5, 50)
    out = Sampler()(logits, [SamplingParams(temperature=0)] * 5, [None] * 5)
    assert out.token_ids == logits.argmax(-1).tolist()


def test_top_k_1_and_tiny_top_p_pick_the_top_token():
    logits = torch.randn(4, 30)
    params = [
        SamplingParams(top_k=1),
        SamplingParams(top_p=1e-6),
        SamplingParams(min_p=1.0),
        SamplingParams(temperature=0.01, seed=3),
    ]
    out = Sampler()(logits, params, [None] * 4)
    assert out.token_ids == logits.argmax(-1).tolist()


def test_filters_keep_the_right_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    keep = lambda p: (filtered_probs(logits, [p])[0] > 0).tolist()
    assert keep(SamplingParams(top_k=2)) == [True, True, False, False]
    assert keep(SamplingParams(top_p=0.8)) == [True, True, False, False]  # 0.5 + 0.3 reaches 0.8
    assert keep(SamplingParams(top_p=0.81)) == [True, True, True, False]
    assert keep(SamplingParams(min_p=0.25)) == [True, True, True, False]  # 0.05 < 0.25 * 0.5
    probs = filtered_probs(logits, [SamplingParams(top_k=2)])[0]
    assert probs[:2].tolist() == pytest.approx([0.5 / 0.8, 0.3 / 0.8])


def test_same_seed_same_tokens_whatever_the_batch():
    logits = torch.randn(3, 1000)
    params = [SamplingParams(seed=42), SamplingParams(), SamplingParams(seed=7)]
    runs = []
    for _ in range(2):
        gens = [torch.Generator().manual_seed(42), None, torch.Generator().manual_seed(7)]
        runs.append([Sampler(seed=_)(logits, params, gens).token_ids for _ in range(1)][0])
    assert runs[0][0] == runs[1][0] and runs[0][2] == runs[1][2]
    alone = Sampler()(logits[:1], params[:1], [torch.Generator().manual_seed(42)]).token_ids
    assert alone[0] == runs[0][0]


def test_sampled_frequencies_follow_the_distribution():
    p = torch.tensor([0.6, 0.25, 0.1, 0.05])
    logits = torch.log(p).expand(4000, 4).clone()
    out = Sampler(seed=1)(logits, [SamplingParams()] * 4000, [None] * 4000)
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=4).float() / 4000
    assert torch.allclose(freq, p, atol=0.03), freq


def test_logprobs_are_the_raw_log_softmax():
    logits = torch.randn(2, 20)
    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0)]
    out = Sampler()(logits, params, [None, None])
    ref = torch.log_softmax(logits[0], -1)
    assert out.logprobs[1] is None
    lp = out.logprobs[0]
    assert len(lp) == 3 and out.token_ids[0] in lp  # greedy token is the top-1
    for tok, val in lp.items():
        assert math.isclose(val, ref[tok].item(), rel_tol=1e-5)


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"stop": [""]}, "stop"),
        ({"logprobs": -1}, "logprobs"),
    ],
)
def test_bad_params_name_the_problem(kwargs, word):
    with pytest.raises(ValueError, match=word):
        SamplingParams(**kwargs)
