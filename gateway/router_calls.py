"""Many router calls for one HTTP request (/v1/embeddings' inputs, a beam search's beams), run side by side with
at most MAX_CONCURRENT open: the first failure is its APIError and cancels the rest; the client going cancels
them (`cancel`), the drain stops them with its error (`stop`)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc

from gateway.errors import APIError, from_grpc
from protos import pdserve_pb2_grpc as pb_grpc

MAX_CONCURRENT = 64
T = TypeVar("T")
R = TypeVar("R")


class RouterCalls:
    def __init__(self, stub: pb_grpc.RouterStub) -> None:
        self.stub = stub
        self.error: APIError | None = None
        self._calls: set[Any] = set()
        self._limit = asyncio.Semaphore(MAX_CONCURRENT)

    async def each(
        self, items: Sequence[T], start: Callable[[T], Any], read: Callable[[Any], Awaitable[R]]
    ) -> list[R]:
        """`read(start(item))` for every item, in order: start makes the call, read takes its answer from it."""
        tasks = [asyncio.ensure_future(self._one(start, read, item)) for item in items]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()

    async def _one(self, start: Callable[[T], Any], read: Callable[[Any], Awaitable[R]], item: T) -> R:
        async with self._limit:
            if self.error is not None:
                raise self.error
            call = start(item)
            self._calls.add(call)
            try:
                return await read(call)
            except grpc.aio.AioRpcError as exc:
                raise from_grpc(exc) from None
            except asyncio.CancelledError:
                if self.error is not None:  # stopped by the drain, not by the client
                    raise self.error from None
                raise
            finally:
                self._calls.discard(call)
                call.cancel()  # a no-op once it ended; a stream's messages after the answer are not needed

    def cancel(self) -> None:
        for call in list(self._calls):
            call.cancel()

    def stop(self, error: APIError) -> None:
        self.error = error
        self.cancel()
