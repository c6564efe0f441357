"""Speculative decoding: a proposer drafts a few tokens per request, one forward pass of the target scores
them, and the longest agreeing run plus the target's own next token are kept.

Configured vLLM's way, `LLM(..., speculative_config={"method": "ngram", "num_speculative_tokens": 4,
"prompt_lookup_max": 4})`. What exists:
- `ngram` (prompt lookup): the continuation of the most recent earlier occurrence of the request's
  longest suffix of `prompt_lookup_max` down to `prompt_lookup_min` tokens.
- `draft_model`: a smaller model with the same tokenizer (checked at start-up: vocabulary sizes equal up to
  128 padding rows, the same special tokens, the same spelling of a sample of ids) drafts greedily on a KV
  cache of its own that shares the target's block tables (`engine/model_runner.py: DraftModel`). Its KV
  is lazy: a step that drafts for a request first computes, as one chunk, the positions the draft's cache
  lacks (the prompt, the tokens of plain steps; prefix-cache hits it wrote keep theirs), then its k + 1
  drafting passes write the draft's positions. Steps that draft nothing run no draft pass. It drafts only
  while a sequence fits its own max_model_len. On a decode worker no transfer carries the draft's KV: it
  is computed there the same way.
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
- Requests with penalties, a logit bias or min_tokens decode one token a step (their penalties would need the
  draft in their history, and each drafted position its own adjusted logits).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

METHODS = ("ngram", "draft_model", "self_draft")
MAX_VOCAB_PADDING = 128  # rows a draft's vocabulary may differ from the target's by (padding), as vLLM allows
MAX_SPECULATIVE_TOKENS = 16
_KEYS = {
    "method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "num_draft_layers", "adaptive",
    "model",
}  # fmt: skip
ACCEPTANCE_PRIOR = 0.7  # a request's assumed per-token acceptance before its first draft
ACCEPTANCE_EMA = 0.3  # the weight of a request's newest draft in its acceptance estimate
STEP_TIME_EMA = 0.2  # the weight of a step's newest wall time in its token bucket's estimate
# per step since a request last drafted, what its acceptance and lookup estimates keep of their distance
# from the prior: a request that stopped drafting for a poor estimate tries again some tens of steps later
ESTIMATE_RECALL = 0.97


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    num_draft_layers: int | None = None  # self_draft: how many of the target's layers draft
    model: str | None = None  # draft_model: the draft's HF directory or GGUF file
    adaptive: bool = True  # each step's draft lengths from acceptance and cost (DraftPolicy); False: always k

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
        if self.method == "draft_model" and not self.model:
            raise ValueError('draft_model needs "model": the draft\'s model directory or GGUF file')
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


def check_draft_tokenizer(target: Any, draft: Any, target_name: str, draft_name: str) -> None:
    """ValueError naming both models and the first difference unless the draft's tokenizer is the
    target's: vocabulary sizes within MAX_VOCAB_PADDING, the same BOS / EOS ids, and the same spelling of
    every 97th id (and the last ones) of the vocabulary they share. `target` and `draft` are
    engine.tokenizer.Tokenizer objects."""

    def differ(what: str) -> ValueError:
        return ValueError(
            f"the draft model {draft_name!r} does not share the target {target_name!r}'s tokenizer: {what}; "
            "speculative decoding needs the same tokenizer"
        )

    if abs(target.vocab_size - draft.vocab_size) > MAX_VOCAB_PADDING:
        raise differ(f"vocabulary sizes {target.vocab_size} and {draft.vocab_size}")
    if target.bos_token_id != draft.bos_token_id:
        raise differ(f"BOS ids {target.bos_token_id} and {draft.bos_token_id}")
    if set(target.eos_token_ids) != set(draft.eos_token_ids):
        raise differ(f"EOS ids {sorted(target.eos_token_ids)} and {sorted(draft.eos_token_ids)}")
    shared = min(target.vocab_size, draft.vocab_size)
    for i in [*range(0, shared, 97), *range(max(0, shared - 8), shared)]:
        a, b = target.backend.id_to_token(i), draft.backend.id_to_token(i)
        if a != b:
            raise differ(f"id {i} is {a!r} in the target and {b!r} in the draft")


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
    # a request's per-token acceptance estimate: an EMA of accepted / drafted over its recent drafts
    acceptance: float = ACCEPTANCE_PRIOR
    # how often its recent lookups found a draft (an EMA; an n-gram lookup may find none, a model always does)
    lookup_hits: float = 1.0
    tried_at: int = 0  # the scheduler's step count at its last lookup

    def observe_lookup(self, found: bool) -> None:
        self.lookup_hits += ACCEPTANCE_EMA * (float(found) - self.lookup_hits)

    def observe(self, num_draft: int, num_accepted: int) -> None:
        self.acceptance += ACCEPTANCE_EMA * (num_accepted / num_draft - self.acceptance)
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


class StepCost:
    """Wall seconds of a step against the tokens it runs, learned online: an EMA per bucket of token
    counts (powers of two), each holding its mean count and time; `time(n)` interpolates between the
    measured buckets around n, and `slope(n)` is the marginal cost of one more token there."""

    def __init__(self) -> None:
        self.buckets: dict[int, tuple[float, float]] = {}  # bucket -> (mean tokens, mean seconds)

    def observe(self, num_tokens: int, seconds: float) -> None:
        b = num_tokens.bit_length()
        if b not in self.buckets:
            self.buckets[b] = (float(num_tokens), seconds)
            return
        n, t = self.buckets[b]
        self.buckets[b] = (n + STEP_TIME_EMA * (num_tokens - n), t + STEP_TIME_EMA * (seconds - t))

    def time(self, num_tokens: int) -> float | None:
        points = self._nearest(num_tokens)
        if not points:
            return None
        if len(points) == 1:
            return points[0][1]
        (n0, t0), (n1, t1) = points
        return max(t0 + (t1 - t0) * (num_tokens - n0) / (n1 - n0), 0.0)

    def at(self, num_tokens: int) -> float | None:
        """The time measured in `num_tokens`' own bucket, or None."""
        point = self.buckets.get(num_tokens.bit_length())
        return point[1] if point is not None else None

    def slope(self, num_tokens: int) -> float | None:
        points = self._nearest(num_tokens)
        if len(points) < 2:
            return None
        (n0, t0), (n1, t1) = points
        return max((t1 - t0) / (n1 - n0), 0.0)

    def _nearest(self, num_tokens: int) -> list[tuple[float, float]]:
        """Two measured buckets around `num_tokens`, in order of count: the nearest below and above it,
        else the two nearest on its one side (one, or none, while fewer are measured)."""
        points = sorted(self.buckets.values())
        below = [p for p in points if p[0] <= num_tokens]
        above = [p for p in points if p[0] > num_tokens]
        if below and above:
            return [below[-1], above[0]]
        return below[-2:] if below else above[:2]


