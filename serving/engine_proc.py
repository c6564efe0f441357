"""A worker's engine in its own process, talking to the gRPC server process over one socket pair.

The child runs `recv -> step -> send` and nothing else, so the GPU loop never waits on the network;
messages are small pickled dataclasses (serving/messages/: token ids as int arrays, block ids), never
tensors. The parent side
(`EngineProcess`) lives in the server's asyncio loop: `send` a message, `open` a per-request queue to
read replies. The parent reads and writes the socket from the loop itself (asyncio streams: no reader
or feeder thread, so a message costs no thread wake-ups on its way; a send never blocks the loop, the
stream buffers it). Frames are multiprocessing.Connection's: a 4-byte big-endian length, then the
pickle, so the child uses a plain Connection (`send_bytes` / `recv_bytes` / `poll`).

A worker core (decode_worker/core.py, prefill_worker/core.py) implements:
    info() -> dict                  sent once as Ready(info) after the model is loaded
    handle(msg: ToEngine) -> None   one inbound message
    bind(send_now, take_inbound)    optional: sends mid-step, and takes chosen inbound messages mid-step
    has_work() -> bool
    load() -> dict                  running / waiting requests and free blocks, reported every 0.1 s and
                                    as soon as an idle engine takes work
    step() -> list[FromEngine]      outbound messages
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import multiprocessing as mp
import os
import pickle
import signal
import socket
import struct
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from engine import trace
from serving.keep_warm import KEEP_WARM_LINGER_S, KEEP_WARM_S
from serving.logs import LogSetup, current, setup_logging
from serving.messages.from_engine import (
    Embedded,
    Error,
    ForRequest,
    FromEngine,
    Load,
    Ready,
    StartFailed,
)
from serving.messages.to_engine import Abort, Shutdown, ToEngine

if TYPE_CHECKING:
    from engine.sequence import Sequence as EngineSequence

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.25
# After work, the idle loop polls at the servers' keep-warm period for their linger (serving/keep_warm.py),
# so the next request of a trickle finds this process warm too; past the linger it blocks for _IDLE_WAIT_S.
_WARM_WAIT_S, _WARM_LINGER_S = KEEP_WARM_S, KEEP_WARM_LINGER_S
_LOAD_EVERY_S = 0.1


def id_list(ids: np.ndarray | Sequence[int]) -> list[int]:
    """A message's token ids (the servers send int arrays) as the engine's list of ints."""
    return ids.tolist() if isinstance(ids, np.ndarray) else list(ids)


def prompt_logprobs_of(seq: EngineSequence) -> tuple[dict[int, float], ...]:
    """What a request's first Tokens / FirstToken carries of its prompt's logprobs: every prompt token's after
    the first when asked for, else (). The engine has computed them all by the first sampled token; one
    missing would be its bug, and is logged rather than sent as a hole the servers cannot tell apart."""
    if seq.params.prompt_logprobs is None:
        return ()
    entries = [e for e in seq.prompt_logprobs if e is not None]
    if len(entries) != len(seq.prompt_logprobs):
        missing = len(seq.prompt_logprobs) - len(entries)
        logger.error("request %s: %d prompt logprobs were never computed", seq.request_id, missing)
        return ()
    return tuple(entries)


def embedded(seq: EngineSequence) -> Embedded | Error:
    """An embedding request's answer (either role), once the step that pooled its prompt ran."""
    if seq.embedding is None:
        return Error(seq.request_id, "INTERNAL", "the request ended before its prompt was pooled")
    return Embedded(seq.request_id, tuple(seq.embedding), max(seq.num_cached_tokens, 0))


