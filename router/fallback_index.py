"""The prefix index as an optimisation, never a dependency: `FallbackIndex` wraps one and answers every call
that fails (Redis down, a timeout, a bug) with what "no index" means: no matches, nothing applied.

After a failure the wrapped index is left alone for `retry_s` (a circuit breaker): one call per interval
probes it, so requests do not each pay a timeout while it is down. The first call that works again closes
the circuit, and `take_recovered()` tells the router to resync the index from its workers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from engine.block_hash import BlockHash
from router.events import EventBatch, WorkerLoad
from router.index import ApplyResult, Lookup, PrefixIndex
from router.metrics import RouterMetrics

logger = logging.getLogger(__name__)

T = TypeVar("T")
_EMPTY = Lookup({}, {})


class FallbackIndex(PrefixIndex):
    def __init__(
        self,
        index: PrefixIndex,
        retry_s: float,
        metrics: RouterMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.index = index
        self.retry_s = retry_s
        self.metrics = metrics
        self._clock = clock
        self._retry_at = 0.0  # while down: no call before this
        self.up = True
        self._recovered = False

    def _call(self, fallback: T, fn: Callable[..., T], *args: Any) -> T:
        if not self.up and self._clock() < self._retry_at:
            return fallback
        try:
            out = fn(*args)
        except Exception as exc:
            self._failed(exc)
            return fallback
        if not self.up:
            self.up, self._recovered = True, True
            self.metrics.index_state.set(1)
            logger.warning("the prefix index answers again: resyncing it from the workers")
        return out

    def _failed(self, exc: Exception) -> None:
        self.metrics.index_errors.inc()
        self._retry_at = self._clock() + self.retry_s
        if self.up:
            self.up = False
            self.metrics.index_state.set(0)
            logger.warning(
                "the prefix index failed (%s: %s); routing by load alone, trying it again every %g s",
                type(exc).__name__,
                exc,
                self.retry_s,
            )

    def take_recovered(self) -> bool:
        """True once after each return of the index (its entries may be gone: resync them)."""
        recovered, self._recovered = self._recovered, False
        return recovered

    def apply(self, batch: EventBatch) -> ApplyResult:
        return self._call(ApplyResult.RESYNC_NEEDED, self.index.apply, batch)

    def resync(self, worker_id: str, epoch: int, seq: int, all_hashes: Iterable[BlockHash]) -> ApplyResult:
        return self._call(ApplyResult.RESYNC_NEEDED, self.index.resync, worker_id, epoch, seq, all_hashes)

    def heartbeat(self, worker_id: str, epoch: int, load: WorkerLoad, seq: int | None = None) -> ApplyResult:
        return self._call(ApplyResult.RESYNC_NEEDED, self.index.heartbeat, worker_id, epoch, load, seq)

    def speculate(self, worker_id: str, hashes: Sequence[BlockHash], ttl: float) -> None:
        self._call(None, self.index.speculate, worker_id, hashes, ttl)

    def match(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        return self._call({}, self.index.match, block_hashes)

    def workers(self) -> dict[str, WorkerLoad]:
        return self._call({}, self.index.workers)

    def lookup(self, block_hashes: Sequence[BlockHash]) -> Lookup:
        return self._call(_EMPTY, self.index.lookup, block_hashes)

    def remove_worker(self, worker_id: str) -> None:
        self._call(None, self.index.remove_worker, worker_id)

    def reap(self) -> list[str]:
        return self._call([], self.index.reap)

    def num_entries(self) -> int:
        return self._call(0, self.index.num_entries)
