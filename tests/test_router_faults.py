"""The router under faults: a Redis index that dies, hangs or comes back empty; background tasks that raise;
huge prompts; workers that go away and come back on their address. The router is the real one (its gRPC
server, poller and health follower in this process); the workers are small real gRPC servers
(tests/fake_workers.py); Redis is a real redis-server that each test starts, kills, stops and restarts."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator

import grpc
import numpy as np
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.block_hash import extra_keys, hash_prompt_blocks
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from router.main import HealthFollower
from router.server import SERVICE_NAME, RouterConfig, RouterServicer, add_servicer
from router.supervise import run_forever
from router.workers import State
from serving.grpc_common import CHANNEL_OPTIONS, add_health_and_reflection
from serving.roles import free_port
from tests.chaos.tools import RedisServer
from tests.fake_workers import BLOCK_SIZE, FakeDecode, FakePrefill, start

SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()


class Harness:
    """The real router (gRPC server, poller, health follower) on this loop, over fake workers."""

    def __init__(self, servicer: RouterServicer, address: str, prefill: list, decode: list) -> None:
        self.servicer = servicer
        self.address = address
        self.prefill = prefill  # [(FakePrefill, address)]
        self.decode = decode
        self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
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
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
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
        for _, a, _ in [*prefill, *decode]:
            await _servers.pop(a).stop(0)


_servers: dict[str, grpc.aio.Server] = {}  # address -> the fake worker's server now


async def _started(worker):
    server, address = await start(worker)
    _servers[address] = server
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


@pytest.mark.slow  # seconds of waiting on real servers and timeouts
def test_redis_killed_then_restarted_empty(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="router")

    async def main() -> None:
        async with running_router(redis_url=redis_server.url) as h:
            ids, holder = await held_by_second(h, 1)
            await h.wait_for("prefix routing through Redis", lambda: routes_by_prefix(h, ids, holder))
            metric = h.servicer.metrics.registry.get_sample_value
            decisions = "pdserve:router_routing_decisions_total"
            redis_server.kill()
            routed_while_down = 0  # requests sent once the router knew the index was down
            for i in range(20):  # every request is served, by load, while Redis is gone
                down = not h.servicer.index.up
                t0 = time.monotonic()
                rid, out = await h.generate(prompt(100 + i))
                assert (
                    out[-1].HasField("usage") and time.monotonic() - t0 < 2.0
                )  # never a hang on the dead index
                assert await h.health() == SERVING
                routed_while_down += down
                await asyncio.sleep(0.05)
            assert not h.servicer.index.up and routed_while_down >= 1
            assert metric("pdserve:router_index_state") == 0
            assert (metric("pdserve:router_index_errors_total") or 0) >= 1
            for operation in ("index", "follow"):  # the index's calls and the mirror's stream reader
                assert (metric("pdserve:router_redis_errors_total", {"operation": operation}) or 0) >= 1
            assert (metric(decisions, {"reason": "prefix_hit"}) or 0) >= 1  # before the kill
            # each one routed while the index was known down was a fallback decision (and maybe the one
            # whose failed index call found it down)
            assert (metric(decisions, {"reason": "fallback"}) or 0) >= routed_while_down
            assert all(h.servicer.workers.state(a) is State.UP for a in h.servicer.channels)
            redis_server.start()  # empty
            await h.wait_for("the index to be back", lambda: h.servicer.index.up)
            await h.wait_for("prefix routing after Redis returned", lambda: routes_by_prefix(h, ids, holder))
            assert metric("pdserve:router_index_state") == 1

    run(main())
    assert len(messages(caplog, "the prefix index failed")) == 1
    assert len(messages(caplog, "the prefix index answers again")) == 1
    assert not messages(caplog, "is down")


@pytest.mark.slow  # seconds of waiting on real servers and timeouts
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
            assert worst < 2.0, worst  # a Redis call waits 50 ms at most, and only one per poll interval
            redis_server.signal(signal.SIGCONT)
            await h.wait_for("the index to be back", lambda: h.servicer.index.up)
            await h.wait_for("prefix routing after SIGCONT", lambda: routes_by_prefix(h, ids, holder))

    run(main())
    assert len(messages(caplog, "the prefix index failed")) == 1
    assert len(messages(caplog, "the prefix index answers again")) == 1
    assert not messages(caplog, "is down")


# ---- background tasks ----------------------------------------------------------------------------


def test_poller_and_health_follower_survive_exceptions(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="router")
    holder = ""

    async def main() -> None:
        async with running_router() as h:
            s = h.servicer
            faults = {"expire": 3, "reason": 3, "heartbeat": 5}

            def failing(name: str, real: Callable) -> Callable:
                def call(*args, **kwargs):
                    if faults[name] > 0:
                        faults[name] -= 1
                        raise RuntimeError(f"injected {name} failure")
                    return real(*args, **kwargs)

                return call

            s.workers.expire = failing("expire", s.workers.expire)  # type: ignore[method-assign]
            s.not_serving_reason = failing("reason", s.not_serving_reason)  # type: ignore[method-assign]
            s.index.index.heartbeat = failing("heartbeat", s.index.index.heartbeat)  # type: ignore[method-assign]
            nonlocal holder
            ids, holder = await held_by_second(h, 9)
            corrupt = next(w for w, a in h.prefill if a == holder)
            corrupt.corrupt = 3  # its event pulls fail to parse
            polls = h.decode[0][0].polls
            await h.wait_for("the injected faults", lambda: not any(faults.values()) and not corrupt.corrupt)
            await h.wait_for("polls to go on", lambda: h.decode[0][0].polls > polls + 4)
            await h.wait_for("the index to be back", lambda: s.index.up)
            assert await h.health() == SERVING
            rid, out = await h.generate(prompt(5))
            assert out[-1].HasField("usage")
            await h.wait_for("its events to be applied", lambda: routes_by_prefix(h, ids, holder))

    run(main())
    assert len(messages(caplog, f"pulling KV events from {holder} failed")) == 1
    assert len(messages(caplog, f"pulling KV events from {holder} works again")) == 1
    assert len(messages(caplog, "the worker poller failed")) == 1
    assert len(messages(caplog, "the worker poller works again")) == 1
    assert len(messages(caplog, "the health follower failed")) == 1
    assert len(messages(caplog, "the health follower works again")) == 1
    assert len(messages(caplog, "the prefix index failed (RuntimeError")) == 1


def test_a_policy_that_raises_fails_only_its_request_with_a_plain_message(caplog) -> None:
    async def main() -> None:
        async with running_router() as h:
            assert h.servicer.router is not None
            policy = h.servicer.router.policy
            real = policy.choose
            policy.choose = lambda view: (_ for _ in ()).throw(KeyError("boom"))  # type: ignore[method-assign]
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await h.generate(prompt(6))
            assert err.value.code() == grpc.StatusCode.INTERNAL
            assert err.value.details() == "the router failed on this request; see its log"
            policy.choose = real  # type: ignore[method-assign]
            await h.generate(prompt(7))

    run(main())
    assert "KeyError" in caplog.text  # the traceback stays in the router's log


# ---- huge prompts --------------------------------------------------------------------------------


@pytest.mark.slow  # seconds of waiting on real servers and timeouts
def test_huge_prompts_are_refused_early_and_do_not_starve_polls(bundled_model_dir) -> None:
    async def main() -> None:
        async with running_router(
            vocab_size=49152, model_dir=str(bundled_model_dir), max_pending_prompts=2
        ) as h:
            s = h.servicer
            assert s.prompts is not None and s.prompts.max_token_chars >= 10
            huge = "word " * 4_000_000  # 20 MB
            # long enough to need tokenizing (under the early bound), too long once tokenized
            long = "a " * (s.prompts.max_token_chars * 1000 // 2)
            polls = [w.polls for w, _ in h.prefill + h.decode]

            async def send(text: str) -> grpc.StatusCode:
                req = pb.GenerateRequest(text=text, sampling=pb.SamplingParams(max_tokens=1))
                try:
                    [r async for r in h.stub.Generate(req, timeout=30)]
                except grpc.aio.AioRpcError as exc:
                    details = exc.details() or ""
                    if (
                        exc.code() == grpc.StatusCode.INVALID_ARGUMENT
                    ):  # the gateway's context_length_exceeded
                        assert (
                            "maximum context length is 1024" in details
                            or "but max_model_len is 1024" in details
                        )
                    if len(text) > 10**7:
                        assert details.startswith(
                            "this model's maximum context length is 1024 tokens, but at least"
                        )
                    if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        assert details.startswith("the router is overloaded")
                    return exc.code()
                return grpc.StatusCode.OK

            encoded: list[str] = []
            real_encode = s.prompts.encode

            async def counting(request: pb.GenerateRequest) -> list[int]:
                encoded.append(request.WhichOneof("prompt") or "")
                return await real_encode(request)

            s.prompts.encode = counting  # type: ignore[method-assign]
            codes = await asyncio.gather(*(send(huge) for _ in range(4)))
            assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * 4
            turns = [pb.ChatMessage(role="user", content="word " * 2_000_000) for _ in range(2)]
            chat = pb.GenerateRequest(chat=pb.ChatMessages(messages=turns, add_generation_prompt=True))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [r async for r in h.stub.Generate(chat, timeout=30)]
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert (err.value.details() or "").startswith(
                "this model's maximum context length is 1024 tokens, but at least"
            )
            as_long_as_fits = pb.GenerateRequest(text=huge, sampling=pb.SamplingParams(max_tokens=0))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [r async for r in h.stub.Generate(as_long_as_fits, timeout=30)]
            assert (err.value.details() or "").startswith(
                "this model's maximum context length is 1024 tokens, but the prompt alone is at least"
            )
            assert encoded == []  # 120 MB refused from their size alone, never tokenized

            async def watch(until: asyncio.Future) -> list[int]:
                seen = []
                while not until.done():
                    seen.append(await h.health())
                    await asyncio.sleep(0.05)
                return seen

            burst = asyncio.ensure_future(asyncio.gather(*(send(long) for _ in range(8))))
            statuses = await watch(burst)
            codes = burst.result()
            assert set(codes) <= {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
            assert encoded  # these were long enough to need the tokenizer
            assert set(statuses) == {SERVING}
            assert all(w.polls > p for (w, _), p in zip(h.prefill + h.decode, polls))
            assert all(s.workers.state(a) is State.UP for a in s.channels)

    run(main())


def test_the_tokenizing_queue_takes_a_burst_of_short_prompts_and_bounds_characters(bundled_model_dir) -> None:
    from engine.tokenizer import Tokenizer
    from router.prompts import Overloaded, PromptEncoder

    encoder = PromptEncoder(Tokenizer.from_dir(str(bundled_model_dir)), threads=1, max_pending_chars=1000)
    gate = threading.Event()
    real = encoder._encode
    encoder._encode = lambda request: (gate.wait(30), real(request))[1]  # type: ignore[method-assign]

    async def main() -> None:
        short = [
            asyncio.ensure_future(encoder.encode(pb.GenerateRequest(text=f"Count to {i}:")))
            for i in range(64)
        ]
        await asyncio.sleep(0)
        with pytest.raises(Overloaded):  # 64 short prompts and this one pass 1000 characters pending
            await encoder.encode(pb.GenerateRequest(text="x" * 900))
        gate.set()
        assert [len(ids) for ids in await asyncio.gather(*short)] == [
            len(real(pb.GenerateRequest(text=f"Count to {i}:"))) for i in range(64)
        ]
        # nothing pending: one prompt longer than the whole character budget is still taken
        assert len(await encoder.encode(pb.GenerateRequest(text="word " * 400))) >= 400

    try:
        run(main())
    finally:
        encoder.close()


# ---- workers that go and come back ---------------------------------------------------------------


@pytest.mark.slow  # seconds of waiting on real servers and timeouts
def test_a_decode_worker_that_dies_and_returns_on_its_address(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="router")

    async def main() -> None:
        async with running_router(n_prefill=1, poll_s=0.5) as h:
            worker, address = h.decode[0]
            worker.tokens, worker.delay_s = 50, 0.05
            call = asyncio.ensure_future(h.generate(prompt(8)))
            await h.wait_for("the call to be open", lambda: worker.open == 1)
            dying = _servers[address]
            await dying.stop(0)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert err.value.details() == f"decode worker {address} became unavailable; retry the request"
            await h.wait_for("NOT_SERVING", lambda: _not_serving(h))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await h.stub.GetModelInfo(pb.ModelInfoRequest(), timeout=2)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert err.value.details() == f"no live decode worker (1 known: {address} down)"
            # Down long enough for gRPC's default reconnect backoff (1 s, growing 1.6x) to reach ~4 s,
            # after which it would take seconds to notice the worker's return.
            await asyncio.sleep(6.0)
            worker.tokens, worker.delay_s = 2, 0.0
            revived, _ = await start(worker, int(address.rsplit(":", 1)[1]))
            _servers[address] = revived
            t0 = time.monotonic()
            await h.wait_for("SERVING again", lambda: _serving(h))
            assert time.monotonic() - t0 < 2.5, time.monotonic() - t0  # ~ a poll interval, not gRPC's backoff
            rid, out = await h.generate(prompt(9))
            assert out[-1].HasField("usage")
            metric = h.servicer.metrics.registry.get_sample_value
            assert metric("pdserve:router_worker_up", {"address": address, "role": "decode"}) == 1
            for state, times in (("down", 1), ("up", 2)):
                labels = {"role": "decode", "state": state}
                assert metric("pdserve:router_worker_state_changes_total", labels) == times

    run(main())
    assert len(messages(caplog, "is down")) == 1
    assert len(messages(caplog, "is up again")) == 1


async def _stream(h: Harness, ids: list[int], n: int) -> list[int]:
    """The token ids of an n-token greedy call through the router."""
    req = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=ids),
        sampling=pb.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
    )
    return [t async for r in h.stub.Generate(req, timeout=30) for t in r.token_ids]


@pytest.mark.slow  # seconds of streaming on real servers
def test_a_decode_worker_that_refuses_polls_still_finishes_the_calls_on_its_stream() -> None:
    """A draining worker's server refuses new calls (its polls among them) while its last tokens are on their
    way: it is routed around at once, and the calls on its stream end whole."""

    async def main() -> None:
        async with running_router(n_prefill=1, poll_s=0.1, heartbeat_ttl_s=1.0) as h:
            worker, address = h.decode[0]
            worker.tokens, worker.delay_s = 60, 0.05  # 3 s, three TTLs
            call = asyncio.ensure_future(_stream(h, prompt(8), 60))
            await h.wait_for("the call to be open", lambda: worker.open == 1)
            worker.load_refusal = grpc.StatusCode.UNAVAILABLE
            await h.wait_for("the worker down", lambda: h.servicer.workers.state(address) is State.DOWN)
            assert worker.open == 1
            assert len(await call) == 60
            assert not worker.cancelled

    run(main())


@pytest.mark.slow  # seconds of streaming on real servers
def test_a_decode_worker_whose_polls_stall_stays_up_while_its_stream_streams() -> None:
    """Polls that time out for longer than the TTL do not cut a worker whose stream carries frames (a busy
    worker's event loop), but once its stream is silent too, its calls fail with a plain UNAVAILABLE."""

    async def main() -> None:
        async with running_router(n_prefill=1, poll_s=0.1, heartbeat_ttl_s=1.0) as h:
            worker, address = h.decode[0]
            worker.tokens, worker.delay_s = 60, 0.05
            worker.load_delay_s = 3.0  # each poll times out after 1 s
            assert len(await _stream(h, prompt(8), 60)) == 60
            assert not worker.cancelled
            worker.load_delay_s = 0.0
            await h.wait_for("the worker up", lambda: h.servicer.workers.state(address) is State.UP)
            call = asyncio.ensure_future(_stream(h, prompt(9), 60))
            await h.wait_for("the call to be open", lambda: worker.open == 1)
            worker.load_delay_s, worker.mute = 3.0, True  # wedged: nothing on the stream, no answers
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await asyncio.wait_for(call, 10)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert err.value.details() == f"decode worker {address} became unavailable; retry the request"
            assert h.servicer.workers.state(address) is State.DOWN

    run(main())


async def _not_serving(h: Harness) -> bool:
    return await h.health() != SERVING


def test_decode_failures_reach_the_client_as_plain_sentences() -> None:
    from router.errors import decode_failure
    from serving.mux import rpc_error

    U, C = grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED
    cases = [
        (
            U,
            "Stream removed (sendmsg: Connection reset by peer (104))",
            U,
            "decode worker D became unavailable; retry the request",
            True,
        ),
        (
            C,
            "Locally cancelled by application!",
            U,
            "decode worker D became unavailable; retry the request",
            True,
        ),
        (U, "server shutting down", U, "decode worker D is shutting down; retry the request", False),
        (
            U,
            "prefill worker P: UNAVAILABLE: Socket closed",
            U,
            "prefill worker P failed; retry the request",
            False,
        ),
        (
            U,
            "KV transfer failed: reset",
            U,
            "the KV transfer from prefill worker P to decode worker D failed; retry the request",
            False,
        ),
        (
            grpc.StatusCode.INTERNAL,
            "ValueError: x",
            grpc.StatusCode.INTERNAL,
            "decode worker D failed on this request (an internal error)",
            False,
        ),
        (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "the decode queue is full",
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "the decode queue is full",
            False,
        ),
    ]
    for code, details, want_code, want, down in cases:
        failure = decode_failure(rpc_error(code, details), "D", "P")
        assert (failure.stop.code, failure.stop.details, failure.worker_down) == (want_code, want, down), (
            details
        )


# ---- the drain (a router process) ----------------------------------------------------------------


class WorkersInThread:
    """A fake prefill and decode worker served from a loop on a thread of their own."""

    def __init__(self) -> None:
        import threading

        self.prefill, self.decode = FakePrefill(49152), FakeDecode(49152)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        started = [
            asyncio.run_coroutine_threadsafe(start(w), self.loop).result(10)
            for w in (self.prefill, self.decode)
        ]
        self.servers = [s for s, _ in started]
        self.addresses = [a for _, a in started]

    def close(self) -> None:
        for s in self.servers:
            asyncio.run_coroutine_threadsafe(s.stop(0), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


def router_process(workers: WorkersInThread, drain_s: float, model_dir: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [
        sys.executable, "-m", "serving.cli", "router", "--port", str(port), "--model", model_dir,
        "--prefill", workers.addresses[0], "--decode", workers.addresses[1], "--drain-timeout-s", str(drain_s),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    with grpc.insecure_channel(address) as ch:
        while True:
            try:
                status = (
                    health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1).status
                )
                if status == SERVING:
                    return proc, address
            except grpc.RpcError:
                pass
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "the router did not serve within 60 s"
            time.sleep(0.1)


def stream_in_thread(address: str, results: list) -> None:
    import threading

    def go() -> None:
        with grpc.insecure_channel(address) as ch:
            req = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=list(range(1, 40))), sampling=pb.SamplingParams(max_tokens=1)
            )
            got = 0
            try:
                for r in pb_grpc.RouterStub(ch).Generate(req, timeout=60):
                    got += len(r.token_ids)
                results.append(("ok", got))
            except grpc.RpcError as exc:
                results.append((exc.code(), exc.details()))

    threading.Thread(target=go, daemon=True).start()


@pytest.mark.slow  # a router process, waiting on its drain
@pytest.mark.parametrize("drain_s", [30.0, 0.5])
def test_sigterm_drains_streams_then_exits_cleanly(drain_s: float, bundled_model_dir) -> None:
    workers = WorkersInThread()
    try:
        workers.decode.tokens, workers.decode.delay_s = (20, 0.1) if drain_s > 1 else (1000, 0.05)
        proc, address = router_process(workers, drain_s, str(bundled_model_dir))
        results: list = []
        for _ in range(2):
            stream_in_thread(address, results)
        deadline = time.monotonic() + 10
        while workers.decode.open < 2:
            assert time.monotonic() < deadline, "the streams did not start"
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        with grpc.insecure_channel(address) as ch:  # refused at once, while the streams go on
            deadline = time.monotonic() + 5
            while True:
                try:
                    list(
                        pb_grpc.RouterStub(ch).Generate(
                            pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2])), timeout=5
                        )
                    )
                except grpc.RpcError as exc:
                    if exc.details() == "server shutting down":
                        assert exc.code() == grpc.StatusCode.UNAVAILABLE
                        break
                assert time.monotonic() < deadline, "new requests were not refused"
                time.sleep(0.02)
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2).status
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        _, stderr = proc.communicate(timeout=30)
        assert proc.returncode == 0, stderr
        assert "Traceback" not in stderr and "was destroyed but it is pending" not in stderr, stderr
        if drain_s > 1:
            assert results == [("ok", 20), ("ok", 20)]
        else:
            assert results == [(grpc.StatusCode.UNAVAILABLE, "server shutting down")] * 2
            deadline = time.monotonic() + 5
            while len(workers.decode.cancelled) < 2:  # the router cancelled its worker calls
                assert time.monotonic() < deadline, workers.decode.cancelled
                time.sleep(0.05)
    finally:
        workers.close()


