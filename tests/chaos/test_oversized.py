"""Oversized requests under steady load: a 20 MB body and ten concurrent 2 MB bodies are refused (413 or
400) within 1 s each, the steady load's p99 latency stays within 2x its value without them, and no worker
drops out of routing (/health stays 200 and every steady request succeeds)."""

from __future__ import annotations

import http.client
import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.chaos.tools import Stack, SteadyLoad, failures, p99

pytestmark = pytest.mark.slow

MB = 2**20


def huge_body(model: str, size: int) -> bytes:
    return json.dumps({"model": model, "prompt": "a" * size, "max_tokens": 4}).encode()


def post_raw(url: str, body: bytes) -> tuple[int, float, dict]:
    """One POST as a plain client sends it: the body in one write, which lets go of the GIL."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    t0 = time.monotonic()
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        reply = conn.getresponse()
        return reply.status, time.monotonic() - t0, json.loads(reply.read())
    finally:
        conn.close()


def test_oversized_bodies_are_refused_fast_and_do_not_stall_others(stack: Stack) -> None:
    bodies = [huge_body(stack.model, 20 * MB)] + [huge_body(stack.model, 2 * MB) for _ in range(10)]
    # one steady request at a time: on two cores, three engines computing flat out would starve the gateway
    # and the router of the CPU they need to refuse, whatever their code does
    with SteadyLoad(stack.url, stack.model, workers=1) as load:
        load.wait_for(20, timeout=60)  # the baseline
        baseline = p99(load.outcomes)
        start = time.monotonic()
        with ThreadPoolExecutor(len(bodies)) as pool:
            refused = list(pool.map(lambda b: post_raw(stack.url, b), bodies))
        end = time.monotonic()
        load.wait_for(4)
    during = [o for o in load.outcomes if start <= o.start <= end or o.start <= start < o.start + o.seconds]
    for status, _, reply in refused:
        assert status in (400, 413), (status, reply)
        assert set(reply["error"]) == {"message", "type", "param", "code"}, reply
    slowest = max(seconds for _, seconds, _ in refused)
    assert slowest <= 1.0, f"refusals took {[(s, round(t, 2)) for s, t, _ in refused]} s"
    assert during, "no steady request overlapped the oversized ones"
    assert p99(during) <= 2 * baseline, (p99(during), baseline)
    assert not failures(load.outcomes), failures(load.outcomes)[:5]
    assert all(s == 200 for _, s in load.health)
    stack.cluster.wait_all_blocks_free(timeout=10)
    stack.complete("The capital of France is", max_tokens=4)
