"""The prefix index as an optimisation, never a dependency: `FallbackIndex` wraps one and answers every call
that fails (Redis down, a timeout, a bug) with what "no index" means: no matches, nothing applied.

After a failure the wrapped index is left alone for `retry_s` (a circuit breaker): one write per interval
(the poller's heartbeat) probes it, so requests do not each pay a timeout while it is down; queries get
"no index" until a probe works. The first call that works again closes
the circuit. Whatever the index lost meanwhile the router repairs from its workers: each heartbeat carries
the last event seq it applied, and an index that no longer has it asks for a snapshot.
Thread-safe: the router applies events and snapshots from a thread, routes from its event loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from engine.block_hash import BlockHash
from router.index import ApplyResult, Lookup, PrefixIndex
from router.metrics import RouterMetrics
from serving.kv_events import EventBatch, WorkerLoad

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
        self._lock = threading.Lock()
        self._retry_at = 0.0  # while down: no call before this
        self.up = True

    def _read(self, fallback: T, fn: Callable[..., T], *args: Any) -> T:
        """A query: answered while the index is up; it never probes one that is down (a mirror could
        answer from memory while Redis is gone, and must not close the circuit)."""
        return self._call(fallback, fn, *args) if self.up else fallback

    def _call(self, fallback: T, fn: Callable[..., T], *args: Any) -> T:
        if not self.up and self._clock() < self._retry_at:
            return fallback
        try:
            out = fn(*args)
        except Exception as exc:
            self._failed(exc)
            return fallback
        if not self.up:
            with self._lock:
                back, self.up = not self.up, True
            if back:
                self.metrics.index_state.set(1)
                logger.warning("the prefix index answers again; workers whose entries it lost are resynced")
        return out

    def _failed(self, exc: Exception) -> None:
        self.metrics.index_errors.inc()
        if _is_redis(exc):
            self.metrics.redis_errors.labels("index").inc()
        with self._lock:
            self._retry_at = self._clock() + self.retry_s
            went_down, self.up = self.up, False
        if went_down:
            self.metrics.index_state.set(0)
            logger.warning(
                "the prefix index failed (%s: %s); routing by load alone, trying it again every %g s",
                type(exc).__name__,
                exc,
                self.retry_s,
            )

    def apply(self, batch: EventBatch) -> ApplyResult:
        return self._call(ApplyResult.RESYNC_NEEDED, self.index.apply, batch)

    def resync(self, worker_id: str, epoch: int, seq: int, all_hashes: Iterable[BlockHash]) -> ApplyResult:
        return self._call(ApplyResult.RESYNC_NEEDED, self.index.resync, worker_id, epoch, seq, all_hashes)

    def heartbeat(self, worker_id: str, epoch: int, load: WorkerLoad, seq: int | None = None) -> ApplyResult:
        return self._call(ApplyResult.RESYNC_NEEDED, self.index.heartbeat, worker_id, epoch, load, seq)

    def speculate(self, worker_id: str, hashes: Sequence[BlockHash], ttl: float) -> None:
        self._read(None, self.index.speculate, worker_id, hashes, ttl)

    def match(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        return self._read({}, self.index.match, block_hashes)

    def workers(self) -> dict[str, WorkerLoad]:
        return self._read({}, self.index.workers)

    def lookup(self, block_hashes: Sequence[BlockHash]) -> Lookup:
        return self._read(_EMPTY, self.index.lookup, block_hashes)

    def remove_worker(self, worker_id: str) -> None:
        self._call(None, self.index.remove_worker, worker_id)

    def reap(self) -> list[str]:
        return self._call([], self.index.reap)

    def num_entries(self) -> int:
        return self._read(0, self.index.num_entries)

    def close(self) -> None:
        self.index.close()


def _is_redis(exc: Exception) -> bool:
    return any(c.__module__.split(".")[0] == "redis" for c in type(exc).__mro__)
