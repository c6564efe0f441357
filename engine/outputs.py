"""What the engine hands back, shaped like vLLM's RequestOutput / CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort" once finished
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """One request's timestamps (time.monotonic(), its first completion's; None: not reached yet) as vLLM's
    RequestMetrics has them, and speculative decoding's counts over its completions (vLLM's spec_decode_*
    names): drafts verified, tokens drafted, tokens accepted, and how often each draft position was
    accepted."""

    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    @property
    def time_in_queue(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def spec_decode_acceptance_rate(self) -> float:
        n = self.spec_decode_num_draft_tokens
        return self.spec_decode_num_accepted_tokens / n if n else 0.0

    @property
    def spec_decode_mean_accepted_length(self) -> float:
        """Tokens gained per verified draft: the accepted ones and the target's own."""
        n = self.spec_decode_num_drafts
        return 1 + self.spec_decode_num_accepted_tokens / n if n else 0.0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # with SamplingParams.prompt_logprobs, vLLM's shape: one entry per prompt token, None for the first (nothing
    # predicts it), else {token id: logprob} holding the prompt's own token and the top ones
    prompt_logprobs: list[dict[int, float] | None] | None = None
    finished: bool = False
    metrics: RequestMetrics | None = None


@dataclass
class EmbeddingOutput:
    """vLLM's: the pooled vector of one prompt."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """vLLM's output of `LLM.embed`: one prompt's embedding."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache


@dataclass
class ScoringOutput:
    """vLLM's: one pair's score (for an embedding model, the cosine similarity of the two embeddings)."""

    score: float


@dataclass
class ScoringRequestOutput:
    """vLLM's output of `LLM.score`: one pair's."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]  # the pair's two prompts, one after the other
    finished: bool = True
