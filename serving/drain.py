"""A worker's shutdown state: once draining it refuses new requests and counts down the ones it holds.

`run_worker` (serving/worker.py) starts the drain on SIGTERM/SIGINT; the servicers wrap each request's
handler with `admit`, so a request that arrived before the drain runs to its end (a decode worker's
stream, a prefill worker's KV for a request already admitted there, its later grant included) and a new
one is refused with UNAVAILABLE "server shutting down". Shared streams (serving/mux.py: serve_many) end
once the drain has begun and none of their calls is left; the servicers count them (`shared`), and the
server stops only once they have ended (`wait_streams_ended`), so no stream is cut by the server stopping,
nor by its grace running out while its last frames are on their way.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from typing import Any

import grpc

from serving.mux import RpcAbort

SHUTTING_DOWN = "server shutting down"

Handler = Callable[[Any, Any], AsyncGenerator[Any, None]]


class _Count:
    """How many of something are open, and an event set while none is."""

    def __init__(self) -> None:
        self.n = 0
        self._none = asyncio.Event()
        self._none.set()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        self.n += 1
        self._none.clear()
        try:
            yield
        finally:
            self.n -= 1
            if not self.n:
                self._none.set()

    async def wait_none(self, timeout: float) -> bool:
        """True once none is open; False if some still are after `timeout` seconds."""
        if self._none.is_set():
            return True
        try:
            await asyncio.wait_for(self._none.wait(), timeout)
        except TimeoutError:
            return False
        return True


class Drain:
    """Which thread: all of it runs on the server's event loop."""

    def __init__(self) -> None:
        self.draining = False
        self.started = asyncio.Event()  # set when the drain begins
        self._requests = _Count()  # admitted and not yet ended (`admit`)
        self._streams = _Count()  # shared streams open (`shared`)

    @property
    def active(self) -> int:
        """Requests admitted and not yet ended."""
        return self._requests.n

    def start(self) -> None:
        self.draining = True
        self.started.set()

    async def wait_idle(self, timeout: float) -> bool:
        """True once no admitted request is left; False if some still are after `timeout` seconds."""
        return await self._requests.wait_none(timeout)

    async def wait_streams_ended(self, timeout: float) -> bool:
        """True once no shared stream is open; False if some still are after `timeout` seconds."""
        return await self._streams.wait_none(timeout)

    async def shared(self, replies: AsyncIterator[Any]) -> AsyncGenerator[Any, None]:
        """A shared stream's replies (serving/mux.py: serve_many), counted while it is open."""
        with self._streams.held():
            async for reply in replies:
                yield reply

    def admit(self, handler: Handler) -> Handler:
        """`handler(request, later)` refused while draining, and counted while it runs."""

        async def admitted(request: Any, later: Any) -> AsyncGenerator[Any, None]:
            if self.draining:
                raise RpcAbort(grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN)
            with self._requests.held():
                async with contextlib.aclosing(handler(request, later)) as replies:
                    async for reply in replies:
                        yield reply

        return admitted
