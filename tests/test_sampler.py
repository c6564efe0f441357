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
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens must be at most max_tokens"),
        ({"logit_bias": {3: 100.5}}, "logit_bias values"),
        ({"logit_bias": {3: float("nan")}}, "logit_bias values"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias keys"),
        ({"logit_bias": {"3": 1.0}}, "logit_bias keys"),
        ({"allowed_token_ids": []}, "allowed_token_ids must not be empty"),
        ({"allowed_token_ids": [2, -1]}, "allowed_token_ids must be token ids"),
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


def test_logit_bias_and_bans_steer_every_row_kind_and_keep_raw_logprobs():
    """Bias added before greedy and sampled picks alike, banned tokens never picked, rows without either
    untouched, and the logprobs reported are the model's own."""
    logits = torch.tensor([[5.0, 4.0, 0.0, -1.0]] * 4)
    params = [
        SamplingParams(temperature=0, logit_bias={2: 6.0}, logprobs=1),  # 0 + 6 beats 5
        SamplingParams(temperature=0, logit_bias={0: -100}),  # the top token pushed below the rest
        SamplingParams(temperature=0),  # only a ban: the top two are stops
        SamplingParams(temperature=0),  # nothing: argmax
    ]
    banned = [(), (), (0, 1, 99), ()]  # an id past the vocabulary is ignored
    out = Sampler()(logits, params, [None] * 4, banned=banned)
    assert out.token_ids == [2, 1, 2, 0]
    assert out.logprobs[0][2] == pytest.approx(torch.log_softmax(logits[0], -1)[2].item())
    sampled = [SamplingParams(temperature=1.0, seed=s, logit_bias={3: 100.0}) for s in range(4)]
    assert Sampler()(logits, sampled, [None] * 4).token_ids == [3] * 4  # e^100 outweighs the rest
    bans = [SamplingParams(temperature=1.0, seed=s) for s in range(4)]
    got = Sampler()(logits, bans, [None] * 4, banned=[(0, 1, 2)] * 4).token_ids
    assert got == [3] * 4


def test_allowed_token_ids_leave_only_those_tokens():
    """Greedy and sampled rows keep to their allowed tokens (bias and bans still apply inside them); rows without
    the list beside them are untouched."""
    logits = torch.tensor([[5.0, 4.0, 0.0, -1.0, 2.0]] * 4)
    params = [
        SamplingParams(temperature=0, allowed_token_ids=[3, 2]),
        SamplingParams(temperature=0, allowed_token_ids=[1, 2, 4], logit_bias={4: 3.0}),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, allowed_token_ids=[0, 4]),
    ]
    out = Sampler()(logits, params, [None] * 4, banned=[(), (), (), (0,)])
    assert out.token_ids == [2, 4, 0, 4]
    sampled = [SamplingParams(temperature=5.0, seed=s, allowed_token_ids=[3, 4]) for s in range(40)]
    assert set(Sampler()(logits[:1].expand(40, -1), sampled, [None] * 40).token_ids) == {3, 4}


def test_adjusting_leaves_the_input_logits_alone():
    from engine.sampler import adjust_logits

    logits = torch.zeros(2, 3)
    out = adjust_logits(logits, [SamplingParams(logit_bias={1: 2.5}), SamplingParams()], [(), (2,)])
    assert out.tolist() == [[0.0, 2.5, 0.0], [0.0, 0.0, -math.inf]]
    assert logits.eq(0).all()
    assert adjust_logits(logits, [SamplingParams(), SamplingParams()], [(), ()]) is logits


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


def _splitmix_noise(seed: int, position: int, v: int) -> float:
    """kernels/sampling_noise.py's construction in Python integers."""
    from kernels.sampling_noise import GAMMA, MIX1, MIX2

    word = (1 << 64) - 1

    def mix(x: int) -> int:
        x = ((x ^ (x >> 30)) * MIX1) & word
        x = ((x ^ (x >> 27)) * MIX2) & word
        return x ^ (x >> 31)

    key = mix((mix(seed & word) + (position + 1) * GAMMA) & word)
    u = ((mix((key + (v + 1) * GAMMA) & word) >> 11) + 0.5) * 2.0**-53
    return -math.log(-math.log(u))


