"""The prefix index in Redis, so several routers share one view and a restarted router recovers it.

Every operation is one Lua script (one round trip, atomic), with the same rules as the in-memory index
(see `PrefixIndex`). Keys, under a prefix (default "pdserve:kv:"); hashes are raw 32-byte strings:

    workers            set      registered worker ids
    w:<id>:meta        hash     epoch (decimal string), seq (last batch applied), pending (1: resync needed)
    w:<id>:blocks      set      hashes the worker holds
    w:<id>:spec        zset     speculative hash -> expiry (ms, Redis clock)
    w:<id>:retired     list     the worker's last 8 epochs, whose messages are stale
    w:<id>:log         list     "<seq>:<events>" batches applied while a resync is pending, for replay
    w:<id>:hb          string   last load (JSON), expiring after the heartbeat TTL: the worker is live
                                while it exists
    h:<hash>           set      worker ids holding the hash (for real or speculatively)
    spec               zset     <hash><id> -> expiry, to sweep expired speculation
    stream             stream   with `stream_maxlen` > 0: every change to a worker's entries, in the order
                                applied (router/redis_mirror.py follows it)
    stream:n, stream:origin     the last entry's number; the id of entry 1

Time comes from Redis (TIME, PEXPIRE), so routers on different hosts agree on TTLs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from engine.block_hash import BlockHash
from router.index import ApplyResult, Lookup, PrefixIndex
from serving.kv_events import EventBatch, WorkerLoad, encode_events

_LIB = r"""
local P, W, SMAX = ARGV[1], ARGV[2], tonumber(ARGV[3])
local function wkey(w, part) return P .. 'w:' .. w .. ':' .. part end
local function now_ms() local t = redis.call('TIME'); return t[1] * 1000 + math.floor(t[2] / 1000) end

-- With a stream (SMAX > 0), every change to a worker's entries is also appended to P..'stream', numbered
-- by P..'stream:n' (1, 2, 3, ...), so that routers can mirror the index: see router/redis_mirror.py.
-- P..'stream:origin' is the id of entry 1: a stream that started over (Redis restarted empty) has another.
local LAST_N, LAST_ID, ORIGIN = 0, '', ''
local function publish(op, w, epoch, seq, data)
  if SMAX == 0 then return end
  LAST_N = redis.call('INCR', P .. 'stream:n')
  LAST_ID = redis.call('XADD', P .. 'stream', 'MAXLEN', '~', SMAX, '*',
    'n', LAST_N, 'op', op, 'w', w, 'e', epoch, 's', seq, 'd', data)
  if LAST_N == 1 then redis.call('SET', P .. 'stream:origin', LAST_ID) end
  ORIGIN = redis.call('GET', P .. 'stream:origin') or ''
end

local function unset(h, w) redis.call('SREM', P .. 'h:' .. h, w) end

local function clear(w)
  for _, h in ipairs(redis.call('SMEMBERS', wkey(w, 'blocks'))) do unset(h, w) end
  for _, h in ipairs(redis.call('ZRANGE', wkey(w, 'spec'), 0, -1)) do
    unset(h, w); redis.call('ZREM', P .. 'spec', h .. w)
  end
  redis.call('DEL', wkey(w, 'blocks'), wkey(w, 'spec'))
end

local function drop(w)
  clear(w)
  publish('d', w, '', 0, '')
  redis.call('DEL', wkey(w, 'meta'), wkey(w, 'retired'), wkey(w, 'log'), wkey(w, 'hb'))
  redis.call('SREM', P .. 'workers', w)
end

