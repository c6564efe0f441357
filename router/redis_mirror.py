"""The Redis index at in-memory speed: each router answers lookups from its own mirror of what Redis holds.

Redis stays the shared source of truth: `RedisPrefixIndex` applies every batch, snapshot and heartbeat
with its Lua scripts (idempotent by worker, epoch and seq, so several routers may apply the same batch),
and each script that changes a worker's entries also appends the change to one Redis Stream,
`<prefix>stream`, numbered by `<prefix>stream:n`:

    op  w       e      s    d
    b   worker  epoch  seq  the batch's events (serving/kv_events.py encoding), as applied
    s   worker  epoch  seq  every hash the worker holds after a resync (its snapshot plus replayed batches)
    e   worker  epoch  0    a new epoch: the worker's entries are gone
    d   worker  ""     0    the worker was reaped or removed
    x   (no n; r = the router that speculated) speculation records: see `_pack_speculation`

Every router follows the stream (XREAD) into an `InMemoryPrefixIndex`-like replica, from which `lookup`,
`match` and `workers` answer without a round trip. A router's own writes wait until its replica has
followed them (read your writes). On start, and whenever the follower cannot trust what it read (a
connection error, Redis restarted, a gap in `n` because the stream was trimmed past it), the replica is
rebuilt from Redis's sets and followed from the stream offset read with them; entries that the sets
already include are applied again harmlessly (each op sets a state, so a replayed suffix ends the same).
What Redis itself lost is repaired by the epoch/seq resync of `PrefixIndex`.

Speculation is local at once and published to the stream from a background thread (best effort) so
that the other routers see it within a few milliseconds. Liveness in the replica comes from this
router's heartbeats and the entries it follows; a worker whose TTL passes is hidden, and dropped only
when Redis reaps it.
"""

from __future__ import annotations

import logging
import secrets
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import redis

from engine.block_hash import BlockHash
from router.index import ApplyResult, InMemoryPrefixIndex, Lookup, PrefixIndex, _Worker
from router.redis_index import RedisPrefixIndex, _client
from serving.kv_events import HASH_SIZE, EventBatch, WorkerLoad, decode_events

logger = logging.getLogger(__name__)

_SPEC = struct.Struct("<HII")  # worker id length, ttl in ms, hash count
_BLOCK_MS = 1000  # one XREAD waits this long for new entries
_SPEC_GATHER_S = 0.002  # speculation published together: other routers see it within a few ms


class _Replica(InMemoryPrefixIndex):
    """What Redis holds, changed by stream entries; a silent worker is hidden, not dropped."""

    def _silent(self, w: _Worker) -> None:
        del self._deadline[w.worker_id]
        self._live_mask &= ~w.bit
        self._view = None

    def _worker(self, worker_id: str, epoch: int) -> _Worker:
        """The worker under `epoch`, created if unknown; another epoch clears it first."""
        w = self._workers.get(worker_id)
        if w is None:
            w = _Worker(worker_id, self._free_bit(), epoch)
            self._workers[worker_id] = w
            self._slots[w.bit.bit_length() - 1] = w
        elif w.epoch != epoch:
            self._clear(w)
            w.epoch, w.last_seq = epoch, 0
        return w

    def follow(self, op: bytes, worker_id: str, epoch: int, seq: int, data: bytes) -> None:
        with self._lock:
            self._expire(self._clock())
            if op == b"d":
                if (w := self._workers.get(worker_id)) is not None:
                    self._drop(w)
                return
            w = self._worker(worker_id, epoch)
            if op == b"b":
                self._apply_events(w, decode_events(data))
            elif op == b"s":
                self._replace_blocks(w, {data[i : i + HASH_SIZE] for i in range(0, len(data), HASH_SIZE)})
            w.last_seq = seq
            self._touch(w)

    def install(
        self, worker_id: str, epoch: int, seq: int, blocks: set[bytes], load: bytes | None, ttl: float
    ) -> None:
        """A worker as read from Redis's sets; live for `ttl` s (0: its heartbeat key had expired)."""
        with self._lock:
            w = self._worker(worker_id, epoch)
            self._replace_blocks(w, blocks)
            w.last_seq = seq
            if load:
                self._loads[worker_id] = WorkerLoad.from_json(load)
            if ttl > 0:
                self._touch(w)
                self._deadline[worker_id] = deadline = self._clock() + ttl
                self._next_reap = min(self._next_reap, deadline)

    def touch(self, worker_id: str, epoch: int, load: WorkerLoad) -> None:
        """This router's heartbeat of the worker, which Redis has taken."""
        with self._lock:
            w = self._workers.get(worker_id) or self._worker(worker_id, epoch)
            self._touch(w)
            if self._loads.get(worker_id) != load:
                self._loads[worker_id] = load
                self._view = None