def test_metrics_are_served_over_http() -> None:
    from urllib.request import urlopen

    from router.metrics import RouterMetrics

    metrics, port = RouterMetrics(), free_port()
    metrics.worker_up.labels("127.0.0.1:1", "decode").set(1)
    metrics.serve(port, host="127.0.0.1")
    body = urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'pdserve:router_worker_up{address="127.0.0.1:1",role="decode"} 1.0' in body
    assert "pdserve:router_index_state 1.0" in body


@pytest.mark.slow  # seconds of waiting on real servers and timeouts
def test_an_emptied_redis_is_resynced_from_the_workers(redis_server: RedisServer) -> None:
    async def main() -> None:
        async with running_router(redis_url=redis_server.url) as h:
            ids, holder = await held_by_second(h, 3)
            await h.wait_for("prefix routing through Redis", lambda: routes_by_prefix(h, ids, holder))
            redis.Redis.from_url(redis_server.url).flushall()  # no error: only the entries are gone
            for _ in range(3):  # live workers stay live: liveness is the router's own
                await h.generate(prompt(30))
            await asyncio.sleep(0.6)  # a poll or two: the heartbeat's seq says the index lost the worker
            assert await routes_by_prefix(h, ids, holder)
            assert h.servicer.index.up

    run(main())


