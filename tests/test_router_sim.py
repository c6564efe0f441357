"""The shared-prefix workload and a small fleet simulation running the real index and policies."""

from __future__ import annotations

import dataclasses

import pytest

from router.sim.fleet import FleetConfig, SimResult, simulate
from router.sim.workload import Request, WorkloadConfig, generate

SMALL = WorkloadConfig(
    num_requests=2000,
    arrival_rate=60.0,
    num_system_prompts=32,
    system_tokens=(200, 800),
    user_tokens=(20, 200),
    reply_tokens=(20, 200),
    think_time_s=5.0,
    seed=1,
)
FLEET = FleetConfig(num_workers=4, cache_blocks=4096)


@pytest.fixture(scope="module")
def requests() -> list[Request]:
    return generate(SMALL)


@pytest.fixture(scope="module")
def prefix_aware(requests: list[Request]) -> SimResult:
    return simulate(requests, FLEET, "prefix_aware")


def test_workload_is_seeded_and_turns_extend_the_previous_prompt(requests: list[Request]) -> None:
    again = generate(SMALL)
    assert [(r.arrival, r.num_tokens, r.block_hashes) for r in again[:50]] == [
        (r.arrival, r.num_tokens, r.block_hashes) for r in requests[:50]
    ]
    assert all(a.arrival <= b.arrival for a, b in zip(requests, requests[1:]))
    last: dict[int, Request] = {}
    for r in requests:
        assert len(r.block_hashes) == r.num_tokens // SMALL.block_size
        prev = last.get(r.conversation)
        if prev is not None:
            assert r.turn == prev.turn + 1 and r.num_tokens > prev.num_tokens
            assert r.block_hashes[: prev.num_blocks] == prev.block_hashes
        last[r.conversation] = r
    first_turns = [r for r in requests if r.turn == 1]
    assert len(first_turns) < len(requests) / 2  # mostly follow-ups
    # Zipf popularity: many conversations start with the same system prompt, so share a first block.
    assert len({r.block_hashes[0] for r in first_turns}) < len(first_turns) / 3


def test_prefix_aware_beats_round_robin(requests: list[Request], prefix_aware: SimResult) -> None:
    rr = simulate(requests, FLEET, "round_robin")
    assert rr.oracle_hit_rate == prefix_aware.oracle_hit_rate
    assert prefix_aware.hit_rate >= 0.9 * prefix_aware.oracle_hit_rate
    assert prefix_aware.hit_rate >= rr.hit_rate + 0.15
    assert prefix_aware.p90_ttft_s * 2 < rr.p90_ttft_s
    assert prefix_aware.max_busy_share < 1.5
    assert prefix_aware.num_requests == rr.num_requests == 1600  # 20% warm-up left out


def test_lost_events_are_repaired_by_resync(requests: list[Request], prefix_aware: SimResult) -> None:
    lossy = simulate(requests, FleetConfig(num_workers=4, cache_blocks=4096, event_loss=0.05), "prefix_aware")
    assert lossy.resyncs > 20
    assert lossy.hit_rate == pytest.approx(prefix_aware.hit_rate, abs=0.02)


def test_the_redis_backed_router_in_the_loop_routes_exactly_as_in_memory(
    requests: list[Request], prefix_aware: SimResult
) -> None:
    """The Redis mirror applies what Redis applied, in Redis's order, and each write waits for it: on the
    simulated clock every decision, so every figure, equals the in-memory run's (lost batches included)."""
    from router.redis_mirror import RedisMirrorIndex
    from tests.chaos.tools import RedisServer

    server = RedisServer()
    server.start()
    made: list[RedisMirrorIndex] = []

    def redis_index(prefix: str):
        def make(ttl: float, clock) -> RedisMirrorIndex:
            made.append(
                RedisMirrorIndex(
                    server.url, prefix=prefix, heartbeat_ttl=ttl, redis_heartbeat_ttl=600, clock=clock
                )
            )
            return made[-1]

        return make

    def figures(r: SimResult) -> SimResult:
        return dataclasses.replace(r, decision_us=0.0, wall_s=0.0)

    try:
        red = simulate(requests, FLEET, "prefix_aware", redis_index("a:"))
        assert figures(red) == figures(prefix_aware)
        lossy_cfg = FleetConfig(num_workers=4, cache_blocks=4096, event_loss=0.05)
        lossy = simulate(requests, lossy_cfg, "prefix_aware", redis_index("b:"))
        assert lossy.resyncs > 20
        assert figures(lossy) == figures(simulate(requests, lossy_cfg, "prefix_aware"))
    finally:
        for index in made:
            index.close()
        server.stop()
