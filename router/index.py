"""The router's prefix index: which prefill worker holds which KV block hashes.

Workers feed it `EventBatch`es and heartbeats; the router asks it, per request, how many leading blocks
of the prompt's hash chain each live worker holds. Nothing here ever sees prompt text.
"""

from __future__ import annotations

import bisect
import enum
import heapq
import itertools
import operator
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from engine.block_hash import BlockHash
from serving.kv_events import AllBlocksCleared, BlockStored, EventBatch, KVEvent, WorkerLoad


class ApplyResult(enum.Enum):
    APPLIED = "applied"
    STALE = "stale"  # an old epoch, a duplicate or an out-of-date snapshot: ignored
    RESYNC_NEEDED = "resync_needed"  # the worker's entries may be wrong until resync() gets a snapshot


@dataclass(frozen=True, slots=True)
class Lookup:
    matches: dict[str, int]  # live worker -> leading blocks of the chain it holds (only those with >= 1)
    workers: dict[str, WorkerLoad]  # every live worker and its last reported load


class PrefixIndex(ABC):
    """Per worker, the block hashes it holds; per request, the longest prefix each worker holds.

    Callers: the router's event consumer calls `apply`, `heartbeat` and `resync` as worker messages
    arrive; its request path calls `lookup` (or `match`/`workers`) and then `speculate` for the worker
    it picked. Every method is thread-safe and may be called from any thread.

    Contract:
    - Epochs. A batch, heartbeat or snapshot under a new epoch means the worker restarted: everything
      held under its old epoch is dropped, and messages that still carry an old epoch are STALE.
    - Sequence numbers. Within an epoch, batches are numbered 1, 2, 3, ...; a duplicate is STALE; a gap
      (or a heartbeat announcing a seq the index has not seen) is applied as well as it can be and
      answered RESYNC_NEEDED, and keeps being answered so until `resync` brings a snapshot at least as new
      as the gap. The caller then fetches `KVEventPublisher.snapshot()` from that worker.
    - Liveness. Any batch or heartbeat keeps a worker alive for the index's heartbeat TTL. A silent worker
      drops out of `match`/`workers` once its TTL passes and its entries are removed (`reap`).
    - Speculation. `speculate` marks blocks as held before the worker's own events arrive; an entry that
      no BlockStored confirms is gone after its TTL. BlockRemoved and AllBlocksCleared remove both kinds.
    """

    @abstractmethod
    def apply(self, batch: EventBatch) -> ApplyResult: ...

    @abstractmethod
    def resync(self, worker_id: str, epoch: int, seq: int, all_hashes: Iterable[BlockHash]) -> ApplyResult:
        """Replace the worker's entries by a snapshot taken after its batch `seq`."""

    @abstractmethod
    def heartbeat(self, worker_id: str, epoch: int, load: WorkerLoad, seq: int | None = None) -> ApplyResult:
        """Keep the worker alive and record its load; `seq`, if given, is its last batch sent."""

    @abstractmethod
    def speculate(self, worker_id: str, hashes: Sequence[BlockHash], ttl: float) -> None: ...

    @abstractmethod
    def match(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]: ...

    @abstractmethod
    def workers(self) -> dict[str, WorkerLoad]: ...

    def lookup(self, block_hashes: Sequence[BlockHash]) -> Lookup:
        """`match` and `workers` together; backends answer it in one round trip where they can."""
        return Lookup(self.match(block_hashes), self.workers())

    @abstractmethod
    def remove_worker(self, worker_id: str) -> None: ...

    @abstractmethod
    def reap(self) -> list[str]:
        """Drop the workers whose heartbeat TTL has passed, with their entries; return their ids."""

    @abstractmethod
    def num_entries(self) -> int:
        """(worker, block) pairs held, speculative ones not counted."""

    def close(self) -> None:  # noqa: B027 (most indexes run nothing in the background)
        """Stop what the index runs in the background, if anything."""


class _Worker:
    __slots__ = ("worker_id", "bit", "epoch", "last_seq", "retired", "blocks", "spec", "pending", "log")

    def __init__(self, worker_id: str, bit: int, epoch: int) -> None:
        self.worker_id = worker_id
        self.bit = bit  # 1 << slot: the worker's bit in every holder mask
        self.epoch = epoch
        self.last_seq = 0
        self.retired: deque[int] = deque(maxlen=8)
        self.blocks: set[BlockHash] = set()
        self.spec: dict[BlockHash, float] = {}  # speculative hash -> expiry
        self.pending = False  # waiting for a resync
        self.log: deque[EventBatch] = deque(maxlen=4096)  # batches applied while pending, for replay