def _pack_speculation(records: Iterable[tuple[str, float, bytes]]) -> bytes:
    parts = []
    for worker_id, ttl, blob in records:
        wid = worker_id.encode()
        parts += [_SPEC.pack(len(wid), max(1, round(ttl * 1000)), len(blob) // HASH_SIZE), wid, blob]
    return b"".join(parts)


def _unpack_speculation(data: bytes) -> list[tuple[str, float, list[bytes]]]:
    out, pos = [], 0
    while pos < len(data):
        wid_len, ttl_ms, count = _SPEC.unpack_from(data, pos)
        pos += _SPEC.size
        wid = data[pos : pos + wid_len].decode()
        pos += wid_len
        hashes = [data[i : i + HASH_SIZE] for i in range(pos, pos + count * HASH_SIZE, HASH_SIZE)]
        pos += count * HASH_SIZE
        out.append((wid, ttl_ms / 1000, hashes))
    return out


def _stream_id(raw: bytes) -> tuple[int, int]:
    ms, _, seq = raw.partition(b"-")
    return int(ms), int(seq or 0)


class RedisMirrorIndex(PrefixIndex):
    """`PrefixIndex` with Redis as the shared truth and lookups from a local mirror. Thread-safe.

    Writes (`apply`, `resync`, `heartbeat`, `remove_worker`, `reap`) go to Redis as `RedisPrefixIndex`
    makes them and return once the mirror includes their effect; `apply`/`resync` carry bulk data and
    wait up to `bulk_timeout_s`, so call them off the event loop. `lookup`, `match`, `workers` and
    `speculate` never wait on Redis. `redis_heartbeat_ttl` (default: `heartbeat_ttl`) is the TTL kept in
    Redis; the mirror's own TTL runs on `clock`. `close()` stops the follower and publisher threads.
    """

    def __init__(
        self,
        client: redis.Redis | str,
        *,
        prefix: str = "pdserve:kv:",
        heartbeat_ttl: float = 5.0,
        redis_heartbeat_ttl: float | None = None,
        reap_interval_s: float = 1.0,
        timeout_s: float | None = None,
        bulk_timeout_s: float | None = None,
        stream_maxlen: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
        on_error: Callable[[str], None] = lambda operation: None,
    ) -> None:
        self.on_error = on_error  # told of each failed background call: "follow" or "speculate"
        self.store = RedisPrefixIndex(
            client,
            prefix=prefix,
            heartbeat_ttl=heartbeat_ttl if redis_heartbeat_ttl is None else redis_heartbeat_ttl,
            reap_interval_s=reap_interval_s,
            timeout_s=timeout_s,
            bulk_timeout_s=bulk_timeout_s,
            stream_maxlen=stream_maxlen,
        )
        self.store.on_published = self._catch_up
        wait = None if bulk_timeout_s is None else bulk_timeout_s + _BLOCK_MS / 1000
        self._reader = _client(client, wait) if isinstance(client, str) else client
        self.heartbeat_ttl = heartbeat_ttl
        self._clock = clock
        self._stream = prefix + "stream"
        self._me = secrets.token_hex(8).encode()  # tells this router's speculation apart in the stream
        self._replica = _Replica(heartbeat_ttl, clock)
        self._lock = threading.Lock()  # guards the stream position and every change to the replica
        self._n = 0  # the last numbered entry the replica includes
        self._offset = b"0-0"  # the last stream id read
        self._origin = b""  # the id of the stream's entry 1: another one means the stream started over
        self._stale = True  # rebuild from the sets before following
        self._stop = threading.Event()
        self._spec: deque[tuple[str, float, bytes]] = deque(maxlen=65_536)
        self._spec_ready = threading.Event()
        try:
            with self._lock:
                self._reload()
        except redis.RedisError as exc:
            logger.warning("the prefix index mirror could not load from Redis yet (%s); retrying", exc)
        self._threads = [
            threading.Thread(target=self._follow, name="index-follower", daemon=True),
            threading.Thread(target=self._publish, name="index-speculation", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # --- writes: Redis first, then the mirror follows ------------------------------------------
    def apply(self, batch: EventBatch) -> ApplyResult:
        return self.store.apply(batch)

    def resync(self, worker_id: str, epoch: int, seq: int, all_hashes: Iterable[BlockHash]) -> ApplyResult:
        return self.store.resync(worker_id, epoch, seq, all_hashes)

    def heartbeat(self, worker_id: str, epoch: int, load: WorkerLoad, seq: int | None = None) -> ApplyResult:
        result = self.store.heartbeat(worker_id, epoch, load, seq)
        if result is not ApplyResult.STALE:
            self._replica.touch(worker_id, epoch, load)
        return result

    def remove_worker(self, worker_id: str) -> None:
        self.store.remove_worker(worker_id)

    def reap(self) -> list[str]:
        return self.store.reap()

    def speculate(self, worker_id: str, hashes: Sequence[BlockHash], ttl: float) -> None:
        self._replica.speculate(worker_id, hashes, ttl)
        if hashes:
            self._spec.append((worker_id, ttl, b"".join(hashes)))
            self._spec_ready.set()

    # --- reads: the mirror alone ------------------------------------------------------------------
    def lookup(self, block_hashes: Sequence[BlockHash]) -> Lookup:
        return self._replica.lookup(block_hashes)

    def match(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        return self._replica.match(block_hashes)

    def workers(self) -> dict[str, WorkerLoad]:
        return self._replica.workers()

    def num_entries(self) -> int:
        return self._replica.num_entries()

    def close(self) -> None:
        self._stop.set()
        self._spec_ready.set()

    # --- following the stream ---------------------------------------------------------------------
    def _follow(self) -> None:
        failing = False
        while not self._stop.is_set():
            try:
                if self._stale:
                    with self._lock:
                        self._reload()
                reply: Any = self._reader.xread({self._stream: self._offset}, count=1024, block=_BLOCK_MS)
                if reply:
                    with self._lock:
                        self._take(reply[0][1])
                if failing:
                    failing = False
                    logger.warning("the prefix index mirror follows Redis again")
            except Exception as exc:
                self._stale = True
                if self._stop.is_set():
                    return
                self.on_error("follow")
                if not failing:
                    failing = True
                    logger.warning(
                        "the prefix index mirror lost Redis (%s: %s); it reloads once Redis answers",
                        type(exc).__name__,
                        exc,
                    )
                self._stop.wait(0.2)

    def _catch_up(self, n: int, stream_id: bytes, origin: bytes, bulk: bool) -> None:
        """Called by the store after a write appended entry `n`: follow the stream up to it, here.

        After a quick call (a heartbeat, on the router's event loop) this waits no longer than the call
        could have, and leaves a reload to the follower thread."""
        wait = self.store.timeout_s if not bulk else None
        quick = wait is not None
        if not self._lock.acquire(timeout=-1 if wait is None else wait):
            return  # the follower holds the lock (reloading): it will include the entry
        try:
            client = self.store.redis if quick else self.store._bulk
            if origin != self._origin:
                self._stale = True  # the stream started over
            while not self._stale and (self._n < n or _stream_id(self._offset) < _stream_id(stream_id)):
                entries: Any = client.xrange(self._stream, min=b"(" + self._offset, count=1024)
                if not entries:
                    self._stale = True  # trimmed past us, or a Redis that restarted
                self._take(entries)
            if self._stale and not quick:
                self._reload()
        finally:
            self._lock.release()

    def _take(self, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> None:
        """Apply the stream entries newer than the replica's position (caller holds the lock)."""
        last = _stream_id(self._offset)
        for raw_id, fields in entries:
            if self._stale:
                return
            if _stream_id(raw_id) <= last:
                continue  # the writer's catch-up read it first
            n = fields.get(b"n")
            if n is not None:
                if int(n) != self._n + 1:
                    self._stale = True  # a gap or a reset: only the sets can tell what is true now
                    return
                self._n = int(n)
                if self._n == 1:
                    self._origin = raw_id
                self._replica.follow(
                    fields[b"op"],
                    fields[b"w"].decode(),
                    int(fields[b"e"] or 0),
                    int(fields[b"s"]),
                    fields[b"d"],
                )
            elif fields.get(b"r") != self._me:
                for worker_id, ttl, hashes in _unpack_speculation(fields[b"d"]):
                    self._replica.speculate(worker_id, hashes, ttl)
            self._offset, last = raw_id, _stream_id(raw_id)

    def _reload(self) -> None:
        """Rebuild the replica from Redis's sets and the stream position they are at (caller holds the lock)."""
        p, bulk = self.store.prefix, self.store._bulk
        pipe: Any = bulk.pipeline(transaction=True)  # (redis-py's pipeline types say little)
        pipe.get(p + "stream:n").get(p + "stream:origin").xrevrange(self._stream, count=1)
        n, origin, last, ids = pipe.smembers(p + "workers").execute()
        replica = _Replica(self.heartbeat_ttl, self._clock)
        for raw in sorted(ids):
            wid = raw.decode()
            pipe = bulk.pipeline(transaction=True)
            pipe.hmget(f"{p}w:{wid}:meta", "epoch", "seq").smembers(f"{p}w:{wid}:blocks")
            pipe.get(f"{p}w:{wid}:hb").pttl(f"{p}w:{wid}:hb")
            (epoch, seq), blocks, load, pttl = pipe.execute()
            if epoch is not None:  # else dropped since the list was read
                replica.install(wid, int(epoch), int(seq or 0), blocks, load, max(pttl, 0) / 1000)
        self._replica = replica
        self._n, self._origin = int(n or 0), origin or b""
        self._offset = last[0][0] if last else b"0-0"
        self._stale = False

    # --- publishing speculation -------------------------------------------------------------------
    def _publish(self) -> None:
        while not self._stop.is_set():
            self._spec_ready.wait()
            self._stop.wait(_SPEC_GATHER_S)  # one XADD for the decisions of the next moment, not one each
            self._spec_ready.clear()
            records = [self._spec.popleft() for _ in range(len(self._spec))]
            if not records or self._stop.is_set():
                continue
            try:
                self.store.redis.xadd(
                    self._stream,
                    {"r": self._me, "d": _pack_speculation(records)},
                    maxlen=self.store.stream_maxlen,
                    approximate=True,
                )
            except Exception:  # best effort: the workers' own events follow within a poll
                self.on_error("speculate")
                logger.debug("publishing speculation failed", exc_info=True)
