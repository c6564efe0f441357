"""Two routers on one Redis: the same prefix-hit routing as one router, nothing lost when one is killed, and
a restarted one routes by prefix from its first request.

Real processes: redis-server, `pdserve up` with two prefill workers and one decode worker (the bundled model
on CPU) and its router, plus a second `pdserve router` on the same workers and `--redis-url`. Prompts are
token ids: a long shared prefix (PREFIX_BLOCKS full blocks) and a short suffix of their own. A hit is a
response whose cached tokens cover the whole prefix.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest

from engine.block_hash import extra_keys, hash_prompt_blocks
from protos import pdserve_pb2_grpc as pb_grpc
from router.redis_mirror import _unpack_speculation
from tests.chaos.tools import RedisServer, free_port, one_thread_per_engine
from tests.cluster import Cluster, collect, greedy_request, health, start_cluster, wait_until

pytestmark = pytest.mark.slow

BLOCK = 16
PREFIX_BLOCKS = 6


@dataclass
class RouterProcess:
    """A `pdserve router` of its own on the cluster's workers, which the test kills and starts again."""

    cluster: Cluster
    redis_url: str
    model_dir: str
    address: str = ""
    metrics_port: int = 0
    proc: subprocess.Popen | None = None

    def start(self) -> float:
        """Start it; return the seconds from its start to SERVING."""
        prefill = ",".join(w["address"] for w in self.cluster.workers if w["role"] == "prefill")
        decode = ",".join(w["address"] for w in self.cluster.workers if w["role"] == "decode")
        port = free_port()
        self.address = f"127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "serving.cli", "--log-level", "WARNING", "router", "--port", str(port)]
        self.metrics_port = free_port()
        cmd += ["--prefill", prefill, "--decode", decode, "--redis-url", self.redis_url]
        cmd += ["--metrics-port", str(self.metrics_port)]
        cmd += ["--model", self.model_dir, "--served-model-name", Path(self.model_dir).name]
        t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        wait_until(lambda: health(self.address, timeout=1) == "SERVING", 120, "the second router serving")
        return time.monotonic() - t0

    def prefix_hits(self) -> float:
        """Requests it routed to a prefill worker that (by what it knew) held some of the prompt's blocks."""
        text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text
        name = 'pdserve:router_routing_decisions_total{reason="prefix_hit"'
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)


@dataclass
class Shared:
    redis: RedisServer
    cluster: Cluster
    second: RouterProcess
    model: str


@pytest.fixture(scope="module")
def shared(bundled_model_dir: Path) -> Iterator[Shared]:
    server = RedisServer()
    server.start()
    try:
        with one_thread_per_engine():
            cluster = start_cluster(2, 1, "tcp", "--redis-url", server.url, "--policy", "prefix_aware")
        second = RouterProcess(cluster, server.url, str(bundled_model_dir))
        try:
            second.start()
            yield Shared(server, cluster, second, Path(bundled_model_dir).name)
        finally:
            if second.proc is not None and second.proc.poll() is None:
                second.kill()
            cluster.stop()
    finally:
        server.stop()


def cached(router: str, ids: list[int]) -> int:
    with grpc.insecure_channel(router) as channel:
        _, _, usage = collect(pb_grpc.RouterStub(channel).Generate(greedy_request(ids, 1), timeout=120))
    assert usage is not None
    return usage.cached_tokens


def prefixes(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 49_000) for _ in range(PREFIX_BLOCKS * BLOCK)] for _ in range(count)]


def with_suffix(prefix: list[int], rng: random.Random) -> list[int]:
    return prefix + [rng.randrange(1, 49_000) for _ in range(5)]


def hits(routers: list[str], shared_prefixes: list[list[int]], rounds: int, seed: int) -> list[list[bool]]:
    """Each round sends every prefix once, to the routers in turn; per prefix, whether each request hit."""
    rng = random.Random(seed)
    out: list[list[bool]] = [[] for _ in shared_prefixes]
    turn = 0
    for _ in range(rounds):
        for i, prefix in enumerate(shared_prefixes):
            got = cached(routers[turn % len(routers)], with_suffix(prefix, rng))
            out[i].append(got >= PREFIX_BLOCKS * BLOCK)
            turn += 1
    return out