class Proposer:
    """Drafts for the scheduler: `propose(tokens, k)` gives at most k tokens. A model-drafted method
    (`on_device`) gives k reserved slots instead, which the runner fills before the verification.

    With `adaptive` (the default) it also sets each step's draft lengths. The marginal draft token at
    depth j of a request with per-token acceptance a gains a^j expected tokens and costs the step's
    marginal time per token s; the step makes R tokens (one per row) in time T. Adding it pays when
    a^j > s * R / T: so each request drafts the depths whose expected gain clears that threshold. While
    verifying costs nearly nothing (a memory-bound step: s ~ 0) requests draft up to k; when a large
    batch makes each token cost its share, drafts shrink to none and the step is a plain decode step.

    A model-drafted method also pays a draft pass per depth, a fraction f of a step's time (self_draft: its
    layers over the target's; draft_model: its parameters over the target's), shared by the m requests
    drafting: so its tokens must clear f * R / m more.

    A drafting step also costs once per step: it starts from the tokens of the step before, so it runs in
    order, where plain steps overlap the next step's host work with this one's GPU work. The engine steps in
    order only while the step's expected gain (`expected_gain`, summed over the rows) beats what running in
    order loses (`in_order_cost`), both in tokens; both step times are measured online."""

    def __init__(self, config: SpeculativeConfig, draft_cost_fraction: float = 0.0) -> None:
        self.config = config
        self.on_device = config.method in ("self_draft", "draft_model")
        self.max_draft_len: int | None = None  # a draft model's max_model_len: it drafts only below it
        self.draft_cost_fraction = draft_cost_fraction
        self.cost = StepCost()
        # wall seconds of a decode step against its rows: stepped in order (its drafts' verification taken
        # out), and overlapped
        self.in_order = StepCost()
        self.overlapped = StepCost()

    def threshold(self, num_rows: int, num_tokens: int, num_drafting: int = 1) -> float:
        """The expected gain a draft token must clear in a step of `num_rows` rows and `num_tokens` tokens
        before drafts, `num_drafting` of the rows may draft (0 when not adaptive: every draft pays; the
        verification's part is 0 while its cost is not known yet)."""
        if not self.config.adaptive:
            return 0.0
        passes = self.draft_cost_fraction * num_rows / max(num_drafting, 1)
        slope, t = self.cost.slope(num_tokens), self.cost.time(num_tokens)
        if slope is None or not t:
            return passes
        return slope * num_rows / t + passes

    def length(self, stats: SpecDecodeStats | None, threshold: float, room: int) -> int:
        """How many tokens a request drafts: the depths whose expected gain clears `threshold`."""
        k = min(room, self.config.num_speculative_tokens)
        if threshold <= 0.0 or k <= 0:
            return max(k, 0)
        a = stats.acceptance if stats is not None else ACCEPTANCE_PRIOR
        depth, gain = 0, 1.0
        while depth < k and (gain := gain * a) > threshold:
            depth += 1
        return depth

    def expected_gain(
        self, stats: SpecDecodeStats | None, threshold: float, room: int, idle: int = 0
    ) -> float:
        """Tokens a request's draft is expected to add to a step: the acceptance of each depth that `length`
        gives it, times how often its lookups find a draft; both estimates drawn back towards the prior
        over the `idle` steps since its last lookup (ESTIMATE_RECALL)."""
        a, hits = ACCEPTANCE_PRIOR, 1.0
        if stats is not None:
            keep = ESTIMATE_RECALL**idle
            a += (stats.acceptance - ACCEPTANCE_PRIOR) * keep
            hits += (stats.lookup_hits - 1.0) * keep
        gain, term = 0.0, 1.0
        for _ in range(self.length(stats, threshold, room)):
            term *= a
            gain += term
        return hits * gain

    def in_order_cost(self, num_rows: int) -> float | None:
        """Tokens a decode step of `num_rows` rows loses by running in order rather than overlapped: its
        extra wall time at the overlapped step's rate, both measured at about that many rows (0 while the
        in-order time is not, and when not adaptive). None while the overlapped time is not: the engine
        then overlaps a step or two to measure it."""
        if not self.config.adaptive:
            return 0.0
        t_over = self.overlapped.at(num_rows)
        if not t_over:
            return None
        t_in = self.in_order.at(num_rows)
        return num_rows * max(t_in - t_over, 0.0) / t_over if t_in else 0.0

    def propose(self, tokens: list[int], k: int) -> list[int]:
        c = self.config
        k = min(k, c.num_speculative_tokens)
        if self.on_device:
            return [MODEL_DRAFT_TOKEN] * k
        return ngram_propose(tokens, k, c.prompt_lookup_min, c.prompt_lookup_max)