@pytest.mark.slow  # seconds of waiting on real servers and timeouts
def test_a_prefill_worker_restarted_with_a_new_epoch_is_resynced() -> None:
    async def main() -> None:
        async with running_router() as h:
            ids, holder = await held_by_second(h, 4)
            await h.wait_for("prefix routing", lambda: routes_by_prefix(h, ids, holder))
            worker = next(w for w, a in h.prefill if a == holder)
            other = prompt(40)
            worker.epoch, worker.held, worker.batches = (
                12345,
                set(),
                [],
            )  # a new process: new epoch, new cache
            worker.store(hashes(other))
            await h.wait_for("routing by the new epoch's blocks", lambda: routes_by_prefix(h, other, holder))
            rid, _ = await h.generate(ids)  # the old process's blocks are forgotten: load decides
            assert h.prefill_of(rid) != holder

    run(main())


@pytest.mark.slow  # seconds of waiting on real servers and timeouts
def test_a_draining_worker_gets_nothing_new(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="router")

    async def main() -> None:
        async with running_router() as h:
            (first, a1), (second, a2) = sorted(h.prefill, key=lambda p: p[1])
            first.draining = True
            await h.wait_for("the drain to be seen", lambda: h.servicer.workers.state(a1) is State.DRAINING)
            for i in range(5):
                rid, _ = await h.generate(prompt(50 + i))
                assert h.prefill_of(rid) == a2
            assert await h.health() == SERVING
            second.draining = True
            await h.wait_for("NOT_SERVING", lambda: _not_serving(h))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await h.generate(prompt(60))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            want = f"no live prefill worker (2 known: {a1} draining, {a2} draining)"
            assert err.value.details() == want

    run(main())
    assert len(messages(caplog, "is draining")) == 2


