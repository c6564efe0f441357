"""Beam search, vLLM's way (`LLM.beam_search`): each step runs every live beam one token further with its top
2 x beam_width logprobs (one batch through the engine, whose prefix cache holds every beam's tokens so far, so a
step computes one new token a beam), keeps the beam_width best continuations by cumulative logprob, and sets
aside those that end in EOS. At the end, the finished and live beams are ranked by vLLM's score: the cumulative
logprob over the sequence's length (prompt included, a final EOS not) to the power length_penalty."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be at least 1, got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` the prompt's and then the generated ones, as vLLM's; `text` the generated text."""

    tokens: list[int]
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) or "length"


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # the beam_width best, best first


def beam_score(beam: BeamSearchSequence, eos_ids: set[int], length_penalty: float) -> float:
    """vLLM's ranking: cumulative logprob / length ** length_penalty (a final EOS not counted)."""
    length = len(beam.tokens) - (beam.tokens[-1] in eos_ids)
    return beam.cum_logprob / (length**length_penalty)


class BeamSearch:
    """The search's state between steps, for drivers sync (LLM.beam_search) and async (the gateway): `step_params`
    and the token lists to run (`wanted`), then `advance` with each one's next-token logprobs, until `done`."""

    def __init__(self, prompts: list[list[int]], params: BeamSearchParams, eos_ids: set[int]) -> None:
        self.prompts, self.params, self.eos_ids = prompts, params, eos_ids
        self.step_params = SamplingParams(
            temperature=params.temperature, max_tokens=1, logprobs=2 * params.beam_width, ignore_eos=True
        )
        self.live = [[BeamSearchSequence(list(p))] for p in prompts]
        self.finished: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        self.steps = 0

    @property
    def done(self) -> bool:
        return self.steps >= self.params.max_tokens or not any(self.live)

    def wanted(self) -> list[list[int]]:
        return [beam.tokens for beams in self.live for beam in beams]

    def advance(self, next_logprobs: list[dict[int, float]]) -> None:
        nexts = iter(next_logprobs)
        for i, beams in enumerate(self.live):
            grown = []
            for beam in beams:
                for token, logprob in next(nexts).items():
                    new = BeamSearchSequence(
                        beam.tokens + [token], beam.logprobs + [{token: logprob}], beam.cum_logprob + logprob
                    )
                    if token in self.eos_ids and not self.params.ignore_eos:
                        new.finish_reason = "stop"
                        self.finished[i].append(new)
                    else:
                        grown.append(new)
            self.live[i] = sorted(grown, key=lambda b: b.cum_logprob, reverse=True)[: self.params.beam_width]
        self.steps += 1

    def results(self, decode: Callable[[list[int]], str] | None = None) -> list[BeamSearchOutput]:
        outputs = []
        for prompt, beams, finished in zip(self.prompts, self.live, self.finished):
            for beam in beams:
                beam.finish_reason = "length"
            ranked = sorted(
                finished + beams,
                key=lambda b: beam_score(b, self.eos_ids, self.params.length_penalty),
                reverse=True,
            )[: self.params.beam_width]
            for beam in ranked:
                generated = self.generated(beam, len(prompt))
                beam.text = decode(generated) if decode is not None else None
            outputs.append(BeamSearchOutput(ranked))
        return outputs

    @staticmethod
    def generated(beam: BeamSearchSequence, prompt_len: int) -> list[int]:
        """A beam's generated tokens, a final EOS left out (it is not text)."""
        out = beam.tokens[prompt_len:]
        return out[:-1] if beam.finish_reason == "stop" else out


def beam_search(
    prompts: list[list[int]],
    params: BeamSearchParams,
    step: Callable[[list[list[int]], SamplingParams], list[dict[int, float]]],
    eos_ids: set[int],
    decode: Callable[[list[int]], str] | None = None,
) -> list[BeamSearchOutput]:
    """Beam search over `step(token lists, params)`, which gives each token list's next-token logprobs (top k and
    the sampled one)."""
    search = BeamSearch(prompts, params, eos_ids)
    while not search.done:
        search.advance(step(search.wanted(), search.step_params))
    return search.results(decode)
