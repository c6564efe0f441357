"""serving/mux.py: many calls on one gRPC stream, against a real grpc.aio server in another process.

The server process serves Prefill.PrefillMany with a scripted handler, so the frames are the real protos
and the stream is a real HTTP/2 stream over TCP. What each call's handler saw (started, got a later
message, was cancelled) is read back through a plain Prefill call, so the tests see the server's side.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import signal
from collections.abc import AsyncIterator

import grpc
import pytest

from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from serving.grpc_common import CHANNEL_OPTIONS
from serving.mux import ManyStream, RpcAbort, serve_many
from serving.roles import free_port


class _Scripted(pb_grpc.PrefillServicer):
    """request_id says what to do: 'echo-N' replies N times then ends; 'wait' replies once, then waits for
    a later message and echoes its dst_block_ids; 'hang' replies once and waits forever; 'fail' aborts;
    'bug' raises; 'close' starts the server's closing (as a drain does). GetLoad returns what the handlers
    saw, as JSON in worker_id."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.closing = asyncio.Event()

    async def _handle(self, request: pb.PrefillRequest, later: AsyncIterator[pb.PrefillRequest]):
        rid = request.request_id
        self.log.append(f"start {rid}")
        try:
            if rid.startswith("echo-"):
                for i in range(int(rid.split("-")[1])):
                    yield pb.PrefillResponse(first_token_id=i)
            elif rid == "wait":
                yield pb.PrefillResponse(first_token_id=-1)
                more = await anext(aiter(later))
                self.log.append(f"more {rid} {list(more.dst_block_ids)}")
                yield pb.PrefillResponse(first_token_id=sum(more.dst_block_ids), kv_done=True)
            elif rid == "hang":
                yield pb.PrefillResponse(first_token_id=7)
                await asyncio.Event().wait()
            elif rid == "fail":
                raise RpcAbort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no room for it")
            elif rid == "bug":
                raise KeyError("oops")
            elif rid == "close":
                self.closing.set()
        except asyncio.CancelledError:
            self.log.append(f"cancelled {rid}")
            raise

    async def PrefillMany(self, frames, context):
        async for reply in serve_many(frames, self._handle, pb.PrefillReply, "response", self.closing):
            yield reply

    async def GetLoad(self, request, context):
        return pb.WorkerLoad(worker_id=json.dumps(self.log))