@pytest.mark.slow  # seconds of waiting on real servers and timeouts
def test_tokenizing_is_bounded_and_a_full_queue_refuses(bundled_model_dir) -> None:
    import threading

    from engine.tokenizer import Tokenizer
    from router.prompts import Overloaded, PromptEncoder

    encoder = PromptEncoder(Tokenizer.from_dir(bundled_model_dir), threads=1, max_pending=2)
    release = threading.Event()
    real = encoder._encode

    def slow(request: pb.GenerateRequest) -> list[int]:
        release.wait(10)
        return real(request)

    encoder._encode = slow  # type: ignore[method-assign]

    async def pending(n: int) -> None:
        deadline = time.monotonic() + 5
        while encoder._pending != n:
            assert time.monotonic() < deadline, f"{encoder._pending} pending, not {n}"
            await asyncio.sleep(0.001)

    async def main() -> None:
        req = pb.GenerateRequest(text="hello there")
        first = asyncio.ensure_future(encoder.encode(req))
        second = asyncio.ensure_future(encoder.encode(req))  # queued behind the first (one thread)
        await pending(2)
        with pytest.raises(Overloaded):
            await encoder.encode(req)
        second.cancel()  # a client that went away: its slot is freed at once, it never runs
        await pending(1)
        third = asyncio.ensure_future(encoder.encode(req))
        release.set()
        assert await first == await third == encoder.tokenizer.encode("hello there")
        assert encoder._pending == 0

    try:
        asyncio.run(asyncio.wait_for(main(), 20))
    finally:
        encoder.close()


@pytest.mark.slow  # seconds of waiting on real servers and timeouts
def test_a_large_snapshot_reaches_redis(redis_server: RedisServer) -> None:
    """A snapshot of 20,000 blocks takes Redis longer than a request's 50 ms budget: it goes with the
    longer bulk timeout, off the event loop, and the index still learns it."""

    async def main() -> None:
        async with running_router(redis_url=redis_server.url) as h:
            (_, a1), (second, a2) = sorted(h.prefill, key=lambda p: p[1])
            ids = prompt(11)
            second.store(hashes(ids) + [os.urandom(32) for _ in range(20_000)])
            await h.wait_for("prefix routing through Redis", lambda: routes_by_prefix(h, ids, a2), timeout=20)
            assert all(h.servicer.workers.state(a) is State.UP for a in h.servicer.channels)

    run(main())
