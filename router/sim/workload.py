"""A seeded shared-prefix workload: chat conversations over a few long, Zipf-popular system prompts.

Conversations start as a Poisson process. Turn 1's prompt is a system prompt plus a user message;
turn k+1's prompt is turn k's prompt plus the assistant's reply plus a new user message, so it extends
the previous prompt, and a worker that prefilled turn k holds all but the reply and the new message.
Each request carries the real block-hash chain of its prompt (`engine.block_hash`), computed once per
block: a conversation's chain only grows, so every turn shares one list and keeps its length.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from engine.block_hash import NONE_HASH, BlockHash, extra_keys, hash_prompt_blocks


@dataclass(frozen=True)
class WorkloadConfig:
    num_requests: int = 10_000
    arrival_rate: float = 100.0  # requests (conversation turns) per second, in steady state
    num_system_prompts: int = 512
    zipf_s: float = 1.0  # popularity of system prompt i is proportional to 1 / (i + 1) ** zipf_s
    system_tokens: tuple[int, int] = (500, 3000)  # uniform range, inclusive
    user_tokens: tuple[int, int] = (20, 500)
    reply_tokens: tuple[int, int] = (50, 700)
    mean_turns: float = 4.0  # geometric
    think_time_s: float = 20.0  # mean gap between a conversation's turns (exponential)
    max_prompt_tokens: int = 16_384  # a conversation ends before its prompt would exceed this
    block_size: int = 16
    vocab_size: int = 32_000
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1 or self.arrival_rate <= 0 or self.mean_turns < 1:
            raise ValueError("need num_requests >= 1, arrival_rate > 0 and mean_turns >= 1")
        for lo, hi in (self.system_tokens, self.user_tokens, self.reply_tokens):
            if not 1 <= lo <= hi:
                raise ValueError(f"bad token range ({lo}, {hi})")

    @property
    def mean_prompt_tokens_first_turn(self) -> float:
        return (sum(self.system_tokens) + sum(self.user_tokens)) / 2


@dataclass(frozen=True, slots=True)
class Request:
    arrival: float  # seconds
    num_tokens: int
    conversation: int
    turn: int  # 1-based
    chain: list[BlockHash]  # the conversation's chain so far, shared by its turns
    num_blocks: int  # this turn's prompt holds chain[:num_blocks]

    @property
    def block_hashes(self) -> list[BlockHash]:
        return self.chain[: self.num_blocks]


class _Conversation:
    __slots__ = ("cid", "chain", "tail", "num_tokens", "turns_left")

    def __init__(self, cid: int, chain: list[BlockHash], tail: list[int], num_tokens: int, turns: int):
        self.cid = cid
        self.chain = chain
        self.tail = tail  # tokens after the last full block
        self.num_tokens = num_tokens
        self.turns_left = turns


class _Generator:
    def __init__(self, cfg: WorkloadConfig) -> None:
        self.cfg = cfg
        self.rng = np.random.default_rng(cfg.seed)
        self.extra = extra_keys("sim-model")
        weights = 1.0 / np.arange(1, cfg.num_system_prompts + 1) ** cfg.zipf_s
        self.popularity = weights / weights.sum()
        self.systems: dict[int, tuple[list[BlockHash], list[int], int]] = {}

    def tokens(self, bounds: tuple[int, int]) -> list[int]:
        n = int(self.rng.integers(bounds[0], bounds[1] + 1))
        return self.rng.integers(0, self.cfg.vocab_size, n).tolist()

    def extend(self, chain: list[BlockHash], tail: list[int], new: list[int]) -> list[int]:
        """Append the full blocks of tail + new to chain; return the new tail."""
        tokens = tail + new
        full = len(tokens) - len(tokens) % self.cfg.block_size
        parent = chain[-1] if chain else NONE_HASH
        chain += hash_prompt_blocks(tokens[:full], self.cfg.block_size, self.extra, parent)
        return tokens[full:]

    def system(self, idx: int) -> tuple[list[BlockHash], list[int], int]:
        if idx not in self.systems:
            chain: list[BlockHash] = []
            tokens = self.tokens(self.cfg.system_tokens)
            self.systems[idx] = (chain, self.extend(chain, [], tokens), len(tokens))
        return self.systems[idx]

    def start(self, cid: int) -> _Conversation:
        sys_chain, sys_tail, sys_tokens = self.system(
            int(self.rng.choice(len(self.popularity), p=self.popularity))
        )
        turns = int(self.rng.geometric(1.0 / self.cfg.mean_turns))
        return _Conversation(cid, list(sys_chain), list(sys_tail), sys_tokens, turns)

    def next_turn(self, conv: _Conversation, turn: int, arrival: float) -> Request | None:
        new = self.tokens(self.cfg.user_tokens)
        if turn > 1:
            new = self.tokens(self.cfg.reply_tokens) + new
        if conv.turns_left <= 0 or conv.num_tokens + len(new) > self.cfg.max_prompt_tokens:
            return None
        conv.turns_left -= 1
        conv.tail = self.extend(conv.chain, conv.tail, new)
        conv.num_tokens += len(new)
        return Request(arrival, conv.num_tokens, conv.cid, turn, conv.chain, len(conv.chain))


def generate(cfg: WorkloadConfig) -> list[Request]:
    """cfg.num_requests requests in arrival order; the same config always gives the same list."""
    gen = _Generator(cfg)
    conv_rate = cfg.arrival_rate / cfg.mean_turns
    pending: list[tuple[float, int, int, _Conversation]] = []  # (arrival, cid, turn, conversation)
    requests: list[Request] = []
    next_start, cid = float(gen.rng.exponential(1 / conv_rate)), 0
    while len(requests) < cfg.num_requests:
        if not pending or next_start <= pending[0][0]:
            heapq.heappush(pending, (next_start, cid, 1, gen.start(cid)))
            next_start += float(gen.rng.exponential(1 / conv_rate))
            cid += 1
            continue
        arrival, _, turn, conv = heapq.heappop(pending)
        req = gen.next_turn(conv, turn, arrival)
        if req is None:
            continue
        requests.append(req)
        gap = float(gen.rng.exponential(cfg.think_time_s))
        heapq.heappush(pending, (arrival + gap, conv.cid, turn + 1, conv))
    return requests
