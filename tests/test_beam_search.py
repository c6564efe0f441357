"""Beam search (engine/beam_search.py, `LLM.beam_search`): the best beam equals transformers' beam search where the
two rank alike (no length penalty), every beam's cumulative logprob is transformers' log-likelihood of its tokens,
and beams come back ranked by vLLM's score, with nothing left held."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM
from engine.beam_search import BeamSearchParams, beam_score
from tests.hf_reference import hf_logits, hf_model, tiny_random_model_dir

PROMPTS = [[5, 6, 7, 8, 9], [20, 30, 40], list(range(50, 70))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return tiny_random_model_dir(tmp_path_factory.mktemp("beam"), "llama")


@pytest.fixture(scope="module")
def llm(tiny: Path) -> LLM:
    return LLM(str(tiny), device="cpu", dtype="float32", cpu_kv_cache_space=0.01)


@torch.no_grad()
def hf_beam(model_dir: Path, prompt: list[int], width: int, max_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf_model(model_dir).generate(
        ids, attention_mask=torch.ones_like(ids), num_beams=width, do_sample=False, max_new_tokens=max_new,
        length_penalty=0.0, early_stopping=False, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("width", [2, 4])
def test_the_best_beam_is_transformers_and_logprobs_are_exact(llm: LLM, tiny: Path, width: int) -> None:
    params = BeamSearchParams(beam_width=width, max_tokens=8, ignore_eos=True, length_penalty=0.0)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    for prompt, out in zip(PROMPTS, outs):
        assert len(out.sequences) == width
        best = out.sequences[0]
        assert best.tokens[: len(prompt)] == prompt
        assert best.tokens[len(prompt) :] == hf_beam(tiny, prompt, width, 8)
        scores = [beam_score(b, set(), 0.0) for b in out.sequences]
        assert scores == sorted(scores, reverse=True)
        for (
            beam
        ) in out.sequences:  # each beam's cumulative logprob: transformers' log-likelihood of its tokens
            logp = torch.log_softmax(hf_logits(tiny, beam.tokens[:-1]), dim=-1)
            want = sum(float(logp[i - 1, beam.tokens[i]]) for i in range(len(prompt), len(beam.tokens)))
            assert abs(beam.cum_logprob - want) < 1e-3
            assert (
                beam.text == llm.tokenizer.decode(beam.tokens[len(prompt) :])
                and beam.finish_reason == "length"
            )
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not llm.engine.has_unfinished_requests()


def test_finished_beams_stop_at_eos_and_rank_by_length_penalty() -> None:
    from engine.beam_search import BeamSearchSequence, beam_search
    from engine.sampling_params import SamplingParams

    eos = 9
    table = {  # the next-token logprobs after each sequence (a toy model)
        (1,): {eos: -0.1, 2: -0.5},
        (1, 2): {3: -0.1, eos: -3.0},
        (1, 2, 3): {4: -0.1, eos: -2.0},
        (1, 2, 3, 4): {5: -0.2, eos: -0.2},
    }

    def step(token_lists: list[list[int]], one: SamplingParams) -> list[dict[int, float]]:
        assert one.max_tokens == 1 and one.logprobs == 4
        return [table.get(tuple(t), {6: -5.0, 7: -6.0}) for t in token_lists]

    short = beam_search([[1]], BeamSearchParams(2, 4, length_penalty=0.0), step, {eos})[0]
    assert short.sequences[0] == BeamSearchSequence([1, eos], [{eos: -0.1}], -0.1, None, "stop")
    long = beam_search([[1]], BeamSearchParams(2, 4, length_penalty=20.0), step, {eos})[0]
    # a large penalty favours length: 1 2 3 4 5 (-0.9 / 5^20) beats 1 EOS (-0.1 / 1^20)
    assert long.sequences[0].tokens == [1, 2, 3, 4, 5] and long.sequences[0].finish_reason == "length"
    with pytest.raises(ValueError, match="beam_width must be at least 1"):
        BeamSearchParams(beam_width=0, max_tokens=4)
