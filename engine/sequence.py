"""A request's state: tokens known vs tokens computed, its blocks, its status."""

from __future__ import annotations

import enum
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.block_hash import NONE_HASH, BlockHash, hash_prompt_blocks
from engine.sampling_params import SamplingParams
from engine.spec_decode import SpecDecodeStats
from engine.stats import RequestTimes

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


class SequenceStatus(enum.IntEnum):
    """Ordered so that `status >= FINISHED_STOPPED` means finished."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= SequenceStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {3: "stop", 4: "length", 5: "abort"}.get(int(self))


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    block_size: int
    extra_keys: bytes = b""  # domain-separated model id + cache salt, see engine/block_hash.py
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    times: RequestTimes = field(
        default_factory=RequestTimes
    )  # scheduled, first and last token (engine/stats.py)
    parent: Sequence | None = None  # n > 1: children wait for the parent's prompt blocks, then share them

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # tokens that a step still running on the device is sampling for this request (overlapped scheduling,
    # engine/engine_core.py): the scheduler plans with them, nothing else sees them until they are known
    num_pending: int = 0
    new_tokens: int = 0  # how many tokens the last step that sampled for it appended (more with a draft)
    spec_stats: SpecDecodeStats | None = None  # its drafts' counts, once it verified one
    num_cached_tokens: int = -1  # prompt tokens served by the prefix cache at first admission; -1: not yet
    block_table: list[int] = field(default_factory=list)
    # block_hashes (below): one per full block of all_token_ids, computed when first asked for
    _hashes: list[BlockHash] = field(default_factory=list, init=False, repr=False)
    status: SequenceStatus = SequenceStatus.WAITING
    stop_reason: int | str | None = None
    # sampling noise is a function of (params.seed, position) (engine/sampler.py): no generator state to carry
    generator: torch.Generator | None = None
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    # with params.prompt_logprobs: entry p - 1 is prompt token p's {token id: logprob}, from position p - 1's
    # logits; None until the step computing it is read. Positions below prompt_logprobs_planned are computed or
    # in a step on the device, so a prefix-cache hit may serve them (engine/scheduler.py).
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    prompt_logprobs_planned: int = 0
    # params.bad_words as token sequences (engine/prompt_checks.py: bad_word_ids), set by the engine
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    # params.structured_outputs' walk through its pattern (engine/structured_output.py), set by the engine and
    # advanced by every token appended; guide_failed: a token it does not allow was appended (the request ends)
    guide: Any = None
    guide_words: int = 0  # int32 words of its masks: the model's vocabulary / 32, rounded up
    guide_failed: bool = False
    # the pattern's index while it compiles in the background (GuideFactory.index_future); the request waits
    guide_future: Future | None = None
    # structured output after a reasoning model's thinking (StructuredOutputsParams.reasoning): the end marker's
    # token while the thinking goes on; the guide neither holds nor takes a token before it, the marker included
    reasoning_end_id: int | None = None
    embedding: list[float] | None = None  # an embedding request's (params.pooling), once its last chunk ran

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * max(len(self.prompt_token_ids) - 1, 0)

    def settle_guide(self, wait: bool) -> bool:
        """Whether its structured output's guide is ready (or none is asked for), once its pattern compiled; a
        pattern that failed to compile leaves guide_failed (the request ends at its first token). `wait`: block
        until it has compiled."""
        future = self.guide_future
        if future is None:
            return True
        if not wait and not future.done():
            return False
        self.guide_future = None
        try:
            from outlines_core import Guide

            self.guide = Guide(future.result())
        except Exception as exc:
            logger.error("request %s: its structured output cannot be compiled: %s", self.request_id, exc)
            self.guide_failed = True
        return True

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether some prompt position's logprobs are still to be computed."""
        return self.prompt_logprobs_planned < len(self.prompt_logprobs)

    def prompt_logprobs_out(self) -> list[dict[int, float] | None] | None:
        """vLLM's RequestOutput.prompt_logprobs: None first (nothing predicts the first token), then each prompt
        token's; None when not asked for."""
        if self.params.prompt_logprobs is None:
            return None
        return [None, *self.prompt_logprobs]

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.reasoning_end_id is not None:  # still thinking: the pattern holds from the next token on
            if token_id == self.reasoning_end_id:
                self.reasoning_end_id = None
        elif self.guide is not None and not self.guide_failed:
            try:
                self.guide.advance(token_id, return_tokens=False)
            except ValueError:  # the end-of-sequence token past a match has nowhere to go: that one is fine;
                # any other was masked out, so only one sampled without the mask (never by this engine)
                self.guide_failed = not self.guide.is_finished()

    def truncate_output(self, num_output: int) -> None:
        """Keep only the first `num_output` output tokens (a stop string ended the text inside a step's
        tokens), with their logprobs; the request is finished, or about to be."""
        cut = self.num_output_tokens - num_output
        if cut <= 0:
            return
        for lp, token in zip(self.logprobs[num_output:], self.output_token_ids[num_output:]):
            self.cumulative_logprob -= lp[token]
        del self.output_token_ids[num_output:], self.logprobs[num_output:]
        del self.all_token_ids[len(self.all_token_ids) - cut :]
        del self._hashes[len(self.all_token_ids) // self.block_size :]
        self.new_tokens = max(0, self.new_tokens - cut)

    @property
    def block_hashes(self) -> list[BlockHash]:
        """The prefix-cache hash of every full block of all_token_ids. Computed on first use, not at
        creation: a decode worker's remote prompt needs them only after its first token went out
        (~0.3 ms for 4096 tokens, off the time to first token), and without prefix caching never."""
        return self.hashes_upto(len(self.all_token_ids) // self.block_size)

    def hashes_upto(self, n: int) -> list[BlockHash]:
        """The hashes computed so far, at least those of the first `n` full blocks (n at most their number):
        a prefix lookup hashes only as far as it reads."""
        bs, hashes = self.block_size, self._hashes
        i = len(hashes)
        if i < n:
            parent = hashes[-1] if hashes else NONE_HASH
            hashes += hash_prompt_blocks(self.all_token_ids[i * bs : n * bs], bs, self.extra_keys, parent)
        return hashes