-- The worker's {seq, pending} under epoch (a new epoch clears it), or nil for a retired epoch.
local function current(w, epoch)
  local meta = wkey(w, 'meta')
  local cur = redis.call('HGET', meta, 'epoch')
  if not cur then
    redis.call('HSET', meta, 'epoch', epoch, 'seq', 0, 'pending', 0)
    redis.call('SADD', P .. 'workers', w)
    return {0, 0}
  end
  if redis.call('LPOS', wkey(w, 'retired'), epoch) then return nil end
  if cur ~= epoch then
    redis.call('LPUSH', wkey(w, 'retired'), cur)
    redis.call('LTRIM', wkey(w, 'retired'), 0, 7)
    clear(w)
    redis.call('DEL', wkey(w, 'log'))
    redis.call('HSET', meta, 'epoch', epoch, 'seq', 0, 'pending', 0)
    publish('e', w, epoch, 0, '')
    return {0, 0}
  end
  local v = redis.call('HMGET', meta, 'seq', 'pending')
  return {tonumber(v[1]), tonumber(v[2])}
end

local function touch(w, ttl)
  if redis.call('PEXPIRE', wkey(w, 'hb'), ttl) == 0 then redis.call('SET', wkey(w, 'hb'), '', 'PX', ttl) end
  redis.call('SADD', P .. 'workers', w)
end

-- events: (op u8 | count u32 little-endian | count x 32-byte hash)*, as serving.kv_events encodes them.
local function apply_events(w, ev)
  local pos, blocks, spec = 1, wkey(w, 'blocks'), wkey(w, 'spec')
  while pos <= #ev do
    local op = string.sub(ev, pos, pos)
    local b1, b2, b3, b4 = string.byte(ev, pos + 1, pos + 4)
    local n = b1 + b2 * 256 + b3 * 65536 + b4 * 16777216
    pos = pos + 5
    if op == 'C' then clear(w) end
    for _ = 1, n do
      local h = string.sub(ev, pos, pos + 31)
      pos = pos + 32
      if op == 'S' then
        redis.call('SADD', blocks, h); redis.call('SADD', P .. 'h:' .. h, w)
      else
        redis.call('SREM', blocks, h); redis.call('ZREM', spec, h); redis.call('ZREM', P .. 'spec', h .. w)
        unset(h, w)
      end
    end
  end
end

