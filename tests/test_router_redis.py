"""RedisPrefixIndex against a real redis-server that the tests start on a free port (and stop)."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from router.index import InMemoryPrefixIndex
from router.policy import PrefixRouter, make_policy
from router.redis_index import RedisPrefixIndex
from router.redis_mirror import RedisMirrorIndex
from serving.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, WorkerLoad
from tests.chaos.tools import RedisServer
from tests.test_router_index import APPLIED, STALE, H, IndexContract, removed, stored


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail(
            "redis-server is not installed: the Redis index tests need it (apt-get install redis-server)"
        )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        client = redis.Redis.from_url(url)
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None:
                    pytest.fail(f"redis-server exited with code {proc.returncode}")
                time.sleep(0.05)
        else:
            pytest.fail("redis-server did not answer within 5 s")
        client.close()
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_url)
    c.flushdb()
    yield c
    c.close()


class TestRedisIndex(IndexContract):
    TTL = 0.6  # real seconds: Redis keeps time itself

    @pytest.fixture(autouse=True)
    def _redis(self, client: redis.Redis) -> None:
        self.make = lambda ttl: RedisPrefixIndex(client, heartbeat_ttl=ttl, reap_interval_s=3600)

    def advance(self, seconds: float) -> None:
        time.sleep(seconds)


class TestRedisMirrorIndex(IndexContract):
    TTL = 0.6

    @pytest.fixture(autouse=True)
    def _redis(self, client: redis.Redis) -> Iterator[None]:
        made: list[RedisMirrorIndex] = []

        def make(ttl: float) -> RedisMirrorIndex:
            made.append(RedisMirrorIndex(client, heartbeat_ttl=ttl, reap_interval_s=3600))
            return made[-1]

        self.make = make
        yield
        for index in made:
            index.close()

    def advance(self, seconds: float) -> None:
        time.sleep(seconds)


def test_restarted_router_recovers_the_index_and_routers_share_it(client: redis.Redis) -> None:
    first = RedisPrefixIndex(client)
    first.heartbeat("a", 1, WorkerLoad(queued_tokens=3))
    first.heartbeat("b", 2, WorkerLoad())
    assert first.apply(stored("a", 1, 1, *H[:6])) is APPLIED
    assert first.apply(stored("b", 2, 1, *H[:2])) is APPLIED
    del first  # the router process goes away; Redis keeps the index

    second = RedisPrefixIndex(client)
    assert second.match(H) == {"a": 6, "b": 2}
    assert second.workers() == {"a": WorkerLoad(queued_tokens=3), "b": WorkerLoad()}
    assert second.apply(stored("a", 1, 2, H[6])) is APPLIED  # numbering carries on: no resync needed
    router = PrefixRouter(second, make_policy("prefix_aware"), block_size=16)
    decision = router.route(H[:7], 7 * 16 + 5)
    assert (decision.prefill_worker, decision.matched_blocks) == ("a", 7)

    third = RedisPrefixIndex(client)  # another router, sharing the same view and the speculation
    router.route(H[:9] + [H[11]], 10 * 16)
    assert third.match(H[:9] + [H[11]]) == {"a": 10, "b": 2}


def test_index_holds_raw_hashes_and_worker_ids_only(client: redis.Redis) -> None:
    index = RedisPrefixIndex(client, prefix="t:")
    index.heartbeat("a", 1, WorkerLoad())
    index.apply(stored("a", 1, 1, *H[:3]))
    hash_keys = sorted(k for k in client.keys("t:h:*"))
    assert hash_keys == sorted(b"t:h:" + h for h in H[:3])
    assert client.smembers(b"t:h:" + H[0]) == {b"a"}
    assert client.smembers("t:w:a:blocks") == set(H[:3])
    index.remove_worker("a")
    assert client.keys("t:*") == []


def test_redis_and_in_memory_answer_alike_under_random_events(client: redis.Redis) -> None:
    rng = random.Random(7)
    pool = [bytes([i]) * 32 for i in range(40)]
    chains = [pool[i : i + 12] for i in range(0, 28, 4)]  # overlapping chains share blocks
    indexes = [InMemoryPrefixIndex(heartbeat_ttl=60.0), RedisPrefixIndex(client, heartbeat_ttl=60.0)]
    seqs = {w: 0 for w in "abcd"}
    for w in seqs:
        for index in indexes:
            index.heartbeat(w, 1, WorkerLoad())
    for step in range(300):
        w = rng.choice("abcd")
        chain = rng.choice(chains)[: rng.randint(1, 12)]
        op = rng.random()
        if op < 0.15:
            for index in indexes:
                index.speculate(w, chain, ttl=60.0)
        else:
            seqs[w] += 1
            if op < 0.65:
                event: BlockStored | BlockRemoved | AllBlocksCleared = BlockStored(tuple(chain))
            elif op < 0.97:
                event = BlockRemoved(tuple(rng.sample(chain, rng.randint(1, len(chain)))))
            else:
                event = AllBlocksCleared()
            batch = EventBatch(w, 1, seqs[w], (event,), 0.0)
            assert {index.apply(batch) for index in indexes} == {APPLIED}
        query = rng.choice(chains)[: rng.randint(1, 12)]
        mem, red = (index.match(query) for index in indexes)
        assert mem == red, (step, mem, red)
    assert indexes[0].num_entries() == indexes[1].num_entries()


def wait_for(what: str, check: Callable[[], object], timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


@pytest.fixture
def mirrors(client: redis.Redis) -> Iterator[Callable[..., RedisMirrorIndex]]:
    made: list[RedisMirrorIndex] = []

    def make(**kwargs: Any) -> RedisMirrorIndex:
        made.append(RedisMirrorIndex(client, **{"heartbeat_ttl": 60.0, **kwargs}))
        return made[-1]

    yield make
    for index in made:
        index.close()


def test_mirrors_follow_each_others_writes_within_a_heartbeat(mirrors) -> None:
    a, b = mirrors(), mirrors()
    for index in (a, b):  # each router heartbeats the workers it polls
        index.heartbeat("p", 1, WorkerLoad())
        index.heartbeat("q", 2, WorkerLoad())
    assert a.apply(stored("p", 1, 1, *H[:5])) is APPLIED
    assert a.match(H) == {"p": 5}  # the writer's own mirror has it when apply returns
    wait_for("b to follow a's batch", lambda: b.match(H) == {"p": 5}, timeout=0.5)
    assert b.apply(stored("p", 1, 1, *H[:5])) is STALE  # b pulled the same batch: applied once
    a.speculate("q", H[:3], ttl=60.0)  # a's routing decision reaches b before any event could
    wait_for("b to see a's speculation", lambda: b.match(H) == {"p": 5, "q": 3}, timeout=0.5)
    assert b.apply(EventBatch("p", 7, 1, (BlockStored((H[0],)),), 0.0)) is APPLIED  # p restarted
    wait_for("a to follow p's new epoch", lambda: a.match(H) == {"p": 1, "q": 3}, timeout=0.5)
    b.remove_worker("q")
    wait_for("a to drop q", lambda: a.match(H) == {"p": 1}, timeout=0.5)
    assert a.num_entries() == b.num_entries() == 1


def test_a_new_mirror_loads_the_sets_and_follows_from_there(mirrors, client: redis.Redis) -> None:
    a = mirrors()
    a.heartbeat("p", 1, WorkerLoad(queued_tokens=9))
    assert a.apply(stored("p", 1, 1, *H[:4])) is APPLIED
    assert a.resync("p", 1, 3, H[:6]) is APPLIED
    b = mirrors()  # a router that starts now: its view is whole before its first call
    assert b.match(H) == {"p": 6}
    assert b.workers() == {"p": WorkerLoad(queued_tokens=9)}
    assert a.apply(removed("p", 1, 4, H[1])) is APPLIED
    wait_for("b to follow", lambda: b.match(H) == {"p": 1})


def test_mirrors_reload_when_redis_restarts_empty() -> None:
    server = RedisServer()
    server.start()
    a = b = None
    try:
        a, b = RedisMirrorIndex(server.url), RedisMirrorIndex(server.url)
        a.heartbeat("p", 1, WorkerLoad())
        assert a.apply(stored("p", 1, 1, *H[:2])) is APPLIED
        wait_for("b to follow", lambda: b.match(H) == {"p": 2})
        server.kill()
        server.start()  # empty: the sets, the stream and its numbering start over
        # the worker's next batch: unknown to the empty index, so applied as far as it goes and resynced
        wait_for("Redis to answer a", lambda: _answers(lambda: a.apply(stored("p", 1, 2, H[2]))), 5.0)
        assert a.match(H) == {}  # only H[2] is in Redis now: a reloaded rather than adding it to H[:2]
        wait_for("b to reload", lambda: b.match(H[2:]) == {"p": 1} and b.match(H) == {}, 5.0)
        assert a.resync("p", 1, 2, H[:3]) is APPLIED
        wait_for("b to follow the resync", lambda: b.match(H) == {"p": 3})
    finally:
        for index in (a, b):
            if index is not None:
                index.close()
        server.stop()


def _answers(call: Callable[[], object]) -> bool:
    try:
        call()
    except redis.RedisError:
        return False
    return True


def test_equal_to_in_memory_under_random_events_and_a_second_router(mirrors) -> None:
    rng = random.Random(11)
    pool = [bytes([i]) * 32 for i in range(40)]
    chains = [pool[i : i + 12] for i in range(0, 28, 4)] + [pool[j:] for j in range(0, 40, 2)]
    memory, first, second = InMemoryPrefixIndex(heartbeat_ttl=60.0), mirrors(), mirrors()
    seqs = {w: 0 for w in "abcd"}
    for w in seqs:
        for index in (memory, first, second):
            index.heartbeat(w, 1, WorkerLoad())
    for step in range(200):
        w = rng.choice("abcd")
        chain = rng.choice(chains)[: rng.randint(1, 12)]
        seqs[w] += 1
        op = rng.random()
        event: BlockStored | BlockRemoved | AllBlocksCleared = (
            BlockStored(tuple(chain))
            if op < 0.6
            else BlockRemoved(tuple(rng.sample(chain, rng.randint(1, len(chain)))))
            if op < 0.97
            else AllBlocksCleared()
        )
        batch = EventBatch(w, 1, seqs[w], (event,), 0.0)
        assert memory.apply(batch) is APPLIED
        writer, other = (first, second) if rng.random() < 0.5 else (second, first)
        assert writer.apply(batch) is APPLIED
        if rng.random() < 0.3:
            assert other.apply(batch) is STALE  # both routers pulled it
        query = rng.choice(chains)[: rng.randint(1, 12)]
        assert writer.match(query) == memory.match(query), step
    truth = [memory.match(chain) for chain in chains]
    wait_for("both mirrors to agree", lambda: [first.match(c) for c in chains] == truth)
    wait_for("both mirrors to agree", lambda: [second.match(c) for c in chains] == truth)
    assert first.num_entries() == second.num_entries() == memory.num_entries()
