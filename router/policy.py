"""Routing policies: which prefill worker and which decode worker serve a request.

`PrefixRouter.route` is the per-request path the router service calls: one index lookup, one policy
decision (pure: the policy sees a `RoutingView` and never touches the index), then a speculative index
entry for the chosen worker. Policies are pluggable by name: `make_policy("prefix_aware")`.
"""

from __future__ import annotations

import itertools
import math
import random
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from engine.block_hash import BlockHash
from router.index import PrefixIndex
from serving.kv_events import WorkerLoad


class NoWorkersError(RuntimeError):
    """No live prefill worker: the router answers UNAVAILABLE."""


LOCAL_PREFILL = ""  # a decision's prefill_worker when the decode worker prefills the prompt itself


@dataclass(frozen=True, slots=True)
class RoutingDecision:
    prefill_worker: str  # LOCAL_PREFILL: none, the decode worker prefills (aggregated serving)
    decode_worker: str | None  # None when no decode worker is live: the prefill worker decodes too
    matched_blocks: int  # leading prompt blocks the index says the prefill worker holds (0: not asked)
    uncached_tokens: int  # prompt tokens the prefill worker is expected to compute


@dataclass(frozen=True, slots=True)
class RoutingView:
    """What a policy decides from: the index's answer plus this router's own in-flight accounting."""

    num_tokens: int
    block_size: int
    matches: Mapping[str, int]
    prefill: Mapping[str, WorkerLoad]  # live workers that prefill, in a stable order
    decode: Mapping[str, WorkerLoad]  # live workers that decode
    outstanding: Mapping[str, int] = field(default_factory=dict)  # prefill tokens routed, not yet done
    decoding: Mapping[str, int] = field(default_factory=dict)  # requests routed to a decode worker, not done
    recent: Mapping[str, float] = field(default_factory=dict)  # prefill tokens routed lately (decayed)

    def queued(self) -> dict[str, int]:
        """Prefill tokens ahead of a new request per worker: the heartbeat's count or our own, the larger."""
        out = self.outstanding
        return {
            w: o if (o := out.get(w, 0)) > (q := load.queued_tokens) else q
            for w, load in self.prefill.items()
        }

    def uncached(self, worker: str) -> int:
        return max(1, self.num_tokens - self.matches.get(worker, 0) * self.block_size)

    def decision(self, prefill_worker: str, decode_worker: str | None) -> RoutingDecision:
        return RoutingDecision(
            prefill_worker, decode_worker, self.matches.get(prefill_worker, 0), self.uncached(prefill_worker)
        )


class RoutingPolicy(ABC):
    """Chooses the workers for one request. Pure planning from a `RoutingView`: no I/O.

    `PrefixRouter` calls `choose` under its lock, so a policy may keep unsynchronised state (a counter,
    an RNG). The view always holds at least one prefill worker.
    """

    name: ClassVar[str]
    uses_index: ClassVar[bool] = False  # False: the view's matches stay empty, and nothing is speculated

    @abstractmethod
    def choose(self, view: RoutingView) -> RoutingDecision: ...


POLICIES: dict[str, Callable[..., RoutingPolicy]] = {}


def register_policy(cls: type[RoutingPolicy]) -> type[RoutingPolicy]:
    POLICIES[cls.name] = cls
    return cls


def make_policy(name: str = "prefix_aware", **kwargs: float) -> RoutingPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(sorted(POLICIES))}")
    return POLICIES[name](**kwargs)


