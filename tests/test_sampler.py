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
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ],
)
def test_bad_params_name_the_problem(kwargs, word):
    with pytest.raises(ValueError, match=word):
        SamplingParams(**kwargs)


def test_penalties_adjust_the_logits_exactly():
    from engine.sampler import apply_penalties

    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    params = [
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0),
        SamplingParams(),  # no penalties: untouched
    ]
    # row 0: prompt [1], output [0, 3, 3]; token 4 never seen
    out = apply_penalties(logits, params, [([1], [0, 3, 3]), ([0], [0])])
    expected0 = [
        2.0 / 2 - 0.25 * 1 - 0.5,  # in output once: repetition divides (positive), then freq + presence
        -1.0 * 2,  # prompt only: repetition multiplies (negative); no freq/presence (prompt is not output)
        0.5,  # unseen
        3.0 / 2 - 0.25 * 2 - 0.5,  # output twice
        -2.0,  # unseen
    ]
    assert out[0].tolist() == pytest.approx(expected0)
    assert out[1].tolist() == logits[1].tolist()
    assert logits[0, 0].item() == 2.0  # the input is not modified


def test_negative_presence_and_frequency_reward_repeats():
    from engine.sampler import apply_penalties

    logits = torch.zeros(1, 4)
    p = SamplingParams(presence_penalty=-1.0, frequency_penalty=-0.5)
    out = apply_penalties(logits, [p], [([2], [1, 1, 1])])
    assert out[0].tolist() == pytest.approx([0.0, 1.0 + 1.5, 0.0, 0.0])


def test_penalties_steer_greedy_and_keep_raw_logprobs():
    logits = torch.tensor([[5.0, 4.0, 0.0]])
    params = [SamplingParams(temperature=0, frequency_penalty=2.0, logprobs=1)]
    plain = Sampler()(logits, params, [None])
    assert plain.token_ids == [0]  # no history given: no penalties
    out = Sampler()(logits, params, [None], [([], [0])])
    assert out.token_ids == [1]  # 5 - 2 < 4
    ref = torch.log_softmax(logits[0], -1)
    assert out.logprobs[0][1] == pytest.approx(ref[1].item())  # logprobs stay the model's


def test_penalties_apply_before_temperature_when_sampling():
    logits = torch.tensor([[10.0, 9.0]])
    p = SamplingParams(temperature=0.1, repetition_penalty=10.0)
    gens = [torch.Generator().manual_seed(0)]
    assert Sampler()(logits, [p], gens).token_ids == [0]  # 100 vs 90 after temperature
    gens = [torch.Generator().manual_seed(0)]
    assert Sampler()(logits, [p], gens, [([0], [])]).token_ids == [1]  # 10 vs 90: token 0 was in the prompt


def test_repetition_penalty_equals_transformers():
    from transformers import RepetitionPenaltyLogitsProcessor

    from engine.sampler import apply_penalties

    torch.manual_seed(0)
    logits = torch.randn(1, 64)
    prompt, output = [3, 5, 5, 60], [7, 3, 11]
    ours = apply_penalties(logits, [SamplingParams(repetition_penalty=1.3)], [(prompt, output)])
    ref = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + output]), logits.clone())
    assert torch.equal(ours, ref)
