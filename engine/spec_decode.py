"""Speculative decoding: a proposer drafts a few tokens per request, one forward pass of the target scores
them, and the longest agreeing run plus the target's own next token are kept.

Configured vLLM's way, `LLM(..., speculative_config={"method": "ngram", "num_speculative_tokens": 4,
"prompt_lookup_max": 4})`. What exists:
- `ngram` (prompt lookup): the continuation of the most recent earlier occurrence of the request's
  longest suffix of `prompt_lookup_max` down to `prompt_lookup_min` tokens.
- `self_draft` (LayerSkip-style early exit): the target's own first `num_draft_layers` layers, its final
  norm and its LM head draft k tokens greedily, one batched pass per token (engine/model_runner.py:
  `_self_draft`). Their KV is the target's own for those layers, written at the draft's positions and
  rewritten with the same values by the verification, so it costs no extra KV cache and no transfer.
- Verification (engine/scheduler.py, engine/model_runner.py): a request with a draft of k tokens runs as a
  chunk of k + 1 queries (its newest token and the draft) in the same batch as plain decodes and prefill
  chunks; the target's greedy token at each of the k + 1 positions is read, the draft is accepted up to the
  first disagreement, and the target's token there is appended too. So the output is the target's greedy
  output, token for token. The KV of rejected positions is rolled back (`BlockManager.free_tail`) and a
  block is hashed for the prefix cache only once every token in it is accepted.
- Sampling stays exact too. Every draft is one proposal (q one-hot), and each of the k + 1 positions is
  sampled as plain decoding samples it (the same seeded noise at the same position); the draft is kept
  while it equals those samples. That is Leviathan et al.'s rejection sampling for a one-hot q: token d
  is accepted with probability p(d), and on rejection the sample is drawn from p without d, renormalized
  (the residual). A seeded request gives the same tokens with and without speculation.
- Requests with penalties decode one token a step (their penalties would need the draft in their history).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

METHODS = ("ngram", "self_draft")
MAX_SPECULATIVE_TOKENS = 16
_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "num_draft_layers"}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    num_draft_layers: int | None = None  # self_draft: how many of the target's layers draft

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
        if self.method == "self_draft" and (self.num_draft_layers is None or self.num_draft_layers < 1):
            raise ValueError(f"self_draft needs num_draft_layers >= 1, got {self.num_draft_layers}")

    def check_model(self, num_hidden_layers: int) -> None:
        """ValueError unless the target can host this config's draft."""
        layers = self.num_draft_layers
        if self.method == "self_draft" and layers is not None and layers >= num_hidden_layers:
            raise ValueError(
                f"num_draft_layers must be fewer than the model's {num_hidden_layers} layers, got {layers}"
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


def accepted_length(draft: list[int], targets: list[int]) -> int:
    """How many of the draft's tokens to keep: the leading run that equals the target's tokens sampled
    (or taken greedily) at the same positions. `targets` has one more token than the draft: the target's
    own at the first disagreement, or after the whole draft, is kept as well."""
    n = 0
    while n < len(draft) and draft[n] == targets[n]:
        n += 1
    return n


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


# where the scheduler reserves a draft that the model itself writes (self_draft), its place in the host's
# inputs; the runner drafts on the device and writes each token there before the verification reads it
MODEL_DRAFT_TOKEN = 0


class Proposer:
    """Drafts for the scheduler: `propose(tokens, k)` gives at most k tokens. A model-drafted method
    (`on_device`) gives k reserved slots instead, which the runner fills before the verification."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.on_device = config.method == "self_draft"

    def propose(self, tokens: list[int], k: int) -> list[int]:
        c = self.config
        k = min(k, c.num_speculative_tokens)
        if self.on_device:
            return [MODEL_DRAFT_TOKEN] * k
        return ngram_propose(tokens, k, c.prompt_lookup_min, c.prompt_lookup_max)
