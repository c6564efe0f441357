"""Rank 0's view of the other ranks of a tensor-parallel engine: their processes and their two pipes.

    rank 0 (the engine process)                         rank r (python -m engine.tp.worker)
      send(msg): pickled once, written to every rank  ==plan pipe==>  read in order, run in order
      a reader thread per rank                        <==reply pipe==  Loaded, Ready, Reply, KVEvent, Failed

A step's plan crosses as one message (a pickled `Launch`), however many tensors the step touches. The
pipes are also how death shows: a rank that dies closes its reply pipe, and its reader thread sees the
end at once; rank 0 then records the failure, aborts the process group (NCCL: collectives in flight
return) and stops the other ranks, so nothing waits on a peer that is gone. A rank whose plan pipe ends
(rank 0 died or closed it) exits.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import pickle
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from engine.tp.messages import Failed, FromRank, KVCall, KVEvent, Reply, Shutdown, Start, ToRank

logger = logging.getLogger(__name__)

PIPE_BYTES = 1 << 20  # a plan of a few hundred rows fits in one write
_F_SETPIPE_SZ = 1031  # Linux fcntl
POLL_S = 0.05
STOP_S = 5.0  # how long close() waits for a rank to exit before killing it


class TensorParallelError(RuntimeError):
    """A rank of a tensor-parallel engine failed or died; the engine cannot run steps any more."""


class RankProcess:
    """One rank r >= 1: its process, the pipe rank 0 writes and the pipe it answers on."""

    def __init__(self, rank: int, env: dict[str, str]) -> None:
        plan_r, plan_w = os.pipe()
        reply_r, reply_w = os.pipe()
        for fd in (plan_w, reply_w):
            with contextlib.suppress(OSError):
                fcntl.fcntl(fd, _F_SETPIPE_SZ, PIPE_BYTES)
        cmd = [sys.executable, "-m", "engine.tp.worker", str(plan_r), str(reply_w)]
        self.rank = rank
        self.proc = subprocess.Popen(cmd, pass_fds=(plan_r, reply_w), env=env)
        os.close(plan_r)
        os.close(reply_w)
        self.plan = Connection(plan_w, readable=False)
        self.reply = Connection(reply_r, writable=False)
        self.inbox: queue.Queue[FromRank] = queue.Queue()
        self.error: str | None = None  # what it said in Failed

    def describe_exit(self) -> str:
        try:
            code = self.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            return f"tensor parallel rank {self.rank} (pid {self.proc.pid}) closed its pipe"
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        said = f": {self.error}" if self.error else ""
        return f"tensor parallel rank {self.rank} (pid {self.proc.pid}) {how}{said}"


class Ranks:
    """Ranks 1..N-1 of one engine. `send` is for rank 0's thread; `on_event` runs on reader threads."""

    def __init__(self, starts: list[Start], on_failure: Callable[[], None] | None = None) -> None:
        self.size = len(starts) + 1
        self.failure: str | None = None
        # a served engine's process exits when a rank dies (its server then fails its requests and
        # `pdserve up` restarts the worker); the offline engine raises TensorParallelError instead
        self.exit_on_failure = False
        self.on_event: Callable[[KVEvent], None] | None = None
        self._on_failure = on_failure
        self._closing = False
        self._calls = 0
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()  # a message goes out whole
        self._call_lock = threading.Lock()  # one call's replies are read before the next call's
        env = {**os.environ, "PYTHONPATH": _pythonpath()}
        self.procs: list[RankProcess] = []
        try:
            for start in starts:
                self.procs.append(RankProcess(start.rank, env))
                self.procs[-1].plan.send_bytes(pickle.dumps(start, protocol=pickle.HIGHEST_PROTOCOL))
        except OSError as e:
            self.close()
            raise TensorParallelError(f"cannot start the tensor parallel ranks: {e}") from e
        for p in self.procs:
            threading.Thread(target=self._read, args=(p,), name=f"tp-rank-{p.rank}", daemon=True).start()

    @property
    def pids(self) -> list[int]:
        return [p.proc.pid for p in self.procs]

    # ---- rank 0 -> ranks ----------------------------------------------------------------------------

    def send(self, msg: ToRank) -> None:
        """Write `msg` to every rank (never waits for them to read it, unless a pipe is full)."""
        self.check()
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            for p in self.procs:
                try:
                    p.plan.send_bytes(data)
                except OSError:
                    self._fail(p.describe_exit())
                    self.check()

    def post(self, method: str, *args: Any) -> None:
        """Run `method` on every rank's KV side, in step order, without waiting for it."""
        self.send(KVCall(None, method, args))

    def call(
        self, method: str, *args: Any, timeout: float | None = None, during: Callable[[], None] | None = None
    ) -> list[Any]:
        """Run `method` on every rank's KV side, in step order; their return values, by rank (1..N-1).
        `during()` runs here meanwhile (rank 0's own share). Raises TensorParallelError for a rank that
        died, RuntimeError with a rank's error."""
        with self._call_lock:
            self._calls += 1
            self.send(KVCall(self._calls, method, args))
            try:
                if during is not None:
                    during()
            finally:
                replies = self.collect(Reply, timeout)
        errors = [f"rank {p.rank}: {r.error}" for p, r in zip(self.procs, replies) if r.error is not None]
        if errors:
            raise RuntimeError("; ".join(errors))
        return [r.value for r in replies]

    def collect(self, kind: type, timeout: float | None = None) -> list[Any]:
        """The next message of `kind` from every rank, in rank order (others are skipped)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        out = []
        for p in self.procs:
            while True:
                self.check()
                try:
                    msg = p.inbox.get(timeout=POLL_S)
                except queue.Empty:
                    if deadline is not None and time.monotonic() > deadline:
                        raise TensorParallelError(
                            f"tensor parallel rank {p.rank} did not answer within {timeout:g} s"
                        ) from None
                    continue
                if isinstance(msg, kind):
                    out.append(msg)
                    break
        return out

    def check(self) -> None:
        if self.failure is not None:
            raise TensorParallelError(self.failure)

    # ---- ranks -> rank 0 ----------------------------------------------------------------------------

    def _read(self, p: RankProcess) -> None:
        while True:
            try:
                msg = pickle.loads(p.reply.recv_bytes())
            except (EOFError, OSError):
                if not self._closing:
                    self._fail(p.describe_exit())
                return
            if isinstance(msg, Failed):
                p.error = msg.error
            elif isinstance(msg, KVEvent):
                if self.on_event is not None:
                    self.on_event(msg)
            else:
                p.inbox.put(msg)

    def _fail(self, reason: str) -> None:
        with self._lock:
            if self.failure is not None or self._closing:
                return
            self.failure = f"{reason}; the engine cannot run steps any more"
        logger.error("%s", self.failure)
        if self._on_failure is not None:
            with contextlib.suppress(Exception):
                self._on_failure()  # NCCL: abort the group, so collectives waiting on the dead rank return
        for p in self.procs:  # the others may be blocked in a collective with the dead one
            if p.proc.poll() is None:
                p.proc.kill()
        if self.exit_on_failure:
            os._exit(1)

    def close(self) -> None:
        """Stop every rank (Shutdown, then a kill past STOP_S) and close the pipes. Idempotent."""
        if self._closing:
            return
        self._closing = True
        data = pickle.dumps(Shutdown(), protocol=pickle.HIGHEST_PROTOCOL)
        for p in self.procs:
            with contextlib.suppress(OSError):
                p.plan.send_bytes(data)
        deadline = time.monotonic() + STOP_S
        for p in self.procs:
            with contextlib.suppress(OSError):
                p.plan.close()
            try:
                p.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.proc.kill()
                p.proc.wait()
            with contextlib.suppress(OSError):
                p.reply.close()


def _pythonpath() -> str:
    """This tree's root first, so a rank imports the same engine as rank 0."""
    root = str(Path(__file__).resolve().parents[2])
    rest = os.environ.get("PYTHONPATH")
    return root if not rest else f"{root}{os.pathsep}{rest}"