def _child_main(core_path: str, config: Any, conn: Any, log_setup: LogSetup) -> None:
    # Ctrl-C reaches the whole process group; the server decides when this process stops (Shutdown),
    # and it stops by itself once the server is gone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    setup_logging(log_setup)  # its lines look like its server's
    module, _, name = core_path.rpartition(".")

    def send(batch: list[FromEngine]) -> None:
        conn.send_bytes(pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL))

    try:
        core = getattr(importlib.import_module(module), name)(config)
    except Exception as exc:  # a bad model path, a pool too small: the parent reports it and exits
        send([StartFailed(f"{type(exc).__name__}: {exc}")])
        return

    def send_traced(batch: list[FromEngine]) -> None:
        if trace.enabled:
            for m in batch:
                _mark(m, "proc.out_")
        send(batch)

    backlog: list[ToEngine] = []  # read mid-step and left to this loop, in arrival order

    def take_inbound(wanted: Callable[[ToEngine], bool]) -> list[ToEngine]:
        """Mid-step, for the core: what has arrived by now (never waits), the messages `wanted` picks
        handed over, the others kept, in order, for the loop."""
        while conn.poll(0):
            backlog.append(pickle.loads(conn.recv_bytes()))
        taken: list[ToEngine] = []
        kept: list[ToEngine] = []
        for m in backlog:
            (taken if not isinstance(m, Shutdown) and wanted(m) else kept).append(m)
        backlog[:] = kept
        if trace.enabled:
            for m in taken:
                _mark(m, "proc.in_")
        return taken

    if hasattr(core, "bind"):  # a core that sends some messages mid-step (prefill: first tokens)
        core.bind(send_traced, take_inbound)
    ranks = getattr(getattr(core, "engine", None), "ranks", None)
    if ranks is not None:  # tensor parallel: a rank that dies ends this process, so its requests fail now
        ranks.exit_on_failure = True

    def load() -> Load:
        counters = core.counters() if hasattr(core, "counters") else {}
        return Load(core.load(), counters, core.histograms() if hasattr(core, "histograms") else {})

    send([Ready(core.info()), load()])
    parent = os.getppid()
    last_load = last_busy = 0.0
    try:
        while True:
            if time.monotonic() - last_load > _LOAD_EVERY_S:  # the server answers load queries from this
                send([load()])
                last_load = time.monotonic()
            msgs, backlog[:] = backlog[:], []
            if not msgs and not core.has_work():
                warm = _WARM_WAIT_S > 0 and time.monotonic() - last_busy < _WARM_LINGER_S
                if not conn.poll(_WARM_WAIT_S if warm else _IDLE_WAIT_S):
                    if os.getppid() != parent:
                        return  # the server process is gone
                    continue
            last_busy = time.monotonic()
            while conn.poll(0):
                msgs.append(pickle.loads(conn.recv_bytes()))
            was_idle = not core.has_work()
            for msg in msgs:
                if isinstance(msg, Shutdown):
                    return
                if trace.enabled:
                    _mark(msg, "proc.in_")
                try:
                    core.handle(msg)
                except Exception as exc:
                    logger.exception("engine failed on %s", type(msg).__name__)
                    send([Error(msg.request_id, "INTERNAL", f"{type(exc).__name__}: {exc}")])
            if was_idle and core.has_work():
                # an idle engine's new work is reported before the step that runs it, which may end it too:
                # the router and GetLoad see a request that one long step takes from start to end
                send([load()])
                last_load = time.monotonic()
            if core.has_work():
                if os.getppid() != parent:
                    return
                out = core.step()
                if out:
                    send_traced(out)
    except (EOFError, OSError):
        return  # the server closed its end: it is gone


def _mark(msg: ToEngine | FromEngine, stage: str) -> None:
    rid = getattr(msg, "request_id", None)
    if rid is not None:
        trace.mark(rid, stage + type(msg).__name__)


_LEN = struct.Struct("!i")  # multiprocessing.Connection's frame header (messages under 2 GiB)


