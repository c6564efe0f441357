"""SamplingParams under vLLM's names, checked when built."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from engine.pooling import PoolingParams
from engine.structured_output import StructuredOutputsParams

_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    max_tokens: int | None = 16  # None: up to max_model_len
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    presence_penalty: float = 0.0  # OpenAI: subtracted once from every token already generated
    frequency_penalty: float = 0.0  # OpenAI: subtracted per occurrence in the generated tokens
    repetition_penalty: float = (
        1.0  # vLLM/HF: divides (>0) or multiplies (<0) logits of prompt + output tokens
    )
    logprobs: int | None = None  # number of top logprobs per output token (the sampled one is always added)
    # vLLM's: the logprob of each prompt token after the first, with this many top logprobs beside it. The
    # prompt's positions are all computed for it: a prefix-cache hit serves only positions already computed
    prompt_logprobs: int | None = None
    # vLLM's: words never generated. Each is tokenized as it stands and after a space (engine/prompt_checks.py:
    # bad_word_ids); a word's last token is banned where the output so far ends in the tokens before it
    bad_words: list[str] | None = None
    # vLLM's: the output held to a JSON schema, any JSON object, a regex or a choice (engine/structured_output.py)
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's: only the prompt's last this many tokens run (left truncation); -1: max_model_len of them
    truncate_prompt_tokens: int | None = None
    # OpenAI's: token id -> a value in [-100, 100] added to its logit before sampling (greedy too); the
    # logprobs reported stay the model's own
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0  # vLLM's: EOS, stop tokens and stop strings end nothing before this many tokens
    allowed_token_ids: list[int] | None = None  # vLLM's: the only tokens that may be sampled
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # an embedding request (LLM.embed, /v1/embeddings): the prompt's pooled hidden state, no tokens; set only
    # through embedding_params
    pooling: PoolingParams | None = None
    _stop: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disable), 0 (disable) or at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be non-negative, got {self.logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}")
        cut = self.truncate_prompt_tokens
        if cut is not None and cut < 1 and cut != -1:
            raise ValueError(f"truncate_prompt_tokens must be at least 1, or -1 (max_model_len), got {cut}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be at most max_tokens, got min_tokens {self.min_tokens} and max_tokens "
                f"{self.max_tokens}"
            )
        bias = dict(self.logit_bias or {})
        for token, value in bias.items():
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
            if not (isinstance(value, int | float) and -100.0 <= value <= 100.0):
                raise ValueError(f"logit_bias values must be in [-100, 100], got {value!r} for token {token}")
        self.logit_bias = {t: float(v) for t, v in bias.items()} or None
        if self.allowed_token_ids is not None:
            allowed = list(self.allowed_token_ids)
            if not allowed:
                raise ValueError("allowed_token_ids must not be empty: no token could be sampled")
            if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in allowed):
                raise ValueError(f"allowed_token_ids must be token ids (integers >= 0), got {allowed[:5]!r}")
            self.allowed_token_ids = sorted(set(allowed))
        if self.bad_words is not None:
            words = [self.bad_words] if isinstance(self.bad_words, str) else list(self.bad_words)
            if any(not isinstance(w, str) or not w.strip() for w in words):
                raise ValueError(f"bad_words must be non-blank strings, got {words[:5]!r}")
            self.bad_words = words or None
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        self._stop = stop
        self.stop_token_ids = list(self.stop_token_ids or [])

    @property
    def stop_strings(self) -> list[str]:
        return self._stop

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def adjusts_logits(self) -> bool:
        """Whether its logits change before sampling: penalties, a logit bias, allowed_token_ids, min_tokens
        (banned stops), bad_words or structured output."""
        return (
            self.has_penalties
            or bool(self.logit_bias)
            or self.min_tokens > 0
            or self.allowed_token_ids is not None
            or self.bad_words is not None
            or self.structured_outputs is not None
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS


def embedding_params(
    pooling: PoolingParams | None = None, truncate_prompt_tokens: int | None = None
) -> SamplingParams:
    """The params of an embedding request: its prompt runs, one greedy step reads the pooled row (the token it
    samples is dropped)."""
    return SamplingParams(
        temperature=0.0, max_tokens=1, ignore_eos=True, pooling=pooling or PoolingParams(),
        truncate_prompt_tokens=truncate_prompt_tokens,
    )  # fmt: skip


def completion_params(params: SamplingParams, index: int) -> SamplingParams:
    """The params of completion `index` of a request's `n`: a seeded request's completions draw from
    seeds seed, seed + 1, ... so that they differ and each is reproducible alone. The prompt's logprobs are the
    first completion's to compute: the others share its prompt blocks."""
    if index == 0 or (params.seed is None and params.prompt_logprobs is None):
        return params
    seed = None if params.seed is None else params.seed + index
    return dataclasses.replace(params, seed=seed, stop=params.stop_strings or None, prompt_logprobs=None)