def settled_holders(s: Shared, some: list[list[int]]) -> list[set[bytes]]:
    """Each prefix's holders once every worker's events of it have reached Redis: after its first holder
    shows, two more poll intervals (0.5 s) for the events of any other worker that computed it."""
    wait_until(lambda: all(holders(s, p) for p in some), 10, "the prefixes' holders in Redis")
    time.sleep(1.0)
    return [holders(s, p) for p in some]


@contextmanager
def stopped(pids: list[int]) -> Iterator[None]:
    """The processes held with SIGSTOP for the block (well under the 5 s heartbeat TTL), then continued."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def speculated(s: Shared, prefix: list[int]) -> list[str]:
    """The prefill workers that the routers' published routing decisions name for the prefix's last block, in
    the order the decisions reached the Redis stream."""
    last = hash_prompt_blocks(prefix, BLOCK, extra_keys(s.model))[PREFIX_BLOCKS - 1]
    client = s.redis.client()
    try:
        entries = client.xrange(b"pdserve:kv:stream")
    finally:
        client.close()
    return [
        worker
        for _, fields in entries
        if b"r" in fields
        for worker, _, hashes in _unpack_speculation(fields[b"d"])
        if last in hashes
    ]


def holders(s: Shared, prefix: list[int]) -> set[bytes]:
    """The prefill workers that Redis says hold the prefix's last full block."""
    last = hash_prompt_blocks(prefix, BLOCK, extra_keys(s.model))[PREFIX_BLOCKS - 1]
    client = s.redis.client()
    try:
        return set(client.smembers(b"pdserve:kv:h:" + last))
    finally:
        client.close()


def test_two_routers_route_like_one_and_survive_a_kill_and_a_restart(shared: Shared) -> None:
    s = shared
    first, second = s.cluster.router, s.second.address
    one = hits([first], prefixes(1, 4), rounds=3, seed=1)
    both_prefixes = prefixes(2, 4)
    both = hits([first, second], both_prefixes, rounds=3, seed=2)
    # the first request of a prefix computes it; every later one, whichever router it reaches, hits
    assert one == [[False, True, True]] * 4, one
    assert both == one, both
    held = settled_holders(s, both_prefixes)
    assert all(len(h) == 1 for h in held), held  # each prefix was computed on one prefill worker only
    rng = random.Random(3)

    # A burst on two new prefixes while both prefill workers are stopped, so that no worker event can tell a
    # router where a prefix went: x and then y to the first router, which spreads them over both prefill
    # workers (x is still in flight when y comes); y to the second router once the first router's routing
    # decision for y is in Redis. That shared decision makes it a prefix hit on the same worker: y is
    # computed once.
    x, y = prefixes(4, 2)
    prefill_pids = [w["pid"] for w in s.cluster.workers if w["role"] == "prefill"]
    hits_before = s.second.prefix_hits()
    with ThreadPoolExecutor(3) as pool, stopped(prefill_pids):
        sent = [pool.submit(cached, first, with_suffix(x, rng))]
        wait_until(lambda: speculated(s, x), 3, "the first router's decision for x in Redis")
        sent.append(pool.submit(cached, first, with_suffix(y, rng)))
        wait_until(lambda: speculated(s, y), 3, "the first router's decision for y in Redis")
        sent.append(pool.submit(cached, second, with_suffix(y, rng)))
        wait_until(lambda: s.second.prefix_hits() > hits_before, 3, "the second router's prefix hit for y")
    for job in sent:
        job.result(timeout=120)
    on_x, on_y = settled_holders(s, [x, y])
    assert len(on_x) == len(on_y) == 1, (on_x, on_y)
    assert on_x != on_y, "the burst did not spread over both prefill workers"

    s.second.kill()
    assert all(cached(first, with_suffix(p, rng)) >= PREFIX_BLOCKS * BLOCK for p in both_prefixes)
    assert [holders(s, p) for p in both_prefixes] == held

    # A restarted router reads its mirror from Redis before it serves: its first requests, sent the moment
    # it serves (before its own polls could have fetched a snapshot), route by prefix.
    s.second.start()
    second = s.second.address
    assert all(cached(second, with_suffix(p, rng)) >= PREFIX_BLOCKS * BLOCK for p in both_prefixes)
