"""`pdserve up`'s children: start them, restart one that exits while the cluster runs, drain them all on stop.

A child that exits while `up` is not stopping, for whatever reason (a crash, a kill, a SIGTERM from someone
else, even with exit code 0), is restarted with the same command line, so on the same address, after a
backoff of 1 s, 2 s, 4 s ... capped at 30 s; the backoff starts over once a child has stayed up 60 s. Every
death is reaped at once (no zombie) and the rest of its process group (a worker's engine process) is
killed with it. Each restart prints a line for tools: `pdserve restarted: {"role", "address", "pid"}`.

On stop (`drain`), every child gets SIGTERM and drains itself; those still running after the drain timeout
plus a margin are killed (a second SIGTERM/SIGINT to `up` kills them at once). They stop front to back, in
`STOP_ORDER`, each caller before what it calls: the gateway (`pdserve serve`'s), the router, the decode
workers, then the prefill workers.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

POLL_S = 0.1
# each caller before what it calls: a draining child's callees still serve what it finishes, and no server
# ends a shared stream while its caller is closing it (grpc then fails to send the stream's status)
STOP_ORDER = ("gateway", "router", "decode", "prefill")
STOP_MARGIN_S = 15.0  # past the children's drain timeout: their engine and server shutdown


@dataclass(frozen=True)
class Backoff:
    first_s: float = 1.0
    cap_s: float = 30.0
    stable_s: float = 60.0  # a child up this long before it died starts the backoff over

    def __post_init__(self) -> None:
        if not 0 < self.first_s <= self.cap_s:
            raise ValueError("backoff needs 0 < first_s <= cap_s")

    def delay(self, failures: int) -> float:
        """Seconds before the restart that follows `failures` deaths in a row (1 or more)."""
        return min(self.cap_s, self.first_s * 2 ** (failures - 1))


@dataclass
class Child:
    role: str  # router, prefill, decode or gateway
    address: str
    cmd: list[str]
    metrics_port: int | None = None  # its Prometheus /metrics, when it serves one
    env: dict[str, str] | None = None  # set on top of this process's environment (e.g. CUDA_VISIBLE_DEVICES)
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    failures: int = 0  # deaths in a row, each within Backoff.stable_s of its start
    restart_at: float | None = None  # set while it waits for its restart

    def start(self) -> None:
        env = {**os.environ, **self.env} if self.env else None
        self.proc = subprocess.Popen(self.cmd, start_new_session=True, env=env)
        self.started_at = time.monotonic()
        self.restart_at = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    def reap(self) -> int | None:
        """Its exit status once it has exited (reaped, the rest of its process group killed), else None."""
        if self.proc is None or self.proc.returncode is not None:
            return None if self.proc is None else self.proc.returncode
        try:  # WNOWAIT: until reaped, its pid (its group's id) cannot be reused, so the group kill is safe
            exited = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return self.proc.poll()
        if exited is None:
            return None
        _kill_group(self.pid)
        return self.proc.wait()

    def describe(self) -> str:
        return f"{self.role} {self.address} (pid {self.pid})"


def how_it_ended(returncode: int) -> str:
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit code {returncode}"


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


@dataclass
class StopSignals:
    """SIGTERM and SIGINT to `up`, counted (installed in the main thread)."""

    count: int = 0

    def install(self) -> StopSignals:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum: int, frame: object) -> None:
        self.count += 1

    @property
    def stopping(self) -> bool:
        return self.count > 0


class Supervisor:
    def __init__(
        self,
        children: list[Child],
        drain_timeout_s: float,
        backoff: Backoff | None = None,
        stop_margin_s: float = STOP_MARGIN_S,
    ) -> None:
        self.children = children
        self.drain_timeout_s = drain_timeout_s
        self.backoff = backoff or Backoff()
        self.stop_margin_s = stop_margin_s

    def start_all(self) -> None:
        for child in self.children:
            child.start()

    def any_exited(self) -> bool:
        return any(c.reap() is not None for c in self.children)

    def run(self, signals: StopSignals) -> None:
        """Keep every child running until `up` is told to stop."""
        while not signals.stopping:
            now = time.monotonic()
            for child in self.children:
                self._tend(child, now)
            time.sleep(POLL_S)

    def _tend(self, child: Child, now: float) -> None:
        if child.restart_at is not None:
            if now >= child.restart_at:
                child.start()
                logger.warning("restarted %s", child.describe())
                line = {"role": child.role, "address": child.address, "pid": child.pid}
                print("pdserve restarted: " + json.dumps(line), flush=True)
            return
        code = child.reap()
        if code is None:
            return
        child.failures = 1 if now - child.started_at >= self.backoff.stable_s else child.failures + 1
        delay = self.backoff.delay(child.failures)
        child.restart_at = now + delay
        logger.warning("%s died: %s; restarting in %g s", child.describe(), how_it_ended(code), delay)

    def drain(self, signals: StopSignals) -> int:
        """SIGTERM the children tier by tier in STOP_ORDER, each tier once the one before has exited; wait for
        them to drain and exit, kill stragglers. The drain timeout plus the margin bounds the whole stop, not
        each tier (the tiers behind the first are idle by the time they stop), though a tier always gets the
        margin. 0 if all exited 0."""
        seen = signals.count
        deadline = time.monotonic() + self.drain_timeout_s + self.stop_margin_s
        tiers = [[c for c in self.children if c.role == role] for role in STOP_ORDER]
        tiers.append([c for c in self.children if c.role not in STOP_ORDER])  # none today
        codes = [self._drain(tier, signals, seen, deadline) for tier in tiers if tier]
        return max(codes, default=0)

    def _drain(self, children: list[Child], signals: StopSignals, seen: int, deadline: float) -> int:
        live = [c for c in children if c.running()]
        for child in live:
            child.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        deadline = max(deadline, time.monotonic() + self.stop_margin_s)
        clean = True
        while live:
            for child in list(live):
                code = child.reap()
                if code is not None:
                    live.remove(child)
                    clean = clean and code == 0
                    logger.info("%s exited: %s", child.describe(), how_it_ended(code))
            if live and (time.monotonic() > deadline or signals.count > seen):
                for child in live:
                    logger.warning("%s did not stop: killing it", child.describe())
                    _kill_group(child.pid)
                    child.proc.wait()  # type: ignore[union-attr]
                return 1
            time.sleep(POLL_S)
        return 0 if clean else 1

    def kill_all(self) -> None:
        """What is left after an error: killed, with their process groups, and reaped."""
        for child in self.children:
            if child.running():
                _kill_group(child.pid)
                child.proc.wait()  # type: ignore[union-attr]
