"""A discrete-event fleet of simulated prefill workers driven by the real index, events and policy.

Each simulated worker is a FIFO server (prefill time = overhead + uncached tokens / tokens_per_s) with a
finite LRU block cache; it publishes real `EventBatch`es through a `KVEventPublisher`, serialised and
delivered to the real index (`InMemoryPrefixIndex`, or any `make_index` builds) after `event_delay_s`, and heartbeats its queue. The real
`PrefixRouter` picks the worker for every request. Simulated time drives the index's clock, so TTLs and
speculation behave as they would in a fleet. A cache hit is what the worker's own LRU holds when the
request starts, not what the index believed.
"""

from __future__ import annotations

import heapq
import itertools
import random
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Container
from dataclasses import dataclass

import numpy as np

from engine.block_hash import BlockHash
from router.index import ApplyResult, InMemoryPrefixIndex, PrefixIndex
from router.policy import PrefixRouter, RoutingDecision, make_policy
from router.sim.workload import Request
from serving.kv_events import EventBatch, KVEventPublisher, WorkerLoad


@dataclass(frozen=True)
class FleetConfig:
    num_workers: int = 8
    cache_blocks: int = 16_384  # per worker
    block_size: int = 16
    tokens_per_s: float = 10_000.0  # prefill throughput of one worker
    overhead_s: float = 0.005  # per prefill
    event_delay_s: float = 0.002  # worker -> index
    event_loss: float = 0.0  # probability that a batch is lost on the way (the index then resyncs)
    heartbeat_interval_s: float = 0.5
    heartbeat_ttl_s: float = 5.0
    speculate_ttl_s: float = 5.0
    warmup_fraction: float = 0.2  # the first requests fill the caches and are left out of the metrics
    seed: int = 0


@dataclass(frozen=True)
class SimResult:
    policy: str
    num_workers: int
    num_requests: int  # measured, after warm-up
    hit_rate: float  # prompt tokens found in the chosen worker's cache / prompt tokens
    oracle_hit_rate: float  # the same for one infinite cache that sees every request
    mean_ttft_s: float
    p50_ttft_s: float
    p90_ttft_s: float
    p99_ttft_s: float
    max_busy_share: float  # busiest worker's prefill time / the mean
    max_request_share: float  # most requests on one worker / the mean
    utilisation: float  # mean fraction of time a worker was busy prefilling, over the measured window
    resyncs: int
    decision_us: float  # mean wall time of one PrefixRouter.route call
    wall_s: float


class _Job:
    __slots__ = ("req", "decision", "measured", "hit_blocks", "uncached", "new_blocks", "seconds")

    def __init__(self, req: Request, decision: RoutingDecision, measured: bool) -> None:
        self.req, self.decision, self.measured = req, decision, measured
        self.hit_blocks = 0
        self.seconds = 0.0
        self.uncached = decision.uncached_tokens  # the router's estimate until the job starts
        self.new_blocks: list[BlockHash] = []


class SimWorker:
    def __init__(self, worker_id: str, cfg: FleetConfig, clock_ref: list[float]) -> None:
        self.worker_id = worker_id
        self.cfg = cfg
        self.lru: OrderedDict[BlockHash, None] = OrderedDict()  # least recently used first
        self.publisher = KVEventPublisher(worker_id, lambda: list(self.lru), clock=lambda: clock_ref[0])
        self.queue: deque[_Job] = deque()
        self.current: _Job | None = None
        self.queued_tokens = 0
        self.busy_s = 0.0
        self.requests = 0

    def start(self, job: _Job) -> float:
        """Take the job's prefix from the cache, make room for the rest; return its prefill time."""
        lru, chain = self.lru, job.req.block_hashes[: self.cfg.cache_blocks]
        hit = _leading(chain, lru)
        lru.update(zip(chain[hit:], itertools.repeat(None)))
        # Touch tail first so the head ends most recent: a prompt's tail is evicted before its head.
        deque(map(lru.move_to_end, reversed(chain)), maxlen=0)
        evicted = [lru.popitem(last=False)[0] for _ in range(len(lru) - self.cfg.cache_blocks)]
        self.publisher.removed(evicted)
        job.hit_blocks, job.new_blocks = hit, chain[hit:]
        uncached = max(1, job.req.num_tokens - hit * self.cfg.block_size)
        self.queued_tokens += uncached - job.uncached
        job.uncached = uncached
        self.current = job
        seconds = job.seconds = self.cfg.overhead_s + uncached / self.cfg.tokens_per_s
        self.busy_s += seconds
        self.requests += 1
        return seconds

    def finish(self) -> tuple[_Job, EventBatch | None]:
        job = self.current
        assert job is not None
        self.current = None
        self.queued_tokens -= job.uncached
        self.publisher.stored(job.new_blocks)
        return job, self.publisher.flush()


_ARRIVE, _DONE, _DELIVER, _HEARTBEAT = range(4)


IndexFactory = Callable[[float, Callable[[], float]], PrefixIndex]  # (heartbeat_ttl, clock) -> index


