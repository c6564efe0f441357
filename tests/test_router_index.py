"""The prefix index contract, run here against InMemoryPrefixIndex and in test_router_redis.py against Redis."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import pytest

from router.index import ApplyResult, InMemoryPrefixIndex, PrefixIndex
from serving.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventPublisher,
    Snapshot,
    WorkerLoad,
    decode_events,
)

H = [hashlib.sha256(b"block %d" % i).digest() for i in range(12)]
APPLIED, STALE, RESYNC = ApplyResult.APPLIED, ApplyResult.STALE, ApplyResult.RESYNC_NEEDED


def stored(worker: str, epoch: int, seq: int, *hashes: bytes) -> EventBatch:
    return EventBatch(worker, epoch, seq, (BlockStored(hashes),), 0.0)


def removed(worker: str, epoch: int, seq: int, *hashes: bytes) -> EventBatch:
    return EventBatch(worker, epoch, seq, (BlockRemoved(hashes),), 0.0)


class IndexContract:
    """Each backend's test class provides `make(ttl)` -> index and `advance(seconds)`."""

    make: Callable[..., PrefixIndex]
    advance: Callable[[float], None]
    TTL = 1.0

    def two_workers(self) -> PrefixIndex:
        index = self.make(self.TTL)
        assert index.heartbeat("a", 1, WorkerLoad()) is APPLIED
        assert index.heartbeat("b", 2, WorkerLoad(queued_tokens=7)) is APPLIED
        assert index.apply(stored("a", 1, 1, *H[:5])) is APPLIED
        assert index.apply(stored("b", 2, 1, *H[:3])) is APPLIED
        return index

    def test_match_is_the_longest_prefix_per_worker(self) -> None:
        index = self.two_workers()
        assert index.match(H) == {"a": 5, "b": 3}
        assert index.match(H[:2]) == {"a": 2, "b": 2}
        assert index.match([H[11], *H]) == {}
        assert index.match([]) == {}
        assert index.workers() == {"a": WorkerLoad(), "b": WorkerLoad(queued_tokens=7)}
        lookup = index.lookup(H[:4])
        assert lookup.matches == {"a": 4, "b": 3}
        assert list(lookup.workers) == ["a", "b"]
        assert index.num_entries() == 8

    def test_removed_block_cuts_the_prefix_and_clear_drops_all(self) -> None:
        index = self.two_workers()
        assert index.apply(removed("a", 1, 2, H[2])) is APPLIED
        assert index.match(H) == {"a": 2, "b": 3}
        assert index.apply(EventBatch("b", 2, 2, (AllBlocksCleared(), BlockStored((H[0],))), 0.0)) is APPLIED
        assert index.match(H) == {"a": 2, "b": 1}
        assert index.num_entries() == 5

    def test_new_epoch_clears_the_old_entries_and_old_epoch_is_stale(self) -> None:
        index = self.two_workers()
        assert index.apply(stored("a", 99, 1, H[0])) is APPLIED  # worker a restarted
        assert index.match(H) == {"a": 1, "b": 3}
        assert index.apply(stored("a", 1, 2, *H[:8])) is STALE  # a late batch from the old process
        assert index.heartbeat("a", 1, WorkerLoad()) is STALE
        assert index.match(H) == {"a": 1, "b": 3}
        assert index.heartbeat("b", 3, WorkerLoad()) is APPLIED  # a heartbeat also carries the epoch
        assert index.match(H) == {"a": 1}

    def test_duplicate_batch_is_stale(self) -> None:
        index = self.two_workers()
        assert index.apply(removed("a", 1, 1, H[0])) is STALE
        assert index.match(H) == {"a": 5, "b": 3}

    def test_lost_batch_asks_for_resync_and_the_snapshot_repairs(self) -> None:
        index = self.two_workers()
        # Batch 2 (removing H[1]) is lost; 3 and 4 arrive. The worker's truth after 4: H0, H5.
        assert index.apply(stored("a", 1, 3, H[5])) is RESYNC
        assert index.apply(removed("a", 1, 4, H[2], H[3], H[4])) is RESYNC  # still pending
        assert index.match(H) == {"a": 2, "b": 3}  # wrong until the resync
        # The snapshot was taken after batch 3: replaying batch 4 on top of it gives the truth.
        assert index.resync("a", 1, 3, [H[0], H[2], H[3], H[4], H[5]]) is APPLIED
        assert index.match(H) == {"a": 1, "b": 3}
        assert index.match([H[0], H[5]]) == {"a": 2, "b": 1}
        assert index.apply(stored("a", 1, 5, H[1])) is APPLIED  # numbering goes on from 4
        assert index.match(H) == {"a": 2, "b": 3}

    def test_resync_older_than_the_applied_batches_is_stale(self) -> None:
        index = self.two_workers()
        assert index.apply(stored("a", 1, 2, H[5])) is APPLIED
        assert index.resync("a", 1, 1, [H[0]]) is STALE
        assert index.match(H) == {"a": 6, "b": 3}
        assert index.resync("a", 1, 2, [H[0], H[1]]) is APPLIED  # an unasked, current snapshot is fine
        assert index.match(H) == {"a": 2, "b": 3}

    def test_heartbeat_announcing_an_unseen_batch_asks_for_resync(self) -> None:
        index = self.two_workers()
        assert index.heartbeat("a", 1, WorkerLoad(), seq=1) is APPLIED
        assert index.heartbeat("a", 1, WorkerLoad(), seq=2) is RESYNC  # batch 2 never arrived
        assert index.resync("a", 1, 2, H[:2]) is APPLIED
        assert index.match(H) == {"a": 2, "b": 3}

    def test_a_router_that_knows_nothing_resyncs_a_running_worker(self) -> None:
        index = self.make(self.TTL)
        assert index.apply(stored("a", 1, 40, H[3])) is RESYNC
        assert index.resync("a", 1, 40, H[:4]) is APPLIED
        assert index.match(H) == {"a": 4}

    def test_silent_worker_drops_out_of_routing_and_of_the_index(self) -> None:
        index = self.two_workers()
        self.advance(self.TTL * 0.6)
        assert index.heartbeat("b", 2, WorkerLoad()) is APPLIED
        self.advance(self.TTL * 0.6)  # a has been silent for 1.2 TTL, b for 0.6
        assert index.reap() == ["a"]
        assert index.match(H) == {"b": 3}
        assert list(index.workers()) == ["b"]
        assert index.num_entries() == 3
        assert index.apply(stored("a", 1, 2, H[0])) is RESYNC  # it comes back: unknown, so resync
        assert index.resync("a", 1, 2, H[:2]) is APPLIED
        assert index.match(H) == {"a": 2, "b": 3}

    def test_speculative_entries_expire_unless_confirmed(self) -> None:
        index = self.two_workers()
        index.speculate("b", H[3:6], ttl=self.TTL * 0.5)
        assert index.match(H) == {"a": 5, "b": 6}
        assert index.apply(stored("b", 2, 2, H[3])) is APPLIED  # the worker confirms one block
        index.heartbeat("a", 1, WorkerLoad())
        index.heartbeat("b", 2, WorkerLoad())
        self.advance(self.TTL * 0.7)
        assert index.match(H) == {"a": 5, "b": 4}
        assert index.num_entries() == 9

    def test_removed_and_cleared_drop_speculation_too(self) -> None:
        index = self.two_workers()
        index.speculate("b", H[3:6], ttl=60.0)
        assert index.apply(removed("b", 2, 2, H[4])) is APPLIED
        assert index.match(H) == {"a": 5, "b": 4}
        assert index.apply(EventBatch("b", 2, 3, (AllBlocksCleared(),), 0.0)) is APPLIED
        assert index.match(H) == {"a": 5}

    def test_speculation_for_an_unknown_worker_is_ignored(self) -> None:
        index = self.two_workers()
        index.speculate("zz", H[:8], ttl=60.0)
        assert index.match(H) == {"a": 5, "b": 3}

    def test_remove_worker(self) -> None:
        index = self.two_workers()
        index.remove_worker("a")
        assert index.match(H) == {"b": 3}
        assert list(index.workers()) == ["b"]
        assert index.num_entries() == 3

    def test_publisher_batches_feed_the_index_and_its_snapshot_resyncs(self) -> None:
        index = self.make(self.TTL)
        held: list[bytes] = []
        delivered: list[EventBatch] = []
        pub = KVEventPublisher("p", lambda: list(held), sink=delivered.append, epoch=5)
        held += H[:4]
        pub.stored(H[:2])
        pub.stored(H[2:4])
        batch = pub.flush()
        assert batch is not None and batch.seq == 1 and batch.events == (BlockStored(tuple(H[:4])),)
        assert pub.flush() is None
        assert index.apply(EventBatch.from_bytes(delivered[0].to_bytes())) is APPLIED
        assert index.match(H) == {"p": 4}
        held.remove(H[1])
        pub.on_block_event("removed", [H[1]])
        pub.flush()  # batch 2: lost on the way
        pub.stored([H[8]])
        held.append(H[8])
        third = pub.flush()
        assert third is not None and index.apply(third) is RESYNC
        snap = Snapshot.from_bytes(pub.snapshot().to_bytes())
        assert (snap.epoch, snap.seq, set(snap.hashes)) == (5, 3, {H[0], H[2], H[3], H[8]})
        assert index.resync(snap.worker_id, snap.epoch, snap.seq, snap.hashes) is APPLIED
        assert index.match(H) == {"p": 1}


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class TestInMemoryIndex(IndexContract):
    @pytest.fixture(autouse=True)
    def _clock(self) -> None:
        self.clock = FakeClock()
        self.make = lambda ttl: InMemoryPrefixIndex(heartbeat_ttl=ttl, clock=self.clock)

    def advance(self, seconds: float) -> None:
        self.clock.now += seconds