def least_busy_decode(view: RoutingView) -> str | None:
    """The decode worker with the smallest running batch among those with room for the prompt."""
    if not view.decode:
        return None
    need = -(-view.num_tokens // view.block_size) + 1

    def running(w: str) -> int:
        return max(view.decode[w].running_requests, view.decoding.get(w, 0))

    roomy = [w for w, load in view.decode.items() if load.free_blocks >= need]
    return min(roomy or view.decode, key=lambda w: (running(w), -view.decode[w].free_blocks))


@register_policy
class PrefixAwarePolicy(RoutingPolicy):
    """Least cost = uncached prompt tokens x per_token_cost + queued tokens (+ a share penalty).

    The first two terms are the request's expected time to first token in units of one prefilled
    token (per_token_cost > 1 charges recomputation extra for the fleet capacity it burns). Two guards
    keep a hot prefix from piling work onto one worker:
    - queue guard (hard): a worker whose queue exceeds balance_factor x the mean queue + balance_slack
      tokens is left out (SGLang's cache-aware router uses the same kind of threshold);
    - share penalty (soft): a worker whose recent work (tokens routed to it, decayed over the router's
      share window) exceeds share_factor x the mean + share_slack pays share_penalty x prompt tokens per
      mean's worth of excess. A queue says little while the fleet is lightly loaded, yet one worker's
      share keeps growing as it collects every new conversation on a hot system prompt. Being a cost,
      the penalty first moves the requests that lose least by moving: those whose prefix others hold.
    Ties go to the less loaded worker, then to the first in view order.
    """

    name = "prefix_aware"
    uses_index = True

    def __init__(
        self,
        per_token_cost: float = 1.5,
        balance_factor: float = 1.5,
        balance_slack: float = 4096,
        share_factor: float = 1.2,
        share_slack: float = 4096,
        share_penalty: float = 4.0,
    ) -> None:
        if (
            per_token_cost <= 0
            or min(balance_factor - 1, balance_slack, share_factor - 1, share_slack, share_penalty) < 0
        ):
            raise ValueError("need per_token_cost > 0, factors >= 1, slacks and share_penalty >= 0")
        self.per_token_cost = per_token_cost
        self.balance_factor = balance_factor
        self.balance_slack = balance_slack
        self.share_factor = share_factor
        self.share_slack = share_slack
        self.share_penalty = share_penalty

    def choose(self, view: RoutingView) -> RoutingDecision:
        return view.decision(self._cheapest(view), least_busy_decode(view))

    def _cheapest(self, view: RoutingView) -> str:
        queued = view.queued()
        limit = self.balance_factor * sum(queued.values()) / len(queued) + self.balance_slack
        recent, matches, n, bs = view.recent, view.matches, view.num_tokens, view.block_size
        mean_recent = sum(map(recent.get, queued, itertools.repeat(0.0))) / len(queued)
        over = self.share_factor * mean_recent + self.share_slack
        per_excess = self.share_penalty * n / mean_recent if mean_recent else 0.0
        # Every worker the index did not match recomputes the whole prompt: of those only the least
        # loaded can win, so the others are skipped. Ties go to the earlier worker in view order.
        best, best_key, unmatched_q = "", (float("inf"), 0), float("inf")
        for w, q in queued.items():
            if q > limit:
                continue
            r = recent.get(w, 0.0)
            m = matches.get(w)
            if m is None:
                if r <= over:
                    if q >= unmatched_q:
                        continue
                    unmatched_q = q
                cost = n * self.per_token_cost + q
            else:
                cost = (n - m * bs if n - m * bs > 1 else 1) * self.per_token_cost + q
            if r > over:
                cost += (r - over) * per_excess
            if (cost, q) < best_key:
                best, best_key = w, (cost, q)
        return best


@register_policy
class LeastLoadedPolicy(RoutingPolicy):
    name = "least_loaded"

    def choose(self, view: RoutingView) -> RoutingDecision:
        queued = view.queued()
        best = min(queued, key=queued.__getitem__)
        return view.decision(best, least_busy_decode(view))


@register_policy
class RoundRobinPolicy(RoutingPolicy):
    name = "round_robin"

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, view: RoutingView) -> RoutingDecision:
        prefill = list(view.prefill)
        decode = list(view.decode)
        self._turn += 1
        return view.decision(
            prefill[self._turn % len(prefill)], decode[self._turn % len(decode)] if decode else None
        )


@register_policy
class RandomPolicy(RoutingPolicy):
    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(self, view: RoutingView) -> RoutingDecision:
        decode = list(view.decode)
        return view.decision(
            self._rng.choice(list(view.prefill)), self._rng.choice(decode) if decode else None
        )


class RecentWork:
    """Prefill tokens routed to each worker, decayed exponentially with time constant window_s.

    Kept scaled by exp(t / window_s) so that adding is O(1); `decayed()` scales them back.
    """

    def __init__(self, window_s: float, clock: Callable[[], float]) -> None:
        self.window_s = window_s
        self._clock = clock
        self._t0 = clock()
        self._scaled: dict[str, float] = {}

    def add(self, worker: str, tokens: float) -> None:
        age = self._age()
        if age > 500:  # rescale before exp() overflows
            self._scaled = self.decayed()
            self._t0, age = self._clock(), 0.0
        self._scaled[worker] = self._scaled.get(worker, 0.0) + tokens * math.exp(age)

    def decayed(self) -> dict[str, float]:
        factor = math.exp(-self._age())
        return {w: v * factor for w, v in self._scaled.items()}

    def _age(self) -> float:
        return (self._clock() - self._t0) / self.window_s