def test_noise_is_the_documented_hash_and_the_kernel_matches_its_reference():
    from kernels.sampling_noise import gumbel_noise_reference, gumbel_noise_triton

    seeds = torch.tensor([0, 1, -5, 2**62, -(2**63), 2**63 - 1], dtype=torch.int64)
    positions = torch.tensor([0, 7, 100, 3, 2**40, 1], dtype=torch.int64)
    ref = gumbel_noise_reference(seeds, positions, 1500)
    for r in range(len(seeds)):
        for v in (0, 1, 777, 1023, 1024, 1499):
            want = _splitmix_noise(seeds[r].item(), positions[r].item(), v)
            assert ref[r, v].item() == pytest.approx(want, rel=1e-6, abs=1e-6)
    assert torch.equal(gumbel_noise_triton(seeds, positions, 1500), ref)  # Triton's interpreter here


def test_a_seeded_row_depends_on_its_seed_and_position_only():
    torch.manual_seed(0)
    logits = torch.randn(6, 500)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=99)
    others = [SamplingParams(), SamplingParams(temperature=0), SamplingParams(top_k=5, seed=1)]
    history = ([1, 2, 3], [4] * 10)  # samples position 13
    alone = Sampler(seed=0)(logits[:1], [seeded], [None], [history]).token_ids
    batch = Sampler(seed=5)(
        torch.cat([logits[1:4], logits[:1]]), [*others, seeded], [None] * 4, [([0], [])] * 3 + [history]
    ).token_ids
    assert batch[3] == alone[0]
    # another position draws other noise: over many positions the tokens vary
    tokens = {
        Sampler()(logits[:1], [seeded], [None], [(history[0], [4] * n)]).token_ids[0] for n in range(40)
    }
    assert len(tokens) > 5


def test_greedy_rows_stay_argmax_beside_sampling_rows():
    torch.manual_seed(1)
    logits = torch.randn(8, 300)
    params = [
        SamplingParams(temperature=0) if i % 2 else SamplingParams(top_k=50, min_p=0.01) for i in range(8)
    ]
    out = Sampler()(logits, params, [None] * 8).token_ids
    assert out[1::2] == logits[1::2].argmax(-1).tolist()


def test_logprobs_per_row_as_asked_while_sampling():
    torch.manual_seed(2)
    logits = torch.randn(3, 40)
    params = [
        SamplingParams(temperature=0.7, logprobs=4, seed=3),
        SamplingParams(temperature=0.7, seed=4),
        SamplingParams(temperature=0, logprobs=0),
    ]
    out = Sampler()(logits, params, [None] * 3)
    ref = torch.log_softmax(logits, -1)
    assert out.logprobs[1] is None
    first, third = out.logprobs[0], out.logprobs[2]
    assert first is not None and third is not None
    assert list(third) == [out.token_ids[2]]
    top4 = ref[0].topk(4).indices.tolist()
    assert set(first) == set(top4) | {out.token_ids[0]}
    for tok, val in first.items():
        assert val == pytest.approx(ref[0, tok].item(), rel=1e-6)


def test_top_k_keeps_the_tokens_tied_at_its_cutoff():
    logits = torch.tensor([[3.0, 1.0, 1.0, 0.0]])
    keep = (filtered_probs(logits, [SamplingParams(top_k=2)])[0] > 0).tolist()
    assert keep == [True, True, True, False]