async def _serve(port: int, ready) -> None:
    server = grpc.aio.server()
    pb_grpc.add_PrefillServicer_to_server(_Scripted(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    ready.set()
    await server.wait_for_termination()


def _server_main(port: int, ready) -> None:
    asyncio.run(_serve(port, ready))


def _start(port: int):
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_server_main, args=(port, ready), daemon=True)
    proc.start()
    assert ready.wait(60), "the test server did not start"
    return proc


@pytest.fixture
def server():
    port = free_port()
    procs = [_start(port)]
    yield f"127.0.0.1:{port}", procs
    for proc in procs:
        proc.kill()
        proc.join(5)


async def _server_log(channel: grpc.aio.Channel) -> list[str]:
    load = await pb_grpc.PrefillStub(channel).GetLoad(pb.LoadRequest(), timeout=10)
    return json.loads(load.worker_id)


def _stream(channel: grpc.aio.Channel) -> ManyStream:
    return ManyStream(pb_grpc.PrefillStub(channel).PrefillMany, pb.PrefillFrame, "response")


async def _collect(call) -> list[int]:
    return [r.first_token_id async for r in call]


async def _until(cond, what: str, timeout: float = 30.0) -> None:
    """Poll `cond` until it holds; fail after `timeout` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


def _pinging(channel: grpc.aio.Channel, keep_warm_s: float = 0.002, linger_s: float = 0.0) -> ManyStream:
    return ManyStream(
        pb_grpc.PrefillStub(channel).PrefillMany, pb.PrefillFrame, "response", keep_warm_s, linger_s=linger_s
    )


async def _quiet_while(control: ManyStream, n: int, stream: ManyStream) -> None:
    """`stream`, whose calls are over, sends no ping while `control` gets `n` more pongs, and gets back at
    most the pings it had in flight when the window began (a loaded host may hold several)."""
    await _until(lambda: not stream._warm_wanted(), "the stream to stop wanting pings", 5)
    sent, in_flight = stream.pings, stream.pings - stream.pongs
    got = (await _pongs_while(control, n, [stream]))[0]
    assert stream.pings == sent, "pinged with no call open and the linger over"
    assert got <= in_flight


async def _pongs_while(control: ManyStream, n: int, streams: list[ManyStream]) -> list[int]:
    """The pongs each of `streams` gets while `control`, a stream pinging with a call open, gets `n` more:
    a window in which a stream that pinged as often would have got about as many."""
    start, before = control.pongs, [s.pongs for s in streams]
    await _until(lambda: control.pongs >= start + n, f"{n} pongs on the control stream")
    return [s.pongs - b for s, b in zip(streams, before)]


def test_concurrent_calls_share_one_stream_and_each_gets_its_own_replies(server):
    address, _ = server

    async def main() -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            many = _stream(channel)
            calls = [many.open(request_id=f"echo-{n}") for n in range(1, 31)]
            results = await asyncio.gather(*(_collect(c) for c in calls))
            assert results == [list(range(n)) for n in range(1, 31)]
            assert many.open_calls == 0
            first = many._call
            assert await _collect(many.open(request_id="echo-2")) == [0, 1]
            assert many._call is first  # still the one stream
            many.close()

    asyncio.run(main())


def test_a_later_message_reaches_the_running_call(server):
    address, _ = server

    async def main() -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            many = _stream(channel)
            call = many.open(request_id="wait")
            it = aiter(call)
            assert (await anext(it)).first_token_id == -1
            await call.write(request_id="wait", dst_block_ids=[3, 4, 5])
            last = await anext(it)
            assert (last.first_token_id, last.kv_done) == (12, True)
            with pytest.raises(StopAsyncIteration):
                await anext(it)
            with pytest.raises(grpc.aio.UsageError):
                await call.write(request_id="wait")
            assert "more wait [3, 4, 5]" in await _server_log(channel)
            many.close()

    asyncio.run(main())


def test_a_closing_server_ends_the_stream_once_its_last_call_has_ended(server):
    address, _ = server

    async def main() -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            many = _stream(channel)
            call = many.open(request_id="wait")
            it = aiter(call)
            assert (await anext(it)).first_token_id == -1
            stream = many._call
            assert await _collect(many.open(request_id="close")) == []
            # "wait" is still open: so is the stream, the server closing or not (it still answers pings)
            pongs = many.pongs
            await _until(lambda: many.pongs >= pongs + 5 or many._call is not stream, "pongs while closing")
            assert many._call is stream
            await call.write(request_id="wait", dst_block_ids=[1, 2])
            assert [r.first_token_id async for r in call] == [3]  # finished, not failed
            # the server ends the stream: the next call opens a new one
            await _until(lambda: many._call is None, "the closing server to end the stream", 5)
            assert await _collect(many.open(request_id="echo-2")) == [0, 1]
            many.close()

    asyncio.run(main())


def test_status_and_handler_bug_fail_only_their_call(server):
    address, _ = server

    async def main() -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            many = _stream(channel)
            bystander = many.open(request_id="hang")
            assert (await anext(aiter(bystander))).first_token_id == 7
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _collect(many.open(request_id="fail"))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert err.value.details() == "no room for it"
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _collect(many.open(request_id="bug"))
            assert err.value.code() == grpc.StatusCode.INTERNAL
            assert "KeyError" in err.value.details()
            assert await _collect(many.open(request_id="echo-3")) == [0, 1, 2]
            assert not bystander.done()
            bystander.cancel()
            many.close()

    asyncio.run(main())


def test_cancel_and_deadline_cancel_the_servers_handler(server):
    address, _ = server

    async def main() -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            many = _stream(channel)
            call = many.open(request_id="hang")
            assert (await anext(aiter(call))).first_token_id == 7
            assert call.cancel() and not call.cancel()
            with pytest.raises(StopAsyncIteration):
                await anext(aiter(call))
            timed = many.open(timeout=0.5, request_id="hang")
            assert (await anext(aiter(timed))).first_token_id == 7
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await anext(aiter(timed))
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            log: list[str] = []

            async def both_cancelled() -> bool:  # the cancel frames travel on the stream
                log[:] = await _server_log(channel)
                return log.count("cancelled hang") == 2

            deadline = asyncio.get_running_loop().time() + 5
            while not await both_cancelled():
                assert asyncio.get_running_loop().time() < deadline, log
                await asyncio.sleep(0.02)
            assert log.count("start hang") == 2
            many.close()

    asyncio.run(main())


def test_a_dead_server_fails_every_open_call_and_the_next_call_reconnects(server):
    address, procs = server

    async def main() -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            many = _stream(channel)
            calls = [many.open(request_id="hang") for _ in range(3)]
            for c in calls:
                assert (await anext(aiter(c))).first_token_id == 7
            procs[0].kill()
            for c in calls:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await asyncio.wait_for(anext(aiter(c)), 10)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert many.open_calls == 0 and many._call is None
            procs.append(_start(int(address.rsplit(":", 1)[1])))  # a new server on the same address
            result = await asyncio.wait_for(_collect(many.open(request_id="echo-2")), 30)
            assert result == [0, 1]
            many.close()

    asyncio.run(main())


def test_a_server_slow_to_answer_the_handshake_is_still_reached(server):
    """With the serving channel options, a first call to a server that answers the connection's handshake
    a second late (its process stopped: a host busy for a moment) waits for it instead of failing."""
    address, procs = server

    async def main() -> None:
        async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
            os.kill(procs[0].pid, signal.SIGSTOP)
            asyncio.get_running_loop().call_later(1.0, os.kill, procs[0].pid, signal.SIGCONT)
            many = _stream(channel)
            assert await asyncio.wait_for(_collect(many.open(request_id="echo-3")), 30) == [0, 1, 2]
            many.close()

    asyncio.run(main())


def test_pings_flow_only_while_calls_are_open(server):
    """A stream with calls open pings when quiet (the server answers each): both sides stay warm for the
    reply to come. With no call open (and no linger) it sends nothing, nor does a stream with pings off;
    "nothing" is counted while a control stream, pinging with a call open, gets 50 pongs."""
    address, _ = server

    async def main() -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            control = _pinging(channel)
            held = control.open(request_id="hang")
            assert (await anext(aiter(held))).first_token_id == 7
            many = _pinging(channel)
            call = many.open(request_id="hang")
            assert (await anext(aiter(call))).first_token_id == 7
            await _until(lambda: many.pongs >= 10, "pongs on a stream with a call open")
            assert not call.done()  # pings are not replies
            call.cancel()
            await _quiet_while(control, 50, many)
            assert await _collect(many.open(request_id="echo-2")) == [0, 1]
            off = _pinging(channel, keep_warm_s=0.0, linger_s=1.0)
            quiet = off.open(request_id="hang")
            assert (await anext(aiter(quiet))).first_token_id == 7
            assert await _pongs_while(control, 50, [off]) == [0]
            quiet.cancel()
            held.cancel()
            for stream in (many, off, control):
                stream.close()

    asyncio.run(main())


def test_pings_linger_after_the_last_call_then_stop(server):
    """After its last call ends a stream keeps pinging for the linger (the next request of a trickle meets
    warm processes), then stops; a new call starts the window again. No call yet: no pings."""
    address, _ = server

    async def main() -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            control = _pinging(channel)
            held = control.open(request_id="hang")
            assert (await anext(aiter(held))).first_token_id == 7
            many = _pinging(channel, linger_s=0.4)
            for _ in range(2):  # the second round: a new call re-arms the linger
                assert await _collect(many.open(request_id="echo-2")) == [0, 1]
                start = many.pongs
                await _until(lambda start=start: many.pongs >= start + 5, "pongs within the linger")
                await _quiet_while(control, 50, many)  # the linger passed
            many.close()
            fresh = _pinging(channel, linger_s=0.4)
            assert await _pongs_while(control, 20, [fresh]) == [0]  # no call yet: not even a stream
            call = fresh.open(request_id="hang")  # opens the stream
            assert (await anext(aiter(call))).first_token_id == 7
            call.cancel()
            fresh.close()
            held.cancel()
            control.close()

    asyncio.run(main())


def test_a_broken_stream_reports_unavailable_unless_the_server_refused_the_method():
    """A peer that dies can end the shared stream with INTERNAL (a write racing the reset) or UNKNOWN; the
    calls on it report UNAVAILABLE (the worker is unreachable: the router routes around it), keeping the
    original status in the details. A server that does not serve the method keeps UNIMPLEMENTED."""
    from serving.mux import _stream_error, rpc_error

    for code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED):
        err = _stream_error(rpc_error(code, "Internal error from Core"))
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        assert code.name in err.details() and "Internal error from Core" in err.details()
    for code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNIMPLEMENTED):
        assert _stream_error(rpc_error(code, "x")).code() == code
