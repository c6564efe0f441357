"""The router's own view of its workers, from its GetLoad polls: the liveness and load that routing and health
use. The prefix index (in memory or Redis) only adds which worker holds which blocks; when it is empty or
unreachable, this table still knows who is live."""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from protos import pdserve_pb2 as pb
from router.metrics import RouterMetrics
from serving.kv_events import WorkerLoad

logger = logging.getLogger(__name__)

PREFILL_ROLES = ("prefill", "both")
DECODE_ROLES = ("decode", "both")


class State(enum.Enum):
    UNKNOWN = "not answered yet"
    UP = "up"
    DOWN = "down"
    DRAINING = "draining"


@dataclass
class _Worker:
    address: str
    role: str  # as configured until the worker says
    state: State = State.UNKNOWN
    load: WorkerLoad | None = None
    epoch: int = 0
    last_seen: float = float("-inf")


class WorkerTable:
    """Address -> state, last load and when it last answered. Used from the router's event loop only.

    A worker is UP from its first answer; DRAINING while its answers say so (live, but given nothing new);
    DOWN once a poll fails with UNAVAILABLE (nobody listens there), its decode stream breaks, or it has not
    answered a poll, nor sent a frame on its decode stream (`heard`), for `ttl_s`. Each change is logged once
    and counted.
    """

    def __init__(
        self,
        roles: Mapping[str, str],
        ttl_s: float,
        metrics: RouterMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s
        self.metrics = metrics
        self._clock = clock
        self._workers = {a: _Worker(a, role) for a, role in roles.items()}
        # configured without prefill workers (aggregated serving): decode workers alone can serve
        self._needs = [("decode", DECODE_ROLES)]
        if any(role in PREFILL_ROLES for role in roles.values()):
            self._needs.insert(0, ("prefill", PREFILL_ROLES))
        self._view: dict[str, WorkerLoad] | None = None
        for w in self._workers.values():
            metrics.worker_up.labels(w.address, w.role).set(0)

    def seen(self, address: str, reply: pb.WorkerLoad) -> bool:
        """Record a GetLoad answer; True when the worker restarted (a new epoch) since the last one."""
        w = self._workers[address]
        w.last_seen = self._clock()
        restarted = w.epoch not in (0, reply.epoch)
        w.epoch = reply.epoch
        if reply.role and reply.role != w.role:
            self.metrics.worker_up.remove(w.address, w.role)
            w.role = reply.role
        load = WorkerLoad(
            role=w.role,
            running_requests=reply.num_running + reply.num_waiting,
            free_blocks=reply.num_free_blocks,
            total_blocks=reply.num_total_blocks,
        )
        if load != w.load:
            w.load, self._view = load, None
        if restarted and w.state is State.UP:
            logger.info(
                "%s worker %s restarted (a new epoch): its prefix cache starts empty", w.role, address
            )
        self._set(w, State.DRAINING if reply.draining else State.UP, "answering")
        return restarted

    def heard(self, address: str, at: float) -> None:
        """The worker sent something at `at` (this table's clock) other than a poll's answer, a frame on its
        decode stream: it is alive, so the TTL counts from there too."""
        w = self._workers[address]
        w.last_seen = max(w.last_seen, at)

    def failed(self, address: str, why: str, at_once: bool) -> bool:
        """A poll or a call failed; `at_once` (the worker is unreachable) marks it DOWN without waiting for
        the TTL. True if it went DOWN now."""
        w = self._workers[address]
        if at_once and w.state in (State.UP, State.DRAINING):
            self._set(w, State.DOWN, why)
            return True
        return False

    def expire(self) -> list[str]:
        """Mark DOWN the workers silent for longer than the TTL; return them."""
        now = self._clock()
        gone = [
            w
            for w in self._workers.values()
            if w.state in (State.UP, State.DRAINING) and now - w.last_seen > self.ttl_s
        ]
        for w in gone:
            self._set(w, State.DOWN, f"no answer for {self.ttl_s:g} s")
        return [w.address for w in gone]

    def load(self, address: str) -> WorkerLoad:
        w = self._workers[address]
        return w.load or WorkerLoad(role=w.role)

    def routable(self) -> dict[str, WorkerLoad]:
        """The UP workers' loads, sorted by address (the same object until something changes)."""
        if self._view is None:
            self._view = {
                a: w.load or WorkerLoad(role=w.role)
                for a, w in sorted(self._workers.items())
                if w.state is State.UP
            }
        return self._view

    def state(self, address: str) -> State:
        return self._workers[address].state

    def not_serving_reason(self) -> str | None:
        """None while an UP worker can prefill (if any is configured) and one can decode; else why not, as a
        plain sentence."""
        for kind, roles in self._needs:
            if not any(w.state is State.UP and w.role in roles for w in self._workers.values()):
                return self.no_worker(kind)
        return None

    def no_worker(self, kind: str) -> str:
        roles = PREFILL_ROLES if kind == "prefill" else DECODE_ROLES
        known = sorted((w for w in self._workers.values() if w.role in roles), key=lambda w: w.address)
        states = ", ".join(f"{w.address} {w.state.value}" for w in known)
        return (
            f"no live {kind} worker ({len(known)} known: {states})"
            if known
            else f"no {kind} worker is configured"
        )

    def _set(self, w: _Worker, state: State, why: str) -> None:
        if w.state is state:
            return
        was, w.state, self._view = w.state, state, None
        self.metrics.worker_up.labels(w.address, w.role).set(1 if state is State.UP else 0)
        self.metrics.worker_state_changes.labels(w.role, state.name.lower()).inc()
        if state is State.DOWN:
            logger.warning("%s worker %s is down (%s); routing around it", w.role, w.address, why)
        elif state is State.DRAINING:
            logger.info("%s worker %s is draining; routing nothing new to it", w.role, w.address)
        elif was is State.UNKNOWN:
            logger.info("%s worker %s is up", w.role, w.address)
        else:
            logger.info("%s worker %s is up again (was %s)", w.role, w.address, was.value)