class EngineProcess:
    def __init__(self, core_path: str, config: Any) -> None:
        ctx = mp.get_context("spawn")
        parent_end, child_end = ctx.Pipe(duplex=True)  # a socket pair
        self.proc = ctx.Process(
            target=_child_main, args=(core_path, config, child_end, current()), daemon=True
        )
        self._parent_end, self._child_end = parent_end, child_end
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self.streams: dict[str, asyncio.Queue] = {}
        self.info: dict[str, Any] = {}
        self.load: dict[str, int] = {}  # the engine's latest load report (running, waiting, free blocks)
        self.counters: dict[str, float] = {}  # and its running counters (serving/worker_metrics.py)
        self.histograms: dict[str, Any] = {}  # and histograms
        # (time, counters) of the reports of the last 10 s, oldest first: recent rates
        self.history: deque[tuple[float, dict[str, float]]] = deque(maxlen=int(10 / _LOAD_EVERY_S))
        # messages for the whole worker, not one request, by type (prefill: KVEvents); run on the server's loop
        self.handlers: dict[type, Callable[[Any], None]] = {}
        self.alive = False
        self.died = False  # it stopped without being asked to
        self._read_task: asyncio.Task | None = None
        self._watch_task: asyncio.Task | None = None

    async def start(self, timeout: float = 600.0) -> dict[str, Any]:
        """Start the child and wait until its model is loaded; raise RuntimeError if it fails."""
        self.proc.start()
        self._child_end.close()  # the child holds it now; its exit closes the pair
        sock = socket.socket(fileno=os.dup(self._parent_end.fileno()))
        self._parent_end.close()
        self._reader, self._writer = await asyncio.open_unix_connection(sock=sock, limit=1 << 26)
        try:
            first = await asyncio.wait_for(self._recv(), timeout)
        except (asyncio.IncompleteReadError, ConnectionError):
            self.proc.join(5)
            first = [StartFailed(f"engine process exited with code {self.proc.exitcode}")]
        except TimeoutError:
            first = [StartFailed(f"engine did not start within {timeout:.0f} s")]
        ready = first[0]
        if not isinstance(ready, Ready):
            error = ready.error if isinstance(ready, StartFailed) else repr(ready)
            raise RuntimeError(f"the engine failed to start: {error}")
        self.info, self.alive = ready.info, True
        self._dispatch(first[1:])
        self._read_task = asyncio.create_task(self._read())
        self._watch_task = asyncio.create_task(self._watch())
        return self.info

    async def _recv(self) -> list[FromEngine]:
        assert self._reader is not None
        (n,) = _LEN.unpack(await self._reader.readexactly(_LEN.size))
        return pickle.loads(await self._reader.readexactly(n))

    def send(self, msg: ToEngine) -> None:
        """Queue `msg` for the engine; never blocks (the stream buffers what the socket cannot take yet)."""
        if self._writer is None or self._writer.is_closing():
            return  # not started, or the engine is gone: its streams were told (UNAVAILABLE)
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        self._writer.write(_LEN.pack(len(data)) + data)

    def open(self, request_id: str) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self.streams[request_id] = q
        return q

    def close(self, request_id: str) -> None:
        self.streams.pop(request_id, None)

    async def _read(self) -> None:
        try:
            while True:
                self._dispatch(await self._recv())
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        except asyncio.CancelledError:
            return
        await asyncio.to_thread(self.proc.join, 5)  # the exit code, for the log
        self._died()

    async def _watch(self) -> None:
        """The end of the socket is the usual sign of death; this also catches a child that died while
        something it started still holds the socket open."""
        while self.alive:
            await asyncio.sleep(0.5)
            if not self.proc.is_alive():
                self._died()

    def _dispatch(self, batch: list[FromEngine]) -> None:
        for msg in batch:
            if isinstance(msg, Load):
                self.load, self.counters, self.histograms = msg.load, msg.counters, msg.histograms
                self.history.append((time.monotonic(), msg.counters))
            elif (handler := self.handlers.get(type(msg))) is not None:
                handler(msg)
            elif isinstance(msg, ForRequest) and (q := self.streams.get(msg.request_id)) is not None:
                q.put_nowait(msg)

    def _died(self) -> None:
        if not self.alive:
            return
        self.alive, self.died = False, True
        logger.error("engine process died (exit code %s)", self.proc.exitcode)
        for rid, q in list(self.streams.items()):
            q.put_nowait(Error(rid, "UNAVAILABLE", "the worker's engine process died"))

    def abort_all(self, code: str, details: str) -> int:
        """End every request the engine holds: the engine aborts it (its blocks are freed) and its stream
        reads Error(rid, code, details). Returns how many there were."""
        streams = list(self.streams.items())
        for rid, q in streams:
            self.send(Abort(rid))
            q.put_nowait(Error(rid, code, details))
        return len(streams)

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the engine process: ask it to, wait up to `timeout` seconds, then kill it."""
        self.alive = False  # a stop asked for, not a death: nothing to report
        tasks = [t for t in (self._read_task, self._watch_task) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.proc.is_alive():
            self.send(Shutdown())
            if self._writer is not None:
                with contextlib.suppress(OSError, RuntimeError, ConnectionError):
                    await self._writer.drain()
            await asyncio.to_thread(self.proc.join, timeout)
            if self.proc.is_alive():
                logger.warning("the engine process did not stop within %g s: killing it", timeout)
                self.proc.kill()
                await asyncio.to_thread(self.proc.join, timeout)
        if self._writer is not None:
            with contextlib.suppress(OSError, RuntimeError, ConnectionError):
                self._writer.close()
                await self._writer.wait_closed()