class PrefixRouter:
    """The per-request routing path: look up, choose, speculate, and count work in flight.

    The router service calls `route` for each request, `prefill_done` when its first token arrives
    and `request_done` when it ends. Thread-safe. `live`, if given, says which workers are live and their
    loads (the router's own polls); otherwise the index's heartbeats do.
    """

    def __init__(
        self,
        index: PrefixIndex,
        policy: RoutingPolicy,
        *,
        block_size: int,
        speculate_ttl: float = 5.0,
        share_window_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        live: Callable[[], Mapping[str, WorkerLoad]] | None = None,
    ) -> None:
        self.index = index
        self._live = live
        self.policy = policy
        self.block_size = block_size
        self.speculate_ttl = speculate_ttl
        self._lock = threading.Lock()
        self._outstanding: dict[str, int] = {}
        self._decoding: dict[str, int] = {}
        self._recent = RecentWork(share_window_s, clock)
        # (prefill worker, the prompt's hashes, blocks matched) of decisions whose speculation is due
        self._to_speculate: list[tuple[str, Sequence[BlockHash], int]] = []

    def route(
        self, block_hashes: Sequence[BlockHash], num_tokens: int, *, speculate_later: bool = False
    ) -> RoutingDecision:
        """Choose the workers. The prompt's unmatched blocks are speculated as held by the chosen prefill
        worker now or, with `speculate_later`, at the next `speculate_pending()` or `route()`, whichever
        comes first: every later decision sees them, and a lazy chain (LazyBlockHashes) is hashed past
        its matched prefix only then, once the caller has sent the request on."""
        self.speculate_pending()
        uses_index = self.policy.uses_index
        # One round trip; workers come sorted by id, so ties break the same way in every router.
        lookup = self.index.lookup(block_hashes if uses_index else ())
        workers = lookup.workers if self._live is None else self._live()
        prefill = {w: load for w, load in workers.items() if load.role != "decode"}
        if not prefill:
            raise NoWorkersError("no live prefill worker")
        decode = {w: load for w, load in workers.items() if load.role != "prefill"}
        with self._lock:
            view = RoutingView(
                num_tokens,
                self.block_size,
                lookup.matches,
                prefill,
                decode,
                self._outstanding,
                self._decoding,
                self._recent.decayed(),
            )
            decision = self.policy.choose(view)
            _add(self._outstanding, decision.prefill_worker, decision.uncached_tokens)
            self._recent.add(decision.prefill_worker, decision.uncached_tokens)
            if decision.decode_worker is not None:
                _add(self._decoding, decision.decode_worker, 1)
        if uses_index and self.speculate_ttl > 0:
            due = (decision.prefill_worker, block_hashes, decision.matched_blocks)
            if speculate_later:
                with self._lock:
                    self._to_speculate.append(due)
            else:
                self._speculate(*due)
        return decision

    def speculate_pending(self) -> None:
        """Speculate the blocks of the decisions routed with `speculate_later` so far."""
        if not self._to_speculate:
            return
        with self._lock:
            due, self._to_speculate = self._to_speculate, []
        for worker, block_hashes, matched in due:
            self._speculate(worker, block_hashes, matched)

    def _speculate(self, worker: str, block_hashes: Sequence[BlockHash], matched: int) -> None:
        # the matched prefix is held (or speculated) already
        self.index.speculate(worker, block_hashes[matched:], self.speculate_ttl)

    def prefill_done(self, decision: RoutingDecision) -> None:
        with self._lock:
            _add(self._outstanding, decision.prefill_worker, -decision.uncached_tokens)

    def request_done(self, decision: RoutingDecision) -> None:
        if decision.decode_worker is not None:
            with self._lock:
                _add(self._decoding, decision.decode_worker, -1)


def _add(counts: dict[str, int], key: str, delta: int) -> None:
    value = counts.get(key, 0) + delta
    if value > 0:
        counts[key] = value
    else:
        counts.pop(key, None)
