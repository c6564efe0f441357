"""A worker's engine in its own process, talking to the gRPC server process through queues.

The child runs `recv -> step -> send` and nothing else, so the GPU loop never waits on the network;
messages are small tuples (token ids, block ids), never tensors. The parent side (`EngineProcess`)
lives in the server's asyncio loop: `send` a message, `open` a per-request queue to read replies.

A worker core (decode_worker/core.py, prefill_worker/core.py) implements:
    info() -> dict                  sent once as ("ready", info) after the model is loaded
    handle(msg: tuple) -> None      one inbound message
    has_work() -> bool
    load() -> dict                  running / waiting requests and free blocks, reported every 0.1 s
    step() -> list[tuple]           outbound messages, each (kind, request_id, *payload)
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import multiprocessing as mp
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.25
_LOAD_EVERY_S = 0.1


def _child_main(core_path: str, config: Any, inbox: mp.Queue, outbox: mp.Queue) -> None:
    module, _, name = core_path.rpartition(".")
    try:
        core = getattr(importlib.import_module(module), name)(config)
    except Exception as exc:  # a bad model path, a pool too small: the parent reports it and exits
        outbox.put([("failed", "", f"{type(exc).__name__}: {exc}")])
        return
    outbox.put([("ready", "", core.info()), ("load", "", core.load())])
    parent = os.getppid()
    last_load = 0.0
    while True:
        if time.monotonic() - last_load > _LOAD_EVERY_S:  # the server answers load queries from this
            outbox.put([("load", "", core.load())])
            last_load = time.monotonic()
        msgs = []
        if not core.has_work():
            try:
                msgs.append(inbox.get(timeout=_IDLE_WAIT_S))
            except queue.Empty:
                if os.getppid() != parent:
                    return  # the server process is gone
                continue
        while True:
            try:
                msgs.append(inbox.get_nowait())
            except queue.Empty:
                break
        for msg in msgs:
            if msg[0] == "shutdown":
                return
            try:
                core.handle(msg)
            except Exception as exc:
                logger.exception("engine failed on %s", msg[0])
                outbox.put([("error", msg[1], "INTERNAL", f"{type(exc).__name__}: {exc}")])
        if core.has_work():
            if os.getppid() != parent:
                return
            out = core.step()
            if out:
                outbox.put(out)


class EngineProcess:
    def __init__(self, core_path: str, config: Any) -> None:
        ctx = mp.get_context("spawn")
        self.inbox: mp.Queue = ctx.Queue()
        self.outbox: mp.Queue = ctx.Queue()
        self.proc = ctx.Process(
            target=_child_main, args=(core_path, config, self.inbox, self.outbox), daemon=True
        )
        self.streams: dict[str, asyncio.Queue] = {}
        self.info: dict[str, Any] = {}
        self.load: dict[str, int] = {}  # the engine's latest load report (running, waiting, free blocks)
        self.handlers: dict[str, Callable[[tuple], None]] = {}  # by message kind, run on the server's loop
        self.alive = False
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self, timeout: float = 600.0) -> dict[str, Any]:
        """Start the child and wait until its model is loaded; raise RuntimeError if it fails."""
        self._loop = asyncio.get_running_loop()
        self.proc.start()
        first = await asyncio.to_thread(self._first_batch, timeout)
        kind, _, payload = first[0]
        if kind != "ready":
            raise RuntimeError(f"the engine failed to start: {payload}")
        self.info, self.alive = payload, True
        self._dispatch(first[1:])
        threading.Thread(target=self._read, daemon=True, name="engine-reader").start()
        return self.info

    def _first_batch(self, timeout: float) -> list[tuple]:
        waited = 0.0
        while waited < timeout:
            try:
                return self.outbox.get(timeout=1.0)
            except queue.Empty:
                waited += 1.0
                if not self.proc.is_alive():
                    return [("failed", "", f"engine process exited with code {self.proc.exitcode}")]
        return [("failed", "", f"engine did not start within {timeout:.0f} s")]

    def send(self, msg: tuple) -> None:
        self.inbox.put(msg)

    def open(self, request_id: str) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self.streams[request_id] = q
        return q

    def close(self, request_id: str) -> None:
        self.streams.pop(request_id, None)

    def _read(self) -> None:
        assert self._loop is not None
        while True:
            try:
                batch = self.outbox.get(timeout=0.5)
            except queue.Empty:
                if not self.proc.is_alive():
                    break
                continue
            except (EOFError, OSError):
                break
            try:
                self._loop.call_soon_threadsafe(self._dispatch, batch)
            except RuntimeError:  # the server's loop has closed: it is shutting down
                return
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._died)

    def _dispatch(self, batch: list[tuple]) -> None:
        for msg in batch:
            if msg[0] == "load":
                self.load = msg[2]
                continue
            handler = self.handlers.get(msg[0])
            if handler is not None:  # messages for the whole worker, not one request
                handler(msg)
                continue
            q = self.streams.get(msg[1])
            if q is not None:
                q.put_nowait(msg)

    def _died(self) -> None:
        self.alive = False
        logger.error("engine process died (exit code %s)", self.proc.exitcode)
        for rid, q in list(self.streams.items()):
            q.put_nowait(("error", rid, "UNAVAILABLE", "the worker's engine process died"))

    def shutdown(self) -> None:
        if self.proc.is_alive():
            self.inbox.put(("shutdown", ""))
            self.proc.join(timeout=5)
            if self.proc.is_alive():
                self.proc.kill()