class InMemoryPrefixIndex(PrefixIndex):
    """The default index, in the router's process.

    Holders of a block are one int bitmask (a bit per worker slot), so `match` walks the chain with one
    dict lookup and one AND per block, all in C, and returns at once when nobody holds the first block.
    """

    def __init__(self, heartbeat_ttl: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        if heartbeat_ttl <= 0:
            raise ValueError(f"heartbeat_ttl must be positive, got {heartbeat_ttl}")
        self.heartbeat_ttl = heartbeat_ttl
        self._clock = clock
        self._lock = threading.Lock()
        self._holders: dict[BlockHash, int] = {}  # hash -> mask of workers holding it (real or speculative)
        self._workers: dict[str, _Worker] = {}
        self._slots: list[_Worker | None] = []
        self._loads: dict[str, WorkerLoad] = {}
        self._deadline: dict[str, float] = {}
        self._live_mask = 0
        self._view: dict[str, WorkerLoad] | None = None  # live workers' loads sorted by id, until a change
        self._next_reap = float("inf")
        self._spec_heap: list[tuple[float, int, _Worker, tuple[BlockHash, ...]]] = []
        self._spec_counter = itertools.count()

    # --- worker messages -------------------------------------------------------------------------
    def apply(self, batch: EventBatch) -> ApplyResult:
        with self._lock:
            self._expire(self._clock())
            w = self._current(batch.worker_id, batch.epoch)
            if w is None:
                return ApplyResult.STALE
            self._touch(w)
            if batch.seq <= w.last_seq:
                return ApplyResult.STALE
            if batch.seq != w.last_seq + 1 and not w.pending:
                w.pending = True
                w.log.clear()
            self._apply_events(w, batch.events)
            w.last_seq = batch.seq
            if w.pending:
                w.log.append(batch)
            return ApplyResult.RESYNC_NEEDED if w.pending else ApplyResult.APPLIED

    def resync(self, worker_id: str, epoch: int, seq: int, all_hashes: Iterable[BlockHash]) -> ApplyResult:
        with self._lock:
            self._expire(self._clock())
            w = self._current(worker_id, epoch)
            if w is None or (seq < w.last_seq and not w.pending):
                return ApplyResult.STALE  # older than what we hold, and nothing to replay on top of it
            self._touch(w)
            self._replace_blocks(w, set(all_hashes))
            expected = seq
            for batch in list(w.log):  # replay what arrived after the snapshot was taken
                if batch.seq > seq:
                    self._apply_events(w, batch.events)
                    expected = batch.seq if batch.seq == expected + 1 else -1
            w.last_seq = max(w.last_seq, seq)
            w.pending = expected < w.last_seq
            if not w.pending:
                w.log.clear()
            return ApplyResult.RESYNC_NEEDED if w.pending else ApplyResult.APPLIED

    def heartbeat(self, worker_id: str, epoch: int, load: WorkerLoad, seq: int | None = None) -> ApplyResult:
        with self._lock:
            self._expire(self._clock())
            w = self._current(worker_id, epoch)
            if w is None:
                return ApplyResult.STALE
            self._touch(w)
            if self._loads.get(worker_id) != load:
                self._loads[worker_id] = load
                self._view = None
            if seq is not None and seq > w.last_seq and not w.pending:
                w.pending = True  # a batch was lost and nothing came after it
                w.log.clear()
            return ApplyResult.RESYNC_NEEDED if w.pending else ApplyResult.APPLIED

    def speculate(self, worker_id: str, hashes: Sequence[BlockHash], ttl: float) -> None:
        with self._lock:
            now = self._clock()
            self._expire(now)
            w = self._workers.get(worker_id)
            if w is None or not self._live_mask & w.bit or not hashes:
                return
            expiry = now + ttl
            fresh = tuple(set(hashes).difference(w.blocks))  # held for real: nothing to speculate
            w.spec.update(zip(fresh, itertools.repeat(expiry)))
            self._set(fresh, w.bit)
            if fresh:
                heapq.heappush(self._spec_heap, (expiry, next(self._spec_counter), w, fresh))

    def remove_worker(self, worker_id: str) -> None:
        with self._lock:
            w = self._workers.get(worker_id)
            if w is not None:
                self._drop(w)

    # --- queries ---------------------------------------------------------------------------------
    def match(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        with self._lock:
            self._expire(self._clock())
            return self._match(block_hashes)

    def workers(self) -> dict[str, WorkerLoad]:
        with self._lock:
            self._expire(self._clock())
            return dict(self._live_view())

    def lookup(self, block_hashes: Sequence[BlockHash]) -> Lookup:
        with self._lock:
            self._expire(self._clock())
            return Lookup(self._match(block_hashes), dict(self._live_view()))

    def reap(self) -> list[str]:
        with self._lock:
            return self._reap(self._clock())

    def num_entries(self) -> int:
        with self._lock:
            return sum(len(w.blocks) for w in self._workers.values())

    # --- internals (caller holds the lock) -------------------------------------------------------
    def _match(self, chain: Sequence[BlockHash]) -> dict[str, int]:
        result: dict[str, int] = {}
        if not chain or not self._holders.get(chain[0], 0) & self._live_mask:
            return result
        # Running AND of the holder masks along the chain, computed in C. Each mask is a subset of the
        # one before, so the sequence never increases and bisect finds where each worker drops out. It
        # stops at the first block no live worker holds: a lazy chain (LazyBlockHashes) is read no further.
        masks = map(self._holders.get, chain, itertools.repeat(0))
        prefix = list(
            itertools.takewhile(bool, itertools.accumulate(masks, operator.and_, initial=self._live_mask))
        )
        depth, cand = 1, prefix[1]
        while cand:
            depth = bisect.bisect_right(prefix, -cand, lo=depth, key=operator.neg)  # first mask != cand
            if depth == len(prefix):
                self._record(cand, depth - 1, result)
                break
            self._record(cand & ~prefix[depth], depth - 1, result)
            cand = prefix[depth]
        return result

    def _record(self, mask: int, depth: int, result: dict[str, int]) -> None:
        while mask:
            low = mask & -mask
            w = self._slots[low.bit_length() - 1]
            assert w is not None
            result[w.worker_id] = depth
            mask ^= low

    def _live_view(self) -> dict[str, WorkerLoad]:
        if self._view is None:
            live = sorted(w.worker_id for w in self._workers.values() if self._live_mask & w.bit)
            self._view = {wid: self._loads.get(wid) or WorkerLoad() for wid in live}
        return self._view

    def _current(self, worker_id: str, epoch: int) -> _Worker | None:
        """The worker's state under `epoch` (a new epoch clears it), or None for a retired epoch."""
        w = self._workers.get(worker_id)
        if w is None:
            w = _Worker(worker_id, self._free_bit(), epoch)
            self._workers[worker_id] = w
            self._slots[w.bit.bit_length() - 1] = w
        elif epoch in w.retired:
            return None
        elif epoch != w.epoch:
            w.retired.append(w.epoch)
            self._clear(w)
            w.epoch, w.last_seq, w.pending = epoch, 0, False
            w.log.clear()
        return w

    def _free_bit(self) -> int:
        for slot, occupant in enumerate(self._slots):
            if occupant is None:
                return 1 << slot
        self._slots.append(None)
        return 1 << (len(self._slots) - 1)

    def _touch(self, w: _Worker) -> None:
        deadline = self._clock() + self.heartbeat_ttl
        self._deadline[w.worker_id] = deadline
        if not self._live_mask & w.bit:
            self._live_mask |= w.bit
            self._view = None
        self._next_reap = min(self._next_reap, deadline)

    def _apply_events(self, w: _Worker, events: Iterable[KVEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                w.blocks.update(event.hashes)
                self._set(event.hashes, w.bit)
            elif isinstance(event, AllBlocksCleared):
                self._clear(w)
            else:
                w.blocks.difference_update(event.hashes)
                for h in event.hashes:
                    w.spec.pop(h, None)
                self._unset(event.hashes, w.bit)

    def _replace_blocks(self, w: _Worker, new: set[BlockHash]) -> None:
        self._unset([h for h in w.blocks - new if h not in w.spec], w.bit)
        self._set(new - w.blocks, w.bit)
        w.blocks = new

    def _set(self, hashes: Iterable[BlockHash], bit: int) -> None:
        holders = self._holders
        hashes = list(hashes)  # all in C: holders[h] |= bit for every h
        holders.update(
            zip(
                hashes,
                map(operator.or_, map(holders.get, hashes, itertools.repeat(0)), itertools.repeat(bit)),
            )
        )

    def _unset(self, hashes: Iterable[BlockHash], bit: int) -> None:
        holders = self._holders
        hashes = list(hashes)  # holders[h] &= ~bit for every h, in C; then drop the emptied entries
        masks = list(
            map(operator.and_, map(holders.get, hashes, itertools.repeat(0)), itertools.repeat(~bit))
        )
        holders.update(zip(hashes, masks))
        for h in itertools.compress(hashes, map(operator.not_, masks)):
            holders.pop(h, None)

    def _clear(self, w: _Worker) -> None:
        self._unset(w.blocks, w.bit)
        self._unset(w.spec, w.bit)
        w.blocks, w.spec = set(), {}

    def _drop(self, w: _Worker) -> None:
        self._clear(w)
        del self._workers[w.worker_id]
        self._slots[w.bit.bit_length() - 1] = None
        self._loads.pop(w.worker_id, None)
        self._deadline.pop(w.worker_id, None)
        self._live_mask &= ~w.bit
        self._view = None

    def _expire(self, now: float) -> None:
        heap = self._spec_heap
        while heap and heap[0][0] <= now:
            expiry, _, w, hashes = heapq.heappop(heap)
            if self._workers.get(w.worker_id) is not w:
                continue  # dropped since
            spec = w.spec
            due = [h for h in hashes if spec.get(h) == expiry]  # not refreshed by a later speculation
            for h in due:
                del spec[h]
            self._unset([h for h in due if h not in w.blocks], w.bit)
        if now >= self._next_reap:
            self._reap(now)

    def _reap(self, now: float) -> list[str]:
        dead = [self._workers[wid] for wid, t in self._deadline.items() if t < now]
        for w in dead:
            self._silent(w)
        self._next_reap = min(self._deadline.values(), default=float("inf"))
        return [w.worker_id for w in dead]

    def _silent(self, w: _Worker) -> None:
        """A worker's TTL passed: it goes, with its entries."""
        self._drop(w)
