"""KV events: what a prefill worker tells the router's prefix index about its cached blocks.

A worker's block manager reports every block hash it starts holding (`BlockStored`), stops holding
(`BlockRemoved`), or that it dropped everything (`AllBlocksCleared`). `KVEventPublisher` gathers them
into `EventBatch`es numbered by `seq` (1, 2, 3, ... with no gaps) under an `epoch`, a random 64-bit
number drawn once per process: a restarted worker has a new epoch, so the index knows to forget what
the old process held. When the index sees a gap in `seq` it asks for a `Snapshot` of every block held.

Wire format (little-endian, no msgpack; one batch costs one `b"".join`):

    batch    = "PDKB" | version u8 | epoch u64 | seq u64 | timestamp f64 | len u16 | worker_id utf-8 | events
    snapshot = "PDKS" | version u8 | epoch u64 | seq u64 | timestamp f64 | len u16 | worker_id utf-8 | events
    events   = ( op u8 ("S" stored, "R" removed, "C" cleared) | count u32 | count x 32-byte hash )*

The `events` part is also what the Redis index's Lua scripts parse, so it stays this simple.
"""

from __future__ import annotations

import json
import secrets
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from engine.block_hash import BlockHash

HASH_SIZE = 32
_VERSION = 1
_HEADER = struct.Struct("<4sBQQdH")
_EVENT = struct.Struct("<cI")
_BATCH_MAGIC = b"PDKB"
_SNAPSHOT_MAGIC = b"PDKS"


