"""Speculative decoding: a proposer drafts a few tokens per request, one forward pass of the target scores
them, and the longest agreeing run plus the target's own next token are kept.

Configured vLLM's way, `LLM(..., speculative_config={"method": "ngram", "num_speculative_tokens": 4,
"prompt_lookup_max": 4})`. What exists:
- `ngram` (prompt lookup): the continuation of the most recent earlier occurrence of the request's
  longest suffix of `prompt_lookup_max` down to `prompt_lookup_min` tokens.
- Verification (engine/scheduler.py, engine/model_runner.py): a request with a draft of k tokens runs as a
  chunk of k + 1 queries (its newest token and the draft) in the same batch as plain decodes and prefill
  chunks; the target's greedy token at each of the k + 1 positions is read, the draft is accepted up to the
  first disagreement, and the target's token there is appended too. So the output is the target's greedy
  output, token for token. The KV of rejected positions is rolled back (`BlockManager.free_tail`) and a
  block is hashed for the prefix cache only once every token in it is accepted.
- Drafts are made for greedy requests without penalties; the others decode one token a step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 16
_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative method {self.method!r} is not available; available: {', '.join(METHODS)}"
            )
        k = self.num_speculative_tokens
        if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {k}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpeculativeConfig:
        unknown = set(d) - _KEYS
        if unknown:
            raise ValueError(f"unknown speculative_config keys {sorted(unknown)}; known: {sorted(_KEYS)}")
        if "num_speculative_tokens" not in d:
            raise ValueError("speculative_config needs num_speculative_tokens")
        return cls(**d)


def ngram_propose(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest suffix of n tokens,
    n from max_n down to min_n; [] when no suffix recurs."""
    length = len(tokens)
    if k < 1 or length < min_n + 1:
        return []
    a = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # every window that starts before the suffix itself and has at least one token after it
        windows = np.lib.stride_tricks.sliding_window_view(a[: length - 1], n)
        hits = np.flatnonzero((windows == a[length - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return a[start : start + k].tolist()
    return []


@dataclass
class SpecDecodeStats:
    """Counters in vLLM's terms: drafts made, draft tokens proposed, draft tokens accepted (and per draft
    position: how often position i was accepted)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft:
            self.accepted_per_pos += [0] * (num_draft - len(self.accepted_per_pos))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verified request gains per step: its accepted drafts plus the target's own."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class Proposer:
    """Drafts for the scheduler: `propose(tokens, k)` gives at most k tokens."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def propose(self, tokens: list[int], k: int) -> list[int]:
        c = self.config
        return ngram_propose(
            tokens, min(k, c.num_speculative_tokens), c.prompt_lookup_min, c.prompt_lookup_max
        )
