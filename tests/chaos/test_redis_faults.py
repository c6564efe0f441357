"""Redis faults under steady load: the prefix index is an optimisation, never a dependency.

One stack of real processes (redis-server, `pdserve up` with two prefill workers and one decode worker
sharing the index through Redis, the gateway). For each fault — redis-server killed with SIGKILL, paused
with SIGSTOP for 20 s, restarted empty — every steady request succeeds within 5 s, /health stays 200 (the
workers are live), the index is rebuilt from the workers within a few heartbeats once Redis is back, and
prompts are routed to the prefill worker that holds their prefix again. Afterwards no worker holds a block
and the gateway serves a normal request.
"""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.chaos.tools import REQUEST_TIMEOUT_S, Stack, SteadyLoad, failures, wait_until

pytestmark = pytest.mark.slow

TOPICS = [
    "You are a meticulous travel agent. Always list flights, hotels and trains with prices, and ask about "
    "budget, dates and seat preferences before booking anything. ",
    "You are a patient math tutor for high-school students. Explain each step, check the arithmetic twice "
    "and end with a short exercise for the student to try on their own. ",
    "You are a code reviewer for a Python team. Point out bugs first, then style, then tests; quote the line "
    "you mean and suggest the smallest fix that works. ",
    "You are a gardener who knows every rose variety. Talk about soil, light, water and pruning, and warn "
    "about pests that come with each season of the year. ",
]
PREFIX_BLOCKS = 8  # full blocks of each topic's prefix that a hit must cover
SERVED_AFTER_FAULT = 10  # steady requests started after the fault that must have ended, all of them well
RECOVERY_S = 5.0  # "within a few heartbeats" (the router polls every 0.5 s)


def prefix(topic: str) -> str:
    return topic * 6


@pytest.fixture(scope="module")
def warmed(stack: Stack) -> Stack:
    """Each topic's prefix computed once, all at the same time so that load spreads them over both prefill
    workers: only a router that follows the prefixes then hits every one of them later."""
    assert all(len(stack.tokenizer.encode(prefix(t))) >= 16 * PREFIX_BLOCKS for t in TOPICS)
    with ThreadPoolExecutor(len(TOPICS)) as pool:
        # a cold stack computing four long prompts at once on two cores: not what the 5 s bound is about
        list(pool.map(lambda t: stack.complete(prefix(t) + " First question?", timeout=120), TOPICS))
    wait_until(
        lambda: all(stack.holders(prefix(t), PREFIX_BLOCKS) for t in TOPICS),
        RECOVERY_S,
        "the index has every prefix",
    )
    holders = [stack.holders(prefix(t), PREFIX_BLOCKS) for t in TOPICS]
    assert len(set().union(*holders)) == 2, (
        f"the prefixes did not spread over both prefill workers: {holders}"
    )
    return stack


def assert_recovered(stack: Stack, back: float) -> None:
    """Redis is back: within a few heartbeats the index is rebuilt from the workers (their blocks, and
    heartbeats for all three)."""
    wait_until(
        lambda: stack.live_in_index() == 3 and all(stack.holders(prefix(t), PREFIX_BLOCKS) for t in TOPICS),
        RECOVERY_S,
        "the index rebuilt from the workers",
        every=0.05,
    )
    assert time.monotonic() - back <= RECOVERY_S + 1


def assert_hits(stack: Stack, round_: str) -> None:
    """With the steady load stopped (its queue would rightly outweigh a cached prefix), every topic is
    routed to the prefill worker that holds it."""
    for i, topic in enumerate(TOPICS):
        cached = stack.cached(prefix(topic) + f" Question {round_} on topic {i}?")
        assert cached >= 16 * PREFIX_BLOCKS, (round_, i, cached)


def assert_served_throughout(load: SteadyLoad, fault: float) -> None:
    during = load.since(fault)
    assert len(during) >= SERVED_AFTER_FAULT, f"too few steady requests ended after the fault: {len(during)}"
    assert not failures(load.outcomes), failures(load.outcomes)[:5]
    bad = [(t, s) for t, s in load.health if s != 200]
    assert not bad, f"/health was not 200 at {len(bad)} of {len(load.health)} polls: {bad[:5]}"


def assert_clean_afterwards(stack: Stack) -> None:
    stack.cluster.wait_all_blocks_free(timeout=10)
    stack.complete("The capital of France is", max_tokens=4)


def run_for(load: SteadyLoad, seconds: float) -> None:
    """Keep the steady load going for `seconds` (the length of the fault)."""
    end = time.monotonic() + seconds
    wait_until(lambda: time.monotonic() >= end, seconds + 1, "the fault's duration", every=0.1)
    load.wait_for(1, timeout=REQUEST_TIMEOUT_S)


def test_redis_killed(warmed: Stack) -> None:
    stack = warmed
    with SteadyLoad(stack.url, stack.model) as load:
        load.wait_for(4)
        fault = time.monotonic()
        stack.redis.kill()
        run_for(load, 6.0)  # past the index's heartbeat TTL (3 s)
        stack.redis.start()  # back, empty
        back = time.monotonic()
        assert_recovered(stack, back)
        load.wait_for(4)
        load.wait_since(fault, SERVED_AFTER_FAULT)
    assert_served_throughout(load, fault)
    assert_hits(stack, "after kill")
    assert_clean_afterwards(stack)


def test_redis_paused_20s(warmed: Stack) -> None:
    stack = warmed
    with SteadyLoad(stack.url, stack.model) as load:
        load.wait_for(4)
        fault = time.monotonic()
        stack.redis.signal(signal.SIGSTOP)
        try:
            run_for(load, 20.0)
        finally:
            stack.redis.signal(signal.SIGCONT)  # back with its data, every heartbeat key expired
        back = time.monotonic()
        assert_recovered(stack, back)
        load.wait_for(4)
        load.wait_since(fault, SERVED_AFTER_FAULT)
    assert_served_throughout(load, fault)
    assert_hits(stack, "after pause")
    assert_clean_afterwards(stack)


def test_redis_restarted_empty(warmed: Stack) -> None:
    stack = warmed
    with SteadyLoad(stack.url, stack.model) as load:
        load.wait_for(4)
        fault = time.monotonic()
        stack.redis.stop()
        stack.redis.start()
        back = time.monotonic()
        assert_recovered(stack, back)
        run_for(load, 2.0)
        load.wait_since(fault, SERVED_AFTER_FAULT)
    assert_served_throughout(load, fault)
    assert_hits(stack, "after restart")
    assert_clean_afterwards(stack)
