"""The router under faults: a Redis index that dies, hangs or comes back empty; background tasks that raise;
huge prompts; workers that go away and come back on their address. The router is the real one (its gRPC
server, poller and health follower in this process); the workers are small real gRPC servers
(tests/fake_workers.py); Redis is a real redis-server that each test starts, kills, stops and restarts."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator

import grpc
import numpy as np
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.block_hash import extra_keys, hash_prompt_blocks
from engine.grpc_common import add_health_and_reflection
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from router.main import HealthFollower
from router.server import SERVICE_NAME, RouterConfig, RouterServicer, add_servicer
from router.supervise import run_forever
from router.workers import State
from tests.fake_workers import BLOCK_SIZE, FakeDecode, FakePrefill, start

SERVING = health_pb2.HealthCheckResponse.SERVING


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """A redis-server on a fixed free port that a test can kill -9, SIGSTOP/SIGCONT and restart (empty)."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed: the router fault tests need it")
        self.binary = binary
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 5
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert self.proc.poll() is None, f"redis-server exited with {self.proc.returncode}"
                assert time.monotonic() < deadline, "redis-server did not answer within 5 s"
                time.sleep(0.05)
        client.close()

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.close()


class Harness:
    """The real router (gRPC server, poller, health follower) on this loop, over fake workers."""

    def __init__(self, servicer: RouterServicer, address: str, prefill: list, decode: list) -> None:
        self.servicer = servicer
        self.address = address
        self.prefill = prefill  # [(FakePrefill, address)]
        self.decode = decode
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = pb_grpc.RouterStub(self.channel)

    async def health(self) -> int:
        reply = await health_pb2_grpc.HealthStub(self.channel).Check(
            health_pb2.HealthCheckRequest(), timeout=2
        )
        return int(reply.status)

    async def generate(self, ids: list[int], timeout: float = 5.0) -> tuple[str, list[pb.GenerateResponse]]:
        """(the request id, its responses); raises grpc.aio.AioRpcError."""
        rid = f"t-{time.monotonic_ns()}"
        req = pb.GenerateRequest(
            request_id=rid,
            token_ids=pb.TokenIds(ids=ids),
            sampling=pb.SamplingParams(temperature=0, max_tokens=2),
        )
        return rid, [r async for r in self.stub.Generate(req, timeout=timeout)]

    def prefill_of(self, rid: str) -> str:
        return next(d.prefill_of[rid] for d, _ in self.decode if rid in d.prefill_of)

    async def wait_for(self, what: str, check: Callable[[], object], timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            result = check()
            if asyncio.iscoroutine(result):
                result = await result
            if result:
                return
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def running_router(
    n_prefill: int = 2, n_decode: int = 1, vocab_size: int = 1000, **config
) -> AsyncIterator[Harness]:
    prefill = [await _started(FakePrefill(vocab_size)) for _ in range(n_prefill)]
    decode = [await _started(FakeDecode(vocab_size)) for _ in range(n_decode)]
    cfg = RouterConfig(
        prefill=tuple(a for _, a, _ in prefill),
        decode=tuple(a for _, a, _ in decode),
        model_dir=config.pop("model_dir", "/nonexistent"),
        served_model_name="m",
        **{"poll_s": 0.25, **config},
    )
    servicer = RouterServicer(cfg)
    server = grpc.aio.server()
    health = add_health_and_reflection(server, [SERVICE_NAME])
    add_servicer(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    follower = HealthFollower(servicer, health)
    log = logging.getLogger("router")
    tasks = [
        asyncio.create_task(servicer.poll_forever()),
        asyncio.create_task(run_forever("the health follower", follower.update, 0.05, log)),
    ]
    h = Harness(
        servicer, f"127.0.0.1:{port}", [(w, a) for w, a, _ in prefill], [(w, a) for w, a, _ in decode]
    )
    try:
        await h.wait_for("the router to serve", lambda: _serving(h))
        yield h
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await h.channel.close()
        await server.stop(0)
        await servicer.close()
        for _, _, s in [*prefill, *decode]:
            await s.stop(0)


async def _started(worker):
    server, address = await start(worker)
    return worker, address, server


async def _serving(h: Harness) -> bool:
    return await h.health() == SERVING


def prompt(seed: int, blocks: int = 4) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(1, 999, blocks * BLOCK_SIZE + 3)]


def hashes(ids: list[int]) -> list[bytes]:
    return hash_prompt_blocks(np.array(ids), BLOCK_SIZE, extra_keys("m", None))


def messages(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


async def held_by_second(h: Harness, seed: int) -> tuple[list[int], str]:
    """A prompt whose blocks the second prefill worker (by address: load-only routing picks the first) holds."""
    (first, a1), (second, a2) = sorted(h.prefill, key=lambda p: p[1])
    ids = prompt(seed)
    second.store(hashes(ids))
    return ids, a2


async def routes_by_prefix(h: Harness, ids: list[int], holder: str) -> bool:
    rid, _ = await h.generate(ids)
    return h.prefill_of(rid) == holder


def run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, 60))


# ---- Redis ---------------------------------------------------------------------------------------


def test_redis_killed_then_restarted_empty(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="router")

    async def main() -> None:
        async with running_router(redis_url=redis_server.url) as h:
            ids, holder = await held_by_second(h, 1)
            await h.wait_for("prefix routing through Redis", lambda: routes_by_prefix(h, ids, holder))
            redis_server.kill()
            for i in range(20):  # every request is served, by load, while Redis is gone
                t0 = time.monotonic()
                rid, out = await h.generate(prompt(100 + i))
                assert out[-1].HasField("usage") and time.monotonic() - t0 < 1.0
                assert await h.health() == SERVING
                await asyncio.sleep(0.05)
            assert not h.servicer.index.up
            assert all(h.servicer.workers.state(a) is State.UP for a in h.servicer.channels)
            redis_server.start()  # empty
            await h.wait_for("the index to be back", lambda: h.servicer.index.up)
            await h.wait_for("prefix routing after Redis returned", lambda: routes_by_prefix(h, ids, holder))

    run(main())
    assert len(messages(caplog, "the prefix index failed")) == 1
    assert len(messages(caplog, "the prefix index answers again")) == 1
    assert not messages(caplog, "is down")


def test_redis_hung_by_sigstop(redis_server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="router")

    async def main() -> None:
        async with running_router(redis_url=redis_server.url) as h:
            ids, holder = await held_by_second(h, 2)
            await h.wait_for("prefix routing through Redis", lambda: routes_by_prefix(h, ids, holder))
            redis_server.signal(signal.SIGSTOP)
            hung_until = time.monotonic() + 4.0  # longer than the heartbeat TTL (3 s)
            worst = 0.0
            while time.monotonic() < hung_until:
                t0 = time.monotonic()
                await h.generate(prompt(int(t0 * 1000)))
                worst = max(worst, time.monotonic() - t0)
                assert await h.health() == SERVING
                await asyncio.sleep(0.1)
            assert worst < 0.5, worst  # a timed-out Redis call costs 50 ms, and only once per poll interval
            redis_server.signal(signal.SIGCONT)
            await h.wait_for("the index to be back", lambda: h.servicer.index.up)
            await h.wait_for("prefix routing after SIGCONT", lambda: routes_by_prefix(h, ids, holder))

    run(main())
    assert len(messages(caplog, "the prefix index failed")) == 1
    assert len(messages(caplog, "the prefix index answers again")) == 1
    assert not messages(caplog, "is down")