def test_event_batch_round_trips_and_is_compact() -> None:
    batch = EventBatch(
        "worker-ä", 2**64 - 1, 7, (BlockStored(tuple(H[:3])), BlockRemoved((H[3],)), AllBlocksCleared()), 12.5
    )
    data = batch.to_bytes()
    assert EventBatch.from_bytes(data) == batch
    assert len(data) == 31 + len("worker-ä".encode()) + 3 * 5 + 4 * 32
    with pytest.raises(ValueError):
        Snapshot.from_bytes(data)
    with pytest.raises(ValueError):
        EventBatch.from_bytes(data[:-1])
    with pytest.raises(ValueError):
        decode_events(b"X\x00\x00\x00\x00")
    with pytest.raises(ValueError, match="32 bytes"):
        EventBatch("w", 1, 1, (BlockStored((b"short",)),), 0.0).to_bytes()


def test_publisher_epoch_is_random_and_clear_supersedes_pending_events() -> None:
    a, b = KVEventPublisher("w", list), KVEventPublisher("w", list)
    assert a.epoch != b.epoch and 0 <= a.epoch < 2**64
    a.stored(H[:2])
    a.removed([H[0]])
    a.cleared()
    a.stored([H[5]])
    batch = a.flush()
    assert batch is not None
    assert batch.events == (AllBlocksCleared(), BlockStored((H[5],)))
    with pytest.raises(ValueError):
        a.on_block_event("evicted", [])


def test_worker_load_json_round_trip() -> None:
    load = WorkerLoad("decode", 1, 2, 3, 4)
    assert WorkerLoad.from_json(load.to_json()) == load
    assert WorkerLoad.from_json(b"") == WorkerLoad()
    with pytest.raises(ValueError):
        WorkerLoad("both ways")


def test_match_with_many_workers_and_slot_reuse() -> None:
    clock = FakeClock()
    index = InMemoryPrefixIndex(heartbeat_ttl=10.0, clock=clock)
    for w in range(70):  # more workers than one machine word: holder masks are Python ints
        index.apply(stored(f"w{w:02d}", 1, 1, *H[: w % 12]))
    assert index.match(H) == {f"w{w:02d}": w % 12 for w in range(70) if w % 12}
    index.remove_worker("w05")
    index.apply(stored("new", 1, 1, H[0]))  # takes w05's slot; must not inherit its blocks
    assert index.match(H[:6])["new"] == 1
    assert "w05" not in index.match(H)
