"""The router's fan-out holds nothing past a request's end, however it ends: each completion is routed and its
decode call opened before its task first runs, so a request that fails or goes away in between must still
cancel those calls and settle the routing accounting (RouterServicer._start / _release). The decode worker is
a stand-in here: the end-to-end paths run against real workers in test_cluster.py."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from engine.sampling_params import SamplingParams
from protos import pdserve_pb2 as pb
from router.policy import PrefixRouter, make_policy
from router.server import RouterConfig, RouterServicer, _Stop
from serving.grpc_common import params_to_proto
from serving.kv_events import WorkerLoad


class FakeCall:
    """A decode call that never replies; records its cancel."""

    def __init__(self) -> None:
        self.cancelled = False
        self.read = False
        self._replies: asyncio.Queue = asyncio.Queue()

    def __aiter__(self) -> FakeCall:
        return self

    async def __anext__(self):
        self.read = True
        item = await self._replies.get()
        if item is None:
            raise StopAsyncIteration
        return item

    def cancel(self) -> bool:
        self.cancelled = True
        self._replies.put_nowait(None)
        return True


class FakeStream:
    def __init__(self) -> None:
        self.calls: list[FakeCall] = []

    def open(self, **request) -> FakeCall:
        self.calls.append(FakeCall())
        return self.calls[-1]


def servicer() -> tuple[RouterServicer, FakeStream]:
    config = RouterConfig(prefill=("p:1",), decode=("d:1",), model_dir="/nonexistent", served_model_name="m")
    s = RouterServicer(config)
    s.router = PrefixRouter(s.index, make_policy("prefix_aware"), block_size=16)
    s.model_info = pb.ModelInfo(model="m", max_model_len=1024, vocab_size=1000, block_size=16)
    for worker, role in (("p:1", "prefill"), ("d:1", "decode")):
        s.index.heartbeat(
            worker, 1, WorkerLoad(role=role, running_requests=0, free_blocks=100, total_blocks=100)
        )
    stream = FakeStream()
    s._decode_stream = lambda address: stream  # type: ignore[method-assign]
    return s, stream


def request(n: int) -> pb.GenerateRequest:
    params = params_to_proto(SamplingParams(temperature=0, max_tokens=4, n=n))
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(range(1, 40))), sampling=params)


def held(s: RouterServicer) -> tuple[dict, dict]:
    assert s.router is not None
    return dict(s.router._outstanding), dict(s.router._decoding)


def test_a_completion_that_cannot_be_routed_releases_those_started_before_it():
    async def main() -> tuple[RouterServicer, FakeStream]:
        s, stream = servicer()  # its channels want a running loop
        route = s._route
        routed = []

        def second_fails(prompt_ids, salt):
            routed.append(1)
            if len(routed) == 2:
                raise _Stop(grpc.StatusCode.UNAVAILABLE, "no live decode worker")
            return route(prompt_ids, salt)

        s._route = second_fails  # type: ignore[method-assign]
        req = request(2)
        prompt_ids, params = await s._admit(req)
        with pytest.raises(_Stop, match="no live decode worker"):
            await anext(s._fan_out("r", req, prompt_ids, params))
        await asyncio.sleep(0)  # the cancelled task's turn: it must not release twice
        return s, stream

    s, stream = asyncio.run(main())
    assert len(stream.calls) == 1 and stream.calls[0].cancelled
    assert held(s) == ({}, {})


def test_a_request_that_goes_away_before_its_tasks_ran_cancels_their_calls():
    async def main() -> tuple[RouterServicer, FakeStream]:
        s, stream = servicer()
        req = request(3)
        prompt_ids, params = await s._admit(req)
        step = s._fan_out("r", req, prompt_ids, params).__anext__()
        step.send(None)  # _fan_out runs to its first wait: every call open, no completion task has run
        assert len(stream.calls) == 3 and held(s) != ({}, {})
        with pytest.raises(asyncio.CancelledError):
            step.throw(asyncio.CancelledError())  # the client went away, there and then
        await asyncio.sleep(0.01)  # the cancelled tasks' turn: they never start
        return s, stream

    s, stream = asyncio.run(main())
    assert all(c.cancelled and not c.read for c in stream.calls)
    assert held(s) == ({}, {})
