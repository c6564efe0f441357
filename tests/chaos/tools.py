"""What the chaos tests share: a redis-server they can kill, pause and restart, a stack of real processes
(the cluster through `pdserve up`, the gateway in its own process) and a steady load that records every
request's outcome."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import httpx
import redis

from engine.block_hash import extra_keys, hash_prompt_blocks
from engine.tokenizer import Tokenizer
from serving.roles import free_port
from tests.cluster import Cluster, start_cluster, start_gateway

REQUEST_TIMEOUT_S = 5.0  # nothing may hang past this


@dataclass
class Stack:
    redis: RedisServer
    cluster: Cluster
    url: str
    model: str
    tokenizer: Tokenizer

    def complete(self, prompt: str, max_tokens: int = 2, timeout: float = REQUEST_TIMEOUT_S) -> dict:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        r = httpx.post(self.url + "/v1/completions", json=body, timeout=timeout)
        assert r.status_code == 200, r.text
        return r.json()

    def cached(self, prompt: str) -> int:
        return self.complete(prompt)["usage"]["prompt_tokens_details"]["cached_tokens"]

    def live_in_index(self) -> int:
        """How many workers the Redis index holds a fresh heartbeat for."""
        client = self.redis.client()
        try:
            return len(client.keys(b"pdserve:kv:w:*:hb"))
        finally:
            client.close()

    def holders(self, prefix: str, blocks: int) -> set[bytes]:
        """The workers that the Redis index says hold the prefix's first `blocks` full blocks."""
        ids = self.tokenizer.encode(prefix)
        last = hash_prompt_blocks(ids, 16, extra_keys(self.model))[blocks - 1]
        client = self.redis.client()
        try:
            return cast(
                set[bytes], set(client.smembers(b"pdserve:kv:h:" + last))
            )  # no decode_responses: bytes
        finally:
            client.close()


@contextmanager
def chaos_stack(model_dir: Path) -> Iterator[Stack]:
    """redis-server, `pdserve up` with two prefill workers and one decode worker sharing the index through
    it, and the gateway, all stopped on the way out."""
    server = RedisServer()
    server.start()
    try:
        with one_thread_per_engine():
            cluster = start_cluster(2, 1, "tcp", "--redis-url", server.url, "--policy", "prefix_aware")
        try:
            proc, url = start_gateway(cluster.router)
            try:
                model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
                yield Stack(server, cluster, url, model, Tokenizer.from_dir(model_dir))
            finally:
                proc.terminate()
                proc.wait(timeout=30)
        finally:
            cluster.stop()
    finally:
        server.stop()


@contextmanager
def one_thread_per_engine() -> Iterator[None]:
    """Processes started inside run torch on one thread: three engines on two cores would otherwise spin
    each other's threads off the CPU, and every request would wait on that rather than on the fault."""
    before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = before


def wait_until(check: Callable[[], bool], timeout: float, what: str, every: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(every)


class RedisServer:
    """A redis-server on a fixed port, so that a restarted one is found at the same URL."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        assert binary is not None, "redis-server is not installed (apt-get install redis-server)"
        self.binary = binary
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        wait_until(self.answers, 10, "redis-server answering")

    def answers(self) -> bool:
        client = redis.Redis(port=self.port, socket_timeout=0.5)
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False
        finally:
            client.close()

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=2)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            self.proc.wait(timeout=10)


@dataclass
class Outcome:
    start: float
    seconds: float
    status: int  # HTTP status, or 0 when the request raised (timeout, connection error)
    detail: str = ""


@dataclass
class SteadyLoad:
    """`workers` threads sending short greedy completions back to back, and a thread polling /health."""

    url: str
    model: str
    workers: int = 2
    outcomes: list[Outcome] = field(default_factory=list)
    health: list[tuple[float, int]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def __enter__(self) -> SteadyLoad:
        for i in range(self.workers):
            self._threads.append(threading.Thread(target=self._send, args=(i,), daemon=True))
        self._threads.append(threading.Thread(target=self._watch_health, daemon=True))
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=2 * REQUEST_TIMEOUT_S)

    def _send(self, worker: int) -> None:
        with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
            n = 0
            while not self._stop.is_set():
                n += 1
                body = {
                    "model": self.model,
                    "prompt": f"Steady load {worker}-{n}: the next number after {n} is",
                    "max_tokens": 4,
                    "temperature": 0,
                }
                t0 = time.monotonic()
                try:
                    r = client.post(self.url + "/v1/completions", json=body)
                    outcome = Outcome(t0, time.monotonic() - t0, r.status_code, r.text[:300])
                except httpx.HTTPError as exc:
                    outcome = Outcome(t0, time.monotonic() - t0, 0, repr(exc))
                self.outcomes.append(outcome)

    def _watch_health(self) -> None:
        with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
            while not self._stop.wait(0.25):
                try:
                    status = client.get(self.url + "/health").status_code
                except httpx.HTTPError:
                    status = 0
                self.health.append((time.monotonic(), status))

    def since(self, t: float) -> list[Outcome]:
        return [o for o in self.outcomes if o.start >= t]

    def wait_for(self, count: int, timeout: float = 30) -> None:
        """Wait until `count` more requests than now have ended."""
        target = len(self.outcomes) + count
        wait_until(lambda: len(self.outcomes) >= target, timeout, f"{count} steady requests")

    def wait_since(self, t: float, count: int, timeout: float = 30) -> None:
        """Wait until `count` requests started at or after `t` have ended."""
        wait_until(lambda: len(self.since(t)) >= count, timeout, f"{count} steady requests since the fault")


def failures(outcomes: list[Outcome]) -> list[Outcome]:
    return [o for o in outcomes if o.status != 200 or o.seconds > REQUEST_TIMEOUT_S]


def p99(outcomes: list[Outcome]) -> float:
    times = sorted(o.seconds for o in outcomes)
    assert times, "no requests ended"
    return times[min(len(times) - 1, int(0.99 * len(times)))]
