"""serving/drain.py: a worker's shutdown state. The cluster tests (tests/test_worker_drain.py,
tests/chaos/test_sigterm_drain.py) drain real workers; these hold its bookkeeping to account."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from serving.drain import SHUTTING_DOWN, Drain
from serving.mux import RpcAbort


async def _until(cond, what: str, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


def test_shared_streams_are_counted_until_they_end_or_are_cancelled() -> None:
    """The server stops once no shared stream is open: one whose last replies are still coming keeps it
    waiting, one that ends or that the server cancels does not."""

    async def main() -> None:
        drain = Drain()
        assert await drain.wait_streams_ended(0)
        gate = asyncio.Event()

        async def replies(n: int) -> AsyncIterator[int]:
            yield 0
            await gate.wait()
            for i in range(1, n):
                yield i

        got: list[list[int]] = [[], []]

        async def consume(k: int, n: int) -> None:
            async for reply in drain.shared(replies(n)):
                got[k].append(reply)

        tasks = [asyncio.create_task(consume(k, 3)) for k in range(2)]
        await _until(lambda: got == [[0], [0]], "both streams' first replies")
        assert not await drain.wait_streams_ended(0.05)
        tasks[1].cancel()  # the server's stop cancels a stream: it is not counted any more
        await asyncio.gather(tasks[1], return_exceptions=True)
        assert not await drain.wait_streams_ended(0.05)  # the other's last replies are still to come
        gate.set()
        assert await drain.wait_streams_ended(5)
        await tasks[0]
        assert got[0] == [0, 1, 2]

    asyncio.run(main())


def test_a_draining_server_refuses_new_requests_and_waits_for_those_it_holds() -> None:
    async def main() -> None:
        drain = Drain()
        gate = asyncio.Event()

        async def handler(request: int, later: object) -> AsyncIterator[int]:
            await gate.wait()
            yield request

        held = drain.admit(handler)(7, None)
        first = asyncio.create_task(anext(held))
        await _until(lambda: drain.active == 1, "the request admitted")
        drain.start()
        with pytest.raises(RpcAbort) as refused:
            await anext(drain.admit(handler)(8, None))
        assert (refused.value.code, refused.value.details) == (grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN)
        assert not await drain.wait_idle(0.05)
        gate.set()
        assert await first == 7
        with pytest.raises(StopAsyncIteration):
            await anext(held)
        assert await drain.wait_idle(5) and drain.active == 0

    asyncio.run(main())
