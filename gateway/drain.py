"""Graceful stop: SIGTERM or SIGINT drains the gateway before uvicorn shuts it down.

`Drain` is the state, used from the event loop only. Once `begin()` is called the gateway admits no new
/v1 request (503 `unavailable`, "server shutting down"; /health answers 503 "draining"), and the requests
in flight run on. `run()` waits for them up to the drain timeout; past it every router call still open is
stopped with that same error, so a stream ends with an error event and `data: [DONE]` and a request still
waiting for its whole response gets a 503 JSON. Then the server exits (status 0).

`DrainingServer` is uvicorn's server with its signal handling replaced by that: a first signal drains, a
second one ends the drain at once (open streams still get their final events), a third forces the exit.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Protocol

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import MODEL_PATHS, APIError, shutting_down
from serving.logs import announce

logger = logging.getLogger(__name__)

_FINAL_EVENTS_S = 10.0  # after the deadline: time for stopped requests to send their last bytes


class Stoppable(Protocol):
    def stop(self, error: APIError) -> None: ...


class Drain:
    def __init__(self) -> None:
        self.draining = False
        self.expired = False  # past the timeout: router calls are stopped as soon as they are watched
        self.in_flight = 0
        self._idle: asyncio.Event | None = None
        self._calls: weakref.WeakSet[Stoppable] = weakref.WeakSet()

    def watch(self, calls: Stoppable) -> None:
        """Router calls of a request in flight; stopped if they outlast the drain timeout."""
        if self.expired:
            calls.stop(shutting_down())
        self._calls.add(calls)

    def enter(self) -> None:
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0 and self._idle is not None:
            self._idle.set()

    def begin(self) -> None:
        self.draining = True

    def stop_all(self) -> None:
        self.expired = True
        for calls in list(self._calls):
            calls.stop(shutting_down())

    async def run(self, timeout_s: float) -> bool:
        """Drain: True when every request finished within `timeout_s`, False when they had to be stopped."""
        self.begin()
        self._idle = asyncio.Event()
        if self.in_flight == 0:
            return True
        if await self._wait_idle(timeout_s):
            return True
        logger.warning("drain timeout: stopping %d requests still in flight", self.in_flight)
        self.stop_all()
        await self._wait_idle(_FINAL_EVENTS_S)
        return False

    async def _wait_idle(self, timeout_s: float) -> bool:
        assert self._idle is not None
        if self.in_flight == 0:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True


class Admission:
    """ASGI middleware: counts /v1 requests (and vLLM's model paths outside /v1: MODEL_PATHS) in flight; refuses
    new ones while draining."""

    def __init__(self, app: ASGIApp, drain: Drain, on_refused: Callable[[str, int], None]) -> None:
        self.app = app
        self.drain = drain
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not (path.startswith("/v1/") or path in MODEL_PATHS):
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            self.on_refused(scope["path"], 503)
            await shutting_down().response({"connection": "close"})(scope, receive, send)
            return
        self.drain.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.leave()


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain: Drain, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.drain = drain
        self.drain_timeout_s = drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._signals = 0
        self._task: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:  # type: ignore[no-untyped-def]
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Signal handler (main thread, between the loop's callbacks): never re-raised after shutdown."""
        self._signals += 1
        if self._loop is None or not self.started or self._signals > 2:
            self.should_exit = True
            self.force_exit = self._signals > 2
            return
        name = signal.Signals(sig).name
        self._loop.call_soon_threadsafe(self._on_signal, name)

    def _on_signal(self, name: str) -> None:
        if self._task is None:
            announce(f"pdserve gateway: {name}: draining {self.drain.in_flight} requests")
            self._task = asyncio.create_task(self._drain_then_exit())
        else:
            announce(f"pdserve gateway: {name} again: stopping the requests in flight")
            self.drain.stop_all()

    async def _drain_then_exit(self) -> None:
        finished = await self.drain.run(self.drain_timeout_s)
        outcome = "every request finished" if finished else "requests past the timeout stopped"
        announce(f"pdserve gateway: drained ({outcome})")
        self.should_exit = True