@dataclass(frozen=True, slots=True)
class BlockStored:
    hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    worker_id: str
    epoch: int
    seq: int
    events: tuple[KVEvent, ...]
    timestamp: float

    def to_bytes(self) -> bytes:
        return _header(_BATCH_MAGIC, self.worker_id, self.epoch, self.seq, self.timestamp) + encode_events(
            self.events
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> EventBatch:
        worker_id, epoch, seq, timestamp, offset = _parse_header(_BATCH_MAGIC, data)
        return cls(worker_id, epoch, seq, decode_events(data, offset), timestamp)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Every block a worker holds as of batch `seq`: the answer to a resync request."""

    worker_id: str
    epoch: int
    seq: int
    hashes: tuple[BlockHash, ...]
    timestamp: float

    def to_bytes(self) -> bytes:
        head = _header(_SNAPSHOT_MAGIC, self.worker_id, self.epoch, self.seq, self.timestamp)
        return head + encode_events((BlockStored(self.hashes),))

    @classmethod
    def from_bytes(cls, data: bytes) -> Snapshot:
        worker_id, epoch, seq, timestamp, offset = _parse_header(_SNAPSHOT_MAGIC, data)
        events = decode_events(data, offset)
        if len(events) != 1 or not isinstance(events[0], BlockStored):
            raise ValueError("a snapshot holds exactly one stored-blocks list")
        return cls(worker_id, epoch, seq, events[0].hashes, timestamp)


def _header(magic: bytes, worker_id: str, epoch: int, seq: int, timestamp: float) -> bytes:
    wid = worker_id.encode()
    return _HEADER.pack(magic, _VERSION, epoch, seq, timestamp, len(wid)) + wid


def _parse_header(magic: bytes, data: bytes) -> tuple[str, int, int, float, int]:
    if len(data) < _HEADER.size:
        raise ValueError(f"KV event message too short ({len(data)} bytes)")
    got_magic, version, epoch, seq, timestamp, wid_len = _HEADER.unpack_from(data)
    if got_magic != magic or version != _VERSION:
        raise ValueError(f"not a v{_VERSION} {magic!r} message: {got_magic!r} v{version}")
    end = _HEADER.size + wid_len
    if len(data) < end:
        raise ValueError("KV event message truncated in worker id")
    return data[_HEADER.size : end].decode(), epoch, seq, timestamp, end


def encode_events(events: Iterable[KVEvent]) -> bytes:
    parts: list[bytes] = []
    for event in events:
        if isinstance(event, AllBlocksCleared):
            parts.append(_EVENT.pack(b"C", 0))
            continue
        op = b"S" if isinstance(event, BlockStored) else b"R"
        blob = b"".join(event.hashes)
        if len(blob) != HASH_SIZE * len(event.hashes):
            raise ValueError(f"block hashes must be {HASH_SIZE} bytes each")
        parts.append(_EVENT.pack(op, len(event.hashes)))
        parts.append(blob)
    return b"".join(parts)


def decode_events(data: bytes, offset: int = 0) -> tuple[KVEvent, ...]:
    events: list[KVEvent] = []
    while offset < len(data):
        if offset + _EVENT.size > len(data):
            raise ValueError("KV event truncated in its header")
        op, count = _EVENT.unpack_from(data, offset)
        offset += _EVENT.size
        end = offset + count * HASH_SIZE
        if end > len(data):
            raise ValueError("KV event truncated in its hashes")
        hashes = tuple([data[i : i + HASH_SIZE] for i in range(offset, end, HASH_SIZE)])
        offset = end
        if op == b"S":
            events.append(BlockStored(hashes))
        elif op == b"R":
            events.append(BlockRemoved(hashes))
        elif op == b"C":
            events.append(AllBlocksCleared())
        else:
            raise ValueError(f"unknown KV event op {op!r}")
    return tuple(events)


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """What a worker's heartbeat says about its load; the routing policy weighs it."""

    role: str = "prefill"  # "prefill", "decode" or "both"
    queued_tokens: int = 0  # prompt tokens waiting for prefill or being prefilled
    running_requests: int = 0  # requests in the running batch
    free_blocks: int = 0  # KV blocks free or evictable
    total_blocks: int = 0

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode", "both"):
            raise ValueError(f"role must be prefill, decode or both, got {self.role!r}")

    def to_json(self) -> bytes:
        return json.dumps(
            [self.role, self.queued_tokens, self.running_requests, self.free_blocks, self.total_blocks]
        ).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> WorkerLoad:
        return cls(*json.loads(data)) if data else cls()


def _event(kind: str, hashes: list[BlockHash]) -> KVEvent:
    if kind == "cleared":
        return AllBlocksCleared()
    return BlockStored(tuple(hashes)) if kind == "stored" else BlockRemoved(tuple(hashes))


class KVEventPublisher:
    """Turns a block manager's callbacks into numbered batches for the router's index.

    The block manager calls `stored`/`removed`/`cleared` (or `on_block_event`, which fits
    `BlockManager(on_event=...)`) from its engine thread; `flush()` (once per engine step, from any
    thread) closes the pending events into the next batch and hands it to `sink`. `snapshot()` answers a
    resync: it flushes, then reads `full_snapshot()`, so the snapshot is exact as of its `seq`. Call it
    from the thread that owns the block manager, or `full_snapshot` may see a half-done step.
    """

    def __init__(
        self,
        worker_id: str,
        full_snapshot: Callable[[], Iterable[BlockHash]],
        *,
        sink: Callable[[EventBatch], None] | None = None,
        epoch: int | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.worker_id = worker_id
        self.epoch = secrets.randbits(64) if epoch is None else epoch
        self.seq = 0  # of the last batch flushed
        self._full_snapshot = full_snapshot
        self._sink = sink
        self._clock = clock
        self._pending: list[tuple[str, list[BlockHash]]] = []  # (kind, hashes), in order
        self._lock = threading.Lock()  # guards _pending and seq
        self._flush_lock = threading.Lock()  # keeps batches reaching the sink in seq order

    def stored(self, hashes: Iterable[BlockHash]) -> None:
        self._add("stored", hashes)

    def removed(self, hashes: Iterable[BlockHash]) -> None:
        self._add("removed", hashes)

    def cleared(self) -> None:
        with self._lock:
            self._pending = [("cleared", [])]  # nothing before a clear matters any more

    def on_block_event(self, kind: str, hashes: list[BlockHash]) -> None:
        if kind not in ("stored", "removed", "cleared"):
            raise ValueError(f"unknown block event kind {kind!r}")
        if kind == "cleared":
            self.cleared()
        else:
            self._add(kind, hashes)

    def _add(self, kind: str, hashes: Iterable[BlockHash]) -> None:
        with self._lock:
            if self._pending and self._pending[-1][0] == kind:  # a run of one kind merges
                self._pending[-1][1].extend(hashes)
            else:
                self._pending.append((kind, list(hashes)))

    def flush(self) -> EventBatch | None:
        """Close the pending events into the next batch, give it to the sink and return it."""
        with self._flush_lock:
            with self._lock:
                events = tuple(
                    _event(kind, hashes) for kind, hashes in self._pending if hashes or kind == "cleared"
                )
                self._pending = []
                if not events:
                    return None
                self.seq += 1
                batch = EventBatch(self.worker_id, self.epoch, self.seq, events, self._clock())
            if self._sink is not None:
                self._sink(batch)
            return batch

    def snapshot(self) -> Snapshot:
        self.flush()
        with self._lock:
            hashes = tuple(self._full_snapshot())
            return Snapshot(self.worker_id, self.epoch, self.seq, hashes, self._clock())