-- Drop the speculation that expired: per worker, one ZREM and one SMISMEMBER per 1000 hashes.
local function sweep(now)
  local due = redis.call('ZRANGEBYSCORE', P .. 'spec', '-inf', now)
  if #due == 0 then return end
  redis.call('ZREMRANGEBYSCORE', P .. 'spec', '-inf', now)
  local by_worker = {}
  for _, m in ipairs(due) do
    local w = string.sub(m, 33)
    by_worker[w] = by_worker[w] or {}
    table.insert(by_worker[w], string.sub(m, 1, 32))
  end
  for w, hashes in pairs(by_worker) do
    for start = 1, #hashes, 1000 do  -- unpack() takes a few thousand values at most
      local part = {unpack(hashes, start, math.min(start + 999, #hashes))}
      redis.call('ZREM', wkey(w, 'spec'), unpack(part))
      for i, held in ipairs(redis.call('SMISMEMBER', wkey(w, 'blocks'), unpack(part))) do
        if held == 0 then unset(part[i], w) end
      end
    end
  end
end
"""

# ARGV: prefix, worker, stream maxlen, epoch, seq, events, ttl_ms, max_log
_APPLY = r"""
local st = current(W, ARGV[4])
if not st then return 'stale' end
touch(W, ARGV[7])
local seq, pending = tonumber(ARGV[5]), st[2]
if seq <= st[1] then return 'stale' end
if seq ~= st[1] + 1 and pending == 0 then pending = 1; redis.call('DEL', wkey(W, 'log')) end
apply_events(W, ARGV[6])
redis.call('HSET', wkey(W, 'meta'), 'seq', seq, 'pending', pending)
publish('b', W, ARGV[4], seq, ARGV[6])
if pending == 1 then
  redis.call('RPUSH', wkey(W, 'log'), ARGV[5] .. ':' .. ARGV[6])
  redis.call('LTRIM', wkey(W, 'log'), -tonumber(ARGV[8]), -1)
  return 'resync'
end
return 'applied'
"""

# ARGV: prefix, worker, stream maxlen, epoch, seq, concatenated hashes, ttl_ms
_RESYNC = r"""
local st = current(W, ARGV[4])
local seq = tonumber(ARGV[5])
if not st or (seq < st[1] and st[2] == 0) then return 'stale' end
touch(W, ARGV[7])
local blocks, spec, blob, new = wkey(W, 'blocks'), wkey(W, 'spec'), ARGV[6], {}
for pos = 1, #blob, 32 do new[string.sub(blob, pos, pos + 31)] = true end
for _, h in ipairs(redis.call('SMEMBERS', blocks)) do
  if not new[h] then
    redis.call('SREM', blocks, h)
    if not redis.call('ZSCORE', spec, h) then unset(h, W) end
  end
end
for h in pairs(new) do redis.call('SADD', blocks, h); redis.call('SADD', P .. 'h:' .. h, W) end
local expected = seq
for _, entry in ipairs(redis.call('LRANGE', wkey(W, 'log'), 0, -1)) do
  local colon = string.find(entry, ':', 1, true)
  local s = tonumber(string.sub(entry, 1, colon - 1))
  if s > seq then
    apply_events(W, string.sub(entry, colon + 1))
    if s == expected + 1 then expected = s else expected = -1 end
  end
end
local last = math.max(st[1], seq)
local pending = (expected < last) and 1 or 0
redis.call('HSET', wkey(W, 'meta'), 'seq', last, 'pending', pending)
if SMAX > 0 then publish('s', W, ARGV[4], last, table.concat(redis.call('SMEMBERS', blocks))) end
if pending == 0 then redis.call('DEL', wkey(W, 'log')); return 'applied' end
return 'resync'
"""

# ARGV: prefix, worker, stream maxlen, epoch, load, ttl_ms, seq or ''
_HEARTBEAT = r"""
local st = current(W, ARGV[4])
if not st then return 'stale' end
redis.call('SET', wkey(W, 'hb'), ARGV[5], 'PX', ARGV[6])
redis.call('SADD', P .. 'workers', W)
if st[2] == 0 and ARGV[7] ~= '' and tonumber(ARGV[7]) > st[1] then
  redis.call('HSET', wkey(W, 'meta'), 'pending', 1)
  redis.call('DEL', wkey(W, 'log'))
  return 'resync'
end
return st[2] == 1 and 'resync' or 'applied'
"""

# ARGV: prefix, worker, stream maxlen, ttl_ms, concatenated hashes
_SPECULATE = r"""
local now = now_ms()
sweep(now)
if redis.call('EXISTS', wkey(W, 'hb')) == 0 then return 0 end
local expiry, blob, hashes = now + tonumber(ARGV[4]), ARGV[5], {}
for pos = 1, #blob, 32 do hashes[#hashes + 1] = string.sub(blob, pos, pos + 31) end
local mine, all = {}, {}
for start = 1, #hashes, 1000 do  -- unpack() takes a few thousand values at most
  local part = {unpack(hashes, start, math.min(start + 999, #hashes))}
  for i, held in ipairs(redis.call('SMISMEMBER', wkey(W, 'blocks'), unpack(part))) do
    if held == 0 then
      local h = part[i]
      redis.call('SADD', P .. 'h:' .. h, W)
      mine[#mine + 1] = expiry; mine[#mine + 1] = h
      all[#all + 1] = expiry; all[#all + 1] = h .. W
    end
  end
  if #mine > 0 then
    redis.call('ZADD', wkey(W, 'spec'), unpack(mine)); redis.call('ZADD', P .. 'spec', unpack(all))
    mine, all = {}, {}
  end
end
return 1
"""

# ARGV: prefix, '', stream maxlen, concatenated hashes -> {{worker, depth, ...}, "worker\tload\n..." for the live workers}
_LOOKUP = r"""
sweep(now_ms())
local ids, keys = redis.call('SMEMBERS', P .. 'workers'), {}
for i, w in ipairs(ids) do keys[i] = wkey(w, 'hb') end
local live, loads = {}, {}
if #ids > 0 then
  for i, load in ipairs(redis.call('MGET', unpack(keys))) do
    if load then live[ids[i]] = true; loads[#loads + 1] = ids[i] .. '\t' .. load end
  end
end
-- Holders of the first block are the candidates; then one SMISMEMBER over each candidate's blocks and one
-- ZMSCORE over its speculative ones cover the rest of the chain: a few calls, not one per block.
local chain, res = ARGV[4], {}
local n = #chain / 32
if n == 0 then return {res, table.concat(loads, '\n')} end
local rest = {}
for i = 2, n do rest[i - 1] = string.sub(chain, i * 32 - 31, i * 32) end
for _, w in ipairs(redis.call('SMEMBERS', P .. 'h:' .. string.sub(chain, 1, 32))) do
  if live[w] then
    local depth, done = 1, false
    for start = 1, #rest, 1000 do  -- unpack() takes a few thousand values at most
      local part = {unpack(rest, start, math.min(start + 999, #rest))}
      local real = redis.call('SMISMEMBER', wkey(w, 'blocks'), unpack(part))
      local spec = redis.call('ZMSCORE', wkey(w, 'spec'), unpack(part))
      for i = 1, #part do
        if real[i] == 0 and not spec[i] then done = true; break end
        depth = depth + 1
      end
      if done then break end
    end
    res[#res + 1] = w; res[#res + 1] = depth
  end
end
return {res, table.concat(loads, '\n')}
"""

# Every script's body runs as main(); the reply also names the last stream entry it appended, if any.
_MAIN = """
local function main()
{body}
end
return {{main(), LAST_N, LAST_ID, ORIGIN}}
"""

_REAP = r"""
local dead = {}
for _, w in ipairs(redis.call('SMEMBERS', P .. 'workers')) do
  if redis.call('EXISTS', wkey(w, 'hb')) == 0 then drop(w); dead[#dead + 1] = w end
end
return dead
"""

_REMOVE = "drop(W) return 1"

_NUM_ENTRIES = r"""
local n = 0
for _, w in ipairs(redis.call('SMEMBERS', P .. 'workers')) do n = n + redis.call('SCARD', wkey(w, 'blocks')) end
return n
"""


class RedisPrefixIndex(PrefixIndex):
    """`PrefixIndex` on a Redis server. Thread-safe (redis-py's client is); every call is one round trip.

    `reap` runs at most every `reap_interval_s` from `heartbeat`; between reaps a dead worker's entries
    are still stored but every query leaves out workers whose heartbeat key has expired.

    Given a URL, calls wait at most `timeout_s` (connecting included) and are never retried: a router
    treats a failed call as "no index" and goes on (router/fallback_index.py), so a hung or absent Redis
    costs a request no more than that. `apply`, `resync` and `num_entries` carry whole batches or snapshots
    (a snapshot of 10,000 blocks takes Redis tens of milliseconds) and wait up to `bulk_timeout_s`: call
    them off the event loop.
    """

    def __init__(
        self,
        client: redis.Redis | str,
        *,
        prefix: str = "pdserve:kv:",
        heartbeat_ttl: float = 5.0,
        reap_interval_s: float = 1.0,
        max_log: int = 4096,
        timeout_s: float | None = None,
        bulk_timeout_s: float | None = None,
        stream_maxlen: int = 0,
    ) -> None:
        self.redis = _client(client, timeout_s)
        self._bulk = _client(client, bulk_timeout_s) if isinstance(client, str) else self.redis
        self.prefix = prefix
        self.heartbeat_ttl = heartbeat_ttl
        self.reap_interval_s = reap_interval_s
        self.max_log = max_log
        self.stream_maxlen = stream_maxlen
        # called with (n, id, origin) of the last entry a call appended to the stream, and whether the call
        # was a bulk one (else one that waits `timeout_s` at most), before the call returns
        self.on_published: Callable[[int, bytes, bytes, bool], None] | None = None
        self.timeout_s = timeout_s
        self._next_reap = 0.0
        self._loads_cache: dict[bytes, tuple[str, WorkerLoad]] = {}
        self._scripts = {
            name: self.redis.register_script(_LIB + _MAIN.format(body=body))
            for name, body in (
                ("apply", _APPLY),
                ("resync", _RESYNC),
                ("heartbeat", _HEARTBEAT),
                ("speculate", _SPECULATE),
                ("lookup", _LOOKUP),
                ("reap", _REAP),
                ("remove", _REMOVE),
                ("num_entries", _NUM_ENTRIES),
            )
        }

    @property
    def _ttl_ms(self) -> int:
        return max(1, round(self.heartbeat_ttl * 1000))

    def _run(self, name: str, worker_id: str, *args: Any) -> Any:
        return self._done(
            self._scripts[name](args=[self.prefix, worker_id, self.stream_maxlen, *args]), False
        )

    def _run_bulk(self, name: str, worker_id: str, *args: Any) -> Any:
        script = self._scripts[name]
        return self._done(
            script(args=[self.prefix, worker_id, self.stream_maxlen, *args], client=self._bulk), True
        )

    def _done(self, reply: list[Any], bulk: bool) -> Any:
        out, n, stream_id, origin = reply
        if n and self.on_published is not None:
            self.on_published(int(n), stream_id, origin, bulk)
        return out

    def apply(self, batch: EventBatch) -> ApplyResult:
        out = self._run_bulk(
            "apply",
            batch.worker_id,
            str(batch.epoch),
            batch.seq,
            encode_events(batch.events),
            self._ttl_ms,
            self.max_log,
        )
        return _result(out)

    def resync(self, worker_id: str, epoch: int, seq: int, all_hashes: Iterable[BlockHash]) -> ApplyResult:
        blob = b"".join(all_hashes)
        return _result(self._run_bulk("resync", worker_id, str(epoch), seq, blob, self._ttl_ms))

    def heartbeat(self, worker_id: str, epoch: int, load: WorkerLoad, seq: int | None = None) -> ApplyResult:
        out = self._run(
            "heartbeat", worker_id, str(epoch), load.to_json(), self._ttl_ms, "" if seq is None else seq
        )
        if time.monotonic() >= self._next_reap:
            self._next_reap = time.monotonic() + self.reap_interval_s
            self.reap()
        return _result(out)

    def speculate(self, worker_id: str, hashes: Sequence[BlockHash], ttl: float) -> None:
        if hashes:
            self._run("speculate", worker_id, max(1, round(ttl * 1000)), b"".join(hashes))

    def match(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        return self.lookup(block_hashes).matches

    def workers(self) -> dict[str, WorkerLoad]:
        return self.lookup(()).workers

    def lookup(self, block_hashes: Sequence[BlockHash]) -> Lookup:
        matches, loads = self._run("lookup", "", b"".join(block_hashes))
        return Lookup(
            {matches[i].decode(): int(matches[i + 1]) for i in range(0, len(matches), 2)},
            self._parse_loads(loads),
        )

    def _parse_loads(self, blob: bytes) -> dict[str, WorkerLoad]:
        """Worker -> load from "id\tjson" lines, sorted by id; lines parsed before come from a cache."""
        cache = self._loads_cache
        if len(cache) > 4096:
            cache.clear()
        workers: dict[str, WorkerLoad] = {}
        for line in sorted(blob.split(b"\n")) if blob else ():
            parsed = cache.get(line)
            if parsed is None:
                wid, _, load = line.partition(b"\t")
                parsed = cache[line] = (wid.decode(), WorkerLoad.from_json(load))
            workers[parsed[0]] = parsed[1]
        return workers

    def remove_worker(self, worker_id: str) -> None:
        self._run("remove", worker_id)

    def reap(self) -> list[str]:
        return [w.decode() for w in self._run("reap", "")]

    def num_entries(self) -> int:
        return int(self._run_bulk("num_entries", ""))


def _client(client: redis.Redis | str, timeout_s: float | None) -> redis.Redis:
    if not isinstance(client, str):
        return client
    timeouts = {} if timeout_s is None else {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
    return redis.Redis.from_url(client, retry=Retry(NoBackoff(), 0), **timeouts)


def _result(out: bytes) -> ApplyResult:
    return {
        b"applied": ApplyResult.APPLIED,
        b"stale": ApplyResult.STALE,
        b"resync": ApplyResult.RESYNC_NEEDED,
    }[out]