def test_fused_sampling_kernel_matches_its_reference():
    """Triton's interpreter here: greedy rows, thresholds that keep one, some or all tokens, a vocabulary
    that ends inside a block."""
    from kernels.sampling_noise import gumbel_argmax_reference, gumbel_argmax_triton

    g = torch.Generator().manual_seed(3)
    rows, vocab = 6, 5000
    logits = torch.randn(rows, vocab, generator=g) * 2
    temperature = torch.tensor([0.0, 1.0, 0.5, 2.0, 0.8, 0.0]).unsqueeze(1)
    scaled = logits / torch.where(temperature > 0, temperature, 1.0)
    top = scaled.sort(dim=1, descending=True).values
    threshold = torch.stack(
        [top[0, 0], top[1, 0], top[2, 9], torch.tensor(-math.inf), top[4, 999], top[5, 0]]
    )
    seeds = torch.randint(-(2**63), 2**63 - 1, (rows,), generator=g)
    positions = torch.randint(0, 10_000, (rows,), generator=g)
    args = (logits, temperature, threshold.unsqueeze(1), seeds, positions)
    want = gumbel_argmax_reference(*args)
    assert torch.equal(gumbel_argmax_triton(*args), want)
    assert want[0] == logits[0].argmax() and want[5] == logits[5].argmax()
    assert want[1] == scaled[1].argmax()  # only the top token is at or above its threshold


def test_greedy_argmax_kernel_is_torch_argmax():
    """Triton's interpreter here: ties inside a block and across blocks go to the first index, as
    torch.argmax's do; a vocabulary that ends inside a block; an all -inf row; bf16 logits."""
    from kernels.sampling_noise import ARGMAX_BLOCK_V, greedy_argmax_triton

    g = torch.Generator().manual_seed(5)
    vocab = 2 * ARGMAX_BLOCK_V + 123
    logits = torch.randn(5, vocab, generator=g)
    logits[1, [7, 9]] = 50.0  # a tie inside the first block
    logits[2, [ARGMAX_BLOCK_V - 1, ARGMAX_BLOCK_V + 3, vocab - 1]] = 50.0  # ties across blocks
    logits[3] = -math.inf
    logits[4, vocab - 1] = 50.0  # the best in the last, partial block
    want = logits.argmax(dim=-1)
    assert want.tolist()[1:] == [7, ARGMAX_BLOCK_V - 1, 0, vocab - 1]
    assert torch.equal(greedy_argmax_triton(logits), want)
    half = logits.bfloat16()
    assert torch.equal(greedy_argmax_triton(half), half.argmax(dim=-1))
    assert greedy_argmax_triton(logits[:0]).shape == (0,)


def test_top_k_without_top_p_cuts_only_the_rows_that_ask():
    from engine.sampler import sampling_tensors, stages_of
    from engine.sampling_ops import filter_threshold

    scaled = torch.randn(3, 100)
    params = [SamplingParams(top_k=5), SamplingParams(), SamplingParams(top_k=2)]
    stages = stages_of(params, 100)
    assert not stages.sort and stages.max_k == 5
    t = sampling_tensors(params, [0] * 3, [0] * 3, 100, torch.device("cpu"))
    cut = filter_threshold(scaled, t, stages).squeeze(1)
    top = scaled.sort(dim=1, descending=True).values
    assert cut.tolist() == [top[0, 4].item(), -math.inf, top[2, 1].item()]


def test_a_large_top_k_sorts_and_cuts_like_topk():
    from engine.sampler import MAX_TOPK, sampling_tensors, stages_of
    from engine.sampling_ops import filter_threshold

    vocab = MAX_TOPK * 2
    scaled = torch.randn(2, vocab)
    params = [SamplingParams(top_k=MAX_TOPK + 1), SamplingParams(top_k=7)]
    stages = stages_of(params, vocab)
    assert stages.sort and not stages.max_k
    t = sampling_tensors(params, [0] * 2, [0] * 2, vocab, torch.device("cpu"))
    cut = filter_threshold(scaled, t, stages).squeeze(1)
    top = scaled.sort(dim=1, descending=True).values
    assert cut.tolist() == [top[0, MAX_TOPK].item(), top[1, 6].item()]