class FleetSim:
    def __init__(
        self, cfg: FleetConfig, policy: str, make_index: IndexFactory | None = None, **policy_kwargs: float
    ) -> None:
        self.cfg = cfg
        self.policy_name = policy
        self._now = [0.0]
        self.index = (make_index or _in_memory)(cfg.heartbeat_ttl_s, lambda: self._now[0])
        self.router = PrefixRouter(
            self.index,
            make_policy(policy, **policy_kwargs),
            block_size=cfg.block_size,
            speculate_ttl=cfg.speculate_ttl_s,
            clock=lambda: self._now[0],
        )
        self.workers = {f"w{i:03d}": SimWorker(f"w{i:03d}", cfg, self._now) for i in range(cfg.num_workers)}
        self._rng = random.Random(cfg.seed)
        self._heap: list[tuple[float, int, int, object]] = []
        self._seq = 0
        self.resyncs = 0

    def _push(self, t: float, kind: int, payload: object) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, payload))

    def _heartbeats(self) -> None:
        for w in self.workers.values():
            load = WorkerLoad("prefill", w.queued_tokens, len(w.queue) + (w.current is not None))
            if self.index.heartbeat(w.worker_id, w.publisher.epoch, load) is ApplyResult.RESYNC_NEEDED:
                self._resync(w)

    def _resync(self, w: SimWorker) -> None:
        snap = w.publisher.snapshot()
        self.index.resync(snap.worker_id, snap.epoch, snap.seq, snap.hashes)
        self.resyncs += 1

    def _deliver(self, data: bytes) -> None:
        batch = EventBatch.from_bytes(data)
        if self.index.apply(batch) is ApplyResult.RESYNC_NEEDED:
            self._resync(self.workers[batch.worker_id])

    def run(self, requests: list[Request]) -> SimResult:
        t0 = time.perf_counter()
        self._heartbeats()
        self._push(self.cfg.heartbeat_interval_s, _HEARTBEAT, None)
        oracle: set[BlockHash] = set()
        warmup = int(len(requests) * self.cfg.warmup_fraction)
        ttfts: list[float] = []
        hit_tokens = oracle_tokens = prompt_tokens = 0
        route_s = busy_s = 0.0
        i, n = 0, len(requests)
        while i < n or self._heap:
            if i < n and (not self._heap or requests[i].arrival <= self._heap[0][0]):
                req = requests[i]
                self._now[0] = req.arrival
                measured = i >= warmup
                i += 1
                chain = req.block_hashes
                if measured:
                    prompt_tokens += req.num_tokens
                    oracle_tokens += _leading(chain, oracle) * self.cfg.block_size
                oracle.update(chain)
                r0 = time.perf_counter()
                decision = self.router.route(chain, req.num_tokens)
                route_s += time.perf_counter() - r0
                worker = self.workers[decision.prefill_worker]
                worker.queued_tokens += decision.uncached_tokens
                job = _Job(req, decision, measured)
                if worker.current is None:
                    self._push(req.arrival + worker.start(job), _DONE, worker)
                else:
                    worker.queue.append(job)
                continue
            t, _, kind, payload = heapq.heappop(self._heap)
            self._now[0] = t
            if kind == _DONE:
                assert isinstance(payload, SimWorker)
                job, batch = payload.finish()
                self.router.prefill_done(job.decision)
                if job.measured:
                    ttfts.append(t - job.req.arrival)
                    hit_tokens += job.hit_blocks * self.cfg.block_size
                    busy_s += job.seconds
                if batch is not None and self._rng.random() >= self.cfg.event_loss:
                    self._push(t + self.cfg.event_delay_s, _DELIVER, batch.to_bytes())
                if payload.queue:
                    self._push(t + payload.start(payload.queue.popleft()), _DONE, payload)
            elif kind == _DELIVER:
                assert isinstance(payload, bytes)
                self._deliver(payload)
            elif i < n:  # heartbeats stop once the last request has arrived
                self._heartbeats()
                self._push(t + self.cfg.heartbeat_interval_s, _HEARTBEAT, None)
        window = requests[-1].arrival - requests[warmup].arrival if warmup < n else 0.0
        utilisation = busy_s / max(window, 1e-9) / self.cfg.num_workers
        return self._result(
            requests, ttfts, hit_tokens, oracle_tokens, prompt_tokens, route_s, utilisation, t0
        )

    def _result(
        self,
        requests: list[Request],
        ttfts: list[float],
        hit_tokens: int,
        oracle_tokens: int,
        prompt_tokens: int,
        route_s: float,
        utilisation: float,
        t0: float,
    ) -> SimResult:
        busy = np.array([w.busy_s for w in self.workers.values()])
        reqs = np.array([w.requests for w in self.workers.values()])
        ttft = np.array(ttfts) if ttfts else np.zeros(1)
        return SimResult(
            policy=self.policy_name,
            num_workers=self.cfg.num_workers,
            num_requests=len(ttfts),
            hit_rate=hit_tokens / max(prompt_tokens, 1),
            oracle_hit_rate=oracle_tokens / max(prompt_tokens, 1),
            mean_ttft_s=float(ttft.mean()),
            p50_ttft_s=float(np.percentile(ttft, 50)),
            p90_ttft_s=float(np.percentile(ttft, 90)),
            p99_ttft_s=float(np.percentile(ttft, 99)),
            max_busy_share=float(busy.max() / busy.mean()),
            max_request_share=float(reqs.max() / reqs.mean()),
            utilisation=utilisation,
            resyncs=self.resyncs,
            decision_us=route_s / len(requests) * 1e6,
            wall_s=time.perf_counter() - t0,
        )


def _leading(chain: list[BlockHash], held: Container[BlockHash]) -> int:
    return len(list(itertools.takewhile(held.__contains__, chain)))


def _in_memory(heartbeat_ttl: float, clock: Callable[[], float]) -> PrefixIndex:
    return InMemoryPrefixIndex(heartbeat_ttl, clock=clock)


def simulate(
    requests: list[Request],
    cfg: FleetConfig,
    policy: str,
    make_index: IndexFactory | None = None,
    **policy_kwargs: float,
) -> SimResult:
    """Run the fleet; `make_index` builds the router's index (default: in memory) on the simulated clock."""
    return FleetSim(cfg, policy, make_index, **policy_kwargs).run(requests)
